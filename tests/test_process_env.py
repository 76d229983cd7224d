"""ProcessVectorEnv: sub-envs stepped in worker processes behave exactly as the one-process vector env."""

import numpy as np
import pytest
import torch

from dporl.envs.process_env import ProcessVectorEnv, make_vector_env
from dporl.utils.validation import ValidationError

pytest.importorskip("Box2D")


def test_workers_give_the_same_transitions_as_one_process():
    params = [{"gravity": g, "enable_wind": True, "wind_power": w, "turbulence_power": 0.3}
              for g, w in zip((-9.0, -10.0, -11.0, -9.5, -10.5), (0.0, 1.0, 2.0, 3.0, 4.0))]
    actions = np.random.default_rng(0).integers(0, 4, size=(80, 5))
    outputs = []
    for workers in (1, 3):
        env = make_vector_env("LunarLander-v3", 5, 30, params, workers=workers)
        try:
            assert isinstance(env, ProcessVectorEnv) == (workers > 1)
            steps = [env.reset(seed=[3, 1, 4, 1, 5])[0]]
            for action in actions:  # 30-step limit: every sub-env autoresets at least twice
                obs, reward, terminated, truncated, _ = env.step(action)
                steps.append(np.concatenate([obs, reward[:, None], terminated[:, None], truncated[:, None]], axis=1))
            outputs.append(np.stack(steps[1:]))
        finally:
            env.close()
    # Same code, same seeds, the same float maths in another process: identical, not merely close.
    np.testing.assert_array_equal(outputs[0], outputs[1])
    assert outputs[1][..., -1].sum() >= 5


def test_bad_inputs_and_worker_failures_are_reported():
    with pytest.raises(ValidationError, match="env_workers"):
        ProcessVectorEnv("LunarLander-v3", 2, 10, workers=0)
    with pytest.raises(ValidationError, match="params.gravity"):  # raised in a worker, re-raised here
        ProcessVectorEnv("LunarLander-v3", 2, 10, [{"gravity": 3.0}] * 2, workers=2)  # gravity must be negative


def test_batched_ppo_over_worker_processes_equals_per_expert_ppo():
    from dporl.experts.batched_ppo import train_ppo_batched
    from dporl.experts.policies import StackedMLPPolicy
    from dporl.experts.ppo import PPOConfig, train_ppo

    config = PPOConfig(actor_hidden_sizes=[8], critic_hidden_sizes=[8], n_envs=2, n_steps=24, total_timesteps=96,
                       update_epochs=1, n_minibatches=2)
    settings = [{"gravity": -9.0, "enable_wind": True, "wind_power": 1.0, "turbulence_power": 0.1},
                {"gravity": -11.0, "enable_wind": True, "wind_power": 4.0, "turbulence_power": 0.4}]
    batched = train_ppo_batched("LunarLander-v3", settings, config, [5, 6], max_episode_steps=30, env_workers=2)
    alone = [train_ppo("LunarLander-v3", s, config, seed, max_episode_steps=30).actor for s, seed in zip(settings, [5, 6])]
    for name, tensor in StackedMLPPolicy.from_single(alone).state_dict().items():  # tolerance: tests/test_batched_ppo.py
        torch.testing.assert_close(batched.actor.state_dict()[name], tensor, rtol=0, atol=1e-5)
