"""The private-selection accountant (Papernot & Steinke 2022, Theorems 2 and 6; Liu & Talwar 2019) against the
papers' closed forms, an independent implementation (dp_accounting's RepeatAndSelectDpEvent), the exact output
distribution of a randomised-response search, and its own special cases."""

from __future__ import annotations

import math

import numpy as np
import pytest
from scipy import stats

from dporl.privacy.accountants import RDP_ORDERS, epsilon_for, rdp_curve
from dporl.privacy.events import (
    ApproxDPEvent,
    PoissonGaussianEvent,
    ReplaceOneEvent,
    SelectionEvent,
    event_from_dict,
    event_to_dict,
)
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.selection import (
    TrialCount,
    calibrate_trial_budget,
    expected_trials,
    negative_binomial_gamma,
    pure_dp_rdp,
    selection_epsilon,
    selection_rdp,
    trial_rdp,
)
from dporl.utils.validation import PrivacyBudgetError, ValidationError

GAUSSIAN = (((PoissonGaussianEvent(5.0, 1.0), 1),),)  # one Gaussian mechanism, sigma = 5: RDP a / 50


def _envelope(values: np.ndarray) -> np.ndarray:
    return np.minimum.accumulate(values[::-1])[::-1]


# ------------------------------------------------------------------------------------------------ closed forms
@pytest.mark.parametrize("eta, gamma", [(1.0, 0.1), (0.0, 0.05), (0.5, 0.2), (2.0, 0.3)])
def test_theorem2_gaussian_matches_the_closed_form(eta, gamma):
    """Theorem 2 for a Gaussian trial (eps(a) = a / (2 sigma^2)): minimising over lambda_hat in closed form,
    (lambda_hat - 1) / (2 sigma^2) + L / lambda_hat is smallest at lambda_hat = sigma sqrt(2 L), L = log(1 / gamma),
    where it equals sqrt(2 L) / sigma - 1 / (2 sigma^2); so
    eps'(a) = a / (2 sigma^2) + (1 + eta) (sqrt(2 L) / sigma - 1 / (2 sigma^2)) + log E[K] / (a - 1).
    The grid's lambda_hat can only do worse than the continuous optimum, by little (the grid is dense there)."""
    sigma = 5.0
    L = math.log(1 / gamma)
    assert 1.1 < sigma * math.sqrt(2 * L) < 1024  # the optimum lies inside the grid
    mean = expected_trials(eta, gamma)
    a = RDP_ORDERS
    closed = a / (2 * sigma**2) + (1 + eta) * (math.sqrt(2 * L) / sigma - 1 / (2 * sigma**2)) + math.log(mean) / (a - 1)
    event = SelectionEvent(GAUSSIAN, "negative_binomial", eta=eta, gamma=gamma)
    ours = selection_rdp(event)
    expected = _envelope(closed)
    assert np.all(ours >= expected - 1e-12)  # never below the paper's bound at its best lambda_hat
    assert np.allclose(ours, expected, rtol=2e-4, atol=1e-9)


def test_theorem2_at_a_given_lambda_hat_by_direct_formula():
    """The formula as the theorem writes it, at one lambda_hat of the grid: our value (the best lambda_hat) is at
    most that, for every lambda."""
    sigma, eta, gamma = 3.0, 1.0, 0.125
    curve = RDP_ORDERS / (2 * sigma**2)
    for lambda_hat in (2.0, 8.0, 32.0):
        eps_hat = lambda_hat / (2 * sigma**2)
        direct = (curve + (1 + eta) * (1 - 1 / lambda_hat) * eps_hat + (1 + eta) * math.log(1 / gamma) / lambda_hat
                  + math.log(expected_trials(eta, gamma)) / (RDP_ORDERS - 1))
        ours = selection_rdp(SelectionEvent((((PoissonGaussianEvent(sigma, 1.0), 1),),), "negative_binomial", eta,
                                            gamma))
        assert np.all(ours <= direct + 1e-12)


@pytest.mark.parametrize("mu", [1.0, 4.0, 10.0])
def test_theorem6_gaussian_against_the_exact_gaussian_delta(mu):
    """Theorem 6: eps'(a) = eps(a) + mu delta_hat + log(mu) / (a - 1) with delta_hat the trial's delta at
    eps_hat = log(1 + 1 / (a - 1)). The exact Gaussian delta (Balle & Wang 2018) is the smallest valid delta_hat, so
    the theorem's value with it is a lower limit for ours (which converts the Renyi curve), and ours stays close."""
    sigma = 5.0
    a = RDP_ORDERS
    eps_hat = np.log1p(1 / (a - 1))
    exact_delta = stats.norm.cdf(1 / (2 * sigma) - eps_hat * sigma) - np.exp(eps_hat) * stats.norm.cdf(
        -1 / (2 * sigma) - eps_hat * sigma)
    paper = a / (2 * sigma**2) + mu * exact_delta + math.log(mu) / (a - 1)
    ours = selection_rdp(SelectionEvent(GAUSSIAN, "poisson", mu=mu))
    assert np.all(ours >= _envelope(paper) - 1e-12)
    # and close: delta_hat from the trial's pessimistic PLD (grid 1e-3) is near the exact one
    assert float(np.max((ours - _envelope(paper))[RDP_ORDERS <= 256])) < 0.01 * mu


