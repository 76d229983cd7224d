"""Policies of the OPE problems: callables obs [..., d] -> action probabilities [..., n_actions] (public, fixed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


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


@dataclass
class SoftmaxPolicy:
    """pi(a|s) = softmax(Q(s, .) / temperature) for a linear Q (weights [n_A, n])."""

    features: Any
    q_weights: torch.Tensor
    temperature: float

    def __call__(self, observations: torch.Tensor) -> torch.Tensor:
        q = self.features(observations).double() @ self.q_weights.T
        return torch.softmax(q / self.temperature, dim=-1)


def uniform_policy(n_actions: int):
    def probabilities(observations: torch.Tensor) -> torch.Tensor:
        return torch.full((*observations.shape[:-1], n_actions), 1.0 / n_actions, dtype=torch.float64)

    return probabilities


def sample_actions(policy, observations: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(actions [B], their log-probabilities [B]) drawn from ``policy`` at observations [B, d], in one call."""
    probs = policy(observations)
    chosen = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return chosen, torch.log(probs.gather(1, chosen.unsqueeze(1)).squeeze(1))
