"""The logged data a training pipeline reads: ``data: {format: npz | table | minari, ...}`` in a config.

- ``format: npz`` (the default): a saved ``TrajectoryDataset`` (``path``, or ``dataset`` as older configs say it),
  with the expert set that logged it (``expert_set``, default: the path its metadata records); or ``generate``: a
  "dataset" pipeline config run first (its out_dir defaults to ``RUN/curator/data``). ``mmap: true`` maps the
  file's arrays instead of reading them (data larger than RAM).
- ``format: table``: a CSV / Parquet file (``path``) read by ``dporl.data.table.read_table`` with the column mapping
  ``columns`` (``read_table(path, **columns)``: episode, unit, observations, action, reward, the declared action set
  ``actions`` and the optional columns). A table config without ``columns.actions`` is refused by name before
  anything is read or written: the action set is public, never inferred from the rows. ``example`` instead generates a small table of a problem with a known value (the treatment chain of
  ``dporl.eval.ope_coverage``) and imports it the same way; its CSV is kept in ``RUN/curator/data`` to look at.
- ``format: minari``: a local Minari dataset (``path``: its id) with the privacy unit's info key ``unit``
  (``dporl.data.table.read_minari``). Its action set is the dataset's declared ``Discrete(n)`` action space (part of
  its schema, not computed from its episodes).
- ``format: memory``: a dataset handed over in Python (``dporl.DiscreteCQLConfig(...).create(dataset).fit()``).

The privacy unit is the data's (``dporl.privacy.units.dataset_unit``): the logging expert for npz expert data, the
column ``columns.unit`` (or the Minari key) for imported data. Imported datasets (table, minari, memory) are saved
to ``RUN/curator/data/dataset.npz``; the run's provenance records the content hash of the dataset (metadata
included: the unit column and its keys) and the unit, so a resumed run refuses other data or another grouping.
Everything here is curator data: nothing is printed but public facts about the config.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, Union

from dporl.data.dataset import TrajectoryDataset, action_set
from dporl.utils.config import to_dict
from dporl.utils.validation import ValidationError, check_probability

DataFormat = Literal["npz", "table", "minari", "memory"]
IMPORTED_FILE = "dataset.npz"  # imported data, under RUN/curator/data


@dataclass
class TableColumns:
    """``read_table``'s column mapping (see ``dporl.data.table``): which column holds what."""

    episode: str  # the episode id column (rows of one episode in order)
    unit: str  # the privacy unit: every guarantee protects all rows sharing one value of this column
    observations: Union[str, list[str]]  # column names, or one name / a prefix of columns
    action: str  # the logged action column (integers 0..n-1, or the declared labels)
    reward: str  # the reward column
    # The declared action set (public, required): a count n (the column holds 0..n-1) or a list of labels (label i is
    # action i). Never inferred from the rows: one unit's rare action would change it.
    actions: Optional[Union[int, list[Union[int, str]]]] = None
    step: Optional[str] = None  # the step index column (consecutive integers within an episode)
    terminated: Optional[str] = None  # the flag of an episode's terminal last row
    truncated: Optional[str] = None  # the flag of an episode's truncated last row (a next state follows)
    next_observations: Optional[Union[str, list[str]]] = None  # next-state columns (or a prefix), as observations
    propensity: Optional[str] = None  # the behaviour policy's probability of the logged action (or its log)
    propensity_kind: Literal["prob", "log_prob"] = "prob"  # whether propensity holds a probability or its log
    env_id: Optional[str] = None  # the simulator's Gymnasium id, if one exists


# What an example table may ask for: a unit-level guarantee needs at least two units; the sizes bound its memory.
EXAMPLE_RANGES = {"units": (2, 1_000_000), "episodes_per_unit": (1, 1_000)}
MAX_EXAMPLE_EPISODES = 2_000_000


