"""A private count of the units: what every count-dependent quantity of an add/remove run is derived from.

Under add/remove neighbours D and D' differ by one unit, so the number of units m is itself private: a sampling rate
B / m, a noise multiplier calibrated for it, a step count, the digits of the printed epsilon, a refusal "batch 64
exceeds the 57 units" would each tell D from D' deterministically, and no noise analysis covers that. A run
therefore releases one private estimate m~ of m, charged in its own ledger stage (``COUNT_STAGE``) before anything
uses it, and derives everything from m~ (a function of a released value is post-processing). Under replace-one
neighbours m is the same in D and D' (public by definition) and no count is needed (``Units.public``).

Mechanism (``release_count``): m~ = m + Z, Z discrete Laplace, P[Z = z] proportional to exp(-eps |z|) (the
two-sided geometric mechanism, Ghosh, Roughgarden, Sundararajan 2009), drawn exactly by
``dporl.privacy.secure_noise.sample_discrete_laplace`` (Canonne, Kamath, Steinke 2020) from the run's secret stream
``COUNT_STREAM``. The count has sensitivity 1, so the release is pure eps-DP; its privacy loss takes only the values
+eps and -eps, with probabilities e^eps / (1 + e^eps) and 1 / (1 + e^eps): exactly the privacy loss distribution of
the worst-case (eps, 0)-DP pair, so the event recorded is ``ApproxDPEvent(eps, 0)`` (exact, not an upper bound; a
continuous ``LaplaceEvent`` would under-state it in a PLD). Why discrete Laplace rather than Gaussian: pure DP
(nothing of the run's delta is spent), an integer release (no floating-point low bits to attack, Mironov 2012), and
an exact tail for the lower bound below; at sensitivity 1 and eps ~ 0.1 its spread (sqrt 2 / eps) is below a
Gaussian's at the same (eps, delta).

Cells. With a ``UnitPartition`` (keyed hash of unit ids) the count is a histogram: one noisy count per cell, each
with its own Z. Adding or removing one unit changes exactly one cell's count by 1 (L1 sensitivity 1), so the whole
vector is eps-DP for every unit: one stage touching every cell, the parallel composition of per-cell counts. The
total m~ is the sum of the cells' (post-processing).

Lower confidence bound (``ReleasedCount.lower_bound``). P[Z > t] = P[Z >= t + 1] = e^{-eps (t + 1)} / (1 + e^{-eps})
for integers t >= 0, so with t the smallest integer making this <= beta, L = m~ - t satisfies P[m < L] <= beta on
every dataset. A check that must hold for the TRUE m (the stable-prefix release needs m p_min >= G0, and so does the
neighbour it is compared with) is made on L - 1 instead:

- if the pair (D, D') satisfies the premise, the released m~ and the decision it drives are post-processing of an
  eps-DP release, and the mechanism that relies on the premise keeps its own guarantee;
- if it does not (min(m, m') p_min < G0, so max(m, m') <= m_crit, m_crit the smallest count meeting the premise),
  passing the check (L - 1 >= m_crit, i.e. L > max(m, m')) needs Z > t on whichever dataset runs: probability
  <= beta. Otherwise only m~ and "refused" are released, eps-DP. So for every epsilon' the pair's hockey-stick
  divergence is at most that of the other events plus beta.

Cells without units. Under add/remove whether a cell of a partition holds any unit is private: a cell of one unit
in D is empty in D minus that unit, so a run that refused an empty cell would tell the two apart every time.
``UnitPartition.split`` therefore gives an empty cell as a dataset of no units, and every mechanism a run applies to
a cell is the same mechanism over zero units (DP-SGD steps of noise only, noisy sums of nothing, whose released
denominators then say "no estimate"): defined, and covered by that mechanism's own analysis. A run refuses a cell
only on its released count (``check_cells_hold_units``: m~_c < 1), a function of a released value: nothing is
charged for it. (A lower confidence bound per cell, as for the stable-prefix precondition, would also be sound, but
it guards nothing here and its margin is large: at the default count epsilon 0.01 and beta = 0.005 delta over four
cells it is 1750 units per cell, which would refuse held-out cells of a thousand units.)

The failure probability is charged to the count stage as ``ApproxDPEvent(0, 2 beta)`` (``CountPlan.events``):
composed by PLD a (0, b) event adds b (1 - delta_rest) >= b / 2 at any reported delta <= 1/2, so 2 beta covers the
additive beta above; basic composition adds 2 beta to the deltas. Runs that rely on no lower bound charge nothing
for it (``failure = 0``: the count stage is (eps, 0)-DP).
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass
from fractions import Fraction
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from dporl.privacy.events import ApproxDPEvent, PrivacyEvent
from dporl.privacy.partition import UnitPartition
from dporl.privacy.randomness import SecretRoot
from dporl.privacy.secure_noise import sample_discrete_laplace
from dporl.utils.validation import PrivacyBudgetError, ValidationError, check_positive, check_probability

COUNT_STAGE = "unit_count"
COUNT_STREAM = "unit_count/noise"
WHOLE = "all"  # the one cell of a count without a partition
ANALYSIS = (
    "discrete Laplace count of the units (two-sided geometric mechanism, sensitivity 1 under add/remove: pure eps; "
    "one count per cell of the partition, L1 sensitivity 1 over the cells)"
)
# beta = this fraction of the run's delta when a check relies on the count's lower bound (charged as 2 beta).
LOWER_BOUND_FAILURE = 0.005


def tail_margin(epsilon: float, failure: float) -> int:
    """The smallest integer t >= 0 with P[Z > t] <= ``failure`` for Z discrete Laplace of privacy ``epsilon``."""
    check_positive("count.epsilon", epsilon)
    check_probability("count.failure", failure, allow_zero=False, allow_one=False)
    # P[Z > t] = exp(-eps (t + 1)) / (1 + exp(-eps)) <= failure  <=>  t + 1 >= log(1 / (failure (1 + e^-eps))) / eps
    needed = math.log(1.0 / (failure * (1.0 + math.exp(-epsilon)))) / epsilon
    t = max(0, math.ceil(needed) - 1)
    while t > 0 and _upper_tail(epsilon, t - 1) <= failure:  # float rounding of the logarithm: the exact smallest
        t -= 1
    while _upper_tail(epsilon, t) > failure:
        t += 1
    return t


def _upper_tail(epsilon: float, t: int) -> float:
    """P[Z > t] for integer t >= 0."""
    return math.exp(-epsilon * (t + 1)) / (1.0 + math.exp(-epsilon))


@dataclass(frozen=True)
class CountPlan:
    """The count a run releases, from public inputs only: its epsilon, the cells it counts (the run's partition;
    None: one count over every unit) and the failure probability of the lower bound a later check relies on (0:
    no check relies on one)."""

    epsilon: float
    cells: Optional[tuple[str, ...]] = None
    failure: float = 0.0

    def __post_init__(self) -> None:
        check_positive("count.epsilon", self.epsilon)
        check_probability("count.failure", self.failure, allow_one=False)
        if self.cells is not None and (not self.cells or len(set(self.cells)) != len(self.cells)
                                       or WHOLE in self.cells):
            raise ValidationError("count.cells", f"expected distinct cell names, got {self.cells!r}")

    @property
    def budget(self) -> tuple[float, float]:
        """(epsilon, delta) of the count stage: delta is the lower bound's charged failure (0 without one)."""
        return self.epsilon, 2.0 * self.failure

    @property
    def events(self) -> list[tuple[PrivacyEvent, int]]:
        """What the stage records (module docstring): the count, and the lower bound's failure when one is used."""
        events: list[tuple[PrivacyEvent, int]] = [(ApproxDPEvent(self.epsilon, 0.0), 1)]
        if self.failure > 0:
            events.append((ApproxDPEvent(0.0, 2.0 * self.failure), 1))
        return events

    @property
    def names(self) -> tuple[str, ...]:
        return (WHOLE,) if self.cells is None else self.cells


