"""Accountants against independent analyses: Opacus RDP/PRV, dp_accounting's own PLD accountant, closed forms."""

from __future__ import annotations

import functools
import math
from collections import Counter

import numpy as np
import pytest

from dporl.privacy.accountants import (
    RDP_ORDERS,
    epsilon_for,
    make_accountant,
    paper_mixture_epsilon,
    rdp_curve,
)
from dporl.privacy.events import (
    ApproxDPEvent,
    LaplaceEvent,
    MixtureEvent,
    PoissonGaussianEvent,
    SampledWithoutReplacementGaussianEvent,
)
from dporl.privacy.pld import event_interval, gaussian_pld, history_interval
from dporl.utils.validation import ValidationError

DELTA = 1e-5
GRID = [(q, sigma, steps) for q in (0.01, 0.1) for sigma in (0.8, 1.5, 5.0) for steps in (1, 100, 1000)]


def _dp_accounting_pld(q: float, sigma: float, steps: int, discretization: float) -> float:
    import dp_accounting
    from dp_accounting.pld import PLDAccountant

    accountant = PLDAccountant(value_discretization_interval=discretization)
    event = dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma))
    accountant.compose(dp_accounting.SelfComposedDpEvent(event, steps))
    return accountant.get_epsilon(DELTA)


# Opacus' default orders stop at 63, too low for small epsilons: extend them like dporl's (its loops are slow
# at large integer orders, hence the gaps above 256).
OPACUS_ORDERS = [1 + x / 10.0 for x in range(1, 100)] + list(range(11, 257)) + [320, 384, 512, 768, 1024]


@functools.lru_cache(maxsize=None)
def _opacus_rdp_curve(q: float, sigma: float) -> np.ndarray:
    from opacus.accountants.analysis.rdp import compute_rdp

    return np.asarray(compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=OPACUS_ORDERS))


def _opacus_rdp(q: float, sigma: float, steps: int) -> float:
    from opacus.accountants.analysis.rdp import get_privacy_spent

    return float(get_privacy_spent(orders=OPACUS_ORDERS, rdp=steps * _opacus_rdp_curve(q, sigma), delta=DELTA)[0])


@pytest.mark.parametrize("q,sigma,steps", GRID)
def test_pld_backend_equals_dp_accountings_pld_accountant(q, sigma, steps):
    # On the event's own grid the event mapping (sampling, both adjacency directions) and the vectorised Gaussian
    # construction must give the library's own answer; 1e-6 relative covers float summation order only.
    event = PoissonGaussianEvent(sigma, q)
    ours = epsilon_for([(event, steps)], DELTA, "pld")
    assert ours == pytest.approx(_dp_accounting_pld(q, sigma, steps, event_interval(event)), rel=1e-6, abs=1e-9)


def test_vectorised_gaussian_pld_is_dp_accountings():
    """The vectorised construction is dp_accounting's ``from_gaussian_mechanism``: the same grid, the same masses
    (to floating-point rounding), both adjacency directions and replace-one."""
    from dp_accounting import NeighboringRelation
    from dp_accounting.pld import privacy_loss_distribution as plds

    for sigma, q, interval, replace_one in [
        (1.0, 1e-3, 1e-4, False), (0.7, 0.01, 1e-3, False), (2.38, 0.256, 1.25e-4, False), (3.0, 1.0, 1e-4, False),
        (500.0, 0.1, 1e-5, False), (0.5, 0.5, 2e-4, False), (1.2, 0.02, 1e-4, True), (4.0, 1.0, 1e-4, True),
    ]:
        relation = NeighboringRelation.REPLACE_ONE if replace_one else NeighboringRelation.ADD_OR_REMOVE_ONE
        theirs = plds.from_gaussian_mechanism(sigma, sampling_prob=q, value_discretization_interval=interval,
                                              neighboring_relation=relation)
        ours = gaussian_pld(sigma, q, interval, replace_one=replace_one)
        for side in ("_pmf_remove", "_pmf_add"):
            a, b = getattr(theirs, side).to_dense_pmf(), getattr(ours, side).to_dense_pmf()
            assert a._lower_loss == b._lower_loss and a._probs.shape == b._probs.shape
            # A mass is a difference of hockey-stick values over e^d - 1 ~ d: rounding 1e-16 becomes ~1e-16 / d.
            np.testing.assert_allclose(b._probs, a._probs, rtol=0, atol=1e-15 / interval)
            assert b._infinity_mass == pytest.approx(a._infinity_mass, rel=1e-9, abs=1e-15)
        for delta in (1e-3, 1e-5, 1e-9):
            assert ours.get_epsilon_for_delta(delta) == pytest.approx(theirs.get_epsilon_for_delta(delta), rel=1e-9)


