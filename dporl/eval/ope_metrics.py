"""Accuracy of a value estimate V = Phi theta: MSPBE (exact or sample-based), relative MSPBE, RMSE.

MSPBE(theta) = (b - A theta)^T C^+ (b - A theta) with A = E[rho phi (phi - gamma phi')^T], b = E[rho r phi],
C = E[phi phi^T] under the behaviour distribution. C^+ is the pseudo-inverse: feature directions the data never
excites (e.g. the one-hot feature of an absorbing state) carry no projected Bellman error.

Finite MDPs: exact statistics from the target policy's transition matrix P (substochastic over the non-terminal
states: the missing mass is termination), the expected reward r and a state distribution d (the on-policy
distribution: normalised expected visits from the start distribution). Otherwise: sample statistics of a large
held-out set of trajectories (``dporl.algos.lstd.td_statistics``). Everything here reads only the released theta and
public or held-out evaluation data: post-processing, no privacy cost.
"""

from __future__ import annotations

from typing import Optional

import torch

from dporl.algos.lstd import LinearTDStatistics
from dporl.utils.validation import ValidationError, check_positive, check_probability


def on_policy_distribution(transitions: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
    """Normalised expected number of transitions from each state: d proportional to start^T (I - P)^{-1}.

    ``transitions`` [S, S] is substochastic (rows of terminal states are zero), so the series converges. Arriving
    in a terminal state ends the episode without a transition from it, so terminal states get weight 0.
    """
    P = torch.as_tensor(transitions, dtype=torch.float64)
    mu = torch.as_tensor(start, dtype=torch.float64)
    if P.dim() != 2 or P.shape[0] != P.shape[1] or mu.shape != (P.shape[0],):
        raise ValidationError("transitions", f"need P [S, S] and start [S], got {tuple(P.shape)}, {tuple(mu.shape)}")
    visits = torch.linalg.solve((torch.eye(P.shape[0], dtype=torch.float64) - P).T, mu)
    visits = visits * (P.sum(1) > 0)
    return visits / visits.sum()


def exact_td_statistics(
    features: torch.Tensor, transitions: torch.Tensor, rewards: torch.Tensor, distribution: torch.Tensor, gamma: float
) -> LinearTDStatistics:
    """A = Phi^T D (Phi - gamma P Phi'), b = Phi^T D r, C = Phi^T D Phi for a finite MDP under the target policy.

    Phi' is Phi with the rows of terminal states (zero rows of P) set to 0: phi(terminal) = 0.

    ``features`` [S, n]; ``transitions`` [S, S] the target policy's (substochastic) transition matrix;
    ``rewards`` [S] expected one-step reward under the target policy; ``distribution`` [S] the state weighting d.
    With d the behaviour distribution this is the off-policy (importance-corrected) expectation.
    """
    check_probability("gamma", gamma)
    Phi = torch.as_tensor(features, dtype=torch.float64)
    P = torch.as_tensor(transitions, dtype=torch.float64)
    r = torch.as_tensor(rewards, dtype=torch.float64)
    d = torch.as_tensor(distribution, dtype=torch.float64)
    n_states = Phi.shape[0]
    if P.shape != (n_states, n_states) or r.shape != (n_states,) or d.shape != (n_states,):
        raise ValidationError("transitions", "features, transitions, rewards and distribution disagree on the states")
    weighted = d.unsqueeze(1) * Phi
    # phi(terminal) = 0 as in the sampled statistics: a transition into a terminal state (zero row) bootstraps 0.
    next_features = Phi * (P.sum(1) > 0).unsqueeze(1)
    A = weighted.T @ (Phi - gamma * (P @ next_features))
    return LinearTDStatistics(A, weighted.T @ r, weighted.T @ Phi)


def mspbe(theta: torch.Tensor, stats: LinearTDStatistics) -> torch.Tensor:
    """(b - A theta)^T C^+ (b - A theta); ``theta`` [n] or a batch [K, n] (returns [] or [K])."""
    theta = torch.as_tensor(theta, dtype=torch.float64)
    A, b, C = stats.A.double(), stats.b.double(), stats.C.double()
    residual = b - theta @ A.T  # [..., n]
    solved = residual @ torch.linalg.pinv(C, hermitian=True)
    return (solved * residual).sum(-1)


def relative_mspbe(theta: torch.Tensor, stats: LinearTDStatistics, reward_scale: float) -> torch.Tensor:
    """MSPBE divided by the squared reward scale (the HIV experiment's ~1e5 mean reward), so domains compare."""
    check_positive("reward_scale", reward_scale)
    return mspbe(theta, stats) / reward_scale**2


def rmse(values: torch.Tensor, true_values: torch.Tensor, weights: Optional[torch.Tensor] = None) -> torch.Tensor:
    """Root mean squared error over states (last dim), optionally weighted by a state distribution."""
    values = torch.as_tensor(values, dtype=torch.float64)
    true_values = torch.as_tensor(true_values, dtype=torch.float64)
    if values.shape[-1] != true_values.shape[-1]:
        raise ValidationError("values", f"{values.shape[-1]} states vs {true_values.shape[-1]} true values")
    squared = (values - true_values) ** 2
    if weights is None:
        return squared.mean(-1).sqrt()
    weights = torch.as_tensor(weights, dtype=torch.float64)
    return ((squared * weights).sum(-1) / weights.sum()).sqrt()


def monte_carlo_values(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """Discounted return of each rollout [K, L] (rewards zero-padded past ``mask``): the ground truth for V(s_0).

    Rollouts must run to termination (or long enough that gamma^L is negligible) from the states being scored.
    """
    check_probability("gamma", gamma)
    discounts = gamma ** torch.arange(rewards.shape[1], dtype=torch.float64)
    return ((rewards.double() * mask.double()) * discounts).sum(1)