@dataclass(frozen=True)
class Units:
    """The numbers of units a run derives its sampling rates, noise, step counts, thresholds and refusals from.

    Either released by the count (``released=True``: noisy, add/remove) or public by the neighbouring relation
    (replace-one: the exact counts). ``cells`` maps each cell of the run's partition (or ``WHOLE``) to its count;
    ``lower`` bounds the true total from below except with probability ``failure``.
    """

    cells: Mapping[str, float]
    lower: float
    released: bool
    epsilon: Optional[float] = None  # the count's (released only)
    failure: float = 0.0

    @property
    def total(self) -> float:
        return float(sum(self.cells.values()))

    def of(self, cell: Optional[str] = None) -> float:
        """The count of ``cell`` (None: every unit)."""
        if cell is None:
            return self.total
        if cell not in self.cells:
            raise ValidationError("count.cell", f"no count for cell {cell!r} (cells: {sorted(self.cells)})")
        return float(self.cells[cell])

    def describe(self, cell: Optional[str] = None) -> str:
        """How a refusal names the count it used."""
        value = self.of(cell)
        where = "" if cell is None or cell == WHOLE else f" in cell {cell!r}"
        if self.released:
            return (f"the released estimate of the number of units{where} (m~ = {value:g}, a noisy count at "
                    f"eps={self.epsilon:g}; stage {COUNT_STAGE!r})")
        return f"the {value:g} units{where} (public: the relation is replace-one)"

    @staticmethod
    def public(counts: Mapping[str, int]) -> "Units":
        """Exact counts, public by the relation (replace-one): no noise, the lower bound is the count itself."""
        total = float(sum(counts.values()))
        return Units({k: float(v) for k, v in counts.items()}, total, released=False)


