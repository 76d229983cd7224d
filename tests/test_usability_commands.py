"""What a user meets around a run on their own table: ``dporl evaluate --run`` on a run without a simulator shows the
value it released; ``dporl data inspect --observations a,b``; ``eval.enabled: false`` turns evaluation off (the
simulator switch is ``eval.simulator``); the progress bar shows the epsilon spent against the budget."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import torch
import yaml
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

import dporl
from dporl.cli import main
from dporl.eval.ope_coverage import TreatmentChain
from dporl.pipelines.train.config import EvalConfig, TrainPipelineConfig
from dporl.pipelines.train.evaluation import simulator_id
from dporl.train.trainer import progress_fields
from dporl.utils.config import from_dict
from dporl.utils.validation import ValidationError

torch.set_num_threads(1)
COLUMNS = dict(episode="episode", unit="clinician", observations="obs_", action="action", reward="reward",
               terminated="terminated", truncated="truncated", actions=2)


@pytest.fixture(scope="module")
def csv(tmp_path_factory):
    frame = dporl.to_frame(TreatmentChain().simulate(300, 2, (0.2, 0.8), np.random.default_rng(5)), unit="clinician")
    frame["propensity"] = np.exp(frame.pop("log_propensity"))
    path = tmp_path_factory.mktemp("usability") / "stays.csv"
    frame.to_csv(path, index=False)
    return path


def config(tmp_path, csv, name, evaluation) -> str:
    data = {"pipeline": "train", "method": "dp_sgd", "run_dir": str(tmp_path / name), "epsilon": 1.0,
            "batch_size": 32, "noise_seed": 3,
            "data": {"format": "table", "path": str(csv), "columns": {**COLUMNS, "propensity": "propensity"}},
            "algorithm": {"name": "cql", "hidden_sizes": [8], "gamma": 0.95},
            "trainer": {"max_steps": 20, "eval_every": 10, "log_every": 5, "checkpoint_every": 10,
                        "progress": False},
            "eval": evaluation}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def test_evaluate_run_shows_the_released_offline_estimate(csv, tmp_path, capsys):
    path = config(tmp_path, csv, "run", {"offline": {"estimator": "wis", "unit_clip": 3.0, "value_range": [-2.0, 1.0]}})
    assert main(["train", "--config", path]) == 0
    capsys.readouterr()
    released = json.loads((tmp_path / "run" / "release" / "summary.json").read_text())["evaluation"]
    assert released["mode"] == "offline"
    assert main(["evaluate", "--run", str(tmp_path / "run")]) == 0  # not "the policy names no environment"
    out = capsys.readouterr().out
    numbers = f"{released['value']:.4g} [{released['ci_low']:.4g}, {released['ci_high']:.4g}]"
    assert "policy value (DP-WIS, 95% interval, released by the run): " + numbers in out
    assert "GUARANTEE: (" in out.splitlines()[-1]
    assert main(["evaluate", "--run", str(tmp_path / "run"), "--json"]) == 0
    shown = json.loads(capsys.readouterr().out)
    assert shown["evaluation"] == released
    assert not (tmp_path / "run" / "release" / "evaluations").exists()  # nothing computed, nothing written
    # The release's TensorBoard logs that same released number (and its interval), nothing else of the evaluation.
    events = EventAccumulator(str(tmp_path / "run" / "release" / "tensorboard"))
    events.Reload()
    offline = {tag for tag in events.Tags()["scalars"] if tag.startswith("offline/")}
    assert offline == {"offline/value", "offline/ci_low", "offline/ci_high"}
    assert events.Scalars("offline/value")[-1].value == pytest.approx(released["value"], rel=1e-6)


def test_eval_enabled_false_turns_evaluation_off_and_evaluate_names_the_way_out(csv, tmp_path, capsys):
    assert main(["train", "--config", config(tmp_path, csv, "off", {"enabled": False})]) == 0
    out = capsys.readouterr().out
    assert "evaluation is off (eval.enabled: false); the policy is not evaluated" in out
    summary = json.loads((tmp_path / "off" / "release" / "summary.json").read_text())
    assert summary["evaluation"] == {"mode": "none"}
    assert [s["name"] for s in summary["privacy"]["stages"]] == ["unit_count", "train"]  # nothing spent evaluating
    assert main(["evaluate", "--run", str(tmp_path / "off")]) == 2
    err = capsys.readouterr().err
    assert "released no offline evaluation" in err and "--env" in err
    # Off, yet an estimator asked for: refused naming eval.enabled, pointing to the simulator switch.
    with pytest.raises(ValidationError) as info:
        from_dict(TrainPipelineConfig, {"eval": {"enabled": False, "offline": {"estimator": "wis"}}})
    assert info.value.field == "eval.enabled" and "eval.simulator: false" in str(info.value)
    # eval.simulator: false is what keeps a registered simulator out (and evaluates on logged data instead).
    assert simulator_id(EvalConfig(), "CartPole-v1") == "CartPole-v1"
    assert simulator_id(EvalConfig(simulator=False), "CartPole-v1") is None
    assert simulator_id(EvalConfig(enabled=False), "CartPole-v1") is None


def test_data_inspect_takes_a_comma_separated_list_of_observation_columns(csv, capsys):
    args = ["data", "inspect", str(csv), "--episode", "episode", "--unit", "clinician", "--action", "action",
            "--reward", "reward", "--actions", "2", "--json"]
    assert main([*args, "--observations", "obs_0, obs_2,obs_5"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["observation_shape"] == [3]
    assert main([*args, "--observations", "obs_0,no_such"]) == 2
    assert "no_such" in capsys.readouterr().err


def test_the_progress_bar_shows_epsilon_spent_against_the_budget(csv, tmp_path, capsys):
    assert progress_fields({"privacy/epsilon": 0.4567, "privacy/stage/train": 0.4, "eval/return_mean": 12.0},
                           (1.0, 1e-5)) == {"eps": "0.457/1", "return_mean": "12"}
    assert progress_fields({"eval/return_mean": 12.0}, (1.0, 1e-5)) == {"return_mean": "12"}
    data = dporl.read_table(csv, **COLUMNS)
    cql = dporl.DiscreteCQLConfig(epsilon=2.0, gamma=0.95, steps=10, hidden_sizes=[8], batch_size=32, progress=True,
                                  noise_seed=3, evaluation=dporl.OfflineEvalConfig(estimator="none"))
    cql.create(data).fit(run_dir=tmp_path / "bar")
    err = capsys.readouterr().err
    spent = [float(x) for x in re.findall(r"eps=([0-9.e-]+)/2\b", err)]
    assert spent and 0 < spent[-1] <= 2.0
