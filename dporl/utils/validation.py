"""Input validation that names the offending field.

Every guarantee dporl prints rests on inputs (clip norms, p_min, budgets, action ranges); a bad one must stop
the run with an error that says which field is wrong and why, before anything is computed or written.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import numpy as np


class ValidationError(ValueError):
    """A user-supplied value is unusable. ``field`` names it (dotted path for nested configs)."""

    def __init__(self, field: str, message: str):
        self.field = field
        super().__init__(f"{field}: {message}")


class PrivacyBudgetError(ValidationError):
    """A budget cannot be met or would be exceeded (never spend past a budget)."""


def _as_array(value: Any) -> np.ndarray:
    if hasattr(value, "detach"):  # torch tensor without importing torch here
        value = value.detach().cpu().numpy()
    return np.asarray(value)


def check_finite(field: str, value: Any) -> None:
    arr = _as_array(value)
    if arr.dtype.kind in "fc" and not np.all(np.isfinite(arr)):
        bad = int(np.size(arr) - np.count_nonzero(np.isfinite(arr)))
        raise ValidationError(field, f"contains {bad} non-finite value(s) (NaN or inf)")


def check_shape(field: str, value: Any, expected: Sequence[int | None]) -> None:
    """``expected`` may use ``None`` as a wildcard for a dimension."""
    shape = tuple(_as_array(value).shape) if not hasattr(value, "shape") else tuple(value.shape)
    ok = len(shape) == len(expected) and all(e is None or e == s for e, s in zip(expected, shape))
    if not ok:
        pretty = tuple("*" if e is None else e for e in expected)
        raise ValidationError(field, f"expected shape {pretty}, got {shape}")


def check_positive(field: str, value: float, *, allow_zero: bool = False) -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        raise ValidationError(field, f"expected a number, got {value!r}") from None
    if math.isnan(number) or number < 0 or (number == 0 and not allow_zero) or math.isinf(number):
        bound = ">= 0" if allow_zero else "> 0"
        raise ValidationError(field, f"must be finite and {bound}, got {value!r}")
    return number


def check_probability(field: str, value: float, *, allow_zero: bool = True, allow_one: bool = True) -> float:
    number = check_positive(field, value, allow_zero=True)
    if number > 1 or (number == 0 and not allow_zero) or (number == 1 and not allow_one):
        lo = "[" if allow_zero else "("
        hi = "]" if allow_one else ")"
        raise ValidationError(field, f"must lie in {lo}0, 1{hi}, got {value!r}")
    return number


def check_int_range(field: str, value: Any, low: int, high: int) -> None:
    """All entries of ``value`` must be integers in ``[low, high)``."""
    arr = _as_array(value)
    if arr.size == 0:
        return
    if arr.dtype.kind not in "iu":
        if arr.dtype.kind == "f" and np.all(np.isfinite(arr)) and np.all(arr == np.round(arr)):
            pass
        else:
            raise ValidationError(field, f"expected integers, got dtype {arr.dtype}")
    lo, hi = arr.min(), arr.max()
    if lo < low or hi >= high:
        raise ValidationError(field, f"values must lie in [{low}, {high}), found range [{lo}, {hi}]")
