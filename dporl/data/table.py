"""Logged decisions from a table (CSV, Parquet or a pandas DataFrame) into a validated ``TrajectoryDataset``.

One row per decision: an episode id, a unit id (the privacy unit: a patient, a clinician, an expert; any grouping
the user chooses), observation columns, the action taken, the reward, and optionally the step index, end flags,
next-state columns and the behaviour policy's propensity of the logged action::

    dataset = read_table("stays.csv", episode="stay_id", unit="patient_id", observations=["hr", "bp", "spo2"],
                         action="treatment", actions=["none", "fluids", "vasopressor"], reward="outcome",
                         step="hour", terminated="discharged")

The action set is declared, never read from the rows: ``actions`` is a count n (the column holds the integers
0..n-1) or a list of labels (the column holds those labels, strings or integers; label i becomes action index i,
and the labels are kept in ``metadata.action_labels`` and in every released policy's action space). The observation
columns' names are kept the same way (``metadata.observation_names``, the released policy's observation space), so a
released policy acts on ``{column: value}`` and answers with a label (``dporl.train.export.GreedyPolicy.act``). A set inferred
from the rows (the largest logged action + 1) would be private: one unit who once logged a rare action changes it,
and with it the shape of every released network. Inferring the logged actions is a curator's inspection
(``logged_action_values``, ``dporl data inspect``), never an input of a run.

What the importer decides, so that no algorithm ever reads an invented state as data:

- Rows of one episode are taken in table order (episodes may interleave). With a ``step`` column, steps inside an
  episode must be consecutive integers in that order: an unsorted, duplicated or skipped step is an error (a gap
  would glue two non-adjacent states into one transition).
- An episode's last row ends it. Without flag columns that end is a termination. With ``terminated`` and/or
  ``truncated`` columns only the last row may carry a flag, and a last row must carry one of them (a missing column
  is the complement of the other).
- A terminal step needs no next state: the layout's observation after it is a zero placeholder that every
  consumer masks (``1 - terminated``; see ``dporl.data.dataset``).
- A truncated last step needs a next state. With ``next_observations`` columns it comes from them; without them the
  step is dropped (its observation becomes the episode's final state) and the import summary counts it. An episode
  left with no step is malformed (an error: give its next state or drop it yourself).
- With ``next_observations`` columns, each non-final row's next state must equal the following row's state.

Values outside a declared set are brought into the run's domain, never refused: an episode holding an action
outside the declared action set is dropped whole (its unit keeps its other episodes; a unit left with none is
absent), and ``metadata.extra["import"]["dropped_out_of_set_episodes"]`` and a labelled stderr line tell the curator.
Dropping depends on each unit's own rows only, so it maps neighbouring datasets (add/remove one unit) to
neighbouring (or equal) datasets and every guarantee downstream holds for the data as given; a refusal would instead
turn one unit's rare action into an error where its neighbour gets a release. (A row cannot be dropped alone: it
would glue two non-adjacent states into one transition.)

Malformed data are refused, each with a ``ValidationError`` naming the column: a missing column, a non-numeric or
missing value, NaN or inf, an action value that is no action at all (a fraction; text where a count is declared),
an unsorted / duplicated / skipped step, an episode split across units, a misplaced end flag, a propensity outside
(0, 1] (or a log-propensity > 0), an episode with no usable step. That refusal is the curator's data validation: it
runs on the curator's machine before any run directory, ledger or release exists and reaches the curator only; a
refused import releases nothing, and the guarantee is stated for the well-formed tables a run accepts. The curator
repairs the table and imports again. What does not happen is a refusal after a run has started, or one against a
value that only a mechanism may see.

The unit column's values become ``metadata.unit_keys`` (strings) and ``metadata.unit_column`` names the column, so
every sampler groups by the user's unit and every split by unit is a function of the user's id
(``dporl.privacy.partition``). ``metadata.extra["import"]`` records what the import did (rows, dropped steps,
placeholders); it counts private rows, so it is curator information: never print it in a release.

All work is vectorised over rows (one stable sort only when episodes interleave), so importing costs a small
multiple of reading the file (``benchmarks/bench_table.py``).

Modules: ``table_source`` reads the named columns of a file or DataFrame with its sizes bounded, ``table_checks``
checks column values, ``table_phases`` holds ``read_table``'s phases; this module is the public entry.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Literal, Mapping, Optional

import numpy as np

from dporl.data.dataset import DatasetMetadata, TrajectoryDataset
from dporl.data.table_checks import _factorize, _integers
from dporl.data.table_phases import (
    DEFAULT_ENV_ID,
    DeclaredActions,
    TableColumns,
    _build_dataset,
    _declared_actions,
    _end_flags,
    _episodes,
    _keep_declared_actions,
    _map_rows,
    _read,
    _units,
)
from dporl.data.table_source import PROGRESS_BYTES, PROGRESS_ROWS, Columns, _csv_header, _Table
from dporl.utils.io import curator_note
from dporl.utils.validation import ValidationError


def logged_action_values(source: Any, action: str) -> list:
    """The distinct values of the ``action`` column, sorted: what the rows logged (CURATOR-ONLY).

    This is an inspection of private data (``dporl data inspect``): it may change when one unit is added or removed,
    so it is never an input of a private run. Declare the action set you mean (``read_table(..., actions=...)``).
    """
    import pandas as pd

    table = _Table(source)
    table.load([action])
    values = table[action]
    if values.dtype.kind == "f":
        values = _integers(action, values)
    uniques = pd.unique(values)
    try:
        return sorted(uniques.tolist())
    except TypeError:  # mixed types: sort by their text
        return sorted(uniques.tolist(), key=str)



def read_table(
    source: Any,
    *,
    episode: str,
    unit: str,
    observations: Columns,
    action: str,
    reward: str,
    actions: Any = None,
    step: Optional[str] = None,
    terminated: Optional[str] = None,
    truncated: Optional[str] = None,
    next_observations: Optional[Columns] = None,
    propensity: Optional[str] = None,
    propensity_kind: Literal["prob", "log_prob"] = "prob",
    env_id: Optional[str] = None,
    extra: Optional[Mapping[str, Any]] = None,
    progress: bool = True,
) -> TrajectoryDataset:
    """A validated ``TrajectoryDataset`` from a table with one row per decision (see the module docstring).

    ``observations`` / ``next_observations``: a list of numeric columns, or a string naming one column or else a
    prefix of columns (in table order). ``propensity``: the behaviour policy's probability of the logged action
    (``propensity_kind="prob"``, in (0, 1]) or its log (``"log_prob"``, <= 0). ``actions`` (required, public): the
    declared action set, a count or a list of labels (module docstring); an episode holding an action outside it is
    dropped (counted in the import summary, curator-only). ``env_id``: the simulator's id if one exists. ``progress``: a bar over
    the import's phases for large tables (over ``PROGRESS_BYTES`` on disk or ``PROGRESS_ROWS`` rows).
    """
    declared = _declared_actions(actions, propensity_kind,
                                 {"episode": episode, "unit": unit, "action": action, "reward": reward})
    requested = TableColumns(episode, unit, observations, action, reward, step, terminated, truncated,
                             next_observations, propensity, propensity_kind)
    table, columns, phases = _read(source, requested, progress)
    action_codes, n_dropped_episodes = _keep_declared_actions(table, columns, declared)
    episodes = _episodes(table, columns)
    phases.next("units")
    units = _units(episodes, columns)
    ends = _end_flags(episodes, columns)
    phases.next("observations")
    steps = _map_rows(episodes, columns, ends, action_codes)
    phases.close()
    if n_dropped_episodes:
        curator_note(f"read_table dropped {n_dropped_episodes} episode(s) holding an action outside the declared set "
                     f"{declared.describe()} (metadata.extra['import'] counts them)")
    return _build_dataset(episodes, columns, declared, ends, units, steps, n_dropped_episodes, env_id, extra)



def to_frame(dataset: TrajectoryDataset, *, next_observations: bool = False, unit: str = "unit"):
    """One row per transition (the inverse of ``read_table``): episode, ``unit`` (the unit key), step, obs_0..,
    action (its declared label when the dataset has labels), reward, terminated, truncated, optionally next_obs_0.. and
    log_propensity. For writing example tables."""
    import pandas as pd

    t = dataset.transitions()
    keys = np.asarray(dataset.metadata.unit_key_strings(), dtype=object)
    frame = {"episode": t.episode_ids, unit: keys[t.unit_ids], "step": t.timesteps}
    obs = t.obs.reshape(len(t), -1)
    frame.update({f"obs_{j}": obs[:, j] for j in range(obs.shape[1])})
    labels = dataset.metadata.action_labels
    actions = t.actions if labels is None else np.asarray(labels)[t.actions]
    frame.update(action=actions, reward=t.rewards, terminated=t.terminated, truncated=t.truncated)
    if next_observations:
        nxt = t.next_obs.reshape(len(t), -1)
        frame.update({f"next_obs_{j}": nxt[:, j] for j in range(nxt.shape[1])})
    if t.behavior_log_probs is not None:
        frame["log_propensity"] = t.behavior_log_probs
    return pd.DataFrame(frame)




def import_summary(dataset: TrajectoryDataset) -> Optional[dict]:
    """What ``read_table`` did (rows, dropped truncated steps, placeholders, column mapping); curator-only."""
    return dataset.metadata.extra.get("import")


def read_minari(
    source: str | os.PathLike,
    *,
    unit: str | Mapping[int, int],
    root: Optional[str | os.PathLike] = None,
    behavior_log_prob_key: Optional[str] = "behavior_log_prob",
    progress: bool = True,
) -> TrajectoryDataset:
    """A local Minari dataset with the privacy unit named: ``unit`` is the info key holding each episode's unit id
    (constant over the episode), or a mapping Minari episode id -> unit id. Wraps
    ``dporl.data.minari_io.import_minari``; the unit column and keys are recorded as ``read_table`` records them."""
    from dporl.data.minari_io import import_minari  # the minari extra, needed here only

    dataset = import_minari(
        source, expert_id_key=unit, root=root, behavior_log_prob_key=behavior_log_prob_key, progress=progress
    )
    column = unit if isinstance(unit, str) else "minari_episode_unit"
    return with_unit(dataset, column)


def with_unit(dataset: TrajectoryDataset, column: str) -> TrajectoryDataset:
    """The same episodes with units re-indexed densely from their ids and the unit ``column`` recorded."""
    ids, uniques = _factorize(dataset.unit_ids, sort=True)
    meta = dataset.metadata.to_dict()
    meta.update(n_units=len(uniques), unit_column=column, unit_keys=[str(int(u)) for u in uniques])
    return dataset.replace(unit_ids=ids, metadata=DatasetMetadata.from_dict(meta))


def table_header(source: str | os.PathLike) -> list[str]:
    """The column names of a CSV / TSV (its first line, bounded) or Parquet file (its schema): never a row."""
    path = Path(source)
    if not path.is_file():
        raise ValidationError("source", f"no file at {path}")
    suffix = path.suffix.lower()
    if suffix in (".parquet", ".pq"):
        import pyarrow.parquet as pq

        try:
            return [str(name) for name in pq.read_schema(path).names]
        except Exception as exc:
            raise ValidationError("source", f"{path} is not a readable Parquet file ({exc})") from None
    if suffix in (".csv", ".tsv", ".txt", ".gz"):
        return _csv_header(path, "\t" if ".tsv" in path.suffixes else ",")
    raise ValidationError("source", f"unknown table format {path.suffix!r}: use .csv, .tsv or .parquet")


__all__ = [
    "DEFAULT_ENV_ID", "PROGRESS_BYTES", "PROGRESS_ROWS", "DeclaredActions", "TableColumns", "import_summary",
    "logged_action_values", "read_minari", "read_table", "table_header", "to_frame", "with_unit",
]
