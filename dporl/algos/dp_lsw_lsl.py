"""DP-LSW and DP-LSL (Balle, Gomrokchi, Precup 2016): first-visit Monte-Carlo regression + output perturbation.

Privacy unit: one trajectory, replace-one adjacency (datasets of the same size m differing in one trajectory).
Analysis: smooth sensitivity (Nissim et al. 2007/2011, Lemma 1 of Balle et al.): the released theta + N(0, sigma_X^2 I)
is (epsilon, delta)-DP when sigma_X >= alpha * (local sensitivity) and ln sigma_X^2 moves by at most beta between
neighbours, with alpha = 5 sqrt(2 ln(2/delta)) / epsilon, beta = epsilon / (4 (d + ln(2/delta))).

Both analyses count, for every state s, the number |X_s| of trajectories that visit s, and bound the change of the
first-visit return targets by a public bound F_max on returns. That argument needs a finite state space and
on-policy returns (importance-weighted returns are unbounded), so both refuse anything else. Returns outside
[0, F_max] are clipped into it: the bound must hold for the analysis, and refusing data that breaks it would
itself reveal something about that data.

sigma_X depends on the data (through |X_s|): it is NOT released; only theta + noise is.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional

import torch

from dporl.privacy.events import ApproxDPEvent
from dporl.privacy.output_perturbation import gaussian_output_perturbation, smooth_sensitivity_constants
from dporl.utils.validation import ValidationError, check_positive, check_probability

ANALYSIS = "smooth sensitivity (Balle et al. 2016)"


@dataclass
class FirstVisitData:
    """Per-trajectory first-visit returns F[i, s] (0 where unvisited) and the visit indicators, on N states."""

    returns: torch.Tensor  # float64 [m, N]
    visited: torch.Tensor  # bool [m, N]

    @property
    def n_trajectories(self) -> int:
        return int(self.returns.shape[0])

    @property
    def visit_counts(self) -> torch.Tensor:
        """|X_s|: how many trajectories visit each state (the dataset's signature)."""
        return self.visited.sum(0)

    def mean_returns(self) -> torch.Tensor:
        """F_X(s): mean first-visit return over the trajectories visiting s (0 if none)."""
        return self.returns.sum(0) / self.visit_counts.clamp_min(1)


def finite_states(observations: torch.Tensor, n_states: int) -> torch.Tensor:
    """State indices from observations [m, L] or [m, L, 1] that must be integers in [0, n_states); else refuse."""
    if observations.dim() == 3 and observations.shape[-1] == 1:
        observations = observations[..., 0]
    if observations.dim() != 2:
        raise ValidationError(
            "observations",
            f"DP-LSW / DP-LSL need a finite state space (one integer state per step), got observations of shape "
            f"{tuple(observations.shape)}; continuous states are refused (the analysis counts visits per state)",
        )
    if observations.is_floating_point() and not torch.equal(observations, observations.round()):
        raise ValidationError(
            "observations", "DP-LSW / DP-LSL need a finite state space: non-integer (continuous) states are refused"
        )
    states = observations.long()
    if states.numel() and (states.min() < 0 or states.max() >= n_states):
        raise ValidationError("observations", f"states must lie in [0, {n_states}) for a finite state space")
    return states


def first_visit_returns(
    data: Mapping[str, torch.Tensor], n_states: int, gamma: float, return_bound: float, target_policy=None
) -> FirstVisitData:
    """First-visit discounted returns of padded trajectories (observations [m, L+1, 1] holding state indices).

    Returns are clipped into [0, return_bound] (the public bound F_max). Any ``target_policy`` (off-policy data)
    is refused.
    """
    check_probability("gamma", gamma)
    check_positive("return_bound", return_bound)
    if target_policy is not None:
        raise ValidationError(
            "target_policy",
            "DP-LSW / DP-LSL are on-policy Monte-Carlo methods: their sensitivity analysis does not hold for "
            "off-policy (importance-weighted) returns; use GPOPE for off-policy evaluation",
        )
    mask = data["mask"].bool()
    m, horizon = mask.shape
    states = finite_states(data["observations"][:, :-1], n_states)  # [m, L]
    rewards = data["rewards"].double() * mask
    # Discounted return-to-go, one vectorised step per time index (backwards), no trajectory loop.
    to_go = torch.zeros(m, horizon + 1, dtype=torch.float64)
    for t in range(horizon - 1, -1, -1):
        to_go[:, t] = rewards[:, t] + gamma * to_go[:, t + 1]
    to_go = to_go[:, :-1].clamp(0.0, return_bound)
    # First visit time of each state: the smallest t with s_t = s (horizon where never visited).
    times = torch.arange(horizon).expand(m, horizon).masked_fill(~mask, horizon)
    first = torch.full((m, n_states), horizon, dtype=torch.long)
    first.scatter_reduce_(1, states.masked_fill(~mask, 0), times, reduce="amin")
    visited = first < horizon
    returns = torch.gather(to_go, 1, first.clamp_max(horizon - 1)) * visited
    return FirstVisitData(returns, visited)


def _check_weights(name: str, weights: torch.Tensor, n_states: int, upper: Optional[float]) -> torch.Tensor:
    weights = torch.as_tensor(weights, dtype=torch.float64)
    if weights.shape != (n_states,):
        raise ValidationError(name, f"expected one weight per state ({n_states}), got shape {tuple(weights.shape)}")
    if not torch.isfinite(weights).all() or (weights < 0).any() or (upper is not None and (weights > upper).any()):
        raise ValidationError(name, f"weights must be finite and in [0, {upper if upper is not None else 'inf'}]")
    return weights


@dataclass
class OutputPerturbationResult:
    """A released parameter vector. ``theta`` is private; ``sigma`` and ``psi`` are curator-only diagnostics."""

    theta: torch.Tensor
    epsilon: float
    delta: float
    sigma: float  # data-dependent noise std (NOT covered by the guarantee if published)
    psi: float  # the beta-smooth upper bound used
    unit: str = "trajectory"
    analysis: str = ANALYSIS

    def event(self) -> ApproxDPEvent:
        return ApproxDPEvent(self.epsilon, self.delta, replace_one=True)


def lsw_estimate(data: FirstVisitData, features: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """Non-private LSW: theta = (Phi^T Gamma Phi)^{-1} Phi^T Gamma F_X = (Gamma^{1/2} Phi)^+ Gamma^{1/2} F_X."""
    root = weights.sqrt().unsqueeze(1)
    return torch.linalg.pinv(root * features.double()) @ (root.squeeze(1) * data.mean_returns())


def dp_lsw_sigma(
    counts: torch.Tensor,
    features: torch.Tensor,
    weights: torch.Tensor,
    epsilon: float,
    delta: float,
    return_bound: float,
) -> tuple[float, float]:
    """(sigma_X, psi) of DP-LSW: psi = max_{0<=k<=max|X_s|} e^{-k beta} sum_s w_s / max(|X_s| - k, 1)^2.

    ||(Gamma^{1/2} Phi)^+|| is the spectral norm of the pseudo-inverse (1 / sqrt(min positive w) for tabular Phi).
    """
    alpha, beta = smooth_sensitivity_constants(epsilon, delta, int(features.shape[1]))
    counts = counts.double()
    k = torch.arange(int(counts.max()) + 1, dtype=torch.float64).unsqueeze(1)  # [K+1, 1]
    phi_k = (weights / (counts - k).clamp_min(1.0) ** 2).sum(1)
    psi = float((torch.exp(-k.squeeze(1) * beta) * phi_k).max())
    pinv = torch.linalg.pinv(weights.sqrt().unsqueeze(1) * features.double())
    pinv_norm = float(torch.linalg.matrix_norm(pinv, ord=2))
    return alpha * return_bound * pinv_norm * math.sqrt(psi), psi


def dp_lsw(
    data: FirstVisitData,
    features: torch.Tensor,
    *,
    epsilon: float,
    delta: float,
    return_bound: float,
    noise,
    weights: Optional[torch.Tensor] = None,
) -> OutputPerturbationResult:
    """DP-LSW (Algorithm 1 of Balle et al.): LSW solution plus Gaussian noise of smooth-sensitivity scale.

    ``features`` is the public [N, d] matrix Phi; ``weights`` the public regression weights w_s >= 0 (default 1 for
    every state). Give w_s = 0 to states no trajectory can visit (visit probability p_s = 0, e.g. an absorbing
    terminal state), as Balle et al. do (Corollary 11): such a state has |X_s| = 0 forever, so with w_s = 1 it
    adds w_s / max(0 - k, 1)^2 = 1 to phi(k) for every k and keeps psi >= 1, a noise floor no amount of data lowers.
    The weights must be public (a property of the MDP, not of the logged data): zeroing the states a particular
    dataset happens not to visit would make w depend on one trajectory, which the smooth-sensitivity analysis
    (fixed w) does not cover. The bound ||theta_X - theta_X'|| <= ||(Gamma^{1/2} Phi)^+|| ||F_X - F_X'||_{2,Gamma}
    holds for any fixed w >= 0 (theta is the minimum-norm least-squares solution, linear in F_X).
    """
    n_states = int(data.returns.shape[1])
    features = _check_features(features, n_states)
    weights = _check_weights("weights", torch.ones(n_states) if weights is None else weights, n_states, None)
    if not (weights > 0).any():
        raise ValidationError("weights", "DP-LSW needs at least one positive regression weight w_s")
    check_positive("return_bound", return_bound)
    sigma, psi = dp_lsw_sigma(data.visit_counts, features, weights, epsilon, delta, return_bound)
    theta = gaussian_output_perturbation(lsw_estimate(data, features, weights), sigma, noise)
    return OutputPerturbationResult(theta, epsilon, delta, sigma, psi)


def lsl_estimate(
    data: FirstVisitData, features: torch.Tensor, regression_weights: torch.Tensor, lam: float
) -> torch.Tensor:
    """Non-private LSL: theta = (Phi^T Gamma_X Phi + lambda/(2m) I)^{-1} Phi^T Gamma_X F_X, Gamma_X = rho_s |X_s|/m."""
    m = data.n_trajectories
    features = features.double()
    gamma_x = regression_weights * data.visit_counts.double() / m
    ridge = lam / (2 * m) * torch.eye(features.shape[1], dtype=torch.float64)
    lhs = features.T @ (gamma_x.unsqueeze(1) * features) + ridge
    return torch.linalg.solve(lhs, features.T @ (gamma_x * data.mean_returns()))


def dp_lsl_sigma(
    counts: torch.Tensor,
    n_trajectories: int,
    features: torch.Tensor,
    regression_weights: torch.Tensor,
    lam: float,
    epsilon: float,
    delta: float,
    return_bound: float,
) -> tuple[float, float]:
    """(sigma_X, psi) of DP-LSL with c = ||Phi|| ||rho||_inf / sqrt(2 lambda),
    phi(k) = (c sqrt(sum_s rho_s min(|X_s| + k, m)) + ||rho||_2)^2, psi = max_{0<=k<=m} e^{-k beta} phi(k)."""
    alpha, beta = smooth_sensitivity_constants(epsilon, delta, int(features.shape[1]))
    phi_norm = float(torch.linalg.matrix_norm(features.double(), ord=2))
    rho_inf = float(regression_weights.max())
    floor = phi_norm**2 * rho_inf
    if not lam > floor:
        raise ValidationError("lam", f"DP-LSL needs lambda > ||Phi||^2 ||rho||_inf = {floor:g}, got {lam:g}")
    c = phi_norm * rho_inf / math.sqrt(2.0 * lam)
    k = torch.arange(n_trajectories + 1, dtype=torch.float64).unsqueeze(1)
    visits = (counts.double() + k).clamp_max(float(n_trajectories))  # [m+1, N]
    phi_k = (c * (regression_weights * visits).sum(1).sqrt() + float(regression_weights.norm())) ** 2
    psi = float((torch.exp(-k.squeeze(1) * beta) * phi_k).max())
    return 2.0 * alpha * return_bound * phi_norm / (lam - floor) * math.sqrt(psi), psi


def dp_lsl(
    data: FirstVisitData,
    features: torch.Tensor,
    *,
    epsilon: float,
    delta: float,
    return_bound: float,
    lam: float,
    noise,
    regression_weights: Optional[torch.Tensor] = None,
) -> OutputPerturbationResult:
    """DP-LSL (Algorithm 2 of Balle et al.): ridge-regularised first-visit MC plus smooth-sensitivity noise.

    ``regression_weights`` are rho_s in [0, 1] (default 1); ``lam`` must exceed ||Phi||^2 ||rho||_inf (the paper's
    experiments favour lambda proportional to sqrt(m)).
    """
    n_states = int(data.returns.shape[1])
    features = _check_features(features, n_states)
    rho = _check_weights(
        "regression_weights", torch.ones(n_states) if regression_weights is None else regression_weights, n_states, 1.0
    )
    check_positive("return_bound", return_bound)
    check_positive("lam", lam)
    sigma, psi = dp_lsl_sigma(data.visit_counts, data.n_trajectories, features, rho, lam, epsilon, delta, return_bound)
    theta = gaussian_output_perturbation(lsl_estimate(data, features, rho, lam), sigma, noise)
    return OutputPerturbationResult(theta, epsilon, delta, sigma, psi)


def _check_features(features: torch.Tensor, n_states: int) -> torch.Tensor:
    features = torch.as_tensor(features, dtype=torch.float64)
    if features.dim() != 2 or features.shape[0] != n_states:
        raise ValidationError(
            "features",
            f"DP-LSW / DP-LSL need the feature matrix of a finite state space, [n_states={n_states}, d]; got "
            f"{tuple(features.shape)}",
        )
    if not torch.isfinite(features).all():
        raise ValidationError("features", "contains non-finite values")
    return features
