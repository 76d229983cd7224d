"""Exact discrete samplers: their laws (goodness of fit against the exact pmf), their analysis, the grid source."""

import math
import random

import numpy as np
import pytest
import torch
from scipy import stats

from dporl.privacy.secure_noise import (
    SecureNoiseSource,
    bernoulli_exp,
    discrete_gaussian_delta,
    discrete_gaussian_epsilon,
    discrete_gaussian_pmf,
    sample_discrete_gaussian,
    sample_discrete_laplace,
)
from dporl.utils.validation import ValidationError

N = 10_000


@pytest.mark.parametrize("numerator,denominator", [(0, 1), (7, 10), (3, 2), (16, 5)])
def test_bernoulli_exp_has_the_exact_rate(numerator, denominator):
    rng = random.Random(1)
    p = math.exp(-numerator / denominator)
    freq = sum(bernoulli_exp(numerator, denominator, rng) for _ in range(N)) / N
    # Binomial standard error; 4.5 sigma makes a false failure (fixed seed aside) a ~1e-5 event.
    assert abs(freq - p) <= 4.5 * math.sqrt(p * (1 - p) / N) + 1e-12


def _goodness_of_fit(draws: np.ndarray, support: np.ndarray, pmf: np.ndarray) -> float:
    """Chi-square p-value, pooling the tails into two bins so every expected count is >= 5."""
    expected = pmf * len(draws)
    keep = expected >= 5
    low, high = support[keep].min(), support[keep].max()
    observed = [np.sum(draws < low)] + [np.sum(draws == v) for v in range(low, high + 1)] + [np.sum(draws > high)]
    exp_counts = [expected[support < low].sum()] + list(expected[(support >= low) & (support <= high)])
    exp_counts += [expected[support > high].sum()]
    observed, exp_counts = np.array(observed, float), np.array(exp_counts, float)
    mask = exp_counts > 0
    observed, exp_counts = observed[mask], exp_counts[mask]
    return float(stats.chisquare(observed, exp_counts * observed.sum() / exp_counts.sum()).pvalue)


@pytest.mark.parametrize("scale", [0.4, 2.5])
def test_discrete_laplace_matches_its_pmf(scale):
    rng = random.Random(2)
    draws = np.array([sample_discrete_laplace(scale, rng) for _ in range(N)])
    support = np.arange(-200, 201)
    pmf = np.exp(-np.abs(support) / scale)
    pmf /= pmf.sum()
    # Under the null the p-value is uniform: 1e-4 is a fixed-seed false alarm rate of 1e-4.
    assert _goodness_of_fit(draws, support, pmf) > 1e-4
    r = math.exp(-1 / scale)
    variance = 2 * r / (1 - r) ** 2  # the discrete Laplace's exact variance
    assert abs(draws.mean()) < 5 * math.sqrt(variance / N)


@pytest.mark.parametrize("sigma", [0.7, 3.0])
def test_discrete_gaussian_matches_its_pmf(sigma):
    rng = random.Random(3)
    draws = np.array([sample_discrete_gaussian(sigma, rng) for _ in range(N)])
    support, pmf = discrete_gaussian_pmf(sigma)
    assert _goodness_of_fit(draws, support, pmf) > 1e-4
    variance = float((support**2 * pmf).sum())
    # Sample variance of a near-normal law has standard error variance * sqrt(2 / N).
    assert abs(draws.var() - variance) < 5 * variance * math.sqrt(2 / N)


@pytest.mark.parametrize("sigma,sensitivity", [(0.8, 1), (2.0, 3), (6.0, 1)])
def test_discrete_gaussian_delta_is_the_hockey_stick_divergence(sigma, sensitivity):
    support, pmf = discrete_gaussian_pmf(sigma)
    shifted = np.roll(pmf, sensitivity)  # law of y + sensitivity on the same support (the far tail is ~0)
    for eps in (0.1, 0.5, 1.0):
        # delta(eps) = sum_y max(0, P[Y + D = y] - e^eps P[Y = y]), the definition, summed directly.
        direct = np.maximum(shifted - math.exp(eps) * pmf, 0.0).sum()
        assert discrete_gaussian_delta(eps, sigma, sensitivity) == pytest.approx(direct, rel=1e-9, abs=1e-15)


def test_discrete_gaussian_epsilon_inverts_delta():
    deltas = [discrete_gaussian_delta(e, 1.0) for e in np.linspace(0, 5, 11)]
    assert all(a > b for a, b in zip(deltas, deltas[1:]))
    eps = discrete_gaussian_epsilon(1e-5, 1.0)
    assert discrete_gaussian_delta(eps, 1.0) <= 1e-5 < discrete_gaussian_delta(eps * 0.99, 1.0)


def test_secure_source_emits_grid_noise_from_the_os_csprng():
    source = SecureNoiseSource(granularity=2.0**-4)
    a, b = source.gaussian((50,), 1.0), source.gaussian((50,), 1.0)
    assert a.dtype == torch.float32 and a.shape == (50,)
    assert torch.equal(a * 16, torch.round(a * 16))  # on the grid: no low-order bits
    assert not torch.equal(a, b)  # no seed: two draws differ (equal with probability ~1e-60)
    lap = source.laplace((2, 3), 0.5)
    assert lap.shape == (2, 3) and torch.equal(lap * 16, torch.round(lap * 16))
    value = torch.tensor([0.3, -1.26])
    assert torch.equal(source.snap(value), torch.tensor([0.3125, -1.25]))
    assert not source.state_dict()["reproducible"]


def test_secure_source_rejects_bad_settings():
    with pytest.raises(ValidationError, match="granularity"):
        SecureNoiseSource(granularity=0.1)
    with pytest.raises(ValidationError, match="noise.scale"):
        SecureNoiseSource().laplace(3, -1.0)
    with pytest.raises(ValidationError, match="noise"):
        SecureNoiseSource().load_state_dict({"generator": torch.zeros(3), "reproducible": True})
    with pytest.raises(ValidationError, match="sensitivity"):
        discrete_gaussian_delta(1.0, 1.0, sensitivity=0)


def test_secure_source_plugs_into_the_release_sites_that_take_a_noise_source():
    from dporl.privacy.output_perturbation import gaussian_output_perturbation

    source = SecureNoiseSource(granularity=2.0**-6, rng=random.Random(5))
    value = source.snap(torch.tensor([0.5, -1.25, 3.0], dtype=torch.float64))
    released = gaussian_output_perturbation(value, 2.0, source)
    assert torch.equal(released * 64, torch.round(released * 64))  # snapped value + grid noise stays on the grid
    assert not torch.equal(released, value)
