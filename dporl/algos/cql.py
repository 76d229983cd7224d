"""Discrete Conservative Q-Learning (Kumar et al. 2020, the DQN form used by the expert-level paper).

Per transition (s, a, r, s', done):

    td_i  = loss(Q(s, a), r + gamma (1 - done) max_a' Q_target(s', a'))      (DQN target)
          or with a' = argmax_a' Q(s', a') evaluated by Q_target            (double DQN)
    cql_i = logsumexp_a Q(s, a) - Q(s, a)
    row_loss_i = td_i + alpha * cql_i

Losses are returned per transition so that the DP-SGD engine can average them per privacy unit and clip per
unit. The Q-network is evaluated once with gradients (on s); every other forward pass (targets, the double-DQN
argmax) runs under no_grad, so per-unit gradients come from one forward/backward. There is no batch norm (it
mixes examples across units). The target network is a deterministic function of past iterates: post-processing.

Defaults follow the paper (DQN target, 2 x 256 ReLU MLP); Huber TD loss is the DQN convention and is
bounded in slope, which keeps per-unit gradients small relative to the clip norm; MSE is available.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal, Mapping, Optional

import torch
from torch import nn
from torch.nn import functional as F

from dporl.algos.base import LossForm, PrivateAlgorithm
from dporl.algos.networks import check_hidden_sizes, check_mlp_sizes, mlp
from dporl.algos.registry import AlgorithmConfig, register_algorithm
from dporl.privacy.units import EXPERT, PrivacyUnit
from dporl.utils.validation import ValidationError, check_positive, check_probability

CQL_KEYS = ("obs", "actions", "rewards", "next_obs", "terminated")


@torch.no_grad()
def update_target(target: nn.Module, online: nn.Module, step: int, tau: Optional[float], every: int) -> None:
    """Polyak averaging by ``tau`` per step, or a hard copy every ``every`` steps (post-processing of iterates)."""
    if tau is not None:
        for t, o in zip(target.parameters(), online.parameters()):
            t.lerp_(o, tau)
    elif step % every == 0:
        target.load_state_dict(online.state_dict())


class DiscreteCQLModule(PrivateAlgorithm):
    """Q-network + target network; ``row_losses`` reads ``CQL_KEYS``; the released policy is greedy in Q."""

    loss_form = LossForm.ROW_LOSSES
    batch_keys = CQL_KEYS
    policy_kind = "greedy_q_mlp"

    def __init__(self, obs_dim: int, n_actions: int, config: "CQLConfig", privacy_unit: PrivacyUnit | str = EXPERT):
        super().__init__(privacy_unit)
        obs_dim, _, n_actions = check_mlp_sizes("cql", obs_dim, config.hidden_sizes, n_actions)
        self.config = config
        self.obs_dim = obs_dim
        self.n_actions = n_actions
        self.q_network = mlp(obs_dim, config.hidden_sizes, n_actions)
        self.target_network = copy.deepcopy(self.q_network)
        self.target_network.requires_grad_(False)

    def q_values(self, obs: torch.Tensor) -> torch.Tensor:
        return self.q_network(obs)

    def policy_network(self) -> nn.Module:
        return self.q_network

    def row_losses(self, batch) -> torch.Tensor:
        data = batch.data
        obs, actions = data["obs"], data["actions"].long()
        q_all = self.q_network(obs)
        q_taken = q_all.gather(1, actions.unsqueeze(1)).squeeze(1)
        with torch.no_grad():
            next_obs = data["next_obs"]
            target_q = self.target_network(next_obs)
            if self.config.target == "double_dqn":
                best = self.q_network(next_obs).argmax(dim=1, keepdim=True)
                next_value = target_q.gather(1, best).squeeze(1)
            else:
                next_value = target_q.max(dim=1).values
            not_done = 1.0 - data["terminated"].float()
            y = data["rewards"].float() / self.config.reward_scale + self.config.gamma * not_done * next_value
        if self.config.td_loss == "huber":
            td = F.smooth_l1_loss(q_taken, y, reduction="none")
        else:
            td = 0.5 * (q_taken - y) ** 2
        conservative = torch.logsumexp(q_all, dim=1) - q_taken
        return td + self.config.alpha * conservative

    def on_step_end(self, step: int) -> None:
        update_target(self.target_network, self.q_network, step, self.config.tau, self.config.target_update_every)


@register_algorithm
@dataclass
class CQLConfig(AlgorithmConfig):
    """Discrete CQL's hyper-parameters: the ``algorithm`` section of a ``train`` config (``name: cql``)."""

    name: str = "cql"
    hidden_sizes: list[int] = field(default_factory=lambda: [256, 256])  # the Q-network's hidden layers (ReLU)
    gamma: float = 0.99  # discount
    alpha: float = 1.0  # weight of the conservative term; 0 gives plain (double) DQN
    td_loss: Literal["huber", "mse"] = "huber"  # the TD error's loss
    target: Literal["dqn", "double_dqn"] = "dqn"  # the TD target: max of the target network, or double DQN's
    target_update_every: int = 500  # hard copy every this many steps, unless tau is set
    tau: Optional[float] = None  # Polyak averaging factor per step (soft updates)
    # Rewards are divided by this public constant before the TD target, so that Q errors sit in the Huber loss's
    # quadratic range (HIV rewards are ~1e5 per step; unscaled, every TD error is in the linear range). A public
    # constant: it uses no data, so it costs no privacy. (alpha weighs the conservative term in scaled units.)
    reward_scale: float = 1.0

    def __post_init__(self) -> None:
        check_probability("cql.gamma", self.gamma)
        check_positive("cql.alpha", self.alpha, allow_zero=True)
        self.hidden_sizes = check_hidden_sizes("cql.hidden_sizes", self.hidden_sizes)
        if self.target_update_every < 1:
            raise ValidationError("cql.target_update_every", f"must be >= 1, got {self.target_update_every}")
        if self.tau is not None:
            check_probability("cql.tau", self.tau, allow_zero=False)
        check_positive("cql.reward_scale", self.reward_scale)

    algorithm: ClassVar[type] = DiscreteCQLModule
    api_name: ClassVar[str] = "DiscreteCQLConfig"
    summary: ClassVar[str] = "discrete conservative Q-learning (Kumar et al. 2020), the expert-level paper's learner"
    # The Python API trains on tables of a few thousand units: smaller networks, faster target copies.
    api_defaults: ClassVar[Mapping[str, Any]] = {"hidden_sizes": [64, 64], "target_update_every": 100}

    def discount(self) -> Optional[float]:
        return self.gamma
