"""The batch sources of expert-level private CQL (expert-level paper, Algorithms 3 and 4), built from datasets.

- ``expert_source``: Algorithm 4's sampler. Every expert of the data (those without rows too) is included with
  rate q = B / m, m the number of units the run may use (``dporl.privacy.count.Units``: a released noisy count
  under add/remove neighbours, the public count under replace-one; never the private count); a sampled expert
  contributes ``rows_per_unit`` of its transitions, averaged into one per-expert gradient by the engine, and
  DP-SGD divides by the public B.
- ``stable_source``: noiseless steps on B transitions of D_stable, uniformly with replacement.

What each method of the ``train`` pipeline trains on is ``dporl.methods.unit_level``'s (it builds these sources).
Batches carry only the columns the algorithm declares it reads (its ``batch_keys``; CQL's by default): never expert
ids or behaviour probabilities. The expert source groups rows by the dataset's unit and names it
(``dataset_unit``): the expert for logged expert data, the user's column for an imported table.
"""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np
import torch

from dporl.algos.cql import CQL_KEYS
from dporl.data.dataset import TrajectoryDataset
from dporl.privacy.count import Units
from dporl.privacy.samplers import PoissonUnitSource, UniformBatchSource, UnitRuns
from dporl.privacy.units import dataset_unit
from dporl.utils.validation import ValidationError

def transition_columns(dataset: TrajectoryDataset, keys: Sequence[str] = CQL_KEYS
                       ) -> tuple[dict[str, torch.Tensor], UnitRuns]:
    """(the transition columns ``keys``, the unit of every transition as one run per episode).

    The columns share the dataset's arrays (``TrajectoryDataset.transition_columns``: no per-transition copy; the
    observations are gathered per batch), so building a source is linear in the number of episodes."""
    columns = dataset.transition_columns()
    units = UnitRuns(torch.from_numpy(np.array(dataset.episode_lengths, dtype=np.int64)),
                     torch.from_numpy(np.array(dataset.unit_ids, dtype=np.int64)))
    missing = sorted(set(keys) - set(columns))
    if missing:
        raise ValidationError("algorithm.batch_keys", f"{missing} are not transition columns of the dataset "
                              f"(it has {sorted(columns)})")
    return {k: columns[k] for k in keys}, units


def expert_source(
    dataset: TrajectoryDataset, batch_size: float, rows_per_unit: int, units: Units, cell: Optional[str] = None,
    keys: Sequence[str] = CQL_KEYS,
) -> PoissonUnitSource:
    """Algorithm 4's sampler: every expert of ``dataset`` (those without rows too) included with rate B / m, B =
    ``batch_size`` (the expected number of experts per step, public), m = ``units.of(cell)``; DP-SGD divides by B.
    Refused, naming the count it used, when B exceeds m."""
    m = units.of(cell)
    if not batch_size <= m:
        raise ValidationError("batch_size", f"expected batch {batch_size:g} exceeds {units.describe(cell)}: lower "
                              "batch_size")
    columns, experts = transition_columns(dataset, keys)
    return PoissonUnitSource(
        columns, experts, dataset.metadata.n_units, batch_size / m, rows_per_unit, unit=dataset_unit(dataset),
        expected_batch=batch_size,
    )


def stable_source(dataset: TrajectoryDataset, batch_size: float, what: str = "D_stable",
                  keys: Sequence[str] = CQL_KEYS) -> UniformBatchSource:
    """Noiseless steps: ``batch_size`` (rounded, >= 1) transitions of ``dataset`` uniformly with replacement."""
    if dataset.n_transitions == 0:
        raise ValidationError("release", f"{what} is empty: nothing to train on (raise the release budget or T)")
    return UniformBatchSource(transition_columns(dataset, keys)[0], max(1, int(round(batch_size))))