@dataclass
class ExampleTable:
    """A generated example table with a known policy value: the treatment chain (``dporl.eval.ope_coverage``),
    clinicians as units, each treating with its own probability (logged as the propensity)."""

    problem: Literal["treatment_chain"] = "treatment_chain"  # the example problem
    units: int = 4000  # clinicians (the privacy units)
    episodes_per_unit: int = 4  # stays logged by each clinician
    behaviour_low: float = 0.2  # each clinician treats with a probability drawn from [behaviour_low, behaviour_high]
    behaviour_high: float = 0.8  # see behaviour_low
    seed: int = 0  # public randomness: the example stands in for someone's logged data

    def __post_init__(self) -> None:
        for name, (low, high) in EXAMPLE_RANGES.items():
            value = getattr(self, name)
            if not low <= value <= high:
                raise ValidationError(f"data.example.{name}", f"must be an integer in [{low}, {high}], got {value}")
        if self.units * self.episodes_per_unit > MAX_EXAMPLE_EPISODES:
            raise ValidationError("data.example.episodes_per_unit", f"units x episodes_per_unit = "
                                  f"{self.units * self.episodes_per_unit} episodes; at most {MAX_EXAMPLE_EPISODES}")
        check_probability("data.example.behaviour_low", self.behaviour_low, allow_zero=False, allow_one=False)
        check_probability("data.example.behaviour_high", self.behaviour_high, allow_zero=False, allow_one=False)
        if self.behaviour_low > self.behaviour_high:
            raise ValidationError("data.example.behaviour_low", "must be <= behaviour_high")

    def frame(self):
        """The example as a pandas DataFrame (one row per decision, the columns of ``example_columns``)."""
        from dporl.eval.ope_coverage import treatment_chain_frame

        return treatment_chain_frame(self.units, self.episodes_per_unit, (self.behaviour_low, self.behaviour_high),
                                     self.seed)


def example_columns() -> TableColumns:
    """The column mapping of the example tables (``to_frame``'s layout, clinicians as units)."""
    return TableColumns(episode="episode", unit="clinician", observations="obs_", action="action", reward="reward",
                        actions=2, step="step", terminated="terminated", truncated="truncated",
                        next_observations="next_obs_", propensity="propensity")


@dataclass
class DataConfig:
    """Where the logged data come from (module docstring)."""

    format: DataFormat = "npz"  # npz (a saved dataset), table (CSV / Parquet), minari, memory (the Python API)
    path: Optional[str] = None  # npz file, CSV / Parquet table, or Minari dataset id
    dataset: Optional[str] = None  # format npz: the same as path (older configs)
    expert_set: Optional[str] = None  # format npz: the ExpertSet that logged the data
    # format npz: a "dataset" pipeline config (pipeline key optional). Its out_dir defaults to RUN/curator/data; an
    # out_dir that already holds the same generation is reused, one holding another generation is refused.
    generate: Optional[dict[str, Any]] = None
    columns: Optional[TableColumns] = None  # format table: the column mapping
    example: Optional[ExampleTable] = None  # format table: generate this example instead of reading path
    unit: Optional[str] = None  # format minari: the episode info key holding each episode's unit id
    minari_root: Optional[str] = None  # format minari: the datasets directory (default: Minari's)
    # format npz: map the saved file's arrays instead of reading them (data larger than RAM; see
    # TrajectoryDataset.load). The file must not change while the run uses it.
    mmap: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.mmap, bool):
            raise ValidationError("data.mmap", f"expected true or false, got {self.mmap!r}")
        if self.mmap and self.format != "npz":
            raise ValidationError("data.mmap", f"does not apply to data.format {self.format!r} (npz files only)")
        given = {name: getattr(self, name) is not None
                 for name in ("path", "dataset", "expert_set", "generate", "columns", "example", "unit", "minari_root")}
        allowed = {
            "npz": {"path", "dataset", "expert_set", "generate"},
            "table": {"path", "columns", "example"},
            "minari": {"path", "unit", "minari_root"},
            "memory": set(),
        }[self.format]
        stray = [name for name, present in given.items() if present and name not in allowed]
        if stray:
            raise ValidationError(f"data.{stray[0]}", f"does not apply to data.format {self.format!r}")
        if self.format == "npz":
            if sum(given[name] for name in ("path", "dataset", "generate")) != 1:
                raise ValidationError("data", "give exactly one of data.path (a saved dataset) or data.generate")
        elif self.format == "table":
            if self.columns is None and self.example is None:
                raise ValidationError("data.columns", "a table needs its column mapping (episode, unit, "
                                      "observations, action, reward, ...)")
            if given["path"] == given["example"]:
                raise ValidationError("data.path", "give exactly one of data.path (a CSV / Parquet file) or "
                                      "data.example")
            if self.columns is not None:  # refused by name before anything is read or written
                action_set(self.columns.actions, "data.columns.actions")
        elif self.format == "minari":
            if not given["path"] or not given["unit"]:
                raise ValidationError("data.unit" if given["path"] else "data.path",
                                      "a Minari dataset needs its id (data.path) and the info key of the privacy "
                                      "unit (data.unit)")

    @property
    def npz_path(self) -> Optional[str]:
        return self.path if self.path is not None else self.dataset

    @property
    def imported(self) -> bool:
        """Whether the data come in through an importer (saved to RUN/curator/data)."""
        return self.format != "npz"

    def table_columns(self) -> TableColumns:
        return self.columns if self.columns is not None else example_columns()


