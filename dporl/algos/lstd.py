"""Linear TD building blocks shared by GPOPE, LSTD and the OPE metrics; LSTD and WIS-LSTD (non-private baselines).

Trajectories arrive padded (``TrajectoryDataset.padded()`` as a dict, or any dict with the same keys):
observations ``[N, L+1, *obs]``, actions / rewards / behavior_log_probs ``[N, L]``, mask ``[N, L]``, terminated
``[N]``. ``td_terms`` turns them into feature tensors once:

    phi_t      = phi(s_t)                                  [N, L, n]
    phi_next_t = phi(s_{t+1}), or 0 when s_{t+1} is terminal (the last step of a terminated episode)
    rho_t      = pi(a_t | s_t) / pi_b(a_t | s_t)           (1 on-policy)

and every estimator below is a tensor contraction over them (no Python loop over trajectories).

Two weightings of the expectations A = E[rho phi (phi - gamma phi')^T], b = E[rho phi r], C = E[phi phi^T]:
``"trajectory"`` averages each trajectory's transitions first (A_i = 1/tau_i sum_t ...), then trajectories: the
expectation GPOPE's stochastic gradients are unbiased for; ``"transition"`` pools all transitions (classic LSTD).
In the tabular case both have the same fixed point in expectation (the true values).

WIS-LSTD: with rho multiplying the whole term rho_t phi_t (phi_t - gamma phi_{t+1})^T, the least-squares TD
solution is the weighted-importance-sampling LSTD of Mahmood, van Hasselt and Sutton (2014) at lambda = 0: in the
tabular case V(s) = sum rho (r + gamma V(s')) / sum rho over visits of s, the weighted-IS average.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal, Mapping, Optional

import torch

from dporl.utils.validation import ValidationError, check_probability

FeatureMap = Callable[[torch.Tensor], torch.Tensor]  # obs [..., d] -> features [..., n], with .n_features
TargetPolicy = Callable[[torch.Tensor], torch.Tensor]  # obs [..., d] -> action probabilities [..., n_actions]
Weighting = Literal["trajectory", "transition"]


@dataclass
class TDTerms:
    """Per-transition ingredients of linear TD on padded trajectories (padding rows are zero in every tensor)."""

    phi: torch.Tensor  # [N, L, n]
    phi_next: torch.Tensor  # [N, L, n], zero after a terminal transition
    rho: torch.Tensor  # [N, L] importance ratios, zero on padding
    rewards: torch.Tensor  # [N, L], zero on padding
    mask: torch.Tensor  # [N, L] float 0/1
    lengths: torch.Tensor  # [N] float, number of real transitions (>= 1)

    @property
    def n_features(self) -> int:
        return int(self.phi.shape[-1])


def importance_ratios(
    data: Mapping[str, torch.Tensor], target_policy: Optional[TargetPolicy], dtype: torch.dtype
) -> torch.Tensor:
    """rho_t = pi(a_t | s_t) / pi_b(a_t | s_t) from logged behaviour log-probabilities (1 on-policy)."""
    mask = data["mask"].to(dtype)
    if target_policy is None:
        return mask
    if data.get("behavior_log_probs") is None:
        raise ValidationError(
            "behavior_log_probs", "off-policy evaluation needs the logged behaviour log-probabilities of every action"
        )
    observations = data["observations"][:, :-1]
    probs = target_policy(observations)
    if probs.shape[:2] != data["actions"].shape:
        raise ValidationError("target_policy", f"returned shape {tuple(probs.shape)} for {tuple(observations.shape)}")
    target = probs.gather(-1, data["actions"].long().clamp_min(0).unsqueeze(-1)).squeeze(-1).to(dtype)
    behaviour = data["behavior_log_probs"].to(dtype).masked_fill(~data["mask"].bool(), 0.0)
    return target * torch.exp(-behaviour) * mask


def td_terms(
    features: FeatureMap,
    data: Mapping[str, torch.Tensor],
    target_policy: Optional[TargetPolicy] = None,
    dtype: torch.dtype = torch.float32,
) -> TDTerms:
    """Features, next features (zeroed at terminal states), importance ratios and rewards of padded trajectories."""
    valid = data["mask"].bool()
    mask = valid.to(dtype)
    n_traj, horizon = mask.shape
    obs = data["observations"]
    if obs.shape[:2] != (n_traj, horizon + 1):
        raise ValidationError(
            "observations", f"expected [N, L+1, ...] = [{n_traj}, {horizon + 1}, ...], got {tuple(obs.shape)}"
        )
    lengths = mask.sum(1)
    if n_traj and lengths.min() < 1:
        raise ValidationError("mask", "every trajectory needs at least one transition")
    phi_all = features(obs).to(dtype)  # [N, L+1, n]
    # s_{t+1} is a real non-terminal state if step t+1 exists, or if t is the last step of a truncated (not
    # terminated) episode, which bootstraps from its last observation. Otherwise phi(s_{t+1}) = 0.
    later = torch.nn.functional.pad(valid[:, 1:], (0, 1))
    next_valid = later | (valid & ~data["terminated"].bool().unsqueeze(1))
    phi = phi_all[:, :-1] * mask.unsqueeze(-1)
    phi_next = phi_all[:, 1:] * next_valid.unsqueeze(-1).to(dtype)
    rho = importance_ratios(data, target_policy, dtype)
    rewards = data["rewards"].to(dtype) * mask
    return TDTerms(phi, phi_next, rho, rewards, mask, lengths)


def _transition_weights(terms: TDTerms, weighting: Weighting) -> torch.Tensor:
    """Weight of each transition in the expectations: 1/(N tau_i) per trajectory, or 1/(total transitions)."""
    if weighting == "trajectory":
        return terms.mask / (terms.lengths.unsqueeze(1) * terms.mask.shape[0])
    if weighting == "transition":
        return terms.mask / terms.mask.sum()
    raise ValidationError("weighting", f"must be 'trajectory' or 'transition', got {weighting!r}")


@dataclass
class LinearTDStatistics:
    """Sample (or exact) A, b, C of linear TD; MSPBE(theta) = (b - A theta)^T C^+ (b - A theta)."""

    A: torch.Tensor  # [n, n]
    b: torch.Tensor  # [n]
    C: torch.Tensor  # [n, n]


def td_statistics(terms: TDTerms, gamma: float, weighting: Weighting = "trajectory") -> LinearTDStatistics:
    """A = E[rho phi (phi - gamma phi')^T], b = E[rho r phi], C = E[phi phi^T] as dense [n, n] averages."""
    check_probability("gamma", gamma)
    weights = _transition_weights(terms, weighting)
    delta_phi = terms.phi - gamma * terms.phi_next
    A = torch.einsum("nl,nli,nlj->ij", weights * terms.rho, terms.phi, delta_phi)
    b = torch.einsum("nl,nli->i", weights * terms.rho * terms.rewards, terms.phi)
    C = torch.einsum("nl,nli,nlj->ij", weights, terms.phi, terms.phi)
    return LinearTDStatistics(A, b, C)


def sample_td_statistics(
    features: FeatureMap,
    data: Mapping[str, torch.Tensor],
    gamma: float,
    *,
    target_policy: Optional[TargetPolicy] = None,
    weighting: Weighting = "transition",
    chunk: int = 2048,
) -> LinearTDStatistics:
    """``td_statistics`` of all trajectories in ``data`` (float64), ``chunk`` trajectories at a time, so that memory
    is O(chunk L n) rather than O(N L n) (1e5 chain trajectories as dense one-hot features would need ~7 GB).

    Each chunk's statistics are its own averages; they combine with weights N_chunk / N (per-trajectory weighting)
    or T_chunk / T (per-transition weighting, T = number of transitions).
    """
    mask = data["mask"]
    n_traj = int(mask.shape[0])
    if n_traj == 0:
        raise ValidationError("mask", "no trajectories")
    total = float(mask.sum())
    parts = []
    for start in range(0, n_traj, chunk):
        rows = {k: v[start : start + chunk] for k, v in data.items() if isinstance(v, torch.Tensor)}
        part = td_statistics(td_terms(features, rows, target_policy, dtype=torch.float64), gamma, weighting)
        size = rows["mask"].shape[0] / n_traj if weighting == "trajectory" else float(rows["mask"].sum()) / total
        parts.append((size, part))
    return LinearTDStatistics(*(sum(size * getattr(part, name) for size, part in parts) for name in ("A", "b", "C")))


def lstd_solution(stats: LinearTDStatistics, ridge: float = 0.0) -> torch.Tensor:
    """theta solving (A + ridge I) theta = b; least squares (minimum norm) when A is singular (unvisited features)."""
    A = stats.A.double() + ridge * torch.eye(stats.A.shape[0], dtype=torch.float64)
    b = stats.b.double()
    solution = torch.linalg.lstsq(A, b.unsqueeze(1), driver="gelsd").solution.squeeze(1)
    return solution.to(stats.A.dtype)


def lstd(
    features: FeatureMap,
    data: Mapping[str, torch.Tensor],
    gamma: float,
    *,
    target_policy: Optional[TargetPolicy] = None,
    weighting: Weighting = "transition",
    ridge: float = 0.0,
) -> torch.Tensor:
    """LSTD(0) on-policy (``target_policy=None``) or WIS-LSTD(0) off-policy: not private."""
    stats = sample_td_statistics(features, data, gamma, target_policy=target_policy, weighting=weighting)
    return lstd_solution(stats, ridge)
