"""Batch sources: the sampling each step performs, and the privacy event that describes exactly that sampling.

The accountant never sees a description of the sampling written elsewhere: each source states its own per-step
event (``step_event(noise_multiplier)``), so rate, unit and mixture cannot drift apart from what the code does.

A private source also states its privacy ``unit`` (the grouping of its rows). The grouping belongs to the data
(``dporl.privacy.units.dataset_unit``): ``PoissonUnitSource.from_dataset`` groups by the dataset's unit and names
it, and the Trainer refuses an algorithm whose declared unit differs, so a report can never say "one expert" while
the rows were grouped by episode.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from dporl.privacy.events import MixtureEvent, PoissonGaussianEvent, SampledWithoutReplacementGaussianEvent
from dporl.privacy.units import PrivacyUnit, as_unit, dataset_unit
from dporl.utils.validation import ValidationError, check_probability


@dataclass(frozen=True)
class RowLayout:
    """What a source of this module guarantees about a batch's ``unit_index``, so the DP-SGD engine need not check
    it on the device: ids lie in [0, n_units), a unit's rows are contiguous and, with ``rows_per_unit`` set, every
    unit owning rows has exactly that many (contiguous blocks of equal size).

    Only the sources here attach one (``Batch.layout``); a batch built by user code has none and is checked.
    """

    rows_per_unit: Optional[int] = None


@dataclass
class Batch:
    """Rows along dim 0 of every tensor in ``data``; ``unit_index[r]`` is the sampled unit that row r belongs to."""

    data: dict[str, torch.Tensor]
    unit_index: torch.Tensor  # LongTensor [n_rows], values in [0, n_units)
    n_units: int
    private: bool
    layout: Optional[RowLayout] = None  # set by the library's sources only (see RowLayout)

    @property
    def n_rows(self) -> int:
        return int(self.unit_index.shape[0])

    def to(self, device: torch.device | str) -> "Batch":
        """The batch on ``device`` (the unit ids stay where they are: the engine moves them only if it needs them)."""
        device = torch.device(device)
        if all(v.device == device for v in self.data.values()):
            return self
        return Batch({k: v.to(device) for k, v in self.data.items()}, self.unit_index, self.n_units, self.private,
                     self.layout)


def _check_rows(data: Mapping[str, torch.Tensor]) -> int:
    if not data:
        raise ValidationError("data", "no tensors to sample from")
    sizes = {k: int(v.shape[0]) for k, v in data.items()}
    if len(set(sizes.values())) != 1:
        raise ValidationError("data", f"tensors disagree on the number of rows: {sizes}")
    return next(iter(sizes.values()))


def _gather(data: Mapping[str, torch.Tensor], rows: torch.Tensor) -> dict[str, torch.Tensor]:
    return {k: v.index_select(0, rows.to(v.device, non_blocking=True)) for k, v in data.items()}


def _data_to(data: Mapping[str, torch.Tensor], device: torch.device | str) -> dict[str, torch.Tensor]:
    return {k: v.to(device) for k, v in data.items()}


class _UnitIndex:
    """Rows grouped by unit (CSR), built once so per-step sampling is pure tensor indexing."""

    def __init__(self, unit_of_row: torch.Tensor, n_units: int, n_rows: int):
        unit_of_row = torch.as_tensor(unit_of_row, dtype=torch.long)
        if unit_of_row.shape != (n_rows,):
            raise ValidationError("unit_of_row", f"expected shape ({n_rows},), got {tuple(unit_of_row.shape)}")
        if n_units < 1:
            raise ValidationError("n_units", f"must be >= 1, got {n_units}")
        if n_rows and (unit_of_row.min() < 0 or unit_of_row.max() >= n_units):
            raise ValidationError("unit_of_row", f"unit ids must lie in [0, {n_units})")
        self.n_units = n_units
        self.order = torch.argsort(unit_of_row, stable=True)
        self.counts = torch.bincount(unit_of_row, minlength=n_units)
        self.offsets = torch.cumsum(self.counts, 0) - self.counts

    def rows_of(self, units: torch.Tensor, rows_per_unit: Optional[int], generator: torch.Generator):
        """(row indices, position of their unit in ``units``) for the given units."""
        counts = self.counts[units]
        if rows_per_unit is None:
            position = torch.repeat_interleave(torch.arange(len(units)), counts)
            starts = torch.repeat_interleave(self.offsets[units], counts)
            within = torch.arange(len(position)) - torch.repeat_interleave(torch.cumsum(counts, 0) - counts, counts)
            return self.order[starts + within], position
        has_rows = counts > 0
        owners = torch.nonzero(has_rows).squeeze(1)
        position = owners.repeat_interleave(rows_per_unit)
        draws = torch.rand(len(position), generator=generator)
        within = (draws * counts[position]).long().clamp_max(counts[position] - 1)
        return self.order[self.offsets[units[position]] + within], position


class PoissonUnitSource:
    """Poisson sampling over privacy units (experts, trajectories or transitions); add/remove adjacency.

    Each of the ``n_units`` units is included independently with ``sample_rate``. A sampled unit contributes
    ``rows_per_unit`` rows drawn uniformly with replacement from its own rows (None: all its rows), so its
    gradient is an average over its rows and never mixes units. Units owning no rows still count in the
    population. DP-SGD divides the noisy sum by ``expected_batch_size``: ``expected_batch`` when given (a public
    constant, e.g. the configured B when the rate is B over a released estimate of the number of units), else
    ``sample_rate * n_units``, which is public only where the number of units is (replace-one neighbours).
    """

    def __init__(
        self,
        data: Mapping[str, torch.Tensor],
        unit_of_row: torch.Tensor,
        n_units: int,
        sample_rate: float,
        rows_per_unit: Optional[int] = None,
        *,
        unit: PrivacyUnit | str | None = None,
        expected_batch: Optional[float] = None,
    ):
        n_rows = _check_rows(data)
        self.sample_rate = check_probability("sample_rate", sample_rate, allow_zero=False)
        if expected_batch is not None and not (isinstance(expected_batch, (int, float)) and expected_batch > 0):
            raise ValidationError("expected_batch", f"must be a positive number or None, got {expected_batch!r}")
        self._expected_batch = None if expected_batch is None else float(expected_batch)
        if rows_per_unit is not None and rows_per_unit < 1:
            raise ValidationError("rows_per_unit", f"must be >= 1 or None, got {rows_per_unit}")
        self.data = dict(data)
        self.rows_per_unit = rows_per_unit
        self.index = _UnitIndex(unit_of_row, n_units, n_rows)
        self.unit = None if unit is None else as_unit(unit)
        self.layout = RowLayout(rows_per_unit)

    @classmethod
    def from_dataset(
        cls,
        dataset,
        data: Mapping[str, torch.Tensor],
        sample_rate: float,
        rows_per_unit: Optional[int] = None,
        expected_batch: Optional[float] = None,
    ) -> "PoissonUnitSource":
        """Rows grouped by the dataset's own unit: ``data`` holds one row per transition or one per episode
        (e.g. padded trajectories); every unit of the dataset counts in the population, rows or not."""
        n_rows = _check_rows(data)
        units = torch.from_numpy(dataset.unit_ids.copy())
        if n_rows == dataset.n_transitions:
            unit_of_row = torch.repeat_interleave(units, torch.from_numpy(dataset.episode_lengths.copy()))
        elif n_rows == dataset.n_episodes:
            unit_of_row = units
        else:
            raise ValidationError(
                "data", f"{n_rows} rows: expected one per transition ({dataset.n_transitions}) or per episode "
                f"({dataset.n_episodes})"
            )
        return cls(data, unit_of_row, dataset.n_units, sample_rate, rows_per_unit, unit=dataset_unit(dataset),
                   expected_batch=expected_batch)

    def to(self, device: torch.device | str) -> "PoissonUnitSource":
        """Keep the rows on ``device`` (sampling decisions stay on the CPU, drawn from the secret generator)."""
        self.data = _data_to(self.data, device)
        return self

    @property
    def n_units(self) -> int:
        return self.index.n_units

    @property
    def expected_batch_size(self) -> float:
        return self.sample_rate * self.n_units if self._expected_batch is None else self._expected_batch

    def sample(self, generator: torch.Generator) -> Batch:
        chosen = torch.nonzero(torch.rand(self.n_units, generator=generator) < self.sample_rate).squeeze(1)
        rows, position = self.index.rows_of(chosen, self.rows_per_unit, generator)
        return Batch(_gather(self.data, rows), position, int(len(chosen)), private=True, layout=self.layout)

    def step_event(self, noise_multiplier: float) -> PoissonGaussianEvent:
        return PoissonGaussianEvent(noise_multiplier, self.sample_rate)


class FixedSizeSource:
    """Exactly ``sample_size`` distinct units uniformly at random per step (GPOPE's paper mode uses 1).

    Replace-one adjacency: replacing a unit moves a clipped sum by up to 2C while the engine adds noise of std
    sigma * C, so the event's noise multiplier (relative to the sensitivity) is sigma / 2.
    """

    def __init__(
        self,
        data: Mapping[str, torch.Tensor],
        unit_of_row: torch.Tensor,
        n_units: int,
        sample_size: int,
        *,
        unit: PrivacyUnit | str | None = None,
    ):
        n_rows = _check_rows(data)
        if not 1 <= sample_size <= n_units:
            raise ValidationError("sample_size", f"need 1 <= sample_size <= {n_units}, got {sample_size}")
        self.data = dict(data)
        self.sample_size = sample_size
        self.index = _UnitIndex(unit_of_row, n_units, n_rows)
        self.unit = None if unit is None else as_unit(unit)

    def to(self, device: torch.device | str) -> "FixedSizeSource":
        self.data = _data_to(self.data, device)
        return self

    @property
    def n_units(self) -> int:
        return self.index.n_units

    @property
    def expected_batch_size(self) -> float:
        return float(self.sample_size)

    def sample(self, generator: torch.Generator) -> Batch:
        chosen = torch.randperm(self.n_units, generator=generator)[: self.sample_size]
        rows, position = self.index.rows_of(chosen, None, generator)
        return Batch(_gather(self.data, rows), position, self.sample_size, private=True, layout=RowLayout())

    def step_event(self, noise_multiplier: float) -> SampledWithoutReplacementGaussianEvent:
        return SampledWithoutReplacementGaussianEvent(noise_multiplier / 2, self.sample_size, self.n_units)


class UniformBatchSource:
    """Public (or released-stable) rows, ``batch_size`` uniformly with replacement: ordinary noiseless steps."""

    unit = None  # protects nothing: its rows are public

    def __init__(self, data: Mapping[str, torch.Tensor], batch_size: int):
        self.n_rows = _check_rows(data)
        if self.n_rows == 0:
            raise ValidationError("data", "a public source needs at least one row")
        if batch_size < 1:
            raise ValidationError("batch_size", f"must be >= 1, got {batch_size}")
        self.data = dict(data)
        self.batch_size = batch_size
        self._unit_index = torch.arange(batch_size)

    def to(self, device: torch.device | str) -> "UniformBatchSource":
        self.data = _data_to(self.data, device)
        return self

    @property
    def expected_batch_size(self) -> float:
        return float(self.batch_size)

    def sample(self, generator: torch.Generator) -> Batch:
        rows = torch.randint(0, self.n_rows, (self.batch_size,), generator=generator)
        return Batch(_gather(self.data, rows), self._unit_index, self.batch_size, private=False, layout=RowLayout(1))

    def step_event(self, noise_multiplier: float) -> None:
        return None


class MixtureSource:
    """Algorithm 3: with probability p a private step from ``private``, otherwise a public step from ``public``.

    The branch is drawn from the step's generator, independently of the data; it is observable in the
    iterates, so the per-step event is the mixture of a data-independent step and the private event.
    """

    def __init__(self, private_probability: float, private: PoissonUnitSource, public: UniformBatchSource):
        self.private_probability = check_probability("private_probability", private_probability)
        self.private_source = private
        self.public_source = public

    @property
    def unit(self) -> Optional[PrivacyUnit]:
        return getattr(self.private_source, "unit", None)

    @property
    def expected_batch_size(self) -> float:
        return self.private_source.expected_batch_size

    def to(self, device: torch.device | str) -> "MixtureSource":
        self.private_source.to(device)
        self.public_source.to(device)
        return self

    def sample(self, generator: torch.Generator) -> Batch:
        if torch.rand((), generator=generator).item() < self.private_probability:
            return self.private_source.sample(generator)
        return self.public_source.sample(generator)

    def step_event(self, noise_multiplier: float):
        if self.private_probability == 0:
            return None
        event = self.private_source.step_event(noise_multiplier)
        if self.private_probability == 1:
            return event
        return MixtureEvent(self.private_probability, event)