@pytest.mark.parametrize("q,sigma,steps", [(0.1, 1.5, 100), (0.01, 5.0, 1000), (1e-3, 1.366, 100_000),
                                           (0.05, 0.9, 3000)])
def test_pld_grid_is_an_upper_bound_within_a_fraction_of_a_percent_of_a_finer_grid(q, sigma, steps):
    # dp_accounting on a grid 4 times finer (nested: every point of ours is one of its points): ours can only
    # over-state it, by < 0.2% (the grid is chosen so; a fixed 1e-3 grid over-states the third point by 13%).
    event = PoissonGaussianEvent(sigma, q)
    ours = epsilon_for([(event, steps)], DELTA, "pld")
    fine = _dp_accounting_pld(q, sigma, steps, event_interval(event) / 4)
    assert fine - 1e-9 <= ours <= fine * 1.002


def test_pld_epsilon_is_tighter_than_a_fixed_coarse_grid_at_long_runs():
    # The point: q = 1e-3, 1e5 steps. The 1e-3 grid reports 0.9995 at sigma 1.530 where the run spends
    # 0.854 (a 1e-4 grid); the event's grid reports within 0.2% of the 1e-4 grid, and never below a finer grid.
    event = PoissonGaussianEvent(1.53, 1e-3)
    ours = epsilon_for([(event, 100_000)], DELTA, "pld")
    assert ours < 0.857 < 0.99 < _dp_accounting_pld(1e-3, 1.53, 100_000, 1e-3)
    assert ours == pytest.approx(_dp_accounting_pld(1e-3, 1.53, 100_000, 1e-4), rel=2e-3)


def test_pld_grid_depends_on_the_events_not_their_counts():
    # Budget checks rely on epsilon growing with every count: the grid of a set of events is fixed.
    release, step = ApproxDPEvent(0.23, 1e-7), MixtureEvent(0.1, PoissonGaussianEvent(2.38, 0.256))
    grids = {history_interval([release, step])}
    values = []
    for n in (1, 10, 100, 1000, 2000, 2001):
        values.append(epsilon_for([(release, 25), (step, n)], 1e-5, "pld"))
        grids.add(history_interval(Counter({release: 25, step: n})))
    assert len(grids) == 1
    assert all(a < b for a, b in zip(values, values[1:]))
    # Finer noise, finer grid; the grids are nested (COARSEST / 2^j) and never finer than affordable.
    intervals = [event_interval(PoissonGaussianEvent(s, 1e-3)) for s in (0.5, 1.0, 2.0, 8.0, 64.0, 1e4)]
    assert all(a >= b for a, b in zip(intervals, intervals[1:]))
    assert all(math.log2(1e-3 / d) == round(math.log2(1e-3 / d)) for d in intervals)
    assert history_interval([PoissonGaussianEvent(1e4, 1e-3), PoissonGaussianEvent(0.3, 1e-3)]) > intervals[-1]


@pytest.mark.parametrize("q,sigma,steps", GRID)
def test_rdp_backend_agrees_with_opacus_rdp_accountant(q, sigma, steps):
    # Same RDP (Opacus' series at fractional orders; the exact binomial sum at integer ones, which Opacus also
    # evaluates) and the same Balle et al. 2020 conversion. The order grids differ (dporl's is coarser at fractional
    # orders above 4: up to 1% higher; Opacus' stops at 10.9 between integers: 0.1% lower allowed).
    ours = epsilon_for([(PoissonGaussianEvent(sigma, q), steps)], DELTA, "rdp")
    reference = _opacus_rdp(q, sigma, steps)
    assert reference * 0.999 <= ours <= reference * 1.01 + 1e-9


