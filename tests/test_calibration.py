"""Calibration searches the accountant itself: exact integer step counts, sigmas that really fit."""

from __future__ import annotations

import math

import pytest

from dporl.privacy import accountants
from dporl.privacy.accountants import epsilon_for
from dporl.privacy.calibration import calibrate_noise_multiplier, max_steps
from dporl.privacy.events import ApproxDPEvent, LaplaceEvent, MixtureEvent, PoissonGaussianEvent
from dporl.privacy.pld import history_interval
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
    """The analyses a search evaluates, in order ("pld, coarse grid" for its first PLD pass)."""
    import dporl.privacy.calibration as calibration

    calls = []
    evaluate = calibration._evaluate

    def counting(events, delta, analysis):
        calls.append(analysis)
        return evaluate(events, delta, analysis)

    monkeypatch.setattr(calibration, "_evaluate", counting)
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


# ----------------------------------------------------------------------------- tightness against dp_accounting
def _referee_pld(history, interval):
    """dp_accounting's own pessimistic PLD of a history of Poisson Gaussian, mixture, Laplace and (eps, delta)
    events on ``interval``, built from its primitives only (``from_gaussian_mechanism``, ``compute_mixture``,
    ``from_laplace_mechanism``, ``from_privacy_parameters``), composed by its ``self_compose`` / ``compose``."""
    from dp_accounting.pld import common
    from dp_accounting.pld import privacy_loss_distribution as plds

    def single(event):
        if isinstance(event, MixtureEvent):
            return single(event.event).compute_mixture(plds.identity(interval), event.probability)
        if isinstance(event, PoissonGaussianEvent):
            return plds.from_gaussian_mechanism(event.noise_multiplier, sampling_prob=event.sample_rate,
                                                value_discretization_interval=interval)
        if isinstance(event, LaplaceEvent):
            return plds.from_laplace_mechanism(event.noise_multiplier, value_discretization_interval=interval)
        return plds.from_privacy_parameters(common.DifferentialPrivacyParameters(event.epsilon, event.delta),
                                            value_discretization_interval=interval)

    composed = None
    for event, count in history:
        part = single(event)
        if count > 1:  # dp_accounting's dense path directly (its sparse one computes size ** count exactly)
            part = plds.PrivacyLossDistribution(part._pmf_remove.to_dense_pmf().self_compose(count),
                                                part._pmf_add.to_dense_pmf().self_compose(count))
        composed = part if composed is None else composed.compose(part)
    return composed


def _referee_epsilon(history, delta, interval):
    return _referee_pld(history, interval).get_epsilon_for_delta(delta)


def _finer_than_both(history):
    """A grid nested in dporl's (half of it) and at most the referee's 1e-4."""
    return min(1e-4, history_interval([event for event, _ in history]) / 2)


def _assert_tight_sigma(sigma, target, delta, history_at):
    """``sigma`` fits the budget under dp_accounting on a grid finer than dporl's and the referee's (an upper
    bound), and 1% less noise does not fit under dp_accounting's 1e-4 grid: sigma <= 1.01 x the referee's
    smallest sigma (the referee's epsilon falls with sigma)."""
    assert _referee_epsilon(history_at(sigma), delta, _finer_than_both(history_at(sigma))) <= target
    assert _referee_epsilon(history_at(sigma / 1.01), delta, 1e-4) > target


def test_calibrated_sigma_at_long_runs_is_within_one_percent_of_the_fine_grid_and_fits():
    # The point: q = 1e-3, 1e5 steps, eps 1. A 1e-3 grid answers 1.530 (which really spends eps 0.855);
    # dp_accounting's 1e-4 grid needs 1.366.
    steps, rate = 100_000, 1e-3
    sigma = calibrate_noise_multiplier(1.0, DELTA, steps, make_event=lambda s: PoissonGaussianEvent(s, rate),
                                       mechanism="pld")
    assert 1.35 < sigma < 1.38
    _assert_tight_sigma(sigma, 1.0, DELTA, lambda s: [(PoissonGaussianEvent(s, rate), steps)])


@pytest.mark.parametrize("rate,steps,target,delta", [
    (1e-2, 20_000, 1.0, 1e-5), (0.1, 300, 10.0, 1e-5), (1e-3, 3_000, 0.5, 1e-7), (0.05, 50_000, 3.0, 1e-6),
])
def test_calibrated_sigma_is_an_upper_bound_and_tight_at_several_points(rate, steps, target, delta):
    sigma = calibrate_noise_multiplier(target, delta, steps, make_event=lambda s: PoissonGaussianEvent(s, rate),
                                       mechanism="pld")
    _assert_tight_sigma(sigma, target, delta, lambda s: [(PoissonGaussianEvent(s, rate), steps)])


