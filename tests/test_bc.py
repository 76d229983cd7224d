"""Private behaviour cloning (``dporl.algos.bc``), added through the algorithm contract: its loss, the Python API,
the ``dporl`` command with its configs, the released policy, and the config audit, with no BC-specific code
elsewhere."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.nn import functional as F

import dporl
from dporl.algos.bc import BCConfig, DiscreteBCModule
from dporl.cli import main
from dporl.privacy.samplers import Batch
from dporl.privacy.units import TRANSITION
from dporl.utils.config import apply_overrides, load_yaml
from dporl.utils.validation import ValidationError

ROOT = Path(__file__).resolve().parents[1]
torch.set_num_threads(1)
TREATING = {"behaviour_low": 0.75, "behaviour_high": 0.95}  # every clinician treats in most stays
TINY = ["data.example.units=300", "data.example.episodes_per_unit=2", "batch_size=32", "algorithm.hidden_sizes=[16]",
        "trainer.max_steps=40", "trainer.eval_every=20", "trainer.log_every=10", "trainer.checkpoint_every=20",
        "trainer.progress=false", "eval.offline.folds=2", "eval.offline.fqe.steps=20",
        "eval.offline.fqe.sample_rate=0.2", "eval.offline.fqe.rows_per_unit=4", "noise_seed=3",
        "eval.offline.tolerance=1e6"]  # 300 clinicians: the pre-spend noise check would refuse their evaluation


def _table(tmp_path: Path, units: int = 1500, **example) -> dporl.TrajectoryDataset:
    from dporl.pipelines.inputs import ExampleTable, example_columns
    from dporl.utils.config import to_dict

    frame = ExampleTable(units=units, episodes_per_unit=2, seed=1, **example).frame()
    path = tmp_path / "stays.csv"
    frame.to_csv(path, index=False)
    return dporl.read_table(path, **to_dict(example_columns()), progress=False)


def test_row_losses_are_the_cross_entropy_of_the_logged_actions():
    torch.manual_seed(0)
    bc = DiscreteBCModule(4, 3, BCConfig(hidden_sizes=[8], label_smoothing=0.1), privacy_unit=TRANSITION)
    obs, actions = torch.randn(10, 4), torch.randint(0, 3, (10,))
    losses = bc.row_losses(Batch({"obs": obs, "actions": actions}, torch.arange(10), 10, private=False))
    log_p = torch.log_softmax(bc.policy(obs), dim=1)
    expected = -(0.9 * log_p.gather(1, actions[:, None]).squeeze(1) + 0.1 * log_p.mean(1))
    torch.testing.assert_close(losses, expected)
    assert losses.shape == (10,) and torch.equal(bc.act(obs), bc.policy(obs).argmax(1))
    with pytest.raises(ValidationError) as info:
        BCConfig(label_smoothing=1.0)
    assert info.value.field == "bc.label_smoothing"


def test_non_private_bc_recovers_the_logged_majority_action(tmp_path):
    """Clinicians treat in 75-95% of their stays: BC without noise treats in every state the data visit."""
    data = _table(tmp_path, **TREATING)
    learner = dporl.DiscreteBCConfig(private=False, steps=150, learning_rate=1e-2, progress=False,
                                     evaluation=dporl.OfflineEvalConfig(estimator="none")).create(data)
    result = learner.fit(run_dir=tmp_path / "run")
    assert result.guarantee is None
    visited = np.unique(np.asarray(data.observations).argmax(1))
    states = torch.eye(6)[torch.as_tensor(visited)]
    assert learner.predict(states).tolist() == [1] * len(visited)


def test_private_bc_through_the_python_api_releases_a_loadable_policy_and_a_guarantee(tmp_path, capsys):
    data = _table(tmp_path, units=600)
    learner = dporl.DiscreteBCConfig(epsilon=2.0, steps=30, batch_size=32, eval_gamma=0.95, noise_seed=2,
                                     progress=False, hidden_sizes=[16],
                                     evaluation=dporl.OfflineEvalConfig(folds=2, unit_clip=5.0,
                                                                        value_range=[-2.0, 1.0],
                                                                        tolerance=1e6)  # 600 units: any width
                                     ).create(data)
    assert isinstance(learner.module, DiscreteBCModule) and learner.unit.column == "clinician"
    result = learner.fit(run_dir=tmp_path / "run")
    epsilon, delta = result.guarantee
    assert epsilon <= 2.0 and delta <= 1e-5
    assert result.evaluation["mode"] == "offline"
    policy = dporl.load_policy(result.policy_dir)
    assert policy.kind == DiscreteBCModule.policy_kind
    obs = torch.eye(6)
    assert torch.equal(policy.act(obs), learner.predict(obs))
    summary = json.loads((tmp_path / "run" / "release" / "summary.json").read_text())
    assert summary["algorithm"] == "bc" and summary["method"] == "dp_sgd"
    assert "GUARANTEE: (" in str(result)


def test_private_bc_without_a_discount_refuses_an_offline_evaluation_by_name(tmp_path):
    data = _table(tmp_path, units=300)
    with pytest.raises(ValidationError) as info:
        dporl.DiscreteBCConfig(steps=5, progress=False).create(data).fit(run_dir=tmp_path / "run")
    assert info.value.field == "eval.gamma" and not (tmp_path / "run").exists()


def test_bc_table_config_runs_through_the_dporl_command(tmp_path, capsys):
    config = tmp_path / "bc.yaml"
    import yaml

    data = apply_overrides(load_yaml(ROOT / "configs/bc_table.yaml"), [*TINY, f"run_dir={tmp_path / 'run'}"])
    config.write_text(yaml.safe_dump(data))
    assert main(["train", "--config", str(config)]) == 0, capsys.readouterr().err
    out = capsys.readouterr().out.strip().splitlines()
    assert out[-1].startswith("GUARANTEE: (") and "privacy unit: clinician" in out[-1]
    spec = json.loads((tmp_path / "run" / "release" / "policy" / "policy.json").read_text())
    assert spec["kind"] == "greedy_logits_mlp" and spec["extra"]["algorithm"] == "bc"


def test_bc_cartpole_config_trains_expert_level_dp_sgd_with_simulator_returns(tmp_path, capsys):
    """configs/bc_cartpole_ppo.yaml on a tiny LQR expert pool instead of the PPO data: expert-level DP-SGD BC,
    returns of the greedy policy in CartPole."""
    from test_expert_cql import log_lqr_experts

    logged = log_lqr_experts(tmp_path, {"data.npz": 0})
    data = apply_overrides(load_yaml(ROOT / "configs/bc_cartpole_ppo.yaml"), [
        f"data.path={logged / 'data.npz'}", f"run_dir={tmp_path / 'run'}", "batch_size=16", "count_fraction=0.05",
        "algorithm.hidden_sizes=[16]", "trainer.max_steps=20", "trainer.eval_every=10", "trainer.log_every=10",
        "trainer.checkpoint_every=10", "trainer.progress=false", "eval.episodes=2", "eval.num_envs=2",
        "eval.max_episode_steps=50", "eval.last_evals=1", "noise_seed=1"])
    from dporl.pipelines import get_pipeline
    from dporl.utils.config import from_dict

    pipeline = get_pipeline(data["pipeline"])
    summary = pipeline.run(from_dict(pipeline.config_cls, data))
    assert summary["algorithm"] == "bc" and summary["evaluation"]["mode"] == "simulator"
    assert summary["privacy"]["guarantee"]["unit"] == "expert"
    assert summary["privacy"]["guarantee"]["epsilon"] <= 10.0
    assert np.isfinite(summary["return_mean_last_evals"])


def test_the_config_audit_attacks_a_bc_config(tmp_path, capsys):
    """``python -m dporl.audit --config configs/bc_table.yaml``: the DP-SGD step the run would take, audited with
    the noise the run calibrates (nothing BC-specific in the audit)."""
    import yaml

    from dporl.audit.__main__ import main as audit_main

    data = apply_overrides(load_yaml(ROOT / "configs/bc_table.yaml"), TINY)
    config = tmp_path / "bc.yaml"
    config.write_text(yaml.safe_dump(data))
    out = tmp_path / "audit.json"
    assert audit_main(["--config", str(config), "--trials", "500", "--no-progress", "--out", str(out)]) == 0, \
        capsys.readouterr().err
    results = json.loads(out.read_text())["results"]
    assert [r["mechanism"] for r in results] == ["dpsgd_step"] and not results[0]["violated"]
