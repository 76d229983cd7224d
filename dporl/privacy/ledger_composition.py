"""Composition of a ledger's stages into one report: a pure function of the recorded stages and their events.

As dp_accounting keeps its event record apart from the accountants that analyse it, the ledger
(``dporl.privacy.ledger``) records stages and events and enforces budgets; ``compose`` analyses a snapshot of them:

- per stage: epsilon at the stage's delta (its accountant's analysis);
- basic composition: (sum of stage epsilons, sum of stage deltas), valid for any analyses;
- joint: one PLD over every event of every stage at the total delta (only when every event has a PLD and all
  stages share one neighbouring relation and privacy unit);
- per cell of a declared partition (parallel composition): the stages touching the cell, composed as above.

``extra`` = (stage, event, count) composes as if that charge were recorded too: the one traversal that both prints
the run's guarantee and decides whether a charge keeps it within the run budget.
"""

from __future__ import annotations

from typing import Iterable, Optional, Sequence

from dporl.privacy.accountants import adjacency, check_analysable, epsilon_for, spends_nothing
from dporl.privacy.events import PrivacyEvent, event_to_dict
from dporl.privacy.ledger_report import CellReport, PaperClaim, PrivacyReport, StageReport
from dporl.privacy.ledger_stages import Stage
from dporl.privacy.partition import UnitPartition
from dporl.privacy.units import Relation
from dporl.utils.validation import ValidationError


def compose(
    stages: Iterable[Stage],
    *,
    relation: Relation,
    assumptions: Sequence[str] = (),
    paper_claims: Sequence[PaperClaim] = (),
    void: Optional[str] = None,
    partition: Optional[UnitPartition] = None,
    extra: Optional[tuple[str, PrivacyEvent, int]] = None,
) -> PrivacyReport:
    """The report of ``stages`` (as if ``extra`` = (stage, event, count) were recorded too); reads the stages'
    accountants, changes nothing."""
    stages = list(stages)
    histories = {s.name: list(s.accountant.history) for s in stages}
    if extra is not None:
        histories[extra[0]].append((extra[1], extra[2]))

    def spent(s: Stage) -> float:
        if extra is None or extra[0] != s.name:
            return s.accountant.get_epsilon(s.delta)
        return s.accountant.epsilon_with([(extra[1], extra[2])], s.delta)

    reports = [
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
        for s in stages
    ]
    notes: list[str] = [f"assumes: {a}" for a in assumptions]
    units = list(dict.fromkeys(s.unit for s in stages))
    unit = units[0] if len(units) == 1 else None
    relations = sorted(_relations(stages, histories))
    basic = None
    if not reports:
        notes.append("no stage recorded")
    elif unit is None:
        notes.append(
            f"stages protect different privacy units {[u.name for u in units]}: no single guarantee combines them"
        )
    elif len(relations) > 1:
        notes.append(f"stages use different neighbouring relations {relations}: no single guarantee combines them")
    else:
        basic = (sum(s.epsilon for s in reports), sum(s.delta for s in reports))
    joint, joint_note = None, ""
    if basic is not None and len(reports) > 1:
        joint, joint_note = _joint(stages, histories, basic[1])
    cells = None
    if partition is not None and any(s.cells is not None for s in stages):
        cells = [_cell(name, stages, reports, histories) for name in partition.names]
    relation = relations[0] if len(relations) == 1 else (relation if not relations else None)
    return PrivacyReport(
        reports, basic, joint, joint_note, unit, relation, notes,
        list(paper_claims), void, partition, cells,
    )


def _cell(name: str, stages: list[Stage], reports: list[StageReport], histories: dict[str, list]) -> CellReport:
    """Sequential composition of the stages touching cell ``name``: the smaller of basic and joint PLD."""
    touching = [s for s in stages if s.cells is None or name in s.cells]
    by_name = {r.name: r for r in reports}
    if not touching:
        return CellReport(name, [], 0.0, 0.0, "no stage touches this cell")
    basic = (sum(by_name[s.name].epsilon for s in touching), sum(s.delta for s in touching))
    if len(touching) == 1:
        return CellReport(name, [touching[0].name], *basic, touching[0].analysis)
    joint, _ = _joint(touching, histories, basic[1])
    if joint is not None and joint[0] < basic[0]:
        return CellReport(name, [s.name for s in touching], *joint, "joint PLD over the cell's stages")
    return CellReport(name, [s.name for s in touching], *basic, "basic composition of the cell's stages")


def _relations(stages: list[Stage], histories: dict[str, list]) -> set[Relation]:
    """The neighbouring relations the events were analysed under (bounded change for reward units)."""
    return {
        Relation.BOUNDED_CHANGE if s.unit.bounded_change else adjacency(e)
        for s in stages
        for e, c in histories[s.name]
        if c and not spends_nothing(e)
    }


def _joint(
    stages: list[Stage], histories: dict[str, list], total_delta: float
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
