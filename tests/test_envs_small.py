"""Chain (closed-form values, dynamics) and 1-D line MDP."""

import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import dporl.envs  # noqa: F401
from dporl.envs.chain import ChainEnv, chain_expected_rewards, chain_transition_matrix, chain_true_values
from dporl.envs.line import LineEnv
from dporl.utils.validation import ValidationError


@pytest.mark.parametrize("n_states,p,gamma", [(40, 0.5, 0.99), (5, 0.2, 0.9), (3, 0.0, 1.0)])
def test_chain_closed_form_equals_linear_solve(n_states, p, gamma):
    P = chain_transition_matrix(n_states, p)
    r = chain_expected_rewards(n_states, p)
    np.testing.assert_allclose(P.sum(axis=1), 1.0)
    # Solve on the transient states (the absorbing one has value 0), so gamma = 1 is allowed too.
    transient = slice(0, n_states - 1)
    solved = np.linalg.solve(np.eye(n_states - 1) - gamma * P[transient, transient], r[transient])
    values = chain_true_values(n_states, p, gamma)
    np.testing.assert_allclose(values[transient], solved, rtol=1e-12)
    assert values[-1] == 0.0


def test_chain_monte_carlo_returns_match_true_values():
    env = gym.make("dporl/Chain-v0")
    gamma, n_episodes = 0.99, 600
    starts, returns = [], []
    obs, _ = env.reset(seed=0)
    for _ in range(n_episodes):
        obs, _ = env.reset()
        starts.append(int(obs[0]))
        discount, total, done = 1.0, 0.0, False
        while not done:
            obs, reward, terminated, truncated, _ = env.step(0)
            total += discount * reward
            discount *= gamma
            done = terminated or truncated
        assert terminated and obs[0] == 39.0
        returns.append(total)
    starts, returns = np.array(starts), np.array(returns)
    assert starts.min() >= 0 and starts.max() <= 38  # uniform over the non-absorbing states
    errors = returns - chain_true_values(40, 0.5, 0.99)[starts]
    # each return is gamma^(time to absorb) in (0, 1]; mean error within 4 standard errors of 0
    assert abs(errors.mean()) < 4 * errors.std() / np.sqrt(n_episodes)


def test_chain_env_checks_and_validation():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(ChainEnv(), skip_render_check=True)
    with pytest.raises(ValidationError, match="n_states"):
        ChainEnv(n_states=1)
    with pytest.raises(ValidationError, match="p"):
        chain_true_values(40, 1.0, 0.9)
    with pytest.raises(ValidationError, match="gamma"):
        chain_true_values(40, 0.5, 1.5)


def test_line_dynamics_reward_and_horizon():
    env = gym.make("dporl/Line1D-v0")
    obs, _ = env.reset(seed=1)
    moves, positions = [], [float(obs[0])]
    rng = np.random.default_rng(0)
    for t in range(50):
        action = int(rng.integers(0, 2))
        obs, reward, terminated, truncated, _ = env.step(action)
        s = float(obs[0])
        assert 0.0 <= s <= 1.0 and not terminated
        assert reward == pytest.approx(0.5 - abs(s - 0.5), abs=1e-6)
        step = s - positions[-1]
        # a move goes the chosen way by at most 0.25 (less only when clipped at the wall)
        assert (step >= -1e-6 if action == 1 else step <= 1e-6) and abs(step) <= 0.25 + 1e-6
        if 1e-6 < s < 1 - 1e-6:
            moves.append(abs(step))
        positions.append(s)
        assert truncated == (t == 49)
    # unclipped moves are U[0, 0.25]: their mean is 0.125 (std 0.072; 4 standard errors)
    assert abs(np.mean(moves) - 0.125) < 4 * 0.072 / np.sqrt(len(moves))


def test_line_env_checks_and_seeding():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(LineEnv(), skip_render_check=True)
    env = LineEnv()
    a = [env.reset(seed=3)[0]] + [env.step(1)[0] for _ in range(5)]
    b = [env.reset(seed=3)[0]] + [env.step(1)[0] for _ in range(5)]
    np.testing.assert_array_equal(np.concatenate(a), np.concatenate(b))
    with pytest.raises(ValidationError, match="action"):
        env.step(2)
