"""The privacy ledger of one run: named stages, each with its own accountant, budget and privacy unit.

A run may release in several stages (e.g. "release": T stable-prefix sparse-vector runs, (2 eps', beta)-DP each;
"train": mixture DP-SGD steps). Each stage is accounted on its own and refuses any event that would take it past
its budget (``PrivacyBudgetError``; the event is not recorded). ``report()`` states

- per stage: epsilon at the stage's delta, its analysis and privacy unit;
- basic composition: (sum of stage epsilons, sum of stage deltas), valid for any analyses;
- joint: one PLD over every event of every stage at the total delta (tighter; only when every event has a PLD
  and all stages share one neighbouring relation);

and the run's guarantee is the smaller epsilon of the sound totals at the total delta. Stages that protect
different privacy units are never combined into one number.

Checking the budget on every step would cost a full analysis per step, so a stage grants itself "headroom": it
verifies once that ``k`` more copies of the event fit (k doubling as steps arrive) and spends that headroom
without recomputation. Every recorded event has therefore been verified to fit before it was recorded.

A run-level budget (``PrivacyLedger(budget=(eps, delta))``) caps the whole run: every stage must then have a budget,
and a stage is refused at opening unless the stage budgets, composed basically, fit the run's. Since each stage
stays within its own budget, the run's guarantee (the smaller of basic composition and the joint PLD) never
exceeds the run budget, whatever state is restored from disk (restored stages and events are checked the same way).

Sharing the run budget. The split of a run budget into stage budgets is fixed before anything runs, and basic
composition of the stage budgets is what the run check above guarantees; one joint PLD over all stages' events is
usually much tighter (a mixed expert-level run at (10, 1e-5) split 5 + 5 guarantees about 7.1), so a fixed split
leaves budget unused. A stage opened with ``shares_run_budget=True`` (the last stage of a run; its ``budget`` is
its nominal share, used only for the opening check) may spend past that share: what must hold for it is the RUN's
budget, decided by the same traversal ``report()`` prints (the smaller of basic composition and the joint PLD, at
the total delta), with the candidate events added. While such a stage exists, every charge to any stage is
checked that way (a later charge elsewhere could otherwise eat the slack it spent), and no state on disk that puts
the run past its budget is loaded. ``shared_budget(stage, delta)`` states the target for calibrating such a stage
(the run's epsilon, the total delta, every other stage's events: ``dporl.privacy.calibration``'s ``prior``).
Sequential composition only: a sharing stage and stages naming cells of a partition are not mixed.

Parallel composition. A ledger may declare one ``UnitPartition`` (``partition``: units split into cells by a keyed
hash of their ids, never by the data) and each stage may name the cells it touches (``cells=``; default: every
cell). Each unit lives in exactly one cell, so its privacy loss is the sequential composition of the stages that
touch its cell (basic and joint PLD, as above), and the run's guarantee is the largest over cells: (max eps,
max delta). Stages over the same cell, or over all units, compose sequentially. The report says which it applied.
A run budget is then checked cell by cell. ``assume`` records a premise the guarantee rests on (printed with it);
it is for premises true of the relation printed, never for one it contradicts.

The neighbouring relation. ``PrivacyLedger(relation=...)`` fixes the relation the run's guarantee is for: add/remove
one unit (the default) or replace one unit's data (the number of units is then public). A replace-one ledger refuses
events analysed for add/remove only: mechanisms record ``relations.analysed_for(ledger.relation, event)``, so every
stage epsilon, budget check, calibration against ``shared_budget`` and the joint PLD use the replace-one analysis.
A stage budget may have delta 0 (a pure-DP stage such as the private count of the units).

Write-ahead journal (``attach_journal``): with a journal attached, every change of the ledger's state (a stage
opened, an event charged, a paper claim, a void) is handed to the journal BEFORE the call returns, so a mechanism
runs only after its cost is durable. ``authorise(stage, event, k)`` charges ``k`` runs ahead of time (one write for
a block of training steps); the next ``k`` ``record`` calls of that event consume the authorisation without
writing. Recovery loads the journal: every authorised event is charged as recorded, run or not (a crash can never
under-count, and a re-run can never re-price what an earlier attempt authorised).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from dporl.privacy.accountants import (
    Accountant,
    Mechanism,
    adjacency,
    analysis_name,
    check_count,
    check_delta,
    check_analysable,
    check_mechanism,
    epsilon_for,
    spends_nothing,
    within_budget,
)
from dporl.privacy.events import PrivacyEvent, event_to_dict
from dporl.privacy.partition import UnitPartition
from dporl.privacy.units import PrivacyUnit, Relation, as_unit
from dporl.utils.validation import PrivacyBudgetError, ValidationError, check_positive, check_probability


@dataclass(frozen=True)
class PaperClaim:
    """A published analysis's figure for something this run did, where that analysis does not cover what the run
    releases (e.g. Algorithm 3's rate-p*q accounting, the logged-prefix release, Theorem 5 of the functional-noise
    paper). Printed beside the report as "the paper's figure, NOT a guarantee"; never part of a guarantee."""

    name: str
    epsilon: float
    delta: float
    source: str  # which paper / theorem, and why it is not a guarantee here

    def describe(self) -> str:
        return (
            f"the paper's figure, NOT a guarantee: {self.name}: eps={self.epsilon:.4g}, delta={self.delta:g} "
            f"({self.source})"
        )

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "epsilon": self.epsilon, "delta": self.delta, "source": self.source}


@dataclass
class Stage:
    name: str
    budget: Optional[tuple[float, float]]  # (epsilon, delta) or None (no cap; report at `delta`)
    mechanism: str
    unit: PrivacyUnit
    accountant: Accountant
    delta: float  # the delta epsilon is reported at (the budget's delta when there is one)
    analysis: str  # what proved the events' guarantees, composed by the accountant
    # (event, how many more of it are already verified to fit); not saved: recomputed after a restore.
    headroom: tuple[Optional[PrivacyEvent], int] = (None, 0)
    grant: int = 1  # next headroom request size (doubles while requests succeed)
    cells: Optional[tuple[str, ...]] = None  # cells of the ledger's partition this stage touches (None: all units)
    # True: may spend past `budget` (its nominal share) while the run's guarantee stays within the run budget
    shares_run_budget: bool = False


@dataclass(frozen=True)
class SharedBudget:
    """What a stage sharing the run budget may spend: its events composed with ``prior`` (every other stage's
    events) by one PLD must fit (``epsilon``, ``delta``) = (the run's epsilon, the total delta of all stages)."""

    epsilon: float
    delta: float
    prior: tuple[tuple[PrivacyEvent, int], ...]
    mechanism: Mechanism = "pld"


@dataclass
class StageReport:
    name: str
    unit: PrivacyUnit
    analysis: str
    epsilon: float
    delta: float
    budget: Optional[tuple[float, float]]
    events: list[tuple[dict[str, Any], int]]
    cells: Optional[tuple[str, ...]] = None
    shares_run_budget: bool = False


@dataclass
class CellReport:
    """One cell of a partition: the stages that touch its units, composed sequentially."""

    name: str
    stages: list[str]
    epsilon: float
    delta: float
    analysis: str


@dataclass
class PrivacyReport:
    stages: list[StageReport]
    basic: Optional[tuple[float, float]]  # (sum eps, sum delta) over stages; None if units differ or no stage
    joint: Optional[tuple[float, float]]  # joint PLD (eps, total delta); None if not analysable
    joint_note: str
    unit: Optional[PrivacyUnit]
    relation: Optional[Relation]  # neighbouring relation every recorded event was analysed under
    notes: list[str] = field(default_factory=list)
    paper_claims: list[PaperClaim] = field(default_factory=list)
    void: Optional[str] = None  # why this run has no guarantee at all (e.g. a release no analysis covers)
    partition: Optional[UnitPartition] = None
    cells: Optional[list[CellReport]] = None  # per-cell composition, when stages touch different cells

    @property
    def composition(self) -> str:
        if self.cells is None:
            return "sequential: every stage touches every unit"
        return (
            "parallel over the cells of a partition of the units (" + self.partition.describe() + "): each unit "
            "lives in one cell; stages touching a cell compose sequentially; the guarantee is the largest cell's"
        )

    @property
    def guarantee(self) -> Optional[tuple[float, float, str]]:
        """(epsilon, delta, analysis) of the run: the smaller sound epsilon at the total delta (None when void);
        with cells, the largest cell's (max epsilon, max delta)."""
        return None if self.void is not None else self.bound

    @property
    def bound(self) -> Optional[tuple[float, float, str]]:
        """The guarantee's numbers whether or not the run is void (what the run budget is checked against)."""
        if self.cells is not None:
            if self.basic is None:  # units or relations differ: nothing combines
                return None
            worst = max(self.cells, key=lambda c: c.epsilon)
            return (
                worst.epsilon, max(c.delta for c in self.cells),
                f"parallel composition over cells (largest: {worst.name!r}, {worst.analysis})",
            )
        options = []
        if self.basic is not None:
            single = len(self.stages) == 1
            options.append((*self.basic, self.stages[0].analysis if single else "basic composition of the stages"))
        if self.joint is not None:
            options.append((*self.joint, "joint PLD over all stages' events"))
        return min(options, key=lambda option: option[0]) if options else None

    @property
    def neighbours(self) -> str:
        """The neighbouring relation in words."""
        if self.unit is None:
            return "neighbouring datasets: undefined (stages protect different units)"
        if self.unit.bounded_change:  # every record may move: no unit is added, removed or replaced
            return f"neighbouring datasets: {self.unit.meaning}"
        if self.relation == Relation.REPLACE_ONE:
            return (f"neighbouring datasets: replace one unit's data; the number of units is public, one unit = "
                    f"{self.unit.meaning}")
        return f"neighbouring datasets: {self.relation or Relation.ADD_REMOVE}, one unit = {self.unit.meaning}"

    def describe(self) -> str:
        lines = []
        for s in self.stages:
            budget = f" (budget eps={s.budget[0]:g}, delta={s.budget[1]:g})" if s.budget else ""
            if s.shares_run_budget:
                budget = (f" (budget: what the run's budget leaves after the other stages, by the run's guarantee; "
                          f"nominal share eps={s.budget[0]:g}, delta={s.budget[1]:g})")
            lines.append(
                f"stage {s.name!r}: eps={s.epsilon:.4g} at delta={s.delta:g}{budget}; unit: {s.unit}; "
                f"analysis: {s.analysis}"
            )
        if self.cells is not None:
            lines.append(f"composition: {self.composition}")
            for c in self.cells:
                lines.append(
                    f"cell {c.name!r} (stages {', '.join(c.stages) or 'none'}): eps={c.epsilon:.4g}, "
                    f"delta={c.delta:g}; {c.analysis}"
                )
        elif len(self.stages) > 1:
            if self.basic is not None:
                lines.append(f"basic composition: eps={self.basic[0]:.4g}, delta={self.basic[1]:g}")
            lines.append(
                f"joint PLD: eps={self.joint[0]:.4g}, delta={self.joint[1]:g}" if self.joint else
                f"joint PLD: not computed ({self.joint_note})"
            )
        guarantee = self.guarantee
        if self.void is not None:
            lines.append(f"NO GUARANTEE: {self.void}")
        elif guarantee is None:
            lines.append("no combined guarantee: " + "; ".join(self.notes or ["no stage recorded"]))
        else:
            lines.append(
                f"GUARANTEE: ({guarantee[0]:.4g}, {guarantee[1]:g})-DP, privacy unit: {self.unit} "
                f"({self.neighbours}); analysis: {guarantee[2]}"
            )
        lines.extend(f"note: {note}" for note in self.notes if guarantee is not None)
        lines.extend(claim.describe() for claim in self.paper_claims)
        return "\n".join(lines)

    def scalars(self) -> dict[str, float]:
        """What a run logs as its privacy scalars: ``privacy/epsilon`` is the run's guarantee over ALL stages (the
        largest cell's under parallel composition; absent when there is none), ``privacy/stage/<name>`` each
        stage's own epsilon beside it."""
        values = {f"privacy/stage/{s.name}": float(s.epsilon) for s in self.stages}
        guarantee = self.guarantee
        if guarantee is not None:
            values["privacy/epsilon"] = float(guarantee[0])
        return values

    def to_dict(self) -> dict[str, Any]:
        guarantee = self.guarantee
        return {
            "stages": [
                {
                    "name": s.name,
                    "unit": s.unit.name,
                    "unit_meaning": s.unit.meaning,
                    "analysis": s.analysis,
                    "epsilon": s.epsilon,
                    "delta": s.delta,
                    "budget": list(s.budget) if s.budget else None,
                    "events": [[event, count] for event, count in s.events],
                    "cells": None if s.cells is None else list(s.cells),
                    "shares_run_budget": s.shares_run_budget,
                }
                for s in self.stages
            ],
            "composition": self.composition,
            "partition": None if self.partition is None else self.partition.to_dict(),
            "cells": None if self.cells is None else [
                {"name": c.name, "stages": c.stages, "epsilon": c.epsilon, "delta": c.delta, "analysis": c.analysis}
                for c in self.cells
            ],
            "basic_composition": list(self.basic) if self.basic else None,
            "joint_pld": list(self.joint) if self.joint else None,
            "joint_note": self.joint_note,
            "guarantee": (
                None if guarantee is None else
                {"epsilon": guarantee[0], "delta": guarantee[1], "analysis": guarantee[2], "unit": self.unit.name,
                 "unit_column": self.unit.column, "relation": str(self.relation or Relation.ADD_REMOVE),
                 "neighbouring": self.neighbours}
            ),
            "void": self.void,
            "paper_figures_NOT_guarantees": [claim.to_dict() for claim in self.paper_claims],
            "notes": list(self.notes),
            "text": self.describe(),
        }


class PrivacyLedger:
    """Named stages composed into one run's guarantee: sequentially, or in parallel over the cells of a partition."""

    def __init__(self, budget: Optional[tuple[float, float]] = None, relation: Relation | str = Relation.ADD_REMOVE
                 ) -> None:
        self.relation = _check_relation(relation)
        self.stages: dict[str, Stage] = {}
        self.paper_claims: list[PaperClaim] = []
        self.void_reason: Optional[str] = None
        self.budget = None if budget is None else _check_budget("ledger.budget", budget)
        self._journal: Optional[Callable[[dict[str, Any]], None]] = None
        self._ahead: dict[tuple[str, PrivacyEvent], int] = {}  # authorised runs not yet recorded
        self.unit_partition: Optional[UnitPartition] = None
        self.assumptions: list[str] = []

    # ------------------------------------------------------------------ parallel composition, premises
    def partition(self, partition: UnitPartition) -> UnitPartition:
        """Declare the split of the units into cells that stages may name (``stage(..., cells=...)``).

        Only a ``UnitPartition`` (a keyed hash of unit ids with a public salt) is accepted: a split computed from
        the data would void parallel composition. Declared once (the same partition again is a no-op).
        """
        if not isinstance(partition, UnitPartition):
            raise ValidationError(
                "ledger.partition", f"expected a UnitPartition (keyed hash of unit ids), got {type(partition).__name__}: "
                "a split that depends on the data cannot be declared"
            )
        if self.unit_partition is not None and self.unit_partition != partition:
            raise ValidationError("ledger.partition", "a different partition is already declared for this run")
        if self.unit_partition is None:
            self.unit_partition = partition
            self._write()
        return partition

    def assume(self, assumption: str) -> None:
        """Record a premise the guarantee rests on (e.g. "the number of units is public"); printed with the report."""
        if not isinstance(assumption, str) or not assumption:
            raise ValidationError("ledger.assume", "state the assumption in words")
        if assumption not in self.assumptions:
            self.assumptions.append(assumption)
            self._write()

    # ------------------------------------------------------------------ write-ahead journal
    @property
    def journaled(self) -> bool:
        return self._journal is not None

    def attach_journal(self, write: Callable[[dict[str, Any]], None], recovered: Optional[dict[str, Any]] = None) -> None:
        """Hand every later change of the state to ``write`` (with the whole ``state_dict()``) before it takes effect.

        ``recovered`` is the state a journal held from an earlier attempt: all its events are charged as recorded,
        and whatever this ledger holds already (recorded before the journal was attached) is charged on top (a
        pipeline that repeats a mechanism on resume pays for it twice, never zero times).
        """
        if self._journal is not None:
            raise ValidationError("ledger.journal", "a journal is already attached")
        if recovered is not None:
            self._merge(recovered)
        self._journal = write
        self._write()

    def _write(self) -> None:
        if self._journal is not None:
            self._journal(self.state_dict())

    def _merge(self, recovered: dict[str, Any]) -> None:
        """This ledger := ``recovered`` plus every stage, event and claim this ledger holds (budgets checked)."""
        merged = PrivacyLedger(self.budget, self.relation)
        merged.load_state_dict(recovered)
        if merged.relation != self.relation:
            raise ValidationError("journal", f"the journal on disk is for {merged.relation} neighbours, this run's "
                                  f"guarantee is for {self.relation}")
        if self.unit_partition is not None:
            merged.partition(self.unit_partition)  # a different partition on disk is refused
        for assumption in self.assumptions:
            merged.assume(assumption)
        for name, s in self.stages.items():
            if name in merged.stages:
                other = merged.stages[name]
                if (other.budget, other.mechanism, other.unit, other.delta, other.shares_run_budget) != (
                    s.budget, s.mechanism, s.unit, s.delta, s.shares_run_budget
                ):
                    raise ValidationError(
                        "journal", f"stage {name!r} on disk ({other.budget}, {other.mechanism}, {other.unit}, shares "
                        f"the run budget: {other.shares_run_budget}) differs from this run's ({s.budget}, "
                        f"{s.mechanism}, {s.unit}, {s.shares_run_budget})"
                    )
            else:
                merged.stage(name, budget=s.budget, mechanism=s.mechanism, unit=s.unit,
                             delta=None if s.budget else s.delta, cells=s.cells,
                             shares_run_budget=s.shares_run_budget)
                merged.stages[name].analysis = s.analysis
            for event, count in s.accountant.history:
                merged._charge(name, event, count)
        for claim in self.paper_claims:
            if claim not in merged.paper_claims:
                merged.paper_claims.append(claim)
        if self.void_reason is not None:
            merged.void(self.void_reason)
        self.stages, self.paper_claims, self.void_reason = merged.stages, merged.paper_claims, merged.void_reason
        self.unit_partition, self.assumptions = merged.unit_partition, merged.assumptions
        self.budget = merged.budget

    def paper_claim(self, name: str, epsilon: float, delta: float, source: str) -> PaperClaim:
        """Record a published analysis's figure that is NOT a guarantee for this run (see ``PaperClaim``)."""
        if not source:
            raise ValidationError("paper_claim.source", "say which paper's analysis this is and why it is not a guarantee")
        claim = PaperClaim(str(name), float(epsilon), float(delta), str(source))
        self.paper_claims.append(claim)
        self._write()
        return claim

    def void(self, reason: str) -> None:
        """Mark the whole run as having NO guarantee (something it released is covered by no analysis)."""
        if not reason:
            raise ValidationError("ledger.void", "say why the run has no guarantee")
        self.void_reason = reason if self.void_reason is None else f"{self.void_reason}; {reason}"
        self._write()

    def stage(
        self,
        name: str,
        *,
        budget: Optional[tuple[float, float]] = None,
        mechanism: Mechanism = "rdp",
        unit: PrivacyUnit | str = "expert",
        delta: Optional[float] = None,
        analysis: Optional[str] = None,
        cells: Optional[tuple[str, ...] | list[str]] = None,
        shares_run_budget: bool = False,
    ) -> Stage:
        """Open a stage. ``delta`` (only without a budget) is the delta its epsilon is reported at.

        ``cells``: the cells of the declared partition whose units this stage touches (None: every unit).

        ``shares_run_budget``: the stage may spend past its ``budget`` (then its nominal share of the run budget)
        while the run's guarantee stays within the run budget (see the module docstring); needs a run budget.

        ``analysis`` names what proved the recorded events' guarantees when the accountant only composes them
        (e.g. a sparse-vector proof whose (eps, delta) runs the PLD composes); default: the accountant's name.
        """
        if name in self.stages:
            raise ValidationError("ledger.stage", f"stage {name!r} already exists")
        check_mechanism(mechanism, f"ledger.{name}.mechanism")
        unit = as_unit(unit)
        if budget is not None:
            if len(budget) != 2:
                raise ValidationError(f"ledger.{name}.budget", f"expected (epsilon, delta), got {budget!r}")
            eps = check_positive(f"ledger.{name}.budget.epsilon", budget[0])
            bdelta = check_delta(budget[1], f"ledger.{name}.budget.delta", allow_zero=True)
            if delta is not None and delta != bdelta:
                raise ValidationError(f"ledger.{name}.delta", "a budgeted stage reports at its budget's delta")
            budget, delta = (eps, bdelta), bdelta
        elif delta is None:
            raise ValidationError(f"ledger.{name}.delta", "a stage without a budget needs the delta to report at")
        else:
            delta = check_delta(delta, f"ledger.{name}.delta")
        cells = self._check_cells(name, cells)
        if self.budget is not None:
            self._check_fits_run(name, budget, cells)
        self._check_sharing(name, bool(shares_run_budget), cells)
        composed_by = analysis_name(mechanism)
        label = composed_by if analysis is None else f"{analysis}; composed by {composed_by}"
        stage = Stage(name, budget, mechanism, unit, Accountant(mechanism), float(delta), label, cells=cells,
                      shares_run_budget=bool(shares_run_budget))
        self.stages[name] = stage
        try:
            self._write()
        except BaseException:
            del self.stages[name]
            raise
        return stage

    def _check_cells(self, name: str, cells: Any) -> Optional[tuple[str, ...]]:
        if cells is None:
            return None
        if self.unit_partition is None:
            raise ValidationError(f"ledger.{name}.cells", "declare the partition first (ledger.partition)")
        if isinstance(cells, str) or not cells:
            raise ValidationError(f"ledger.{name}.cells", f"expected a non-empty list of cell names, got {cells!r}")
        unknown = [c for c in cells if c not in self.unit_partition.names]
        if unknown:
            raise ValidationError(
                f"ledger.{name}.cells", f"unknown cell {unknown[0]!r} (cells: {list(self.unit_partition.names)})"
            )
        cells = tuple(dict.fromkeys(cells))
        return None if set(cells) == set(self.unit_partition.names) else cells  # every cell: every unit

    def _check_fits_run(self, name: str, budget: Optional[tuple[float, float]], cells: Optional[tuple[str, ...]]) -> None:
        """Under a run budget, a new stage's budget must fit beside the others' (basic composition) in every cell
        it touches (all units when the ledger has no partition)."""
        if budget is None:
            raise PrivacyBudgetError(
                f"ledger.{name}.budget", f"the run has a total budget {self.budget}: every stage needs a budget"
            )
        names = self.unit_partition.names if self.unit_partition is not None else (None,)
        for cell in names:
            if cell is not None and cells is not None and cell not in cells:
                continue
            sharing = [s for s in self.stages.values() if cell is None or s.cells is None or cell in s.cells]
            eps = sum(s.budget[0] for s in sharing) + budget[0]
            delta = sum(s.budget[1] for s in sharing) + budget[1]
            if not (within_budget(eps, self.budget[0]) and within_budget(delta, self.budget[1])):
                where = "" if cell is None else f" in cell {cell!r}"
                raise PrivacyBudgetError(
                    f"ledger.{name}.budget",
                    f"stage budgets{where} would total (eps={eps:.6g}, delta={delta:.3g}), more than the run's budget "
                    f"(eps={self.budget[0]:g}, delta={self.budget[1]:g})",
                )

    def _check_sharing(self, name: str, shares: bool, cells: Optional[tuple[str, ...]]) -> None:
        """A stage sharing the run budget needs one, and composes sequentially with every other stage."""
        if shares and self.budget is None:
            raise PrivacyBudgetError(
                f"ledger.{name}.shares_run_budget", "only a ledger with a run budget has a budget to share"
            )
        sharing = shares or self._sharing()
        if sharing and (cells is not None or any(s.cells is not None for s in self.stages.values())):
            raise ValidationError(
                f"ledger.{name}.cells", "a stage sharing the run budget composes sequentially with every stage: "
                "stages over cells of a partition cannot be mixed with it"
            )

    def _sharing(self) -> bool:
        """Whether some stage shares the run budget (every charge is then checked against the run's guarantee)."""
        return any(s.shares_run_budget for s in self.stages.values())

    def shared_budget(self, stage: str, delta: float) -> SharedBudget:
        """The target a stage sharing the run budget is calibrated against (``dporl.privacy.calibration``'s
        ``prior``): the run's epsilon, the total delta of every stage (``delta``: this stage's, which need not be
        open yet) and every other stage's events. Any sigma / count calibrated to fit it leaves the run's guarantee
        (at most the joint PLD it bounds) within the run budget; events a PLD cannot analyse are refused."""
        if self.budget is None:
            raise PrivacyBudgetError(f"ledger.{stage}.shares_run_budget", "only a ledger with a run budget has a "
                                     "budget to share")
        delta = check_probability(f"ledger.{stage}.delta", delta, allow_zero=False, allow_one=False)
        others = [s for s in self.stages.values() if s.name != stage]
        total = sum(s.delta for s in others) + delta
        if not within_budget(total, self.budget[1]):
            raise PrivacyBudgetError(
                f"ledger.{stage}.delta", f"the stages' deltas would total {total:.3g}, more than the run's "
                f"delta={self.budget[1]:g}"
            )
        prior = tuple((e, c) for s in others for e, c in s.accountant.history if c)
        for event, _ in prior:
            if not spends_nothing(event):
                check_analysable(event, "pld")  # a named refusal when the joint analysis cannot cover an earlier stage
        return SharedBudget(self.budget[0], total, prior)

    def _get(self, name: str) -> Stage:
        if name not in self.stages:
            raise ValidationError("ledger.stage", f"no stage {name!r} (stages: {list(self.stages)})")
        return self.stages[name]

    def record(self, stage: str, event: PrivacyEvent, count: int = 1) -> None:
        """Record ``count`` runs of ``event`` in ``stage``; raises PrivacyBudgetError (recording nothing) if over.

        Runs already authorised (``authorise``) are consumed first and cost nothing more.
        """
        self._get(stage)
        count = check_count("count", count)
        self._check_relation(stage, event)
        ahead = self._ahead.get((stage, event), 0)
        used = min(ahead, count)
        if used:
            self._ahead[(stage, event)] = ahead - used
        self._charge(stage, event, count - used)

    def authorise(self, stage: str, event: PrivacyEvent, count: int) -> None:
        """Charge ``count`` runs of ``event`` now, before they run (the write-ahead step of a block of steps).

        The next ``count`` ``record`` calls of this event in this stage consume the authorisation. Runs authorised
        but never run stay charged: the ledger cannot know they did not leak.
        """
        count = check_count("count", count)
        self._check_relation(stage, event)
        self._charge(stage, event, count)
        self._ahead[(stage, event)] = self._ahead.get((stage, event), 0) + count

    def _check_relation(self, stage: str, event: PrivacyEvent) -> None:
        if self.relation == Relation.REPLACE_ONE and not spends_nothing(event) and adjacency(event) != self.relation:
            raise ValidationError(
                f"ledger.{stage}", f"this run's guarantee is for replace-one neighbours and {event} is analysed for "
                "add/remove only: record relations.analysed_for(ledger.relation, event)"
            )

    def adopt_authorised(self, stage: str, event: PrivacyEvent, count: int) -> None:
        """Declare that the last ``count`` recorded runs of ``event`` in ``stage`` (authorised by an earlier attempt,
        recovered from its journal) have not produced anything this run keeps: the next ``count`` ``record`` calls
        consume them without charging again. For a resumed loop that replays them from saved state with the same
        secret randomness (the same mechanism run, not a new one). Only runs already charged can be adopted."""
        s = self._get(stage)
        count = check_count("count", count)
        tail = s.accountant.history[-1] if s.accountant.history else None
        available = tail[1] if tail is not None and tail[0] == event else 0
        adopted = self._ahead.get((stage, event), 0) + count
        if adopted > available:
            raise ValidationError(
                f"ledger.{stage}", f"cannot adopt {adopted} authorised runs of {event}: the journal's last entry for "
                f"this stage charges {available} of them"
            )
        if count:
            self._ahead[(stage, event)] = adopted

    def _charge(self, stage: str, event: PrivacyEvent, count: int) -> None:
        s = self._get(stage)
        if count == 0:
            return
        if s.budget is not None and not spends_nothing(event):
            self._reserve(s, event, count)
        before = s.accountant.state_dict() if self._journal is not None else None
        s.accountant.record(event, count)
        if self._sharing():  # the other stages' headroom was verified against the run's state before this charge
            for other in self.stages.values():
                if other is not s:
                    other.headroom = (None, 0)
        try:
            self._write()
        except BaseException:  # not durable: not charged, and the caller must not run the mechanism
            s.accountant.load_state_dict(before)
            raise

    def remaining(self, stage: str, event: PrivacyEvent, limit: int) -> int:
        """Largest k <= ``limit`` such that k more runs of ``event`` fit the stage's budget (``limit`` if none)."""
        s = self._get(stage)
        limit = check_count("limit", limit)
        if s.budget is None or spends_nothing(event) or limit == 0:
            return limit
        if not self._fits(s, event, 1):
            return 0
        good, bad = 1, None
        while bad is None:  # doubling, then bisection: O(log k) analyses
            trial = min(2 * good, limit)
            if trial == good:
                return good
            if self._fits(s, event, trial):
                good = trial
            else:
                bad = trial
        while bad - good > 1:
            middle = (good + bad) // 2
            good, bad = (middle, bad) if self._fits(s, event, middle) else (good, middle)
        return good

    def _fits(self, s: Stage, event: PrivacyEvent, count: int) -> bool:
        """Whether ``count`` more ``event`` fit: the stage's own budget (unless it shares the run's) and, while some
        stage shares the run budget, the run's guarantee as ``report()`` computes it."""
        if not s.shares_run_budget and not within_budget(
            s.accountant.epsilon_with([(event, count)], s.delta), s.budget[0]
        ):
            return False
        return not self._sharing() or self._run_fits(self._report((s.name, event, count)))

    def _run_fits(self, report: "PrivacyReport") -> bool:
        bound = report.bound
        return bound is not None and within_budget(bound[0], self.budget[0]) and within_budget(bound[1], self.budget[1])

    def _reserve(self, s: Stage, event: PrivacyEvent, count: int) -> None:
        held_event, held = s.headroom
        if held_event != event:
            held, s.grant = 0, count
        if held >= count:
            s.headroom = (event, held - count)
            return
        # Ask for `grant` more than needed; fall back to exactly `count` near the end of the budget.
        wanted = count + max(s.grant, count)
        if self._fits(s, event, wanted):
            s.headroom, s.grant = (event, wanted - count), 2 * max(s.grant, count)
            return
        s.grant = count
        if not self._fits(s, event, count):
            spent = s.accountant.get_epsilon(s.delta)
            if self._sharing():
                bound = self.report().bound
                raise PrivacyBudgetError(
                    f"ledger.{s.name}",
                    f"recording {count} x {event} would take the run's guarantee past its budget "
                    f"eps={self.budget[0]:g}, delta={self.budget[1]:g} (stage spent so far: eps={spent:.4g} at "
                    f"delta={s.delta:g}; run so far: {'none' if bound is None else f'eps={bound[0]:.4g}'}); "
                    "nothing was recorded",
                )
            raise PrivacyBudgetError(
                f"ledger.{s.name}",
                f"recording {count} x {event} would exceed the budget eps={s.budget[0]:g} at delta={s.delta:g} "
                f"(spent so far: eps={spent:.4g}, {s.mechanism} analysis); nothing was recorded",
            )
        s.headroom = (event, 0)

    def spent(self, stage: str) -> float:
        """Epsilon spent by ``stage`` at its delta."""
        s = self._get(stage)
        return s.accountant.get_epsilon(s.delta)

    def report(self) -> PrivacyReport:
        report = self._report()
        guarantee = report.guarantee
        if self.budget is not None and guarantee is not None and not self._run_fits(report):
            # unreachable while every charge is checked; a guarantee above the budget is never printed
            raise PrivacyBudgetError(
                "ledger.budget", f"the run's guarantee ({guarantee[0]:.4g}, {guarantee[1]:g}) exceeds its budget "
                f"{self.budget}: refusing to report it"
            )
        return report

    def _report(self, extra: Optional[tuple[str, PrivacyEvent, int]] = None) -> PrivacyReport:
        """The report, as if ``extra`` = (stage, event, count) were recorded too: the one traversal that both prints
        the run's guarantee and decides whether a charge keeps it within the run budget."""
        histories = {name: list(s.accountant.history) for name, s in self.stages.items()}
        if extra is not None:
            histories[extra[0]].append((extra[1], extra[2]))

        def spent(s: Stage) -> float:
            if extra is None or extra[0] != s.name:
                return s.accountant.get_epsilon(s.delta)
            return s.accountant.epsilon_with([(extra[1], extra[2])], s.delta)

        stages = [
            StageReport(
                s.name,
                s.unit,
                s.analysis,
                spent(s),
                s.delta,
                s.budget,
                [(event_to_dict(e), c) for e, c in histories[s.name]],
                s.cells,
                s.shares_run_budget,
            )
            for s in self.stages.values()
        ]
        notes: list[str] = [f"assumes: {a}" for a in self.assumptions]
        units = list(dict.fromkeys(s.unit for s in self.stages.values()))
        unit = units[0] if len(units) == 1 else None
        relations = sorted(self._relations(histories))
        basic = None
        if not stages:
            notes.append("no stage recorded")
        elif unit is None:
            notes.append(
                f"stages protect different privacy units {[u.name for u in units]}: no single guarantee combines them"
            )
        elif len(relations) > 1:
            notes.append(f"stages use different neighbouring relations {relations}: no single guarantee combines them")
        else:
            basic = (sum(s.epsilon for s in stages), sum(s.delta for s in stages))
        joint, joint_note = None, ""
        if basic is not None and len(stages) > 1:
            joint, joint_note = self._joint(list(self.stages.values()), histories, basic[1])
        cells = None
        if self.unit_partition is not None and any(s.cells is not None for s in self.stages.values()):
            cells = [self._cell(name, stages, histories) for name in self.unit_partition.names]
        relation = relations[0] if len(relations) == 1 else (self.relation if not relations else None)
        return PrivacyReport(
            stages, basic, joint, joint_note, unit, relation, notes,
            list(self.paper_claims), self.void_reason, self.unit_partition, cells,
        )

    def _cell(self, name: str, reports: list[StageReport], histories: dict[str, list]) -> CellReport:
        """Sequential composition of the stages touching cell ``name``: the smaller of basic and joint PLD."""
        touching = [s for s in self.stages.values() if s.cells is None or name in s.cells]
        by_name = {r.name: r for r in reports}
        if not touching:
            return CellReport(name, [], 0.0, 0.0, "no stage touches this cell")
        basic = (sum(by_name[s.name].epsilon for s in touching), sum(s.delta for s in touching))
        if len(touching) == 1:
            return CellReport(name, [touching[0].name], *basic, touching[0].analysis)
        joint, _ = self._joint(touching, histories, basic[1])
        if joint is not None and joint[0] < basic[0]:
            return CellReport(name, [s.name for s in touching], *joint, "joint PLD over the cell's stages")
        return CellReport(name, [s.name for s in touching], *basic, "basic composition of the cell's stages")

    def _relations(self, histories: dict[str, list]) -> set[Relation]:
        """The neighbouring relations the events were analysed under (bounded change for reward units)."""
        return {
            Relation.BOUNDED_CHANGE if s.unit.bounded_change else adjacency(e)
            for s in self.stages.values()
            for e, c in histories[s.name]
            if c and not spends_nothing(e)
        }

    def _joint(
        self, stages: list[Stage], histories: dict[str, list], total_delta: float
    ) -> tuple[Optional[tuple[float, float]], str]:
        events = [(e, c) for s in stages for e, c in histories[s.name]]
        try:
            for event, _ in events:
                if not spends_nothing(event):
                    check_analysable(event, "pld")
        except ValidationError as exc:
            return None, str(exc)
        if total_delta >= 1:
            return None, "total delta >= 1"
        return (epsilon_for(events, total_delta, "pld"), total_delta), "PLD over all events"

    def state_dict(self) -> dict[str, Any]:
        return {
            "stages": [
                {
                    "name": s.name,
                    "budget": list(s.budget) if s.budget else None,
                    "mechanism": s.mechanism,
                    "unit": s.unit.to_dict(),
                    "delta": s.delta,
                    "analysis": s.analysis,
                    "accountant": s.accountant.state_dict(),
                    "cells": None if s.cells is None else list(s.cells),
                    "shares_run_budget": s.shares_run_budget,
                }
                for s in self.stages.values()
            ],
            "paper_claims": [claim.to_dict() for claim in self.paper_claims],
            "void": self.void_reason,
            "budget": list(self.budget) if self.budget else None,
            "partition": None if self.unit_partition is None else self.unit_partition.to_dict(),
            "assumptions": list(self.assumptions),
            "relation": self.relation.value,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore a saved state (a JSON-safe dict). Every restored stage and event is checked against this ledger's
        run budget (the saved one when this ledger has none) and each stage's own, so no state on disk can produce a
        guarantee above the budget; a malformed state is a ValidationError naming "ledger", never a KeyError."""
        try:
            restored = self._restore(state)
        except ValidationError:
            raise
        except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
            raise ValidationError("ledger", f"saved ledger state is malformed ({type(exc).__name__}: {exc})") from None
        self.stages, self.paper_claims, self.void_reason = restored.stages, restored.paper_claims, restored.void_reason
        self.unit_partition, self.assumptions = restored.unit_partition, restored.assumptions
        self.budget, self.relation = restored.budget, restored.relation
        self._ahead = {}
        self._write()

    def _restore(self, state: dict[str, Any]) -> "PrivacyLedger":
        if not isinstance(state, dict) or not isinstance(state["stages"], list):
            raise ValidationError("ledger", f"expected a saved ledger state, got {type(state).__name__}")
        saved_budget = state.get("budget")
        if self.budget is not None and saved_budget is not None and tuple(saved_budget) != self.budget:
            raise PrivacyBudgetError(
                "ledger.budget", f"the saved ledger was made for a run budget {tuple(saved_budget)}, this run's is "
                f"{self.budget}"
            )
        # A ledger without a run budget of its own (e.g. one reading a journal) takes the saved one.
        budget = self.budget if self.budget is not None or saved_budget is None else saved_budget
        restored = PrivacyLedger(budget, state.get("relation", Relation.ADD_REMOVE.value))
        if state.get("partition") is not None:
            restored.partition(UnitPartition.from_dict(state["partition"]))
        assumptions = state.get("assumptions", [])
        if not isinstance(assumptions, list) or not all(isinstance(a, str) and a for a in assumptions):
            raise ValidationError("ledger.assumptions", f"must be a list of non-empty strings, got {assumptions!r}")
        restored.assumptions = list(assumptions)
        for entry in state["stages"]:
            budget = tuple(entry["budget"]) if entry["budget"] is not None else None
            s = restored.stage(
                entry["name"], budget=budget, mechanism=entry["mechanism"], unit=PrivacyUnit.from_dict(entry["unit"]),
                delta=None if budget else entry["delta"], cells=entry.get("cells"),
                shares_run_budget=_flag(entry.get("shares_run_budget", False)),
            )
            if not isinstance(entry["analysis"], str):
                raise ValidationError("ledger", f"stage {s.name!r}: analysis must be a string")
            s.analysis = entry["analysis"]
            s.accountant.load_state_dict(entry["accountant"])
            own = s.budget is not None and not s.shares_run_budget  # a sharing stage: the run's check below
            if own and not within_budget(restored.spent(s.name), s.budget[0]):
                raise PrivacyBudgetError(
                    f"ledger.{s.name}", f"the saved state spends eps={restored.spent(s.name):.4g}, over the stage "
                    f"budget eps={s.budget[0]:g}: refusing to load it"
                )
        if restored._sharing() and not restored._run_fits(restored._report()):
            raise PrivacyBudgetError(
                "ledger.budget", f"the saved state puts the run past its budget {restored.budget}: refusing to load it"
            )
        restored.paper_claims = [
            PaperClaim(str(c["name"]), float(c["epsilon"]), float(c["delta"]), str(c["source"]))
            for c in state.get("paper_claims", [])
        ]
        void = state.get("void")
        if void is not None and not isinstance(void, str):
            raise ValidationError("ledger.void", f"must be a string or null, got {void!r}")
        restored.void_reason = void
        return restored


def _check_relation(relation: Any) -> Relation:
    try:
        relation = Relation(relation)
    except ValueError:
        relation = None
    if relation not in (Relation.ADD_REMOVE, Relation.REPLACE_ONE):
        raise ValidationError("ledger.relation", f"expected {Relation.ADD_REMOVE.value!r} or "
                              f"{Relation.REPLACE_ONE.value!r}")
    return relation


def _flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValidationError("ledger.shares_run_budget", f"must be true or false, got {value!r}")
    return value


def _check_budget(field: str, budget: Any) -> tuple[float, float]:
    if not isinstance(budget, (tuple, list)) or len(budget) != 2:
        raise ValidationError(field, f"expected (epsilon, delta), got {budget!r}")
    eps = check_positive(f"{field}.epsilon", budget[0])
    delta = check_delta(budget[1], f"{field}.delta")
    return eps, delta
