"""Logged decision data: the ``TrajectoryDataset`` format and its views, tables in (``read_table``), Minari
import/export in ``minari_io`` (``read_minari`` names the privacy unit)."""

from dporl.data.dataset import (
    FORMAT_VERSION,
    DatasetMetadata,
    PaddedTrajectories,
    TrajectoryDataset,
    Transitions,
)
from dporl.data.table import read_minari, read_table

__all__ = [
    "FORMAT_VERSION", "DatasetMetadata", "PaddedTrajectories", "TrajectoryDataset", "Transitions", "read_minari",
    "read_table",
]
