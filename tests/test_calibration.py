"""Calibration searches the accountant itself: exact integer step counts, sigmas that really fit."""

from __future__ import annotations

import pytest

from dporl.privacy.accountants import epsilon_for
from dporl.privacy.calibration import calibrate_noise_multiplier, max_steps
from dporl.privacy.events import ApproxDPEvent, MixtureEvent, PoissonGaussianEvent
from dporl.utils.validation import PrivacyBudgetError, ValidationError

DELTA = 1e-5


@pytest.mark.parametrize("mechanism", ["rdp", "pld"])
def test_max_steps_is_the_exact_largest_count(mechanism):
    event = MixtureEvent(0.5, PoissonGaussianEvent(1.0, 0.02))
    n = max_steps(event, 2.0, DELTA, mechanism=mechanism)
    assert n > 10
    assert epsilon_for([(event, n)], DELTA, mechanism) <= 2.0 < epsilon_for([(event, n + 1)], DELTA, mechanism)
    assert max_steps(event, 2.0, DELTA, mechanism=mechanism, limit=n // 2) == n // 2
    assert max_steps(event, 2.0, DELTA, mechanism=mechanism, limit=n + 100) == n


def test_max_steps_edge_cases():
    assert max_steps(PoissonGaussianEvent(0.5, 1.0), 0.5, DELTA) == 0  # not even one full-batch step fits
    # (0.3, 0)-DP releases: basic composition allows 3 within eps = 1; the PLD's tight composition of pure pairs
    # at delta = 1e-5 cannot beat that with so few (3 x 0.3 = 0.9 <= 1 < 1.2 = 4 x 0.3 is the basic answer).
    assert max_steps(ApproxDPEvent(0.3, 0.0), 1.0, DELTA, mechanism="pld") >= 3
    with pytest.raises(ValidationError, match="unbounded"):
        max_steps(MixtureEvent(0.0, PoissonGaussianEvent(1.0, 0.1)), 1.0, DELTA)
    assert max_steps(MixtureEvent(0.0, PoissonGaussianEvent(1.0, 0.1)), 1.0, DELTA, limit=7) == 7
    with pytest.raises(ValidationError, match="step cap"):
        max_steps(PoissonGaussianEvent(1e4, 1e-3), 10.0, DELTA)  # more than 10^9 steps fit
    with pytest.raises(ValidationError):
        max_steps(PoissonGaussianEvent(1.0, 0.1), -1.0, DELTA)


@pytest.mark.parametrize("mechanism", ["rdp", "pld"])
def test_calibrated_sigma_fits_and_is_smallest(mechanism):
    steps, target = 100, 3.0

    def make_event(sigma):
        return PoissonGaussianEvent(sigma, 0.05)

    sigma = calibrate_noise_multiplier(target, DELTA, steps, make_event=make_event, mechanism=mechanism)
    assert epsilon_for([(make_event(sigma), steps)], DELTA, mechanism) <= target
    # Bisection to a relative 1e-3: 0.2% less noise no longer fits.
    assert epsilon_for([(make_event(sigma * 0.998), steps)], DELTA, mechanism) > target


@pytest.mark.filterwarnings("ignore:Optimal order")  # Opacus' own grid tops out at 63; irrelevant at eps = 2
def test_calibration_agrees_with_opacus():
    from opacus.accountants.utils import get_noise_multiplier

    # Opacus bisects its own RDP accountant to epsilon_tolerance 0.01; the sigmas agree to 1%.
    ours = calibrate_noise_multiplier(
        2.0, DELTA, 1000, make_event=lambda s: PoissonGaussianEvent(s, 0.01), mechanism="rdp"
    )
    theirs = get_noise_multiplier(target_epsilon=2.0, target_delta=DELTA, sample_rate=0.01, steps=1000,
                                  accountant="rdp")
    assert ours == pytest.approx(theirs, rel=0.01)


def test_calibration_refusals():
    with pytest.raises(ValidationError, match="no privacy"):
        calibrate_noise_multiplier(1.0, DELTA, 10, make_event=lambda s: None)
    with pytest.raises(PrivacyBudgetError):
        # An (eps, delta) part that does not depend on sigma can make the budget impossible.
        calibrate_noise_multiplier(1.0, DELTA, 10, make_event=lambda s: ApproxDPEvent(1.0, 0.0), mechanism="pld")
    with pytest.raises(ValidationError):
        calibrate_noise_multiplier(1.0, DELTA, 0, make_event=lambda s: PoissonGaussianEvent(s, 0.1))