@pytest.mark.parametrize("q,sigma,steps", [(0.01, 0.8, 1000), (0.1, 1.5, 100), (0.1, 5.0, 1000)])
def test_prv_backend_is_opacus_prv_and_close_to_pld(q, sigma, steps):
    accountant = make_accountant("prv")
    for _ in range(steps):
        accountant.step(noise_multiplier=sigma, sample_rate=q)
    pld = epsilon_for([(PoissonGaussianEvent(sigma, q), steps)], DELTA, "pld")
    # PRV's upper bound carries eps_error = 0.01 on top of PLD-like discretisation: agree within 3% + 0.02.
    assert accountant.get_epsilon(DELTA) == pytest.approx(pld, rel=0.03, abs=0.02)
    assert len(accountant) == steps and len(accountant.history) == 1  # equal consecutive steps merge


def test_tight_backends_beat_rdp():
    event = PoissonGaussianEvent(1.0, 0.01)
    rdp = epsilon_for([(event, 1000)], DELTA, "rdp")
    assert epsilon_for([(event, 1000)], DELTA, "pld") < rdp


@pytest.mark.parametrize("mechanism", ["rdp", "pld"])
def test_mixture_limits(mechanism):
    inner = PoissonGaussianEvent(1.2, 0.05)
    plain = epsilon_for([(inner, 300)], DELTA, mechanism)
    assert epsilon_for([(MixtureEvent(1.0, inner), 300)], DELTA, mechanism) == pytest.approx(plain, rel=1e-9)
    assert epsilon_for([(MixtureEvent(0.0, inner), 300)], DELTA, mechanism) == 0.0
    mixed = epsilon_for([(MixtureEvent(0.3, inner), 300)], DELTA, mechanism)
    assert 0 < mixed < plain


@pytest.mark.parametrize("mechanism", ["rdp", "pld"])
def test_sound_mixture_epsilon_exceeds_the_papers_figure(mechanism):
    # The paper accounts a mixed step as rate p*q; the observable branch makes it a mixture, which costs more.
    p, q, sigma, steps = 0.2, 0.05, 1.0, 2000
    sound = epsilon_for([(MixtureEvent(p, PoissonGaussianEvent(sigma, q)), steps)], DELTA, mechanism)
    paper = paper_mixture_epsilon(p, q, sigma, steps, DELTA, mechanism)
    assert sound > 1.5 * paper


def test_rdp_mixture_formula_matches_the_spec():
    p, inner = 0.3, PoissonGaussianEvent(1.0, 0.1)
    r = rdp_curve(inner)
    moderate = (RDP_ORDERS - 1) * r < 500  # where the formula can be evaluated directly without overflow
    a = RDP_ORDERS[moderate]
    expected = np.log(1 - p + p * np.exp((a - 1) * r[moderate])) / (a - 1)
    np.testing.assert_allclose(rdp_curve(MixtureEvent(p, inner))[moderate], expected, rtol=1e-12)
    assert moderate.sum() > 50  # the comparison covers the orders that matter for epsilons below ~20


def test_laplace_pure_epsilon_and_rdp_closed_form():
    b = 2.0  # scale / L1 sensitivity: pure epsilon 1/b per release
    # PLD at a tiny delta: the pure epsilon, up to one 1e-3 grid step (pessimistic: never below 1/b - grid).
    assert epsilon_for([(LaplaceEvent(b), 1)], 1e-12, "pld") == pytest.approx(1 / b, abs=2e-3)
    # Mironov 2017, Table II: RDP of Laplace(b), sensitivity 1.
    a = RDP_ORDERS
    closed = np.log(a / (2 * a - 1) * np.exp((a - 1) / b) + (a - 1) / (2 * a - 1) * np.exp(-a / b)) / (a - 1)
    np.testing.assert_allclose(rdp_curve(LaplaceEvent(b)), closed, rtol=1e-9)
    assert epsilon_for([(LaplaceEvent(b), 10)], DELTA, "rdp") < 10 / b  # better than basic composition


