"""What a dataset declares about itself: ``DatasetMetadata`` and the declared action set (``action_set``).

Every field is validated on construction and bounded before anything is sized by it (``MAX_ACTIONS``,
``MAX_UNITS``, ``MAX_OBS_ELEMENTS``). ``env_id`` is a name, never code. The action set is DECLARED (public),
never read from the rows; the privacy-unit fields (``unit_column``, ``unit_keys``) are described in
``dporl.data.dataset``.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, asdict, dataclass, field, fields
from typing import Any, Mapping, Optional, Sequence

import numpy as np

from dporl.envs.registry import check_no_module
from dporl.utils.validation import ValidationError

# Bounds on what metadata may declare (arrays are sized by them, e.g. per-unit counts and action histograms).
MAX_ACTIONS = 1 << 20
MAX_UNITS = 1 << 27
MAX_OBS_ELEMENTS = 1 << 24
# Metadata keys that dataset format versions 1 and 2 spelled differently (stored name -> field), read by ``from_dict``.
VERSION_2_KEYS = {"n_experts": "n_units"}


def _json_safe(field_name: str, value: Any) -> Any:
    """Normalise ``value`` to what a JSON round trip returns (lists, not tuples) so save/load is exact."""
    try:
        return json.loads(json.dumps(value, allow_nan=False))
    except (TypeError, ValueError) as exc:
        raise ValidationError(field_name, f"must be JSON-serialisable with finite numbers: {exc}") from None


def _is_int(value: Any) -> bool:
    return isinstance(value, (int, np.integer)) and not isinstance(value, (bool, np.bool_))


ActionLabel = int | str


def action_set(actions: Any, field_name: str = "actions") -> tuple[int, Optional[tuple[ActionLabel, ...]]]:
    """(n_actions, labels or None) of a declared action set: a count n (actions 0..n-1) or a list of distinct labels
    (all strings or all integers; label i is action index i). A label list equal to 0..n-1 is the count n.

    Undeclared (None) is refused: the action set shapes what a private run releases, so it must be public.
    """
    if actions is None:
        raise ValidationError(
            field_name, "declare the action set: a count n (actions 0..n-1) or a list of labels. It is public and "
            "never read from the data (the largest logged action would change with one unit); `dporl data inspect` "
            "shows the logged actions to the curator"
        )
    if _is_int(actions):
        if not 1 <= int(actions) <= MAX_ACTIONS:
            raise ValidationError(field_name, f"expected a count in [1, {MAX_ACTIONS}], got {actions!r}")
        return int(actions), None
    if isinstance(actions, (str, bytes, Mapping)) or not isinstance(actions, Sequence):
        raise ValidationError(field_name, f"expected a count or a list of labels, got {actions!r}")
    labels = list(actions)
    if not labels or len(labels) > MAX_ACTIONS:
        raise ValidationError(field_name, f"expected 1 to {MAX_ACTIONS} labels, got {len(labels)}")
    if all(isinstance(label, str) for label in labels):
        labels = [str(label) for label in labels]
    elif all(_is_int(label) for label in labels):
        labels = [int(label) for label in labels]
    else:
        raise ValidationError(field_name, f"labels must be all strings or all integers, got {labels!r}")
    if len(set(labels)) != len(labels):
        raise ValidationError(field_name, f"labels must be distinct, got {labels!r}")
    if labels == list(range(len(labels))):
        return len(labels), None
    return len(labels), tuple(labels)


def check_observation_names(names: Any, obs_shape: Sequence[int], field_name: str) -> tuple[str, ...]:
    """Validated feature names of a flat observation: distinct non-empty strings, one per element of ``obs_shape``."""
    if isinstance(names, (str, bytes)) or not isinstance(names, Sequence):
        raise ValidationError(field_name, f"expected a list of names, got {type(names).__name__}")
    names = list(names)
    size = math.prod(int(d) for d in obs_shape)
    if len(obs_shape) != 1 or len(names) != size:
        raise ValidationError(field_name, f"{len(names)} name(s) for observations of shape {tuple(obs_shape)}")
    if not all(isinstance(n, str) and n for n in names):
        raise ValidationError(field_name, "expected non-empty strings")
    if len(set(names)) != len(names):
        raise ValidationError(field_name, "names must be distinct")
    return tuple(names)


@dataclass(frozen=True)
class DatasetMetadata:
    """What a dataset needs to be interpreted: where it was logged, by how many privacy units (the logging experts,
    unless the user chose a unit column), under which p_min."""

    env_id: str
    n_actions: int
    n_units: int
    obs_shape: tuple[int, ...]
    env_params: dict = field(default_factory=dict)  # physics parameters of the logging env
    p_min: Optional[float] = None  # every expert put at least this probability on every action
    seed: Optional[int] = None
    expert_set: Optional[dict] = None  # reference to the expert set (path, family, hash, ...)
    extra: dict = field(default_factory=dict)
    # The privacy unit's column when the user chose the grouping (None: the logging expert, column "expert_id"),
    # and the column's value of every unit (unit i's key; None: the unit index is the id). See the module docstring.
    unit_column: Optional[str] = None
    unit_keys: Optional[tuple[str, ...]] = None
    # The declared labels of the actions (label i is action i); None: the actions are the integers 0..n_actions-1.
    action_labels: Optional[tuple[ActionLabel, ...]] = None
    # The names of the observation's features (a table's observation columns, in order); None: unnamed. Public: they
    # are the user's column mapping (or the table's header), never values, and they reach the released policy.
    observation_names: Optional[tuple[str, ...]] = None

    def __post_init__(self) -> None:
        if not isinstance(self.env_id, str) or not self.env_id:
            raise ValidationError("metadata.env_id", f"expected a non-empty string, got {self.env_id!r}")
        check_no_module("metadata.env_id", self.env_id)
        # n_units may be 0: a cell of a keyed-hash partition that holds no unit (``UnitPartition.split``)
        for name, low, bound in (("n_actions", 1, MAX_ACTIONS), ("n_units", 0, MAX_UNITS)):
            value = getattr(self, name)  # bounded: code sizes arrays by these before reading any row
            if not _is_int(value) or not low <= value <= bound:
                raise ValidationError(f"metadata.{name}", f"expected an integer in [{low}, {bound}], got {value!r}")
            object.__setattr__(self, name, int(value))
        shape = self.obs_shape
        if not isinstance(shape, (tuple, list)) or not all(_is_int(d) and d >= 1 for d in shape):
            raise ValidationError("metadata.obs_shape", f"expected a tuple of integers >= 1, got {shape!r}")
        if len(shape) > 8 or math.prod(int(d) for d in shape) > MAX_OBS_ELEMENTS:
            raise ValidationError("metadata.obs_shape", f"{shape!r} exceeds {MAX_OBS_ELEMENTS} elements / 8 axes")
        object.__setattr__(self, "obs_shape", tuple(int(d) for d in shape))
        if self.p_min is not None:
            if isinstance(self.p_min, bool) or not isinstance(self.p_min, (int, float, np.floating)):
                raise ValidationError("metadata.p_min", f"expected a number or null, got {self.p_min!r}")
            p_min = float(self.p_min)
            # p_min = 1/n_A is the uniform policy; anything above it cannot hold for every action (NaN fails too).
            if not 0.0 < p_min <= 1.0 / self.n_actions:
                raise ValidationError(
                    "metadata.p_min", f"must lie in (0, 1/n_actions] = (0, {1.0 / self.n_actions:.6g}], got {p_min!r}"
                )
            object.__setattr__(self, "p_min", p_min)
        if self.seed is not None:
            if not _is_int(self.seed):
                raise ValidationError("metadata.seed", f"expected an integer or null, got {self.seed!r}")
            object.__setattr__(self, "seed", int(self.seed))
        for name in ("env_params", "extra"):
            if not isinstance(getattr(self, name), Mapping):
                raise ValidationError(f"metadata.{name}", f"expected a mapping, got {getattr(self, name)!r}")
            object.__setattr__(self, name, _json_safe(f"metadata.{name}", dict(getattr(self, name))))
        if self.expert_set is not None:
            if not isinstance(self.expert_set, Mapping):
                raise ValidationError("metadata.expert_set", f"expected a mapping or null, got {self.expert_set!r}")
            object.__setattr__(self, "expert_set", _json_safe("metadata.expert_set", dict(self.expert_set)))
        if self.unit_column is not None and (not isinstance(self.unit_column, str) or not self.unit_column):
            raise ValidationError("metadata.unit_column", f"expected a non-empty string or null, got {self.unit_column!r}")
        if self.unit_keys is not None:
            keys = self.unit_keys
            if not isinstance(keys, (list, tuple)) or not all(isinstance(k, str) for k in keys):
                raise ValidationError("metadata.unit_keys", "expected a list of strings (one per unit) or null")
            if len(keys) != self.n_units:
                raise ValidationError(
                    "metadata.unit_keys", f"expected one key per unit ({self.n_units}), got {len(keys)}"
                )
            if len(set(keys)) != len(keys):
                raise ValidationError("metadata.unit_keys", "unit keys must be distinct")
            object.__setattr__(self, "unit_keys", tuple(keys))
        if self.action_labels is not None:
            n, labels = action_set(list(self.action_labels) if isinstance(self.action_labels, (list, tuple))
                                   else self.action_labels, "metadata.action_labels")
            if n != self.n_actions:
                raise ValidationError("metadata.action_labels", f"{n} labels for n_actions = {self.n_actions}")
            object.__setattr__(self, "action_labels", labels)
        if self.observation_names is not None:
            object.__setattr__(self, "observation_names",
                               check_observation_names(self.observation_names, self.obs_shape, "metadata.observation_names"))

    def unit_key_strings(self) -> list[str]:
        """Every unit's stable id as a string: the user's column value, or the unit index for expert data."""
        return list(self.unit_keys) if self.unit_keys is not None else [str(i) for i in range(self.n_units)]

    def to_dict(self) -> dict:
        payload = asdict(self)
        payload["obs_shape"] = list(self.obs_shape)
        payload["unit_keys"] = None if self.unit_keys is None else list(self.unit_keys)
        for name in ("action_labels", "observation_names"):
            if getattr(self, name) is None:  # absent rather than null: files and fingerprints without them are unchanged
                del payload[name]
            else:
                payload[name] = list(getattr(self, name))
        return payload

    @classmethod
    def from_dict(cls, payload: Any, version: int = 3) -> "DatasetMetadata":
        """Metadata from its JSON object as ``to_dict`` writes it; ``version`` < 3: as dataset format versions 1 and 2
        wrote it (``VERSION_2_KEYS``: the number of units was ``n_experts``). Unknown or missing keys are errors."""
        if not isinstance(payload, Mapping):
            raise ValidationError("metadata", f"expected a JSON object, got {type(payload).__name__}")
        if version < 3:
            for stored, name in VERSION_2_KEYS.items():
                if name in payload:
                    raise ValidationError(f"metadata.{name}", f"unknown key in a version {version} file (it "
                                          f"stores {stored!r})")
            payload = {VERSION_2_KEYS.get(key, key): value for key, value in payload.items()}
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(payload) - names)
        if unknown:
            raise ValidationError(f"metadata.{unknown[0]}", f"unknown key (valid keys: {', '.join(sorted(names))})")
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        missing = sorted(name for name in required if name not in payload)
        if missing:
            raise ValidationError(f"metadata.{missing[0]}", "missing")
        return cls(**payload)
