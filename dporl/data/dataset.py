"""Logged decision data: ``TrajectoryDataset``, its validation, its views and its on-disk format.

Layout (fixed by docs/design.md). Episodes are stored back to back in flat numpy arrays. Episode ``e`` owns
transitions ``[tstart[e], tstart[e] + len[e])`` and observations ``[tstart[e] + e, tstart[e] + e + len[e] + 1)``
(``len[e] + 1`` observations: the state before every action plus the state after the last one), where
``tstart = cumsum(episode_lengths) - episode_lengths``.

On-disk format (``save`` / ``load``): ONE uncompressed ``.npz`` archive (a zip of ``.npy`` arrays; no pickles)
written atomically, holding exactly these members::

    format_version       int64 scalar, currently 2 (readers accept 1 and 2 and refuse any other value)
    metadata             0-d unicode string: DatasetMetadata as JSON (env_id, n_actions, n_experts, obs_shape,
                         env_params, p_min, seed, expert_set, extra, unit_column, unit_keys; action_labels and
                         observation_names only when declared)
    observations         float32 [n_transitions + n_episodes, *obs_shape]
    actions              int64   [n_transitions], in [0, n_actions)
    rewards              float32 [n_transitions]
    terminations         bool    [n_transitions]   only an episode's last step may be True ...
    truncations          bool    [n_transitions]   ... and that step has at least one of the two flags
    episode_lengths      int64   [n_episodes], >= 1, summing to n_transitions
    expert_ids           int64   [n_episodes], in [0, n_experts)
    start_steps          int64   [n_episodes], >= 0 (time index of an episode's first transition; 0 unless a fragment)
    behavior_log_probs   float32 [n_transitions], <= 0 (optional member: log pi_behaviour(a_t | s_t))

Every member is a ``.npy`` file stored without compression whose array data starts on a 64-byte boundary of the
archive (a padding zip extra field, id 0xD935, in the member's local header; the ``.npy`` header pads itself to
64 bytes; ``write_npz_members``), so ``load(path, mmap=True)`` maps the arrays straight from the file (data larger
than RAM). Any npz reader reads the file. Archives written by a bare ``np.savez`` load too: what is aligned is
mapped, the rest read.

Privacy units. ``expert_ids`` holds each episode's *unit*: the group of rows a guarantee protects as one. For data
logged by dporl's experts the unit is the expert (``metadata.unit_column`` is None, the historical meaning). A table
imported with ``dporl.data.table.read_table(..., unit=COLUMN)`` groups rows by the user's column: ``unit_column``
names it, ``n_experts`` is the number of units and ``unit_keys[i]`` is the column's value (as a string) for unit i.
``unit_keys`` let a split by unit depend on the user's id alone (``dporl.privacy.partition``), never on which other
units happen to be present (the dense index i does). Version 1 files (no unit fields) load unchanged.

Actions. The action set is DECLARED (public), never read from the rows: ``n_actions`` (and, when the user's actions
are labels, ``action_labels``: label i is action index i) comes from a simulator's action space, an expert set, or
the user's declaration at import (``dporl.data.table.read_table(..., actions=...)``). Under add/remove neighbours a
set inferred from the rows (largest logged action + 1) changes with the presence of one unit who once took a rare
action, and every released object shaped by it (a Q-network's output layer, a policy's action space) would tell.
``action_set`` validates a declaration.

Terminal steps. The observation after an episode's last step exists in the layout even when the step is terminal
(the episode has no next state). Importers store a placeholder there (zeros): it is never data. Every consumer
multiplies the next state's value by ``1 - terminated`` (CQL's and FQE's targets, LSTD/GPOPE's ``phi_next``), so a
placeholder cannot move any estimate (tested by swapping the placeholder for huge values).

Loading checks every rule above (exact dtypes, shapes, finiteness, ranges, boundaries, metadata types) and raises
``ValidationError`` naming the bad field or, for an unreadable/corrupt/truncated archive, the path. Sizes come
first: each member's declared dtype and shape (its ``.npy`` header) and inflated size (the zip directory) are checked
against the metadata, the other members and a compression-ratio cap before any array is inflated or allocated
(``dporl.utils.archives``). ``metadata.env_id`` is a name, never code: an id with a module part
(``"module:Env-v0"``, which Gymnasium would import) is refused.

Views never loop over episodes in Python: every per-episode slice is one vectorised gather (``concat_ranges``).
``transition_columns()`` gives batch sources the per-transition columns without copying: tensors sharing the
stored arrays, and observations gathered per batch from the episode layout (``EpisodeObservations``).
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import struct
import warnings
import zipfile
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Mapping, Optional, Sequence

import numpy as np
import torch

from dporl.envs.registry import check_no_module
from dporl.utils.archives import NpyMember, NpzArchive, check_declared
from dporl.utils.grouping import concat_ranges, stable_group_order
from dporl.utils.io import MAX_JSON_BYTES, atomic_write, dump_json, parse_json
from dporl.utils.validation import ValidationError, check_finite, check_int_range

FORMAT_VERSION = 2
READABLE_VERSIONS = (1, 2)  # 2 added metadata.unit_column / unit_keys; version 1 files load unchanged

_ARRAY_DTYPES = {
    "observations": np.float32,
    "actions": np.int64,
    "rewards": np.float32,
    "terminations": np.bool_,
    "truncations": np.bool_,
    "episode_lengths": np.int64,
    "expert_ids": np.int64,
    "start_steps": np.int64,
    "behavior_log_probs": np.float32,
}
_OPTIONAL_ARRAYS = {"behavior_log_probs"}
# Bounds on what metadata may declare (arrays are sized by them, e.g. per-expert counts and action histograms).
MAX_ACTIONS = 1 << 20
MAX_EXPERTS = 1 << 27
MAX_OBS_ELEMENTS = 1 << 24
_ARCHIVE_KEYS = {"format_version", "metadata", *_ARRAY_DTYPES}


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
    """What a dataset needs to be interpreted: where it was logged, by how many experts, under which p_min."""

    env_id: str
    n_actions: int
    n_experts: int
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
        for name, bound in (("n_actions", MAX_ACTIONS), ("n_experts", MAX_EXPERTS)):
            value = getattr(self, name)  # bounded: code sizes arrays by these before reading any row
            if not _is_int(value) or not 1 <= value <= bound:
                raise ValidationError(f"metadata.{name}", f"expected an integer in [1, {bound}], got {value!r}")
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
            if len(keys) != self.n_experts:
                raise ValidationError(
                    "metadata.unit_keys", f"expected one key per unit ({self.n_experts}), got {len(keys)}"
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

    @property
    def n_units(self) -> int:
        """Number of privacy units (the experts, unless the user chose a unit column)."""
        return self.n_experts

    def unit_key_strings(self) -> list[str]:
        """Every unit's stable id as a string: the user's column value, or the unit index for expert data."""
        return list(self.unit_keys) if self.unit_keys is not None else [str(i) for i in range(self.n_experts)]

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
    def from_dict(cls, payload: Any) -> "DatasetMetadata":
        if not isinstance(payload, Mapping):
            raise ValidationError("metadata", f"expected a JSON object, got {type(payload).__name__}")
        names = {f.name for f in fields(cls)}
        unknown = sorted(set(payload) - names)
        if unknown:
            raise ValidationError(f"metadata.{unknown[0]}", f"unknown key (valid keys: {', '.join(sorted(names))})")
        required = [f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING]
        missing = sorted(name for name in required if name not in payload)
        if missing:
            raise ValidationError(f"metadata.{missing[0]}", "missing")
        return cls(**payload)



@dataclass(frozen=True)
class Transitions:
    """Flat per-transition view (numpy). ``timesteps`` is the index in the original episode (fragments keep it)."""

    obs: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    next_obs: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    expert_ids: np.ndarray
    episode_ids: np.ndarray
    timesteps: np.ndarray
    behavior_log_probs: Optional[np.ndarray]

    def __len__(self) -> int:
        return len(self.actions)

    def to_torch(self) -> dict[str, torch.Tensor]:
        """Tensors sharing memory with the arrays; ``behavior_log_probs`` is absent when not logged."""
        return {
            f.name: torch.from_numpy(getattr(self, f.name))
            for f in fields(self)
            if getattr(self, f.name) is not None
        }


@dataclass(frozen=True)
class PaddedTrajectories:
    """Episodes padded to the longest one (torch). Positions past an episode's end are zero and ``mask`` False.

    Padded log-probabilities are 0 (log 1), so sums of masked log-ratios need no extra masking.
    """

    observations: torch.Tensor  # [N, L+1, *obs]
    actions: torch.Tensor  # [N, L] int64
    rewards: torch.Tensor  # [N, L]
    mask: torch.Tensor  # [N, L] bool: True on real transitions
    lengths: torch.Tensor  # [N] int64
    terminated: torch.Tensor  # [N] bool: the episode's last step is a termination
    truncated: torch.Tensor  # [N] bool
    expert_ids: torch.Tensor  # [N] int64
    start_steps: torch.Tensor  # [N] int64
    behavior_log_probs: Optional[torch.Tensor]  # [N, L] or None when not logged

    def to_dict(self) -> dict[str, torch.Tensor]:
        """The tensors by field name (rows along dim 0, as a Batch's ``data``); absent log-probs are left out."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


def shared_tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor sharing ``array``'s memory, also when the array is read-only (a dataset's stored arrays, a memory
    map). The tensor must never be written: it exists to be indexed (``index_select``) by batch sources."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


