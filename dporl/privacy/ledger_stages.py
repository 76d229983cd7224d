"""The stages of a privacy ledger: what one stage is (its accountant, budget, privacy unit, cells) and the checks
of the values a stage or a ledger is opened with (``dporl.privacy.ledger``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from dporl.privacy.accountants import Accountant, Mechanism, check_delta
from dporl.privacy.events import PrivacyEvent
from dporl.privacy.units import PrivacyUnit, Relation
from dporl.utils.validation import ValidationError, check_positive


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



def check_relation(relation: Any) -> Relation:
    try:
        relation = Relation(relation)
    except ValueError:
        relation = None
    if relation not in (Relation.ADD_REMOVE, Relation.REPLACE_ONE):
        raise ValidationError("ledger.relation", f"expected {Relation.ADD_REMOVE.value!r} or "
                              f"{Relation.REPLACE_ONE.value!r}")
    return relation


def check_flag(value: Any) -> bool:
    if not isinstance(value, bool):
        raise ValidationError("ledger.shares_run_budget", f"must be true or false, got {value!r}")
    return value


def check_budget(field: str, budget: Any) -> tuple[float, float]:
    if not isinstance(budget, (tuple, list)) or len(budget) != 2:
        raise ValidationError(field, f"expected (epsilon, delta), got {budget!r}")
    eps = check_positive(f"{field}.epsilon", budget[0])
    delta = check_delta(budget[1], f"{field}.delta")
    return eps, delta
