"""A pipeline run on D and on its neighbour D', through the code users run, and what each side released.

``NeighbourPair`` names a pipeline config (the YAML dict a user gives ``dporl train``), the relation and the unit
that differs, and how to run it:

- ``via="process"``: what ``dporl train --config`` does after parsing its arguments (``run_cli`` over
  ``get_pipeline(name).run(config)``), in this process;
- ``via="cli"``: ``python -m dporl train --config config.yaml`` in a subprocess;
- ``via="api"``: ``dporl.read_table(...)`` then the Python API config of the pair's registered ``algorithm``
  (``dporl.DiscreteCQLConfig(**api)``, ...) ``.create(data).fit(run_dir=...)`` and ``print(result)``.

``prepare`` writes each side's inputs (``D/`` and ``D'/``: the same relative paths, so a printed path is the same
string on both sides) from the config's data: a saved or generated expert dataset with its expert set, a CSV /
Parquet table (or the generated example table), an fnq dataset; without a data file (fnq online, the ope
experiments, whose data are drawn inside the run) D' is made at run time: fnq online reads its rewards from the
environment, so on D' every environment of ``env_id`` the run makes pays ``change`` more per transition
(``shifted_rewards``: the neighbouring reward function, training and evaluation alike); the ope pipeline takes a
``problem`` whose private draws lose (or replace) one trajectory while the public tuning draws are untouched. ``run_side`` runs one side with a given noise seed in a run
directory of its own and returns its ``Snapshot``; both sides of a pair share the seed, so every difference comes
from the data.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import io
import os
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Literal, Optional

import yaml

from dporl.audit import neighbours
from dporl.audit.release_snapshot import Snapshot, describe_outcome, snapshot
from dporl.utils.validation import ValidationError

Relation = Literal["remove", "replace", "reward"]
Via = Literal["process", "cli", "api"]
SIDES = ("D", "D'")
SIDE_DIRS = {"D": "D", "D'": "Dprime"}
CONFIG_FILE = "config.yaml"
DATA_DIR = "data"


@dataclass
class NeighbourPair:
    """A pipeline config and the neighbouring relation to test it on (module docstring).

    ``unit``: the unit removed or replaced (an index in the data's unit order), the transition whose reward changes
    (``relation="reward"`` on a dataset; online, every reward of the environment changes), or the trajectory (ope). ``unit_key``: tables, the unit column's value instead of an index.
    ``donor``: replace-one, whose data take the unit's place. ``change``: reward-level, the change of the reward(s).
    """

    config: dict[str, Any]
    relation: Relation = "remove"
    unit: int = 0
    unit_key: Optional[str] = None
    donor: int = 1
    change: float = 1.0
    via: Via = "process"
    api: dict[str, Any] = field(default_factory=dict)  # via "api": the API config's keyword arguments
    algorithm: str = "cql"  # via "api": the registered algorithm whose API config runs
    timeout: float = 600.0  # via "cli": seconds per side

    @property
    def pipeline(self) -> str:
        return str(self.config.get("pipeline"))


@dataclass
class SideRun:
    side: str
    snapshot: Snapshot
    seconds: float
    run_dir: Path


# ---------------------------------------------------------------------------------------------------- inputs
def prepare(pair: NeighbourPair, base: str | Path) -> dict[str, Path]:
    """Write each side's inputs and config under ``base`` (``D/``, ``Dprime/``); the side directories by side."""
    base = Path(base)
    dirs = {side: base / SIDE_DIRS[side] for side in SIDES}
    for directory in dirs.values():
        (directory / DATA_DIR).mkdir(parents=True, exist_ok=True)
    config = copy.deepcopy(pair.config)
    pipeline = pair.pipeline
    if pipeline == "train":
        config = _prepare_train(pair, config, dirs, base)
    elif pipeline == "fnq":
        config = _prepare_fnq(pair, config, dirs)
    elif pipeline != "ope":
        raise ValidationError("pipeline", f"no neighbour construction for pipeline {pipeline!r}")
    for directory in dirs.values():
        (directory / CONFIG_FILE).write_text(yaml.safe_dump(config, sort_keys=False))
    return dirs


def _prepare_train(pair: NeighbourPair, config: dict, dirs: dict[str, Path], base: Path) -> dict:
    data = dict(config.get("data") or {})
    fmt = data.get("format", "npz")
    if pair.via == "api" and fmt != "table":
        raise ValidationError("via", "the Python API case reads a table (data.format: table)")
    if fmt == "table":
        frame = _source_frame(data)
        column = table_columns(data)["unit"]
        key = pair.unit_key if pair.unit_key is not None else _unit_key(frame, column, pair.unit)
        if pair.relation == "remove":
            other = neighbours.frame_without_unit(frame, column, key)
        elif pair.relation == "replace":
            other = _frame_replace_unit(frame, column, key, _unit_key(frame, column, pair.donor), data)
        else:
            raise ValidationError("relation", "the train pipeline protects units: use remove or replace")
        for side, table in (("D", frame), ("D'", other)):
            table.to_csv(dirs[side] / DATA_DIR / "table.csv", index=False)
        data = {"format": "table", "path": f"{DATA_DIR}/table.csv", "columns": table_columns(data)}
        return {**config, "data": data}
    if fmt != "npz":
        raise ValidationError("data.format", f"neighbours of {fmt!r} data are not built here (use npz or table)")
    from dporl.data.dataset import TrajectoryDataset
    from dporl.experts.expert_set import ExpertSet

    if data.get("generate") is not None:
        from dporl.pipelines.train import generate_dataset

        dataset_path, expert_path = generate_dataset({**data["generate"], "progress": False}, base / "source")
    else:
        dataset_path = data.get("path") or data.get("dataset")
        expert_path = data.get("expert_set")
    dataset = TrajectoryDataset.load(dataset_path)
    if expert_path is None:
        expert_path = (dataset.metadata.expert_set or {}).get("path")
    experts = ExpertSet.load(expert_path) if expert_path is not None else None
    if pair.relation == "remove":
        other_experts = neighbours.experts_without(experts, pair.unit) if experts is not None else None
        pairs = {"D": (dataset, experts), "D'": (None, other_experts)}
    elif pair.relation == "replace":
        pairs = {"D": (dataset, experts), "D'": (neighbours.replace_unit(dataset, pair.unit, pair.donor), experts)}
    else:
        raise ValidationError("relation", "the train pipeline protects units: use remove or replace")
    for side, (side_data, side_experts) in pairs.items():
        if side_experts is not None:
            # Saved from the side's directory: the set records the same relative path on both sides, and so does
            # the dataset's reference to it.
            with working_directory(dirs[side]):
                side_experts.save(Path(DATA_DIR) / "experts.pt")
                reference = side_experts.reference()
        if side_data is None:
            side_data = neighbours.without_unit(dataset, pair.unit, side_experts)
        elif side_experts is not None:
            side_data = side_data.replace(metadata=dataclasses.replace(side_data.metadata, expert_set=reference))
        side_data.save(dirs[side] / DATA_DIR / "data.npz")
    data = {"path": f"{DATA_DIR}/data.npz", **({"expert_set": f"{DATA_DIR}/experts.pt"} if experts else {})}
    return {**config, "data": data}


def _prepare_fnq(pair: NeighbourPair, config: dict, dirs: dict[str, Path]) -> dict:
    if pair.relation != "reward":
        raise ValidationError("relation", "fnq protects single rewards: use relation reward")
    if config.get("dataset") is None:
        return config  # online: the neighbour's environment is made at run time (shifted_rewards)
    from dporl.data.dataset import TrajectoryDataset

    dataset = TrajectoryDataset.load(config["dataset"])
    for side, side_data in (("D", dataset), ("D'", neighbours.with_reward_changed(dataset, pair.unit, pair.change))):
        side_data.save(dirs[side] / DATA_DIR / "data.npz")
    return {**config, "dataset": f"{DATA_DIR}/data.npz"}


def table_columns(data: dict) -> dict[str, Any]:
    from dporl.pipelines.inputs import example_columns
    from dporl.utils.config import to_dict

    columns = data.get("columns")
    return dict(columns) if columns is not None else to_dict(example_columns())


def _source_frame(data: dict):
    import pandas as pd

    if data.get("example") is not None:
        from dporl.pipelines.inputs import ExampleTable
        from dporl.utils.config import from_dict

        return from_dict(ExampleTable, data["example"]).frame()
    path = Path(data["path"])
    return pd.read_parquet(path) if path.suffix in (".parquet", ".pq") else pd.read_csv(path)


def _unit_key(frame, column: str, index: int):
    import pandas as pd

    keys = pd.unique(frame[column])
    if not 0 <= index < len(keys):
        raise ValidationError("unit", f"must be a unit index in [0, {len(keys)}), got {index}")
    return keys[index]


def _frame_replace_unit(frame, column: str, key, donor_key, data: dict):
    import pandas as pd

    if key == donor_key:
        raise ValidationError("donor", "the donor must be another unit")
    donor = frame.loc[frame[column] == donor_key].copy()
    donor[column] = key
    episode = table_columns(data)["episode"]
    donor[episode] = donor[episode].astype(str) + "-replaced"
    return pd.concat([frame.loc[frame[column] != key], donor], ignore_index=True)


# ---------------------------------------------------------------------------------------------------- runs
@contextlib.contextmanager
def working_directory(path: Path) -> Iterator[None]:
    previous = os.getcwd()
    os.chdir(path)
    try:
        yield
    finally:
        os.chdir(previous)


def run_side(pair: NeighbourPair, directory: str | Path, side: str, noise_seed: int, run_dir: str = "run") -> SideRun:
    """One side of ``pair`` (inputs written by ``prepare`` in ``directory``) with ``noise_seed``, into ``run_dir``."""
    directory = Path(directory)
    config = yaml.safe_load((directory / CONFIG_FILE).read_text())
    config = {**config, "run_dir": run_dir, "noise_seed": noise_seed}
    started = time.perf_counter()
    if pair.via == "cli":
        stdout, outcome = _run_cli(pair, directory, config, run_dir)
    elif pair.via == "api":
        stdout, outcome = _run_api(pair, directory, config, noise_seed, run_dir)
    else:
        stdout, outcome = _run_process(pair, directory, config, side)
    seconds = time.perf_counter() - started
    return SideRun(side, snapshot(directory / run_dir, stdout, outcome), seconds, directory / run_dir)


def _run_process(pair: NeighbourPair, directory: Path, config: dict, side: str) -> tuple[str, str]:
    from dporl.pipelines import get_pipeline, run_cli
    from dporl.utils.config import from_dict

    hooks = _hooks(pair, config, side)
    shift = pair.change if side == "D'" and _online(pair, config) else 0.0
    out, err = io.StringIO(), io.StringIO()
    with working_directory(directory), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err), \
            shifted_rewards(config.get("env_id", ""), shift) if shift else contextlib.nullcontext():
        def work() -> dict:
            pipeline = get_pipeline(config.get("pipeline"))
            return pipeline.run(from_dict(pipeline.config_cls, config), mode="new", **hooks)

        code = run_cli(work)
    return out.getvalue(), "ok" if code == 0 else _refusal(code, err.getvalue())