def test_calibration_with_mixture_steps_and_a_shared_budget_prior_is_tight():
    # The quickstart's shape: 25 (eps', delta') release runs already spent, then Algorithm 3's mixture steps
    # calibrated so that one joint PLD over both fits the run's budget (PrivacyLedger.shared_budget's prior).
    release = [(ApproxDPEvent(0.2299972782053064, 1e-7), 25)]
    steps, target, delta = 2_000, 10.0, 1e-5

    def make(sigma):
        return MixtureEvent(0.1, PoissonGaussianEvent(sigma, 0.256))

    sigma = calibrate_noise_multiplier(target, delta, steps, make_event=make, mechanism="pld", prior=release)
    _assert_tight_sigma(sigma, target, delta, lambda s: release + [(make(s), steps)])
    # A Laplace release beside long Poisson steps at a small rate (a fine grid for the steps).
    prior = [(LaplaceEvent(4.0), 3)]
    sigma = calibrate_noise_multiplier(2.0, delta, 30_000, make_event=lambda s: PoissonGaussianEvent(s, 2e-3),
                                       mechanism="pld", prior=prior)
    _assert_tight_sigma(sigma, 2.0, delta, lambda s: prior + [(PoissonGaussianEvent(s, 2e-3), 30_000)])


def _assert_tight_steps(n, target, delta, history_at):
    """n steps fit under dp_accounting on a grid finer than dporl's and the referee's, and 1% more steps do not fit
    under dp_accounting's 1e-4 grid: n >= the referee's largest count / 1.01."""
    assert _referee_epsilon(history_at(n), delta, _finer_than_both(history_at(n))) <= target
    assert _referee_epsilon(history_at(math.ceil(n * 1.01)), delta, 1e-4) > target


def test_max_steps_at_long_runs_is_within_one_percent_of_the_fine_grid_and_fits():
    # The point: sigma 1, q = 1e-3, eps 6. A 1e-3 grid allows 900,414 steps; 991,688 fit on a 1e-4 grid.
    event = PoissonGaussianEvent(1.0, 1e-3)
    n = max_steps(event, 6.0, DELTA, mechanism="pld")
    assert 985_000 < n < 995_000
    _assert_tight_steps(n, 6.0, DELTA, lambda k: [(event, k)])
    # With a mixture step and a prior, at another delta.
    prior = [(ApproxDPEvent(0.05, 1e-8), 10)]
    mixture = MixtureEvent(0.5, PoissonGaussianEvent(2.0, 5e-3))
    n = max_steps(mixture, 1.5, 1e-6, mechanism="pld", prior=prior)
    assert n > 10_000
    _assert_tight_steps(n, 1.5, 1e-6, lambda k: prior + [(mixture, k)])


def test_long_run_calibrations_take_few_evaluations_on_bounded_grids(monkeypatch):
    """The cost of a calibration, without a clock: the real analysis runs a handful of times (the coarse grid finds
    the answer first), and no composed PLD exceeds a few hundred thousand points, from 1e2 to 1e6 steps."""
    import dporl.privacy.calibration as calibration
    from dporl.privacy import pld

    calls, sizes = [], []
    evaluate, compose = calibration._evaluate, pld.compose

    def counting(events, delta, analysis):
        calls.append(analysis)
        return evaluate(events, delta, analysis)

    def measuring(counts, *args, **kwargs):
        result = compose(counts, *args, **kwargs)
        sizes.append(max(result._pmf_remove.size, result._pmf_add.size))
        return result

    monkeypatch.setattr(calibration, "_evaluate", counting)
    monkeypatch.setattr(accountants, "compose", measuring)
    for rate, steps, target in [(1e-3, 100, 1.0), (1e-3, 100_000, 1.0), (1e-2, 1_000_000, 10.0),
                                (0.1, 1_000_000, 1.0)]:
        calls.clear()
        sigma = calibrate_noise_multiplier(target, DELTA, steps, make_event=lambda s: PoissonGaussianEvent(s, rate),
                                           mechanism="pld")
        assert calls.count("pld") <= 4 and len(calls) <= 12, (rate, steps, calls)
        calls.clear()
        max_steps(PoissonGaussianEvent(float(f"{sigma:.3g}"), rate), target, DELTA, mechanism="pld")
        assert calls.count("pld") <= 6 and len(calls) <= 12, (rate, steps, calls)
    assert max(sizes) < 1_000_000