class FlatEpisodes:
    """A dataset's flat observations with its episode ends: what ``EpisodeObservations`` columns gather from.

    Transition t of episode e has observation ``t + e`` (next observation ``t + e + 1``). The episode of each row
    is found by a binary search over the episode ends; the last lookup is kept, so the ``obs`` and ``next_obs``
    columns of one batch (gathered with the same row tensor) search once. ``to(device)`` is memoised, so both
    columns moved to a device still share one copy of the observations.
    """

    def __init__(self, observations: torch.Tensor, episode_ends: torch.Tensor):
        self.observations = observations
        self.episode_ends = episode_ends  # int64 [n_episodes]: cumulative episode lengths
        self.n_transitions = int(episode_ends[-1]) if len(episode_ends) else 0
        self._moved: dict[torch.device, FlatEpisodes] = {}
        self._last: Optional[tuple[torch.Tensor, int, torch.Tensor]] = None

    def observation_index(self, rows: torch.Tensor) -> torch.Tensor:
        """Index of each transition's observation in the flat array (``rows`` + its episode index)."""
        last = self._last
        if last is not None and last[0] is rows and last[1] == rows._version:
            return last[2]
        index = rows + torch.searchsorted(self.episode_ends, rows, right=True)
        self._last = (rows, rows._version, index)
        return index

    def to(self, device: torch.device | str) -> "FlatEpisodes":
        device = torch.device(device)
        if device == self.observations.device:
            return self
        if device not in self._moved:
            self._moved[device] = FlatEpisodes(self.observations.to(device), self.episode_ends.to(device))
        return self._moved[device]


class EpisodeObservations:
    """Per-transition observations (``shift`` 0) or next observations (``shift`` 1) of ``FlatEpisodes``,
    gathered on demand: ``index_select(0, rows)`` gathers those rows only, so a batch source over a dataset holds
    no per-transition copy of the observations (a step reads only its sampled rows: a memory-mapped dataset stays
    on disk)."""

    def __init__(self, episodes: FlatEpisodes, shift: int):
        self.episodes = episodes
        self.shift = shift
        self.shape = torch.Size((episodes.n_transitions, *episodes.observations.shape[1:]))

    @property
    def dtype(self) -> torch.dtype:
        return self.episodes.observations.dtype

    @property
    def device(self) -> torch.device:
        return self.episodes.observations.device

    def __len__(self) -> int:
        return self.shape[0]

    def index_select(self, dim: int, rows: torch.Tensor) -> torch.Tensor:
        if dim != 0:
            raise ValidationError("dim", f"observations are gathered by row (dim 0), got dim {dim}")
        index = self.episodes.observation_index(rows)
        return self.episodes.observations.index_select(0, index + self.shift if self.shift else index)

    def to(self, device: torch.device | str) -> "EpisodeObservations":
        return EpisodeObservations(self.episodes.to(device), self.shift)


