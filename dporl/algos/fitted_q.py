"""Batched linear fitted Q-iteration (Ernst et al. 2005 with a linear regressor): public policy construction.

Q(s, a) = W[a] . phi(s). Each iteration regresses the Bellman targets r + gamma max_a' Q(s', a') (0 after a
terminal transition) on phi(s), separately for every action, by ridge regression. The per-action Gram matrices
do not change between iterations, so they are factorised once (Cholesky) and every iteration costs one batched
matrix product and one batched triangular solve: no Python loop over transitions or actions.

Used on simulated (public) data to build target and behaviour policies for off-policy evaluation experiments;
it touches no private data, so it has no privacy cost.
"""

from __future__ import annotations

import torch

from dporl.utils.validation import ValidationError, check_positive, check_probability


def linear_fitted_q(
    phi: torch.Tensor,
    actions: torch.Tensor,
    rewards: torch.Tensor,
    phi_next: torch.Tensor,
    continues: torch.Tensor,
    *,
    n_actions: int,
    gamma: float,
    iterations: int,
    ridge: float = 1e-3,
) -> torch.Tensor:
    """Q-weights ``[n_actions, n]`` from flat transitions.

    ``phi`` / ``phi_next`` [T, n] features of s and s'; ``actions`` [T] in [0, n_actions); ``rewards`` [T];
    ``continues`` [T] 1 where s' is not terminal (truncation at a time limit still bootstraps), else 0.
    ``ridge`` is added to every action's Gram matrix (also keeps an action never taken solvable: its weights
    stay 0).
    """
    phi, phi_next = phi.double(), phi_next.double()
    n_transitions, n_features = phi.shape
    if phi_next.shape != phi.shape or actions.shape != (n_transitions,) or rewards.shape != (n_transitions,) \
            or continues.shape != (n_transitions,):
        raise ValidationError("phi", "phi, phi_next [T, n] and actions, rewards, continues [T] must agree on T")
    if n_transitions and (actions.min() < 0 or actions.max() >= n_actions):
        raise ValidationError("actions", f"must lie in [0, {n_actions})")
    check_probability("gamma", gamma)
    check_positive("ridge", ridge)
    if int(iterations) != iterations or iterations < 1:
        raise ValidationError("iterations", f"must be a positive integer, got {iterations!r}")
    chosen = torch.nn.functional.one_hot(actions.long(), n_actions).double()  # [T, A]
    gram = torch.einsum("ta,ti,tj->aij", chosen, phi, phi) + ridge * torch.eye(n_features, dtype=torch.float64)
    factor = torch.linalg.cholesky(gram)  # [A, n, n]
    weights = torch.zeros(n_actions, n_features, dtype=torch.float64)
    bootstrap = gamma * continues.double()
    rewards = rewards.double()
    for _ in range(int(iterations)):
        targets = rewards + bootstrap * (phi_next @ weights.T).max(-1).values  # [T]
        rhs = torch.einsum("ta,ti,t->ai", chosen, phi, targets).unsqueeze(-1)  # [A, n, 1]
        weights = torch.cholesky_solve(rhs, factor).squeeze(-1)
    return weights
