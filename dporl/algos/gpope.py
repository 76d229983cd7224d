"""GPOPE: gradient-perturbed off-policy evaluation (Xie, Thomas, Miklau 2019), i.e. private GTD2.

The module holds (theta, w) and returns, per sampled trajectory i (the privacy unit), the primal-dual gradient

    B_i(theta, w) = [ -A_i^T w ;  A_i theta + C_i w - b_i ]                       (length 2n)

with A_i, b_i, C_i the per-trajectory averages of ``dporl.algos.lstd``. It is computed in O(tau n) without
forming A_i or C_i (Phi, Phi' are the tau x n feature matrices of the trajectory, D = Phi - gamma Phi'):

    A_i theta  = Phi^T (rho * (D theta)) / tau      A_i^T w = D^T (rho * (Phi w)) / tau
    C_i w      = Phi^T (Phi w) / tau                b_i     = Phi^T (rho * r) / tau

batched over padded trajectories, each batch cut to its own longest trajectory. Features with a
``state_index(obs)`` method (one-hot tabular features) take an O(tau) path instead: Phi w = w[s_t], and Phi^T v is
a scatter-add of v into the visited states, which makes the chain's 1e5-trajectory runs affordable.

The shared Trainer clips each B_i to ``max_grad_norm`` (the paper's h), adds N(0, sigma^2 h^2) and takes an SGD step
[theta; w] -= beta * direction, which is GTD2. The module never adds noise. Sampling (Poisson over trajectories, or
the paper's one trajectory per update) and its accounting belong to the batch source and the privacy layer;
``paper_lemma1_epsilon`` gives the paper's own figure for comparison.

Iterate averaging (``GPOPEConfig.average_from``): the released estimate is the mean of theta over the iterates after
step ``average_from`` (0: Polyak-Ruppert averaging of every iterate; N/2: the last half, "tail" averaging) instead of
the last iterate. Every iterate is already covered by the accounting (each noisy step is a released mechanism), so
the average is post-processing: it records no privacy event and changes nothing the ledger sees. Averaging cancels
part of the injected noise that a constant step size otherwise leaves in the final iterate (Theorem 2's term II).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
from torch import nn

from dporl.algos.base import LossForm, PrivateAlgorithm
from dporl.algos.lstd import FeatureMap, TargetPolicy, TDTerms, importance_ratios, td_terms
from dporl.privacy.units import TRAJECTORY
from dporl.utils.validation import ValidationError, check_positive, check_probability


@dataclass
class GPOPEConfig:
    gamma: float = 0.99
    dtype: str = "float32"  # "float64" for exact convergence checks
    # Release the mean of theta over the iterates after this step (0: Polyak averaging of all of them); None: the
    # last iterate. Post-processing of the noisy iterates: no privacy cost.
    average_from: Optional[int] = None

    def __post_init__(self) -> None:
        check_probability("gpope.gamma", self.gamma)
        if self.dtype not in ("float32", "float64"):
            raise ValidationError("gpope.dtype", f"must be float32 or float64, got {self.dtype!r}")
        if self.average_from is not None and (isinstance(self.average_from, bool) or self.average_from < 0):
            raise ValidationError("gpope.average_from", f"must be a step >= 0 or None, got {self.average_from!r}")


class GPOPE(PrivateAlgorithm):
    """Linear value estimate V(s) = theta . phi(s) trained by (private) GTD2 on whole trajectories.

    Train it with ``DPConfig(clipping="naive")``: closed-form directions need none of the engine's per-layer
    hooks (the book-keeping tape only understands nn.Linear and refuses the bare parameters theta and w).
    """

    privacy_unit = TRAJECTORY
    loss_form = LossForm.UNIT_DIRECTIONS
    # padded trajectories (behaviour probabilities read off-policy only)
    batch_keys = ("observations", "actions", "rewards", "terminated", "mask", "behavior_log_probs")
    policy_kind = None  # an evaluator: it releases value weights, no policy

    def __init__(
        self, features: FeatureMap, config: GPOPEConfig | None = None, target_policy: Optional[TargetPolicy] = None
    ):
        super().__init__()
        self.config = config or GPOPEConfig()
        n_features = getattr(features, "n_features", None)
        if not isinstance(n_features, int) or n_features < 1:
            raise ValidationError("features", "needs a positive integer attribute n_features")
        dtype = getattr(torch, self.config.dtype)
        self.theta = nn.Parameter(torch.zeros(n_features, dtype=dtype))  # primal: value weights
        self.w = nn.Parameter(torch.zeros(n_features, dtype=dtype))  # dual (GTD2's auxiliary weights)
        # Running sum of the averaged iterates (float64: a mean over 1e6 iterates must keep the noise's cancellation)
        self.register_buffer("theta_sum", torch.zeros(n_features, dtype=torch.float64))
        self.register_buffer("n_averaged", torch.zeros((), dtype=torch.int64))
        # A feature network or a target-policy network is public and fixed: freeze it so that only (theta, w)
        # are trainable (the Trainer privatises every trainable parameter).
        for fixed in (features, target_policy):
            if isinstance(fixed, nn.Module):
                fixed.requires_grad_(False)
        self.features = features
        self.target_policy = target_policy  # None: on-policy (rho = 1)

    @property
    def n_features(self) -> int:
        return int(self.theta.shape[0])

    def terms(self, data) -> TDTerms:
        return td_terms(self.features, data, self.target_policy, dtype=self.theta.dtype)

    def unit_directions(self, batch) -> torch.Tensor:
        """[n_units, 2n]: the primal-dual gradient of each sampled trajectory (mean over its rows if several)."""
        with torch.no_grad():
            data = _trim_padding(batch.data)
            if hasattr(self.features, "state_index"):
                rows = tabular_primal_dual_gradients(
                    self.features, data, self.target_policy, self.theta, self.w, self.config.gamma
                )
            else:
                rows = primal_dual_gradients(self.terms(data), self.theta, self.w, self.config.gamma)
            if batch.n_rows == batch.n_units and torch.equal(batch.unit_index, torch.arange(batch.n_units)):
                return rows  # one row per trajectory (the usual trajectory-level batch)
            units = torch.zeros(batch.n_units, rows.shape[1], dtype=rows.dtype)
            units.index_add_(0, batch.unit_index, rows)
            counts = torch.bincount(batch.unit_index, minlength=batch.n_units).clamp_min(1)
            return units / counts.unsqueeze(1).to(rows.dtype)

    def on_step_end(self, step: int) -> None:
        """Called by the Trainer after optimizer step ``step`` (1-based): accumulate theta for the average."""
        start = self.config.average_from
        if start is not None and step > start:
            with torch.no_grad():
                self.theta_sum += self.theta.detach().double()
                self.n_averaged += 1

    def estimate(self) -> torch.Tensor:
        """The released value weights: the average of the iterates after ``average_from``, else the last iterate."""
        with torch.no_grad():
            if self.config.average_from is not None and int(self.n_averaged) > 0:
                return (self.theta_sum / self.n_averaged).to(self.theta.dtype)
            return self.theta.detach().clone()

    def values(self, observations: torch.Tensor) -> torch.Tensor:
        """V(s) = theta . phi(s) for observations [..., d], with the released (possibly averaged) theta."""
        with torch.no_grad():
            return self.features(observations).to(self.theta.dtype) @ self.estimate()


def released_theta(state: dict) -> torch.Tensor:
    """The estimate a saved GPOPE state_dict released: the averaged iterates if it averaged any, else theta."""
    count = state.get("n_averaged")
    if count is not None and int(count) > 0:
        return (state["theta_sum"] / count).to(state["theta"].dtype)
    return state["theta"]


def primal_dual_gradients(terms: TDTerms, theta: torch.Tensor, w: torch.Tensor, gamma: float) -> torch.Tensor:
    """B_i(theta, w) for every trajectory in ``terms``: [N, 2n], O(N L n) (never forms A_i or C_i)."""
    delta_phi = terms.phi - gamma * terms.phi_next  # [N, L, n]
    inv_tau = terms.lengths.reciprocal().unsqueeze(1)  # [N, 1]
    value_gap = delta_phi @ theta  # (phi_t - gamma phi_{t+1}) . theta  [N, L]
    dual = terms.phi @ w  # phi_t . w  [N, L] (zero on padding, where phi is zero)
    # A_i theta + C_i w - b_i = Phi^T (rho * (D theta - r) + Phi w) / tau  and  -A_i^T w = -D^T (rho * Phi w) / tau:
    # two batched matrix-vector products over the time axis.
    dual_weights = (terms.rho * (value_gap - terms.rewards) + dual) * inv_tau
    primal_weights = terms.rho * dual * (-inv_tau)
    dual_part = torch.bmm(dual_weights.unsqueeze(1), terms.phi).squeeze(1)
    primal_part = torch.bmm(primal_weights.unsqueeze(1), delta_phi).squeeze(1)
    return torch.cat([primal_part, dual_part], dim=1)


def _trim_padding(data):
    """The batch's padded tensors cut to its longest trajectory (rows come from a dataset padded to its longest)."""
    mask = data["mask"]
    width = int(mask.sum(1).max()) if mask.shape[0] else 0
    if width in (0, mask.shape[1]):
        return data
    trimmed = dict(data)
    for key in ("actions", "rewards", "mask", "behavior_log_probs"):
        if trimmed.get(key) is not None:
            trimmed[key] = trimmed[key][:, :width]
    trimmed["observations"] = data["observations"][:, : width + 1]
    return trimmed