def _as_typed(field_name: str, value: Any, dtype: type, kinds: str) -> np.ndarray:
    """``value`` as a numpy array of ``dtype``; only arrays whose dtype kind is in ``kinds`` are converted."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    array = np.asarray(value)
    if array.dtype.kind not in kinds:
        raise ValidationError(field_name, f"expected dtype {np.dtype(dtype).name}, got {array.dtype}")
    if array.dtype.kind in "iu" and dtype is np.float32:
        return array.astype(dtype)
    if array.dtype.kind == "f" and dtype is np.float32 and array.dtype != np.float32:
        check_finite(field_name, array)  # before narrowing, so the error names NaN rather than an overflow
    with np.errstate(over="ignore"):  # values beyond float32 become inf, which validation then reports
        return np.ascontiguousarray(array, dtype=dtype)


class TrajectoryDataset:
    """Episodes logged by a pool of experts, in the flat layout above. Validated on construction.

    The arrays are exposed as read-only views. Input arrays of the right dtype are not copied (datasets can be large),
    so do not modify them after construction. Views returned by the methods below are fresh, writable arrays unless
    a method says otherwise.
    """

    def __init__(
        self,
        *,
        observations: Any,
        actions: Any,
        rewards: Any,
        terminations: Any,
        truncations: Any,
        episode_lengths: Any,
        expert_ids: Any,
        metadata: DatasetMetadata,
        start_steps: Any = None,
        behavior_log_probs: Any = None,
    ):
        if not isinstance(metadata, DatasetMetadata):
            raise ValidationError("metadata", f"expected DatasetMetadata, got {type(metadata).__name__}")
        self.metadata = metadata
        self.observations = _as_typed("observations", observations, np.float32, "fiu")
        self.actions = _as_typed("actions", actions, np.int64, "iu")
        self.rewards = _as_typed("rewards", rewards, np.float32, "fiu")
        self.terminations = _as_typed("terminations", terminations, np.bool_, "b")
        self.truncations = _as_typed("truncations", truncations, np.bool_, "b")
        self.episode_lengths = _as_typed("episode_lengths", episode_lengths, np.int64, "iu")
        self.expert_ids = _as_typed("expert_ids", expert_ids, np.int64, "iu")
        if start_steps is None:
            start_steps = np.zeros(self.episode_lengths.shape, dtype=np.int64)
        self.start_steps = _as_typed("start_steps", start_steps, np.int64, "iu")
        self.behavior_log_probs = (
            None
            if behavior_log_probs is None
            else _as_typed("behavior_log_probs", behavior_log_probs, np.float32, "f")
        )
        self._validate()
        for name in _ARRAY_DTYPES:  # read-only views: validated data cannot be changed behind the checks' back
            array = getattr(self, name)
            if array is not None:
                view = array.view()
                view.flags.writeable = False
                setattr(self, name, view)
        self._transition_starts = np.cumsum(self.episode_lengths) - self.episode_lengths
        self._observation_starts = self._transition_starts + np.arange(self.n_episodes, dtype=np.int64)

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        meta = self.metadata
        for name in ("episode_lengths", "expert_ids", "start_steps"):
            if getattr(self, name).ndim != 1:
                raise ValidationError(name, f"expected a 1-D array, got shape {getattr(self, name).shape}")
        n_episodes = len(self.episode_lengths)
        for name in ("expert_ids", "start_steps"):
            if len(getattr(self, name)) != n_episodes:
                raise ValidationError(
                    name, f"expected one entry per episode ({n_episodes}), got {len(getattr(self, name))}"
                )
        if n_episodes and self.episode_lengths.min() < 1:
            bad = int(np.argmin(self.episode_lengths))
            raise ValidationError("episode_lengths", f"every episode needs >= 1 transition; episode {bad} has "
                                  f"{int(self.episode_lengths[bad])}")
        n_transitions = int(self.episode_lengths.sum())
        per_transition = ["actions", "rewards", "terminations", "truncations"]
        if self.behavior_log_probs is not None:
            per_transition.append("behavior_log_probs")
        for name in per_transition:
            shape = getattr(self, name).shape
            if shape != (n_transitions,):
                raise ValidationError(
                    name, f"expected shape ({n_transitions},) (sum of episode_lengths), got {shape}"
                )
        expected_obs = (n_transitions + n_episodes, *meta.obs_shape)
        if self.observations.shape != expected_obs:
            raise ValidationError(
                "observations",
                f"expected shape {expected_obs} (n_transitions + n_episodes observations of metadata.obs_shape), "
                f"got {self.observations.shape}",
            )
        _check_finite_chunked("observations", self.observations)
        _check_finite_chunked("rewards", self.rewards)
        check_int_range("actions", self.actions, 0, meta.n_actions)
        check_int_range("expert_ids", self.expert_ids, 0, meta.n_experts)
        if n_episodes and self.start_steps.min() < 0:
            raise ValidationError("start_steps", f"must be >= 0, found {int(self.start_steps.min())}")
        if self.behavior_log_probs is not None:
            _check_finite_chunked("behavior_log_probs", self.behavior_log_probs)
            if n_transitions and self.behavior_log_probs.max() > 0:
                raise ValidationError(
                    "behavior_log_probs",
                    f"log-probabilities must be <= 0, found {float(self.behavior_log_probs.max())}",
                )
        self._validate_boundaries(n_transitions)

    def _validate_boundaries(self, n_transitions: int) -> None:
        last = np.cumsum(self.episode_lengths) - 1
        for name in ("terminations", "truncations"):
            flagged = np.flatnonzero(getattr(self, name))  # at most one per episode when valid: no [N] temporary
            inside = flagged[last[np.searchsorted(last, flagged)] != flagged]  # the episode's end is not the flag
            if len(inside):
                raise ValidationError(
                    name, f"transition {int(inside[0])} (inside episode {int(np.searchsorted(last, inside[0]))}) is "
                    "flagged but is not the episode's last step; only an episode's last step may end it"
                )
        open_ended = np.flatnonzero(~(self.terminations[last] | self.truncations[last]))
        if len(open_ended):
            raise ValidationError(
                "terminations",
                f"episode {int(open_ended[0])} ends without being terminated or truncated "
                f"({len(open_ended)} such episode(s)); mark cut-off episodes truncated",
            )

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_episodes(cls, episodes: Sequence[Mapping], metadata: DatasetMetadata) -> "TrajectoryDataset":
        """Build from per-episode dicts: observations [L+1, *obs], actions [L], rewards [L], terminated, truncated,
        expert_id, optional behavior_log_probs [L] (all or none) and start_step."""
        episodes = list(episodes)
        with_log_probs = [e.get("behavior_log_probs") is not None for e in episodes]
        if any(with_log_probs) and not all(with_log_probs):
            first = with_log_probs.index(not with_log_probs[0])
            raise ValidationError(f"episodes[{first}].behavior_log_probs", "either every episode has them or none")
        lengths = np.zeros(len(episodes), dtype=np.int64)
        for i, episode in enumerate(episodes):
            for key in ("observations", "actions", "rewards", "terminated", "truncated", "expert_id"):
                if key not in episode:
                    raise ValidationError(f"episodes[{i}].{key}", "missing")
            length = len(np.asarray(episode["actions"]))
            if length == 0:
                raise ValidationError(f"episodes[{i}].actions", "an episode needs at least one transition")
            if len(np.asarray(episode["observations"])) != length + 1:
                raise ValidationError(
                    f"episodes[{i}].observations", f"expected {length + 1} observations for {length} actions, got "
                    f"{len(np.asarray(episode['observations']))}"
                )
            lengths[i] = length
        flags = {}
        for key in ("terminated", "truncated"):  # per-episode flags live on each episode's last transition
            flags[key] = np.zeros(int(lengths.sum()), dtype=bool)
            flags[key][np.cumsum(lengths) - 1] = [bool(e[key]) for e in episodes]

        def stack(key: str, empty_shape: tuple, dtype) -> np.ndarray:
            if not episodes:
                return np.zeros(empty_shape, dtype=dtype)
            return np.concatenate([np.asarray(e[key]) for e in episodes])

        obs_shape = metadata.obs_shape
        return cls(
            observations=stack("observations", (0, *obs_shape), np.float32),
            actions=stack("actions", (0,), np.int64),
            rewards=stack("rewards", (0,), np.float32),
            terminations=flags["terminated"],
            truncations=flags["truncated"],
            episode_lengths=lengths,
            expert_ids=np.array([e["expert_id"] for e in episodes], dtype=np.int64),
            start_steps=np.array([e.get("start_step", 0) for e in episodes], dtype=np.int64),
            behavior_log_probs=stack("behavior_log_probs", (0,), np.float32) if all(with_log_probs) and episodes
            else None,
            metadata=metadata,
        )

    @classmethod
    def from_padded(
        cls,
        *,
        observations: Any,
        actions: Any,
        rewards: Any,
        mask: Any,
        terminated: Any,
        metadata: DatasetMetadata,
        behavior_log_probs: Any = None,
        expert_ids: Any = None,
    ) -> "TrajectoryDataset":
        """The inverse of ``padded()``, vectorised: episodes as rows [N, L(+1), ...] with a prefix ``mask`` [N, L].

        Episode i keeps its first ``mask[i].sum()`` transitions and the observations up to the one after its last
        step; it ends terminated where ``terminated[i]``, else truncated. ``expert_ids`` default to 0.
        """
        def array(name: str, value: Any) -> np.ndarray:
            return value.detach().cpu().numpy() if isinstance(value, torch.Tensor) else np.asarray(value)

        mask = array("mask", mask).astype(bool)
        if mask.ndim != 2:
            raise ValidationError("mask", f"expected [N, L], got shape {mask.shape}")
        n, width = mask.shape
        lengths = mask.sum(1).astype(np.int64)
        if not np.array_equal(mask, np.arange(width)[None, :] < lengths[:, None]):
            raise ValidationError("mask", "each row must be a prefix of True values (an episode, then padding)")
        observations = array("observations", observations)
        if observations.shape[:2] != (n, width + 1):
            raise ValidationError("observations", f"expected [{n}, {width + 1}, ...], got {observations.shape}")
        keep_obs = np.arange(width + 1)[None, :] <= lengths[:, None]
        terminated = array("terminated", terminated).astype(bool).reshape(n)
        last = np.cumsum(lengths) - 1
        terminations = np.zeros(int(lengths.sum()), dtype=bool)
        truncations = np.zeros(int(lengths.sum()), dtype=bool)
        terminations[last], truncations[last] = terminated, ~terminated
        return cls(
            observations=observations[keep_obs],
            actions=array("actions", actions)[mask],
            rewards=array("rewards", rewards)[mask],
            terminations=terminations,
            truncations=truncations,
            episode_lengths=lengths,
            expert_ids=np.zeros(n, dtype=np.int64) if expert_ids is None else array("expert_ids", expert_ids),
            behavior_log_probs=None if behavior_log_probs is None else array("behavior_log_probs",
                                                                           behavior_log_probs)[mask],
            metadata=metadata,
        )

    # ------------------------------------------------------------------ basic accessors
    @property
    def n_episodes(self) -> int:
        return len(self.episode_lengths)

    @property
    def n_transitions(self) -> int:
        return len(self.actions)

    @property
    def unit_ids(self) -> np.ndarray:
        """Each episode's privacy unit [n_episodes] (stored as ``expert_ids``; see the module docstring)."""
        return self.expert_ids

    @property
    def n_units(self) -> int:
        return self.metadata.n_experts

    def __len__(self) -> int:
        return self.n_episodes

    def __repr__(self) -> str:
        return (
            f"TrajectoryDataset(env_id={self.metadata.env_id!r}, episodes={self.n_episodes}, "
            f"transitions={self.n_transitions}, experts={self.metadata.n_experts})"
        )

    def _check_episode_indices(self, field_name: str, indices: Any) -> np.ndarray:
        array = _as_typed(field_name, indices, np.int64, "iu")
        if array.ndim != 1:
            raise ValidationError(field_name, f"expected a 1-D array of episode indices, got shape {array.shape}")
        check_int_range(field_name, array, 0, self.n_episodes)
        return array

    def episode(self, i: int) -> dict:
        """Episode ``i`` in the ``from_episodes`` format (arrays are copies)."""
        index = int(self._check_episode_indices("episode", np.array([i]))[0])
        t0, length, o0 = self._transition_starts[index], self.episode_lengths[index], self._observation_starts[index]
        last = t0 + length - 1
        result = {
            "observations": self.observations[o0 : o0 + length + 1].copy(),
            "actions": self.actions[t0 : t0 + length].copy(),
            "rewards": self.rewards[t0 : t0 + length].copy(),
            "terminated": bool(self.terminations[last]),
            "truncated": bool(self.truncations[last]),
            "expert_id": int(self.expert_ids[index]),
            "start_step": int(self.start_steps[index]),
        }
        if self.behavior_log_probs is not None:
            result["behavior_log_probs"] = self.behavior_log_probs[t0 : t0 + length].copy()
        return result

    def episode_observations_actions(self, i: int) -> tuple[np.ndarray, np.ndarray]:
        """(observations [L+1, *obs], actions [L]) of episode ``i``: views into the storage, do not modify."""
        index = int(self._check_episode_indices("episode", np.array([i]))[0])
        t0, length, o0 = self._transition_starts[index], self.episode_lengths[index], self._observation_starts[index]
        return self.observations[o0 : o0 + length + 1], self.actions[t0 : t0 + length]

    # ------------------------------------------------------------------ views
    def transitions(self) -> Transitions:
        """Every transition as fresh, writable arrays (a copy of the data: batch sources use the zero-copy
        ``transition_columns`` instead). Linear in the data; the index arithmetic reuses one buffer, since fresh
        large allocations (page faults) cost more than the gathers themselves."""
        episode_ids = np.repeat(np.arange(self.n_episodes, dtype=np.int64), self.episode_lengths)
        index = np.arange(self.n_transitions, dtype=np.int64)
        index += episode_ids  # episode e's transitions start e observations later (one extra obs per episode)
        obs = np.take(self.observations, index, axis=0)  # row gathers: much faster than fancy indexing
        index += 1
        next_obs = np.take(self.observations, index, axis=0)
        # The same buffer becomes the time index: (t + e + 1) - (first observation of e + 1) + start step of e.
        index -= np.repeat(self._observation_starts + 1 - self.start_steps, self.episode_lengths)
        return Transitions(
            obs=obs,
            actions=self.actions.copy(),
            rewards=self.rewards.copy(),
            next_obs=next_obs,
            terminated=self.terminations.copy(),
            truncated=self.truncations.copy(),
            expert_ids=np.repeat(self.expert_ids, self.episode_lengths),
            episode_ids=episode_ids,
            timesteps=index,
            behavior_log_probs=None if self.behavior_log_probs is None else self.behavior_log_probs.copy(),
        )

    def transition_columns(self) -> dict[str, Any]:
        """Per-transition columns for batch sources, without copying the data: ``actions``, ``rewards``,
        ``terminated``, ``truncated`` (and ``behavior_log_probs`` when logged) are tensors sharing the stored,
        read-only arrays (never write to them); ``obs`` and ``next_obs`` are ``EpisodeObservations`` that gather
        their rows from the flat observations when indexed. Memory: one int64 per episode."""
        episodes = FlatEpisodes(shared_tensor(self.observations), torch.from_numpy(np.cumsum(self.episode_lengths)))
        columns = {
            "obs": EpisodeObservations(episodes, 0),
            "next_obs": EpisodeObservations(episodes, 1),
            "actions": shared_tensor(self.actions),
            "rewards": shared_tensor(self.rewards),
            "terminated": shared_tensor(self.terminations),
            "truncated": shared_tensor(self.truncations),
        }
        if self.behavior_log_probs is not None:
            columns["behavior_log_probs"] = shared_tensor(self.behavior_log_probs)
        return columns

    def expert_episode_index(self) -> tuple[np.ndarray, np.ndarray]:
        """Episodes grouped by expert (CSR): expert i's episodes are ``order[offsets[i]:offsets[i+1]]``, in
        dataset order."""
        return stable_group_order(self.expert_ids, self.metadata.n_experts)  # a counting sort: linear

    def padded(self, episode_indices: Any = None) -> PaddedTrajectories:
        """The selected episodes (default: all, in order) padded to the longest selected one."""
        if episode_indices is None:
            indices = np.arange(self.n_episodes, dtype=np.int64)
        else:
            indices = self._check_episode_indices("episode_indices", episode_indices)
        lengths = self.episode_lengths[indices]
        n, width = len(indices), int(lengths.max()) if len(indices) else 0
        rows = np.arange(n, dtype=np.int64)
        # Slot of every selected transition / observation in the flattened [n * width] / [n * (width + 1)] output.
        slots = concat_ranges(rows * width, lengths)
        sources = concat_ranges(self._transition_starts[indices], lengths)

        def scatter(values: np.ndarray) -> torch.Tensor:
            out = np.zeros(n * width, dtype=values.dtype)
            out[slots] = values[sources]
            return torch.from_numpy(out.reshape(n, width))

        # Rows of a multi-dimensional array: torch's index_copy_ is several times faster than numpy fancy indexing.
        observations = torch.zeros((n * (width + 1), *self.metadata.obs_shape), dtype=torch.float32)
        obs_sources = concat_ranges(self._observation_starts[indices], lengths + 1)
        observations.index_copy_(
            0,
            torch.from_numpy(concat_ranges(rows * (width + 1), lengths + 1)),
            torch.from_numpy(np.take(self.observations, obs_sources, axis=0)),
        )
        mask = np.arange(width)[None, :] < lengths[:, None]
        last = self._transition_starts[indices] + lengths - 1
        return PaddedTrajectories(
            observations=observations.reshape(n, width + 1, *self.metadata.obs_shape),
            actions=scatter(self.actions),
            rewards=scatter(self.rewards),
            mask=torch.from_numpy(mask),
            lengths=torch.from_numpy(lengths.copy()),
            terminated=torch.from_numpy(self.terminations[last]),
            truncated=torch.from_numpy(self.truncations[last]),
            expert_ids=torch.from_numpy(self.expert_ids[indices]),
            start_steps=torch.from_numpy(self.start_steps[indices]),
            behavior_log_probs=(
                None if self.behavior_log_probs is None else scatter(self.behavior_log_probs)
            ),
        )

    def fragments(self, episode_ids: Any, starts: Any, ends: Any) -> "TrajectoryDataset":
        """Transitions ``[starts[j], ends[j])`` of episode ``episode_ids[j]``, one new episode per entry.

        Needs ``0 <= start < end <= length`` (an empty fragment is not an episode: filter those out first).
        A fragment that stops before its episode's end is truncated (terminated=False, truncated=True); one that
        reaches the end keeps the episode's flags. ``start_steps`` shift by ``starts`` so time indices survive.
        """
        ids = self._check_episode_indices("episode_ids", episode_ids)
        starts = _as_typed("starts", starts, np.int64, "iu")
        ends = _as_typed("ends", ends, np.int64, "iu")
        for name, array in (("starts", starts), ("ends", ends)):
            if array.shape != ids.shape:
                raise ValidationError(name, f"expected shape {ids.shape} (one per episode id), got {array.shape}")
        full_lengths = self.episode_lengths[ids]
        if len(ids) and starts.min() < 0:
            raise ValidationError("starts", f"must be >= 0, found {int(starts.min())}")
        bad = np.flatnonzero(ends <= starts)
        if len(bad):
            j = int(bad[0])
            raise ValidationError(
                "ends",
                f"fragment {j} is empty (start {int(starts[j])}, end {int(ends[j])}); fragments need end > start",
            )
        bad = np.flatnonzero(ends > full_lengths)
        if len(bad):
            j = int(bad[0])
            raise ValidationError(
                "ends",
                f"fragment {j} ends at {int(ends[j])} past episode {int(ids[j])}'s length {int(full_lengths[j])}",
            )
        lengths = ends - starts
        flat = concat_ranges(self._transition_starts[ids] + starts, lengths)
        obs_flat = concat_ranges(self._observation_starts[ids] + starts, lengths + 1)
        reaches_end = ends == full_lengths
        new_last = np.cumsum(lengths) - 1
        terminations = self.terminations[flat]
        truncations = self.truncations[flat]
        # A fragment cut before the episode's end did not terminate: it was truncated by the cut.
        terminations[new_last[~reaches_end]] = False
        truncations[new_last[~reaches_end]] = True
        return TrajectoryDataset(
            observations=np.take(self.observations, obs_flat, axis=0),
            actions=self.actions[flat],
            rewards=self.rewards[flat],
            terminations=terminations,
            truncations=truncations,
            episode_lengths=lengths,
            expert_ids=self.expert_ids[ids],
            start_steps=self.start_steps[ids] + starts,
            behavior_log_probs=None if self.behavior_log_probs is None else self.behavior_log_probs[flat],
            metadata=self.metadata,
        )

    def subset(self, episode_indices: Any) -> "TrajectoryDataset":
        """The listed episodes, whole, in the given order (repeats allowed, e.g. for bootstrapping)."""
        ids = self._check_episode_indices("episode_indices", episode_indices)
        return self.fragments(ids, np.zeros_like(ids), self.episode_lengths[ids])

    @classmethod
    def concatenate(cls, datasets: Sequence["TrajectoryDataset"]) -> "TrajectoryDataset":
        """Episodes of every dataset, in order. Metadata must be identical; behaviour log-probs kept only if all
        datasets have them (otherwise an error: silently dropping them would change what OPE can compute)."""
        datasets = list(datasets)
        if not datasets:
            raise ValidationError("datasets", "need at least one dataset to concatenate")
        metadata = datasets[0].metadata
        for i, other in enumerate(datasets[1:], start=1):
            if other.metadata != metadata:
                raise ValidationError(f"datasets[{i}].metadata", "differs from datasets[0].metadata")
        with_log_probs = [d.behavior_log_probs is not None for d in datasets]
        if any(with_log_probs) and not all(with_log_probs):
            raise ValidationError(
                f"datasets[{with_log_probs.index(False)}].behavior_log_probs",
                "missing while other datasets have them",
            )

        def cat(name: str) -> np.ndarray:
            return np.concatenate([getattr(d, name) for d in datasets])

        return cls(
            observations=cat("observations"),
            actions=cat("actions"),
            rewards=cat("rewards"),
            terminations=cat("terminations"),
            truncations=cat("truncations"),
            episode_lengths=cat("episode_lengths"),
            expert_ids=cat("expert_ids"),
            start_steps=cat("start_steps"),
            behavior_log_probs=cat("behavior_log_probs") if all(with_log_probs) else None,
            metadata=metadata,
        )

    def replace(self, **changes: Any) -> "TrajectoryDataset":
        """A validated copy with some constructor fields replaced (the rest shared, not copied)."""
        fields_ = {name: getattr(self, name) for name in _ARRAY_DTYPES}
        unknown = sorted(set(changes) - set(fields_) - {"metadata"})
        if unknown:
            raise ValidationError(unknown[0], "not a TrajectoryDataset field")
        return TrajectoryDataset(**{**fields_, "metadata": self.metadata, **changes})

    def with_identities_removed(self, metadata: DatasetMetadata) -> "TrajectoryDataset":
        """Same episodes, every expert id 0 and no behaviour log-probs (both identify the logging expert)."""
        return self.replace(expert_ids=np.zeros(self.n_episodes, dtype=np.int64), behavior_log_probs=None,
                            metadata=metadata)

    def initial_observations(self) -> np.ndarray:
        """Every episode's first observation [n_episodes, *obs_shape] (a fresh array)."""
        return np.take(self.observations, self._observation_starts, axis=0)

    def episode_returns(self) -> np.ndarray:
        """Undiscounted return of every episode [n_episodes] (float64)."""
        episode_ids = np.repeat(np.arange(self.n_episodes), self.episode_lengths)
        return np.bincount(episode_ids, weights=self.rewards.astype(np.float64), minlength=self.n_episodes)

    def summary(self) -> dict:
        """JSON-safe overview: counts, episodes per expert, returns, lengths, action histogram, end flags."""

        def stats(values: np.ndarray) -> dict:
            if len(values) == 0:
                return {"min": None, "mean": None, "max": None, "std": None}
            values = np.asarray(values, dtype=np.float64)
            return {
                "min": float(values.min()),
                "mean": float(values.mean()),
                "max": float(values.max()),
                "std": float(values.std()),
            }

        per_expert = np.bincount(self.expert_ids, minlength=self.metadata.n_experts)
        last = self._transition_starts + self.episode_lengths - 1
        return {
            "env_id": self.metadata.env_id,
            "n_episodes": self.n_episodes,
            "n_transitions": self.n_transitions,
            "n_experts": self.metadata.n_experts,
            "experts_with_episodes": int(np.count_nonzero(per_expert)),
            "episodes_per_expert": {k: v for k, v in stats(per_expert).items() if k != "std"},
            "episode_return": stats(self.episode_returns()),
            "episode_length": stats(self.episode_lengths),
            "action_counts": np.bincount(self.actions, minlength=self.metadata.n_actions).tolist(),
            "terminated_episodes": int(self.terminations[last].sum()),
            "truncated_episodes": int(self.truncations[last].sum()),
            "has_behavior_log_probs": self.behavior_log_probs is not None,
            "p_min": self.metadata.p_min,
        }

    def fingerprint(self) -> str:
        """sha256 of the content (metadata JSON and every array's dtype, shape and bytes), independent of the file
        it came from: what run directories record as the provenance of their input data."""
        cached = self.__dict__.get("_fingerprint")
        if cached is not None:  # the arrays are read-only views: the content cannot have changed
            return cached
        digest = hashlib.sha256(dump_json(self.metadata.to_dict(), sort_keys=True).encode())
        for name in _ARRAY_DTYPES:
            array = getattr(self, name)
            digest.update(name.encode())
            if array is None:
                digest.update(b"absent")
                continue
            digest.update(f"{array.dtype.str}{array.shape}".encode())
            flat = np.ascontiguousarray(array).reshape(-1)  # a view for stored arrays: hashed in place, in chunks
            step = max(1, _CHUNK_BYTES // max(flat.itemsize, 1))
            for start in range(0, len(flat), step):
                digest.update(memoryview(flat[start : start + step]).cast("B"))
        self._fingerprint = digest.hexdigest()
        return self._fingerprint

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | os.PathLike) -> Path:
        """Write the whole dataset as one ``.npz`` (format in the module docstring), atomically."""
        arrays = {name: getattr(self, name) for name in _ARRAY_DTYPES}
        if arrays["behavior_log_probs"] is None:
            del arrays["behavior_log_probs"]
        payload = {
            "format_version": np.array(FORMAT_VERSION, dtype=np.int64),
            "metadata": np.array(dump_json(self.metadata.to_dict(), sort_keys=True)),
            **arrays,
        }

        def write(tmp: Path) -> None:
            with open(tmp, "wb") as handle:
                write_npz_members(handle, payload)

        return atomic_write(path, write, suffix=".npz")

    @classmethod
    def load(cls, path: str | os.PathLike, *, mmap: bool = False) -> "TrajectoryDataset":
        """Read and fully validate a dataset written by ``save``.

        Sizes are bounded before anything is inflated or allocated (``dporl.utils.archives``): every member's
        declared dtype and shape are compared with the metadata and with each other, and only then read.

        ``mmap=True`` maps the arrays from the file instead of reading them (data larger than RAM): pages are read
        when touched and belong to the page cache, and the batch sources gather only their sampled rows.
        Validation still reads every value once, in chunks. Members that cannot be mapped (compressed, or not
        aligned to their dtype: files written by a bare ``np.savez``) are read as usual. The file must not change
        while the dataset is in use: the arrays are its pages.
        """
        path = Path(path)
        if not path.is_file():
            raise ValidationError("path", f"no dataset file at {path}")
        if not zipfile.is_zipfile(path):
            raise ValidationError("path", f"{path} is not a readable dporl dataset (not a zip archive of .npy arrays)")
        with NpzArchive(path, "path") as archive:
            keys = set(archive.members)
            unexpected = sorted(keys - _ARCHIVE_KEYS)
            if unexpected:
                raise ValidationError(unexpected[0], f"unexpected member in {path} (is this a dporl dataset?)")
            missing = sorted(_ARCHIVE_KEYS - _OPTIONAL_ARRAYS - keys)
            if missing:
                raise ValidationError(missing[0], f"missing from {path} (truncated or not a dporl dataset)")
            version_header = archive.members["format_version"]
            if version_header.shape != () or version_header.dtype.kind not in "iu":
                raise ValidationError("format_version", f"expected an integer scalar, got {version_header.dtype} "
                                      f"{version_header.shape}")
            version = archive.read("format_version")
            if int(version) not in READABLE_VERSIONS:
                raise ValidationError(
                    "format_version", f"file has version {int(version)}, this dporl reads versions {READABLE_VERSIONS}"
                )
            meta_header = archive.members["metadata"]
            if meta_header.shape != () or meta_header.dtype.kind != "U":
                raise ValidationError("metadata", f"expected a JSON string scalar, got {meta_header.dtype} "
                                      f"{meta_header.shape}")
            if meta_header.nbytes > 4 * MAX_JSON_BYTES:
                raise ValidationError("metadata", f"declares {meta_header.nbytes} bytes of metadata, more than a "
                                      "dataset's metadata may hold")
            metadata = DatasetMetadata.from_dict(parse_json(str(archive.read("metadata")), "metadata"))
            _check_declared_sizes(archive.members, metadata)
            names = sorted(keys - {"format_version", "metadata"})
            mapped = _map_members(path, archive, names) if mmap else {}
            contents = {name: mapped[name] if name in mapped else archive.read(name) for name in names}
        return cls(metadata=metadata, **contents)


