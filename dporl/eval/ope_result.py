"""The result of a private off-policy evaluation, and the rules every estimator applies before returning one.

``finish`` is the one place an ``OPEResult`` is made:

- a failed estimate (a non-finite value, a noisy denominator <= 0, a diverged DP-FQE) returns NaN with the public
  value range as its interval, ``calibrated=False`` and a note that names the failure;
- otherwise the point estimate is clamped into the declared value range (post-processing with public bounds) and the
  interval is clamped alike and widened, if need be, to contain the point estimate;
- ``calibrated`` is True only when no caveat applies (``dporl.eval.ope_calibration`` decides which configurations
  were measured nominal); the caveat is the last note.

Every note is a function of public inputs (the configuration, the declared scales) or of released values.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Literal, Optional, Sequence

Status = Literal["ok", "no_estimate", "diverged"]


@dataclass(frozen=True)
class OPEResult:
    estimator: str
    value: float
    ci_low: float
    ci_high: float
    confidence: float
    stages: list[str]
    variance: str  # how the interval's variance was obtained (and that it is private)
    fold_values: Optional[list[float]] = None
    notes: list[str] = field(default_factory=list)
    # Whether the benchmark suite (``python -m dporl.eval.ope_suite``) measured this estimator and configuration
    # nominal on every problem; False: the interval accounts for sampling and privacy noise but NOT for a bias the
    # last note names (read it as indicative only). Always False for a failed estimate.
    calibrated: bool = True
    status: Status = "ok"  # ok | no_estimate (no released denominator) | diverged (DP-FQE)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        head = (f"{self.estimator}: value {self.value:.4g}, {100 * self.confidence:g}% interval "
                f"[{self.ci_low:.4g}, {self.ci_high:.4g}] ({self.variance})")
        if self.status != "ok":
            return f"{head}; FAILED ({self.status}): {self.notes[0] if self.notes else ''}"
        return head + ("" if self.calibrated else "; NOT CALIBRATED: " + self.notes[-1])


def finish(
    estimator: str,
    value: float,
    low: float,
    high: float,
    *,
    confidence: float,
    stages: Sequence[str],
    variance: str,
    value_range: tuple[float, float],
    notes: Sequence[str] = (),
    caveat: Optional[str] = None,
    fold_values: Optional[Sequence[float]] = None,
    status: Status = "ok",
    failure: Optional[str] = None,
) -> OPEResult:
    """The ``OPEResult`` of an estimate (module docstring): clamped into ``value_range``, NaN with the range as its
    interval when it failed (``status`` not ok, or a non-finite value, with ``failure`` saying why)."""
    lo, hi = float(value_range[0]), float(value_range[1])
    notes = list(notes)
    folds = None if fold_values is None else [float(v) for v in fold_values]
    if status == "ok" and not all(math.isfinite(x) for x in (value, low, high)):
        status, failure = "no_estimate", failure or "the estimate is not a finite number"
    if status != "ok":
        text = failure or status
        return OPEResult(estimator, math.nan, lo, hi, confidence, list(stages), f"{variance}: unavailable", folds,
                         [f"no estimate ({status}): {text}; the interval is the declared value range"] + notes
                         + ([caveat] if caveat else []), calibrated=False, status=status)
    value = min(max(float(value), lo), hi)
    low, high = max(float(low), lo), min(float(high), hi)
    low, high = min(low, value), max(high, value)
    return OPEResult(estimator, value, low, high, confidence, list(stages), variance, folds,
                     notes + ([caveat] if caveat else []), calibrated=caveat is None)
