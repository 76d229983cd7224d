"""Items grouped by a small integer key in linear time (a stable counting sort: CSR ``order`` / ``offsets``), and
the concatenated index ranges that read such groups without a Python loop.

Keys are unit or expert ids in ``[0, n_groups)``. numpy's stable sort of keys of 16 bits or less is a radix sort
(one counting pass), so keys below 2**16 take one pass and wider keys two least-significant-digit passes of 16 bits
each: linear in the number of items, never an O(n log n) comparison sort. Already-sorted keys (data logged unit by
unit) are detected in one comparison pass and need no sort at all.
"""

from __future__ import annotations

import numpy as np

from dporl.utils.validation import ValidationError

_DIGIT = 1 << 16


def stable_group_order(keys: np.ndarray, n_groups: int) -> tuple[np.ndarray, np.ndarray]:
    """(order, offsets): group g's items are ``order[offsets[g]:offsets[g + 1]]``, in input order (stable).

    ``keys`` are integers in ``[0, n_groups)`` (not checked here: the caller validated them); ``order`` is int64
    ``[len(keys)]`` and ``offsets`` int64 ``[n_groups + 1]``.
    """
    keys = np.asarray(keys)
    if keys.ndim != 1 or keys.dtype.kind not in "iu":
        raise ValidationError("keys", f"expected a 1-D integer array, got {keys.dtype} {keys.shape}")
    if n_groups > 1 << 32:
        raise ValidationError("n_groups", f"at most 2**32 groups, got {n_groups}")
    offsets = np.zeros(n_groups + 1, dtype=np.int64)
    np.cumsum(np.bincount(keys, minlength=n_groups), out=offsets[1:])
    if len(keys) < 2 or bool(np.all(keys[1:] >= keys[:-1])):
        return np.arange(len(keys), dtype=np.int64), offsets
    if n_groups <= _DIGIT:
        order = np.argsort(keys.astype(np.uint16), kind="stable")
    else:  # LSD radix: sort by the low 16 bits, then stably by the high 16 bits
        order = np.argsort((keys & (_DIGIT - 1)).astype(np.uint16), kind="stable")
        order = order[np.argsort((keys[order] >> 16).astype(np.uint16), kind="stable")]
    return order.astype(np.int64, copy=False), offsets


def concat_ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """Concatenation of ``arange(s, s + n)`` for every (s, n), in one vectorised pass (int64)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    total = int(lengths.sum())
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    offsets = np.cumsum(lengths) - lengths
    result = np.repeat(np.asarray(starts, dtype=np.int64) - offsets, lengths)
    result += np.arange(total, dtype=np.int64)
    return result
