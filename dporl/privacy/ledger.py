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
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from dporl.privacy.accountants import (
    Accountant,
    ADD_REMOVE,
    Mechanism,
    adjacency,
    analysis_name,
    check_count,
    check_mechanism,
    epsilon_for,
    event_pld,
    spends_nothing,
    within_budget,
)
from dporl.privacy.events import PrivacyEvent, event_to_dict
from dporl.utils.validation import PrivacyBudgetError, ValidationError, check_positive, check_probability

# What one privacy unit is: the neighbouring datasets each guarantee is about.
UNIT_MEANINGS = {
    "expert": "one expert with all its trajectories",
    "trajectory": "one trajectory",
    "transition": "one transition",
    "reward": "reward functions with sup |r - r'| <= 1 (every reward may change by up to 1)",
}


@dataclass
class Stage:
    name: str
    budget: Optional[tuple[float, float]]  # (epsilon, delta) or None (no cap; report at `delta`)
    mechanism: str
    unit: str
    accountant: Accountant
    delta: float  # the delta epsilon is reported at (the budget's delta when there is one)
    analysis: str  # what proved the events' guarantees, composed by the accountant
    # (event, how many more of it are already verified to fit); not saved: recomputed after a restore.
    headroom: tuple[Optional[PrivacyEvent], int] = (None, 0)
    grant: int = 1  # next headroom request size (doubles while requests succeed)


@dataclass
class StageReport:
    name: str
    unit: str
    analysis: str
    epsilon: float
    delta: float
    budget: Optional[tuple[float, float]]
    events: list[tuple[dict[str, Any], int]]


@dataclass
class PrivacyReport:
    stages: list[StageReport]
    basic: Optional[tuple[float, float]]  # (sum eps, sum delta) over stages; None if units differ or no stage
    joint: Optional[tuple[float, float]]  # joint PLD (eps, total delta); None if not analysable
    joint_note: str
    unit: Optional[str]
    relation: Optional[str]  # neighbouring relation every recorded event was analysed under
    notes: list[str] = field(default_factory=list)

    @property
    def guarantee(self) -> Optional[tuple[float, float, str]]:
        """(epsilon, delta, analysis) of the run: the smaller sound epsilon at the total delta."""
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
        if self.unit == "reward":  # every reward may move: no unit is added, removed or replaced
            return f"neighbouring datasets: {UNIT_MEANINGS['reward']}"
        return f"neighbouring datasets: {self.relation or ADD_REMOVE}, one unit = {UNIT_MEANINGS.get(self.unit, self.unit)}"

    def describe(self) -> str:
        lines = []
        for s in self.stages:
            budget = f" (budget eps={s.budget[0]:g}, delta={s.budget[1]:g})" if s.budget else ""
            lines.append(
                f"stage {s.name!r}: eps={s.epsilon:.4g} at delta={s.delta:g}{budget}; unit: {s.unit}; "
                f"analysis: {s.analysis}"
            )
        if len(self.stages) > 1:
            if self.basic is not None:
                lines.append(f"basic composition: eps={self.basic[0]:.4g}, delta={self.basic[1]:g}")
            lines.append(
                f"joint PLD: eps={self.joint[0]:.4g}, delta={self.joint[1]:g}" if self.joint else
                f"joint PLD: not computed ({self.joint_note})"
            )
        guarantee = self.guarantee
        if guarantee is None:
            lines.append("no combined guarantee: " + "; ".join(self.notes or ["no stage recorded"]))
        else:
            lines.append(
                f"GUARANTEE: ({guarantee[0]:.4g}, {guarantee[1]:g})-DP, privacy unit: {self.unit} "
                f"({self.neighbours}); analysis: {guarantee[2]}"
            )
        lines.extend(f"note: {note}" for note in self.notes if guarantee is not None)
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        guarantee = self.guarantee
        return {
            "stages": [
                {
                    "name": s.name,
                    "unit": s.unit,
                    "analysis": s.analysis,
                    "epsilon": s.epsilon,
                    "delta": s.delta,
                    "budget": list(s.budget) if s.budget else None,
                    "events": [[event, count] for event, count in s.events],
                }
                for s in self.stages
            ],
            "basic_composition": list(self.basic) if self.basic else None,
            "joint_pld": list(self.joint) if self.joint else None,
            "joint_note": self.joint_note,
            "guarantee": (
                None if guarantee is None else
                {"epsilon": guarantee[0], "delta": guarantee[1], "analysis": guarantee[2], "unit": self.unit,
                 "neighbouring": self.neighbours}
            ),
            "notes": list(self.notes),
            "text": self.describe(),
        }


