"""Audit of the private OPE release (``dporl.eval.private_ope``) on two FIXED neighbouring logged datasets.

D: treatment-chain episodes of ``n_units`` clinicians plus one canary clinician whose episodes carry an extreme
importance weight and return (a propensity of 1e-6 on a rewarded step); D' = D without the canary's episodes. Both
go through the library's own per-episode terms, per-unit sums, ratio-preserving clip (``unit_pairs``) and moment
rows (``moment_rows``), exactly as ``dp_importance_sampling(kind="wis")`` computes them; each trial adds the
library's Gaussian noise (``NoiseSource``) at the calibrated std. The score is the released vector projected on the
difference of the two noiseless sums (the likelihood-ratio statistic for a Gaussian location shift). The claim is
the PLD epsilon of the calibrated ``PoissonGaussianEvent(sigma, 1)``.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from dporl.audit.experiment import Experiment
from dporl.privacy.accountants import analysis_name, epsilon_for
from dporl.privacy.events import PoissonGaussianEvent
from dporl.privacy.noise import NoiseSource
from dporl.utils.validation import check_positive


def private_ope_audit(
    epsilon: float = 1.0, delta: float = 1e-5, n_units: int = 30, unit_clip: float = 12.0, noise_factor: float = 1.0
) -> Experiment:
    from dporl.eval.ope_coverage import TreatmentChain, constant_policy
    from dporl.eval.private_ope import episode_terms, gaussian_noise_multiplier, moment_rows, unit_pairs

    chain = TreatmentChain()
    policy = constant_policy(0.8)
    dataset = chain.simulate(n_units + 1, 4, (0.2, 0.8), np.random.default_rng(0))  # public seed: fixed datasets
    canary = n_units  # the last unit: make its logged propensities tiny so its weights explode
    log_probs = dataset.behavior_log_probs.copy()
    per_row_unit = np.repeat(dataset.unit_ids, dataset.episode_lengths)
    log_probs[per_row_unit == canary] = math.log(1e-6)
    rewards = dataset.rewards.copy()
    rewards[per_row_unit == canary] = 1.0
    with_canary = dataset.replace(behavior_log_probs=log_probs, rewards=rewards)
    without = with_canary.subset(np.flatnonzero(with_canary.unit_ids != canary))

    def released_sum(data) -> torch.Tensor:
        terms = episode_terms(data, policy, chain.gamma)
        units = torch.from_numpy(data.unit_ids.copy())
        a = torch.zeros(n_units + 1, dtype=torch.float64).index_add_(0, units, terms["w"] * terms["G"])
        b = torch.zeros(n_units + 1, dtype=torch.float64).index_add_(0, units, terms["w"])
        return moment_rows(unit_pairs(a, b, 1.0, unit_clip)).sum(0)

    sum_d, sum_d_prime = released_sum(with_canary), released_sum(without)
    shift = sum_d - sum_d_prime
    direction = shift / shift.norm()
    sigma = gaussian_noise_multiplier(check_positive("epsilon", epsilon), delta)
    std = sigma * math.sqrt(2) * check_positive("noise_factor", noise_factor)

    def scores(n: int, on_d: bool, seed: int) -> np.ndarray:
        noise = NoiseSource(seed).gaussian((n, 5), std, dtype=torch.float64)
        released = (sum_d if on_d else sum_d_prime) + noise
        return ((released - sum_d_prime) @ direction).numpy()

    return Experiment(
        name="private_ope",
        claimed_epsilon=epsilon_for([(PoissonGaussianEvent(sigma, 1.0), 1)], delta, "pld"),
        delta=delta,
        privacy_unit="clinician (all rows sharing one unit id)",
        analysis=f"PoissonGaussianEvent({sigma:.4g}, sample_rate=1) by {analysis_name('pld')}; sensitivity sqrt 2",
        neighbours=f"{n_units + 1} clinicians vs the same without a canary clinician (propensities 1e-6, shift "
                   f"{float(shift.norm()):.3f} of the bound sqrt 2)",
        scores=scores,
        chunk_trials=200_000,
        settings={"epsilon": epsilon, "n_units": n_units, "unit_clip": unit_clip, "noise_factor": noise_factor},
    )
