"""Logged decision data: the ``TrajectoryDataset`` format and its views (Minari import/export in ``minari_io``)."""

from dporl.data.dataset import (
    FORMAT_VERSION,
    DatasetMetadata,
    PaddedTrajectories,
    TrajectoryDataset,
    Transitions,
)

__all__ = ["FORMAT_VERSION", "DatasetMetadata", "PaddedTrajectories", "TrajectoryDataset", "Transitions"]
