"""The shipped expert-dataset configs run end to end through ``train.py`` at a tiny scale.

Only the scale is overridden (settings, timesteps, episode lengths, trajectories); the family, the candidate
selection, the network sizes, p_min and every environment argument are each config's own, and the test checks that
they reached the saved experts and data.
"""

import importlib.util
from pathlib import Path

import pytest

from dporl.data.dataset import TrajectoryDataset
from dporl.experts import ExpertSet
from dporl.utils.config import load_yaml

ROOT = Path(__file__).resolve().parents[1]

TINY = ["experts.n_settings=2", "experts.eval_episodes=1", "experts.max_episode_steps=12", "trajectories_per_expert=2",
        "max_episode_steps=10", "progress=false"]
# One PPO update per candidate (total_timesteps = n_envs x n_steps); Ray left to the cluster runs.
CONFIGS = {
    "dataset_cartpole_ppo": ["experts.ppo.total_timesteps=512"],
    "dataset_acrobot_ppo": ["experts.ppo.total_timesteps=512"],
    "dataset_hiv_ppo": ["experts.ppo.total_timesteps=20", "experts.ppo.n_envs=2", "experts.ppo.n_steps=10",
                        "experts.batch_experts=3"],
    "dataset_lunarlander_ppo": ["experts.ppo.total_timesteps=64", "experts.ppo.n_steps=8", "experts.ray.enabled=false"],
    "dataset_lunarlander_analytic": ["experts.env_workers=1"],
}


def _train_main():
    spec = importlib.util.spec_from_file_location("dporl_train_cli", ROOT / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_dataset_config_runs_at_tiny_scale(name, tmp_path):
    if "lunarlander" in name:
        pytest.importorskip("Box2D")
    path = ROOT / "configs" / f"{name}.yaml"
    config = load_yaml(path)
    out = tmp_path / "out"
    rc = _train_main()(["--config", str(path), f"out_dir={out}", *TINY, *CONFIGS[name]])
    assert rc == 0
    experts = ExpertSet.load(out / "experts.pt")
    data = TrajectoryDataset.load(out / "dataset.npz")
    generation = config["experts"]
    # The paper's selection as the config states it: the best keep_best of each setting's candidates.
    assert experts.n_experts == 2 * generation["keep_best"]
    assert data.metadata.n_units == experts.n_experts and data.n_episodes == 2 * experts.n_experts
    assert data.episode_lengths.max() <= 10 and data.metadata.env_id == generation["env_id"]
    assert experts.p_min == config["p_min"]
    assert experts.info["generation"]["family"] == generation["family"]
    assert experts.info["generation"]["candidates_per_setting"] == generation["candidates_per_setting"]
    assert experts.info["generation"]["env_kwargs"] == generation.get("env_kwargs", {})
    if generation["family"] == "ppo":  # the experts are the config's actor architecture
        assert experts.policy.hidden_sizes == generation["ppo"]["actor_hidden_sizes"]
