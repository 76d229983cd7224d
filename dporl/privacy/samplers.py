"""Batch sources: the sampling each step performs, and the privacy event that describes exactly that sampling.

The accountant never sees a description of the sampling written elsewhere: each source states its own per-step
event (``step_event(noise_multiplier)``), so rate, unit and mixture cannot drift apart from what the code does.

A private source also states its privacy ``unit`` (the grouping of its rows). The grouping belongs to the data
(``dporl.privacy.units.dataset_unit``): ``PoissonUnitSource.from_dataset`` groups by the dataset's unit and names
it, and the Trainer refuses an algorithm whose declared unit differs, so a report can never say "one expert" while
the rows were grouped by episode.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional

import numpy as np
import torch

from dporl.privacy.events import MixtureEvent, PoissonGaussianEvent, SampledWithoutReplacementGaussianEvent
from dporl.privacy.units import PrivacyUnit, as_unit, dataset_unit
from dporl.utils.grouping import concat_ranges, stable_group_order
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


@dataclass(frozen=True)
class UnitRuns:
    """Which unit owns each row, as runs: the rows, in order, cut into runs of consecutive rows of one unit.

    Run k is the next ``lengths[k]`` rows and belongs to unit ``units[k]``; runs of one unit need not be adjacent
    (one run per episode: ``lengths`` = the episode lengths, ``units`` = each episode's unit). This is the compact
    form of a per-row unit id (``of_rows`` builds it from one): a source indexes runs, so data with a few long runs
    (transitions of episodes) is grouped in time and memory linear in the number of episodes, not of rows.
    """

    lengths: torch.Tensor  # int64 [n_runs], each >= 1
    units: torch.Tensor  # int64 [n_runs]

    def __post_init__(self) -> None:
        lengths = torch.as_tensor(self.lengths, dtype=torch.long)
        units = torch.as_tensor(self.units, dtype=torch.long)
        if lengths.ndim != 1 or units.shape != lengths.shape:
            raise ValidationError("unit_of_row", f"run lengths {tuple(lengths.shape)} and run units "
                                  f"{tuple(units.shape)} must be 1-D of one length")
        if len(lengths) and int(lengths.min()) < 1:
            raise ValidationError("unit_of_row", "every run needs at least one row")
        object.__setattr__(self, "lengths", lengths)
        object.__setattr__(self, "units", units)

    @property
    def n_rows(self) -> int:
        return int(self.lengths.sum())

    @classmethod
    def of_rows(cls, unit_of_row: torch.Tensor) -> "UnitRuns":
        """Run-length encoding of a per-row unit id (one pass)."""
        unit_of_row = torch.as_tensor(unit_of_row, dtype=torch.long)
        if unit_of_row.ndim != 1:
            raise ValidationError("unit_of_row", f"expected a 1-D tensor, got shape {tuple(unit_of_row.shape)}")
        if len(unit_of_row) == 0:
            return cls(torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long))
        starts = torch.cat([torch.zeros(1, dtype=torch.long),
                            torch.nonzero(unit_of_row[1:] != unit_of_row[:-1]).squeeze(1) + 1])
        ends = torch.cat([starts[1:], torch.tensor([len(unit_of_row)])])
        return cls(ends - starts, unit_of_row[starts])


class _UnitIndex:
    """Rows grouped by unit, built once so per-step sampling is pure array indexing.

    Built from runs (``UnitRuns``) by a stable counting sort of the run units (``stable_group_order``), then
    runs of one unit that touch are merged: unit u's rows, in increasing order, occupy the "unit-major" positions
    ``[offsets[u], offsets[u] + counts[u])``. A position maps to its row by

    - one addition when every unit's rows are contiguous (data logged unit by unit);
    - a binary search among the unit's own runs (cumulative lengths; ``ceil(log2(most runs of a unit))``
      vectorised steps) when runs are long (episodes of interleaved units);
    - one gather from a per-row order when runs are short (rows of units interleaved row by row: a per-row array
      is then no larger than the runs).

    Memory and time are linear in the number of runs (in the last case, of rows). The per-step work runs in numpy
    on a few hundred values (cheaper per call than torch); only the draws come from the torch generator.
    """

    SHORT_RUNS = 4  # mean rows per run below which a per-row order replaces the search

    def __init__(self, unit_of_row: "torch.Tensor | UnitRuns", n_units: int, n_rows: int):
        if n_units < 0:  # (0: a cell without units; every draw is empty)
            raise ValidationError("n_units", f"must be >= 0, got {n_units}")
        if isinstance(unit_of_row, UnitRuns):
            runs = unit_of_row
            if runs.n_rows != n_rows:
                raise ValidationError("unit_of_row", f"runs cover {runs.n_rows} rows, the data has {n_rows}")
        else:
            unit_of_row = torch.as_tensor(unit_of_row, dtype=torch.long)
            if unit_of_row.shape != (n_rows,):
                raise ValidationError("unit_of_row", f"expected shape ({n_rows},), got {tuple(unit_of_row.shape)}")
            runs = UnitRuns.of_rows(unit_of_row)
        units = runs.units.cpu().numpy()
        if len(units) and (units.min() < 0 or units.max() >= n_units):
            raise ValidationError("unit_of_row", f"unit ids must lie in [0, {n_units})")
        self.n_units = n_units
        order, _ = stable_group_order(units, n_units)
        lengths = runs.lengths.cpu().numpy()
        unit, start, length = units[order], (np.cumsum(lengths) - lengths)[order], lengths[order]
        if len(unit):  # merge touching runs of one unit (consecutive episodes of one expert)
            head = np.ones(len(unit), dtype=bool)
            head[1:] = (unit[1:] != unit[:-1]) | (start[1:] != start[:-1] + length[:-1])
            heads = np.flatnonzero(head)
            unit, start, length = unit[heads], start[heads], np.add.reduceat(length, heads)
        self._run_end = np.cumsum(length)  # unit-major position just past each run
        runs_per_unit = np.bincount(unit, minlength=n_units)
        self._run_offsets = np.zeros(n_units + 1, dtype=np.int64)  # unit u's runs: [_run_offsets[u], [u + 1])
        np.cumsum(runs_per_unit, out=self._run_offsets[1:])
        ends = np.concatenate([[0], self._run_end])[self._run_offsets]
        self._offsets, self._counts = ends[:-1].copy(), np.diff(ends)
        self.offsets = torch.from_numpy(self._offsets)  # unit u's first unit-major position
        self.counts = torch.from_numpy(self._counts)  # rows of unit u
        self._run_start, self._run_len = start, length
        most_runs = int(runs_per_unit.max()) if n_units else 0
        if most_runs <= 1:  # contiguous units: row = the unit's first row + the position within the unit
            self.mode = "contiguous"
            self._first_row = np.zeros(n_units, dtype=np.int64)
            owning = runs_per_unit > 0
            self._first_row[owning] = start[self._run_offsets[:-1][owning]]
        elif n_rows < self.SHORT_RUNS * len(length):
            self.mode = "order"
            self._order = concat_ranges(start, length)  # rows in unit-major order
        else:
            self.mode = "search"
            self._search_steps = math.ceil(math.log2(most_runs))
            self._run_base = start - (self._run_end - length)  # row = base + unit-major position

    def rows_of(self, units: torch.Tensor, rows_per_unit: Optional[int], generator: torch.Generator,
                replace: bool = True):
        """(row indices, position of their unit in ``units``) for the given units (LongTensors).

        ``rows_per_unit`` None: every row of each unit, in increasing row order. Otherwise each unit owning rows
        contributes ``rows_per_unit`` rows, each uniform over its rows with replacement: position
        ``floor(U * count)`` for a float64 uniform U on the 2**-53 grid, so each row's probability is within
        2**-53 of ``1 / count``. ``replace=False``: min(rows_per_unit, count) DISTINCT rows, a uniform subset
        (Floyd's algorithm, vectorised over units), so a unit never contributes a row twice.
        """
        units = units.numpy()
        counts = self._counts[units]
        if rows_per_unit is None:
            first = self._run_offsets[units]
            runs = concat_ranges(first, self._run_offsets[units + 1] - first)
            rows = concat_ranges(self._run_start[runs], self._run_len[runs])
            return torch.from_numpy(rows), torch.from_numpy(np.repeat(np.arange(len(units)), counts))
        if not replace:
            return self._distinct_rows(units, counts, rows_per_unit, generator)
        position = np.flatnonzero(counts)
        if rows_per_unit > 1:
            position = np.repeat(position, rows_per_unit)
        owned = counts[position]
        draws = torch.rand(len(position), dtype=torch.float64, generator=generator).numpy()
        draws *= owned
        within = np.minimum(draws.astype(np.int64), owned - 1)  # floor (draws >= 0); U * count may round up
        return torch.from_numpy(self._rows_at(units[position], within)), torch.from_numpy(position)

    def _distinct_rows(self, units: np.ndarray, counts: np.ndarray, k: int, generator: torch.Generator):
        """min(k, count) distinct rows of each unit, uniform over its subsets of that size (Floyd 1987: for j = count
        - k .. count - 1 draw t uniform on [0, j]; take t unless already taken, else j)."""
        take = np.minimum(counts, k)
        within = np.broadcast_to(np.arange(k), (len(units), k)).copy()  # units owning <= k rows: all of them
        big = np.flatnonzero(counts > k)
        if len(big):
            c = counts[big]
            draws = torch.rand((len(big), k), dtype=torch.float64, generator=generator).numpy()
            for step in range(k):
                j = c - k + step
                t = np.minimum((draws[:, step] * (j + 1)).astype(np.int64), j)
                taken = (within[big, :step] == t[:, None]).any(axis=1) if step else np.zeros(len(big), bool)
                within[big, step] = np.where(taken, j, t)
        keep = np.arange(k)[None, :] < take[:, None]
        position = np.broadcast_to(np.arange(len(units))[:, None], (len(units), k))[keep]
        return (torch.from_numpy(self._rows_at(units[position], within[keep])), torch.from_numpy(position))

    def rows_at(self, units: torch.Tensor, within: torch.Tensor) -> torch.Tensor:
        """Row index of the ``within[i]``-th row (in increasing row order) of unit ``units[i]``; needs
        ``0 <= within[i] < counts[units[i]]``."""
        return torch.from_numpy(self._rows_at(np.asarray(units, dtype=np.int64), np.asarray(within, dtype=np.int64)))

    def _rows_at(self, units: np.ndarray, within: np.ndarray) -> np.ndarray:
        if self.mode == "contiguous":
            return self._first_row[units] + within
        target = self._offsets[units] + within
        if self.mode == "order":
            return self._order[target]
        # The first of the unit's runs [lo, hi] whose end passes the target (the unit owns it: lo <= hi).
        lo, hi = self._run_offsets[units], self._run_offsets[units + 1] - 1
        for _ in range(self._search_steps):
            mid = (lo + hi) >> 1
            right = self._run_end[mid] <= target
            lo = np.where(right, mid + 1, lo)
            hi = np.where(right, hi, mid)
        return self._run_base[lo] + target


def poisson_subset(n: int, rate: float, generator: torch.Generator, *, chunk: Optional[int] = None) -> torch.Tensor:
    """Poisson sampling of ``range(n)``: each index included independently with probability ``rate``.

    Returns the included indices in increasing order (LongTensor), in time O(rate * n) rather than O(n), from
    geometric gaps: with G_1, G_2, ... i.i.d. Geometric(rate) on {0, 1, ...} (failures before a success), the
    included indices are P_1 = G_1, P_{j+1} = P_j + 1 + G_{j+1}, as long as they are < n.

    Why this is Poisson sampling (each index independently with probability q = ``rate``): for any set
    S = {s_1 < ... < s_k} of [0, n), the output is S exactly when G_1 = s_1, G_{j+1} = s_{j+1} - s_j - 1
    (j < k) and the next index P_{k+1} = s_k + 1 + G_{k+1} is >= n, i.e. G_{k+1} >= n - 1 - s_k. With
    P(G = g) = q (1 - q)^g and P(G >= g) = (1 - q)^g, that probability is
    prod_j q (1 - q)^{g_j} * (1 - q)^{n - 1 - s_k} = q^k (1 - q)^{(s_k - k + 1) + (n - 1 - s_k)} = q^k (1 - q)^{n - k},
    the law of n independent Bernoulli(q) inclusions (the number included is Binomial(n, q)). Each gap comes by
    inversion: G = floor(log(1 - U) / log(1 - q)) with U uniform on [0, 1) has P(G >= g) = P(1 - U <= (1 - q)^g)
    = (1 - q)^g. In floating point U is a float64 on the 2**-53 grid (torch's CPU ``rand``), so each of these
    tail probabilities is met to within 2**-53 plus a few ulps of rounding in ``log``: far finer than the
    float32 comparison ``rand(n) < q`` (a 2**-24 grid) of a Bernoulli mask.

    Randomness comes only from ``generator`` (the run's secret stream): the output is a deterministic function
    of its state. Gaps are drawn ``chunk`` at a time (default: the expected count plus six standard deviations,
    so a second chunk is rarely needed); drawing more is the same process continued, so any ``chunk`` gives the
    same law.
    """
    if rate >= 1.0:
        return torch.arange(n)
    if n == 0:
        return torch.zeros(0, dtype=torch.long)
    log_keep = math.log1p(-rate)  # log(1 - q) < 0
    mean = rate * n
    if chunk is None:
        chunk = int(mean + 6.0 * math.sqrt(mean) + 16)
    elif chunk < 1:
        raise ValidationError("chunk", f"must be >= 1, got {chunk}")
    pieces, next_start = [], 0.0  # next_start: the first index the next gap may land on
    while True:
        # Uniforms from the generator; the arithmetic in numpy (cheaper per call than torch on a few hundred values).
        gaps = torch.rand(chunk, dtype=torch.float64, generator=generator).numpy()
        np.log1p(np.negative(gaps, out=gaps), out=gaps)  # log(1 - U), U in [0, 1): finite, <= 0
        gaps /= log_keep
        np.floor(gaps, out=gaps)
        np.minimum(gaps, float(n), out=gaps)  # a gap >= n lands past the end anyway
        gaps += 1.0
        positions = np.cumsum(gaps, out=gaps)  # exact: integers far below 2**53
        positions += next_start - 1.0
        inside = int(np.searchsorted(positions, float(n)))  # positions are increasing: those < n come first
        pieces.append(positions[:inside])
        if inside < chunk:
            break
        next_start = float(positions[-1]) + 1.0
    return torch.from_numpy((pieces[0] if len(pieces) == 1 else np.concatenate(pieces)).astype(np.int64))


class PoissonUnitSource:
    """Poisson sampling over privacy units (experts, trajectories or transitions); add/remove adjacency.

    Each of the ``n_units`` units is included independently with ``sample_rate`` (``poisson_subset``: geometric
    gaps, O(rate * n_units) per step). A sampled unit contributes ``rows_per_unit`` rows drawn uniformly with
    replacement from its own rows (``replace=False``: min(rows_per_unit, its rows) distinct rows; None: all its
    rows), so its gradient is an average over its rows and never mixes units: its clipped contribution is bounded
    by the clip whatever the number of rows. Units owning no rows still count in the population. DP-SGD divides the noisy sum by
    ``expected_batch_size``: ``expected_batch`` when given (a public constant, e.g. the configured B when the rate
    is B over a released estimate of the number of units), else ``sample_rate * n_units``, which is public only
    where the number of units is (replace-one neighbours).

    ``unit_of_row`` is every row's unit (a tensor ``[n_rows]``) or the same as runs of rows (``UnitRuns``: one
    per episode for transitions). A column of ``data`` is a tensor or any object with ``shape``, ``to(device)``
    and ``index_select(0, rows)`` (e.g. ``TrajectoryDataset.transition_columns``' observations, gathered from
    the episode layout on demand): each step gathers only the sampled rows.
    """

    def __init__(
        self,
        data: Mapping[str, torch.Tensor],
        unit_of_row: "torch.Tensor | UnitRuns",
        n_units: int,
        sample_rate: float,
        rows_per_unit: Optional[int] = None,
        *,
        unit: PrivacyUnit | str | None = None,
        expected_batch: Optional[float] = None,
        replace: bool = True,
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
        self.replace = bool(replace)
        # Without replacement a unit owning fewer rows contributes fewer: blocks of unequal size.
        self.layout = RowLayout(rows_per_unit if self.replace else None)

    @classmethod
    def from_dataset(
        cls,
        dataset,
        data: Mapping[str, torch.Tensor],
        sample_rate: float,
        rows_per_unit: Optional[int] = None,
        expected_batch: Optional[float] = None,
        replace: bool = True,
    ) -> "PoissonUnitSource":
        """Rows grouped by the dataset's own unit: ``data`` holds one row per transition or one per episode
        (e.g. padded trajectories); every unit of the dataset counts in the population, rows or not."""
        n_rows = _check_rows(data)
        units = torch.from_numpy(np.array(dataset.unit_ids, dtype=np.int64))
        if n_rows == dataset.n_transitions:
            unit_of_row = UnitRuns(torch.from_numpy(np.array(dataset.episode_lengths, dtype=np.int64)), units)
        elif n_rows == dataset.n_episodes:
            unit_of_row = UnitRuns(torch.ones(len(units), dtype=torch.long), units)
        else:
            raise ValidationError(
                "data", f"{n_rows} rows: expected one per transition ({dataset.n_transitions}) or per episode "
                f"({dataset.n_episodes})"
            )
        return cls(data, unit_of_row, dataset.n_units, sample_rate, rows_per_unit, unit=dataset_unit(dataset),
                   expected_batch=expected_batch, replace=replace)

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

    def sample_units(self, generator: torch.Generator) -> torch.Tensor:
        """One step's Poisson sample of units (increasing ids), from ``generator`` alone."""
        return poisson_subset(self.n_units, self.sample_rate, generator)

    def sample(self, generator: torch.Generator) -> Batch:
        chosen = self.sample_units(generator)
        rows, position = self.index.rows_of(chosen, self.rows_per_unit, generator, self.replace)
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
        unit_of_row: "torch.Tensor | UnitRuns",
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