def tabular_primal_dual_gradients(features, data, target_policy, theta: torch.Tensor, w: torch.Tensor,
                                  gamma: float) -> torch.Tensor:
    """B_i(theta, w) for one-hot features (``features.state_index``): [N, 2n] in O(N L) by gathers and scatter-adds.

    Same quantities as ``primal_dual_gradients`` with phi_t = e_{s_t}: phi_t . x = x[s_t] and
    sum_t v_t phi_t = scatter-add of v_t at s_t; phi_{t+1} is zero after a terminal transition and on padding.
    """
    valid = data["mask"].bool()
    dtype = theta.dtype
    mask = valid.to(dtype)
    n_traj, horizon = mask.shape
    if data["observations"].shape[:2] != (n_traj, horizon + 1):
        raise ValidationError("observations", f"expected [N, L+1, ...] = [{n_traj}, {horizon + 1}, ...], got "
                              f"{tuple(data['observations'].shape)}")
    lengths = mask.sum(1)
    if n_traj and lengths.min() < 1:
        raise ValidationError("mask", "every trajectory needs at least one transition")
    index = features.state_index(data["observations"])  # [N, L+1]
    states, following = index[:, :-1], index[:, 1:]
    later = torch.nn.functional.pad(valid[:, 1:], (0, 1))
    next_valid = (later | (valid & ~data["terminated"].bool().unsqueeze(1))).to(dtype)
    rho = importance_ratios(data, target_policy, dtype)
    rewards = data["rewards"].to(dtype) * mask
    inv_tau = lengths.reciprocal().unsqueeze(1)
    value_gap = theta[states] * mask - gamma * theta[following] * next_valid
    dual = w[states] * mask
    dual_weights = (rho * (value_gap - rewards) + dual) * inv_tau
    primal_weights = rho * dual * (-inv_tau)
    n = theta.shape[0]
    dual_part = torch.zeros(n_traj, n, dtype=dtype).scatter_add_(1, states, dual_weights)
    primal_part = torch.zeros(n_traj, n, dtype=dtype).scatter_add_(1, states, primal_weights)
    primal_part.scatter_add_(1, following, primal_weights * next_valid * (-gamma))
    return torch.cat([primal_part, dual_part], dim=1)


