"""What a privacy ledger reports: each stage's epsilon, the compositions of the stages, the run's guarantee, and
the paper figures that are NOT guarantees (``PrivacyLedger.report()``; printed, logged and saved as JSON).

Presentation only: the numbers are computed by ``dporl.privacy.ledger_composition`` from the recorded stages; this
module says which of them is the run's guarantee (the smaller sound epsilon at the total delta, or the largest
cell's under parallel composition) and how it is printed.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Optional

from dporl.privacy.partition import UnitPartition
from dporl.privacy.units import PrivacyUnit, Relation


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
            return (f"neighbouring datasets: replace one unit's data; the number of units is public and the replaced "
                    f"unit keeps its id (so its cell of any partition), one unit = {self.unit.meaning}")
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