@dataclass(frozen=True)
class ReleasedCount:
    """What the count stage released: one noisy integer per cell (``WHOLE`` without a partition)."""

    counts: Mapping[str, int]
    epsilon: float
    failure: float

    @property
    def total(self) -> int:
        return int(sum(self.counts.values()))

    def lower_bound(self) -> int:
        """L with P[true total < L] <= failure (the total's noise is the sum of the cells'; bounded by a union bound
        over the cells: each cell's Z_c > t with failure / cells)."""
        if self.failure <= 0:
            raise ValidationError("count.failure", "this count was planned without a lower bound (failure 0)")
        per_cell = self.failure / len(self.counts)
        return self.total - len(self.counts) * tail_margin(self.epsilon, per_cell)

    def units(self) -> Units:
        lower = self.lower_bound() if self.failure > 0 else -math.inf
        return Units({k: float(v) for k, v in self.counts.items()}, float(lower), released=True,
                     epsilon=self.epsilon, failure=self.failure)

    def to_dict(self) -> dict[str, Any]:
        """The released fields (``privacy_report.json``: ``stages[name=unit_count].released``)."""
        out: dict[str, Any] = {
            "count": self.total,
            "cells": None if list(self.counts) == [WHOLE] else {k: int(v) for k, v in self.counts.items()},
            "epsilon": self.epsilon,
            "noise": f"discrete Laplace, P[z] ~ exp(-{self.epsilon:g} |z|) per cell",
            "lower_bound": self.lower_bound() if self.failure > 0 else None,
            "lower_bound_failure": self.failure if self.failure > 0 else None,
        }
        return out

    @staticmethod
    def from_dict(payload: Any, plan: CountPlan) -> "ReleasedCount":
        """A released count read back from a run's journal, checked against the count ``plan`` of this run."""
        if not isinstance(payload, Mapping) or not isinstance(payload.get("count"), int):
            raise ValidationError("count", f"not a released count: {payload!r}")
        cells = payload.get("cells")
        counts = {WHOLE: payload["count"]} if cells is None else cells
        if (not isinstance(counts, Mapping) or set(counts) != set(plan.names)
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in counts.values())):
            raise ValidationError("count", f"the released count on disk ({payload!r}) does not match this run's "
                                  f"cells {list(plan.names)}")
        counts = {name: counts[name] for name in plan.names}  # (JSON on disk may hold them in another order)
        if sum(counts.values()) != payload["count"] or payload.get("epsilon") != plan.epsilon:
            raise ValidationError("count", "the released count on disk is inconsistent with this run's count plan")
        return ReleasedCount(dict(counts), plan.epsilon, plan.failure)


