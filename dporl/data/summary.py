"""What a dataset is, in brief: its JSON-safe overview (``summary``) and its content hash (``fingerprint``)."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np

from dporl.data.storage import _ARRAY_DTYPES, chunks
from dporl.utils.io import dump_json


def summary(dataset: Any) -> dict:
    """JSON-safe overview of a ``TrajectoryDataset``: counts, episodes per unit, returns, lengths, action
    histogram, end flags."""

    def stats(values: np.ndarray) -> dict:
        if len(values) == 0:
            return {"min": None, "mean": None, "max": None, "std": None}
        values = np.asarray(values, dtype=np.float64)
        return {
            "min": float(values.min()),
            "mean": float(values.mean()),
            "max": float(values.max()),
            "std": float(values.std()),
        }

    per_unit = np.bincount(dataset.unit_ids, minlength=dataset.metadata.n_units)
    last = dataset._transition_starts + dataset.episode_lengths - 1
    return {
        "env_id": dataset.metadata.env_id,
        "n_episodes": dataset.n_episodes,
        "n_transitions": dataset.n_transitions,
        "n_units": dataset.metadata.n_units,
        "units_with_episodes": int(np.count_nonzero(per_unit)),
        "episodes_per_unit": {k: v for k, v in stats(per_unit).items() if k != "std"},
        "episode_return": stats(dataset.episode_returns()),
        "episode_length": stats(dataset.episode_lengths),
        "action_counts": np.bincount(dataset.actions, minlength=dataset.metadata.n_actions).tolist(),
        "terminated_episodes": int(dataset.terminations[last].sum()),
        "truncated_episodes": int(dataset.truncations[last].sum()),
        "has_behavior_log_probs": dataset.behavior_log_probs is not None,
        "p_min": dataset.metadata.p_min,
    }


# The labels the fingerprint hashes the unit fields under: fixed (they are format version 2's names), so the same
# content keeps its fingerprint whatever the fields are called; run directories and searches record fingerprints.
_FINGERPRINT_LABELS = {"unit_ids": "expert_ids", "n_units": "n_experts"}


def fingerprint(dataset: Any) -> str:
    """sha256 of a ``TrajectoryDataset``'s content (metadata JSON and every array's dtype, shape and bytes), hashed
    in place in chunks."""
    metadata = {_FINGERPRINT_LABELS.get(key, key): value for key, value in dataset.metadata.to_dict().items()}
    digest = hashlib.sha256(dump_json(metadata, sort_keys=True).encode())
    for name in _ARRAY_DTYPES:
        array = getattr(dataset, name)
        digest.update(_FINGERPRINT_LABELS.get(name, name).encode())
        if array is None:
            digest.update(b"absent")
            continue
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        for chunk in chunks(np.ascontiguousarray(array)):  # a view for stored arrays
            digest.update(memoryview(chunk).cast("B"))
    return digest.hexdigest()