@pytest.mark.parametrize("distribution, mean, shape", [("negative_binomial", 8.0, 1.0), ("negative_binomial", 5.0, 0.5),
                                                        ("negative_binomial", 5.0, 0.0), ("poisson", 6.0, None)])
def test_matches_dp_accounting_repeat_and_select(distribution, mean, shape):
    """dp_accounting's RdpAccountant implements the same theorems independently (RepeatAndSelectDpEvent): the same
    curve for the negative binomials; for the Poisson ours takes delta_hat from the trial's PLD where that is smaller
    than the Renyi conversion dp_accounting uses, so it is at most dp_accounting's."""
    from dp_accounting import dp_event
    from dp_accounting.rdp import RdpAccountant

    trial = ((PoissonGaussianEvent(4.0, 0.05), 500),)
    accountant = RdpAccountant(orders=list(RDP_ORDERS))
    inner = dp_event.SelfComposedDpEvent(dp_event.PoissonSampledDpEvent(0.05, dp_event.GaussianDpEvent(4.0)), 500)
    accountant.compose(dp_event.RepeatAndSelectDpEvent(inner, mean, np.inf if shape is None else shape))
    count = TrialCount.with_mean(mean, distribution, 1.0 if shape is None else shape)
    ours = selection_rdp(count.event((trial,)))
    theirs = np.asarray(accountant._rdp)
    if distribution == "poisson":
        assert np.all(ours <= theirs + 1e-9) and np.any(ours < theirs - 1e-3)
    else:  # the trial curves agree to 1e-9 (the accountants' own tests); dp_accounting rounds gamma down by <= 1e-9
        assert np.allclose(ours, theirs, rtol=1e-6, atol=1e-9)


# ------------------------------------------------------------------------------------------------ special cases
def test_one_trial_is_the_trial_itself():
    """gamma = 1: K = 1 always, so the search is the trial: the same curve and the same guarantee."""
    trial = (((PoissonGaussianEvent(1.3, 0.02), 2000),),)
    event = SelectionEvent(trial, "negative_binomial", eta=1.0, gamma=1.0)
    assert np.array_equal(selection_rdp(event), trial_rdp(trial))
    geometric = TrialCount.with_mean(1.0, "negative_binomial", 1.0)
    assert geometric.gamma == 1.0 and geometric.sample(np.random.default_rng(0)) == 1
    assert selection_epsilon(event, 1e-5) == pytest.approx(epsilon_for([(PoissonGaussianEvent(1.3, 0.02), 2000)],
                                                                         1e-5, "rdp"), rel=1e-12)


def test_monotone_in_the_number_of_trials_the_trial_and_the_order():
    trial = (((PoissonGaussianEvent(2.0, 0.05), 1000),),)
    for distribution, eta in [("negative_binomial", 1.0), ("negative_binomial", 0.0), ("poisson", 1.0)]:
        eps = [selection_epsilon(TrialCount.with_mean(m, distribution, eta).event(trial), 1e-5) for m in (2, 4, 8, 16)]
        assert eps == sorted(eps) and eps[0] < eps[-1]
    by_sigma = [selection_epsilon(TrialCount.with_mean(6.0).event((((PoissonGaussianEvent(s, 0.05), 1000),),)), 1e-5)
                for s in (4.0, 2.0, 1.0)]
    assert by_sigma == sorted(by_sigma)
    by_eta = [selection_epsilon(SelectionEvent(trial, "negative_binomial", eta=e, gamma=0.1), 1e-5)
              for e in (0.0, 0.5, 1.0, 3.0)]  # fixed gamma: a larger eta means more trials and a larger factor
    assert by_eta == sorted(by_eta)
    curve = selection_rdp(TrialCount.with_mean(6.0).event(trial))
    assert np.all(np.diff(curve) >= 0)
    assert selection_epsilon(TrialCount.with_mean(6.0).event(trial), 1e-5) > epsilon_for(list(trial[0]), 1e-5, "rdp")