def check_cells_hold_units(units: Units, fractions: Mapping[str, float], field: str = "partition",
                           remedy: str = "") -> None:
    """Refuse, by name, a cell of ``fractions`` ({cell: its share of the units}) whose count in ``units`` is below
    one: the released estimate m~_c under add/remove (a function of the released count: module docstring, "Cells
    without units"), the public count under replace-one. The refusal says how many units in all would put a count of
    one plus three noise standard deviations in the cell, and that a larger count epsilon lowers the noise; its words
    do not depend on the count. ``remedy``: another way out (appended)."""
    for cell, fraction in fractions.items():
        count = units.of(cell)
        if count >= 1:
            continue
        if not units.released:
            raise ValidationError(field, f"cell {cell!r} holds no unit ({units.describe(cell)}): too few units for "
                                  f"this split (the cell takes a share {fraction:.3g} of the units){remedy}")
        spread = math.sqrt(2.0) / units.epsilon  # the standard deviation of the count's discrete Laplace noise
        wanted = 1.0 + 3.0 * spread
        raise ValidationError(
            field, f"cell {cell!r} holds no unit by the released count ({units.describe(cell)} < 1): too few units "
            f"for this split. The cell takes a share {fraction:.3g} of the units: about {math.ceil(wanted / fraction)} "
            f"units in all put {wanted:.4g} in it (one unit plus three standard deviations {spread:.4g} of the "
            f"count's noise); or a larger count_fraction (the count's share of epsilon: less noise){remedy}"
        )


def exact_counts(unit_keys: Sequence[str], partition: Optional[UnitPartition]) -> dict[str, int]:
    """The true number of units per cell (curator-side: the count mechanism's input, never released as such)."""
    if partition is None:
        return {WHOLE: len(unit_keys)}
    cells = partition.cell_of_keys(list(unit_keys))
    counts = np.bincount(cells, minlength=len(partition.names))
    return {name: int(counts[i]) for i, name in enumerate(partition.names)}


def release_count(
    plan: CountPlan, exact: Mapping[str, int], *, ledger, root: SecretRoot, unit: Any, stage: str = COUNT_STAGE
) -> ReleasedCount:
    """Charge the count stage, then release m~ per cell (module docstring). ``exact`` maps ``plan.names`` to the true
    counts; ``unit`` is the privacy unit counted; the cells are the ledger's partition's (the stage touches them).
    The stage must not exist yet: a count is drawn once per run (its secret stream is "<stage>/noise")."""
    if tuple(exact) != plan.names:
        raise ValidationError("count.cells", f"counts for {list(exact)}, plan for {list(plan.names)}")
    if stage in ledger.stages and len(ledger.stages[stage].accountant):
        raise PrivacyBudgetError(stage, "this ledger has already released this count of the units: it is drawn "
                                 "once per run and reused")
    if stage not in ledger.stages:  # (an attempt that opened the stage and stopped before charging it spent nothing)
        ledger.stage(stage, budget=plan.budget, mechanism="pld", unit=unit, analysis=ANALYSIS,
                     cells=None if plan.cells is None else list(plan.cells))
    for event, count in plan.events:  # paid (and journaled) before anything is drawn
        ledger.record(stage, event, count)
    rng = random.Random(root.integer(f"{stage}/noise", bits=256))
    scale = Fraction(1) / Fraction(plan.epsilon)  # exactly 1 / eps: P[z] ~ exp(-eps |z|)
    noisy = {name: int(exact[name]) + sample_discrete_laplace(scale, rng) for name in plan.names}
    return ReleasedCount(noisy, plan.epsilon, plan.failure)


__all__ = [
    "ANALYSIS",
    "COUNT_STAGE",
    "COUNT_STREAM",
    "CountPlan",
    "LOWER_BOUND_FAILURE",
    "ReleasedCount",
    "Units",
    "WHOLE",
    "check_cells_hold_units",
    "exact_counts",
    "release_count",
    "tail_margin",
]
