"""The 40-state chain of Xie, Thomas, Miklau (2019) and Balle et al. (2016) as an OPE problem with exact truth.

On-policy (one action), tabular features. Metrics are exact: the MSPBE under the on-policy distribution (expected
visits from the uniform start, the paper's definition) and the RMSE against the closed-form values over the
non-absorbing states. DP-LSW's public regression weights are 1 on every state a trajectory can visit and 0 on the
absorbing state, which ends the episode and is never the origin of a transition (Balle et al.'s Corollary 11).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from dporl.data.dataset import DatasetMetadata, TrajectoryDataset
from dporl.eval.ope_metrics import exact_td_statistics, mspbe, on_policy_distribution, rmse
from dporl.utils.validation import ValidationError, check_probability


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
class FiniteMRPProblem:
    """A finite Markov reward process (the target policy's) with public features, exact statistics and values."""

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
    env_id: str = "dporl/Chain-v0"
    target_policy = None  # on-policy
    weightings = ("transition",)
    metric_labels = {"mspbe": "exact MSPBE (on-policy distribution)", "rmse": "RMSE vs the true values"}

    def __post_init__(self) -> None:
        expected_reward = (self.transitions * self.step_rewards).sum(1)
        self.distribution = on_policy_distribution(self.transitions, self.start)
        self.stats = exact_td_statistics(
            self.feature_matrix, self.transitions, expected_reward, self.distribution, self.gamma
        )
        self.n_states = int(self.feature_matrix.shape[0])
        # Public: states of zero visit probability (terminal ones) get no DP-LSW weight.
        self.lsw_weights = (self.distribution > 0).double()

    def metrics(self, theta: torch.Tensor) -> dict[str, float]:
        values = self.feature_matrix @ theta.double()
        return {
            "mspbe": float(mspbe(theta, self.stats)),
            "rmse": float(rmse(values[self.scored_states], self.true_values[self.scored_states])),
        }

    def sample(self, n: int, generator: torch.Generator) -> TrajectoryDataset:
        """n trajectories (observations hold the state index), simulated for all n at once."""
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
        return TrajectoryDataset.from_padded(
            observations=torch.stack(visited, 1).unsqueeze(-1).float(),
            actions=torch.zeros(mask.shape, dtype=torch.long),
            rewards=torch.stack(rewards, 1).float() * mask,
            mask=mask,
            terminated=~alive[-1],
            metadata=DatasetMetadata(env_id=self.env_id, n_actions=1, n_units=1, obs_shape=(1,)),
        )


def chain_problem(settings: ChainSettings, gamma: float) -> FiniteMRPProblem:
    from dporl.envs.chain import chain_transition_matrix, chain_true_values
    from dporl.envs.features import TabularFeatures

    n, p = settings.n_states, settings.stay_probability
    transitions = torch.as_tensor(chain_transition_matrix(n, p), dtype=torch.float64).clone()
    transitions[n - 1] = 0.0  # the absorbing state ends the episode
    step_rewards = torch.zeros(n, n, dtype=torch.float64)
    step_rewards[: n - 1, n - 1] = 1.0  # reward 1 on entering the absorbing state
    start = torch.ones(n, dtype=torch.float64)
    start[n - 1] = 0.0
    features = TabularFeatures(n)
    states = torch.arange(n, dtype=torch.float32).unsqueeze(1)
    return FiniteMRPProblem(
        features=features,
        feature_matrix=features(states).double(),
        transitions=transitions,
        step_rewards=step_rewards,
        start=start / start.sum(),
        true_values=torch.as_tensor(chain_true_values(n, p, gamma), dtype=torch.float64),
        scored_states=torch.arange(n - 1),
        gamma=gamma,
        reward_max=1.0,
        max_episode_steps=settings.max_episode_steps,
    )
