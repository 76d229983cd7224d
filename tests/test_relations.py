"""Add/remove events analysed for replace-one neighbours: the conversion the OPE comparison reports at one relation."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import integrate, optimize, stats

from dporl.privacy.accountants import ADD_REMOVE, REPLACE_ONE, epsilon_for
from dporl.privacy.events import (
    ApproxDPEvent,
    LaplaceEvent,
    MixtureEvent,
    PoissonGaussianEvent,
    SampledWithoutReplacementGaussianEvent,
)
from dporl.privacy.relations import calibrate_for_relation, epsilon_for_relation, relation_of
from dporl.utils.validation import ValidationError

DELTA = 1e-5


def _gaussian_epsilon(mu: float, delta: float) -> float:
    """Exact epsilon of the Gaussian mechanism with sensitivity / noise = mu (Balle & Wang 2018)."""
    def excess(eps):
        return stats.norm.cdf(-eps / mu + mu / 2) - math.exp(eps) * stats.norm.cdf(-eps / mu - mu / 2) - delta
    return optimize.brentq(excess, 0.0, 100.0)


def _hockey_stick(q: float, sigma: float, epsilon: float) -> float:
    """delta(epsilon) of P = (1-q) N(0, s^2) + q N(-1, s^2) against Q = (1-q) N(0, s^2) + q N(1, s^2), by quadrature:
    the replace-one pair of one Poisson-subsampled Gaussian step, computed independently of dp_accounting."""
    def p(x):
        return (1 - q) * stats.norm.pdf(x, 0, sigma) + q * stats.norm.pdf(x, -1, sigma)

    def qq(x):
        return (1 - q) * stats.norm.pdf(x, 0, sigma) + q * stats.norm.pdf(x, 1, sigma)

    value, _ = integrate.quad(lambda x: max(0.0, p(x) - math.exp(epsilon) * qq(x)), -12 * sigma - 1, 12 * sigma + 1,
                              limit=400, points=[0.0])
    return value


def test_unsampled_gaussian_replace_one_is_twice_the_sensitivity():
    # q = 1: replacing a unit moves the clipped sum by up to 2 (norm 1 each way): the Gaussian with mu = 2 / sigma.
    # The PLD's pessimistic 1e-4 grid over 20 compositions overstates by < 20 * 1e-4 (+ float noise).
    sigma, steps = 4.0, 20
    exact = _gaussian_epsilon(2 * math.sqrt(steps) / sigma, DELTA)
    got = epsilon_for_relation([(PoissonGaussianEvent(sigma, 1.0), steps)], DELTA, REPLACE_ONE)
    assert exact - 1e-6 <= got <= exact + steps * 1e-4
    add_remove = epsilon_for([(PoissonGaussianEvent(sigma, 1.0), steps)], DELTA, "pld")
    assert got > 1.8 * add_remove  # not the add/remove figure


@pytest.mark.parametrize("q,sigma", [(0.01, 1.0), (0.1, 2.0), (0.001, 0.7)])
def test_one_poisson_step_matches_the_replace_one_pair_by_quadrature(q, sigma):
    # Independent check of the dominating pair: find epsilon with delta(epsilon) = target by quadrature, compare.
    target = 1e-4
    epsilon = epsilon_for_relation([(PoissonGaussianEvent(sigma, q), 1)], target, REPLACE_ONE)
    assert _hockey_stick(q, sigma, epsilon) <= target * 1.01  # sound: the reported epsilon achieves the delta
    assert _hockey_stick(q, sigma, max(0.0, epsilon - 2e-3)) > target  # and tight to a couple of grid steps


@pytest.mark.parametrize("q,sigma,steps", [(0.01, 2.0, 100), (0.001, 1.0, 1000), (1.0, 8.0, 5)])
def test_conversion_lies_between_add_remove_and_group_privacy(q, sigma, steps):
    # Replace-one costs more than add/remove, and at most what group privacy gives from the add/remove guarantee:
    # (eps, delta) add/remove => (2 eps, (1 + e^eps) delta) replace-one.
    event = PoissonGaussianEvent(sigma, q)
    add_remove = epsilon_for([(event, steps)], DELTA, "pld")
    replace_one = epsilon_for_relation([(event, steps)], DELTA, REPLACE_ONE)
    assert replace_one > add_remove
    group_delta = (1 + math.exp(add_remove)) * DELTA
    assert epsilon_for_relation([(event, steps)], group_delta, REPLACE_ONE) <= 2 * add_remove + 5e-3


def test_native_histories_pass_through_and_the_reverse_is_refused():
    swor = [(SampledWithoutReplacementGaussianEvent(2.0, 1, 100), 50)]
    assert relation_of(swor) == REPLACE_ONE
    assert epsilon_for_relation(swor, DELTA, REPLACE_ONE) == epsilon_for(swor, DELTA, "rdp")
    poisson = [(PoissonGaussianEvent(1.0, 0.01), 50)]
    assert epsilon_for_relation(poisson, DELTA, ADD_REMOVE, mechanism="pld") == epsilon_for(poisson, DELTA, "pld")
    with pytest.raises(ValidationError, match="implies nothing"):
        epsilon_for_relation(swor, DELTA, ADD_REMOVE)
    with pytest.raises(ValidationError, match="relation"):
        epsilon_for_relation(poisson, DELTA, "swap two units")
    with pytest.raises(ValidationError, match="mixes"):
        relation_of(swor + poisson)


def test_other_events_convert_by_sensitivity_and_group_privacy():
    # Laplace at twice the sensitivity: pure eps = 2 / b per release, so k releases cost <= 2k / b.
    b, k = 10.0, 5
    got = epsilon_for_relation([(LaplaceEvent(b), k)], DELTA, REPLACE_ONE)
    assert 2 / b < got <= 2 * k / b + k * 1e-4
    # An (eps, delta)-only event by group privacy: one (0.5, 1e-7) release is (1, (1 + e^0.5) 1e-7) replace-one.
    converted = epsilon_for_relation([(ApproxDPEvent(0.5, 1e-7), 1)], (1 + math.exp(0.5)) * 1e-7 + 1e-12, REPLACE_ONE)
    assert converted == pytest.approx(1.0, abs=2e-4)
    # The mixture step's branch is observable under either relation: a mixture costs less than its private step.
    inner = PoissonGaussianEvent(1.0, 0.05)
    mixed = epsilon_for_relation([(MixtureEvent(0.3, inner), 100)], DELTA, REPLACE_ONE)
    assert 0 < mixed < epsilon_for_relation([(inner, 100)], DELTA, REPLACE_ONE)


def test_huge_noise_is_never_free():
    got = epsilon_for_relation([(PoissonGaussianEvent(1e6, 0.01), 10)], DELTA, REPLACE_ONE)
    rho = 10 * 4 / (2 * 1e12)  # zCDP of 10 unsampled Gaussian steps at sensitivity 2
    assert 0 < got <= rho + 2 * math.sqrt(rho * math.log(1 / DELTA)) + 1e-15


def test_calibration_for_replace_one_is_the_smallest_fitting_sigma():
    q, steps = 1e-3, 2000

    def make(sigma):
        return PoissonGaussianEvent(sigma, q)

    sigma = calibrate_for_relation(0.1, DELTA, steps, make_event=make, relation=REPLACE_ONE)
    assert epsilon_for_relation([(make(sigma), steps)], DELTA, REPLACE_ONE) <= 0.1
    assert epsilon_for_relation([(make(sigma * 0.998), steps)], DELTA, REPLACE_ONE) > 0.1
    # More noise than the same budget for add/remove neighbours under the same (PLD) analysis.
    from dporl.privacy.calibration import calibrate_noise_multiplier

    assert sigma > calibrate_noise_multiplier(0.1, DELTA, steps, make_event=make, mechanism="pld")
    np.testing.assert_array_less(0, sigma)
