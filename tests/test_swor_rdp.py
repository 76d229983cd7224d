"""Sampling without replacement (GPOPE's paper mode): the RDP bound at every order, checked against dp_accounting."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dporl.privacy.accountants import RDP_ORDERS, epsilon_for, swor_gaussian_rdp
from dporl.privacy.calibration import calibrate_noise_multiplier, max_steps
from dporl.privacy.events import PoissonGaussianEvent, SampledWithoutReplacementGaussianEvent

# Orders where dp_accounting's O(a^2) evaluation is cheap, the fractional interpolation, both sides of the exact /
# Stirling split at 256, and the large orders small epsilons need.
CHECKED_ORDERS = [1.5, 2.0, 3.0, 4.75, 10.5, 33.0, 88.0, 150.0, 256.0, 320.0, 512.0, 1024.0]


def _dp_accounting_rdp(q_inverse: int, sigma: float, orders) -> np.ndarray:
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    accountant = RdpAccountant(orders=list(orders), neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
    accountant.compose(
        dp_accounting.SampledWithoutReplacementDpEvent(q_inverse, 1, dp_accounting.GaussianDpEvent(sigma))
    )
    return np.asarray(accountant.rdp)


@pytest.mark.parametrize("population,sigma", [(10, 1.0), (100, 2.0), (1000, 2.5), (10_000, 0.8), (1000, 6.0)])
def test_swor_curve_equals_dp_accounting_at_every_kind_of_order(population, sigma):
    # Same bound (Theorem 27 of Wang, Balle, Kasiviswanathan 2019), same float operations in vectorised form:
    # agreement to rounding (the forward-error guard adds < 1e-9 relative where float64 resolves the differences).
    where = np.searchsorted(RDP_ORDERS, CHECKED_ORDERS)
    assert np.array_equal(RDP_ORDERS[where], CHECKED_ORDERS)
    ours = swor_gaussian_rdp(1 / population, sigma)[where]
    np.testing.assert_allclose(ours, _dp_accounting_rdp(population, sigma, CHECKED_ORDERS), rtol=1e-9)


def test_swor_curve_is_an_upper_bound_where_float64_cancels():
    # At sigma = 30 the forward differences of exp(K) cancel in float64 beyond the 10th (dp_accounting's values are
    # rounding noise there, some below the exact ones). Against the differences in 300-digit arithmetic, the curve
    # must never be lower; at the sample rates GPOPE uses (1/m) those terms are negligible and it is within 1e-9.
    import mpmath

    from dporl.privacy import rdp

    sigma, n = 30.0, 60
    mpmath.mp.dps = 300
    values = [mpmath.mpf(1)] + [mpmath.e ** (mpmath.mpf(x) * (x + 1) / (2 * mpmath.mpf(sigma) ** 2)) for x in range(n)]
    exact = []
    for _ in range(n):  # the first difference is exactly 0 (g_0 = g_1 = 1)
        values = [b - a for a, b in zip(values, values[1:])]
        exact.append(float(mpmath.log(abs(values[0]))) if values[0] != 0 else -math.inf)
    bounded = rdp._swor_log_differences(sigma)[:n]
    assert np.all(bounded >= np.array(exact) - 1e-9)
    excess = bounded - np.array(exact)
    assert np.all(excess[1:4] < 1e-7)  # resolved by float64: the guard adds only the rounding bound
    assert np.all(excess[12:] > 1.0)  # rounding noise: the guard dominates
    # Upper bound of the exact Theorem-27 curve at q = 0.1 (where high orders keep the noisy terms), exact at 1e-3.
    exact_differences = np.concatenate([exact, rdp._swor_log_differences(sigma)[n:]])
    saved = rdp._swor_log_differences
    try:
        rdp._swor_log_differences = lambda s: exact_differences
        rdp.swor_gaussian_rdp.cache_clear()
        reference = {q: swor_gaussian_rdp(q, sigma) for q in (0.1, 1e-3)}
    finally:
        rdp._swor_log_differences = saved
        rdp.swor_gaussian_rdp.cache_clear()
    assert np.all(swor_gaussian_rdp(0.1, sigma) >= reference[0.1] * (1 - 1e-12))
    np.testing.assert_allclose(swor_gaussian_rdp(1e-3, sigma), reference[1e-3], rtol=1e-9)


def test_paper_mode_calibration_matches_dp_accountings_own():
    # GPOPE's paper mode at the chain's setting: m = 1000 trajectories, one per update, N = m updates, (0.1, 1e-5).
    # The engine adds sigma * h of noise to a sum whose replace-one sensitivity is 2h, so the event's multiplier is
    # sigma / 2. dp_accounting calibrates the same event on its default orders plus every 4th order to 128 (the
    # optimum sits near 88; its default grid jumps from 63 to 128 and would calibrate 17% higher).
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant
    from dp_accounting.rdp.rdp_privacy_accountant import DEFAULT_RDP_ORDERS

    m, steps, epsilon, delta = 1000, 1000, 0.1, 1e-5
    sigma = calibrate_noise_multiplier(
        epsilon, delta, steps, make_event=lambda s: SampledWithoutReplacementGaussianEvent(s / 2, 1, m)
    )
    orders = sorted(set(DEFAULT_RDP_ORDERS) | set(range(64, 129, 4)))
    reference = dp_accounting.calibrate_dp_mechanism(
        lambda: RdpAccountant(orders=orders, neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE),
        lambda s: dp_accounting.SelfComposedDpEvent(
            dp_accounting.SampledWithoutReplacementDpEvent(m, 1, dp_accounting.GaussianDpEvent(s)), steps
        ),
        epsilon, delta,
        bracket_interval=dp_accounting.ExplicitBracketInterval(0.4 * sigma, 0.6 * sigma), tol=1e-4,
    )
    assert sigma / 2 == pytest.approx(reference, rel=0.05)
    assert sigma / 2 <= reference * (1 + 1e-3)  # a denser order grid can only lower the noise
    # The fix itself: the issue measured sigma = 3043 h (the unamplified fallback); amplification gives ~5 h.
    assert sigma < 6.0


def test_small_spends_are_positive_and_grow_with_steps():
    # One Poisson step at q = 1e-5 has RDP below delta^2 at the smallest order, where dp_accounting's conversion
    # answers exactly 0. epsilon_for used to replace that by the unamplified closed form (3.0 for one step against
    # 0.099 for ten), so max_steps saw "not even one step fits" for a sigma calibrated for 5000 steps.
    event = PoissonGaussianEvent(1.7, 1e-5)  # just above the 1.68 calibrated for 5000 steps at (0.1, 1e-5)
    eps = [epsilon_for([(event, n)], 1e-5, "rdp") for n in (1, 2, 10, 100, 5000)]
    assert all(e > 0 for e in eps) and eps == sorted(eps)
    assert eps[-1] <= 0.1
    assert max_steps(event, 0.1, 1e-5, limit=5000) == 5000


def test_swor_cost_is_that_of_one_vectorised_pass():
    # Not a timing test: the curve for a new sigma comes from one cached pass of differences per sigma, shared by
    # every sample rate (the calibration of several population sizes at one sigma reuses it).
    from dporl.privacy import rdp

    rdp._swor_log_differences.cache_clear()
    for population in (100, 1000, 10_000):
        swor_gaussian_rdp(1 / population, 3.21)
    info = rdp._swor_log_differences.cache_info()
    assert info.misses == 1 and info.hits == 2
    assert math.isfinite(swor_gaussian_rdp(1e-3, 3.21)[-1])
