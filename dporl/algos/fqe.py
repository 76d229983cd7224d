"""Fitted Q evaluation (Le, Voloshin, Yue 2019) of a fixed target policy, as a per-row loss for unit-level DP-SGD.

Per transition (s, a, r, s', done), with the target policy's action probabilities pi(. | s') given as data:

    y_i        = r / reward_scale + gamma (1 - done) sum_a' pi(a' | s') Q_target(s', a')
    row_loss_i = loss(Q(s, a), y_i)            (Huber or squared error)

The target network is a deterministic function of past iterates (post-processing). ``pi(. | s')`` is computed from
the public target policy before training and travels with the rows (key ``next_pi``), so the loss never calls user
code. After a terminal step the next state is a placeholder (``dporl.data.dataset``): ``1 - done`` masks it.

The policy's value at a state is ``sum_a pi(a | s) Q(s, a)`` (``state_values``), in reward units after
multiplying by ``reward_scale``; with ``average_last`` the evaluated Q is the running mean of the last iterates
(Polyak & Juditsky 1992), post-processing of the released iterates. An empty ``hidden_sizes`` gives a linear Q
(tabular on one-hot observations).

Public bounds keep the iteration stable: ``target_range`` (in Q units, i.e. divided by ``reward_scale``) clips every
TD target y, so a noisy target network can never push the fit outside the declared value range, and ``obs_scale``
divides the observations (a public constant bringing them to about unit norm: the step size a linear Q tolerates
falls with the squared feature norm). The defaults are those the benchmark suite measured stable
(``dporl.eval.ope_suite``): a linear Q, squared TD error, the target network copied every step (plain semi-gradient
TD, whose value propagates every step instead of once per copy), the last half of the iterates averaged.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Literal, Optional

import torch
from torch import nn
from torch.nn import functional as F

from dporl.algos.cql import mlp, update_target
from dporl.privacy.units import PrivacyUnit, as_unit
from dporl.utils.validation import ValidationError, check_positive, check_probability

FQE_KEYS = ("obs", "actions", "rewards", "next_obs", "terminated", "next_pi")
UNIT_WEIGHT = "unit_weight"  # optional per-row key: the weight of the row's unit (``weighted_row_losses``)


@dataclass
class FQEConfig:
    """Fitted Q evaluation of one target policy (module docstring): the Q-network and its TD targets."""

    hidden_sizes: list[int] = field(default_factory=list)  # [] : linear in the (scaled) observations
    gamma: float = 0.99
    td_loss: Literal["huber", "mse"] = "mse"
    target_update_every: int = 1  # hard copy every this many steps, unless tau is set
    tau: Optional[float] = None
    reward_scale: float = 1.0  # public constant dividing rewards (Q is learnt in these units)
    # Polyak-Ruppert averaging: the evaluated Q is the mean of the online network over the last this fraction of
    # the steps (0: the last iterate). Averaging released iterates is post-processing; it cancels much of the
    # DP-SGD noise that a single noisy iterate carries.
    average_last: float = 0.5
    target_range: Optional[tuple[float, float]] = None  # public bounds of a TD target, in Q units (None: unclipped)
    obs_scale: float = 1.0  # public constant dividing the observations

    def __post_init__(self) -> None:
        check_probability("fqe.gamma", self.gamma)
        if any(int(h) != h or h < 1 for h in self.hidden_sizes):
            raise ValidationError("fqe.hidden_sizes", f"need positive layer sizes, got {self.hidden_sizes}")
        if self.target_update_every < 1:
            raise ValidationError("fqe.target_update_every", f"must be >= 1, got {self.target_update_every}")
        if self.tau is not None:
            check_probability("fqe.tau", self.tau, allow_zero=False)
        check_positive("fqe.reward_scale", self.reward_scale)
        check_probability("fqe.average_last", self.average_last, allow_one=False)
        check_positive("fqe.obs_scale", self.obs_scale)
        if self.target_range is not None:
            lo, hi = (float(v) for v in self.target_range)
            if not lo < hi:
                raise ValidationError("fqe.target_range", f"expected (low, high), got {self.target_range}")
            self.target_range = (lo, hi)


class DiscreteFQE(nn.Module):
    """Q-network of the target policy + its target network; ``row_losses`` reads ``FQE_KEYS``."""

    def __init__(self, obs_dim: int, n_actions: int, config: FQEConfig, privacy_unit: PrivacyUnit | str):
        super().__init__()
        if obs_dim < 1 or n_actions < 1:
            raise ValidationError("fqe", f"need obs_dim >= 1 and n_actions >= 1, got {obs_dim}, {n_actions}")
        self.config = config
        self.n_actions = n_actions
        self.privacy_unit = as_unit(privacy_unit)
        self.q_network = mlp(obs_dim, list(config.hidden_sizes), n_actions)
        self.target_network = copy.deepcopy(self.q_network)
        self.target_network.requires_grad_(False)
        # The running mean of the online network's iterates from step ``average_from`` on (see FQEConfig).
        self.averaged_network = copy.deepcopy(self.q_network)
        self.averaged_network.requires_grad_(False)
        self.register_buffer("averaged_count", torch.zeros((), dtype=torch.long))
        self.average_from: Optional[int] = None

    def plan_averaging(self, total_steps: int) -> None:
        """Average the iterates of the last ``config.average_last`` fraction of ``total_steps`` steps."""
        if self.config.average_last > 0:
            self.average_from = int(total_steps * (1 - self.config.average_last))

    def _evaluated(self) -> nn.Module:
        return self.averaged_network if int(self.averaged_count) > 0 else self.q_network

    def row_losses(self, batch) -> torch.Tensor:
        data = batch.data
        scale = self.config.obs_scale
        q_taken = self.q_network(data["obs"] / scale).gather(1, data["actions"].long().unsqueeze(1)).squeeze(1)
        with torch.no_grad():
            next_value = (self.target_network(data["next_obs"] / scale) * data["next_pi"]).sum(dim=1)
            not_done = 1.0 - data["terminated"].float()
            y = data["rewards"].float() / self.config.reward_scale + self.config.gamma * not_done * next_value
            if self.config.target_range is not None:
                y = y.clamp(*self.config.target_range)
        if self.config.td_loss == "huber":
            return F.smooth_l1_loss(q_taken, y, reduction="none")
        return 0.5 * (q_taken - y) ** 2

    def weighted_row_losses(self, batch) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(row losses, the weight of each row's unit or None): DP-SGD multiplies each unit's clipped gradient of
        its mean row loss by its weight (|w| <= 1, ``dporl.privacy.dpsgd``). A unit's mean over its rows weighs a
        row by 1 / (the unit's rows), a number that depends on how its episodes turned out (a unit whose patients
        recovered fast has fewer rows), which biases the fitted fixed point; the weight (the unit's rows per episode
        over a public bound on an episode's length) makes every transition weigh alike again."""
        weights = batch.data.get(UNIT_WEIGHT)
        return self.row_losses(batch), None if weights is None else weights.float()

    @torch.no_grad()
    def state_values(self, obs: torch.Tensor, pi: torch.Tensor) -> torch.Tensor:
        """V^pi(s) = sum_a pi(a|s) Q(s, a), in reward units, for observations [B, d] and probabilities [B, A]."""
        return (self._evaluated()(obs / self.config.obs_scale) * pi).sum(dim=1) * self.config.reward_scale

    @torch.no_grad()
    def q_values(self, obs: torch.Tensor) -> torch.Tensor:
        """Q(s, .) in reward units [B, A] (the averaged iterate when averaging ran)."""
        return self._evaluated()(obs / self.config.obs_scale) * self.config.reward_scale

    def parameters_finite(self) -> bool:
        """Whether every parameter of the evaluated network is finite (a released quantity: post-processing)."""
        return all(bool(torch.isfinite(p).all()) for p in self._evaluated().parameters())

    def n_parameters(self) -> int:
        return sum(p.numel() for p in self.q_network.parameters())

    @torch.no_grad()
    def on_step_end(self, step: int) -> None:
        update_target(self.target_network, self.q_network, step, self.config.tau, self.config.target_update_every)
        if self.average_from is not None and step > self.average_from:
            self.averaged_count += 1
            weight = 1.0 / float(self.averaged_count)
            for mean, online in zip(self.averaged_network.parameters(), self.q_network.parameters()):
                mean.lerp_(online, weight)
