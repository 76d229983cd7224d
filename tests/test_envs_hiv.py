"""HIV simulator: model equations, the batched Rosenbrock integrator against scipy, equilibria, Gymnasium envs."""

import warnings

import gymnasium as gym
import numpy as np
import pytest
from gymnasium.utils.env_checker import check_env

import dporl.envs  # noqa: F401  (registers the ids)
from dporl.envs import hiv
from dporl.envs.hiv import (
    ACTION_EFFICACIES,
    HEALTHY_EQUILIBRIUM,
    UNHEALTHY_EQUILIBRIUM,
    HIVParameters,
    HIVTreatmentEnv,
    HIVVectorEnv,
    HIVVectorSimulator,
    hiv_derivatives,
    hiv_jacobian,
    integrate_scipy,
)
from dporl.envs.hiv_dynamics import _drug_coefficients, _log_rates, _RosenbrockSolver
from dporl.utils.validation import ValidationError

NO_DRUG = np.zeros(1)


def random_states(rng, n):
    # log-uniform over the ranges the model visits (1 to 1e6 cells or copies per ml)
    return np.exp(rng.uniform(0.0, np.log(1e6), size=(n, 6)))


def test_jacobian_matches_finite_differences():
    rng = np.random.default_rng(0)
    y = random_states(rng, 5)
    eps = ACTION_EFFICACIES[rng.integers(0, 4, 5)]
    J = hiv_jacobian(y, eps[:, 0], eps[:, 1])
    for j in range(6):
        step = 1e-6 * y[:, j]
        up, down = y.copy(), y.copy()
        up[:, j] += step
        down[:, j] -= step
        numeric = (hiv_derivatives(up, eps[:, 0], eps[:, 1]) - hiv_derivatives(down, eps[:, 0], eps[:, 1])) / (2 * step[:, None])
        # central differences are exact up to O(step^2) for these (at most rational) terms plus round-off
        scale = np.abs(J).max(axis=(1, 2))[:, None]
        np.testing.assert_allclose(numeric / scale, J[:, :, j] / scale, atol=1e-6)


def test_structured_solver_matches_dense_solve():
    rng = np.random.default_rng(1)
    n = 64
    y = random_states(rng, n)
    eps = ACTION_EFFICACIES[rng.integers(0, 4, n)]
    f = hiv_derivatives(y, eps[:, 0], eps[:, 1])
    # Jacobian of the log-state rates: G_ij = J_ij y_j / y_i - delta_ij f_i / y_i
    G = hiv_jacobian(y, eps[:, 0], eps[:, 1]) * (y[:, None, :] / y[:, :, None])
    G[:, np.arange(6), np.arange(6)] -= f / y
    s = rng.uniform(0.05, 50.0, n)
    b = rng.normal(size=(n, 6))
    dense = np.linalg.solve(s[:, None, None] * np.eye(6) - G, b[..., None])[..., 0]
    drugs = _drug_coefficients(eps[:, 0], eps[:, 1], HIVParameters())
    rates, terms = _log_rates(y.T.copy(), drugs, HIVParameters())
    np.testing.assert_allclose(rates.T, f / y, rtol=1e-12, atol=1e-12 * np.abs(f / y).max())
    structured = _RosenbrockSolver(terms, s, HIVParameters())(b.T.copy()).T
    np.testing.assert_allclose(structured, dense, rtol=1e-8, atol=1e-10 * np.abs(dense).max())


@pytest.mark.parametrize("small_batch", [0, 2, 8], ids=["batched", "batched-then-one-by-one", "one-by-one"])
def test_matches_scipy_lsoda_one_interval_at_a_time(monkeypatch, small_batch):
    """Each interval restarts the reference from the simulator's own state, so this measures one interval's error.

    The local error of each Rosenbrock step on log-state is controlled to ``tolerance`` (1e-5 here); an interval
    takes ~20-80 steps and errors are damped by the stable dynamics, so we require 1e-4 relative error per
    interval (measured: ~5e-6). The reference is LSODA at rtol 1e-10 (agrees with Radau at rtol 1e-10).
    """
    monkeypatch.setattr(hiv, "_SMALL_BATCH", small_batch)  # exercise both integration paths
    rng = np.random.default_rng(2)
    n_patients, n_steps = 4, 6
    sim = HIVVectorSimulator(n_patients, tolerance=1e-5)
    for _ in range(n_steps):
        actions = rng.integers(0, 4, n_patients)
        before = sim.state
        sim.step(actions)
        after = sim.state
        for i in range(n_patients):
            reference = integrate_scipy(before[i], int(actions[i]), 5.0)
            np.testing.assert_allclose(after[i], reference, rtol=1e-4)


def test_batched_and_one_by_one_paths_agree(monkeypatch):
    """Same method, same step-size decisions: the paths differ only by floating-point rounding.

    12 patients: all batched (0), batched with the last <= 8 stragglers finished one by one (8), all one by one."""
    actions = np.random.default_rng(4).integers(0, 4, size=(5, 12))
    finals = []
    for small_batch in (0, 8, 12):
        monkeypatch.setattr(hiv, "_SMALL_BATCH", small_batch)
        sim = HIVVectorSimulator(12)
        for step_actions in actions:
            sim.step(step_actions)
        finals.append(sim.state)
    np.testing.assert_allclose(finals[0], finals[1], rtol=1e-8)
    np.testing.assert_allclose(finals[0], finals[2], rtol=1e-8)


