"""What a run releases (release/, stdout) depends on the private data only through accounted mechanisms: the action
set is declared, rewards are clamped into their declared range, flags come from public inputs, and TensorBoard
files carry no wall-clock time, host name or process id. Each test runs two datasets a declared-not-inferred fact
must not tell apart, with the same fixed noise seed, and compares what is released."""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

import dporl
from dporl.cli import main
from dporl.data.dataset import DatasetMetadata, TrajectoryDataset
from dporl.eval.ope_coverage import TreatmentChain, state_policy
from dporl.eval.private_ope import dp_importance_sampling
from dporl.pipelines.offline_eval import OfflineEvalConfig
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.randomness import SecretRoot
from dporl.utils.validation import ValidationError

torch.set_num_threads(1)
COLUMNS = dict(episode="episode", unit="clinician", observations="obs_", action="action", reward="reward",
               terminated="terminated", truncated="truncated", next_observations="next_obs_", propensity="propensity")


def tree(root: Path) -> dict[str, str]:
    """sha256 of every file under ``root``, by relative path."""
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(root.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------------------------------------------- action set
@pytest.fixture(scope="module")
def tables(tmp_path_factory) -> tuple[Path, Path]:
    """D: 300 clinicians of the treatment chain (actions 0 = wait, 1 = treat); D + canary: one more clinician whose
    one episode logs action 2 once (a rare action no one else took)."""
    root = tmp_path_factory.mktemp("tables")
    frame = dporl.to_frame(TreatmentChain().simulate(300, 2, (0.2, 0.8), np.random.default_rng(5)),
                           next_observations=True, unit="clinician")
    frame["propensity"] = np.exp(frame.pop("log_propensity"))
    canary = frame[frame["episode"] == frame["episode"].iloc[0]].copy()
    canary["episode"] = frame["episode"].max() + 1
    canary["clinician"] = "canary"
    canary.iloc[0, canary.columns.get_loc("action")] = 2
    frame.to_csv(root / "d.csv", index=False)
    pd.concat([frame, canary]).to_csv(root / "canary.csv", index=False)
    return root / "d.csv", root / "canary.csv"


def small_cql(**changes) -> dporl.DiscreteCQLConfig:
    evaluation = OfflineEvalConfig(estimator="wis", unit_clip=3.0, value_range=(-2.0, 1.0))
    return dporl.DiscreteCQLConfig(**{"epsilon": 1.0, "gamma": 0.95, "steps": 20, "hidden_sizes": [8],
                                      "batch_size": 32, "progress": False, "noise_seed": 3, "evaluation": evaluation,
                                      **changes})


def test_an_undeclared_action_set_is_refused_by_name_before_anything_is_written(tables, tmp_path, capsys):
    _, canary = tables
    with pytest.raises(ValidationError) as info:  # the Python API: refused at the import, before the file is read
        dporl.read_table(canary, **COLUMNS)
    assert info.value.field == "actions"
    config = {"pipeline": "train", "method": "dp_sgd", "run_dir": str(tmp_path / "run"),
              "data": {"format": "table", "path": str(canary), "columns": COLUMNS}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", "--config", str(tmp_path / "c.yaml")]) == 2
    assert capsys.readouterr().err.startswith("error: data.columns.actions: declare the action set")
    assert not (tmp_path / "run").exists()


def test_a_canary_unit_logging_an_undeclared_action_changes_nothing_released_through_the_api(tables, tmp_path,
                                                                                              capsys):
    plain, canary = tables
    runs, outs = {}, {}
    for name, path in (("d", plain), ("canary", canary)):
        data = dporl.read_table(path, **COLUMNS, actions=2)
        small_cql().create(data).fit(run_dir=tmp_path / name)
        runs[name], outs[name] = tmp_path / name, capsys.readouterr()
    # The canary's only episode holds an action outside the declared set: dropped whole, said on stderr only.
    assert "curator-only" in outs["canary"].err and "dropped 1 episode" in outs["canary"].err
    assert outs["d"].out.replace(str(runs["d"]), "RUN") == outs["canary"].out.replace(str(runs["canary"]), "RUN")
    spec = json.loads((runs["d"] / "release" / "policy" / "policy.json").read_text())
    assert spec["architecture"]["n_actions"] == 2 and spec["action_space"] == {"type": "Discrete", "n": 2}
    # Every released file, byte for byte (policy.json and its weights, summary, privacy report, TensorBoard).
    assert tree(runs["d"] / "release") == tree(runs["canary"] / "release")


def test_a_canary_unit_changes_nothing_released_through_the_command_line(tables, tmp_path, capsys):
    plain, canary = tables
    released, outs = {}, {}
    for name, path in (("d", plain), ("canary", canary)):
        config = {"pipeline": "train", "method": "dp_sgd", "run_dir": str(tmp_path / name), "epsilon": 1.0,
                  "batch_size": 32, "noise_seed": 3,
                  "data": {"format": "table", "path": str(path), "columns": {**COLUMNS, "actions": 2}},
                  "algorithm": {"name": "cql", "hidden_sizes": [8], "gamma": 0.95},
                  "trainer": {"max_steps": 20, "eval_every": 10, "log_every": 5, "checkpoint_every": 10,
                              "progress": False},
                  "eval": {"offline": {"estimator": "wis", "unit_clip": 3.0, "value_range": [-2.0, 1.0]}}}
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(config))
        assert main(["train", "--config", str(tmp_path / f"{name}.yaml")]) == 0
        released[name], outs[name] = tree(tmp_path / name / "release"), capsys.readouterr()
    # stdout names its run directory: equal once that is masked.
    assert outs["d"].out.replace(str(tmp_path / "d"), "RUN") == outs["canary"].out.replace(str(tmp_path / "canary"), "RUN")
    assert released["d"] == released["canary"]


def test_action_labels_are_declared_and_reach_the_released_policy(tmp_path, capsys):
    frame = dporl.to_frame(TreatmentChain().simulate(60, 2, (0.2, 0.8), np.random.default_rng(1)), unit="clinician")
    frame["action"] = np.where(frame["action"] == 1, "treat", "wait")
    data = dporl.read_table(frame, episode="episode", unit="clinician", observations="obs_", action="action",
                            actions=["wait", "treat"], reward="reward", terminated="terminated",
                            truncated="truncated")
    small_cql(evaluation=OfflineEvalConfig(estimator="none")).create(data).fit(run_dir=tmp_path / "run")
    spec = json.loads((tmp_path / "run" / "release" / "policy" / "policy.json").read_text())
    assert spec["action_space"] == {"type": "Discrete", "n": 2, "labels": ["wait", "treat"]}


# ---------------------------------------------------------------------------------------------------- reward range
def _fnq_dataset(path: Path, bump: float) -> str:
    """The line MDP logged offline; ``bump`` is added to one reward (the reward-level neighbour: sup |r - r'| <= 1)."""
    rng = np.random.default_rng(0)
    episodes = [{"observations": rng.uniform(size=(11, 1)).astype(np.float32), "actions": rng.integers(0, 2, 10),
                 "rewards": rng.uniform(0, 0.5, 10).astype(np.float32), "terminated": False, "truncated": True,
                 "unit_id": 0} for _ in range(6)]
    episodes[2]["rewards"][4] += bump
    TrajectoryDataset.from_episodes(episodes, DatasetMetadata("dporl/Line1D-v0", 2, 1, (1,))).save(path)
    return str(path)


def test_a_reward_leaving_the_declared_range_is_clamped_and_the_release_keeps_its_files_and_fields(tmp_path, capsys):
    outs, roots = {}, {}
    for name, bump in (("d", 0.0), ("neighbour", 1.0)):  # 0.x + 1 leaves the declared range [0, 0.5]
        config = {"pipeline": "fnq", "run_dir": str(tmp_path / name), "env_id": "dporl/Line1D-v0",
                  "dataset": _fnq_dataset(tmp_path / f"{name}.npz", bump), "methods": ["fnq", "input_perturbation"],
                  "epsilons": [1.0], "delta": 1e-4, "samples": 96, "batch_size": 16, "reward_range": [0.0, 0.5],
                  "optimizer": {"name": "sgd", "lr": 0.05}, "eval_episodes": 2, "evaluations": 1, "noise_seed": 0,
                  "progress": False}
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(config))
        assert main(["train", "--config", str(tmp_path / f"{name}.yaml")]) == 0  # never refused
        outs[name], roots[name] = capsys.readouterr(), tmp_path / name
    assert outs["d"].out == outs["neighbour"].out and "GUARANTEE" not in outs["d"].err
    for label in ("fnq_eps1", "input_perturbation_eps1"):
        runs = {name: root / label / "seed0" for name, root in roots.items()}
        released = {name: tree(run / "release") for name, run in runs.items()}
        assert set(released["d"]) == set(released["neighbour"])  # the same files
        for file in released["d"]:
            if file.endswith(".json"):  # the same fields and, here, the same public values
                a, b = (json.loads((run / "release" / file).read_text()) for run in runs.values())
                assert a == b, file
        weights = {name: torch.load(run / "release" / "released.pt", weights_only=True) for name, run in runs.items()}
        assert weights["d"].keys() == weights["neighbour"].keys()
        # The clamped count lives under curator/ only.
        counts = {name: json.loads((run / "curator" / "rewards.json").read_text())["clamped_rewards"]
                  for name, run in runs.items()}
        assert counts == {"d": 0, "neighbour": 1}
        for name, run in runs.items():
            assert not any("clamp" in (run / "release" / f).read_bytes().decode("latin-1")
                           for f in released[name] if f.endswith(".json"))


