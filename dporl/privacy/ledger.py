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

This module holds the ledger's run policy (opening stages, budget checks, charging); the stage record is in
``dporl.privacy.ledger_stages``, the composition of the stages into a report (a pure function of the recorded
stages) in ``dporl.privacy.ledger_composition``, the report and its presentation in ``dporl.privacy.ledger_report``,
and the journal and saved state in ``dporl.privacy.ledger_journal``. Their public names are re-exported here.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

from dporl.privacy.accountants import (
    Accountant,
    Mechanism,
    adjacency,
    analysis_name,
    check_analysable,
    check_count,
    check_delta,
    check_mechanism,
    spends_nothing,
    within_budget,
)
from dporl.privacy.events import PrivacyEvent
from dporl.privacy.ledger_composition import compose
from dporl.privacy.ledger_journal import LedgerJournal
from dporl.privacy.ledger_report import CellReport, PaperClaim, PrivacyReport, StageReport
from dporl.privacy.ledger_stages import SharedBudget, Stage, check_budget, check_relation
from dporl.privacy.partition import UnitPartition
from dporl.privacy.units import PrivacyUnit, Relation, as_unit
from dporl.utils.validation import PrivacyBudgetError, ValidationError, check_positive, check_probability

__all__ = [
    "CellReport", "LedgerJournal", "PaperClaim", "PrivacyLedger", "PrivacyReport", "SharedBudget", "Stage",
    "StageReport",
]


class PrivacyLedger(LedgerJournal):
    """Named stages composed into one run's guarantee: sequentially, or in parallel over the cells of a partition."""

    def __init__(self, budget: Optional[tuple[float, float]] = None, relation: Relation | str = Relation.ADD_REMOVE
                 ) -> None:
        self.relation = check_relation(relation)
        self.stages: dict[str, Stage] = {}
        self.paper_claims: list[PaperClaim] = []
        self.void_reason: Optional[str] = None
        self.budget = None if budget is None else check_budget("ledger.budget", budget)
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
        return compose(
            self.stages.values(), relation=self.relation, assumptions=self.assumptions, paper_claims=self.paper_claims,
            void=self.void_reason, partition=self.unit_partition, extra=extra,
        )
