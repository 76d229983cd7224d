"""The statistics behind every audit: exact Clopper-Pearson bounds, held-out threshold selection, validity."""

import math

import numpy as np
import pytest
from scipy import stats

from dporl.audit import Experiment, clopper_pearson_lower, clopper_pearson_upper, epsilon_lower_bound, run_audit
from dporl.utils.validation import ValidationError


def test_clopper_pearson_matches_scipy_exact_interval_and_edge_cases():
    n, alpha = 200, 0.025
    for k in (1, 7, 100, 199):
        # A one-sided bound at level alpha is one end of the two-sided exact interval at level 1 - 2 alpha.
        ci = stats.binomtest(k, n).proportion_ci(confidence_level=1 - 2 * alpha, method="exact")
        assert clopper_pearson_lower(k, n, alpha) == pytest.approx(ci.low, rel=1e-9)
        assert clopper_pearson_upper(k, n, alpha) == pytest.approx(ci.high, rel=1e-9)
    # k = 0 and k = n have closed forms: P[X = 0] = (1 - p)^n = alpha, P[X = n] = p^n = alpha.
    assert clopper_pearson_lower(0, n, alpha) == 0.0
    assert clopper_pearson_upper(0, n, alpha) == pytest.approx(1 - alpha ** (1 / n))
    assert clopper_pearson_upper(n, n, alpha) == 1.0
    assert clopper_pearson_lower(n, n, alpha) == pytest.approx(alpha ** (1 / n))


def test_identical_mechanisms_give_no_evidence():
    rng = np.random.default_rng(0)
    result = epsilon_lower_bound(rng.normal(size=20_000), rng.normal(size=20_000), delta=1e-5)
    assert result.epsilon == 0.0


def test_perfectly_separated_outputs_hit_the_trial_count_limit():
    n = 10_000
    result = epsilon_lower_bound(np.ones(n), np.zeros(n), delta=0.0, confidence=0.95)
    # Held-out halves of 5000: lower bound alpha^(1/5000) on one side, 1 - alpha^(1/5000) on the other.
    alpha, half = 0.025, n // 2
    expected = math.log(alpha ** (1 / half) / (1 - alpha ** (1 / half)))
    assert result.epsilon == pytest.approx(expected, rel=1e-9)
    assert result.test.first in ("D", "D'")


def test_the_bound_is_valid_for_a_mechanism_with_known_epsilon():
    """Laplace(1) on a sensitivity-1 query is exactly 1-DP: bounds above 1 may occur in at most 5% of audits."""
    rng = np.random.default_rng(1)
    bounds = [
        epsilon_lower_bound(rng.laplace(1.0, 1.0, 4_000), rng.laplace(0.0, 1.0, 4_000), delta=0.0).epsilon
        for _ in range(40)
    ]
    # Confidence 95% per audit: P[Binomial(40, 0.05) > 6] < 0.01.
    assert sum(b > 1.0 for b in bounds) <= 6
    assert np.mean(bounds) > 0.5  # and the audit is not vacuous: it gets within a factor 2 of the truth


def test_run_audit_validates_the_score_function():
    bad = Experiment("bad", 1.0, 1e-5, "record", "none", "none", scores=lambda n, on_d, seed: np.zeros(n + 1))
    with pytest.raises(ValidationError, match="scores"):
        run_audit(bad, 100)
    with pytest.raises(ValidationError, match="trials"):
        run_audit(bad, 3)
    nan = Experiment("nan", 1.0, 1e-5, "record", "none", "none", scores=lambda n, on_d, seed: np.full(n, np.nan))
    with pytest.raises(ValidationError, match="NaN"):
        run_audit(nan, 100)
