"""The interval of a released ratio (dporl.eval.ope_interval): its margin covers for every sampling variance, its
closed form is the brute-force test inversion, it covers at the nominal rate where plugging in the noisy variance
does not, and calibrated=True is decided as dporl.eval.ope_calibration documents."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dporl.eval import ope_calibration, ope_interval
from dporl.eval.ope_calibration import WIS_MEASURED, importance_caveat
from dporl.eval.ope_interval import acceptance_probability, ratio_interval, ratio_set, variance_margin
from dporl.eval.ope_release import SQRT2, gaussian_noise_multiplier
from dporl.eval.ope_scales import OPEScales

EPS10 = gaussian_noise_multiplier(10.0, 1e-5) * SQRT2  # s of one moment release at eps 10 (add/remove): about 0.71


@pytest.mark.parametrize("s", [0.1, EPS10, 5.0])
def test_the_margin_covers_for_every_sampling_variance_and_no_smaller_one_does(s):
    kappa = variance_margin(s, 0.95)
    assert acceptance_probability(kappa, s, 0.95).min() >= 0.95 - 1e-9
    # Without it (the noisy variance plugged in as if exact) the worst case falls short, most where s is small;
    # a slightly smaller margin falls short too (kappa is the smallest).
    assert acceptance_probability(0.0, s, 0.95).min() < 0.95 - (0.02 if s < 1 else 0.001)
    assert acceptance_probability(0.98 * kappa, s, 0.95).min() < 0.95
    # The probabilities themselves, at one point, by Monte Carlo over the moments' noise (u = 1.6, kappa = 0).
    rng = np.random.default_rng(0)
    u, xi, t = 1.6, rng.standard_normal(400_000), rng.standard_normal(400_000) * math.sqrt(2.6)
    direct = np.mean(t**2 <= 1.959964**2 * (1 + np.maximum(u + xi / s, 0)))
    assert direct == pytest.approx(float(acceptance_probability(0.0, s, 0.95, np.array([u]))[0]), abs=0.002)


def _released(A, B, S_aa, S_ab, S_bb, s):
    return dict(A=A, B=B, S_aa=S_aa, S_ab=S_ab, S_bb=S_bb, noise_std=s)


def _grid_hull(rel):
    grid = np.linspace(-1, 1, 400_001)
    z2 = 1.959963984540054**2  # 95%
    s, k = rel["noise_std"], variance_margin(rel["noise_std"], 0.95)
    q = rel["S_aa"] - 2 * grid * rel["S_ab"] + grid**2 * rel["S_bb"]
    noise = s * s * (1 + grid**2)
    ok = (rel["A"] - grid * rel["B"]) ** 2 <= z2 * (np.maximum(q + k * s * (1 + grid**2), 0) + noise)
    return (grid[ok].min(), grid[ok].max()) if ok.any() else None


def test_the_closed_form_set_is_the_brute_force_test_inversion():
    rng = np.random.default_rng(1)
    cases = [_released(14.5, 25.4, 1.4, 1.24, 1.39, EPS10),  # a digits release at eps 10
             _released(14.5, 25.4, 1.4, 1.24, 1.39, 5.3),  # the same sums at eps 1's noise
             _released(0.3, 0.8, -2.0, 0.1, -1.5, 1.0),  # a tiny denominator and negative noisy moments
             _released(-3.0, 5.0, 2.0, -2.0, 4.0, 0.2),
             _released(30.0, 10.0, -5.0, -5.0, -5.0, 0.1)]  # nothing in the range is accepted
    for _ in range(40):
        n = rng.uniform(1, 50)
        cases.append(_released(rng.normal(0, n), rng.uniform(0.1, n), rng.normal(n / 10, 2), rng.normal(0, 2),
                               rng.normal(n / 10, 2), rng.choice([0.05, 0.7, 5.0])))
    kinds = set()
    for rel in cases:
        closed, brute = ratio_set(rel, 0.95), _grid_hull(rel)
        if brute is None:
            assert closed is None
            kinds.add("empty")
            continue
        assert closed == pytest.approx(brute, abs=1e-5)
        kinds.add("range" if closed == (-1.0, 1.0) else "inner")
    assert kinds == {"empty", "range", "inner"}


def test_the_interval_contains_the_estimate_and_stays_in_the_range():
    scales = OPEScales.declare(value_range=(0.0, 1.0))
    value, low, high, notes = ratio_interval(_released(14.5, 25.4, 1.4, 1.24, 1.39, EPS10), scales, 0.95)
    assert 0 < low < value < high < 1 and value == pytest.approx(0.5 + 0.5 * 14.5 / 25.4) and notes == []
    value, low, high, notes = ratio_interval(_released(30.0, 10.0, -5.0, -5.0, -5.0, 0.1), scales, 0.95)
    assert (low, high) == (0.0, 1.0) and "reject every value" in notes[0]  # conservative: the whole range
    value, low, high, _ = ratio_interval(_released(1.0, -0.5, 1.0, 0.0, 1.0, 1.0), scales, 0.95)
    assert math.isnan(value) and (low, high) == (0.0, 1.0)  # no released denominator: no estimate


def _bandit_releases(reps, units, s, rng):
    """``reps`` releases of nothing-clipped WIS on ``units`` i.i.d. one-step units: uniform logging over 3 actions
    (propensity 1/3), target (0.7, 0.2, 0.1), Bernoulli rewards (0.8, 0.5, 0.2), value range [0, 1]; the unit clip
    C is chosen so that the sampling variance is 1.6 noise variances (where plugging in the noisy second moments
    covers least). Returns the releases [reps, 5] and the truth in centred units."""
    target, means = np.array([0.7, 0.2, 0.1]), np.array([0.8, 0.5, 0.2])
    rho = 2 * float(target @ means) - 1
    w = 3 * target
    per_unit = (w**2 * (means * (1 - rho) ** 2 + (1 - means) * (1 + rho) ** 2)).sum() / 3  # E[(x - rho y)^2] C^2
    clip = math.sqrt(units * per_unit / (1.6 * s * s * (1 + rho * rho)))
    assert clip >= SQRT2 * w.max()  # nothing is clipped
    actions = rng.integers(0, 3, (reps, units))
    g = rng.random((reps, units)) < means[actions]
    x, y = w[actions] * (2 * g - 1) / clip, w[actions] / clip
    sums = np.stack([x.sum(1), y.sum(1), (x * x).sum(1), SQRT2 * (x * y).sum(1), (y * y).sum(1)], 1)
    return sums + rng.normal(0, s, sums.shape), rho


def test_coverage_at_the_worst_sampling_variance_is_nominal_where_the_plug_in_was_not(monkeypatch):
    # 2000 releases (fixed seed) at eps 10's noise, the sampling variance where the plug-in interval covers least.
    reps = 2000
    released, rho = _bandit_releases(reps, 2000, EPS10, np.random.default_rng(5))
    scales = OPEScales.declare(value_range=(0.0, 1.0))
    truth = 0.5 + 0.5 * rho

    def coverage():
        hits = 0
        for A, B, aa, ab, bb in released:
            _, low, high, _ = ratio_interval(_released(A, B, aa, ab / SQRT2, bb, EPS10), scales, 0.95)
            hits += low <= truth <= high
        return hits / reps

    # A 95% interval's coverage over 2000 draws: binomial sd sqrt(0.95 0.05 / 2000) = 0.0049; three sds below.
    tolerance = 3 * math.sqrt(0.95 * 0.05 / reps)
    assert coverage() >= 0.95 - tolerance
    monkeypatch.setattr(ope_interval, "variance_margin", lambda s, c: 0.0)  # the noisy moments as if exact
    assert coverage() < 0.95 - tolerance  # the test has power: it fails the plug-in (about 0.92 here)


def test_calibrated_is_decided_as_documented():
    scales = OPEScales.declare(value_range=(0.0, 1.0), min_propensity=0.02, horizon=1, episodes_per_unit=1)
    maximum = scales.max_unit_norm("wis")
    # Nothing clipped, a target that declares itself stochastic: the suite measured it nominal, so no caveat.
    assert importance_caveat("wis", deterministic=False, clip=maximum, scales=scales, epsilon=10.0) is None
    # Anything else keeps its reason.
    assert "clipping may bias" in importance_caveat("wis", deterministic=False, clip=maximum / 2, scales=scales,
                                                     epsilon=10.0)
    assert "deterministic" in importance_caveat("wis", deterministic=True, clip=maximum, scales=scales, epsilon=1.0)
    assert "does not declare" in importance_caveat("wis", deterministic=None, clip=maximum, scales=scales,
                                                   epsilon=1.0)
    for kind in ("pdis", "dr"):
        assert importance_caveat(kind, deterministic=False, clip=maximum, scales=scales, epsilon=1.0)
    # The record behind the True: >= 1000 datasets per answered cell, each covering at least 95% as a point estimate.
    assert WIS_MEASURED and all(cells for cells in WIS_MEASURED.values())
    for cells in WIS_MEASURED.values():
        for covered, datasets in cells.values():
            assert datasets >= 1000 and covered / datasets >= 0.95
    assert "WIS_MEASURED" in ope_calibration.__doc__
