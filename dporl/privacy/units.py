"""Privacy units and neighbouring relations, as types.

A guarantee is a statement about neighbouring datasets: which records form one *unit* (an expert with all its
trajectories, one trajectory, the rows sharing a value of a column the user chose, or the whole reward function)
and how neighbours differ (one unit added or removed, one unit replaced, or every record moved by a bounded
amount). Every ledger stage, event analysis and printed guarantee names both, so a report cannot say "one expert"
while the data were grouped by episode (the grouping is owned by the data; see ``grouped_by``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Optional

from dporl.utils.validation import ValidationError


class Relation(str, enum.Enum):
    """How two neighbouring datasets differ."""

    ADD_REMOVE = "add/remove one unit"
    REPLACE_ONE = "replace one unit"
    # Every record may move, each by a bounded amount (reward-level privacy: sup |r - r'| <= 1).
    BOUNDED_CHANGE = "every record moved by at most a bounded amount"

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True)
class PrivacyUnit:
    """What one unit of the neighbouring relation is.

    ``name`` is printed in guarantees; ``meaning`` says it in words; ``column`` names the data column whose values
    group rows into units when the user chose the grouping (``grouped_by``); ``bounded_change`` marks units under
    which every record may change (no unit is added or removed), such as the reward function.
    """

    name: str
    meaning: str
    column: Optional[str] = None
    bounded_change: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ValidationError("privacy_unit.name", f"must be a non-empty string, got {self.name!r}")
        if not isinstance(self.meaning, str) or not self.meaning:
            raise ValidationError("privacy_unit.meaning", "must say in words what one unit is")

    def __str__(self) -> str:
        return self.name

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "meaning": self.meaning, "column": self.column, "bounded_change": self.bounded_change}

    @staticmethod
    def from_dict(payload: Any) -> "PrivacyUnit":
        if isinstance(payload, str):  # ledgers saved before units were types stored the name only
            return as_unit(payload)
        if not isinstance(payload, dict) or set(payload) != {"name", "meaning", "column", "bounded_change"}:
            raise ValidationError("privacy_unit", f"not a privacy unit: {payload!r}")
        if payload["column"] is not None and not isinstance(payload["column"], str):
            raise ValidationError("privacy_unit.column", f"must be a string or null, got {payload['column']!r}")
        return PrivacyUnit(payload["name"], payload["meaning"], payload["column"], bool(payload["bounded_change"]))


EXPERT = PrivacyUnit("expert", "one expert with all its trajectories", column="expert_id")
TRAJECTORY = PrivacyUnit("trajectory", "one trajectory")
TRANSITION = PrivacyUnit("transition", "one transition")
REWARD = PrivacyUnit(
    "reward", "reward functions with sup |r - r'| <= 1 (every reward may change by up to 1)", bounded_change=True
)
BUILTIN_UNITS = {unit.name: unit for unit in (EXPERT, TRAJECTORY, TRANSITION, REWARD)}


def grouped_by(column: str, name: Optional[str] = None) -> PrivacyUnit:
    """The unit formed by all rows sharing one value of ``column`` (a clinician id, a patient id, ...)."""
    if not isinstance(column, str) or not column:
        raise ValidationError("unit", f"a unit column must be a non-empty name, got {column!r}")
    return PrivacyUnit(name or column, f"all rows sharing one value of column {column!r}", column=column)


def as_unit(value: Any) -> PrivacyUnit:
    """A ``PrivacyUnit`` from a unit or the name of a built-in one ("expert", "trajectory", "transition", "reward")."""
    if isinstance(value, PrivacyUnit):
        return value
    if isinstance(value, str) and value in BUILTIN_UNITS:
        return BUILTIN_UNITS[value]
    raise ValidationError("privacy_unit", f"unknown privacy unit {value!r}; use one of {sorted(BUILTIN_UNITS)} or grouped_by(column)")


def dataset_unit(dataset: Any) -> PrivacyUnit:
    """The privacy unit a dataset's rows are grouped by (owned by the data, not by the algorithm).

    ``metadata.unit_column`` None means the logging expert (``EXPERT``); otherwise the user's column (``grouped_by``).
    """
    metadata = getattr(dataset, "metadata", dataset)
    column = getattr(metadata, "unit_column", None)
    return EXPERT if column is None else grouped_by(column)
