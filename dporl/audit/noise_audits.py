"""Audits of the noise primitives: Gaussian and Laplace from ``NoiseSource``, and the exact discrete samplers.

Each releases ``q(D) + noise`` for a scalar query with sensitivity 1 (q(D) = 1, q(D') = 0: the worst case of any
sensitivity-1 query). The test statistic is the released value itself, the likelihood-ratio-optimal statistic
for these location families. ``noise_factor < 1`` cuts the noise below what the claim assumes: the power check.
"""

from __future__ import annotations

import random

import numpy as np
import torch

from dporl.audit.experiment import Experiment
from dporl.privacy.accountants import analysis_name, epsilon_for
from dporl.privacy.events import LaplaceEvent, PoissonGaussianEvent
from dporl.privacy.noise import NoiseSource
from dporl.privacy.secure_noise import discrete_gaussian_epsilon, sample_discrete_gaussian, sample_discrete_laplace
from dporl.utils.validation import check_positive

_NEIGHBOURS = "a sensitivity-1 scalar query: q(D) = 1, q(D') = 0"


def gaussian_audit(
    noise_multiplier: float = 1.0, delta: float = 1e-5, noise_factor: float = 1.0, accountant: str = "pld"
) -> Experiment:
    sigma = check_positive("noise_multiplier", noise_multiplier)
    std = sigma * check_positive("noise_factor", noise_factor)

    def scores(n: int, on_d: bool, seed: int) -> np.ndarray:
        noise = NoiseSource(seed).gaussian(n, std, dtype=torch.float64).numpy()
        return noise + (1.0 if on_d else 0.0)

    return Experiment(
        name="gaussian",
        claimed_epsilon=epsilon_for([(PoissonGaussianEvent(sigma), 1)], delta, accountant),
        delta=delta,
        privacy_unit="record",
        analysis=f"PoissonGaussianEvent({sigma:g}, sample_rate=1) by {analysis_name(accountant)}",
        neighbours=_NEIGHBOURS,
        scores=scores,
        chunk_trials=200_000,
        settings={"noise_multiplier": sigma, "noise_factor": noise_factor},
    )


def laplace_audit(
    noise_multiplier: float = 1.0, delta: float = 1e-6, noise_factor: float = 1.0, accountant: str = "pld"
) -> Experiment:
    scale = check_positive("noise_multiplier", noise_multiplier)
    used = scale * check_positive("noise_factor", noise_factor)

    def scores(n: int, on_d: bool, seed: int) -> np.ndarray:
        return NoiseSource(seed).laplace(n, used).numpy() + (1.0 if on_d else 0.0)

    return Experiment(
        name="laplace",
        claimed_epsilon=epsilon_for([(LaplaceEvent(scale), 1)], delta, accountant),
        delta=delta,
        privacy_unit="record",
        analysis=f"LaplaceEvent({scale:g}) by {analysis_name(accountant)}",
        neighbours=_NEIGHBOURS,
        scores=scores,
        chunk_trials=200_000,
        settings={"noise_multiplier": scale, "noise_factor": noise_factor},
    )


def _integer_scores(sampler, parameter, n: int, on_d: bool, seed: int) -> np.ndarray:
    # A seeded generator so that CI is reproducible; the distribution is the same as from the OS CSPRNG.
    rng = random.Random(seed)
    return np.array([sampler(parameter, rng) for _ in range(n)], dtype=np.float64) + (1.0 if on_d else 0.0)


def secure_laplace_audit(scale: float = 1.0, delta: float = 1e-6, noise_factor: float = 1.0) -> Experiment:
    scale = check_positive("scale", scale)
    used = scale * check_positive("noise_factor", noise_factor)
    return Experiment(
        name="secure_laplace",
        claimed_epsilon=1.0 / scale,
        delta=delta,
        privacy_unit="record",
        analysis="discrete Laplace DLap(t) on an integer query of sensitivity 1 is (1/t)-DP exactly",
        neighbours=_NEIGHBOURS,
        scores=lambda n, on_d, seed: _integer_scores(sample_discrete_laplace, used, n, on_d, seed),
        chunk_trials=10_000,
        settings={"scale": scale, "noise_factor": noise_factor},
    )


def secure_gaussian_audit(sigma: float = 1.0, delta: float = 1e-5, noise_factor: float = 1.0) -> Experiment:
    sigma = check_positive("sigma", sigma)
    used = sigma * check_positive("noise_factor", noise_factor)
    return Experiment(
        name="secure_gaussian",
        claimed_epsilon=discrete_gaussian_epsilon(delta, sigma),
        delta=delta,
        privacy_unit="record",
        analysis="discrete Gaussian, exact privacy profile (Canonne-Kamath-Steinke 2020, Theorem 7)",
        neighbours=_NEIGHBOURS,
        scores=lambda n, on_d, seed: _integer_scores(sample_discrete_gaussian, used, n, on_d, seed),
        chunk_trials=10_000,
        settings={"sigma": sigma, "noise_factor": noise_factor},
    )