_CHUNK_BYTES = 1 << 24  # validation and hashing walk large arrays in pieces this size: no full-size temporaries


def _check_finite_chunked(field_name: str, array: np.ndarray) -> None:
    """``check_finite`` over row chunks, so a large (or memory-mapped) array needs no full-size boolean mask."""
    flat = array.reshape(-1)
    step = max(1, _CHUNK_BYTES // max(flat.itemsize, 1))
    bad = 0
    for start in range(0, len(flat), step):
        chunk = flat[start : start + step]
        bad += len(chunk) - int(np.count_nonzero(np.isfinite(chunk)))
    if bad:
        raise ValidationError(field_name, f"contains {bad} non-finite value(s) (NaN or inf)")


_ALIGN = 64  # array data in a saved archive start on 64-byte boundaries of the file (the npy header is padded too)
_PAD_FIELD = 0xD935  # zip extra-field id of a field that only pads (the id Android's zipalign uses)


def write_npz_members(handle: Any, members: Mapping[str, np.ndarray]) -> None:
    """Write ``members`` as an uncompressed ``.npz`` to the seekable binary ``handle``, each array's data aligned.

    The file is an ordinary npz (``np.load`` reads it; members are ``.npy`` files stored without compression, no
    pickles). Each member's local zip header carries a padding extra field sized so that the member starts on a
    64-byte boundary; the ``.npy`` header pads itself to 64 bytes, so every array's data starts on a 64-byte
    boundary of the file and ``TrajectoryDataset.load(path, mmap=True)`` can map it. Arrays are written in chunks
    (a memory-mapped input is never loaded whole).
    """
    with zipfile.ZipFile(handle, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, array in members.items():
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_STORED
            # local header: 30 fixed bytes, the name, our field (4 + pad bytes), the zip64 field (20 bytes, forced)
            header = 30 + len(info.filename.encode("ascii")) + 4 + 20
            pad = -(handle.tell() + header) % _ALIGN
            info.extra = struct.pack("<HH", _PAD_FIELD, pad) + bytes(pad)
            with archive.open(info, mode="w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asanyarray(array), allow_pickle=False)


def _map_member(path: Path, handle: Any, info: zipfile.ZipInfo) -> Optional[np.ndarray]:
    """Member ``info`` of the archive at ``path`` as a read-only memory map, or None when it cannot be mapped
    (compressed, not a version 1/2 ``.npy``, or data not aligned to its dtype). Sizes are checked against the
    member before anything is mapped; an object dtype is refused (no pickles)."""
    if info.compress_type != zipfile.ZIP_STORED:
        return None
    handle.seek(info.header_offset)
    local = handle.read(30)
    if len(local) != 30 or local[:4] != b"PK\x03\x04":
        raise ValidationError(info.filename[:-4], f"member of {path} has a corrupt zip header")
    name_length, extra_length = struct.unpack("<HH", local[26:30])
    start = info.header_offset + 30 + name_length + extra_length
    handle.seek(start)
    version = np.lib.format.read_magic(handle)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(handle)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(handle)
    else:
        return None
    if dtype.hasobject:
        raise ValidationError(info.filename[:-4], f"member of {path} holds Python objects (pickles are refused)")
    offset = handle.tell()
    size = math.prod(shape) * dtype.itemsize
    if offset + size > start + info.file_size:
        raise ValidationError(info.filename[:-4], f"member of {path} is truncated: {shape} {dtype} needs {size} "
                              f"bytes, the member holds {start + info.file_size - offset}")
    if offset % dtype.alignment or size == 0 or not shape:
        return None
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape, order="F" if fortran else "C")



def _map_members(path: Path, archive: NpzArchive, names: list[str]) -> dict[str, np.ndarray]:
    """The members of ``names`` that can be mapped (see ``TrajectoryDataset.load``), as read-only memory maps; their
    headers were checked by ``archive`` and against the metadata already."""
    mapped: dict[str, np.ndarray] = {}
    with open(path, "rb") as handle:
        for key in names:
            try:
                array = _map_member(path, handle, archive.zip_info(key))
            except ValidationError:
                raise
            except Exception as exc:  # a bad npy header: the member is corrupt
                raise ValidationError(
                    key, f"member of {path} is corrupt or truncated ({type(exc).__name__}: {exc})"
                ) from exc
            if array is not None:
                mapped[key] = array
    return mapped


def _check_declared_sizes(members: Mapping[str, NpyMember], metadata: DatasetMetadata) -> None:
    """Every array member's declared dtype, and shape against the metadata and the other members, before reading."""
    for name in _ARRAY_DTYPES:
        member = members.get(name)
        if member is not None and member.dtype != np.dtype(_ARRAY_DTYPES[name]):
            raise ValidationError(name, f"expected dtype {np.dtype(_ARRAY_DTYPES[name]).name}, got {member.dtype}")
    for name in ("episode_lengths", "actions"):
        if len(members[name].shape) != 1:
            raise ValidationError(name, f"expected a 1-d array, got shape {members[name].shape}")
    n_episodes, n_transitions = members["episode_lengths"].shape[0], members["actions"].shape[0]
    expected = {"observations": (n_transitions + n_episodes, *metadata.obs_shape)}
    expected.update({name: (n_transitions,) for name in ("rewards", "terminations", "truncations",
                                                         "behavior_log_probs")})
    expected.update({name: (n_episodes,) for name in ("expert_ids", "start_steps")})
    for name, shape in expected.items():
        check_declared(name, members.get(name), None, shape)
