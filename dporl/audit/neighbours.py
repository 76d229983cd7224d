"""Fixed neighbouring datasets: D and D' for each relation a dporl guarantee names.

- add/remove one unit (``without_unit``): D' = D minus one unit with all its data: its episodes, its key, and
  (expert-level data) its policy in the expert set (``experts_without``). The other units keep their order; ids
  above the removed one shift down by one. For tables, ``frame_without_unit`` drops the unit's rows.
- replace one unit (``replace_unit``): D' = D with one unit's episodes replaced by a copy of another unit's, under
  the replaced unit's id (the number of units is the same).
- reward level (``with_reward_changed``): D' = D with one logged reward changed by ``change`` (|r - r'| <= 1).

Pure functions of their inputs: each builds a validated ``TrajectoryDataset`` and never changes D.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

import numpy as np

from dporl.data.dataset import TrajectoryDataset
from dporl.utils.validation import ValidationError


def _check_unit(dataset: TrajectoryDataset, unit: int) -> int:
    m = dataset.metadata.n_units
    if isinstance(unit, bool) or not isinstance(unit, (int, np.integer)) or not 0 <= unit < m:
        raise ValidationError("unit", f"must be a unit index in [0, {m}), got {unit!r}")
    if m < 2:
        raise ValidationError("unit", "a dataset of one unit has no add/remove neighbour with data")
    return int(unit)


def without_unit(dataset: TrajectoryDataset, unit: int, experts: Optional[Any] = None) -> TrajectoryDataset:
    """D minus unit ``unit`` (its episodes, its key; ``experts``: the expert set of D' for the metadata's reference)."""
    unit = _check_unit(dataset, unit)
    meta = dataset.metadata
    subset = dataset.subset(np.flatnonzero(dataset.unit_ids != unit))
    keys = None if meta.unit_keys is None else tuple(k for i, k in enumerate(meta.unit_keys) if i != unit)
    changes: dict[str, Any] = {"n_units": meta.n_units - 1, "unit_keys": keys}
    if experts is not None:
        changes["expert_set"] = experts.reference()
    return subset.replace(unit_ids=subset.unit_ids - (subset.unit_ids > unit),
                          metadata=dataclasses.replace(meta, **changes))


def experts_without(experts: Any, unit: int) -> Any:
    """The expert set of D minus expert ``unit`` (the others, in order)."""
    import torch

    m = experts.n_experts
    if not 0 <= unit < m:
        raise ValidationError("unit", f"must be an expert index in [0, {m}), got {unit!r}")
    return experts.select(torch.tensor([i for i in range(m) if i != unit]))


def replace_unit(dataset: TrajectoryDataset, unit: int, donor: int) -> TrajectoryDataset:
    """D with unit ``unit``'s episodes replaced by a copy of unit ``donor``'s (same number of units)."""
    unit, donor = _check_unit(dataset, unit), _check_unit(dataset, donor)
    if unit == donor:
        raise ValidationError("donor", "the donor must be another unit")
    ids = dataset.unit_ids
    kept = np.flatnonzero(ids != unit)
    copied = np.flatnonzero(ids == donor)
    order = np.concatenate([kept, copied])
    new_ids = np.concatenate([ids[kept], np.full(len(copied), unit, dtype=ids.dtype)])
    subset = dataset.subset(order)
    return subset.replace(unit_ids=new_ids)


def with_reward_changed(dataset: TrajectoryDataset, index: int, change: float = 1.0) -> TrajectoryDataset:
    """D with the reward of transition ``index`` changed by ``change`` (reward-level neighbours: |change| <= 1)."""
    if not 0 <= index < dataset.n_transitions:
        raise ValidationError("index", f"must be a transition index in [0, {dataset.n_transitions}), got {index}")
    if not 0 < abs(change) <= 1:
        raise ValidationError("change", f"reward-level neighbours differ by at most 1 in one reward, got {change}")
    rewards = np.array(dataset.rewards, dtype=np.float32)
    rewards[index] += np.float32(change)
    return dataset.replace(rewards=rewards)


def frame_without_unit(frame: Any, column: str, key: Any) -> Any:
    """A table (pandas DataFrame) without the rows of the unit whose ``column`` value is ``key``."""
    mask = frame[column] == key
    if not bool(mask.any()):
        raise ValidationError("unit", f"no rows with {column} == {key!r}")
    return frame.loc[~mask].reset_index(drop=True)


def episodes_without(dataset: TrajectoryDataset, episode: int) -> TrajectoryDataset:
    """D minus one episode (trajectory-level data: every episode is a unit)."""
    if not 0 <= episode < dataset.n_episodes:
        raise ValidationError("episode", f"must be an episode index in [0, {dataset.n_episodes}), got {episode}")
    return dataset.subset(np.array([i for i in range(dataset.n_episodes) if i != episode], dtype=np.int64))


def episode_replaced(dataset: TrajectoryDataset, episode: int, donor: int) -> TrajectoryDataset:
    """D with one episode replaced by a copy of another (trajectory-level replace-one neighbours), in place."""
    n = dataset.n_episodes
    if not (0 <= episode < n and 0 <= donor < n) or episode == donor:
        raise ValidationError("episode", f"need two distinct episode indices in [0, {n}), got {episode}, {donor}")
    order = np.arange(n, dtype=np.int64)
    order[episode] = donor
    return dataset.subset(order)