# ---------------------------------------------------------------------------------------------------- flags
def _chain_data(states: list[int], seed: int) -> TrajectoryDataset:
    """200 units x 3 one-step episodes over one-hot states drawn from ``states``, actions logged at 1/2."""
    rng = np.random.default_rng(seed)
    n = 600
    obs = np.zeros((n, 2, 3), np.float32)
    obs[np.arange(n), 0, rng.choice(states, n)] = 1.0
    actions = rng.integers(0, 2, (n, 1))
    return TrajectoryDataset.from_padded(
        observations=obs, actions=actions, rewards=rng.uniform(0, 1, (n, 1)), mask=np.ones((n, 1), bool),
        terminated=np.ones(n, bool), behavior_log_probs=np.full((n, 1), np.log(0.5)),
        unit_ids=np.arange(n) // 3, metadata=DatasetMetadata("test", 2, 200, (3,)))


@pytest.mark.parametrize("declared", [False, True])
def test_dp_wis_calibrated_and_notes_do_not_depend_on_which_states_were_logged(declared):
    # Deterministic in states 0 and 1 (treat / wait), stochastic in state 2.
    treat = [1.0, 0.0, 0.5]
    if declared:
        policy = state_policy(treat)  # declares itself stochastic (not deterministic everywhere): public
    else:
        probs = torch.tensor([[1 - t, t] for t in treat], dtype=torch.float64)
        policy = lambda obs: probs[obs.argmax(1)]  # noqa: E731  (declares nothing)
    results = [dp_importance_sampling(_chain_data(states, 0), policy, epsilon=1.0, delta=1e-5, ledger=PrivacyLedger(),
                                      root=SecretRoot(0), kind="wis", value_range=(0.0, 1.0), min_propensity=0.5,
                                      horizon=1, episodes_per_unit=3)  # the unit clip: the public maximum
               for states in ([0, 1], [0, 1, 2])]  # only the deterministic states logged, or all of them
    # Nothing clipped: calibrated exactly when the target declares itself stochastic (the suite's measurement).
    assert results[0].calibrated is results[1].calibrated is declared
    assert results[0].notes == results[1].notes  # the flag and its reason: from the declaration, never the states
    assert declared or "does not declare" in results[0].notes[-1]


# ---------------------------------------------------------------------------------------------------- side channels
def test_release_tensorboard_files_have_neutral_names_and_no_wall_clock_time(tmp_path, capsys):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    data = TreatmentChain().simulate(100, 2, (0.2, 0.8), np.random.default_rng(2))
    small_cql(evaluation=OfflineEvalConfig(estimator="none")).create(data).fit(run_dir=tmp_path / "run")
    files = sorted((tmp_path / "run" / "release" / "tensorboard").iterdir())
    assert files and all(re.fullmatch(r"events\.out\.tfevents\.\d{6}\.dporl", f.name) for f in files), files
    events = [event for f in files for event in EventFileLoader(str(f)).Load()]
    tags = {value.tag for event in events for value in event.summary.value}
    assert {"train/lr", "privacy/epsilon", "privacy/plan/text_summary"} <= tags
    assert len(events) > 10 and all(event.wall_time == float(event.step) for event in events)


def test_curator_only_lines_never_reach_the_stdout_of_dporl_train(tmp_path, capsys):
    """The train pipeline generating its data first: the generator's description of the logged data (mean logged return,
    transitions) goes to stderr, labelled; stdout, which ends with the guarantee, is the same for two datasets."""
    outs = {}
    for seed in (0, 1):
        generate = {"experts": {"env_id": "CartPole-v1", "family": "analytic", "points_per_axis": 2, "n_settings": 2,
                                "candidates_per_setting": 1, "keep_best": 1, "eval_episodes": 1,
                                "max_episode_steps": 30},
                    "p_min": 0.45, "trajectories_per_expert": 3, "max_episode_steps": 30, "seed": seed,
                    "progress": False}  # nearly uniform logging: returns vary with the seed
        config = {"pipeline": "train", "method": "dp_sgd", "run_dir": str(tmp_path / f"run{seed}"),
                  "epsilon": 1.0, "batch_size": 2, "noise_seed": 0, "data": {"generate": generate},
                  "algorithm": {"name": "cql", "hidden_sizes": [8]}, "eval": {"enabled": False, "offline": {"estimator": "none"}},
                  "trainer": {"max_steps": 5, "eval_every": 5, "log_every": 5, "checkpoint_every": 5,
                              "progress": False}}
        (tmp_path / f"c{seed}.yaml").write_text(yaml.safe_dump(config))
        assert main(["train", "--config", str(tmp_path / f"c{seed}.yaml")]) == 0
        outs[seed] = capsys.readouterr()
    returns = [re.search(r"mean logged return (\S+);", outs[s].err).group(1) for s in (0, 1)]
    assert returns[0] != returns[1]  # two datasets the curator can tell apart ...
    for seed in (0, 1):
        assert "curator-only" in outs[seed].err and "curator-only (" not in outs[seed].out.split("release (safe")[0]
        assert "logged return" not in outs[seed].out and "transitions from" not in outs[seed].out
    # ... printing the same stdout (up to the run directory it names).
    assert outs[0].out.replace("run0", "RUN") == outs[1].out.replace("run1", "RUN")
