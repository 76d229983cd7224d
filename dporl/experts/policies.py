"""Batched policy families: m policies whose parameters are stacked along a leading expert dimension.

Every family maps states to action logits for all m experts in one call, with tensor ops only (no Python loop
over experts):

- ``forward_all(states[B, d]) -> logits[m, B, n_actions]``: every expert on the same states;
- ``forward_paired(states[m, B, d]) -> logits[m, B, n_actions]``: expert i on its own states ``states[i]``.

Both take ``experts=`` (a slice, which indexes parameters without copying, or an index tensor) to evaluate a chunk
of experts. ``select(indices)`` returns a new module of the same family holding the chosen sub-stack.

Both must return a FRESH logits tensor (never a view of a parameter or a cached buffer): ``ExpertSet`` turns it
into log-probabilities in place to avoid another [m, B, n_actions] temporary.

A family is rebuilt from ``(family, config(), state_dict())``; families register themselves in ``FAMILIES``
under their ``family`` name so saved expert sets can be loaded without pickling code.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Sequence, Union

import torch
from torch import nn

from dporl.utils.validation import ValidationError

ExpertIndex = Union[None, slice, torch.Tensor, Sequence[int]]

FAMILIES: dict[str, type["StackedPolicy"]] = {}


def register_family(cls: type["StackedPolicy"]) -> type["StackedPolicy"]:
    FAMILIES[cls.family] = cls
    return cls


# Sizes a config (e.g. a hostile expert-set file) may declare; checked before anything is allocated.
MAX_COUNT = 1 << 27
MAX_ELEMENTS = 1 << 31  # 8 GiB of float32 parameters in one expert set


def _check_count(field: str, value: Any) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= MAX_COUNT:
        raise ValidationError(field, f"must be an integer in [1, {MAX_COUNT}], got {value!r}")
    return value


class StackedPolicy(nn.Module):
    """Base class: m policies over ``obs_dim``-dimensional states and ``n_actions`` discrete actions.

    Every parameter has leading dimension ``n_experts``. Subclasses implement ``_logits_paired`` (and may
    override ``_logits_all`` with a faster same-states path) over a dict of (possibly sub-stacked) parameters.
    Parameters are frozen (``requires_grad=False``): experts are queried, never trained, through this module.
    """

    family: ClassVar[str] = ""

    def __init__(self, n_experts: int, obs_dim: int, n_actions: int):
        super().__init__()
        self.n_experts = _check_count("n_experts", n_experts)
        self.obs_dim = _check_count("obs_dim", obs_dim)
        self.n_actions = _check_count("n_actions", n_actions)

    def config(self) -> dict[str, Any]:
        """Constructor keyword arguments (JSON-safe); ``type(self)(**config())`` rebuilds the architecture."""
        return {"n_experts": self.n_experts, "obs_dim": self.obs_dim, "n_actions": self.n_actions}

    def _new_parameter(self, *shape: int) -> nn.Parameter:
        self._elements = getattr(self, "_elements", 0) + self.n_experts * math.prod(shape)
        if self._elements > MAX_ELEMENTS:
            raise ValidationError("family_config", f"{self.family}: more than {MAX_ELEMENTS:.3g} parameters declared")
        return nn.Parameter(torch.zeros(self.n_experts, *shape), requires_grad=False)

    def stacked(self, experts: ExpertIndex = None) -> dict[str, torch.Tensor]:
        """Parameters by state-dict name, restricted to ``experts`` (a slice gives views, no copy)."""
        tensors = dict(self.named_parameters())
        tensors.update(self.named_buffers())
        if experts is None:
            return tensors
        if not isinstance(experts, slice):
            experts = torch.as_tensor(experts, dtype=torch.long, device=next(iter(tensors.values())).device)
        return {name: value[experts] for name, value in tensors.items()}

    def forward_all(self, states: torch.Tensor, experts: ExpertIndex = None) -> torch.Tensor:
        """states [B, obs_dim] -> logits [m', B, n_actions] for the selected experts (all by default)."""
        return self._logits_all(states, self.stacked(experts))

    def forward_paired(self, states: torch.Tensor, experts: ExpertIndex = None) -> torch.Tensor:
        """states [m', B, obs_dim] (row i for the i-th selected expert) -> logits [m', B, n_actions]."""
        return self._logits_paired(states, self.stacked(experts))

    forward = forward_all

    def _logits_all(self, states: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
        count = next(iter(params.values())).shape[0]
        return self._logits_paired(states.unsqueeze(0).expand(count, *states.shape), params)

    def _logits_paired(self, states: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
        raise NotImplementedError

    def select(self, indices: ExpertIndex) -> "StackedPolicy":
        """A new module of the same family holding experts ``indices`` (in that order; repeats allowed)."""
        params = self.stacked(indices)
        count = next(iter(params.values())).shape[0]
        if count == 0:
            raise ValidationError("indices", "selects no expert")
        clone = type(self)(**{**self.config(), "n_experts": int(count)})
        clone.load_state_dict({name: value.clone() for name, value in params.items()})
        return clone.to(next(iter(params.values())).device)

    @classmethod
    def concatenate(cls, policies: Sequence["StackedPolicy"]) -> "StackedPolicy":
        """One module stacking the experts of ``policies`` in order (same family and architecture)."""
        if not policies:
            raise ValidationError("policies", "need at least one policy")
        first = policies[0]
        architecture = {k: v for k, v in first.config().items() if k != "n_experts"}
        for i, other in enumerate(policies[1:], start=1):
            other_architecture = {k: v for k, v in other.config().items() if k != "n_experts"}
            if type(other) is not type(first) or other_architecture != architecture:
                raise ValidationError(f"policies[{i}]", f"{other.family} {other_architecture} differs from "
                                      f"policies[0]'s {first.family} {architecture}")
        merged = type(first)(**{**first.config(), "n_experts": sum(p.n_experts for p in policies)})
        merged.load_state_dict({name: torch.cat([p.state_dict()[name] for p in policies]) for name in first.state_dict()})
        return merged

    @classmethod
    def from_config(cls, config: dict[str, Any]) -> "StackedPolicy":
        try:
            return cls(**config)
        except TypeError as exc:
            raise ValidationError("family_config", f"{cls.family}: {exc}") from None


_ACTIVATIONS = {"tanh": torch.tanh, "relu": torch.relu}
_ACTIVATION_MODULES = {nn.Tanh: "tanh", nn.ReLU: "relu"}


@register_family
class StackedMLPPolicy(StackedPolicy):
    """m multilayer perceptrons of one architecture: obs_dim -> hidden_sizes -> n_actions logits.

    Holds PPO actors (``from_single``). Weight ``weights.i`` is [m, in, out] so a layer is one ``baddbmm``.
    """

    family = "mlp"

    def __init__(
        self,
        n_experts: int,
        obs_dim: int,
        n_actions: int,
        hidden_sizes: Sequence[int] = (64, 64),
        activation: str = "tanh",
    ):
        super().__init__(n_experts, obs_dim, n_actions)
        if activation not in _ACTIVATIONS:
            raise ValidationError("activation", f"must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        self.hidden_sizes = [_check_count(f"hidden_sizes[{i}]", h) for i, h in enumerate(hidden_sizes)]
        self.activation = activation
        sizes = [obs_dim, *self.hidden_sizes, n_actions]
        self.weights = nn.ParameterList([self._new_parameter(i, o) for i, o in zip(sizes[:-1], sizes[1:])])
        self.biases = nn.ParameterList([self._new_parameter(o) for o in sizes[1:]])

    def config(self) -> dict[str, Any]:
        return {**super().config(), "hidden_sizes": list(self.hidden_sizes), "activation": self.activation}

    def _layers(self, params: dict[str, torch.Tensor]) -> list[tuple[torch.Tensor, torch.Tensor]]:
        return [(params[f"weights.{i}"], params[f"biases.{i}"]) for i in range(len(self.hidden_sizes) + 1)]

    def _hidden_to_logits(self, hidden: torch.Tensor, layers: list) -> torch.Tensor:
        act = _ACTIVATIONS[self.activation]
        for weight, bias in layers:
            hidden = torch.baddbmm(bias.unsqueeze(1), act(hidden), weight)
        return hidden

    def _logits_all(self, states: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
        layers = self._layers(params)
        weight, bias = layers[0]
        # Shared states: the first layer of all experts is one [B, d] x [d, m*h] matmul.
        first = torch.einsum("bd,mdh->mbh", states, weight) + bias.unsqueeze(1)
        return self._hidden_to_logits(first, layers[1:])

    def _logits_paired(self, states: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
        layers = self._layers(params)
        weight, bias = layers[0]
        return self._hidden_to_logits(torch.baddbmm(bias.unsqueeze(1), states, weight), layers[1:])

    @classmethod
    def from_single(cls, modules: Sequence[nn.Module]) -> "StackedMLPPolicy":
        """Stack per-expert ``nn.Sequential(Linear, Tanh|ReLU, ..., Linear)`` modules of one architecture."""
        if not modules:
            raise ValidationError("modules", "need at least one module")
        parsed = [_parse_mlp(f"modules[{i}]", module) for i, module in enumerate(modules)]
        linears, activation = parsed[0]
        sizes = [linears[0].in_features] + [layer.out_features for layer in linears]
        for i, (other, other_activation) in enumerate(parsed[1:], start=1):
            other_sizes = [other[0].in_features] + [layer.out_features for layer in other]
            if other_sizes != sizes or other_activation != activation:
                raise ValidationError(f"modules[{i}]", f"architecture {other_sizes} differs from modules[0]'s {sizes}")
        policy = cls(len(modules), sizes[0], sizes[-1], sizes[1:-1], activation or "tanh")
        with torch.no_grad():
            for layer in range(len(linears)):
                policy.weights[layer].copy_(torch.stack([p[0][layer].weight.detach().T for p in parsed]))
                policy.biases[layer].copy_(torch.stack([p[0][layer].bias.detach() for p in parsed]))
        return policy


def _parse_mlp(field: str, module: nn.Module) -> tuple[list[nn.Linear], str | None]:
    children = list(module.children()) if isinstance(module, nn.Sequential) else [module]
    linears = [c for c in children if isinstance(c, nn.Linear)]
    acts = {_ACTIVATION_MODULES.get(type(c)) for c in children if not isinstance(c, nn.Linear)}
    expected = 2 * len(linears) - 1
    if not linears or len(children) != expected or None in acts or len(acts) > 1:
        raise ValidationError(field, "expected nn.Sequential(Linear, Tanh|ReLU, ..., Linear)")
    if any(not isinstance(c, nn.Linear) for c in children[::2]) or any(layer.bias is None for layer in linears):
        raise ValidationError(field, "layers must alternate Linear (with bias) and one activation kind")
    return linears, (acts.pop() if acts else None)


@register_family
class StackedLinearPolicy(StackedPolicy):
    """m linear policies: logits = s W_i + b_i with W [m, obs_dim, n_actions] (analytic gains, e.g. LQR)."""

    family = "linear"

    def __init__(self, n_experts: int, obs_dim: int, n_actions: int):
        super().__init__(n_experts, obs_dim, n_actions)
        self.weight = self._new_parameter(obs_dim, n_actions)
        self.bias = self._new_parameter(n_actions)

    def _logits_all(self, states: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.einsum("bd,mda->mba", states, params["weight"]) + params["bias"].unsqueeze(1)

    def _logits_paired(self, states: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
        return torch.baddbmm(params["bias"].unsqueeze(1), states, params["weight"])

    @classmethod
    def from_weights(cls, weight: torch.Tensor, bias: torch.Tensor) -> "StackedLinearPolicy":
        """weight [m, obs_dim, n_actions], bias [m, n_actions]."""
        if weight.dim() != 3 or bias.shape != (weight.shape[0], weight.shape[2]):
            raise ValidationError("weight", f"expected [m, d, A] and bias [m, A], got {tuple(weight.shape)}, {tuple(bias.shape)}")
        policy = cls(weight.shape[0], weight.shape[1], weight.shape[2])
        with torch.no_grad():
            policy.weight.copy_(weight)
            policy.bias.copy_(bias)
        return policy

    @classmethod
    def from_single(cls, modules: Sequence[nn.Linear]) -> "StackedLinearPolicy":
        """Stack per-expert ``nn.Linear(obs_dim, n_actions)`` modules."""
        if not modules or any(not isinstance(m, nn.Linear) or m.bias is None for m in modules):
            raise ValidationError("modules", "expected a non-empty list of nn.Linear with bias")
        if len({(m.in_features, m.out_features) for m in modules}) != 1:
            raise ValidationError("modules", "all linear modules must have the same shape")
        weight = torch.stack([m.weight.detach().T for m in modules])
        bias = torch.stack([m.bias.detach() for m in modules])
        return cls.from_weights(weight, bias)


# The gains and thresholds of Gymnasium's LunarLander heuristic (``gymnasium.envs.box2d.lunar_lander.heuristic``), in
# the order of ``StackedLanderHeuristic``'s ``gains`` columns.
LANDER_HEURISTIC_GAINS = {
    "x_to_angle": 0.5,  # angle target = clip(x_to_angle * x + vx_to_angle * vx, +-angle_limit)
    "vx_to_angle": 1.0,
    "angle_limit": 0.4,
    "x_to_hover": 0.55,  # hover target = x_to_hover * |x|
    "angle_error": 0.5,  # angle_todo = angle_error * (target - angle) - angular_damping * angular velocity
    "angular_damping": 1.0,
    "hover_error": 0.5,  # hover_todo = hover_error * (target - y) - vertical_damping * vy
    "vertical_damping": 0.5,
    "contact_damping": 0.5,  # a leg touches: angle_todo = 0, hover_todo = -contact_damping * vy
    "hover_threshold": 0.05,  # main engine if hover_todo > |angle_todo| and hover_todo > hover_threshold
    "angle_threshold": 0.05,  # else left engine if angle_todo < -angle_threshold, right if > angle_threshold
}


@register_family
class StackedLanderHeuristic(StackedPolicy):
    """m copies of Gymnasium's LunarLander heuristic controller, each with its own gains and thresholds.

    ``gains`` is [m, 11] in the order of ``LANDER_HEURISTIC_GAINS`` (its values reproduce Gymnasium's heuristic
    exactly). The controller picks one action per state; the logits are ``logit_scale`` on that action and 0
    elsewhere, so the ``"argmax"`` softening of ``ExpertSet`` plays the controller, and ``logit_scale`` matters only
    for the raw softmax. Observation: (x, y, vx, vy, angle, angular velocity, leg 1 contact, leg 2 contact).
    """

    family = "lander_heuristic"

    def __init__(self, n_experts: int, obs_dim: int = 8, n_actions: int = 4, logit_scale: float = 1.0):
        super().__init__(n_experts, obs_dim, n_actions)
        if (obs_dim, n_actions) != (8, 4):
            raise ValidationError("obs_dim", f"the lander heuristic needs obs_dim 8 and 4 actions, got {obs_dim}, "
                                  f"{n_actions}")
        if not isinstance(logit_scale, (int, float)) or not logit_scale > 0:
            raise ValidationError("logit_scale", f"must be a positive number, got {logit_scale!r}")
        self.logit_scale = float(logit_scale)
        self.gains = self._new_parameter(len(LANDER_HEURISTIC_GAINS))

    def config(self) -> dict[str, Any]:
        return {**super().config(), "logit_scale": self.logit_scale}

    def _logits_paired(self, states: torch.Tensor, params: dict[str, torch.Tensor]) -> torch.Tensor:
        g = params["gains"].to(states.dtype).unsqueeze(1).unbind(-1)  # 11 x [m, 1]
        (x_to_angle, vx_to_angle, limit, x_to_hover, angle_error, angular_damping, hover_error, vertical_damping,
         contact_damping, hover_threshold, angle_threshold) = g
        x, y, vx, vy, angle, angular_velocity, leg1, leg2 = states.unbind(-1)
        angle_target = torch.minimum(torch.maximum(x_to_angle * x + vx_to_angle * vx, -limit), limit)
        hover_target = x_to_hover * x.abs()
        contact = (leg1 != 0) | (leg2 != 0)
        angle_todo = torch.where(contact, 0.0, (angle_target - angle) * angle_error - angular_velocity * angular_damping)
        hover_todo = torch.where(contact, -vy * contact_damping, (hover_target - y) * hover_error - vy * vertical_damping)
        main = (hover_todo > angle_todo.abs()) & (hover_todo > hover_threshold)
        action = torch.where(main, 2, torch.where(angle_todo < -angle_threshold, 3,
                                                  torch.where(angle_todo > angle_threshold, 1, 0)))
        logits = torch.zeros(*action.shape, self.n_actions, dtype=states.dtype, device=states.device)
        return logits.scatter_(-1, action.unsqueeze(-1), self.logit_scale)

    @classmethod
    def from_gains(cls, gains: torch.Tensor, logit_scale: float = 1.0) -> "StackedLanderHeuristic":
        """gains [m, 11] in the order of ``LANDER_HEURISTIC_GAINS``."""
        gains = torch.as_tensor(gains, dtype=torch.float32)
        if gains.dim() != 2 or gains.shape[1] != len(LANDER_HEURISTIC_GAINS) or not torch.isfinite(gains).all():
            raise ValidationError("gains", f"expected finite [m, {len(LANDER_HEURISTIC_GAINS)}], got {tuple(gains.shape)}")
        policy = cls(gains.shape[0], logit_scale=logit_scale)
        with torch.no_grad():
            policy.gains.copy_(gains)
        return policy
