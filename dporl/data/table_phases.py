"""The phases of ``dporl.data.table.read_table``, each a function of typed inputs: the declared public facts
(``_declared_actions``), reading the named columns (``_read``), mapping rows into the declared action set, episodes,
units, end flags and transitions (``_keep_declared_actions`` ... ``_map_rows``), and building the dataset with its
curator-only import summary (``_build_dataset``). The rules they enforce are in ``dporl.data.table``.

The row passes run in blocks of ``_BLOCK`` rows: temporaries stay small and are reused.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Literal, Mapping, Optional

import numpy as np

from dporl.data.dataset import DatasetMetadata, TrajectoryDataset, action_set
from dporl.data.table_checks import _action_indices, _describe_set, _factorize, _flags, _integers, _numeric
from dporl.data.table_source import Columns, _Phases, _phases, _resolve, _Table
from dporl.utils.validation import ValidationError

DEFAULT_ENV_ID = "offline-table"  # no simulator: the data's environment is not a registered Gymnasium id


@dataclass(frozen=True)
class TableColumns:
    """Which column holds what (``read_table``'s column arguments); ``observations`` / ``next_observations`` are
    column lists once resolved against the table (``_read``)."""

    episode: str
    unit: str
    observations: Columns
    action: str
    reward: str
    step: Optional[str] = None
    terminated: Optional[str] = None
    truncated: Optional[str] = None
    next_observations: Optional[Columns] = None
    propensity: Optional[str] = None
    propensity_kind: Literal["prob", "log_prob"] = "prob"

    def to_load(self) -> list[str]:
        optional = [c for c in (self.step, self.terminated, self.truncated, self.propensity) if c is not None]
        return [self.episode, self.unit, self.action, self.reward, *self.observations,
                *(self.next_observations or []), *optional]

    def record(self) -> dict:
        """The mapping as the import summary records it."""
        return {
            "episode": self.episode, "unit": self.unit, "observations": self.observations, "action": self.action,
            "reward": self.reward, "step": self.step, "terminated": self.terminated, "truncated": self.truncated,
            "next_observations": self.next_observations, "propensity": self.propensity,
            "propensity_kind": self.propensity_kind if self.propensity else None,
        }


@dataclass(frozen=True)
class DeclaredActions:
    """The public action set: ``n_actions`` and, when the actions are labels, ``labels`` (label i is action i)."""

    n_actions: int
    labels: Optional[tuple]

    def describe(self) -> str:
        return _describe_set(self.n_actions, self.labels)


@dataclass
class _Episodes:
    """The table's rows grouped into episodes (rows of one episode contiguous after ``order``, a stable sort)."""

    table: _Table
    order: Optional[np.ndarray]  # None: the rows are already grouped
    starts: np.ndarray  # first row of each episode
    lengths: np.ndarray  # rows per episode
    steps: Optional[np.ndarray]  # the step column (validated), or None

    def __post_init__(self) -> None:
        self.n_rows = int(self.lengths.sum())
        self.lasts = self.starts + self.lengths - 1
        self.is_last = np.zeros(self.n_rows, dtype=bool)
        self.is_last[self.lasts] = True
        self.inside = ~self.is_last[:-1]  # row r and r + 1 belong to the same episode

    @property
    def n_episodes(self) -> int:
        return len(self.starts)

    def column(self, name: str) -> np.ndarray:
        values = self.table[name]
        return values if self.order is None else values[self.order]


@dataclass(frozen=True)
class _Ends:
    """How each episode ends: ``terminated`` [n_episodes], and the truncation column (rows) if the table has one."""

    terminated: np.ndarray
    truncation_flags: Optional[np.ndarray]


@dataclass(frozen=True)
class _Steps:
    """The transitions and observation layout of the imported episodes (``_map_rows``)."""

    observations: np.ndarray  # [n_transitions + kept final states, d]
    actions: np.ndarray
    rewards: np.ndarray
    log_probs: Optional[np.ndarray]
    lengths: np.ndarray  # transitions per episode
    n_dropped: int  # truncated last steps without a next state


def _declared_actions(actions: Any, propensity_kind: str, names: Mapping[str, Any]) -> DeclaredActions:
    """Phase 1: the declared public facts (action set, propensity kind, the required column names), refused by name
    before the file is opened."""
    n_actions, labels = action_set(actions)
    if propensity_kind not in ("prob", "log_prob"):
        raise ValidationError("propensity_kind", f"expected 'prob' or 'log_prob', got {propensity_kind!r}")
    for name, value in names.items():
        if not isinstance(value, str) or not value:
            raise ValidationError(name, f"name the column, got {value!r}")
    return DeclaredActions(n_actions, labels)


def _read(source: Any, requested: TableColumns, progress: bool) -> tuple[_Table, TableColumns, _Phases]:
    """Phase 2: the table's columns (only those named) with observation prefixes resolved, and the progress bar."""
    table = _Table(source)
    phases = _phases(table, progress)
    obs_names = _resolve(table, requested.observations, "observations")
    next_spec = requested.next_observations
    next_names = None if next_spec is None else _resolve(table, next_spec, "next_observations")
    if next_names is not None and len(next_names) != len(obs_names):
        raise ValidationError(
            "next_observations", f"{len(next_names)} column(s) for {len(obs_names)} observation column(s)"
        )
    columns = dataclasses.replace(requested, observations=obs_names, next_observations=next_names)
    table.load(columns.to_load())
    phases.next("episodes")
    if len(table[columns.episode]) == 0:
        raise ValidationError("source", "the table has no rows")
    return table, columns, phases


def _keep_declared_actions(table: _Table, columns: TableColumns, declared: DeclaredActions) -> tuple[np.ndarray, int]:
    """Phase 3a: every row's action index, after dropping each episode that holds an action outside the declared
    set (module docstring); (action indices, episodes dropped)."""
    episode, action = columns.episode, columns.action
    for name in (episode, columns.unit):
        if table[name].dtype.kind == "f":
            _numeric(name, table[name])  # a NaN id would silently start an episode (or a unit) of its own
    action_codes = _action_indices(action, table[action], declared.n_actions, declared.labels)
    if not np.any(action_codes < 0):
        return action_codes, 0
    import pandas as pd

    ids = table[episode]
    outside_ids = pd.unique(ids[action_codes < 0])
    keep = pd.Index(outside_ids).get_indexer(ids) < 0
    if not keep.any():
        first = table[action][int(np.argmax(action_codes < 0))]
        raise ValidationError(
            action, f"every episode holds an action outside the declared set {declared.describe()}"
            f" (e.g. {first.item() if isinstance(first, np.generic) else first!r}): is the set declared right?"
        )
    table.select(keep)
    return action_codes[keep], len(outside_ids)


def _episodes(table: _Table, columns: TableColumns) -> _Episodes:
    """Phase 3b: rows grouped into episodes, keeping their table order (a stable sort by first appearance if
    episodes interleave; a numeric id column that never decreases needs no factorisation), steps checked."""
    ids = table[columns.episode]
    n_rows = len(ids)
    order = None
    if ids.dtype.kind in "iuf" and not np.any(ids[1:] < ids[:-1]):
        episode_codes = ids
    else:
        episode_codes, _ = _factorize(ids, sort=False)
        if np.any(episode_codes[1:] < episode_codes[:-1]):
            order = np.argsort(episode_codes, kind="stable")
            episode_codes = episode_codes[order]
    boundaries = np.flatnonzero(episode_codes[1:] != episode_codes[:-1]) + 1
    starts = np.concatenate([[0], boundaries]).astype(np.int64)
    lengths = np.diff(np.concatenate([starts, [n_rows]])).astype(np.int64)
    episodes = _Episodes(table, order, starts, lengths, None)
    step = columns.step
    if step is not None:
        steps = _integers(step, episodes.column(step))
        inside = episodes.inside
        row = _first_row(lambda a, b: ((steps[a + 1 : b + 1] - steps[a:b]) != 1) & inside[a:b], n_rows - 1)
        if row is not None:
            gap = steps[row + 1] - steps[row]
            kind = "duplicated" if gap == 0 else ("unsorted" if gap < 0 else "skipped")
            raise ValidationError(
                step, f"{kind} step in episode {episodes.column(columns.episode)[row]!r}: step {steps[row]} is "
                f"followed by {steps[row + 1]} (steps of an episode must be consecutive integers in row order)"
            )
        episodes.steps = steps
    return episodes


def _units(episodes: _Episodes, columns: TableColumns) -> tuple[np.ndarray, list[str]]:
    """Phase 3c: each episode's unit (dense index) and the unit keys; a unit owns whole episodes."""
    unit, starts, inside = columns.unit, episodes.starts, episodes.inside
    unit_values = episodes.column(unit)
    unit_of_episode = unit_values[starts]
    row = _first_row(lambda a, b: (unit_values[a + 1 : b + 1] != unit_values[a:b]) & inside[a:b], episodes.n_rows - 1)
    if row is not None:
        row += 1
        raise ValidationError(
            unit, f"episode {episodes.column(columns.episode)[row]!r} is split across units "
            f"({unit_of_episode[np.searchsorted(starts, row, 'right') - 1]!r} and {unit_values[row]!r}): a unit must "
            "own whole episodes"
        )
    unit_ids, unit_uniques = _factorize(unit_of_episode, sort=True)
    unit_keys = [str(value) for value in unit_uniques.tolist()]
    if len(set(unit_keys)) != len(unit_keys):
        raise ValidationError(unit, "distinct unit values print the same; use ids whose text differs")
    return unit_ids, unit_keys


def _end_flags(episodes: _Episodes, columns: TableColumns) -> _Ends:
    """Phase 3d: only an episode's last row may carry an end flag; every last row carries one (none: terminated)."""
    terminated, truncated, is_last, lasts = columns.terminated, columns.truncated, episodes.is_last, episodes.lasts
    term = None if terminated is None else _flags(terminated, episodes.column(terminated))
    trunc = None if truncated is None else _flags(truncated, episodes.column(truncated))
    for name, flags in ((terminated, term), (truncated, trunc)):
        if flags is not None and np.any(flags & ~is_last):
            row = int(np.flatnonzero(flags & ~is_last)[0])
            raise ValidationError(
                name, f"episode {episodes.column(columns.episode)[row]!r} is flagged at a row that is not its last: "
                "only an episode's last row may end it"
            )
    if term is None and trunc is None:
        ends_terminated = np.ones(episodes.n_episodes, dtype=bool)
    elif trunc is None:
        ends_terminated = term[lasts]
    elif term is None:
        ends_terminated = ~trunc[lasts]
    else:
        ends_terminated = term[lasts]
        open_ended = ~(term[lasts] | trunc[lasts])
        if np.any(open_ended):
            e = int(np.flatnonzero(open_ended)[0])
            raise ValidationError(
                terminated, f"episode {episodes.column(columns.episode)[episodes.starts[e]]!r} ends with neither "
                f"{terminated!r} nor {truncated!r} set"
            )
    return _Ends(ends_terminated, trunc)


def _final_next_states(episodes: _Episodes, columns: TableColumns, obs_columns: list,
                       ends: _Ends) -> Optional[np.ndarray]:
    """Each episode's state after its last row, from the next-state columns (None without them); every non-final
    row's next state must equal the following row's state."""
    if columns.next_observations is None:
        return None
    is_last = episodes.is_last
    next_columns = [episodes.column(name) for name in columns.next_observations]
    for name, obs_values, next_values in zip(columns.next_observations, obs_columns, next_columns):
        if next_values.dtype.kind not in "iuf":
            raise ValidationError(name, f"expected numbers, got {next_values.dtype}")
        needed = ~is_last | ~np.repeat(ends.terminated, episodes.lengths)  # terminal next states may be empty (NaN)
        _numeric(name, next_values[needed])
        mismatch = ~is_last[:-1] & (next_values[:-1].astype(np.float32) != obs_values[1:].astype(np.float32))
        if np.any(mismatch):
            row = int(np.flatnonzero(mismatch)[0])
            raise ValidationError(
                name, f"row {row}'s next state differs from the following row's state in episode "
                f"{episodes.column(columns.episode)[row]!r}: a transition's next state must be the next row's state"
            )
    return np.stack([np.asarray(c[episodes.lasts], dtype=np.float32) for c in next_columns], axis=1)


def _log_propensities(name: str, kind: str, values: np.ndarray, copied: bool) -> np.ndarray:
    """log pi_b(a | s) of each transition from a probability (in (0, 1]) or log-probability (<= 0) column;
    ``copied``: ``values`` is a fresh array that may be overwritten."""
    if values.dtype.kind != "f":
        values = values.astype(np.float64)
    if kind == "prob":
        if values.size and (values.min() <= 0 or values.max() > 1):
            raise ValidationError(name, f"probabilities must lie in (0, 1], found [{values.min()}, {values.max()}]")
        return np.log(values, out=values) if copied else np.log(values)  # in place: one fresh array instead of two
    if values.size and values.max() > 0:
        raise ValidationError(name, f"log-probabilities must be <= 0, found {values.max()}")
    return values


def _map_rows(episodes: _Episodes, columns: TableColumns, ends: _Ends, action_codes: np.ndarray) -> _Steps:
    """Phase 3e: observations, next states, actions, rewards and propensities as transitions. Every row is a
    transition except a truncated last row with no next state (dropped); the observation layout holds the rows'
    states plus one final state per episode that kept its last row (the next-state columns' value, or a zero
    placeholder after a termination)."""
    lengths, lasts = episodes.lengths, episodes.lasts
    obs_columns = [_numeric(name, episodes.column(name)) for name in columns.observations]
    final_next = _final_next_states(episodes, columns, obs_columns, ends)
    n_episodes = episodes.n_episodes
    drop = np.zeros(n_episodes, dtype=bool) if final_next is not None else ~ends.terminated
    if np.any(drop & (lengths == 1)):
        e = int(np.flatnonzero(drop & (lengths == 1))[0])
        raise ValidationError(
            "episode", f"episode {episodes.column(columns.episode)[episodes.starts[e]]!r} has no usable step: its "
            "only row is truncated and there are no next-state columns (give next_observations, or drop the "
            "episode yourself)"
        )
    kept = None
    if drop.any():
        kept = np.ones(episodes.n_rows, dtype=bool)
        kept[lasts[drop]] = False

    def transitions_of(values: np.ndarray) -> np.ndarray:
        return values if kept is None else values[kept]

    actions = action_codes if episodes.order is None else action_codes[episodes.order]
    rewards = _numeric(columns.reward, episodes.column(columns.reward))
    log_probs = None
    if columns.propensity is not None:
        values = transitions_of(_numeric(columns.propensity, episodes.column(columns.propensity)))
        log_probs = _log_propensities(columns.propensity, columns.propensity_kind, values, kept is not None)
    full = ~drop
    shift = np.cumsum(full) - full  # extra states inserted before episode e
    n_obs = episodes.n_rows + int(full.sum())
    extra_index = lasts[full] + 1 + shift[full]
    is_row = np.ones(n_obs, dtype=bool)
    is_row[extra_index] = False
    obs = _interleave(obs_columns, is_row, extra_index, n_obs)
    if final_next is not None:
        obs[extra_index] = np.where(ends.terminated[full, None], 0.0, final_next[full])
    # else: zeros already (terminal placeholders)
    return _Steps(obs, transitions_of(actions), transitions_of(rewards), log_probs, lengths - drop, int(drop.sum()))


def _build_dataset(episodes: _Episodes, columns: TableColumns, declared: DeclaredActions, ends: _Ends,
                   units: tuple[np.ndarray, list[str]], steps: _Steps, n_dropped_episodes: int, env_id: Optional[str],
                   extra: Optional[Mapping[str, Any]]) -> TrajectoryDataset:
    """Phase 4: the end flags of the transitions, the import summary (curator-only), metadata and the dataset."""
    unit_ids, unit_keys = units
    ends_terminated = ends.terminated
    term_out = np.zeros(int(steps.lengths.sum()), dtype=bool)
    trunc_out = np.zeros_like(term_out)
    new_lasts = np.cumsum(steps.lengths) - 1
    term_out[new_lasts] = ends_terminated
    truncated_last = None if ends.truncation_flags is None else ends.truncation_flags[episodes.lasts]
    trunc_out[new_lasts] = ~ends_terminated if truncated_last is None else (truncated_last | ~ends_terminated)
    summary = {
        "rows": int(episodes.n_rows),
        "episodes": int(episodes.n_episodes),
        "units": len(unit_keys),
        "transitions": int(steps.lengths.sum()),
        "dropped_truncated_steps": steps.n_dropped,
        "dropped_out_of_set_episodes": n_dropped_episodes,
        "terminal_placeholders": int(ends_terminated.sum()),
        "columns": columns.record(),
    }
    metadata = DatasetMetadata(
        env_id=env_id or DEFAULT_ENV_ID,
        n_actions=int(declared.n_actions),
        n_units=len(unit_keys),
        obs_shape=(len(columns.observations),),
        extra={**dict(extra or {}), "import": summary},
        unit_column=columns.unit,
        unit_keys=tuple(unit_keys),
        action_labels=declared.labels,
        observation_names=tuple(columns.observations),  # the column mapping (or the header's names): public, never values
    )
    return TrajectoryDataset(
        observations=steps.observations,
        actions=steps.actions,
        rewards=steps.rewards,
        terminations=term_out,
        truncations=trunc_out,
        episode_lengths=steps.lengths,
        unit_ids=unit_ids,
        start_steps=None if episodes.steps is None else episodes.steps[episodes.starts],
        behavior_log_probs=steps.log_probs,
        metadata=metadata,
    )



_BLOCK = 1 << 18  # rows per block of the blockwise passes: temporaries stay small and are reused, not page-faulted


def _first_row(bad_rows, n: int) -> Optional[int]:
    """The first index in [0, n) where ``bad_rows(a, b)`` (a boolean block for [a, b)) is True, else None."""
    for a in range(0, n, _BLOCK):
        block = bad_rows(a, min(n, a + _BLOCK))
        if block.any():
            return a + int(np.argmax(block))
    return None


def _interleave(columns: list, is_row: np.ndarray, extra_index: np.ndarray, n_obs: int) -> np.ndarray:
    """Observation matrix [n_obs, d]: the columns' rows where ``is_row``, zeros at ``extra_index`` (sorted).

    Block by block: each block's columns are written with contiguous masked 1-D writes into a small column-major
    buffer, then transposed into the output (twice as fast as a row scatter, and no full-size temporary).
    """
    d = len(columns)
    obs = np.empty((n_obs, d), dtype=np.float32)
    buffer = np.zeros((d, _BLOCK), dtype=np.float32)
    for p0 in range(0, n_obs, _BLOCK):
        p1 = min(n_obs, p0 + _BLOCK)
        mask = is_row[p0:p1]
        r0 = p0 - int(np.searchsorted(extra_index, p0))  # input rows before this block
        r1 = r0 + int(mask.sum())
        view = buffer[:, : p1 - p0]
        view[:, ~mask] = 0.0
        for j, values in enumerate(columns):
            view[j][mask] = values[r0:r1]
        obs[p0:p1] = view.T
    return obs
