"""A starting "train" config for a user's table, written from its header alone (``dporl init table FILE.csv``).

Only the column names are read (a CSV's first line, a Parquet file's schema): never a row, so nothing about the
private data reaches the config. Columns are assigned to roles by their names (an ``episode`` column, a ``reward``
column, ...), every other column is an observation, and each guess is marked for the user to check. What only the
user can declare is written as a placeholder ``TODO: ...`` that the config loader refuses, naming its key, until it
is filled in: the declared public facts the guarantee rests on (the action set, the bounds of the policy value, a
unit's clip), the privacy unit's column when no column is named like one, and the budget.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Optional

from dporl.data.table import table_header
from dporl.utils.config import PLACEHOLDER
from dporl.utils.validation import ValidationError

# Normalised column names (lower case, letters and digits only) that suggest a role.
ROLE_NAMES: dict[str, tuple[str, ...]] = {
    "episode": ("episode", "episodeid", "episodeindex", "stay", "stayid", "trajectory", "trajectoryid", "session",
                "sessionid", "admission", "admissionid"),
    "unit": ("unit", "unitid", "patient", "patientid", "clinician", "clinicianid", "doctor", "doctorid", "user",
             "userid", "subject", "subjectid", "person", "personid", "expertid"),
    "action": ("action", "treatment", "decision", "arm"),
    "reward": ("reward", "outcome"),
    "step": ("step", "timestep", "t", "hour", "stepindex"),
    "terminated": ("terminated", "terminal", "done", "discharged"),
    "truncated": ("truncated", "timeout"),
    "propensity": ("propensity", "behaviourprob", "behaviorprob", "actionprob", "logpropensity", "logprob"),
}
ACTIONS = " the action set: a count n (the column holds 0..n-1) or the list of labels"
UNIT_CLIP = " a unit clip: the norm bound of one unit contribution, e.g. the most episodes one unit logs"
DESCRIPTIONS = {
    "episode": "the column holding each row's episode id",
    "unit": "the column of the privacy unit (every guarantee protects all rows sharing one value of it)",
    "action": "the column holding the logged action",
    "reward": "the column holding the reward",
}


def _normal(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def guess_roles(names: list[str]) -> dict[str, Optional[str]]:
    """Role -> the first column whose name suggests it (None: no such column)."""
    roles: dict[str, Optional[str]] = {}
    taken: set[str] = set()
    for role, candidates in ROLE_NAMES.items():
        roles[role] = next((n for n in names if _normal(n) in candidates and n not in taken), None)
        if roles[role] is not None:
            taken.add(roles[role])
    return roles


def _quote(value: str) -> str:
    return json.dumps(value)  # a JSON string is a YAML string


def table_config(path: str | Path) -> str:
    """The YAML text of a starting config for the table at ``path`` (its header read, nothing else)."""
    path = Path(path)
    names = table_header(path)
    if len(set(names)) != len(names):
        raise ValidationError("source", f"{path} repeats a column name in its header")
    roles = guess_roles(names)
    used = {column for column in roles.values() if column is not None}
    next_names = [n for n in names if n.startswith("next_") and n[len("next_"):] in names]
    observations = [n for n in names if n not in used and n not in next_names]
    if not observations:
        raise ValidationError("source", f"{path}'s header leaves no column for the observations")
    log_propensity = roles["propensity"] is not None and _normal(roles["propensity"]).startswith("log")

    def column(role: str) -> str:
        if roles[role] is None:
            return f"{_quote(PLACEHOLDER + ' ' + DESCRIPTIONS[role])}"
        note = "  # guessed from the header: check"
        if role == "unit":
            note = ("  # PUBLIC CHOICE, guessed from the header: check. The privacy unit: every guarantee protects "
                    "all rows sharing one value of this column")
        return _quote(roles[role]) + note

    lines = [
        f"# Written by `dporl init table {path.name}` from the table's header alone (no row was read).",
        "# Check each column guess and fill in every TODO: a run refuses a TODO, naming its key. Every key: "
        "docs/config.md.",
        "pipeline: train",
        "method: dp_sgd             # unit-level DP-SGD over the unit column",
        f"run_dir: {_quote('runs/' + (re.sub(r'[^A-Za-z0-9_.-]', '_', path.stem) or 'table'))}",
        f"epsilon: {_quote(PLACEHOLDER + ' the privacy budget of the whole run for one unit, e.g. 1.0')}",
        "delta: 1.0e-5",
        "data:",
        "  format: table",
        f"  path: {_quote(str(path))}",
        "  columns:",
        f"    episode: {column('episode')}",
        f"    unit: {column('unit')}",
        f"    observations: [{', '.join(_quote(n) for n in observations)}]  # every other column: check",
        f"    action: {column('action')}",
        f"    actions: {_quote(PLACEHOLDER + ACTIONS)}  # PUBLIC FACT: declared, never read from the rows",
        f"    reward: {column('reward')}",
    ]
    for role in ("step", "terminated", "truncated", "propensity"):
        if roles[role] is not None:
            lines.append(f"    {role}: {column(role)}")
    if log_propensity:
        lines.append("    propensity_kind: log_prob")
    if next_names:
        lines.append(f"    next_observations: [{', '.join(_quote(n) for n in next_names)}]  # check: the order of "
                     "observations")
    lines += [
        "algorithm: {name: cql, gamma: 0.99}",
        "eval:",
        "  offline:",
        f"    value_range: {_quote(PLACEHOLDER + ' [low, high], bounds on any policy value (discounted return)')}"
        "  # PUBLIC FACT",
        f"    unit_clip: {_quote(PLACEHOLDER + UNIT_CLIP)}  # PUBLIC FACT",
    ]
    return "\n".join(lines) + "\n"


__all__ = ["guess_roles", "table_config"]
