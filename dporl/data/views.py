"""Views of a ``TrajectoryDataset``: single episodes, flat transitions (copied, or zero-copy columns for batch
sources), episodes padded to a common length, episodes grouped by unit, fragments and subsets.

``EpisodeViews`` is the dataset's view half (``TrajectoryDataset`` inherits it); every per-episode slice is one
vectorised gather (``concat_ranges``), never a Python loop over episodes.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any, Optional, Self

import numpy as np
import torch

from dporl.data.metadata import DatasetMetadata
from dporl.data.storage import EpisodeObservations, FlatEpisodes, _as_typed, shared_tensor
from dporl.utils.grouping import concat_ranges, stable_group_order
from dporl.utils.validation import ValidationError, check_int_range


@dataclass(frozen=True)
class Transitions:
    """Flat per-transition view (numpy). ``timesteps`` is the index in the original episode (fragments keep it)."""

    obs: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    next_obs: np.ndarray
    terminated: np.ndarray
    truncated: np.ndarray
    unit_ids: np.ndarray
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
    unit_ids: torch.Tensor  # [N] int64
    start_steps: torch.Tensor  # [N] int64
    behavior_log_probs: Optional[torch.Tensor]  # [N, L] or None when not logged

    def to_dict(self) -> dict[str, torch.Tensor]:
        """The tensors by field name (rows along dim 0, as a Batch's ``data``); absent log-probs are left out."""
        return {f.name: getattr(self, f.name) for f in fields(self) if getattr(self, f.name) is not None}


class EpisodeViews:
    """The views of a dataset in the flat episode layout (``dporl.data.dataset``); ``TrajectoryDataset`` holds the
    arrays and the episode offsets (``_transition_starts``, ``_observation_starts``) these read."""

    metadata: DatasetMetadata
    observations: np.ndarray
    actions: np.ndarray
    rewards: np.ndarray
    terminations: np.ndarray
    truncations: np.ndarray
    episode_lengths: np.ndarray
    unit_ids: np.ndarray
    start_steps: np.ndarray
    behavior_log_probs: Optional[np.ndarray]
    n_episodes: int
    n_transitions: int
    _transition_starts: np.ndarray
    _observation_starts: np.ndarray

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
            "unit_id": int(self.unit_ids[index]),
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
            unit_ids=np.repeat(self.unit_ids, self.episode_lengths),
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

    def unit_episode_index(self) -> tuple[np.ndarray, np.ndarray]:
        """Episodes grouped by privacy unit (CSR): unit i's episodes are ``order[offsets[i]:offsets[i+1]]``, in
        dataset order."""
        return stable_group_order(self.unit_ids, self.metadata.n_units)  # a counting sort: linear

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
            unit_ids=torch.from_numpy(self.unit_ids[indices]),
            start_steps=torch.from_numpy(self.start_steps[indices]),
            behavior_log_probs=(
                None if self.behavior_log_probs is None else scatter(self.behavior_log_probs)
            ),
        )

    def fragments(self, episode_ids: Any, starts: Any, ends: Any) -> Self:
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
        return type(self)(
            observations=np.take(self.observations, obs_flat, axis=0),
            actions=self.actions[flat],
            rewards=self.rewards[flat],
            terminations=terminations,
            truncations=truncations,
            episode_lengths=lengths,
            unit_ids=self.unit_ids[ids],
            start_steps=self.start_steps[ids] + starts,
            behavior_log_probs=None if self.behavior_log_probs is None else self.behavior_log_probs[flat],
            metadata=self.metadata,
        )

    def subset(self, episode_indices: Any) -> Self:
        """The listed episodes, whole, in the given order (repeats allowed, e.g. for bootstrapping)."""
        ids = self._check_episode_indices("episode_indices", episode_indices)
        return self.fragments(ids, np.zeros_like(ids), self.episode_lengths[ids])


    def initial_observations(self) -> np.ndarray:
        """Every episode's first observation [n_episodes, *obs_shape] (a fresh array)."""
        return np.take(self.observations, self._observation_starts, axis=0)

    def episode_returns(self) -> np.ndarray:
        """Undiscounted return of every episode [n_episodes] (float64)."""
        episode_ids = np.repeat(np.arange(self.n_episodes), self.episode_lengths)
        return np.bincount(episode_ids, weights=self.rewards.astype(np.float64), minlength=self.n_episodes)
