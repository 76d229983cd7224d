from pathlib import Path

import gymnasium as gym
import numpy as np
import pytest
import torch

from dporl.algos.fnq import (
    EnvInteractionSource,
    FNQConfig,
    FunctionalNoiseQLearning,
    dataset_source,
    load_noisy_q,
    save_noisy_q,
)
from dporl.algos.fnq_baselines import GaussianRewardNoise, WholeBatchUnitSource
from dporl.privacy.events import PoissonGaussianEvent
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.noise import NoiseSource
from dporl.train.config import DPConfig, OptimizerConfig, TrainerConfig
from dporl.train.trainer import Trainer
from dporl.utils.validation import ValidationError


class LineEnv(gym.Env):
    """The 1-D line MDP of spec/environments.md, local so these tests do not depend on dporl.envs."""

    observation_space = gym.spaces.Box(0.0, 1.0, (1,), dtype=np.float32)
    action_space = gym.spaces.Discrete(2)

    def reset(self, *, seed=None, options=None):
        super().reset(seed=seed)
        self.state, self.t = float(self.np_random.uniform()), 0
        return np.array([self.state], dtype=np.float32), {}

    def step(self, action):
        move = self.np_random.uniform(0, 0.25)
        self.state = min(1.0, max(0.0, self.state + (move if action == 1 else -move)))
        self.t += 1
        return np.array([self.state], dtype=np.float32), 0.5 - abs(self.state - 0.5), False, self.t >= 50, {}


def _learner(sigma=0.7, reset_every=1, seed=0):
    torch.manual_seed(seed)
    config = FNQConfig(sigma=sigma, beta=20.0, reset_every=reset_every, gamma=0.9)
    return FunctionalNoiseQLearning(1, 2, config, NoiseSource(seed))


def test_losses_are_algorithm_1_with_noisy_q_in_prediction_and_target():
    learner = _learner()
    generator = torch.Generator().manual_seed(0)
    batch = EnvInteractionSource(LineEnv(), learner.act, 16).sample(generator)
    losses = learner.row_losses(batch)
    data = batch.data
    with torch.no_grad():
        g, g_next = learner.noise(data["obs"]), learner.noise(data["next_obs"])  # stored values: no new draws
        q = learner.q_network(data["obs"]) + g
        q_next = learner.q_network(data["next_obs"]) + g_next
        target = data["rewards"] + 0.9 * (1 - data["terminated"].float()) * q_next.max(1).values
        expected = 0.5 * (q.gather(1, data["actions"].unsqueeze(1)).squeeze(1) - target) ** 2
    assert torch.allclose(losses, expected)
    assert g.abs().sum() > 0
    losses.mean().backward()  # the paths are constants: gradients reach only the network
    assert all(p.grad is not None for p in learner.q_network.parameters())


def test_online_source_acts_greedily_on_the_noisy_function_and_counts_samples():
    learner = _learner(sigma=2.0)
    source = EnvInteractionSource(LineEnv(), learner.act, 8)
    batch = source.sample(torch.Generator().manual_seed(1))
    assert batch.n_rows == 8 and not batch.private and source.env_steps == 8
    greedy = learner.function(batch.data["obs"]).argmax(1)
    assert torch.equal(greedy, batch.data["actions"])
    # Replay: 4 new transitions per update, batches of 8 drawn from the buffer.
    replay = EnvInteractionSource(LineEnv(), learner.act, 8, env_steps_per_update=4, replay_capacity=10)
    generator = torch.Generator().manual_seed(2)
    for _ in range(3):
        assert replay.sample(generator).n_rows == 8
    assert replay.env_steps == 12
    with pytest.raises(ValidationError, match="env_steps_per_update"):
        EnvInteractionSource(LineEnv(), learner.act, 8, env_steps_per_update=4)


def test_paths_reset_every_T_over_JB_updates():
    learner = _learner(reset_every=3)
    learner.noise(torch.rand(5, 1))
    for step in (1, 2):
        learner.on_step_end(step)
        assert learner.noise.n_points == 10
    learner.on_step_end(3)
    assert learner.noise.n_points == 0