def dense_primal_dual_gradients(terms: TDTerms, theta: torch.Tensor, w: torch.Tensor, gamma: float) -> torch.Tensor:
    """Reference B_i that forms A_i, b_i, C_i explicitly (O(N L n^2)); for tests and the benchmark baseline."""
    delta_phi = terms.phi - gamma * terms.phi_next
    scale = (terms.rho / terms.lengths.unsqueeze(1)).unsqueeze(-1)
    A = torch.einsum("nli,nlj->nij", terms.phi * scale, delta_phi)
    C = torch.einsum("nli,nlj->nij", terms.phi / terms.lengths.view(-1, 1, 1), terms.phi)
    b = torch.einsum("nl,nli->ni", (terms.rho * terms.rewards) / terms.lengths.unsqueeze(1), terms.phi)
    primal = -torch.einsum("nji,j->ni", A, w)
    dual = torch.einsum("nij,j->ni", A, theta) + torch.einsum("nij,j->ni", C, w) - b
    return torch.cat([primal, dual], dim=1)


def paper_lemma1_epsilon(noise_multiplier: float, n_trajectories: int, steps: int, delta: float) -> float:
    """The paper's figure for its one-trajectory-per-update mode (NOT dporl's guarantee for that mode).

    Lemma 1 bounds the log moment of one iteration by
    alpha(lambda) <= lambda (lambda + 1) / (2 m^2) * min{4 (e^{1/sigma^2} - 1), 2 e^{1/sigma^2}};
    moments compose additively over N iterations and the tail bound gives
    epsilon = min_lambda (N alpha(lambda) + log(1/delta)) / lambda (Abadi et al. 2016, Theorem 2).
    """
    sigma = check_positive("noise_multiplier", noise_multiplier)
    check_probability("delta", delta, allow_zero=False, allow_one=False)
    if n_trajectories < 1 or steps < 0:
        raise ValidationError("steps", f"need m >= 1 and N >= 0, got m={n_trajectories}, N={steps}")
    inv = 1.0 / sigma**2
    # For large 1/sigma^2 the exponential overflows; the bound is then vacuous anyway.
    factor = min(4.0 * math.expm1(inv), 2.0 * math.exp(inv)) if inv < 700 else math.inf
    lambdas = torch.arange(1, 4097, dtype=torch.float64)
    moments = steps * lambdas * (lambdas + 1) / (2 * n_trajectories**2) * factor
    return float(((moments + math.log(1 / delta)) / lambdas).min())