def _run_cli(pair: NeighbourPair, directory: Path, config: dict, run_dir: str) -> tuple[str, str]:
    if pair.pipeline == "ope" or _online(pair, config):
        raise ValidationError("via", f"{pair.pipeline} draws its data inside the run: run it in process (via process)")
    path = directory / f"{run_dir}.{CONFIG_FILE}"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in [str(Path(__file__).resolve().parents[2]),
                                                                    os.environ.get("PYTHONPATH", "")] if p)}
    done = subprocess.run([sys.executable, "-m", "dporl", "train", "--config", path.name], cwd=directory,
                          capture_output=True, text=True, timeout=pair.timeout, env=env)
    return done.stdout, "ok" if done.returncode == 0 else _refusal(done.returncode, done.stderr)


def _run_api(pair: NeighbourPair, directory: Path, config: dict, noise_seed: int, run_dir: str) -> tuple[str, str]:
    import dporl
    from dporl.algos.registry import get
    from dporl.api import api_config
    from dporl.utils.config import from_dict

    columns = dict((config.get("data") or {}).get("columns") or {})
    out = io.StringIO()
    error = None
    with working_directory(directory), contextlib.redirect_stdout(out):
        try:
            data = dporl.read_table(config["data"]["path"], **columns, progress=False)
            settings = from_dict(api_config(get(pair.algorithm)), {**pair.api, "noise_seed": noise_seed,
                                                                   "progress": False})
            print(settings.create(data).fit(run_dir=run_dir))
        except ValidationError as exc:
            error = exc
    return out.getvalue(), describe_outcome(error)