def test_trained_function_is_released_saved_and_reloaded_with_identical_answers(tmp_path):
    learner = _learner(sigma=0.5, reset_every=4)
    source = EnvInteractionSource(LineEnv(), learner.act, 16)
    config = TrainerConfig(max_steps=6, eval_every=3, checkpoint_every=6, progress=False,
                           optimizer=OptimizerConfig(name="sgd", lr=1e-2))
    result = Trainer(learner, source, config=config, dp=None, ledger=PrivacyLedger(), run_dir=tmp_path / "run",
                     pipeline="fnq", pipeline_config={}, evaluators={}).fit()
    assert result.steps == 6 and source.env_steps == 96
    released = learner.release(NoiseSource(3))
    seen = torch.rand(20, 1)
    before = released(seen)
    save_noisy_q(tmp_path / "released.pt", released, {"note": "test"})
    loaded, metadata = load_noisy_q(tmp_path / "released.pt")
    unseen = torch.rand(7, 1)
    assert torch.equal(loaded(seen), before)
    assert torch.equal(loaded(unseen), released(unseen))
    assert metadata == {"note": "test"}
    # The released copy draws from its own generator, not the training one.
    assert released.noise.noise is not learner.noise.noise


def test_offline_variant_trains_on_logged_transitions_with_perturbed_rewards():
    from dporl.data.dataset import DatasetMetadata, TrajectoryDataset

    rng = np.random.default_rng(0)
    episodes = [
        {"observations": rng.uniform(size=(11, 1)).astype(np.float32), "actions": rng.integers(0, 2, 10),
         "rewards": rng.uniform(0, 0.5, 10).astype(np.float32), "terminated": False, "truncated": True,
         "expert_id": 0}
        for _ in range(3)
    ]
    dataset = TrajectoryDataset.from_episodes(episodes, DatasetMetadata("line", 2, 1, (1,)))
    perturb = GaussianRewardNoise(5.0, NoiseSource(0))
    source = dataset_source(dataset, 8, perturb)
    assert perturb.rewards_perturbed == 30  # every logged reward perturbed exactly once
    noisy = source.data["rewards"]
    assert not torch.allclose(noisy, torch.from_numpy(dataset.transitions().rewards))
    batch = source.sample(torch.Generator().manual_seed(0))
    learner = _learner()
    assert learner.row_losses(batch).shape == (8,)


def test_dpsgd_baseline_treats_the_whole_batch_as_one_unit_and_spends_its_budget(tmp_path):
    learner = _learner(sigma=0.0)
    inner = EnvInteractionSource(LineEnv(), learner.act, 16)
    source = WholeBatchUnitSource(inner)
    batch = source.sample(torch.Generator().manual_seed(0))
    assert batch.private and batch.n_units == 1 and torch.equal(batch.unit_index, torch.zeros(16, dtype=torch.long))
    # Replacing the reward function moves the clipped batch gradient by 2C: the event's multiplier is sigma / 2.
    assert source.step_event(3.0) == PoissonGaussianEvent(1.5, 1.0)
    ledger = PrivacyLedger()
    ledger.stage("train", budget=(2.0, 1e-4), unit="reward")
    dp = DPConfig(epsilon=2.0, delta=1e-4, max_grad_norm=1.0, noise_seed=0)
    config = TrainerConfig(max_steps=5, eval_every=5, checkpoint_every=5, progress=False,
                           optimizer=OptimizerConfig(name="sgd", lr=1e-2))
    result = Trainer(learner, source, config=config, dp=dp, ledger=ledger, run_dir=tmp_path / "dp",
                     pipeline="fnq", pipeline_config={}).fit()
    assert result.steps == 5
    assert 1.5 < ledger.spent("train") <= 2.0  # the calibrated sigma spends (nearly) all of the budget