class PrivacyLedger:
    """Named stages composed sequentially into one run's guarantee (see the module docstring)."""

    def __init__(self) -> None:
        self.stages: dict[str, Stage] = {}

    def stage(
        self,
        name: str,
        *,
        budget: Optional[tuple[float, float]] = None,
        mechanism: Mechanism = "rdp",
        unit: str = "expert",
        delta: Optional[float] = None,
        analysis: Optional[str] = None,
    ) -> Stage:
        """Open a stage. ``delta`` (only without a budget) is the delta its epsilon is reported at.

        ``analysis`` names what proved the recorded events' guarantees when the accountant only composes them
        (e.g. a sparse-vector proof whose (eps, delta) runs the PLD composes); default: the accountant's name.
        """
        if name in self.stages:
            raise ValidationError("ledger.stage", f"stage {name!r} already exists")
        check_mechanism(mechanism, f"ledger.{name}.mechanism")
        if unit not in UNIT_MEANINGS:
            raise ValidationError(f"ledger.{name}.unit", f"must be one of {list(UNIT_MEANINGS)}, got {unit!r}")
        if budget is not None:
            if len(budget) != 2:
                raise ValidationError(f"ledger.{name}.budget", f"expected (epsilon, delta), got {budget!r}")
            eps = check_positive(f"ledger.{name}.budget.epsilon", budget[0])
            bdelta = check_probability(f"ledger.{name}.budget.delta", budget[1], allow_zero=False, allow_one=False)
            if delta is not None and delta != bdelta:
                raise ValidationError(f"ledger.{name}.delta", "a budgeted stage reports at its budget's delta")
            budget, delta = (eps, bdelta), bdelta
        elif delta is None:
            raise ValidationError(f"ledger.{name}.delta", "a stage without a budget needs the delta to report at")
        else:
            delta = check_probability(f"ledger.{name}.delta", delta, allow_zero=False, allow_one=False)
        composed_by = analysis_name(mechanism)
        label = composed_by if analysis is None else f"{analysis}; composed by {composed_by}"
        stage = Stage(name, budget, mechanism, unit, Accountant(mechanism), float(delta), label)
        self.stages[name] = stage
        return stage

    def _get(self, name: str) -> Stage:
        if name not in self.stages:
            raise ValidationError("ledger.stage", f"no stage {name!r} (stages: {list(self.stages)})")
        return self.stages[name]

    def record(self, stage: str, event: PrivacyEvent, count: int = 1) -> None:
        """Record ``count`` runs of ``event`` in ``stage``; raises PrivacyBudgetError (recording nothing) if over."""
        s = self._get(stage)
        count = check_count("count", count)
        if count == 0:
            return
        if s.budget is not None and not spends_nothing(event):
            self._reserve(s, event, count)
        s.accountant.record(event, count)

    def _fits(self, s: Stage, event: PrivacyEvent, count: int) -> bool:
        return within_budget(s.accountant.epsilon_with([(event, count)], s.delta), s.budget[0])

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
        stages = [
            StageReport(
                s.name,
                s.unit,
                s.analysis,
                self.spent(s.name),
                s.delta,
                s.budget,
                [(event_to_dict(e), c) for e, c in s.accountant.history],
            )
            for s in self.stages.values()
        ]
        notes: list[str] = []
        units = sorted({s.unit for s in self.stages.values()})
        unit = units[0] if len(units) == 1 else None
        relations = sorted(self._relations())
        basic = None
        if not stages:
            notes.append("no stage recorded")
        elif unit is None:
            notes.append(f"stages protect different privacy units {units}: no single guarantee combines them")
        elif len(relations) > 1:
            notes.append(f"stages use different neighbouring relations {relations}: no single guarantee combines them")
        else:
            basic = (sum(s.epsilon for s in stages), sum(s.delta for s in stages))
        joint, joint_note = None, ""
        if basic is not None and len(stages) > 1:
            joint, joint_note = self._joint(basic[1])
        return PrivacyReport(stages, basic, joint, joint_note, unit, relations[0] if len(relations) == 1 else None, notes)

    def _relations(self) -> set[str]:
        return {
            adjacency(e)
            for s in self.stages.values()
            for e, c in s.accountant.history
            if c and not spends_nothing(e)
        }

    def _joint(self, total_delta: float) -> tuple[Optional[tuple[float, float]], str]:
        events = [(e, c) for s in self.stages.values() for e, c in s.accountant.history]
        try:
            for event, _ in events:
                if not spends_nothing(event):
                    event_pld(event)
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
                    "unit": s.unit,
                    "delta": s.delta,
                    "analysis": s.analysis,
                    "accountant": s.accountant.state_dict(),
                }
                for s in self.stages.values()
            ]
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        stages: dict[str, Stage] = {}
        restored = PrivacyLedger()
        for entry in state["stages"]:
            budget = tuple(entry["budget"]) if entry["budget"] is not None else None
            s = restored.stage(
                entry["name"], budget=budget, mechanism=entry["mechanism"], unit=entry["unit"],
                delta=None if budget else entry["delta"],
            )
            s.analysis = entry["analysis"]
            s.accountant.load_state_dict(entry["accountant"])
            stages[s.name] = s
        self.stages = stages