def _refusal(code: int, stderr: str) -> str:
    """A failed run's released outcome: the exit status and the error lines it printed (never tracebacks' paths)."""
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    return f"exit {code}: " + (" | ".join(errors) if errors else (stderr.strip().splitlines() or [""])[-1])


def _hooks(pair: NeighbourPair, config: dict, side: str) -> dict[str, Any]:
    """The ope pipeline's neighbour hook: a problem whose private draws are D''s on side D' (D runs unchanged)."""
    if pair.pipeline == "ope":
        return {"problem": NeighbourProblem(config, pair, active=side == "D'")}
    return {}


def _online(pair: NeighbourPair, config: dict) -> bool:
    return pair.pipeline == "fnq" and config.get("dataset") is None


@contextlib.contextmanager
def shifted_rewards(env_id: str, change: float) -> Iterator[None]:
    """Every environment ``env_id`` this process makes (``gymnasium.make`` / ``make_vec``) pays ``change`` more on
    every transition: the neighbouring reward function r' = r + change (sup |r - r'| = |change|). Online learners
    read their data from the environment, so this is how D' reaches them: training and evaluation alike."""
    import gymnasium as gym

    make, make_vec = gym.make, gym.make_vec

    def same(env: Any) -> bool:
        return (env.id if hasattr(env, "id") else env) == env_id

    def shifted_make(env: Any, *args: Any, **kwargs: Any):
        made = make(env, *args, **kwargs)
        return gym.wrappers.TransformReward(made, lambda r: r + change) if same(env) else made

    def shifted_make_vec(env: Any, *args: Any, **kwargs: Any):
        made = make_vec(env, *args, **kwargs)
        return gym.wrappers.vector.TransformReward(made, lambda r: r + change) if same(env) else made

    gym.make, gym.make_vec = shifted_make, shifted_make_vec
    try:
        yield
    finally:
        gym.make, gym.make_vec = make, make_vec


