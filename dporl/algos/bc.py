"""Discrete behaviour cloning: a policy network fitted to the logged actions by cross-entropy (Pomerleau 1991,
"Efficient training of artificial neural networks for autonomous navigation"; the baseline of offline RL
benchmarks, e.g. Fu et al. 2020, D4RL, and of d3rlpy's ``DiscreteBC``).

Per transition (s, a): ``row_loss_i = CE(softmax(f(s_i)), a_i)`` (with optional label smoothing), one forward pass
with gradients, no target network, no batch norm (it would mix rows across units). The DP-SGD engine averages each
unit's rows and clips per unit, as for CQL, so unit-level and expert-level private BC are the ``train`` pipeline's
``dp_sgd`` (or ``mixed`` / ``stable_only``) method with ``algorithm: bc``. The released policy is greedy in the logits
(the most likely logged action); it reads only observations and actions, so its batches carry nothing else.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar, Mapping

import torch
from torch import nn
from torch.nn import functional as F

from dporl.algos.base import LossForm, PrivateAlgorithm
from dporl.algos.networks import check_hidden_sizes, check_mlp_sizes, mlp
from dporl.algos.registry import AlgorithmConfig, register_algorithm
from dporl.privacy.units import EXPERT, PrivacyUnit
from dporl.utils.validation import ValidationError


class DiscreteBCModule(PrivateAlgorithm):
    """Policy network obs -> action logits; ``row_losses`` is the cross-entropy of the logged action."""

    loss_form = LossForm.ROW_LOSSES
    batch_keys = ("obs", "actions")
    policy_kind = "greedy_logits_mlp"

    def __init__(self, obs_dim: int, n_actions: int, config: "BCConfig", privacy_unit: PrivacyUnit | str = EXPERT):
        super().__init__(privacy_unit)
        obs_dim, _, n_actions = check_mlp_sizes("bc", obs_dim, config.hidden_sizes, n_actions)
        self.config = config
        self.policy = mlp(obs_dim, config.hidden_sizes, n_actions)

    def row_losses(self, batch: Any) -> torch.Tensor:
        data = batch.data
        return F.cross_entropy(self.policy(data["obs"]), data["actions"].long(), reduction="none",
                               label_smoothing=self.config.label_smoothing)

    def policy_network(self) -> nn.Module:
        return self.policy


@register_algorithm
@dataclass
class BCConfig(AlgorithmConfig):
    """Behaviour cloning's hyper-parameters: the ``algorithm`` section of a ``train`` config (``name: bc``)."""

    name: str = "bc"
    hidden_sizes: list[int] = field(default_factory=lambda: [256, 256])  # the policy network's hidden layers (ReLU)
    label_smoothing: float = 0.0  # mass spread uniformly over the actions in the target distribution

    def __post_init__(self) -> None:
        self.hidden_sizes = check_hidden_sizes("bc.hidden_sizes", self.hidden_sizes)
        if not 0.0 <= self.label_smoothing < 1.0:
            raise ValidationError("bc.label_smoothing", f"must be in [0, 1), got {self.label_smoothing}")

    algorithm: ClassVar[type] = DiscreteBCModule
    api_name: ClassVar[str] = "DiscreteBCConfig"
    summary: ClassVar[str] = "behaviour cloning: cross-entropy on the logged actions (the first baseline to run)"
    api_defaults: ClassVar[Mapping[str, Any]] = {"hidden_sizes": [64, 64]}
