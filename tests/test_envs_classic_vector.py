"""Batched CartPole / Acrobot with per-sub-env streams: equal to Gymnasium's scalar envs, block by block."""

import gymnasium as gym
import numpy as np
import pytest

from dporl.envs.classic_vector import AcrobotVectorEnv, CartPoleVectorEnv, sub_env_seeds
from dporl.envs.variants import make_variant, make_vector_variant, physics_of
from dporl.utils.validation import ValidationError


def run(vector_env, seed, actions):
    """Observations, rewards, terminations, truncations of a fixed action sequence [T, n]."""
    obs, _ = vector_env.reset(seed=seed)
    out = [[obs], [], [], []]
    for action in actions:
        obs, reward, terminated, truncated, _ = vector_env.step(action)
        for store, value in zip(out, (obs, reward, terminated, truncated)):
            store.append(np.asarray(value))
    return [np.stack(values) for values in out]


@pytest.mark.parametrize("env_id, cls, steps", [("CartPole-v1", CartPoleVectorEnv, 30), ("Acrobot-v1", AcrobotVectorEnv, 25)])
def test_batched_env_follows_gymnasium_scalar_envs_with_the_same_seeds(env_id, cls, steps):
    # Short time limits force several next-step autoresets, so the per-sub-env reset streams are exercised too.
    n, horizon = 3, 120
    actions = np.random.default_rng(0).integers(0, 3 if env_id == "Acrobot-v1" else 2, size=(horizon, n))
    reference = gym.vector.SyncVectorEnv([lambda: gym.make(env_id, max_episode_steps=steps) for _ in range(n)])
    batched = cls(num_envs=n, max_episode_steps=steps)
    for seed in (7, [11, 3, 5]):
        expected, got = run(reference, seed, actions), run(batched, seed, actions)
        ended = expected[2] | expected[3]
        assert ended.sum(axis=0).min() >= 2  # every sub-env ended (and autoreset) at least twice
        # Same random streams (resets draw the same numbers); vectorised vs scalar numpy maths differ by float
        # rounding only, which the chaotic Acrobot amplifies to ~1e-12 over an episode: 1e-6 is far above that
        # and far below any real difference (a wrong reset or one wrong step moves states by >1e-3).
        np.testing.assert_allclose(got[0], expected[0], atol=1e-6)
        for index in (1, 2, 3):
            np.testing.assert_array_equal(got[index], expected[index])


@pytest.mark.parametrize("cls", [CartPoleVectorEnv, AcrobotVectorEnv])
def test_a_block_of_a_big_vector_env_equals_the_block_alone(cls):
    seeds = [21, 22, 23, 24, 25, 26]
    actions = np.random.default_rng(1).integers(0, 2, size=(150, 6))
    big = run(cls(num_envs=6, max_episode_steps=40), seeds, actions)
    small = run(cls(num_envs=2, max_episode_steps=40), seeds[2:4], actions[:, 2:4])
    for whole, block in zip(big, small):
        np.testing.assert_array_equal(whole[:, 2:4], block)


def test_acrobot_physics_per_sub_env_match_the_scalar_variant():
    params = {"LINK_LENGTH_1": np.array([0.8, 1.2]), "LINK_LENGTH_2": np.array([0.8, 1.2]),
              "LINK_MASS_1": np.array([0.9, 1.1]), "LINK_MASS_2": 1.05}
    vec = make_vector_variant("Acrobot-v1", params, num_envs=2, max_episode_steps=500)
    assert isinstance(vec, AcrobotVectorEnv) and physics_of(vec, "Acrobot-v1")["LINK_MASS_1"] == [0.9, 1.1]
    actions = np.random.default_rng(2).integers(0, 3, size=(60, 2))
    got = run(vec, [4, 9], actions)[0]
    for i in range(2):
        single = make_variant("Acrobot-v1", {k: (v[i] if isinstance(v, np.ndarray) else v) for k, v in params.items()})
        reference = gym.vector.SyncVectorEnv([lambda single=single: single])
        np.testing.assert_allclose(got[:, i], run(reference, [[4, 9][i]], actions[:, i:i + 1])[0][:, 0], atol=1e-6)


def test_seeds_are_validated():
    assert sub_env_seeds(5, 3) == [5, 6, 7] and sub_env_seeds(None, 2) == [None, None]
    with pytest.raises(ValidationError, match="seed"):
        sub_env_seeds([1, 2], 3)
    with pytest.raises(ValidationError, match="seed"):
        sub_env_seeds([1, -2], 2)
    env = AcrobotVectorEnv(num_envs=2)
    env.reset(seed=0)
    with pytest.raises(ValidationError, match="actions"):
        env.step(np.array([0, 3]))