class NeighbourProblem:
    """An ope problem whose private draws (not the public tuning draws) lose trajectory ``pair.unit`` (remove) or
    have it replaced by a copy of trajectory ``pair.donor`` (replace). Everything else is the problem's."""

    def __init__(self, config: dict, pair: NeighbourPair, active: bool):
        from dporl.pipelines.ope import build_problem
        from dporl.pipelines.ope.config import OPEConfig
        from dporl.utils.config import from_dict

        self._config = from_dict(OPEConfig, config)
        self._problem = build_problem(self._config)
        self._pair = pair
        self._active = active

    def __getattr__(self, name: str) -> Any:
        return getattr(self._problem, name)

    def _public(self, n: int, generator) -> bool:
        from dporl.pipelines.ope import PUBLIC_DRAW, data_generator

        return generator.initial_seed() == data_generator(self._config.seed, n, PUBLIC_DRAW).initial_seed()

    def sample(self, n: int, generator):
        data = self._problem.sample(n, generator)
        if not self._active or self._public(n, generator):
            return data
        if self._pair.relation == "remove":
            return neighbours.episodes_without(data, self._pair.unit)
        if self._pair.relation == "replace":
            return neighbours.episode_replaced(data, self._pair.unit, self._pair.donor)
        raise ValidationError("relation", "ope protects trajectories: use remove or replace")


def run_pair(pair: NeighbourPair, base: str | Path, noise_seed: int = 0, run_dir: str = "run",
             dirs: Optional[dict[str, Path]] = None) -> dict[str, SideRun]:
    """Both sides of ``pair`` with the same ``noise_seed`` (inputs prepared under ``base`` unless ``dirs``)."""
    dirs = dirs or prepare(pair, base)
    return {side: run_side(pair, dirs[side], side, noise_seed, run_dir) for side in SIDES}