def test_parts_compose_in_parallel_and_events_within_a_part_add():
    a, b = (PoissonGaussianEvent(2.0, 0.1), 100), (PoissonGaussianEvent(3.0, 0.1), 100)
    assert np.allclose(trial_rdp(((a, b),)), 100 * (rdp_curve(a[0]) + rdp_curve(b[0])))
    assert np.allclose(trial_rdp(((a,), (b,))), np.maximum(100 * rdp_curve(a[0]), 100 * rdp_curve(b[0])))


def test_pure_events_have_randomised_response_curves():
    eps = 0.7
    curve = pure_dp_rdp(eps)
    p = math.exp(eps) / (1 + math.exp(eps))
    a = 3.0
    direct = math.log(p**a * (1 - p) ** (1 - a) + (1 - p) ** a * p ** (1 - a)) / (a - 1)
    assert curve[list(RDP_ORDERS).index(a)] == pytest.approx(direct, rel=1e-12)
    assert np.all(curve <= eps + 1e-15) and np.all(curve <= RDP_ORDERS * eps**2 / 2 + 1e-12)  # ε-DP => ε²/2-zCDP
    assert np.array_equal(trial_rdp((((ApproxDPEvent(eps, 0.0), 1),),)), curve)


# ------------------------------------------------------------------------------------------------ exact RR search
def _rr_search_outputs(count: TrialCount, zero_probability: float) -> np.ndarray:
    """Exact distribution of the released best bit of K randomised-response trials whose bit is 0 with
    ``zero_probability``: [P(nothing released), P(best = 0), P(best = 1)] from the probability generating function."""
    nothing = float(count.pmf(np.array([0]))[0])
    zero = float(count.pgf(np.array([zero_probability]))[0]) - nothing
    return np.array([nothing, zero, 1.0 - nothing - zero])


def _renyi(p: np.ndarray, q: np.ndarray, order: float) -> float:
    from scipy.special import logsumexp

    mask = p > 0
    return float(logsumexp(order * np.log(p[mask]) + (1 - order) * np.log(q[mask])) / (order - 1))


@pytest.mark.parametrize("count", [TrialCount.with_mean(10.0, "negative_binomial", 1.0),
                                   TrialCount.with_mean(10.0, "negative_binomial", 0.0),
                                   TrialCount.with_mean(6.0, "poisson"), TrialCount.with_mean(3.0, "negative_binomial", 2.0)])
def test_exact_randomised_response_search_stays_under_the_bound(count):
    """The exact Renyi divergence of a best-of-K randomised-response search (its whole output distribution, both
    directions) never exceeds the accountant's curve."""
    eps = 1.0
    p = math.exp(eps) / (1 + math.exp(eps))  # P[bit = 1] on D; 1 - p on D'
    on_d, on_dp = _rr_search_outputs(count, 1 - p), _rr_search_outputs(count, p)
    bound = selection_rdp(count.event((((ApproxDPEvent(eps, 0.0), 1),),)))
    exact = np.array([max(_renyi(on_d, on_dp, a), _renyi(on_dp, on_d, a)) for a in RDP_ORDERS])
    assert np.all(exact <= bound + 1e-12)
    assert np.max(exact) > eps  # the search leaks more than one trial: the check is not vacuous


def test_monte_carlo_randomised_response_search_matches_its_exact_distribution():
    """Sampling K (TrialCount.sample) and K randomised-response bits reproduces the exact output law used above."""
    rng = np.random.default_rng(2024)
    count = TrialCount.with_mean(6.0, "poisson")
    p_one = 0.3
    n = 100_000
    k = count.sample(rng, n)
    bits = rng.random(int(k.sum())) < p_one
    owner = np.repeat(np.arange(n), k)
    best = np.full(n, -1)  # -1: nothing released (K = 0)
    best[k > 0] = 0
    best[np.unique(owner[bits])] = 1
    observed = np.array([np.mean(best == -1), np.mean(best == 0), np.mean(best == 1)])
    exact = _rr_search_outputs(count, 1 - p_one)
    se = np.sqrt(exact * (1 - exact) / n)
    assert np.all(np.abs(observed - exact) <= 5 * se + 1e-12)


# ------------------------------------------------------------------------------------------------ distribution of K
@pytest.mark.parametrize("count", [TrialCount.with_mean(7.0, "negative_binomial", 1.0),
                                   TrialCount.with_mean(7.0, "negative_binomial", 0.0),
                                   TrialCount.with_mean(7.0, "negative_binomial", 0.5),
                                   TrialCount.with_mean(7.0, "poisson")])
