"""OPE problems: the protocol, datasets in the project's format, batched Mountain Car, a user's logged data."""

from __future__ import annotations

import gymnasium as gym
import numpy as np
import pytest
import torch

from dporl.algos.lstd import lstd
from dporl.data.dataset import DatasetMetadata, TrajectoryDataset
from dporl.envs.features import TabularFeatures
from dporl.envs.mountain_car import MountainCarBatch
from dporl.eval.ope_problems import (
    ChainSettings,
    FiniteStateProblem,
    HIVSettings,
    LoggedProblem,
    MountainCarSettings,
    OPEProblem,
    chain_problem,
    hiv_problem,
    mountain_car_problem,
    padded_data,
    uniform_policy,
)
from dporl.utils.validation import ValidationError


def test_every_problem_follows_the_protocol_and_samples_datasets():
    chain = chain_problem(ChainSettings(n_states=6), 0.9)
    car = mountain_car_problem(MountainCarSettings(fourier_order=2, q_learning_episodes=1, heldout_trajectories=3,
                                                   max_episode_steps=20, off_policy=True), 0.99, 0)
    hiv = hiv_problem(HIVSettings(horizon=3, fqi_patients=3, fqi_iterations=2, heldout_trajectories=3), 0.9, 0)
    for problem in (chain, car, hiv):
        assert isinstance(problem, OPEProblem)
        dataset = problem.sample(7, torch.Generator().manual_seed(0))
        assert isinstance(dataset, TrajectoryDataset) and dataset.n_episodes == 7
        metrics = problem.metrics(torch.zeros(problem.features.n_features, dtype=torch.float64))
        assert list(metrics) == list(problem.metric_labels)  # every metric labelled, headline first
        if problem.target_policy is not None:  # off-policy data carries the behaviour's propensities
            assert dataset.behavior_log_probs is not None
    assert isinstance(chain, FiniteStateProblem) and not isinstance(car, FiniteStateProblem)
    assert list(car.metric_labels) == ["mspbe", "mspbe_transition"]


def test_from_padded_inverts_padded():
    problem = chain_problem(ChainSettings(n_states=8), 0.9)
    dataset = problem.sample(50, torch.Generator().manual_seed(3))
    padded = dataset.padded()
    again = TrajectoryDataset.from_padded(
        observations=padded.observations, actions=padded.actions, rewards=padded.rewards, mask=padded.mask,
        terminated=padded.terminated, metadata=dataset.metadata,
    )
    for name in ("observations", "actions", "rewards", "terminations", "truncations", "episode_lengths"):
        np.testing.assert_array_equal(getattr(again, name), getattr(dataset, name))
    assert dataset.terminations.sum() == 50  # every chain episode ends in the absorbing state
    broken = padded.mask.clone()
    broken[0, 0] = False  # not a prefix
    with pytest.raises(ValidationError, match="mask"):
        TrajectoryDataset.from_padded(observations=padded.observations, actions=padded.actions,
                                      rewards=padded.rewards, mask=broken, terminated=padded.terminated,
                                      metadata=dataset.metadata)


def test_mountain_car_batch_is_gymnasiums_dynamics():
    # 40 cars under an energy-pumping controller with random pushes, stepped by Gymnasium one at a time and by the
    # batch together: identical float32 observations and termination flags at every step (same float64 updates).
    n = 40
    envs = [gym.make("MountainCar-v0").unwrapped for _ in range(n)]
    for i, env in enumerate(envs):
        env.reset(seed=i)
    batch = MountainCarBatch(n)
    batch.set_state([e.state[0] for e in envs], [e.state[1] for e in envs])
    rng = np.random.default_rng(0)
    live, finished = np.arange(n), 0
    for _ in range(300):
        if live.size == 0:
            break
        pump = np.where(batch.velocity[live] >= 0, 2, 0)
        actions = np.where(rng.random(live.size) < 0.2, rng.integers(0, 3, live.size), pump)
        done = batch.step(actions, live)
        for i, a, d in zip(live, actions, done):
            obs, reward, terminated, _, _ = envs[i].step(int(a))
            assert terminated == d and reward == -1.0
            np.testing.assert_array_equal(obs, batch.observation(np.array([i]))[0])
        finished += int(done.sum())
        live = live[~done]
    assert finished > n // 2  # the controller reaches the goal: the terminal branch was exercised
    with pytest.raises(ValidationError, match="actions"):
        batch.step(np.array([3]), np.array([0]))


def test_logged_problem_is_a_dataset_plus_features_plus_a_target():
    # A user's own data without a simulator: sample() hands out the logged trajectories themselves, and metrics
    # exist only on public held-out data. Off-policy data must carry the logged propensities.
    chain = chain_problem(ChainSettings(n_states=5), 0.9)
    logged = chain.sample(30, torch.Generator().manual_seed(1))
    public = chain.sample(200, torch.Generator().manual_seed(2))
    problem = LoggedProblem(logged, TabularFeatures(5), None, 0.9, public_heldout=public)
    assert isinstance(problem, OPEProblem) and not isinstance(problem, FiniteStateProblem)
    assert problem.sample(30, torch.Generator()) is logged
    subset = problem.sample(10, torch.Generator().manual_seed(0))
    assert subset.n_episodes == 10
    theta = lstd(problem.features, padded_data(public), 0.9, weighting="trajectory")
    assert problem.metrics(theta)["mspbe"] < 1e-12  # the held-out LSTD solution has zero held-out error
    assert LoggedProblem(logged, TabularFeatures(5), None, 0.9).metrics(theta) == {}
    with pytest.raises(ValidationError, match="n"):
        problem.sample(31, torch.Generator())
    with pytest.raises(ValidationError, match="behavior_log_probs"):
        LoggedProblem(logged, TabularFeatures(5), uniform_policy(1), 0.9)


def test_batched_rollouts_log_the_behaviours_probabilities():
    car = mountain_car_problem(MountainCarSettings(fourier_order=2, q_learning_episodes=1, heldout_trajectories=3,
                                                   max_episode_steps=25), 0.99, 0)
    data = padded_data(car.sample(12, torch.Generator().manual_seed(5)))
    states = data["observations"][:, :-1]
    probs = car.behaviour(states).gather(-1, data["actions"].unsqueeze(-1)).squeeze(-1)
    mask = data["mask"]
    torch.testing.assert_close(data["behavior_log_probs"][mask].double(), probs.log()[mask], atol=1e-6, rtol=0)
    assert int(data["lengths"].max()) <= 25
    assert bool((data["rewards"][mask] == -1).all())