@pytest.mark.parametrize("eps", [0.1, 0.0987654])
def test_approx_dp_composition_is_the_optimal_kairouz_oh_viswanath_one(eps):
    # k-fold composition of (eps, delta) pairs is exactly (k - 2i) eps-DP at
    # delta_i = 1 - (1 - delta)^k (1 - sum_{l<i} C(k,l)(e^{(k-l)eps} - e^{(k-2i+l)eps}) / (1 + e^eps)^k).
    # 0.0987654 is off the grid: rounding each loss up to the grid (dp_accounting's from_privacy_parameters) would
    # over-state these by up to k grid steps; connect-the-dots around the two losses loses < 0.1%.
    delta, k = 1e-7, 40
    for i in (8, 12):
        inner = sum(
            math.comb(k, l) * (math.exp((k - l) * eps) - math.exp((k - 2 * i + l) * eps)) for l in range(i)
        ) / (1 + math.exp(eps)) ** k
        delta_i = 1 - (1 - delta) ** k * (1 - inner)
        got = epsilon_for([(ApproxDPEvent(eps, delta), k)], delta_i, "pld")
        assert (k - 2 * i) * eps - 1e-9 <= got <= (k - 2 * i) * eps * 1.001


def test_sampling_without_replacement_rdp_and_refusals():
    full = SampledWithoutReplacementGaussianEvent(2.0, 10, 10)  # sample everyone: the plain Gaussian mechanism
    np.testing.assert_allclose(rdp_curve(full), RDP_ORDERS / (2 * 2.0**2), rtol=1e-12)
    event = SampledWithoutReplacementGaussianEvent(2.0, 1, 100)
    assert 0 < epsilon_for([(event, 100)], DELTA, "rdp") < epsilon_for([(full, 100)], DELTA, "rdp")
    for mechanism in ("pld", "prv"):
        with pytest.raises(ValidationError):
            epsilon_for([(event, 1)], DELTA, mechanism)
    with pytest.raises(ValidationError, match="neighbouring relation"):
        epsilon_for([(event, 1), (PoissonGaussianEvent(1.0, 0.1), 1)], DELTA, "rdp")


def test_refusals_name_the_way_out():
    with pytest.raises(ValidationError, match="pld"):
        make_accountant("rdp").record(ApproxDPEvent(1.0, 1e-6))
    with pytest.raises(ValidationError, match="pld"):
        make_accountant("prv").record(MixtureEvent(0.5, PoissonGaussianEvent(1.0, 0.1)))
    with pytest.raises(ValidationError):
        make_accountant("moments")
    with pytest.raises(ValidationError):
        make_accountant("rdp").record(PoissonGaussianEvent(1.0, 0.1), count=-1)


@pytest.mark.parametrize("mechanism", ["rdp", "pld"])
def test_state_dict_round_trip(mechanism):
    accountant = make_accountant(mechanism)
    accountant.record(LaplaceEvent(5.0), 3)
    for _ in range(20):
        accountant.step(noise_multiplier=1.1, sample_rate=0.02)
    accountant.record(MixtureEvent(0.4, PoissonGaussianEvent(1.1, 0.02)), 50)
    restored = make_accountant(mechanism)
    restored.load_state_dict(accountant.state_dict())
    assert restored.history == accountant.history and len(restored) == 73
    assert restored.get_epsilon(DELTA) == accountant.get_epsilon(DELTA)
    with pytest.raises(ValidationError):
        make_accountant("prv" if mechanism == "rdp" else "rdp").load_state_dict(accountant.state_dict())


@pytest.mark.parametrize("mechanism", ["rdp", "pld"])
def test_huge_noise_is_never_reported_as_free_and_stays_monotone(mechanism):
    """At sigma ~ 1e5 the numerical analyses underflow to 0; the closed-form zCDP bound must take over."""
    events = [PoissonGaussianEvent(s, 0.05) for s in (1e3, 1e4, 1e5, 1e6)]
    if mechanism == "rdp":
        events += [SampledWithoutReplacementGaussianEvent(s, 1, 20) for s in (1e3, 1e4, 1e5, 1e6)]
    for family in (events[:4], events[4:]):
        eps = [epsilon_for([(e, 20)], 1e-5, mechanism) for e in family]
        if not eps:
            continue
        assert all(e > 0 for e in eps)
        assert all(a >= b for a, b in zip(eps, eps[1:]))
        # zCDP of 20 unsampled Gaussian steps: rho = 20 / (2 sigma^2), eps = rho + 2 sqrt(rho ln(1/delta)).
        rho = 20 / (2 * family[-1].noise_multiplier ** 2)
        assert eps[-1] <= rho + 2 * math.sqrt(rho * math.log(1e5)) + 1e-15