def test_trial_count_pmf_mean_pgf_and_sampler_agree(count):
    k = np.arange(0, 2000)
    pmf = count.pmf(k)
    assert pmf.sum() == pytest.approx(1.0, abs=1e-9)
    assert (k * pmf).sum() == pytest.approx(count.mean, rel=1e-9) == pytest.approx(7.0, rel=1e-9)
    assert count.pgf(np.array([0.6]))[0] == pytest.approx((pmf * 0.6**k).sum(), rel=1e-9)
    draws = count.sample(np.random.default_rng(7), 200_000)
    assert draws.min() >= (0 if count.distribution == "poisson" else 1)
    sd = math.sqrt(((k - count.mean) ** 2 * pmf).sum())
    assert abs(draws.mean() - count.mean) <= 5 * sd / math.sqrt(len(draws))


def test_gamma_solves_the_mean():
    for eta in (0.0, 0.3, 1.0, 4.0):
        for mean in (1.5, 6.0, 100.0):
            assert expected_trials(eta, negative_binomial_gamma(mean, eta)) == pytest.approx(mean, rel=1e-9)
    with pytest.raises(ValidationError, match="trials.mean"):
        negative_binomial_gamma(0.5, 1.0)


# ------------------------------------------------------------------------------------------------ record, ledger
def test_event_round_trips_through_json_and_the_ledger():
    import json

    event = TrialCount.with_mean(5.0).event((((PoissonGaussianEvent(2.0, 0.1), 300), (ApproxDPEvent(0.1, 0.0), 1)),
                                             ((PoissonGaussianEvent(3.0, 0.05), 100),)))
    again = event_from_dict(json.loads(json.dumps(event_to_dict(event))))
    assert again == event and hash(again) == hash(event)
    small = TrialCount.with_mean(3.0).event((((PoissonGaussianEvent(8.0, 0.05), 500),),))
    budget = 1.5 * selection_epsilon(small, 1e-5)  # room for one search, not two
    ledger = PrivacyLedger((0.01 + budget, 1e-5))
    ledger.stage("count", budget=(0.01, 0.0), mechanism="pld")
    ledger.record("count", ApproxDPEvent(0.01, 0.0))
    ledger.stage("selection", budget=(budget, 1e-5), mechanism="rdp")
    ledger.record("selection", small)
    report = ledger.report()
    assert report.guarantee[0] == pytest.approx(0.01 + selection_epsilon(small, 1e-5), rel=1e-9)
    assert report.joint is None and "Renyi" in report.joint_note  # no PLD: basic composition with the count
    restored = PrivacyLedger((0.01 + budget, 1e-5))
    restored.load_state_dict(json.loads(json.dumps(ledger.state_dict())))
    assert restored.report().guarantee[0] == pytest.approx(report.guarantee[0], rel=1e-12)
    with pytest.raises(PrivacyBudgetError):  # a second search does not fit
        ledger.record("selection", small)


def test_events_without_a_renyi_curve_are_refused_by_name():
    with pytest.raises(ValidationError, match="no Renyi curve"):
        selection_rdp(TrialCount.with_mean(3.0).event((((ApproxDPEvent(1.0, 1e-6), 1),),)))
    with pytest.raises(ValidationError, match="replace-one"):
        selection_rdp(TrialCount.with_mean(3.0).event((((ReplaceOneEvent(PoissonGaussianEvent(2.0, 0.1)), 1),),)))
    with pytest.raises(ValidationError, match="Renyi curve"):
        epsilon_for([(TrialCount.with_mean(3.0).event(GAUSSIAN), 1)], 1e-5, "pld")
    with pytest.raises(ValidationError, match="selection.trial"):
        SelectionEvent((((TrialCount.with_mean(2.0).event(GAUSSIAN), 1),),))
    with pytest.raises(ValidationError, match="selection.gamma"):
        SelectionEvent(GAUSSIAN, gamma=0.0)
    with pytest.raises(ValidationError, match="event.trial"):
        event_from_dict({"type": "SelectionEvent", "trial": "not parts"})


# ------------------------------------------------------------------------------------------------ calibration
def test_calibration_finds_the_largest_trial_budget_that_fits():
    count = TrialCount.with_mean(6.0, "poisson")
    calls = []

    def selection_of(trial_epsilon: float) -> SelectionEvent:
        calls.append(trial_epsilon)
        sigma = math.sqrt(2.0) / trial_epsilon * 3  # any trial whose noise falls with its budget
        return count.event((((PoissonGaussianEvent(sigma, 0.1), 200),),))

    budget, event, spent = calibrate_trial_budget(selection_of, 1.0, 1e-5, upper=1.0, rtol=1e-3)
    assert spent <= 1.0 and spent == pytest.approx(selection_epsilon(event, 1e-5))
    assert selection_epsilon(selection_of(budget * 1.002), 1e-5) > 1.0  # tight to its precision
    assert len(calls) < 40
    with pytest.raises(PrivacyBudgetError, match="even trials"):
        calibrate_trial_budget(lambda e: count.event((((PoissonGaussianEvent(0.5, 1.0), 100),),)), 0.1, 1e-5,
                               upper=0.1)
