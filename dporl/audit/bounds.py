"""Empirical lower bounds on epsilon from a distinguishing experiment (Jagielski et al. 2020; Nasr et al. 2021).

A mechanism M is (eps, delta)-DP only if, for every event S and both orders of the neighbours (D, D'),
``P[M(D) in S] <= e^eps P[M(D') in S] + delta``. So any S with a one-sided lower confidence bound ``lo`` on
``P[M(D) in S]`` and an upper bound ``hi`` on ``P[M(D') in S]`` certifies ``eps >= log((lo - delta) / hi)``.

The events here are threshold tests on a scalar statistic of each output: S = {score >= t} or {score < t},
with either neighbour in the role of D. Choosing the best of many (t, S, order) on the same trials and then
quoting its bound would be a multiple-comparisons error, so the trials are split: the test is *chosen* on the
first half and its bound *evaluated* on the second half only, where it is a single pre-registered test. The two
Clopper-Pearson bounds are one-sided at level (1 - confidence) / 2 each, so the quoted bound holds with
probability >= ``confidence`` (union bound).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np
from scipy import stats

from dporl.utils.validation import ValidationError, check_probability

# Candidate thresholds per selection (quantiles of the pooled selection scores): plenty for a smooth optimum.
_MAX_THRESHOLDS = 1024


def clopper_pearson_lower(successes: np.ndarray, trials: int, alpha: float) -> np.ndarray:
    """One-sided lower bound on a binomial proportion, exact: P[p < bound] <= alpha."""
    k = np.asarray(successes, dtype=np.float64)
    safe = np.maximum(k, 1.0)  # beta.ppf needs a > 0; k = 0 gives bound 0 below
    bound = stats.beta.ppf(alpha, safe, trials - safe + 1)
    return np.where(k > 0, bound, 0.0)


def clopper_pearson_upper(successes: np.ndarray, trials: int, alpha: float) -> np.ndarray:
    """One-sided upper bound on a binomial proportion, exact: P[p > bound] <= alpha."""
    k = np.asarray(successes, dtype=np.float64)
    safe = np.minimum(k, trials - 1.0)
    bound = stats.beta.ppf(1.0 - alpha, safe + 1, trials - safe)
    return np.where(k < trials, bound, 1.0)


@dataclass(frozen=True)
class ThresholdTest:
    """The event S = {score >= threshold} (``upper_tail``) or {score < threshold}; ``first`` plays D."""

    threshold: float
    upper_tail: bool
    first: str  # "D" or "D'": the neighbour whose probability of S is bounded from below

    def count(self, scores: np.ndarray) -> int:
        inside = scores >= self.threshold if self.upper_tail else scores < self.threshold
        return int(np.count_nonzero(inside))


def _event_counts(sorted_scores: np.ndarray, thresholds: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(count of scores >= t, count of scores < t) for every threshold, by binary search."""
    below = np.searchsorted(sorted_scores, thresholds, side="left")
    return len(sorted_scores) - below, below


def _bounds_for(counts_first, counts_second, n_first, n_second, delta, alpha):
    lo = clopper_pearson_lower(counts_first, n_first, alpha)
    hi = clopper_pearson_upper(counts_second, n_second, alpha)
    with np.errstate(divide="ignore", invalid="ignore"):
        eps = np.log(np.maximum(lo - delta, 0.0) / hi)
    return np.where(lo - delta > 0, eps, -np.inf)


def select_test(scores_d: np.ndarray, scores_dp: np.ndarray, delta: float, alpha: float) -> ThresholdTest:
    """The threshold test with the largest conservative bound on these trials (used on the selection half)."""
    pooled = np.concatenate([scores_d, scores_dp])
    finite = np.unique(pooled[np.isfinite(pooled)])
    if len(finite) > _MAX_THRESHOLDS:
        finite = np.unique(np.quantile(finite, np.linspace(0.0, 1.0, _MAX_THRESHOLDS)))
    # Thresholds at every observed value, plus +inf so S = {score < inf} separates -inf/finite outcomes too.
    thresholds = np.concatenate([finite, [np.inf]])
    d_sorted, dp_sorted = np.sort(scores_d), np.sort(scores_dp)
    d_up, d_down = _event_counts(d_sorted, thresholds)
    dp_up, dp_down = _event_counts(dp_sorted, thresholds)
    n_d, n_dp = len(scores_d), len(scores_dp)
    candidates = {
        (True, "D"): _bounds_for(d_up, dp_up, n_d, n_dp, delta, alpha),
        (True, "D'"): _bounds_for(dp_up, d_up, n_dp, n_d, delta, alpha),
        (False, "D"): _bounds_for(d_down, dp_down, n_d, n_dp, delta, alpha),
        (False, "D'"): _bounds_for(dp_down, d_down, n_dp, n_d, delta, alpha),
    }
    best, best_value = ThresholdTest(float(thresholds[0]), True, "D"), -np.inf
    for (upper_tail, first), values in candidates.items():
        i = int(np.argmax(values))
        if values[i] > best_value:
            best, best_value = ThresholdTest(float(thresholds[i]), upper_tail, first), float(values[i])
    return best


@dataclass(frozen=True)
class EpsilonLowerBound:
    """The certified bound and the test behind it (probabilities are the held-out half's)."""

    epsilon: float  # max(0, bound): eps >= this with probability >= confidence
    test: ThresholdTest
    confidence: float
    delta: float
    trials: int  # per neighbour, both halves
    first_rate_lower: float  # CP lower bound of P[first in S]
    second_rate_upper: float  # CP upper bound of P[other in S]

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def epsilon_lower_bound(
    scores_d: np.ndarray, scores_dp: np.ndarray, delta: float, confidence: float = 0.95
) -> EpsilonLowerBound:
    """Certified lower bound on eps at ``delta`` from per-trial scores on D and on D' (see the module docstring).

    Trials must be i.i.d. within each array; the first half of each selects the test, the second evaluates it.
    """
    scores_d = np.asarray(scores_d, dtype=np.float64).ravel()
    scores_dp = np.asarray(scores_dp, dtype=np.float64).ravel()
    check_probability("delta", delta, allow_one=False)
    confidence = check_probability("confidence", confidence, allow_zero=False, allow_one=False)
    if len(scores_d) < 4 or len(scores_dp) < 4:
        raise ValidationError("trials", f"need at least 4 trials per neighbour, got {len(scores_d)}, {len(scores_dp)}")
    if np.isnan(scores_d).any() or np.isnan(scores_dp).any():
        raise ValidationError("scores", "a mechanism produced NaN scores")
    alpha = (1.0 - confidence) / 2
    half_d, half_dp = len(scores_d) // 2, len(scores_dp) // 2
    test = select_test(scores_d[:half_d], scores_dp[:half_dp], delta, alpha)
    held_d, held_dp = scores_d[half_d:], scores_dp[half_dp:]
    first, second = (held_d, held_dp) if test.first == "D" else (held_dp, held_d)
    lo = float(clopper_pearson_lower(test.count(first), len(first), alpha))
    hi = float(clopper_pearson_upper(test.count(second), len(second), alpha))
    value = math.log((lo - delta) / hi) if lo > delta and hi > 0 else 0.0
    return EpsilonLowerBound(max(0.0, value), test, confidence, delta, min(len(scores_d), len(scores_dp)), lo, hi)
