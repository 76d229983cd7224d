"""Policies of the OPE problems: callables obs [..., d] -> action probabilities [..., n_actions] (public, fixed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class _LinearQPolicy:
    """A policy of a linear Q: Q(s, .) = features(s) @ q_weights.T (weights [n_A, n])."""

    features: Any
    q_weights: torch.Tensor

    def q_values(self, observations: torch.Tensor) -> torch.Tensor:
        return self.features(observations).double() @ self.q_weights.T


@dataclass
class EpsilonGreedyPolicy(_LinearQPolicy):
    """pi(a|s) = eps / n_A + (1 - eps) [a = argmax_a Q(s, a)]."""

    epsilon: float

    def __call__(self, observations: torch.Tensor) -> torch.Tensor:
        q = self.q_values(observations)
        n_actions = q.shape[-1]
        greedy = torch.nn.functional.one_hot(q.argmax(-1), n_actions).double()
        return self.epsilon / n_actions + (1 - self.epsilon) * greedy


@dataclass
class SoftmaxPolicy(_LinearQPolicy):
    """pi(a|s) = softmax(Q(s, .) / temperature)."""

    temperature: float

    def __call__(self, observations: torch.Tensor) -> torch.Tensor:
        return torch.softmax(self.q_values(observations) / self.temperature, dim=-1)


def uniform_policy(n_actions: int):
    def probabilities(observations: torch.Tensor) -> torch.Tensor:
        return torch.full((*observations.shape[:-1], n_actions), 1.0 / n_actions, dtype=torch.float64)

    return probabilities


def sample_actions(policy, observations: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(actions [B], their log-probabilities [B]) drawn from ``policy`` at observations [B, d], in one call."""
    probs = policy(observations)
    chosen = torch.multinomial(probs, 1, generator=generator).squeeze(1)
    return chosen, torch.log(probs.gather(1, chosen.unsqueeze(1)).squeeze(1))
