"""HIV treatment (Adams et al. 2004) as an off-policy evaluation problem (Xie, Thomas, Miklau 2019, Figure 4).

Target: greedy w.r.t. a batched linear fitted-Q on Fourier features of the log10 state (learnt on public uniform-
random simulations); behaviour: the softmax of the same Q. Rewards are divided by a public reward scale (the paper's
~1e5), so every MSPBE reported is the paper's relative MSPBE. All patients of a dataset advance in one batched
stiff-ODE simulator (``dporl.envs.hiv.HIVVectorSimulator``); episodes are truncated after ``horizon`` decisions.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from dporl.data.dataset import DatasetMetadata, TrajectoryDataset
from dporl.eval.ope_problems.base import SimulatedProblem, padded_data
from dporl.eval.ope_problems.policies import EpsilonGreedyPolicy, SoftmaxPolicy, sample_actions, uniform_policy
from dporl.utils.validation import ValidationError, check_positive


@dataclass
class HIVSettings:
    """Features: an order-``fourier_order`` Fourier basis on the log10 of a few state coordinates (default T1, V, E:
    healthy T-cells, free virus, immune effectors, which carry the reward and the treatment's effect; the infected
    compartments follow V closely). Order 2 on 3 coordinates is 27 features: few enough for GPOPE's noise (it
    grows with the dimension 2n) and for a well-conditioned held-out C.
    """

    treatment_interval: float = 5.0  # days per decision (the classic setting)
    horizon: int = 50  # decisions per episode; the classic 200 costs 4x the simulation
    coordinates: list[int] = field(default_factory=lambda: [0, 4, 5])  # indices into (T1, T2, T1*, T2*, V, E)
    # Public log10 ranges of those coordinates for the Fourier scaling (T1 <= l1/d1 = 1e6; V and E as simulated
    # from the unhealthy equilibrium under any treatment sequence).
    low: list[float] = field(default_factory=lambda: [4.0, -1.0, 0.0])
    high: list[float] = field(default_factory=lambda: [6.2, 7.0, 6.0])
    fourier_order: int = 2
    # Rewards are divided by this public constant (the paper's ~1e5 reward scale) before anything is learnt,
    # so the MSPBE reported is the relative MSPBE (MSPBE is quadratic in the rewards).
    reward_scale: float = 1e5
    fqi_patients: int = 200  # uniform-random simulated episodes for fitted Q-iteration (public data)
    fqi_iterations: int = 40
    # Ridge on each action's Gram matrix (~2500 transitions each): 1e-3 lets linear FQI diverge (weights grow
    # without bound, the greedy policy never treats well); 1 converges within 20 iterations.
    fqi_ridge: float = 1.0
    behaviour_temperature: float = 1.0  # behaviour pi_b(a|s) = softmax(Q(s, .) / temperature), Q in reward_scale units
    efficacy_noise: float = 0.0  # std of the Gaussian noise on administered drug efficacies
    heldout_trajectories: int = 1000  # independent behaviour data for the sample-based MSPBE
    tolerance: float = 1e-5  # integrator tolerance (HIVVectorSimulator)

    def __post_init__(self) -> None:
        check_positive("hiv.treatment_interval", self.treatment_interval)
        check_positive("hiv.reward_scale", self.reward_scale)
        check_positive("hiv.behaviour_temperature", self.behaviour_temperature)
        check_positive("hiv.fqi_ridge", self.fqi_ridge)
        check_positive("hiv.efficacy_noise", self.efficacy_noise, allow_zero=True)
        check_positive("hiv.tolerance", self.tolerance)
        if self.horizon < 1 or self.fqi_patients < 1 or self.fqi_iterations < 1 or self.heldout_trajectories < 2:
            raise ValidationError("hiv", "horizon, fqi_patients, fqi_iterations must be >= 1, heldout >= 2")
        if self.fourier_order < 1:
            raise ValidationError("hiv.fourier_order", f"must be >= 1, got {self.fourier_order}")
        if not self.coordinates or len(set(self.coordinates)) != len(self.coordinates) \
                or any(not 0 <= c < 6 for c in self.coordinates):
            raise ValidationError("hiv.coordinates", f"need distinct indices in [0, 6), got {self.coordinates}")
        if not (len(self.low) == len(self.high) == len(self.coordinates)):
            raise ValidationError("hiv.low", "low, high and coordinates need the same length")


@dataclass
class CoordinateFeatures:
    """A feature map applied to some coordinates of the observation (``obs[..., coordinates]``)."""

    features: Any
    coordinates: list[int]

    def __post_init__(self) -> None:
        self.n_features = self.features.n_features

    def __call__(self, observations: torch.Tensor) -> torch.Tensor:
        return self.features(observations[..., self.coordinates])


def simulate_hiv(settings: HIVSettings, policy, n: int, generator: torch.Generator) -> TrajectoryDataset:
    """n episodes from the unhealthy equilibrium under ``policy`` (obs -> action probabilities), with logged
    log-probabilities; rewards in units of ``reward_scale``. All n patients advance in one batched simulator."""
    from dporl.envs.hiv import HIVVectorSimulator

    simulator = HIVVectorSimulator(n, treatment_interval=settings.treatment_interval,
                                   efficacy_noise=settings.efficacy_noise, tolerance=settings.tolerance)
    rng = np.random.default_rng(int(torch.randint(0, 2**62, (1,), generator=generator)))
    horizon = settings.horizon
    observations = torch.zeros(n, horizon + 1, 6)
    actions = torch.zeros(n, horizon, dtype=torch.long)
    rewards = torch.zeros(n, horizon)
    log_probs = torch.zeros(n, horizon)
    observations[:, 0] = torch.from_numpy(simulator.observation())
    for t in range(horizon):
        actions[:, t], log_probs[:, t] = sample_actions(policy, observations[:, t], generator)
        rewards[:, t] = torch.from_numpy(simulator.step(actions[:, t].numpy(), rng=rng) / settings.reward_scale)
        observations[:, t + 1] = torch.from_numpy(simulator.observation())
    return TrajectoryDataset.from_padded(
        observations=observations, actions=actions, rewards=rewards, mask=torch.ones(n, horizon, dtype=torch.bool),
        terminated=torch.zeros(n, dtype=torch.bool), behavior_log_probs=log_probs,
        metadata=DatasetMetadata(env_id="dporl/HIVTreatment-v0", n_actions=4, n_units=1, obs_shape=(6,),
                                 extra={"reward_scale": settings.reward_scale}),
    )


@dataclass
class HIVProblem(SimulatedProblem):
    """Off-policy evaluation of the fitted-Q greedy policy from its softmax behaviour's episodes; relative MSPBE
    (rewards are stored in ``reward_scale`` units) on held-out behaviour data, both weightings."""

    settings: HIVSettings
    features: Any
    behaviour: SoftmaxPolicy
    target_policy: Any
    gamma: float
    seed: int
    metric_prefix = "held-out relative"

    def __post_init__(self) -> None:
        self._draw_heldout(self.settings.heldout_trajectories, self.seed)

    def sample(self, n: int, generator: torch.Generator) -> TrajectoryDataset:
        return simulate_hiv(self.settings, self.behaviour, n, generator)


def hiv_q_weights(settings: HIVSettings, features, gamma: float, seed: int) -> torch.Tensor:
    """Linear fitted-Q weights [4, n] from uniform-random simulated episodes (public setup, no privacy cost)."""
    from dporl.algos.fitted_q import linear_fitted_q

    data = padded_data(simulate_hiv(settings, uniform_policy(4), settings.fqi_patients,
                                    torch.Generator().manual_seed(seed + 3)))
    observations = data["observations"]
    return linear_fitted_q(
        features(observations[:, :-1]).reshape(-1, features.n_features),
        data["actions"].reshape(-1),
        data["rewards"].reshape(-1),
        features(observations[:, 1:]).reshape(-1, features.n_features),
        torch.ones(data["actions"].numel()),  # truncated episodes: every next state bootstraps
        n_actions=4, gamma=gamma, iterations=settings.fqi_iterations, ridge=settings.fqi_ridge,
    )


def hiv_problem(settings: HIVSettings, gamma: float, seed: int) -> HIVProblem:
    from dporl.envs.features import FourierBasis

    features = CoordinateFeatures(FourierBasis(settings.fourier_order, settings.low, settings.high),
                                  list(settings.coordinates))
    q_weights = hiv_q_weights(settings, features, gamma, seed)
    behaviour = SoftmaxPolicy(features, q_weights, settings.behaviour_temperature)
    target = EpsilonGreedyPolicy(features, q_weights, 0.0)  # greedy w.r.t. the fitted Q
    return HIVProblem(settings, features, behaviour, target, gamma, seed)