# ------------------------------------------------------------------------------------------------ grid caps
@pytest.fixture
def small_composition_cap(monkeypatch):
    """A composed-PLD cap small enough for moderate counts to reach it (caches cleared on both sides: what is built
    under the small cap must not answer later tests)."""
    from dporl.privacy import pld

    pld.clear_caches()
    monkeypatch.setattr(pld, "MAX_COMPOSED_POINTS", 30_000)
    yield pld
    pld.clear_caches()


def _composed_grid(pld, event, count):
    composed = pld.compose({event: count})
    assert max(composed._pmf_remove.size, composed._pmf_add.size) <= pld.MAX_COMPOSED_POINTS
    return composed._pmf_remove._discretization


def test_compositions_beyond_the_point_cap_coarsen_and_stay_monotone_in_counts(small_composition_cap, monkeypatch):
    """A composition predicted above the cap is built on a grid 2, 4, ... times coarser (never beyond the cap);
    the grid only coarsens as the count grows, so epsilon stays non-decreasing in the count across the switches
    (what the ledger's headroom and max_steps rely on), and every answer stays an upper bound, here within 0.5% of
    the uncapped analysis on the event's own grid."""
    pld = small_composition_cap
    event = PoissonGaussianEvent(0.9, 0.05)
    counts = [1, 10, 100, 300, 1000, 3000, 10_000]
    grids = [_composed_grid(pld, event, n) for n in counts]
    values = [epsilon_for([(event, n)], DELTA, "pld") for n in counts]
    assert grids == sorted(grids) and grids[0] == pld.history_interval([event]) and grids[-1] >= 8 * grids[0]
    assert all(a < b for a, b in zip(values, values[1:]))
    low, high = 100, 300  # the first switch lies between these counts: find it and look at both sides
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if _composed_grid(pld, event, middle) == grids[0] else (low, middle)
    assert epsilon_for([(event, low)], DELTA, "pld") < epsilon_for([(event, high)], DELTA, "pld")
    capped = {n: epsilon_for([(event, n)], DELTA, "pld") for n in (high, 3000)}
    pld.clear_caches()
    monkeypatch.setattr(pld, "MAX_COMPOSED_POINTS", 2**22)
    for n, value in capped.items():
        uncapped = epsilon_for([(event, n)], DELTA, "pld")
        assert uncapped - 1e-9 <= value <= uncapped * 1.005


def test_a_composition_too_large_on_every_grid_is_the_closed_form_bound(small_composition_cap, monkeypatch):
    """Where no grid up to MAX_COARSENING fits, the closed-form bound answers (never the RDP bound: it can be below
    the PLD answer of a smaller count, and the switch depends on the count); it is at least every smaller count's
    answer. An event too wide to build is a property of the events and is answered by RDP at every count."""
    from dporl.privacy.accountants import _closed_form_epsilon

    pld = small_composition_cap
    monkeypatch.setattr(pld, "MAX_COARSENING", 1)
    event = PoissonGaussianEvent(0.9, 0.05)
    values = [epsilon_for([(event, n)], DELTA, "pld") for n in (10, 100, 300, 1000)]
    assert values[-1] == _closed_form_epsilon([(event, 1000)], DELTA)
    assert values[0] < _closed_form_epsilon([(event, 10)], DELTA)
    assert all(a < b for a, b in zip(values, values[1:]))
    # Losses wider than MAX_LOSS_RANGE (sigma 0.05: ~400 nats, a 9M-point composition at 60 steps on the 1e-3 grid;
    # sigma 0.01: ~2e7 points for one step): the RDP bound at every count, before any PMF is built.
    for tiny in (PoissonGaussianEvent(0.05, 0.25), PoissonGaussianEvent(0.01, 0.25)):
        assert pld._loss_range(tiny) > pld.MAX_LOSS_RANGE
        values = [epsilon_for([(tiny, n)], DELTA, "pld") for n in (1, 2, 60, 1000)]
        assert values == [epsilon_for([(tiny, n)], DELTA, "rdp") for n in (1, 2, 60, 1000)]
        assert values == sorted(values)
