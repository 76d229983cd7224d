"""MountainCar-v0 as an OPE problem (Xie, Thomas, Miklau 2019): order-5 Fourier features, a Q(lambda) behaviour.

The behaviour is epsilon-greedy w.r.t. a linear Q learnt by Watkins' Q(lambda) on the same Fourier features (public
setup). On-policy the target is the behaviour; off-policy it is the uniform policy. Trajectories are simulated for all
cars at once (``dporl.envs.mountain_car.MountainCarBatch``, Gymnasium's dynamics exactly), one policy evaluation per
time step. The truth is a large held-out behaviour sample: its MSPBE under both weightings (see ``base``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

import numpy as np
import torch

from dporl.data.dataset import DatasetMetadata, TrajectoryDataset
from dporl.envs.mountain_car import N_ACTIONS, OBSERVATION_HIGH, OBSERVATION_LOW, MountainCarBatch
from dporl.eval.ope_problems.base import SimulatedProblem
from dporl.eval.ope_problems.policies import EpsilonGreedyPolicy, sample_actions, uniform_policy
from dporl.utils.validation import ValidationError, check_positive, check_probability

# The scaling of (x, v) to [0, 1] for the Fourier basis (Konidaris et al. 2011's ranges) (Gymnasium's observation box has x up to 0.6).
MOUNTAIN_CAR_LOW, MOUNTAIN_CAR_HIGH = (-1.2, -0.07), (0.5, 0.07)


@dataclass
class MountainCarSettings:
    fourier_order: int = 5  # (order + 1)^2 features for GPOPE / LSTD and for the behaviour's Q-function
    q_learning_episodes: int = 100  # Watkins' Q(lambda), greedy w.r.t. an optimistic (zero) initial Q
    q_learning_step_size: float = 0.001  # base step; feature i uses step / ||c_i|| (Konidaris et al. 2011)
    q_learning_trace_decay: float = 0.9
    behaviour_epsilon: float = 0.1  # behaviour = epsilon-greedy of the learned Q (its probabilities are logged)
    off_policy: bool = False  # True: evaluate the uniform random policy from the behaviour's data
    heldout_trajectories: int = 500  # independent behaviour data for the sample-based MSPBE
    max_episode_steps: int = 200

    def __post_init__(self) -> None:
        if self.fourier_order < 1 or self.q_learning_episodes < 1 or self.heldout_trajectories < 2:
            raise ValidationError("mountain_car", "fourier_order, q_learning_episodes must be >= 1, heldout >= 2")
        check_positive("mountain_car.q_learning_step_size", self.q_learning_step_size)
        check_probability("mountain_car.q_learning_trace_decay", self.q_learning_trace_decay)
        check_probability("mountain_car.behaviour_epsilon", self.behaviour_epsilon, allow_zero=False)


def _fourier_norms(features) -> torch.Tensor:
    """||c_i|| of every Fourier coefficient vector, read off the basis (1 for the constant feature)."""
    coefficients = getattr(features, "coefficients", None)
    if coefficients is None:
        return torch.ones(features.n_features, dtype=torch.float64)
    norms = torch.as_tensor(coefficients, dtype=torch.float64).norm(dim=-1)
    return torch.where(norms > 0, norms, torch.ones_like(norms))


def q_lambda_policy(settings: MountainCarSettings, features, seed: int) -> torch.Tensor:
    """Linear Q-weights [n_actions, n] for MountainCar-v0 by Watkins' Q(lambda) on Fourier features (public setup).

    Greedy with respect to the current Q, which starts at 0 above every true value (rewards are -1): optimism
    explores, and with no exploratory actions Watkins' traces are never cut.
    """
    import gymnasium as gym

    env = gym.make("MountainCar-v0", max_episode_steps=settings.max_episode_steps)
    n_actions = int(env.action_space.n)
    weights = torch.zeros(n_actions, features.n_features, dtype=torch.float64)
    steps = settings.q_learning_step_size / _fourier_norms(features)
    for episode in range(settings.q_learning_episodes):
        obs, _ = env.reset(seed=seed + episode)
        phi = features(torch.as_tensor(obs, dtype=torch.float32)).double()
        traces = torch.zeros_like(weights)
        while True:
            action = int(torch.argmax(weights @ phi))
            obs, reward, terminated, truncated, _ = env.step(action)
            next_phi = features(torch.as_tensor(obs, dtype=torch.float32)).double()
            target = reward + (0.0 if terminated else float((weights @ next_phi).max()))
            error = target - float(weights[action] @ phi)
            traces *= settings.q_learning_trace_decay
            traces[action] += phi
            weights += error * steps * traces
            if terminated or truncated:
                break
            phi = next_phi
    env.close()
    return weights


def simulate_mountain_car(policy, n: int, max_steps: int, generator: torch.Generator) -> TrajectoryDataset:
    """n episodes of ``policy`` (obs -> action probabilities) with logged log-probabilities; the time limit
    truncates. All cars step together: one policy call and one numpy update per time step."""
    cars = MountainCarBatch(n)
    rng = np.random.default_rng(int(torch.randint(0, 2**62, (1,), generator=generator)))
    observations = np.zeros((n, max_steps + 1, 2), dtype=np.float32)
    actions = np.zeros((n, max_steps), dtype=np.int64)
    log_probs = np.zeros((n, max_steps), dtype=np.float32)
    mask = np.zeros((n, max_steps), dtype=bool)
    terminated = np.zeros(n, dtype=bool)
    observations[:, 0] = cars.reset(rng)
    live = np.arange(n)
    for t in range(max_steps):
        if live.size == 0:
            break
        chosen, logp = sample_actions(policy, torch.from_numpy(observations[live, t]), generator)
        actions[live, t], log_probs[live, t], mask[live, t] = chosen.numpy(), logp.numpy(), True
        done = cars.step(chosen.numpy(), live)
        observations[live, t + 1] = cars.observation(live)
        terminated[live[done]] = True
        live = live[~done]
    width = max(1, int(mask.sum(1).max()))
    return TrajectoryDataset.from_padded(
        observations=observations[:, : width + 1], actions=actions[:, :width],
        rewards=-mask[:, :width].astype(np.float32), mask=mask[:, :width], terminated=terminated,
        behavior_log_probs=log_probs[:, :width],
        metadata=DatasetMetadata(env_id="MountainCar-v0", n_actions=N_ACTIONS, n_units=1, obs_shape=(2,),
                                 extra={"observation_low": list(OBSERVATION_LOW),
                                        "observation_high": list(OBSERVATION_HIGH)}),
    )


@dataclass
class MountainCarProblem(SimulatedProblem):
    """On- or off-policy evaluation in MountainCar-v0 from the logged behaviour; held-out MSPBE, both weightings."""

    features: Any
    behaviour: EpsilonGreedyPolicy
    target_policy: Optional[Any]  # None: on-policy
    gamma: float
    max_episode_steps: int
    heldout: int
    seed: int

    def __post_init__(self) -> None:
        self._draw_heldout(self.heldout, self.seed)

    def sample(self, n: int, generator: torch.Generator) -> TrajectoryDataset:
        return simulate_mountain_car(self.behaviour, n, self.max_episode_steps, generator)


def mountain_car_problem(settings: MountainCarSettings, gamma: float, seed: int) -> MountainCarProblem:
    from dporl.envs.features import FourierBasis

    features = FourierBasis(settings.fourier_order, MOUNTAIN_CAR_LOW, MOUNTAIN_CAR_HIGH)
    q_weights = q_lambda_policy(settings, features, seed)
    behaviour = EpsilonGreedyPolicy(features, q_weights, settings.behaviour_epsilon)
    target = uniform_policy(int(q_weights.shape[0])) if settings.off_policy else None
    return MountainCarProblem(features, behaviour, target, gamma, settings.max_episode_steps,
                              settings.heldout_trajectories, seed)
