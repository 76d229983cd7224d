import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from dporl.data.dataset import TrajectoryDataset
from dporl.experts import ExpertSet
from dporl.pipelines import get_pipeline
from dporl.utils.config import from_dict
from dporl.utils.validation import ValidationError

TINY = {
    "pipeline": "dataset",
    "experts": {"env_id": "CartPole-v1", "family": "analytic", "points_per_axis": 2, "n_settings": 4,
                "candidates_per_setting": 2, "keep_best": 1, "eval_episodes": 1, "max_episode_steps": 50},
    "p_min": 0.1,
    "trajectories_per_expert": 2,
    "max_episode_steps": 30,
    "seed": 7,
    "progress": False,
}


def _run(tmp_path, **overrides):
    pipeline = get_pipeline("dataset")
    config = from_dict(pipeline.config_cls, {**TINY, "out_dir": str(tmp_path), **overrides})
    return pipeline.run(config)


def test_pipeline_writes_expert_set_dataset_summary_and_plot(tmp_path):
    summary = _run(tmp_path)
    experts = ExpertSet.load(tmp_path / "experts.pt")
    data = TrajectoryDataset.load(tmp_path / "dataset.npz")
    assert experts.n_experts == summary["n_experts"] == 4 and experts.p_min == 0.1
    assert data.n_episodes == 8 and data.episode_lengths.max() <= 30
    # The dataset names the exact expert set that produced it, and the default physics it was logged in.
    assert data.metadata.expert_set["sha256"] == experts.fingerprint()
    assert data.metadata.expert_set["path"] == str(tmp_path / "experts.pt")
    assert data.metadata.env_params["gravity"] == pytest.approx(9.8) and data.metadata.seed == 7
    assert len(experts.info["per_expert"]["setting_index"]) == 4
    assert sorted(set(experts.info["per_expert"]["setting_index"])) == [0, 1, 2, 3]
    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["dataset_summary"]["n_episodes"] == 8
    assert (tmp_path / "expert_returns.png").stat().st_size > 0


def test_pipeline_relogs_a_saved_expert_set_with_another_p_min(tmp_path):
    _run(tmp_path / "first")
    summary = _run(tmp_path / "second", expert_set_path=str(tmp_path / "first" / "experts.pt"), p_min=0.25)
    first = ExpertSet.load(tmp_path / "first" / "experts.pt")
    second = ExpertSet.load(tmp_path / "second" / "experts.pt")
    states = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    # Same experts (same preferred actions), new softening mass.
    torch.testing.assert_close(first.log_probs(states).argmax(-1), second.log_probs(states).argmax(-1))
    assert second.log_probs(states).exp().min() == pytest.approx(0.25, rel=1e-5)
    data = TrajectoryDataset.load(tmp_path / "second" / "dataset.npz")
    assert data.metadata.p_min == 0.25 and summary["n_experts"] == 4
    assert np.all(data.behavior_log_probs >= np.log(0.25) - 1e-6)


def test_pipeline_config_errors_name_the_field():
    pipeline = get_pipeline("dataset")
    with pytest.raises(ValidationError) as info:
        from_dict(pipeline.config_cls, {**TINY, "trajectories_per_experts": 3})
    assert info.value.field == "trajectories_per_experts"
    with pytest.raises(ValidationError, match="experts.family"):
        from_dict(pipeline.config_cls, {**TINY, "experts": {"family": "dqn"}})
    with pytest.raises(ValidationError, match="trajectories_per_expert"):
        from_dict(pipeline.config_cls, {**TINY, "trajectories_per_expert": 0})


def test_impossible_p_min_is_refused_before_any_work(tmp_path):
    # CartPole has 2 actions: argmax softening needs p_min < 1/2.
    with pytest.raises(ValidationError) as info:
        _run(tmp_path, p_min=0.5)
    assert info.value.field == "expert_set.p_min"
    assert not (tmp_path / "experts.pt").exists()


ROOT = Path(__file__).resolve().parents[1]


def test_train_cli_runs_the_quick_config_with_overrides(tmp_path):
    result = subprocess.run(
        [sys.executable, str(ROOT / "train.py"), "--config", str(ROOT / "configs" / "dataset_quick.yaml"),
         f"out_dir={tmp_path}", "experts.n_settings=2", "experts.candidates_per_setting=1", "experts.keep_best=1",
         "trajectories_per_expert=1", "max_episode_steps=20", "progress=false", "--json"],
        capture_output=True, text=True, cwd=ROOT, timeout=300,
    )
    assert result.returncode == 0, result.stderr
    # The description of the logged data is curator-only: stderr, labelled; stdout is the JSON summary alone.
    assert "curator-only" in result.stderr and "dataset: 2 episodes" in result.stderr
    assert json.loads(result.stdout)["n_experts"] == 2  # --json: the whole summary
    assert TrajectoryDataset.load(tmp_path / "dataset.npz").n_episodes == 2


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("dataset_*.yaml")), ids=lambda p: p.stem)
def test_every_dataset_config_parses(path):
    from dporl.utils.config import load_config

    config = load_config(get_pipeline("dataset").config_cls, path)
    assert config.experts.keep_best <= config.experts.candidates_per_setting
