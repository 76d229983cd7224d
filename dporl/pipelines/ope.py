"""Pipeline "ope": private policy evaluation experiments (GPOPE vs DP-LSW / DP-LSL, LSTD reference).

Chain experiment (Xie, Thomas, Miklau 2019, Figure 1a; Balle et al. 2016's domain): for every number of
trajectories m and trial, draw m on-policy trajectories of the 40-state chain, release a value estimate with
each private method at (epsilon, delta), and score it by the exact MSPBE (on-policy distribution) and the RMSE
against the closed-form values. GPOPE's step size is tuned on an independent *public* dataset of the same size
(the paper's protocol: a step size chosen on the private data would leak), then also run at the configured
multiples (0.1x, 10x) to check robustness. DP-LSL's lambda = scale * sqrt(m) is tuned the same way.

Off-policy experiments compare GPOPE with the non-private WIS-LSTD on held-out sample MSPBE: Mountain Car
(behaviour epsilon-greedy Q(lambda), target uniform) and HIV treatment (target greedy w.r.t. a batched linear
fitted-Q on Fourier features of the log10 state, behaviour the softmax of the same Q; rewards divided by a public
reward scale, so the MSPBE is the paper's relative MSPBE). DP-LSW / DP-LSL need a finite state space and run on
the chain only.

Every trial's GPOPE run goes through the shared Trainer (Poisson sampling over trajectories, RDP accounting,
or the paper's one-trajectory-per-update mode with sampling-without-replacement RDP, replace-one adjacency).
Outputs in ``run_dir``: results.csv, results.md, mspbe_vs_m.png, rmse_vs_m.png, summary.json and one Trainer
run directory (checkpoint, TensorBoard, privacy report) per GPOPE run.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import torch

from dporl.algos.dp_lsw_lsl import ANALYSIS as SMOOTH_SENSITIVITY, dp_lsl, dp_lsw, first_visit_returns
from dporl.algos.gpope import GPOPE, GPOPEConfig, paper_lemma1_epsilon
from dporl.algos.lstd import lstd
from dporl.eval.ope_metrics import exact_td_statistics, mspbe, on_policy_distribution, rmse
from dporl.logging import plot_lines
from dporl.pipelines import Pipeline, register
from dporl.privacy.accountants import analysis_name
from dporl.privacy.calibration import max_steps
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.noise import NoiseSource
from dporl.privacy.samplers import FixedSizeSource, PoissonUnitSource
from dporl.train.config import DPConfig, OptimizerConfig, TrainerConfig
from dporl.train.run_dir import RunDirectory, RunMode
from dporl.train.trainer import Trainer
from dporl.utils.config import to_dict
from dporl.utils.io import atomic_write_json, atomic_write_text
from dporl.utils.validation import ValidationError, check_positive, check_probability

PRIVATE_METHODS = ("gpope", "dp_lsw", "dp_lsl")


@dataclass
class ChainSettings:
    n_states: int = 40
    stay_probability: float = 0.5
    max_episode_steps: int = 10_000  # sampling guard; the expected length from state 0 is (N-1)/(1-p)

    def __post_init__(self) -> None:
        if self.n_states < 2:
            raise ValidationError("chain.n_states", f"must be >= 2, got {self.n_states}")
        check_probability("chain.stay_probability", self.stay_probability, allow_one=False)


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


@dataclass
class HIVSettings:
    """HIV treatment (Adams et al. 2004), off-policy: target greedy w.r.t. a linear fitted-Q, behaviour its softmax.

    Features: an order-``fourier_order`` Fourier basis on the log10 of a few state coordinates (default T1, V, E:
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
class GPOPESettings:
    mode: Literal["poisson", "paper"] = "poisson"
    expected_batch_size: float = 1.0  # Poisson: sample rate q = expected_batch_size / m (1: the paper's rate)
    epochs: float = 1.0  # iterations N = epochs * m / expected_batch_size (when noise_multiplier is None)
    # None: sigma calibrated so that N iterations fit (epsilon, delta). Given: N = the most iterations that fit.
    noise_multiplier: Optional[float] = None
    # The paper's h. Noise is sigma * h, so h should sit near typical gradient norms (chain: ~0.01, far below 1):
    # None tunes it on public data over clip_norm_grid, jointly with the step size.
    clip_norm: Optional[float] = None
    clip_norm_grid: list[float] = field(default_factory=lambda: [0.001, 0.003, 0.01])
    step_size: Optional[float] = None  # None: tuned on public data over step_size_grid, separately for every m
    step_size_grid: list[float] = field(default_factory=lambda: [0.001, 0.003, 0.01, 0.03, 0.1, 0.3, 1.0])
    step_size_multipliers: list[float] = field(default_factory=lambda: [1.0, 0.1, 10.0])
    schedule: Literal["constant", "inverse_time"] = "constant"
    time_offset: float = 0.0
    accountant: Literal["rdp", "prv", "pld"] = "rdp"

    def __post_init__(self) -> None:
        check_positive("gpope.expected_batch_size", self.expected_batch_size)
        check_positive("gpope.epochs", self.epochs)
        if self.clip_norm is not None:
            check_positive("gpope.clip_norm", self.clip_norm)
        if self.step_size is not None:
            check_positive("gpope.step_size", self.step_size)
        if self.noise_multiplier is not None:
            check_positive("gpope.noise_multiplier", self.noise_multiplier)
        if not self.step_size_grid or not self.step_size_multipliers:
            raise ValidationError("gpope.step_size_grid", "needs at least one step size and one multiplier")
        for i, value in enumerate(self.step_size_grid + self.step_size_multipliers + self.clip_norm_grid):
            check_positive(f"gpope.step_sizes[{i}]", value)
        if self.mode == "paper" and self.accountant != "rdp":
            raise ValidationError("gpope.accountant", "paper mode (sampling without replacement) is analysed by 'rdp'")


@dataclass
class OutputPerturbationSettings:
    methods: list[str] = field(default_factory=lambda: ["dp_lsw", "dp_lsl"])
    # Public bound F_max on first-visit returns; None: R_max / (1 - gamma). The chain pays at most one unit
    # reward per episode, so 1 is a public bound there (and the better baseline).
    return_bound: Optional[float] = 1.0
    lsl_lambda_scale: Optional[float] = None  # lambda = scale * sqrt(m); None: tuned on public data
    lsl_lambda_grid: list[float] = field(default_factory=lambda: [1.0, 3.0, 10.0, 30.0, 100.0])

    def __post_init__(self) -> None:
        unknown = sorted(set(self.methods) - {"dp_lsw", "dp_lsl"})
        if unknown:
            raise ValidationError("output_perturbation.methods", f"unknown method(s) {unknown}; use dp_lsw, dp_lsl")
        if self.return_bound is not None:
            check_positive("output_perturbation.return_bound", self.return_bound)
        if self.lsl_lambda_scale is not None:
            check_positive("output_perturbation.lsl_lambda_scale", self.lsl_lambda_scale)
        for i, value in enumerate(self.lsl_lambda_grid):
            check_positive(f"output_perturbation.lsl_lambda_grid[{i}]", value)


@dataclass
class OPEConfig:
    pipeline: str = "ope"
    experiment: Literal["chain", "mountain_car", "hiv"] = "chain"
    run_dir: str = "runs/ope_chain"
    seed: int = 0
    trials: int = 5
    m_values: list[int] = field(default_factory=lambda: [100, 1000, 10000])
    gamma: float = 0.99
    epsilon: float = 0.1
    delta: float = 1e-5
    # None: a secret seed per release (real use). A fixed seed makes the run reproducible but voids the guarantee
    # for anyone who knows it.
    noise_seed: Optional[int] = None
    progress: bool = True
    chain: ChainSettings = field(default_factory=ChainSettings)
    mountain_car: MountainCarSettings = field(default_factory=MountainCarSettings)
    hiv: HIVSettings = field(default_factory=HIVSettings)
    gpope: GPOPESettings = field(default_factory=GPOPESettings)
    output_perturbation: OutputPerturbationSettings = field(default_factory=OutputPerturbationSettings)

    def __post_init__(self) -> None:
        if self.pipeline != "ope":
            raise ValidationError("pipeline", f"this config is for pipeline 'ope', got {self.pipeline!r}")
        if self.trials < 1:
            raise ValidationError("trials", f"must be >= 1, got {self.trials}")
        if not self.m_values or any(m < 2 for m in self.m_values):
            raise ValidationError("m_values", f"need dataset sizes >= 2, got {self.m_values}")
        check_probability("gamma", self.gamma, allow_one=False)
        check_positive("epsilon", self.epsilon)
        check_probability("delta", self.delta, allow_zero=False, allow_one=False)


# --------------------------------------------------------------------------------------------- the chain problem
@dataclass
class FiniteProblem:
    """A finite Markov reward process with its public features, exact TD statistics and true values."""

    features: Any  # callable obs [..., 1] -> [..., n]
    feature_matrix: torch.Tensor  # [S, n]
    transitions: torch.Tensor  # [S, S], rows of terminal states zero
    step_rewards: torch.Tensor  # [S, S] reward on the transition s -> s'
    start: torch.Tensor  # [S] start distribution
    true_values: torch.Tensor  # [S]
    scored_states: torch.Tensor  # states the RMSE averages over (the non-terminal ones)
    gamma: float
    reward_max: float
    max_episode_steps: int
    finite = True
    target_policy = None  # on-policy
    reference_name = "lstd (non-private)"

    def __post_init__(self) -> None:
        expected_reward = (self.transitions * self.step_rewards).sum(1)
        self.distribution = on_policy_distribution(self.transitions, self.start)
        self.stats = exact_td_statistics(
            self.feature_matrix, self.transitions, expected_reward, self.distribution, self.gamma
        )

    def metrics(self, theta: torch.Tensor) -> dict[str, float]:
        values = self.feature_matrix @ theta.double()
        return {
            "mspbe": float(mspbe(theta, self.stats)),
            "rmse": float(rmse(values[self.scored_states], self.true_values[self.scored_states])),
        }

    def sample(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """n trajectories as padded tensors (observations hold the state index), sampled for all n at once."""
        cumulative = self.transitions.cumsum(1)
        terminal = self.transitions.sum(1) == 0
        states = torch.multinomial(self.start, n, replacement=True, generator=generator)
        visited, rewards, alive = [states], [], [~terminal[states]]
        for _ in range(self.max_episode_steps):
            if not alive[-1].any():
                break
            draw = torch.rand(n, generator=generator, dtype=torch.float64)
            nxt = torch.searchsorted(cumulative[states], draw.unsqueeze(1)).squeeze(1).clamp_max(len(terminal) - 1)
            nxt = torch.where(alive[-1], nxt, states)
            rewards.append(torch.where(alive[-1], self.step_rewards[states, nxt], 0.0))
            states = nxt
            visited.append(states)
            alive.append(alive[-1] & ~terminal[states])
        mask = torch.stack(alive[:-1], 1)
        if not mask[:, 0].all():
            raise ValidationError("chain", "the start distribution puts mass on terminal states")
        return {
            "observations": torch.stack(visited, 1).unsqueeze(-1).float(),
            "actions": torch.zeros(mask.shape, dtype=torch.long),
            "rewards": torch.stack(rewards, 1).float() * mask,
            "mask": mask,
            "lengths": mask.sum(1),
            "terminated": ~alive[-1],
        }


def chain_problem(config: OPEConfig) -> FiniteProblem:
    from dporl.envs.chain import chain_transition_matrix, chain_true_values
    from dporl.envs.features import TabularFeatures

    n, p, gamma = config.chain.n_states, config.chain.stay_probability, config.gamma
    transitions = torch.as_tensor(chain_transition_matrix(n, p), dtype=torch.float64).clone()
    transitions[n - 1] = 0.0  # the absorbing state ends the episode
    step_rewards = torch.zeros(n, n, dtype=torch.float64)
    step_rewards[: n - 1, n - 1] = 1.0  # reward 1 on entering the absorbing state
    start = torch.ones(n, dtype=torch.float64)
    start[n - 1] = 0.0
    features = TabularFeatures(n)
    states = torch.arange(n, dtype=torch.float32).unsqueeze(1)
    return FiniteProblem(
        features=features,
        feature_matrix=features(states).double(),
        transitions=transitions,
        step_rewards=step_rewards,
        start=start / start.sum(),
        true_values=torch.as_tensor(chain_true_values(n, p, gamma), dtype=torch.float64),
        scored_states=torch.arange(n - 1),
        gamma=gamma,
        reward_max=1.0,
        max_episode_steps=config.chain.max_episode_steps,
    )


# --------------------------------------------------------------------------------------------- Mountain Car
MOUNTAIN_CAR_LOW, MOUNTAIN_CAR_HIGH = (-1.2, -0.07), (0.5, 0.07)  # the spec's scaling of (x, v) to [0, 1]


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


@dataclass
class EpsilonGreedyPolicy:
    """pi(a|s) = eps / n_A + (1 - eps) [a = argmax_a Q(s, a)] for a linear Q (weights [n_A, n])."""

    features: Any
    q_weights: torch.Tensor
    epsilon: float

    def __call__(self, observations: torch.Tensor) -> torch.Tensor:
        q = self.features(observations).double() @ self.q_weights.T
        n_actions = q.shape[-1]
        greedy = torch.nn.functional.one_hot(q.argmax(-1), n_actions).double()
        return self.epsilon / n_actions + (1 - self.epsilon) * greedy


def uniform_policy(n_actions: int):
    def probabilities(observations: torch.Tensor) -> torch.Tensor:
        return torch.full((*observations.shape[:-1], n_actions), 1.0 / n_actions, dtype=torch.float64)

    return probabilities


@dataclass
class MountainCarProblem:
    """On- or off-policy evaluation in MountainCar-v0 from the logged behaviour; sample-based MSPBE on held-out data."""

    features: Any
    behaviour: EpsilonGreedyPolicy
    target_policy: Any  # None: on-policy
    gamma: float
    max_episode_steps: int
    heldout: int
    seed: int
    finite = False

    def __post_init__(self) -> None:
        from dporl.algos.lstd import td_statistics, td_terms

        data = self.sample(self.heldout, torch.Generator().manual_seed(self.seed + 7))
        self.stats = td_statistics(td_terms(self.features, data, self.target_policy, dtype=torch.float64), self.gamma,
                                   weighting="transition")
        self.reference_name = "lstd (non-private)" if self.target_policy is None else "wis-lstd (non-private)"

    def metrics(self, theta: torch.Tensor) -> dict[str, float]:
        return {"mspbe": float(mspbe(theta, self.stats)), "rmse": math.nan}

    def sample(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        """n behaviour episodes (MountainCar-v0, time limit = truncation), padded, with logged log-probabilities.

        The n environments step in lock-step; the policy is evaluated once per time step for all of them. The raw
        environment (no wrappers) is stepped and the time limit applied here, which is what TimeLimit does.
        """
        import gymnasium as gym
        import numpy as np

        seeds = torch.randint(0, 2**31 - 1, (n,), generator=generator).tolist()
        envs = [gym.make("MountainCar-v0").unwrapped for _ in range(n)]
        obs = np.stack([env.reset(seed=s)[0] for env, s in zip(envs, seeds)]).astype(np.float32)
        horizon = self.max_episode_steps
        observations = np.zeros((n, horizon + 1, obs.shape[1]), dtype=np.float32)
        actions = np.zeros((n, horizon), dtype=np.int64)
        rewards = np.zeros((n, horizon), dtype=np.float32)
        log_probs = np.zeros((n, horizon), dtype=np.float32)
        mask = np.zeros((n, horizon), dtype=bool)
        terminated = np.zeros(n, dtype=bool)
        observations[:, 0] = obs
        alive = np.ones(n, dtype=bool)
        for t in range(horizon):
            live = np.flatnonzero(alive)
            if live.size == 0:
                break
            probs = self.behaviour(torch.from_numpy(observations[live, t]))
            chosen = torch.multinomial(probs, 1, generator=generator).squeeze(1)
            log_probs[live, t] = torch.log(probs.gather(1, chosen.unsqueeze(1)).squeeze(1)).numpy()
            chosen = chosen.numpy()
            actions[live, t] = chosen
            mask[live, t] = True
            observations[:, t + 1] = observations[:, t]
            for i, a in zip(live.tolist(), chosen.tolist()):
                o, r, term, _, _ = envs[i].step(a)
                observations[i, t + 1], rewards[i, t] = o, r
                if term:
                    terminated[i], alive[i] = True, False
        for env in envs:
            env.close()
        width = max(1, int(mask.sum(1).max()))
        return {
            "observations": torch.from_numpy(observations[:, : width + 1]),
            "actions": torch.from_numpy(actions[:, :width]),
            "rewards": torch.from_numpy(rewards[:, :width]),
            "behavior_log_probs": torch.from_numpy(log_probs[:, :width]),
            "mask": torch.from_numpy(mask[:, :width]),
            "lengths": torch.from_numpy(mask.sum(1)),
            "terminated": torch.from_numpy(terminated),
        }


def mountain_car_problem(config: OPEConfig) -> MountainCarProblem:
    from dporl.envs.features import FourierBasis

    settings = config.mountain_car
    features = FourierBasis(settings.fourier_order, MOUNTAIN_CAR_LOW, MOUNTAIN_CAR_HIGH)
    q_weights = q_lambda_policy(settings, features, config.seed)
    behaviour = EpsilonGreedyPolicy(features, q_weights, settings.behaviour_epsilon)
    target = uniform_policy(int(q_weights.shape[0])) if settings.off_policy else None
    return MountainCarProblem(features, behaviour, target, config.gamma, settings.max_episode_steps,
                              settings.heldout_trajectories, config.seed)


# --------------------------------------------------------------------------------------------- HIV treatment
@dataclass
class CoordinateFeatures:
    """A feature map applied to some coordinates of the observation (``obs[..., coordinates]``)."""

    features: Any
    coordinates: list[int]

    def __post_init__(self) -> None:
        self.n_features = self.features.n_features

    def __call__(self, observations: torch.Tensor) -> torch.Tensor:
        return self.features(observations[..., self.coordinates])


@dataclass
class SoftmaxPolicy:
    """pi(a|s) = softmax(Q(s, .) / temperature) for a linear Q (weights [n_A, n])."""

    features: Any
    q_weights: torch.Tensor
    temperature: float

    def __call__(self, observations: torch.Tensor) -> torch.Tensor:
        q = self.features(observations).double() @ self.q_weights.T
        return torch.softmax(q / self.temperature, dim=-1)


def simulate_hiv(settings: HIVSettings, policy, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
    """n episodes from the unhealthy equilibrium under ``policy`` (obs -> action probabilities), padded, with
    logged log-probabilities; rewards in units of ``reward_scale``. All n patients advance in one batched
    simulator; episodes are truncated (never terminated) after ``horizon`` decisions."""
    import numpy as np

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
        probs = policy(observations[:, t])
        chosen = torch.multinomial(probs, 1, generator=generator).squeeze(1)
        log_probs[:, t] = torch.log(probs.gather(1, chosen.unsqueeze(1)).squeeze(1))
        actions[:, t] = chosen
        rewards[:, t] = torch.from_numpy(simulator.step(chosen.numpy(), rng=rng) / settings.reward_scale)
        observations[:, t + 1] = torch.from_numpy(simulator.observation())
    return {
        "observations": observations,
        "actions": actions,
        "rewards": rewards,
        "behavior_log_probs": log_probs,
        "mask": torch.ones(n, horizon, dtype=torch.bool),
        "lengths": torch.full((n,), horizon),
        "terminated": torch.zeros(n, dtype=torch.bool),
    }


@dataclass
class HIVProblem:
    """Off-policy evaluation of the fitted-Q greedy policy from its softmax behaviour's episodes; relative MSPBE
    (rewards in ``reward_scale`` units) on held-out behaviour data."""

    settings: HIVSettings
    features: Any
    behaviour: SoftmaxPolicy
    target_policy: Any
    gamma: float
    seed: int
    finite = False
    reference_name = "wis-lstd (non-private)"

    def __post_init__(self) -> None:
        from dporl.algos.lstd import td_statistics, td_terms

        data = self.sample(self.settings.heldout_trajectories, torch.Generator().manual_seed(self.seed + 7))
        self.stats = td_statistics(td_terms(self.features, data, self.target_policy, dtype=torch.float64), self.gamma,
                                   weighting="transition")

    def metrics(self, theta: torch.Tensor) -> dict[str, float]:
        # Rewards are already in reward_scale units, so this MSPBE is the relative MSPBE.
        return {"mspbe": float(mspbe(theta, self.stats)), "rmse": math.nan}

    def sample(self, n: int, generator: torch.Generator) -> dict[str, torch.Tensor]:
        return simulate_hiv(self.settings, self.behaviour, n, generator)


def hiv_q_weights(settings: HIVSettings, features, gamma: float, seed: int) -> torch.Tensor:
    """Linear fitted-Q weights [4, n] from uniform-random simulated episodes (public setup, no privacy cost)."""
    from dporl.algos.fitted_q import linear_fitted_q

    data = simulate_hiv(settings, uniform_policy(4), settings.fqi_patients, torch.Generator().manual_seed(seed + 3))
    observations = data["observations"]
    return linear_fitted_q(
        features(observations[:, :-1]).reshape(-1, features.n_features),
        data["actions"].reshape(-1),
        data["rewards"].reshape(-1),
        features(observations[:, 1:]).reshape(-1, features.n_features),
        torch.ones(data["actions"].numel()),  # truncated episodes: every next state bootstraps
        n_actions=4, gamma=gamma, iterations=settings.fqi_iterations, ridge=settings.fqi_ridge,
    )


def hiv_problem(config: OPEConfig) -> HIVProblem:
    from dporl.envs.features import FourierBasis

    settings = config.hiv
    features = CoordinateFeatures(FourierBasis(settings.fourier_order, settings.low, settings.high),
                                  list(settings.coordinates))
    q_weights = hiv_q_weights(settings, features, config.gamma, config.seed)
    behaviour = SoftmaxPolicy(features, q_weights, settings.behaviour_temperature)
    target = EpsilonGreedyPolicy(features, q_weights, 0.0)  # greedy w.r.t. the fitted Q
    return HIVProblem(settings, features, behaviour, target, config.gamma, config.seed)


def build_problem(config: OPEConfig):
    if config.experiment == "chain":
        return chain_problem(config)
    return mountain_car_problem(config) if config.experiment == "mountain_car" else hiv_problem(config)


# --------------------------------------------------------------------------------------------- one release each
def _generator(*keys: int) -> torch.Generator:
    return torch.Generator().manual_seed(hash(tuple(keys)) % 2**62)


def _noise_seed(config: OPEConfig, *keys: int) -> Optional[int]:
    return None if config.noise_seed is None else hash((config.noise_seed, *keys)) % 2**62


def run_gpope(
    config: OPEConfig, problem: FiniteProblem, data: dict, step_size: float, clip_norm: float, run_dir: Path,
    noise_seed: Optional[int], run_info: dict,
) -> dict[str, Any]:
    """One private GPOPE release through the Trainer; returns its metrics and privacy figures."""
    settings = config.gpope
    m = int(data["mask"].shape[0])
    units = torch.arange(m)
    if settings.mode == "poisson":
        rate = min(1.0, settings.expected_batch_size / m)
        source = PoissonUnitSource(data, units, m, sample_rate=rate)  # one row = one padded trajectory
        steps = max(1, round(settings.epochs / rate))  # N = epochs * m / expected batch
    else:
        source = FixedSizeSource(data, units, m, sample_size=1)
        steps = max(1, round(settings.epochs * m))
    if settings.noise_multiplier is not None:  # N for (sigma, epsilon, delta): the most steps the budget allows
        steps = max_steps(source.step_event(settings.noise_multiplier), config.epsilon, config.delta,
                          mechanism=settings.accountant)
        if steps == 0:
            raise ValidationError("gpope.noise_multiplier", f"not one step fits epsilon={config.epsilon} at this noise")
    ledger = PrivacyLedger()
    ledger.stage("train", budget=(config.epsilon, config.delta), mechanism=settings.accountant, unit="trajectory")
    module = GPOPE(problem.features, GPOPEConfig(gamma=config.gamma), target_policy=problem.target_policy)
    trainer = Trainer(
        module,
        source,
        config=TrainerConfig(
            max_steps=steps, seed=run_info.get("trial", 0), log_every=max(1, steps // 20), eval_every=steps,
            checkpoint_every=steps, journal_every=max(50, steps // 20), progress=False,
            optimizer=OptimizerConfig(
                name="sgd", lr=step_size, schedule=settings.schedule, time_offset=settings.time_offset
            ),
        ),
        dp=DPConfig(
            epsilon=config.epsilon, delta=config.delta, noise_multiplier=settings.noise_multiplier,
            max_grad_norm=clip_norm, accountant=settings.accountant,
            clipping="naive", noise_seed=noise_seed,
        ),
        ledger=ledger,
        run_dir=run_dir,
        pipeline="ope",
        pipeline_config={"ope": to_dict(config), **run_info, "step_size": step_size, "clip_norm": clip_norm},
        evaluators={"ope": lambda mod: problem.metrics(mod.theta.detach())},
    )
    result = trainer.fit()
    out = {**problem.metrics(module.theta.detach()), "epsilon": ledger.spent("train"), "steps": result.steps,
           "noise_multiplier": result.noise_multiplier}
    if settings.mode == "paper":
        out["paper_lemma1_epsilon"] = paper_lemma1_epsilon(result.noise_multiplier, m, result.steps, config.delta)
    return out


def run_output_perturbation(
    method: str, config: OPEConfig, problem: FiniteProblem, data: dict, lambda_scale: float, noise_seed: Optional[int]
) -> dict[str, Any]:
    """One DP-LSW or DP-LSL release (smooth sensitivity), recorded in its own ledger stage."""
    settings = config.output_perturbation
    bound = settings.return_bound if settings.return_bound is not None else problem.reward_max / (1 - config.gamma)
    n_states = problem.feature_matrix.shape[0]
    visits = first_visit_returns(data, n_states, config.gamma, bound)
    noise = NoiseSource(noise_seed)
    if method == "dp_lsw":
        release = dp_lsw(visits, problem.feature_matrix, epsilon=config.epsilon, delta=config.delta,
                         return_bound=bound, noise=noise)
    else:
        lam = lambda_scale * math.sqrt(visits.n_trajectories)
        release = dp_lsl(visits, problem.feature_matrix, epsilon=config.epsilon, delta=config.delta,
                         return_bound=bound, lam=lam, noise=noise)
    ledger = PrivacyLedger()
    # An (epsilon, delta) release has no RDP curve; PLD reproduces its epsilon (to float rounding).
    ledger.stage(method, mechanism="pld", unit="trajectory", delta=config.delta,
                 analysis="smooth-sensitivity Gaussian output perturbation (Balle et al. 2016)")
    ledger.record(method, release.event())
    return {**problem.metrics(release.theta), "epsilon": ledger.spent(method)}


def _lsl_lambda_scale(config: OPEConfig, problem: FiniteProblem, public: dict, m: int) -> float:
    settings = config.output_perturbation
    if settings.lsl_lambda_scale is not None:
        return settings.lsl_lambda_scale
    # lambda must exceed ||Phi||^2 ||rho||_inf; grid values that do not are skipped.
    floor = float(torch.linalg.matrix_norm(problem.feature_matrix, ord=2)) ** 2
    scores = {}
    for scale in settings.lsl_lambda_grid:
        if scale * math.sqrt(m) > floor:
            scores[scale] = run_output_perturbation("dp_lsl", config, problem, public, scale, None)["mspbe"]
    if not scores:
        raise ValidationError(
            "output_perturbation.lsl_lambda_grid", f"no lambda exceeds ||Phi||^2 = {floor:g} at m={m}"
        )
    return min(scores, key=scores.get)


# --------------------------------------------------------------------------------------------- the experiment
def run(config: OPEConfig, mode: RunMode = "new") -> dict[str, Any]:
    from tqdm.auto import tqdm

    torch.set_num_threads(1)
    run_dir = Path(config.run_dir)
    directory = RunDirectory(run_dir, pipeline="ope", config=to_dict(config), mode=mode)
    problem = build_problem(config)
    directory.begin()  # each GPOPE release below is a Trainer run directory of its own under run_dir
    gp = config.gpope
    op_methods = config.output_perturbation.methods if problem.finite else []
    rows: list[dict[str, Any]] = []
    tuned: dict[int, dict[str, float]] = {}
    step_grid = gp.step_size_grid if gp.step_size is None else [gp.step_size]
    clip_grid = gp.clip_norm_grid if gp.clip_norm is None else [gp.clip_norm]
    grid = [(lr, h) for lr in step_grid for h in clip_grid] if len(step_grid) * len(clip_grid) > 1 else []
    n_jobs = len(config.m_values) * (len(grid) + config.trials * len(gp.step_size_multipliers))
    progress = tqdm(total=n_jobs, desc=f"ope {config.experiment}", unit="run", disable=not config.progress, dynamic_ncols=True)
    for m in config.m_values:
        # Hyper-parameters come from an independent public dataset of the same size (never the private one).
        public = problem.sample(m, _generator(config.seed, m, -1))
        step_size, clip_norm = step_grid[0], clip_grid[0]
        if grid:
            scores = {}
            for k, (lr, h) in enumerate(grid):
                result = run_gpope(config, problem, public, lr, h, run_dir / f"m{m}" / "tuning" / f"run{k}",
                                   _noise_seed(config, m, -1, k), {"m": m, "trial": -1})
                scores[(lr, h)] = result["mspbe"]
                progress.update(1)
            step_size, clip_norm = min(scores, key=scores.get)
        lambda_scale = _lsl_lambda_scale(config, problem, public, m) if "dp_lsl" in op_methods else 0.0
        tuned[m] = {"step_size": step_size, "clip_norm": clip_norm, "lsl_lambda_scale": lambda_scale}
        for trial in range(config.trials):
            data = problem.sample(m, _generator(config.seed, m, trial))
            reference = problem.metrics(lstd(problem.features, data, config.gamma, target_policy=problem.target_policy))
            rows.append({"method": problem.reference_name, "m": m, "trial": trial, **reference, "epsilon": math.inf})
            # The data-free estimate: a private method above this line has learnt nothing useful.
            zero = problem.metrics(torch.zeros(problem.features.n_features, dtype=torch.float64))
            rows.append({"method": "theta = 0 (no data)", "m": m, "trial": trial, **zero, "epsilon": 0.0})
            for k, multiplier in enumerate(gp.step_size_multipliers):
                result = run_gpope(
                    config, problem, data, step_size * multiplier, clip_norm,
                    run_dir / f"m{m}" / f"trial{trial}" / f"gpope_x{multiplier:g}",
                    _noise_seed(config, m, trial, k), {"m": m, "trial": trial, "multiplier": multiplier},
                )
                rows.append({"method": f"gpope ({multiplier:g}x step)", "m": m, "trial": trial, **result})
                progress.update(1)
            for j, method in enumerate(op_methods):
                result = run_output_perturbation(method, config, problem, data, lambda_scale,
                                                 _noise_seed(config, m, trial, 100 + j))
                rows.append({"method": method, "m": m, "trial": trial, **result})
    progress.close()
    # The tables hold non-private references (LSTD on the private data): curator-only.
    return _write_results(config, directory.curator, rows, tuned)


def _aggregate(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    table = []
    for method in dict.fromkeys(r["method"] for r in rows):
        for m in sorted({r["m"] for r in rows if r["method"] == method}):
            group = [r for r in rows if r["method"] == method and r["m"] == m]
            entry: dict[str, Any] = {"method": method, "m": m, "trials": len(group)}
            for key in ("mspbe", "rmse"):
                values = torch.tensor([r[key] for r in group], dtype=torch.float64)
                entry[f"{key}_mean"] = float(values.mean())
                entry[f"{key}_std"] = float(values.std()) if len(group) > 1 else 0.0
            entry["epsilon"] = max(r["epsilon"] for r in group)
            if "paper_lemma1_epsilon" in group[0]:
                entry["paper_lemma1_epsilon"] = max(r["paper_lemma1_epsilon"] for r in group)
            table.append(entry)
    return table


def _write_results(config: OPEConfig, run_dir: Path, rows: list[dict[str, Any]], tuned: dict) -> dict[str, Any]:
    table = _aggregate(rows)
    columns = ["method", "m", "trials", "mspbe_mean", "mspbe_std", "rmse_mean", "rmse_std", "epsilon"]
    csv = [",".join(columns)] + [",".join(str(entry[c]) for c in columns) for entry in table]
    atomic_write_text(run_dir / "results.csv", "\n".join(csv) + "\n")
    unit = "trajectory"
    ran_output_perturbation = any(r["method"] in config.output_perturbation.methods for r in rows)
    gp_analysis = (
        analysis_name(config.gpope.accountant)
        + (", Poisson sampling, add/remove one trajectory" if config.gpope.mode == "poisson"
           else ", sampling without replacement, replace one trajectory")
    )
    if config.experiment == "chain":
        setting = f"Chain ({config.chain.n_states} states, p={config.chain.stay_probability}, gamma={config.gamma})"
    elif config.experiment == "mountain_car":
        policy = "off-policy, target uniform" if config.mountain_car.off_policy else "on-policy"
        setting = f"MountainCar-v0 ({policy}, Fourier order {config.mountain_car.fourier_order}, gamma={config.gamma})"
    else:
        hiv = config.hiv
        setting = (f"HIV treatment (off-policy: target greedy fitted-Q, behaviour softmax T={hiv.behaviour_temperature};"
                   f" {hiv.horizon} x {hiv.treatment_interval:g} days, Fourier order {hiv.fourier_order} on log10 state"
                   f" coordinates {hiv.coordinates}, gamma={config.gamma}; MSPBE relative to reward scale"
                   f" {hiv.reward_scale:g})")
    lines = [
        f"# {setting}: MSPBE vs m at epsilon={config.epsilon}, delta={config.delta}, privacy unit: {unit}",
        "",
        f"GPOPE: {gp_analysis}."
        + (f" DP-LSW / DP-LSL: {SMOOTH_SENSITIVITY}, replace one trajectory." if ran_output_perturbation else ""),
        "",
        "| method | m | trials | MSPBE (mean +- std) | RMSE (mean +- std) | epsilon |",
        "|---|---|---|---|---|---|",
    ]
    for e in table:
        eps = "n/a (not private)" if math.isinf(e["epsilon"]) else f"{e['epsilon']:.4g}"
        lines.append(f"| {e['method']} | {e['m']} | {e['trials']} | {e['mspbe_mean']:.3e} +- {e['mspbe_std']:.1e} | "
                     f"{e['rmse_mean']:.3e} +- {e['rmse_std']:.1e} | {eps} |")
    paper = [e for e in table if "paper_lemma1_epsilon" in e]
    if paper:
        lines += ["", "The paper's Lemma 1 moments bound for the same runs (the paper's figure, NOT dporl's guarantee): "
                  + ", ".join(f"m={e['m']} ({e['method']}): eps={e['paper_lemma1_epsilon']:.4g}" for e in paper)]
    lines += ["", "Tuned on public data: " + ", ".join(
        f"m={m}: step size {v['step_size']:g}, clip norm {v['clip_norm']:g}"
        + (f", DP-LSL lambda scale {v['lsl_lambda_scale']:g}" if v["lsl_lambda_scale"] else "")
        for m, v in tuned.items())]
    atomic_write_text(run_dir / "results.md", "\n".join(lines) + "\n")
    mspbe_label = "relative MSPBE" if config.experiment == "hiv" else "MSPBE"
    for key, label in (("mspbe", mspbe_label), ("rmse", "RMSE")):
        series = {}
        for method in dict.fromkeys(e["method"] for e in table):
            picked = [e for e in table
                      if e["method"] == method and math.isfinite(e[f"{key}_mean"]) and e[f"{key}_mean"] > 0]
            if picked:
                series[method] = ([e["m"] for e in picked], [e[f"{key}_mean"] for e in picked], None)
        if not series:  # e.g. no RMSE without closed-form values (Mountain Car)
            continue
        plot_lines(run_dir / f"{key}_vs_m.png", series, xlabel="trajectories m", ylabel=label, logx=True, logy=True,
                   title=f"{config.experiment}, epsilon={config.epsilon}, delta={config.delta}")
    summary = {"config": to_dict(config), "table": table, "tuned": {str(k): v for k, v in tuned.items()},
               "privacy_unit": unit, "gpope_analysis": gp_analysis, "output_perturbation_analysis": SMOOTH_SENSITIVITY}
    atomic_write_json(run_dir / "summary.json", summary)
    return {"run_dir": str(run_dir), "table": table, "tuned": summary["tuned"]}


def evaluate(payload: dict[str, Any], episodes: int, seed: int, out_dir: Path) -> dict[str, Any]:
    """Metrics of the value estimate a GPOPE checkpoint released, on its environment (exact for the chain)."""
    from dporl.utils.config import from_dict

    stored = payload.get("config", {})
    if "ope" not in stored or "theta" not in payload.get("algorithm", {}):
        raise ValidationError("checkpoint", "not a GPOPE checkpoint of the 'ope' pipeline")
    config = from_dict(OPEConfig, stored["ope"])
    problem = build_problem(config)
    metrics = {**problem.metrics(payload["algorithm"]["theta"]), "m": stored.get("m"), "trial": stored.get("trial"),
               "steps": payload.get("step")}
    atomic_write_json(Path(out_dir) / "ope_eval.json", metrics)
    return metrics


register(Pipeline("ope", OPEConfig, run, evaluate))
