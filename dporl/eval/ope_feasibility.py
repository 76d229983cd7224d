"""Feasibility before spending: the noise of a private estimate, predicted from public (or released) facts only.

Before a private evaluation spends anything (anything but the unit count, whose released value it may use), it
predicts the standard deviation that privacy noise alone adds to the released value, from the public or released
number of units, the budget, the folds, the clips and the declared scales, and refuses by name when the interval
that noise alone implies would be wider than the tolerance (default: the whole value range), saying how many units
or how much epsilon would be needed. Nothing here reads the private data.

- Ratio estimators (DP-WIS / PDIS / DR, ``predict_ratio``): V = centre + half A / B with noise std s = sigma sqrt 2 per
  coordinate. A unit adds y_u <= min(1, b_u / C) to B, where b_u is its number of episodes (PDIS, DR) or its sum of
  importance weights (WIS), whose expectation is its number of episodes (E[w] = 1 under the behaviour policy); with
  the declared episodes_per_unit k, E[B] <= n min(1, k / C) (n: without k), and by Jensen the noise std of V,
  about half s / B, is at least half s / (n min(1, k / C)) on average: the refusal errs toward allowing.
- DP-FQE (``predict_fqe``): each fold's value release adds half sigma_v / B (B <= n_fold min(1, k / C)), and the
  DP-SGD noise in its averaged iterate adds about half kappa sigma_sgd / (q n_fold sqrt(T_avg)) (q the Poisson rate,
  T_avg the averaged steps; kappa, ``FQE_NOISE_GAIN``, stands for the step size, the TD fixed point's amplification
  and the features: the suite measured 3 to 26 on its problems at eps 1). This part is an estimate, not a bound: a
  DP-FQE refusal can err either way, and says so. The interval is Student-t over K folds: half-width
  t_{K-1} sd_fold / sqrt K.

Noise falls as 1 / n in both, so the units needed are n x (predicted width / tolerance); the epsilon needed is
the one whose noise multiplier is the current one x (tolerance / predicted width), by the same analysis. A released
count m~ is noisy: the prediction uses m~ itself (at least one unit), and a refusal states m~'s upper confidence
bound m~ + t (``count_upper``: P[m > m~ + t] <= 5%) beside it, so that a reader sees how much the count could hide.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from dporl.eval.ope_release import SQRT2, dpsgd_noise_multiplier, gaussian_noise_multiplier
from dporl.eval.ope_scales import OPEScales
from dporl.privacy.relations import ADD_REMOVE
from dporl.utils.validation import ValidationError, check_positive

# DP-FQE: a fold's value noise relative to the noise of its averaged DP-SGD gradient (module docstring); the
# benchmark suite (dporl.eval.ope_suite) measured 3 (digits, where the fit barely moves) to 26 (the treatment chain).
FQE_NOISE_GAIN = 10.0


class InfeasibleEvaluation(ValidationError):
    """The predicted noise of a private evaluation exceeds its tolerance: refused before anything is spent."""


@dataclass(frozen=True)
class Feasibility:
    estimator: str
    units: float  # the public or released number of units the estimate uses (all folds together for DP-FQE)
    epsilon: float
    noise_std: float  # predicted std of the released value from privacy noise alone
    half_width: float  # predicted half-width of the interval from that noise alone
    tolerance: float  # the widest acceptable interval
    epsilon_needed: Optional[float]  # None: no epsilon makes it fit at these units
    field: str = "eval.offline"
    units_high: Optional[float] = None  # the upper confidence bound of a released count (None: ``units`` is exact)
    units_label: str = "units"  # what the units are, in the refusal (e.g. "held-out units")

    @property
    def ok(self) -> bool:
        return 2 * self.half_width <= self.tolerance

    @property
    def units_needed(self) -> int:
        return int(math.ceil(max(self.units, 1.0) * 2 * self.half_width / self.tolerance))

    def describe(self) -> str:
        eps = ("" if self.epsilon_needed is None or not math.isfinite(self.epsilon_needed) else
               f", or epsilon about {self.epsilon_needed:.3g} (now {self.epsilon:g}) for these units")
        label = self.units_label
        units = (f"{self.units:.0f} {label}" if self.units_high is None else
                 f"about {self.units:.0f} {label} (a released count; at most {self.units_high:.0f} at 95%)")
        return (f"DP-{self.estimator.upper()} on {units} at epsilon {self.epsilon:g}: privacy noise alone "
                f"predicts a standard deviation of {self.noise_std:.3g} and an interval {2 * self.half_width:.3g} "
                f"wide, more than the tolerance {self.tolerance:.3g}; needs about {self.units_needed} {label}{eps}"
                + (" (DP-FQE's DP-SGD share is an estimate)" if self.estimator == "fqe" else ""))


def count_upper(count: float, epsilon: Optional[float], failure: float = 0.05) -> float:
    """An upper confidence bound of the true number of units from a released count m~ at privacy ``epsilon``
    (discrete Laplace, ``dporl.privacy.count``): m~ + t with P[Z > t] <= ``failure``; ``count`` itself when exact
    (``epsilon`` None)."""
    if epsilon is None:
        return float(count)
    from dporl.privacy.count import tail_margin

    return float(count) + tail_margin(epsilon, failure)


def check_feasible(prediction: Feasibility) -> Feasibility:
    """Refuse (``InfeasibleEvaluation``, naming the field) when the prediction exceeds its tolerance."""
    if not prediction.ok:
        raise InfeasibleEvaluation(
            prediction.field, prediction.describe() + " (refused before anything was spent; predicted from public "
            "inputs and the released number of units only)")
    return prediction


def _z(confidence: float) -> float:
    from scipy import stats

    return float(stats.norm.ppf(0.5 + confidence / 2))


def _epsilon_for_sigma(sigma: float, delta: float, relation) -> float:
    """The epsilon of one Gaussian mechanism of noise multiplier ``sigma`` at ``delta`` (exact: Balle & Wang 2018,
    delta(eps) = Phi(1 / (2 s) - eps s) - e^eps Phi(-1 / (2 s) - eps s) with s the noise over the sensitivity,
    which replace-one doubles)."""
    from scipy import optimize, stats

    s = sigma / (1.0 if relation == ADD_REMOVE else 2.0)

    def excess(eps: float) -> float:  # the second term in logs: e^eps overflows long before the product does
        second = math.exp(min(eps + float(stats.norm.logcdf(-0.5 / s - eps * s)), 700.0))
        return float(stats.norm.cdf(0.5 / s - eps * s)) - second - delta

    if excess(0.0) <= 0:
        return 0.0
    high = 1.0
    while excess(high) > 0 and high < 1e4:
        high *= 2
    return float(optimize.brentq(excess, 0.0, high)) if excess(high) <= 0 else math.inf


def _tolerance(scales: OPEScales, tolerance: Optional[float]) -> float:
    return scales.width if tolerance is None else check_positive("tolerance", tolerance)


def predict_ratio(kind: str, *, epsilon: float, delta: float, relation=ADD_REMOVE, units: float, unit_clip: float,
                  scales: OPEScales, confidence: float = 0.95, tolerance: Optional[float] = None,
                  field: str = "eval.offline", units_high: Optional[float] = None) -> Feasibility:
    """The noise of DP-WIS / PDIS / DR on ``units`` units (module docstring)."""
    sigma = gaussian_noise_multiplier(epsilon, delta, relation)
    k = scales.episodes_per_unit
    share = 1.0 if k is None else min(1.0, k / unit_clip)
    denominator = max(units, 1.0) * share
    noise = scales.half * sigma * SQRT2 / denominator
    half_width = _z(confidence) * noise
    tol = _tolerance(scales, tolerance)
    needed = None
    if 2 * half_width > tol:
        needed = _epsilon_for_sigma(sigma * tol / (2 * half_width), delta, relation)
    return Feasibility(kind, float(units), epsilon, noise, half_width, tol, needed, field, units_high)


def fqe_fold_noise(*, train_epsilon: float, value_epsilon: float, delta: float, relation, fold_units: float,
                   unit_clip: float, scales: OPEScales, steps: int, sample_rate: float,
                   averaged_steps: int) -> tuple[float, float]:
    """(value-release std, DP-SGD std) of one DP-FQE fold's released value (module docstring)."""
    n = max(fold_units, 1.0)
    k = scales.episodes_per_unit
    share = 1.0 if k is None else min(1.0, k / unit_clip)
    value_sigma = gaussian_noise_multiplier(value_epsilon, delta, relation)
    value_std = scales.half * value_sigma / (n * share)
    sgd_sigma = dpsgd_noise_multiplier(train_epsilon, delta, steps, sample_rate, relation)
    sgd_std = scales.half * FQE_NOISE_GAIN * sgd_sigma / (sample_rate * n * math.sqrt(max(averaged_steps, 1)))
    return value_std, sgd_std


