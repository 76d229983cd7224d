"""Column checks of a table import: numbers without NaN or inf, integers, 0/1 flags, ids factorised, and actions
mapped into the declared action set (``dporl.data.table``). Each refusal names the column."""

from __future__ import annotations

from typing import Optional

import numpy as np

from dporl.utils.validation import ValidationError


def _numeric(name: str, values: np.ndarray) -> np.ndarray:
    if values.dtype.kind not in "iufb":
        raise ValidationError(name, f"expected numbers, got {values.dtype} values (e.g. {values[:1].tolist()})")
    # A sum is NaN/inf when any term is (or on overflow, which the exact check below then clears): one pass,
    # no temporary array for the common case of clean data.
    if values.dtype.kind == "f" and not np.isfinite(np.sum(values, dtype=np.float64)):
        finite = np.isfinite(values)
        if not finite.all():
            bad = np.flatnonzero(~finite)
            raise ValidationError(name, f"{len(bad)} NaN/inf value(s) (first at row {int(bad[0])})")
    return values


def _integers(name: str, values: np.ndarray) -> np.ndarray:
    values = _numeric(name, values)
    if values.dtype.kind == "f":
        if not np.all(values == np.round(values)):
            bad = int(np.flatnonzero(values != np.round(values))[0])
            raise ValidationError(name, f"expected integers, found {values[bad]!r} (row {bad})")
    return values.astype(np.int64, copy=False)


def _flags(name: str, values: np.ndarray) -> np.ndarray:
    if values.dtype.kind == "b":
        return values
    values = _integers(name, values)
    if values.size and (values.min() < 0 or values.max() > 1):
        raise ValidationError(name, "expected booleans (0/1, true/false)")
    return values.astype(bool)


def _factorize(values: np.ndarray, *, sort: bool) -> tuple[np.ndarray, np.ndarray]:
    import pandas as pd

    codes, uniques = pd.factorize(values, sort=sort)
    if len(codes) and codes.min() < 0:  # pandas codes missing values as -1
        raise ValidationError("id", "missing id values")
    return codes.astype(np.int64, copy=False), np.asarray(uniques)


def _action_indices(name: str, values: np.ndarray, n_actions: int, labels: Optional[tuple]) -> np.ndarray:
    """Every row's action index in the declared set (a count: the integers 0..n-1; labels: label i -> i), -1 for a
    value outside it. A value that is no action at all (NaN, a fraction, text for a count) is refused."""
    import pandas as pd

    if labels is None:
        indices = _integers(name, values)
        return np.where((indices >= 0) & (indices < n_actions), indices, -1)
    if isinstance(labels[0], str):  # text labels; a numeric column is matched by its integers' decimal text
        keys = _integers(name, values).astype(str) if values.dtype.kind in "iufb" else values
        index = pd.Index(list(labels), dtype=object)
    else:
        keys, index = _integers(name, values), pd.Index(list(labels), dtype=np.int64)
    return np.asarray(index.get_indexer(keys), dtype=np.int64)


def _describe_set(n_actions: int, labels: Optional[tuple]) -> str:
    if labels is None:
        return f"0..{n_actions - 1} (actions={n_actions})"
    return f"the labels {list(labels)}" if len(labels) <= 10 else f"{len(labels)} declared labels"
