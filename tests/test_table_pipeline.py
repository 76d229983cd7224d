"""A CSV of an offline problem with known truth, end to end through the README's API and
through ``dporl train --config``: import, unit-level private CQL, private offline evaluation whose interval covers
the truth, export, reload; and the pipeline's refusals for data it cannot train on privately.

The problem is the treatment chain (``dporl.eval.ope_coverage``): clinicians are the units, and every policy's
value is exact by backward induction, so the learned policy's interval can be checked against its true value.
Coverage is a 95% property, measured over many datasets in docs/results.md (whole table runs and DP-FQE of a greedy
policy); each test here fixes its noise seed, so it checks one reproducible draw.
"""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

import dporl
from dporl.cli import main
from dporl.eval.ope_coverage import TreatmentChain, state_policy_probabilities
from dporl.pipelines.train import TrainPipelineConfig, run
from dporl.utils.config import from_dict
from dporl.utils.validation import PrivacyBudgetError, ValidationError

ROOT = Path(__file__).resolve().parents[1]
CHAIN = TreatmentChain()
COLUMNS = dict(episode="episode", unit="clinician", observations="obs_", action="action", actions=2, reward="reward",
               terminated="terminated", truncated="truncated", next_observations="next_obs_")
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def csv(tmp_path_factory) -> Path:
    """3000 clinicians x 4 episodes of the treatment chain, written by the documented command."""
    path = tmp_path_factory.mktemp("data") / "stays.csv"
    assert main(["data", "example", "treatment_chain", str(path), "--units", "3000", "--seed", "7"]) == 0
    return path


def true_value(policy) -> float:
    return CHAIN.true_value(state_policy_probabilities(policy, CHAIN.n_states))


def small(**changes):
    """A quick CQL (the README's, smaller: CI has two cores)."""
    evaluation = dporl.OfflineEvalConfig(value_range=(-2.0, 1.0), episodes_per_unit=4)  # declared, public
    return dporl.DiscreteCQLConfig(**{"epsilon": 1.0, "gamma": CHAIN.gamma, "steps": 150, "hidden_sizes": [32],
                                      "batch_size": 64, "progress": False, "evaluation": evaluation, **changes})


def test_csv_to_private_policy_through_the_python_api(csv, tmp_path, capsys):
    data = dporl.read_table(csv, **COLUMNS)
    cql = small(noise_seed=11).create(data)
    assert (cql.observation_size, cql.n_actions, cql.unit.column) == (6, 2, "clinician")  # declared / from the data
    result = cql.fit(run_dir=tmp_path / "run")
    out = capsys.readouterr().out
    assert out.startswith("no simulator: 'offline-table' is not a registered Gymnasium environment")

    policy = dporl.load_policy(result.policy_dir)  # export -> reload, from release/ alone
    truth = true_value(policy)
    value, low, high = result.value
    assert low <= truth <= high, (value, low, high, truth)
    assert torch.equal(policy.act(torch.eye(6)), cql.predict(torch.eye(6)))
    cql.policy.save(tmp_path / "copy")
    assert torch.equal(dporl.load_policy(tmp_path / "copy").act(torch.eye(6)), policy.act(torch.eye(6)))

    # One ledger: training on the "train" cell, DP-FQE on three held-out cells; parallel, so the guarantee is the
    # largest cell's (<= the budget), not the sum of the stages.
    epsilon, delta = result.guarantee
    privacy = result.summary["privacy"]
    assert epsilon <= 1.0 + 1e-9 and delta <= 1e-5
    assert privacy["composition"].startswith("parallel") and sum(s["epsilon"] for s in privacy["stages"]) > 2.5
    assert privacy["guarantee"]["unit_column"] == "clinician"
    assert json.loads((tmp_path / "run" / "release" / "privacy_report.json").read_text())["stages"] == privacy["stages"]
    assert epsilon > 0.98  # the stages spend their budgets: training and the count, composed by one PLD
    assert str(result).splitlines()[-1].startswith(f"GUARANTEE: ({epsilon:.4g}, 1e-05)")


