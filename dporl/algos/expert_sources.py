"""The batch sources of expert-level private CQL (expert-level paper, Algorithms 3 and 4), built from datasets.

- ``expert_source``: Algorithm 4's sampler. Every expert of the data (those without rows too) is included with
  rate q = B / m, m the number of units the run may use (``dporl.privacy.count.Units``: a released noisy count
  under add/remove neighbours, the public count under replace-one; never the private count); a sampled expert
  contributes ``rows_per_expert`` of its transitions, averaged into one per-expert gradient by the engine, and
  DP-SGD divides by the public B.
- ``stable_source``: noiseless steps on B transitions of D_stable, uniformly with replacement.
- ``training_source``: what a method trains on (the pipeline's, and the audits', single builder): ``non_private``
  on the whole logged dataset, ``stable_only`` on D_stable, ``dp_sgd`` on the expert source over the whole logged
  dataset, ``mixed`` the Algorithm-3 mixture of both (D_unstable is the whole logged dataset: the sound release
  never reads it).

Batches carry only the columns CQL reads (``CQL_KEYS``): never expert ids or behaviour probabilities. The expert
source groups rows by the dataset's unit and names it (``dataset_unit``): the expert for logged expert data, the
user's column for an imported table.
"""

from __future__ import annotations

from typing import Literal, Optional

import numpy as np
import torch

from dporl.data.dataset import TrajectoryDataset
from dporl.privacy.count import Units
from dporl.privacy.samplers import MixtureSource, PoissonUnitSource, UniformBatchSource, UnitRuns
from dporl.privacy.units import dataset_unit
from dporl.utils.validation import ValidationError

Method = Literal["non_private", "dp_sgd", "stable_only", "mixed"]
CQL_KEYS = ("obs", "actions", "rewards", "next_obs", "terminated")


def cql_columns(dataset: TrajectoryDataset) -> tuple[dict[str, torch.Tensor], UnitRuns]:
    """(the columns CQL reads, the unit of every transition as one run per episode).

    The columns share the dataset's arrays (``TrajectoryDataset.transition_columns``: no per-transition copy; the
    observations are gathered per batch), so building a source is linear in the number of episodes."""
    columns = dataset.transition_columns()
    units = UnitRuns(torch.from_numpy(np.array(dataset.episode_lengths, dtype=np.int64)),
                     torch.from_numpy(np.array(dataset.unit_ids, dtype=np.int64)))
    return {k: columns[k] for k in CQL_KEYS}, units


def expert_source(
    dataset: TrajectoryDataset, batch_size: float, rows_per_expert: int, units: Units, cell: Optional[str] = None
) -> PoissonUnitSource:
    """Algorithm 4's sampler: every expert of ``dataset`` (those without rows too) included with rate B / m, B =
    ``batch_size`` (the expected number of experts per step, public), m = ``units.of(cell)``; DP-SGD divides by B.
    Refused, naming the count it used, when B exceeds m."""
    m = units.of(cell)
    if not batch_size <= m:
        raise ValidationError("batch_size", f"expected batch {batch_size:g} exceeds {units.describe(cell)}: lower "
                              "batch_size")
    columns, experts = cql_columns(dataset)
    return PoissonUnitSource(
        columns, experts, dataset.metadata.n_experts, batch_size / m, rows_per_expert, unit=dataset_unit(dataset),
        expected_batch=batch_size,
    )


def stable_source(dataset: TrajectoryDataset, batch_size: float, what: str = "D_stable") -> UniformBatchSource:
    """Noiseless steps: ``batch_size`` (rounded, >= 1) transitions of ``dataset`` uniformly with replacement."""
    if dataset.n_transitions == 0:
        raise ValidationError("release", f"{what} is empty: nothing to train on (raise the release budget or T)")
    return UniformBatchSource(cql_columns(dataset)[0], max(1, int(round(batch_size))))


def training_source(
    method: Method,
    logged: TrajectoryDataset,
    stable: Optional[TrajectoryDataset],
    *,
    batch_size: float,
    units: Optional[Units] = None,
    cell: Optional[str] = None,
    rows_per_expert: int = 1,
    p_dp: float = 0.5,
):
    """The batch source ``method`` trains on (see the module docstring); the private methods sample at rate
    ``batch_size`` / ``units.of(cell)`` (required for them)."""
    if method == "non_private":
        return stable_source(logged, batch_size, "the dataset")
    if method in ("stable_only", "mixed") and stable is None:
        raise ValidationError("method", f"{method} trains on D_stable: run the release first")
    if method == "stable_only":
        return stable_source(stable, batch_size)
    if units is None:
        raise ValidationError("units", f"{method} samples at rate B / m: give the number of units it may use")
    private = expert_source(logged, batch_size, rows_per_expert, units, cell)
    if method == "dp_sgd":
        return private
    if method == "mixed":
        return MixtureSource(p_dp, private, stable_source(stable, batch_size))
    raise ValidationError("method", f"unknown method {method!r}")