def test_bad_configs_name_their_field():
    with pytest.raises(ValidationError, match="fnq.reset_every"):
        FNQConfig(reset_every=0)
    with pytest.raises(ValidationError, match="fnq.state_low"):
        FunctionalNoiseQLearning(2, 2, FNQConfig())


def test_pipeline_compares_methods_at_one_certified_budget(tmp_path):
    import json

    from dporl.pipelines import get_pipeline
    from dporl.utils.config import from_dict

    pipeline = get_pipeline("fnq")
    config = from_dict(pipeline.config_cls, {
        "pipeline": "fnq", "run_dir": str(tmp_path), "env_id": "dporl/Line1D-v0",
        "methods": ["nonprivate", "fnq", "input_perturbation", "dpsgd"], "epsilons": [0.9], "delta": 1e-4,
        "reset_factors": [4], "samples": 128, "batch_size": 32, "optimizer": {"name": "sgd", "lr": 0.05},
        "eval_episodes": 2, "evaluations": 1, "noise_seed": 0, "progress": False,
    })
    summary = pipeline.run(config)
    rows = {row["label"]: row for row in summary["rows"]}
    assert set(rows) == {"nonprivate", "fnq_eps0.9", "input_perturbation_eps0.9", "dpsgd_eps0.9"}
    results = json.loads((tmp_path / "curator" / "results.json").read_text())
    fnq = next(r for r in results["runs"] if r["label"] == "fnq_eps0.9")
    # Theorem 5 at T/B = 4 updates, 4 windows: the total delta fits, and the ledger reports the reward unit.
    assert fnq["privacy"]["delta_total"] <= 1e-4 and fnq["privacy"]["reset_factor"] == 4
    assert fnq["ledger"]["stages"][0]["unit"] == "reward"
    assert fnq["sigma"] == pytest.approx(fnq["privacy"]["sigma"])
    dpsgd = next(r for r in results["runs"] if r["label"] == "dpsgd_eps0.9")
    assert dpsgd["ledger"]["stages"][0]["epsilon"] <= 0.9
    assert (tmp_path / "curator" / "table.md").exists() and all(Path(p).exists() for p in summary["plots"])
    released, _ = load_noisy_q(tmp_path / "fnq_eps0.9" / "seed0" / "release" / "released.pt")
    assert released.noise.sigma == pytest.approx(fnq["sigma"])
    from dporl.train.checkpoint import load_checkpoint

    run_dir = tmp_path / "fnq_eps0.9" / "seed0"
    metrics = pipeline.evaluate(load_checkpoint(run_dir / "curator" / "checkpoints" / "last.pt"), episodes=2, seed=0,
                                out_dir=run_dir)
    assert metrics["episodes"] == 2 and metrics["label"] == "fnq_eps0.9" and (run_dir / "eval.json").exists()


def test_pipeline_refuses_what_it_cannot_certify(tmp_path):
    from dporl.pipelines import get_pipeline
    from dporl.utils.config import from_dict

    pipeline = get_pipeline("fnq")
    base = {"pipeline": "fnq", "run_dir": str(tmp_path), "samples": 64, "batch_size": 32, "progress": False}
    with pytest.raises(ValidationError, match="methods"):  # baselines need a budget to be calibrated to
        pipeline.run(from_dict(pipeline.config_cls, {**base, "methods": ["fnq", "dpsgd"], "beta": 10.0}))
    with pytest.raises(ValidationError, match="epsilons"):  # Theorem 5 is one-dimensional
        pipeline.run(from_dict(pipeline.config_cls, {
            **base, "env_id": "CartPole-v1", "state_low": [-2.4, -3, -0.21, -3.5], "state_high": [2.4, 3, 0.21, 3.5],
            "epsilons": [1.0],
        }))
    with pytest.raises(ValidationError, match="optimizer"):  # the theorem's sensitivity assumes plain SGD
        pipeline.run(from_dict(pipeline.config_cls, {**base, "epsilons": [1.0], "optimizer": {"name": "adam"}}))