@pytest.mark.parametrize("published", [UNHEALTHY_EQUILIBRIUM, HEALTHY_EQUILIBRIUM], ids=["unhealthy", "healthy"])
def test_equilibria_stay_put_without_drug(published):
    # Newton from the published (integer-rounded) values finds the exact equilibrium within the rounding.
    y = published.copy()
    for _ in range(20):
        y = y - np.linalg.solve(hiv_jacobian(y[None], NO_DRUG, NO_DRUG)[0], hiv_derivatives(y[None], NO_DRUG, NO_DRUG)[0])
    np.testing.assert_allclose(y, published, atol=0.5)
    assert np.abs(hiv_derivatives(y[None], NO_DRUG, NO_DRUG)[0] / y).max() < 1e-12  # derivative ~ 0 per unit state
    sim = HIVVectorSimulator(2, tolerance=1e-6)
    sim.reset(initial_state=np.stack([y, published]))
    sim.step(np.zeros(2, dtype=int))
    # exact equilibrium: within the integrator tolerance; published values: within their rounding's pull (< 5%)
    np.testing.assert_allclose(sim.state[0], y, rtol=1e-6)
    np.testing.assert_allclose(sim.state[1], published, rtol=0.05)


def test_reward_and_observation_follow_the_spec():
    sim = HIVVectorSimulator(4, R1=20000.0, R2=2000.0)
    rewards = sim.step(np.arange(4))
    y = sim.state
    eps = ACTION_EFFICACIES
    expected = -(0.1 * y[:, 4] + 20000.0 * eps[:, 0] ** 2 + 2000.0 * eps[:, 1] ** 2 - 1000.0 * y[:, 5])
    np.testing.assert_allclose(rewards, expected)
    np.testing.assert_allclose(sim.observation(), np.log10(y), rtol=1e-6)


def test_per_patient_penalties_change_only_the_drug_cost():
    sim = HIVVectorSimulator(2, R1=np.array([18750.0, 21250.0]))
    rewards = sim.step(np.array([1, 1]))  # same drug, same dynamics, different penalty
    np.testing.assert_allclose(rewards[0] - rewards[1], (21250.0 - 18750.0) * 0.7**2)


def test_efficacy_noise_is_seeded_and_only_on_given_drugs():
    sim = HIVVectorSimulator(3, efficacy_noise=0.01)
    eps = sim.efficacies(np.array([0, 1, 3]), np.random.default_rng(0))
    assert eps[0].tolist() == [0.0, 0.0] and eps[1, 1] == 0.0
    assert np.all(np.abs(eps[1:][eps[1:] > 0] - np.array([0.7, 0.7, 0.3])) < 0.06)  # 6 std
    assert not np.allclose(eps[1:][eps[1:] > 0], [0.7, 0.7, 0.3])
    env = gym.make("dporl/HIVTreatment-v0", efficacy_noise=0.01, horizon=3)
    runs = []
    for seed in (5, 5, 6):
        obs, _ = env.reset(seed=seed)
        runs.append(np.concatenate([env.step(3)[0] for _ in range(3)]))
    np.testing.assert_array_equal(runs[0], runs[1])
    assert not np.array_equal(runs[0], runs[2])


def test_single_env_passes_checker_and_truncates_at_horizon():
    env = HIVTreatmentEnv(horizon=3, treatment_interval=20.0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        check_env(env, skip_render_check=True)
    env.reset(seed=0)
    flags = [env.step(0)[2:4] for _ in range(3)]
    assert flags == [(False, False), (False, False), (False, True)]


def test_vector_env_matches_single_envs_and_autoresets():
    actions = np.random.default_rng(3).integers(0, 4, size=(4, 3))
    vec = gym.make_vec("dporl/HIVTreatment-v0", num_envs=3, vectorization_mode="vector_entry_point", horizon=2)
    assert isinstance(vec.unwrapped, HIVVectorEnv)
    obs, _ = vec.reset(seed=0)
    singles = [HIVTreatmentEnv(horizon=2) for _ in range(3)]
    single_obs = np.stack([env.reset(seed=0)[0] for env in singles])
    np.testing.assert_allclose(obs, single_obs)
    for t in range(2):
        obs, rewards, terminated, truncated, _ = vec.step(actions[t])
        results = [env.step(int(a)) for env, a in zip(singles, actions[t])]
        np.testing.assert_allclose(obs, np.stack([r[0] for r in results]), rtol=1e-5)
        np.testing.assert_allclose(rewards, [r[1] for r in results], rtol=1e-5)
        assert not terminated.any() and truncated.tolist() == [t == 1] * 3
    # next-step autoreset: the step after truncation returns the initial observation and reward 0
    obs, rewards, _, truncated, _ = vec.step(actions[2])
    np.testing.assert_allclose(obs, single_obs)
    assert rewards.tolist() == [0.0, 0.0, 0.0] and not truncated.any()


def test_bad_inputs_name_the_field():
    sim = HIVVectorSimulator(2)
    with pytest.raises(ValidationError, match="actions"):
        sim.step(np.array([0, 4]))
    with pytest.raises(ValidationError, match="actions"):
        sim.step(np.array([0]))
    with pytest.raises(ValidationError, match="horizon"):
        HIVTreatmentEnv(horizon=0)
    with pytest.raises(ValidationError, match="R1"):
        HIVVectorSimulator(2, R1=np.array([1.0, -1.0]))
    with pytest.raises(ValidationError, match="rng"):
        HIVVectorSimulator(1, efficacy_noise=0.01).step(np.array([1]))
