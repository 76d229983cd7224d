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


def _reference_max_steps(event, epsilon, mechanism, cap=10**7):
    """The exact answer by plain doubling and bisection over the accountant (main's search), for comparison."""
    def fits(n):
        return epsilon_for([(event, n)], DELTA, mechanism) <= epsilon * (1 + 1e-12)

    if not fits(1):
        return 0
    good, bad = 1, 2
    while fits(bad):
        good, bad = bad, 2 * bad
        assert bad < cap
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return good


GRID = [  # (event, epsilon): Poisson steps at several rates/noises, Algorithm 3's mixture, answers 1 to ~10^4
    (PoissonGaussianEvent(1.0, 0.01), 1.0),
    (PoissonGaussianEvent(0.8, 0.05), 2.0),
    (PoissonGaussianEvent(2.0, 0.1), 0.5),
    (PoissonGaussianEvent(0.6, 0.256), 8.0),
    (PoissonGaussianEvent(5.0, 1.0), 1.0),
    (MixtureEvent(0.1, PoissonGaussianEvent(1.2, 0.2)), 3.0),
    (MixtureEvent(0.5, PoissonGaussianEvent(0.9, 0.02)), 1.5),
]


@pytest.mark.parametrize("mechanism", ["rdp", "pld"])
def test_max_steps_matches_the_exact_answer_on_a_grid_with_few_evaluations(mechanism, monkeypatch):
    calls = _counting(monkeypatch)
    grid = GRID if mechanism == "rdp" else GRID[::2]  # PLD evaluations cost more: every other point
    for event, epsilon in grid:
        calls.clear()
        n = max_steps(event, epsilon, DELTA, mechanism=mechanism)
        assert n == _reference_max_steps(event, epsilon, mechanism), (event, epsilon)
        # Verified to fit, and one more step does not (the reference's own criterion, evaluated directly).
        assert epsilon_for([(event, n)], DELTA, mechanism) <= epsilon < epsilon_for([(event, n + 1)], DELTA, mechanism)
        # The search interpolates from the RDP answer: far fewer evaluations than doubling + bisection (2 log2 n).
        assert len(calls) <= 8, (event, epsilon, n, len(calls))


def _counting(monkeypatch):
    import dporl.privacy.calibration as calibration

    calls = []

    def counting(events, delta, analysis):
        calls.append(analysis)
        return epsilon_for(events, delta, analysis)

    monkeypatch.setattr(calibration, "epsilon_for", counting)
    return calls


def test_max_steps_with_prv_is_prvs_exact_answer_from_few_prv_evaluations(monkeypatch):
    calls = _counting(monkeypatch)
    # Many steps (PRV the tighter analysis) and few (PRV the looser one): either way PRV's own exact answer.
    for event, epsilon in [(PoissonGaussianEvent(1.0, 1e-3), 0.4), (PoissonGaussianEvent(1.0, 0.01), 1.0)]:
        calls.clear()
        n = max_steps(event, epsilon, DELTA, mechanism="prv")
        assert epsilon_for([(event, n)], DELTA, "prv") <= epsilon < epsilon_for([(event, n + 1)], DELTA, "prv")
        assert n != max_steps(event, epsilon, DELTA, mechanism="pld")  # a different analysis, a different answer
        # The PRV search starts from PLD's answer: a handful of PRV evaluations (doubling + bisection: 2 log2 n).
        assert calls.count("prv") <= 6, calls
    with pytest.raises(ValidationError, match="PRV"):
        max_steps(MixtureEvent(0.5, event), 1.0, DELTA, mechanism="prv")


def test_calibrated_sigma_under_prv_is_prvs_smallest_from_few_prv_evaluations(monkeypatch):
    calls = _counting(monkeypatch)
    for rate, steps, target in [(1e-3, 5_000, 0.4), (0.02, 500, 2.0)]:
        calls.clear()
        sigma = calibrate_noise_multiplier(target, DELTA, steps, make_event=lambda s: PoissonGaussianEvent(s, rate),
                                           mechanism="prv")
        assert epsilon_for([(PoissonGaussianEvent(sigma, rate), steps)], DELTA, "prv") <= target
        assert epsilon_for([(PoissonGaussianEvent(sigma / 1.001, rate), steps)], DELTA, "prv") > target
        assert calls.count("prv") <= 6, calls


@pytest.mark.parametrize("mechanism", ["rdp", "pld"])
def test_sigma_search_uses_few_evaluations(mechanism, monkeypatch):
    calls = _counting(monkeypatch)
    for rate, steps, target in [(0.05, 100, 3.0), (0.01, 2000, 1.0), (0.256, 50, 8.0)]:
        calls.clear()
        sigma = calibrate_noise_multiplier(target, DELTA, steps, make_event=lambda s: PoissonGaussianEvent(s, rate),
                                           mechanism=mechanism)
        assert epsilon_for([(PoissonGaussianEvent(sigma, rate), steps)], DELTA, mechanism) <= target
        assert epsilon_for([(PoissonGaussianEvent(sigma / 1.001, rate), steps)], DELTA, mechanism) > target
        assert len(calls) <= 10, (rate, steps, len(calls))  # bracketing from sigma = 1 and bisecting took ~14
