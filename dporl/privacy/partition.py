"""A split of the privacy units into named cells by a keyed hash of each unit's id: parallel composition.

Parallel composition (McSherry 2009, Theorem 4; adaptive form in e.g. Smith et al. 2022) needs the cell a unit
falls in to be a function of that unit alone. If the split depended on the data (on which other units exist, on
their rows, on the dense index a table import happened to assign), adding or removing one unit could move other
units between cells, and the max-over-cells argument would fail. ``UnitPartition`` therefore takes only a public
salt and the cells' fractions: a unit's cell is ``sha256(salt, unit key)`` mapped to [0, 1) and cut at the
cumulative fractions, where the unit key is the user's own id (``DatasetMetadata.unit_key_strings``). There is no
way to hand it an assignment, an array or a callable, and ``PrivacyLedger.partition`` accepts nothing else.

With a partition declared, a ledger stage may name the cells it touches; stages over the same cell compose
sequentially, a stage without cells touches every cell, and the run's guarantee is the largest cell's
(``dporl.privacy.ledger``). Outputs computed on one cell may feed a later stage on another (a doubly-robust model
fitted on held-out units): for a unit in cell A the later stage is post-processing of A's release, because its own
input (cell B's rows) is the same in both neighbouring datasets.

The fraction of units in a cell is random (each unit lands independently), and how many units a cell holds is
private under add/remove neighbours like any count of units: a run that needs it releases a noisy count per cell
(``dporl.privacy.count``). So is whether a cell holds any unit at all: under add/remove a run splits with
``allow_empty`` (an empty cell is a dataset of no units, its mechanisms run over no units) and never refuses on it;
only under replace-one, where the counts are public, does ``split`` refuse an empty cell.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import numpy as np

from dporl.data.dataset import DatasetMetadata, TrajectoryDataset
from dporl.utils.validation import ValidationError, check_probability

_SCALE = float(2**64)


@dataclass(frozen=True)
class UnitPartition:
    """Cells ``{name: fraction}`` (fractions > 0 summing to 1) over units, by a keyed hash with a public ``salt``."""

    salt: str
    cells: tuple[tuple[str, float], ...]

    def __init__(self, salt: str, cells: Mapping[str, float] | Sequence[str]):
        if not isinstance(salt, str) or not salt:
            raise ValidationError("partition.salt", "a public, non-empty string chosen before seeing the data")
        if isinstance(cells, Mapping):
            items = [(str(k), check_probability(f"partition.cells.{k}", v, allow_zero=False)) for k, v in cells.items()]
        elif isinstance(cells, Sequence) and not isinstance(cells, str) and all(isinstance(c, str) for c in cells):
            items = [(c, 1.0 / len(cells)) for c in cells] if cells else []
        else:
            raise ValidationError(
                "partition.cells", "expected cell names or {name: fraction}; a split is a keyed hash of unit ids "
                "with a public salt, never an assignment computed from the data"
            )
        if len(items) < 2:
            raise ValidationError("partition.cells", "a partition needs at least two cells")
        if len({name for name, _ in items}) != len(items):
            raise ValidationError("partition.cells", "cell names must be distinct")
        total = sum(f for _, f in items)
        if abs(total - 1.0) > 1e-9:
            raise ValidationError("partition.cells", f"fractions must sum to 1, got {total:g}")
        object.__setattr__(self, "salt", salt)
        object.__setattr__(self, "cells", tuple(items))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.cells)

    def describe(self) -> str:
        parts = ", ".join(f"{name!r} {fraction:.3g}" for name, fraction in self.cells)
        return f"keyed hash (sha256) of each unit's id with public salt {self.salt!r} into cells {parts}"

    def cell_of_keys(self, keys: Sequence[str]) -> np.ndarray:
        """The cell index of every unit key (a function of the salt and that key alone)."""
        salt = self.salt.encode("utf-8") + b"\x00"
        draws = np.fromiter(
            (int.from_bytes(hashlib.sha256(salt + str(k).encode("utf-8")).digest()[:8], "little") for k in keys),
            dtype=np.float64, count=len(keys),
        ) / _SCALE
        bounds = np.cumsum([fraction for _, fraction in self.cells])[:-1]
        return np.searchsorted(bounds, draws, side="right").astype(np.int64)

    def cell_of_units(self, dataset: TrajectoryDataset) -> np.ndarray:
        """The cell index of every unit of ``dataset`` [n_units], from the units' own ids."""
        return self.cell_of_keys(dataset.metadata.unit_key_strings())

    def split(self, dataset: TrajectoryDataset, allow_empty: bool = False) -> dict[str, TrajectoryDataset]:
        """Every cell's episodes, as a dataset over that cell's units only (units re-indexed, keys kept).

        A cell without units is refused by name unless ``allow_empty`` (it is then a dataset of no units). Whether a
        cell is empty is a fact of the private data under add/remove neighbours: a run refuses on it only where the
        number of units is public (replace-one); an add/remove run splits with ``allow_empty``, runs its mechanisms
        over an empty cell's no units, and refuses a cell only on its released count
        (``dporl.privacy.count.check_cells_hold_units``)."""
        unit_cell = self.cell_of_units(dataset)
        keys = np.asarray(dataset.metadata.unit_key_strings(), dtype=object)
        result = {}
        for index, name in enumerate(self.names):
            members = np.flatnonzero(unit_cell == index)
            if len(members) == 0 and not allow_empty:
                raise ValidationError("partition", f"cell {name!r} holds no unit: too few units for this split")
            remap = np.full(dataset.n_units, -1, dtype=np.int64)
            remap[members] = np.arange(len(members))
            episodes = np.flatnonzero(unit_cell[dataset.unit_ids] == index)
            part = dataset.subset(episodes)
            meta = dataset.metadata.to_dict()
            meta.update(n_units=len(members), unit_keys=[str(k) for k in keys[members]])  # same unit column
            result[name] = part.replace(unit_ids=remap[part.unit_ids], metadata=DatasetMetadata.from_dict(meta))
        return result

    def to_dict(self) -> dict[str, Any]:
        return {"salt": self.salt, "cells": [[name, fraction] for name, fraction in self.cells]}

    @staticmethod
    def from_dict(payload: Any) -> "UnitPartition":
        if not isinstance(payload, Mapping) or set(payload) != {"salt", "cells"}:
            raise ValidationError("partition", f"not a unit partition: {payload!r}")
        try:
            cells = {str(name): float(fraction) for name, fraction in payload["cells"]}
        except (TypeError, ValueError):
            raise ValidationError("partition.cells", f"expected [name, fraction] pairs, got {payload['cells']!r}") from None
        return UnitPartition(payload["salt"], cells)


def fold_partition(salt: str, k: int, prefix: str = "fold") -> UnitPartition:
    """``k`` equal cells named ``fold0 .. fold{k-1}``."""
    if int(k) != k or k < 2:
        raise ValidationError("folds", f"need an integer >= 2, got {k!r}")
    return UnitPartition(salt, [f"{prefix}{i}" for i in range(int(k))])
