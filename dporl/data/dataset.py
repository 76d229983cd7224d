"""Logged decision data: ``TrajectoryDataset``, its validation, its views and its on-disk format.

Layout (fixed by docs/design.md). Episodes are stored back to back in flat numpy arrays. Episode ``e`` owns
transitions ``[tstart[e], tstart[e] + len[e])`` and observations ``[tstart[e] + e, tstart[e] + e + len[e] + 1)``
(``len[e] + 1`` observations: the state before every action plus the state after the last one), where
``tstart = cumsum(episode_lengths) - episode_lengths``.

On-disk format (``save`` / ``load``): ONE uncompressed ``.npz`` archive (a zip of ``.npy`` arrays; no pickles)
written atomically, holding exactly these members::

    format_version       int64 scalar, currently 3 (readers accept 1, 2 and 3 and refuse any other value)
    metadata             0-d unicode string: DatasetMetadata as JSON (env_id, n_actions, n_units, obs_shape,
                         env_params, p_min, seed, expert_set, extra, unit_column, unit_keys; action_labels and
                         observation_names only when declared)
    observations         float32 [n_transitions + n_episodes, *obs_shape]
    actions              int64   [n_transitions], in [0, n_actions)
    rewards              float32 [n_transitions]
    terminations         bool    [n_transitions]   only an episode's last step may be True ...
    truncations          bool    [n_transitions]   ... and that step has at least one of the two flags
    episode_lengths      int64   [n_episodes], >= 1, summing to n_transitions
    unit_ids             int64   [n_episodes], in [0, n_units)
    start_steps          int64   [n_episodes], >= 0 (time index of an episode's first transition; 0 unless a fragment)
    behavior_log_probs   float32 [n_transitions], <= 0 (optional member: log pi_behaviour(a_t | s_t))

Every member is a ``.npy`` file stored without compression whose array data starts on a 64-byte boundary of the
archive (a padding zip extra field, id 0xD935, in the member's local header; the ``.npy`` header pads itself to
64 bytes; ``write_npz_members``), so ``load(path, mmap=True)`` maps the arrays straight from the file (data larger
than RAM). Any npz reader reads the file. Archives written by a bare ``np.savez`` load too: what is aligned is
mapped, the rest read.

Privacy units. ``unit_ids`` holds each episode's *unit*: the group of rows a guarantee protects as one. For data
logged by dporl's experts the unit is the expert (``metadata.unit_column`` is None). A table
imported with ``dporl.data.table.read_table(..., unit=COLUMN)`` groups rows by the user's column: ``unit_column``
names it, ``n_units`` is the number of units and ``unit_keys[i]`` is the column's value (as a string) for unit i.
``unit_keys`` let a split by unit depend on the user's id alone (``dporl.privacy.partition``), never on which other
units happen to be present (the dense index i does). Version 1 files (no unit fields) load unchanged; versions 1
and 2 name the unit fields ``expert_ids`` (member) and ``n_experts`` (metadata), read back as ``unit_ids`` and
``n_units`` (the same dataset: ``dporl.data.io``).

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

Modules: ``metadata`` (``DatasetMetadata``, the declared action set), ``storage`` (typed read-only columns, memory-
mapped and aligned npz members), ``views`` (episodes, transitions, padding, grouping by unit, fragments), ``io``
(save / load with the size checks), ``summary`` (overview, fingerprint); this module holds ``TrajectoryDataset``,
its validation and constructors, and re-exports the public names.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from dporl.data.io import FORMAT_VERSION, READABLE_VERSIONS, read_archive, save_archive
from dporl.data.metadata import (
    MAX_ACTIONS,
    MAX_UNITS,
    MAX_OBS_ELEMENTS,
    ActionLabel,
    DatasetMetadata,
    action_set,
    check_observation_names,
)
from dporl.data.storage import (
    _ARRAY_DTYPES,
    EpisodeObservations,
    FlatEpisodes,
    _as_typed,
    _check_finite_chunked,
    shared_tensor,
    write_npz_members,
)
from dporl.data.summary import fingerprint as content_fingerprint
from dporl.data.summary import summary as dataset_summary
from dporl.data.views import EpisodeViews, PaddedTrajectories, Transitions
from dporl.utils.validation import ValidationError, check_int_range

__all__ = [
    "FORMAT_VERSION", "MAX_ACTIONS", "MAX_UNITS", "MAX_OBS_ELEMENTS", "READABLE_VERSIONS", "ActionLabel",
    "DatasetMetadata", "EpisodeObservations", "FlatEpisodes", "PaddedTrajectories", "TrajectoryDataset",
    "Transitions", "action_set", "check_observation_names", "shared_tensor", "write_npz_members",
]


class TrajectoryDataset(EpisodeViews):
    """Episodes grouped by privacy unit (logged by a pool of experts, or a table's units), in the flat layout above.
    Validated on construction.

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
        unit_ids: Any,
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
        self.unit_ids = _as_typed("unit_ids", unit_ids, np.int64, "iu")
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
        for name in ("episode_lengths", "unit_ids", "start_steps"):
            if getattr(self, name).ndim != 1:
                raise ValidationError(name, f"expected a 1-D array, got shape {getattr(self, name).shape}")
        n_episodes = len(self.episode_lengths)
        for name in ("unit_ids", "start_steps"):
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
        check_int_range("unit_ids", self.unit_ids, 0, meta.n_units)
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
        unit_id, optional behavior_log_probs [L] (all or none) and start_step."""
        episodes = list(episodes)
        with_log_probs = [e.get("behavior_log_probs") is not None for e in episodes]
        if any(with_log_probs) and not all(with_log_probs):
            first = with_log_probs.index(not with_log_probs[0])
            raise ValidationError(f"episodes[{first}].behavior_log_probs", "either every episode has them or none")
        lengths = np.zeros(len(episodes), dtype=np.int64)
        for i, episode in enumerate(episodes):
            for key in ("observations", "actions", "rewards", "terminated", "truncated", "unit_id"):
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
            unit_ids=np.array([e["unit_id"] for e in episodes], dtype=np.int64),
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
        unit_ids: Any = None,
    ) -> "TrajectoryDataset":
        """The inverse of ``padded()``, vectorised: episodes as rows [N, L(+1), ...] with a prefix ``mask`` [N, L].

        Episode i keeps its first ``mask[i].sum()`` transitions and the observations up to the one after its last
        step; it ends terminated where ``terminated[i]``, else truncated. ``unit_ids`` default to 0.
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
            unit_ids=np.zeros(n, dtype=np.int64) if unit_ids is None else array("unit_ids", unit_ids),
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
    def n_units(self) -> int:
        """Number of privacy units (``metadata.n_units``); ``unit_ids`` holds each episode's."""
        return self.metadata.n_units

    def __len__(self) -> int:
        return self.n_episodes

    def __repr__(self) -> str:
        return (
            f"TrajectoryDataset(env_id={self.metadata.env_id!r}, episodes={self.n_episodes}, "
            f"transitions={self.n_transitions}, units={self.metadata.n_units})"
        )

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
            unit_ids=cat("unit_ids"),
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
        """Same episodes, every unit id 0 and no behaviour log-probs (both identify the logging expert)."""
        return self.replace(unit_ids=np.zeros(self.n_episodes, dtype=np.int64), behavior_log_probs=None,
                            metadata=metadata)

    def summary(self) -> dict:
        """JSON-safe overview: counts, episodes per unit, returns, lengths, action histogram, end flags."""
        return dataset_summary(self)

    def fingerprint(self) -> str:
        """sha256 of the content (metadata JSON and every array's dtype, shape and bytes), independent of the file
        it came from: what run directories record as the provenance of their input data."""
        cached = self.__dict__.get("_fingerprint")
        if cached is not None:  # the arrays are read-only views: the content cannot have changed
            return cached
        self._fingerprint = content_fingerprint(self)
        return self._fingerprint

    # ------------------------------------------------------------------ persistence
    def save(self, path: str | os.PathLike) -> Path:
        """Write the whole dataset as one ``.npz`` (format in the module docstring), atomically."""
        return save_archive(path, self.metadata, {name: getattr(self, name) for name in _ARRAY_DTYPES})

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
        metadata, contents = read_archive(path, mmap=mmap)
        return cls(metadata=metadata, **contents)