def test_csv_to_private_policy_through_dporl_train(csv, tmp_path, capsys):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    config = yaml.safe_load((ROOT / "configs" / "table_quickstart.yaml").read_text())
    del config["data"]["example"]
    config["data"]["path"] = str(csv)
    config.update(run_dir=str(tmp_path / "run"), noise_seed=6, batch_size=64)
    config["algorithm"]["hidden_sizes"] = [32]
    config["trainer"].update(max_steps=150, eval_every=50, checkpoint_every=50, progress=False)
    path = tmp_path / "config.yaml"
    path.write_text(yaml.safe_dump(config))

    assert main(["train", "--config", str(path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[-2].startswith("policy value (DP-FQE, 95% interval): ")  # the headline, then the guarantee
    assert lines[-2].endswith("(interval NOT calibrated: see the evaluation's notes)")  # DP-FQE under-covers
    guarantee = float(lines[-1].removeprefix("GUARANTEE: (").split(",")[0])
    assert 0.98 < guarantee <= 1.0 and "privacy unit: clinician" in lines[-1]  # near the budget (1, 1e-5), not past
    assert not any("noise_seed" in line for line in lines)  # the config goes to the run directory, not the screen

    run_dir = tmp_path / "run"
    summary = json.loads((run_dir / "release" / "summary.json").read_text())
    evaluation = summary["evaluation"]
    truth = true_value(dporl.load_policy(run_dir / "release" / "policy"))
    assert evaluation["mode"] == "offline" and evaluation["ci_low"] <= truth <= evaluation["ci_high"], (evaluation, truth)
    assert summary["env_id"] is None  # no simulator: the policy names none (evaluate.py asks for --env)

    # Provenance covers the imported content (metadata included: the unit column and every unit's key).
    provenance = json.loads((run_dir / "curator" / "provenance.json").read_text())
    imported = dporl.TrajectoryDataset.load(run_dir / "curator" / "data" / "dataset.npz")
    assert provenance["inputs"]["dataset"] == imported.fingerprint() == dporl.read_table(csv, **{
        **COLUMNS, "step": "step", "propensity": "propensity"}).fingerprint()
    assert imported.metadata.unit_column == "clinician"
    assert not (run_dir / "release" / "data").exists()

    # TensorBoard: privacy/epsilon is the run's guarantee (every stage, parallel-aware), one scalar per stage beside it.
    events = EventAccumulator(str(run_dir / "release" / "tensorboard"))
    events.Reload()
    tags = set(events.Tags()["scalars"])
    assert {"privacy/epsilon", "privacy/stage/train", "privacy/stage/evaluate0/value", "offline/value"} <= tags
    assert events.Scalars("privacy/epsilon")[-1].value == pytest.approx(summary["privacy"]["guarantee"]["epsilon"])

    assert main(["train", "--config", str(path), "--resume"]) == 0  # a finished run is read back, not repeated
    assert capsys.readouterr().out.splitlines()[-2:] == lines[-2:]
    assert main(["train", "--config", str(path)]) == 2  # an existing run directory is refused
    assert "--resume" in capsys.readouterr().err


def _config(tmp_path, csv, **changes) -> TrainPipelineConfig:
    data = {
        "method": "dp_sgd", "run_dir": str(tmp_path / "run"), "epsilon": 1.0, "batch_size": 64, "noise_seed": 3,
        "data": {"format": "table", "path": str(csv), "columns": dict(COLUMNS, propensity="propensity")},
        "algorithm": {"name": "cql", "hidden_sizes": [16], "gamma": CHAIN.gamma},
        "trainer": {"max_steps": 40, "eval_every": 40, "checkpoint_every": 40, "progress": False},
        "eval": {"offline": {"value_range": [-2.0, 1.0], "episodes_per_unit": 4, "unit_clip": 12.0}},
    }
    for key, value in changes.items():
        node = data
        *parents, last = key.split(".")
        for parent in parents:
            node = node.setdefault(parent, {})
        node[last] = value
    return from_dict(TrainPipelineConfig, data)


@pytest.mark.parametrize("method", ["mixed", "stable_only"])
def test_methods_that_need_queryable_experts_refuse_imported_units(csv, tmp_path, method):
    with pytest.raises(ValidationError) as info:
        run(_config(tmp_path, csv, method=method))
    assert info.value.field == "method" and "clinician" in str(info.value) and "dp_sgd" in str(info.value)
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("changes,field", [
    ({"eval.offline.estimator": "wis", "data.columns.propensity": None}, "eval.offline.estimator"),
    ({"eval.offline.holdout": 0.0}, "eval.offline.epsilon"),
    ({"eval.offline.holdout": 0.0, "eval.offline.epsilon": 1.0, "eval.offline.delta": 1e-6}, "eval.offline.epsilon"),
    ({"eval.offline.epsilon": 2.0}, "eval.offline.epsilon"),
    ({"eval.env_id": "NoSuchEnv-v9"}, "eval.env_id"),
    ({"data.columns.action": "no_such_column"}, "no_such_column"),
])
def test_evaluation_and_data_refusals_name_the_field_and_write_nothing(csv, tmp_path, changes, field):
    with pytest.raises(ValidationError) as info:
        run(_config(tmp_path, csv, **changes))
    assert info.value.field == field, info.value
    assert not (tmp_path / "run").exists()


def test_data_config_refusals():
    for data, field in [({"format": "table", "path": "x.csv"}, "data.columns"),
                        ({"format": "table", "path": "x.csv", "dataset": "y.npz", "columns": COLUMNS}, "data.dataset"),
                        ({"format": "minari", "path": "d-v0"}, "data.unit"),
                        ({"format": "npz"}, "data")]:
        with pytest.raises(ValidationError) as info:
            from_dict(TrainPipelineConfig, {"data": data})
        assert info.value.field == field
    with pytest.raises(ValidationError) as info:  # "memory" is for datasets handed over in Python
        run(from_dict(TrainPipelineConfig, {"data": {"format": "memory"}, "run_dir": "/nonexistent/run"}))
    assert info.value.field == "data.format"


def test_reusing_the_training_units_composes_sequentially(csv, tmp_path):
    summary = run(_config(tmp_path, csv, **{"eval.offline.holdout": 0.0, "eval.offline.estimator": "wis",
                                            "eval.offline.epsilon": 0.25, "eval.offline.delta": 2e-6}))
    privacy = summary["privacy"]
    stages = {s["name"]: s for s in privacy["stages"]}
    # The evaluation's budget comes out of training's (and the count's 1% out of the run's): every stage touches
    # every unit.
    assert stages["unit_count"]["budget"] == [0.01, 0.0]
    assert stages["train"]["budget"] == pytest.approx([0.74, 8e-6]) and stages["ope/wis"]["budget"] == [0.25, 2e-6]
    assert stages["train"]["cells"] is None and stages["ope/wis"]["cells"] is None and privacy["cells"] is None
    assert privacy["composition"].startswith("sequential")
    assert privacy["guarantee"]["epsilon"] <= privacy["basic_composition"][0] <= 1.0 + 1e-9


def test_a_bad_table_exits_2_from_the_command_and_writes_nothing(tmp_path, capsys):
    frame = dporl.to_frame(TreatmentChain().simulate(20, 2, (0.2, 0.8), np.random.default_rng(0)), unit="clinician")
    frame.loc[3, "reward"] = np.nan
    frame.to_csv(tmp_path / "bad.csv", index=False)
    config = {"pipeline": "train", "method": "dp_sgd", "run_dir": str(tmp_path / "run"),
              "data": {"format": "table", "path": str(tmp_path / "bad.csv"),
                       "columns": {k: COLUMNS[k] for k in ("episode", "unit", "observations", "action", "actions",
                                                           "reward")}}}
    (tmp_path / "c.yaml").write_text(yaml.safe_dump(config))
    assert main(["train", "--config", str(tmp_path / "c.yaml")]) == 2
    assert capsys.readouterr().err.startswith("error: reward: 1 NaN/inf value(s)")
    assert not (tmp_path / "run").exists()


def test_an_interrupted_offline_evaluation_is_never_repeated(csv, tmp_path, monkeypatch):
    import dporl.pipelines.train.evaluation as pipeline

    config = _config(tmp_path, csv, **{"eval.offline.estimator": "wis"})
    original = pipeline.evaluate_offline

    def crash(plan, *args, ledger, **kwargs):  # killed after the evaluation's stage was charged
        ledger.stage("ope/wis", budget=plan.budget, mechanism="pld", unit=dporl.grouped_by("clinician"),
                     cells=["evaluate"])
        raise RuntimeError("killed")

    monkeypatch.setattr(pipeline, "evaluate_offline", crash)
    with pytest.raises(RuntimeError):
        run(config)
    monkeypatch.setattr(pipeline, "evaluate_offline", original)
    with pytest.raises(PrivacyBudgetError) as info:
        run(config, mode="resume")
    assert info.value.field == "eval.offline" and "earlier attempt" in str(info.value)


def test_a_minari_dataset_trains_through_the_config(tmp_path, monkeypatch):
    """``data: {format: minari, path: ID, unit: KEY}``: a local Minari dataset, its unit named by an info key."""
    pytest.importorskip("minari")
    from dporl.data.minari_io import export_minari

    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari"))
    logged = TreatmentChain().simulate(600, 2, (0.2, 0.8), np.random.default_rng(1))
    with warnings.catch_warnings():  # Minari nags about optional provenance fields
        warnings.simplefilter("ignore", UserWarning)
        export_minari(logged, "dporl/chain-v0", progress=False)
    config = from_dict(TrainPipelineConfig, {
        "method": "dp_sgd", "run_dir": str(tmp_path / "run"), "batch_size": 32, "noise_seed": 1,
        "data": {"format": "minari", "path": "dporl/chain-v0", "unit": "expert_id"},
        "algorithm": {"name": "cql", "hidden_sizes": [8], "gamma": CHAIN.gamma},
        "trainer": {"max_steps": 20, "eval_every": 20, "checkpoint_every": 20, "progress": False},
        "eval": {"offline": {"estimator": "wis", "value_range": [-2.0, 1.0], "unit_clip": 12.0}},
    })
    summary = run(config)
    assert summary["privacy"]["guarantee"]["unit_column"] == "expert_id"
    assert summary["evaluation"]["mode"] == "offline" and summary["privacy"]["composition"].startswith("parallel")
    imported = dporl.TrajectoryDataset.load(tmp_path / "run" / "curator" / "data" / "dataset.npz")
    assert imported.n_episodes == logged.n_episodes and imported.metadata.unit_column == "expert_id"


def test_a_declared_reward_range_is_scaled_by_the_runs_discount(csv, tmp_path):
    """The evaluation's value range derives from the declared reward range at the discount of the value the run
    releases: the algorithm's (CQL's gamma) or eval.gamma (behaviour cloning has none); never a default."""
    from dporl.eval.ope_scales import return_range
    from dporl.pipelines.train.evaluation import evaluation_plan

    dataset = CHAIN.simulate(60, 4, (0.2, 0.8), np.random.default_rng(0))
    offline = {"reward_range": [-0.1, 1.0], "episodes_per_unit": 4}
    cql = _config(tmp_path, csv, **{"eval.offline": offline})
    assert evaluation_plan(cql, dataset, None).scales.value_range == pytest.approx(
        return_range((-0.1, 1.0), CHAIN.gamma, None))  # [-2, 20] at gamma 0.95
    bc = {"name": "bc", "hidden_sizes": [16]}
    plan = evaluation_plan(_config(tmp_path, csv, **{"algorithm": bc, "eval.gamma": 0.9, "eval.offline": offline}),
                           dataset, None)
    assert plan.scales.value_range == pytest.approx((-1.0, 10.0))
    with pytest.raises(ValidationError) as info:  # no discount to derive it with: refused by name
        evaluation_plan(_config(tmp_path, csv, **{"algorithm": bc, "eval.offline": offline}), dataset, None)
    assert info.value.field == "eval.gamma"