def check_inputs_outside(run: Any, inputs: Mapping[str, Any]) -> None:
    """Refuse (naming the field, deleting nothing) an input file or directory that lies inside a run directory
    ``--overwrite`` is about to remove: the replaced run would take the user's data with it.

    ``run``: the ``RunDirectory``; ``inputs``: field -> path (None entries are skipped). A path counts as inside when
    it is, as written (a link inside the directory is removed with it) or with links resolved (a link to a file in
    it). Data a generation writes inside the run directory are regenerated, not inputs: callers leave them out.
    """
    if run.mode != "overwrite" or not run.existing:
        return
    roots = {Path(os.path.abspath(run.root)), Path(run.root).resolve()}
    for field_name, path in inputs.items():
        if path is None:
            continue
        candidates = {Path(os.path.abspath(path)), Path(path).resolve()}
        if any(candidate == root or candidate.is_relative_to(root) for candidate in candidates for root in roots):
            raise ValidationError(
                field_name, f"{path} lies inside {run.root}, which --overwrite would delete with it: move the input "
                "out of the run directory first (nothing was deleted)")


def data_inputs(config: DataConfig) -> dict[str, Any]:
    """The user's input files of ``config`` (field -> path), for ``check_inputs_outside``."""
    inputs: dict[str, Any] = {"data.path": config.path, "data.dataset": config.dataset,
                              "data.expert_set": config.expert_set, "data.minari_root": config.minari_root}
    if config.format == "minari" and config.path is not None and not Path(config.path).exists():
        inputs["data.path"] = None  # a Minari id, not a path (under data.minari_root)
    if config.generate is not None:
        inputs["data.generate.expert_set_path"] = config.generate.get("expert_set_path")
    return inputs


def import_dataset(config: DataConfig, progress: bool = True) -> tuple[TrajectoryDataset, Optional[Any]]:
    """An imported dataset (formats table and minari; reads only, writes nothing), and the example's DataFrame
    when the table was generated (to keep beside it)."""
    from dporl.data.table import read_minari, read_table

    if config.format == "table":
        frame = config.example.frame() if config.example is not None else None
        mapping = to_dict(config.table_columns())
        return read_table(frame if frame is not None else config.path, **mapping, progress=progress), frame
    if config.format == "minari":
        return read_minari(config.path, unit=config.unit, root=config.minari_root, progress=progress), None
    raise ValidationError("data.format", f"{config.format!r} is not imported")


def save_imported(dataset: TrajectoryDataset, curator_data: Path, frame: Optional[Any] = None) -> Path:
    """Keep an imported dataset (and a generated example's CSV) in ``RUN/curator/data`` (curator-only)."""
    from dporl.utils.io import atomic_write

    path = curator_data / IMPORTED_FILE
    if not path.exists() or TrajectoryDataset.load(path).fingerprint() != dataset.fingerprint():
        dataset.save(path)
    if frame is not None and not (curator_data / "example.csv").exists():
        atomic_write(curator_data / "example.csv", lambda tmp: frame.to_csv(tmp, index=False), suffix=".csv")
    return path
