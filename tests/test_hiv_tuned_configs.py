"""configs/expert_cql_hiv_tuned.yaml, configs/sweep_hiv_tuned.yaml and configs/dataset_hiv_public_tune.yaml load and
run end to end at a tiny scale (the shipped sweep with overrides that shrink the data, the release and training),
so CI covers the configs the issue-16 HIV table was measured with. The sweep test also pins the fix that lets a
sweep's overrides shape ``data.generate`` (they used to be re-applied after the generation and failed with "give
exactly one of data.path or data.generate")."""

from __future__ import annotations

import math
from pathlib import Path

from dporl.pipelines.dataset import DatasetConfig
from dporl.pipelines.expert_cql import ExpertCQLConfig
from dporl.pipelines.sweep import SweepConfig, run as run_sweep
from dporl.utils.config import from_dict, load_yaml, to_dict

CONFIGS = Path(__file__).resolve().parent.parent / "configs"

TINY = [
    "data.generate.experts.n_settings=300",
    "data.generate.experts.max_episode_steps=10",
    "data.generate.max_episode_steps=10",
    "data.generate.trajectories_per_expert=1",
    "data.generate.progress=false",
    "release.trajectories=2",
    "cql.hidden_sizes=[16]",
    "trainer.max_steps=6",
    "trainer.eval_every=3",
    "trainer.checkpoint_every=3",
    "eval.episodes=1",
    "eval.num_envs=1",
    "eval.max_episode_steps=10",
    "eval.last_evals=2",
]


def test_tuned_config_keeps_private_data_and_changes_only_the_learner():
    tuned = from_dict(ExpertCQLConfig, load_yaml(CONFIGS / "expert_cql_hiv_tuned.yaml"))
    old = from_dict(ExpertCQLConfig, load_yaml(CONFIGS / "expert_cql_hiv.yaml"))
    # Same private data and release: the tuning read only the public dataset below.
    assert tuned.data.generate == old.data.generate and to_dict(tuned.release) == to_dict(old.release)
    assert tuned.cql.alpha == 0.05 and old.cql.alpha == 1.0
    public = from_dict(DatasetConfig, load_yaml(CONFIGS / "dataset_hiv_public_tune.yaml"))
    private = from_dict(DatasetConfig, {"pipeline": "dataset", **old.data.generate})
    # The public tuning data are the same generation under other seeds (never the private data's).
    assert public.experts.seed != private.experts.seed and public.seed != private.seed
    assert to_dict(public.experts) | {"seed": 0} == to_dict(private.experts) | {"seed": 0}


def test_hiv_tuned_sweep_runs_at_tiny_scale(tmp_path):
    sweep_data = load_yaml(CONFIGS / "sweep_hiv_tuned.yaml")
    sweep_data["base"] = str(CONFIGS / "expert_cql_hiv_tuned.yaml")
    sweep_data["overrides"] = [*sweep_data["overrides"], *TINY, f"data.generate.out_dir={tmp_path / 'data'}"]
    sweep_data.update({"epsilons": [10.0], "seeds": [0], "out_dir": str(tmp_path / "sweep"), "progress": False})
    summary = run_sweep(from_dict(SweepConfig, sweep_data))
    cells = {e["method"]: e for e in summary["table"]}
    assert set(cells) == {"non_private", "dp_sgd", "stable_only", "mixed"}
    for method, cell in cells.items():
        assert cell["seeds"] == 1, (method, cell["note"])
        assert math.isfinite(cell["return_mean"])
        if method != "non_private":  # every private run prints a guarantee within its budget
            assert 0 < cell["guarantee_epsilon"] <= 10.0 + 1e-9
    assert (tmp_path / "sweep" / "return_vs_epsilon.png").stat().st_size > 0