def predict_fqe(*, epsilon: float, delta: float, relation=ADD_REMOVE, units: float, folds: int, unit_clip: float,
                scales: OPEScales, steps: int, sample_rate: float, train_fraction: float, averaged_steps: int,
                confidence: float = 0.95, tolerance: Optional[float] = None,
                field: str = "eval.offline", units_high: Optional[float] = None) -> Feasibility:
    """The noise of DP-FQE on ``folds`` folds of ``units`` units in all, each fold at (epsilon, delta)."""
    from scipy import stats

    def half_width(eps: float) -> tuple[float, float]:
        value_std, sgd_std = fqe_fold_noise(
            train_epsilon=eps * train_fraction, value_epsilon=eps * (1 - train_fraction), delta=delta / 2,
            relation=relation, fold_units=units / folds, unit_clip=unit_clip, scales=scales, steps=steps,
            sample_rate=sample_rate, averaged_steps=averaged_steps)
        fold_std = math.hypot(value_std, sgd_std)
        return fold_std / math.sqrt(folds), float(stats.t.ppf(0.5 + confidence / 2, folds - 1)) * fold_std / math.sqrt(
            folds)

    noise, width = half_width(epsilon)
    tol = _tolerance(scales, tolerance)
    # Both noises fall about as 1 / epsilon (noise multipliers of Gaussian mechanisms): the epsilon needed, roughly.
    needed = epsilon * 2 * width / tol if 2 * width > tol else None
    return Feasibility("fqe", float(units), epsilon, noise, width, tol, needed, field, units_high)
