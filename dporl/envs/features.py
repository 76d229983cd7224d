"""Public feature maps for linear value functions: ``phi(obs[..., d]) -> features[..., n]`` with ``n_features``.

Torch in, torch out, batched over any leading dimensions, float32 unless the input is float64. The maps are
public (data-independent) by construction, which the private policy-evaluation analyses require.
"""

from __future__ import annotations

import copy
import itertools
from typing import Sequence

import torch
from torch import nn

from dporl.utils.validation import ValidationError


def _as_bounds(field: str, values: Sequence[float] | torch.Tensor) -> torch.Tensor:
    tensor = torch.as_tensor(values, dtype=torch.float64).reshape(-1)
    if tensor.numel() == 0 or not torch.isfinite(tensor).all():
        raise ValidationError(field, f"expected finite numbers, got {values!r}")
    return tensor


def _check_obs(obs: torch.Tensor, dim: int) -> torch.Tensor:
    obs = torch.as_tensor(obs)
    if obs.ndim == 0 or obs.shape[-1] != dim:
        raise ValidationError("obs", f"expected shape [..., {dim}], got {tuple(obs.shape)}")
    return obs


def _float_dtype(obs: torch.Tensor) -> torch.dtype:
    return obs.dtype if obs.dtype in (torch.float32, torch.float64) else torch.float32


class TabularFeatures:
    """One-hot of a state index held in ``obs[..., 0]`` (``obs`` of shape ``[..., 1]``, e.g. ``dporl/Chain-v0``)."""

    def __init__(self, n_states: int):
        if int(n_states) != n_states or n_states < 1:
            raise ValidationError("n_states", f"must be a positive integer, got {n_states!r}")
        self.n_features = int(n_states)

    def state_index(self, obs: torch.Tensor) -> torch.Tensor:
        """The validated integer state of each observation, ``[...]`` (the position of the one)."""
        obs = _check_obs(obs, 1)
        index = obs[..., 0]
        if obs.is_floating_point() and not torch.equal(index, index.round()):
            raise ValidationError("obs", "tabular features need integer state indices")
        index = index.long()
        if index.numel() and (index.min() < 0 or index.max() >= self.n_features):
            raise ValidationError("obs", f"state indices must lie in [0, {self.n_features})")
        return index

    def __call__(self, obs: torch.Tensor) -> torch.Tensor:
        obs = _check_obs(obs, 1)
        return nn.functional.one_hot(self.state_index(obs), self.n_features).to(_float_dtype(obs))


class StateAggregation:
    """One-hot of the cell of a uniform grid over the box [low, high] with ``bins`` cells per dimension.

    Cell index is row-major over dimensions (last dimension fastest); values outside the box go to the edge cells.
    ``StateAggregation([0], [40], [8])`` groups 40 chain states 5 at a time.
    """

    def __init__(self, low: Sequence[float], high: Sequence[float], bins: Sequence[int] | int):
        self.low, self.high = _as_bounds("low", low), _as_bounds("high", high)
        if self.low.shape != self.high.shape or not (self.high > self.low).all():
            raise ValidationError("high", "low and high need the same length and high > low everywhere")
        bins_tensor = torch.as_tensor(bins).reshape(-1).expand(self.low.shape)
        if bins_tensor.is_floating_point() or (bins_tensor < 1).any():
            raise ValidationError("bins", f"expected positive integers, got {bins!r}")
        self.bins = bins_tensor.long().clone()
        # Row-major strides: cell (i_1, ..., i_d) -> sum_k i_k * prod_{j > k} bins_j.
        self.strides = torch.cat([torch.cumprod(self.bins.flip(0), 0).flip(0)[1:], torch.ones(1, dtype=torch.long)])
        self.n_features = int(self.bins.prod())

    def __call__(self, obs: torch.Tensor) -> torch.Tensor:
        obs = _check_obs(obs, self.low.numel())
        scaled = (obs.to(torch.float64) - self.low) / (self.high - self.low)
        cells = torch.minimum((scaled * self.bins).floor().long().clamp_min(0), self.bins - 1)
        index = (cells * self.strides).sum(-1)
        return nn.functional.one_hot(index, self.n_features).to(_float_dtype(obs))


class FourierBasis:
    """Order-n Fourier basis (Konidaris et al. 2011): phi_c(x) = cos(pi c . x), x scaled to [0, 1] per dimension.

    One feature per c in {0..n}^d, in lexicographic order (last dimension fastest), so the first is the constant 1;
    (n + 1)^d features in all. Scaling is (obs - low) / (high - low), not clipped: the ranges are public and
    should cover the state space.
    """

    def __init__(self, order: int, low: Sequence[float], high: Sequence[float]):
        if int(order) != order or order < 0:
            raise ValidationError("order", f"must be a non-negative integer, got {order!r}")
        self.low, self.high = _as_bounds("low", low), _as_bounds("high", high)
        if self.low.shape != self.high.shape or not (self.high > self.low).all():
            raise ValidationError("high", "low and high need the same length and high > low everywhere")
        dim = self.low.numel()
        self.order = int(order)
        self.coefficients = torch.tensor(list(itertools.product(range(self.order + 1), repeat=dim)), dtype=torch.float64)
        self.n_features = self.coefficients.shape[0]

    @classmethod
    def mountain_car(cls, order: int = 5) -> "FourierBasis":
        """Gymnasium MountainCar-v0 ranges: position in [-1.2, 0.5], velocity in [-0.07, 0.07]."""
        return cls(order, [-1.2, -0.07], [0.5, 0.07])

    def __call__(self, obs: torch.Tensor) -> torch.Tensor:
        obs = _check_obs(obs, self.low.numel())
        scaled = (obs.to(torch.float64) - self.low) / (self.high - self.low)
        return torch.cos(torch.pi * scaled @ self.coefficients.T).to(_float_dtype(obs))


class ModuleFeatures:
    """Features from a frozen torch module (e.g. the penultimate layer of a network trained on public data).

    The module is deep-copied, put in eval mode and its parameters frozen, so later training of the original
    cannot change the features. ``n_features`` is read from the last layer with ``out_features`` unless given.
    """

    def __init__(self, module: nn.Module, n_features: int | None = None):
        if not isinstance(module, nn.Module):
            raise ValidationError("module", f"expected a torch.nn.Module, got {type(module).__name__}")
        self.module = copy.deepcopy(module).eval().requires_grad_(False)
        if n_features is None:
            widths = [m.out_features for m in self.module.modules() if hasattr(m, "out_features")]
            if not widths:
                raise ValidationError("n_features", "cannot infer the output width of this module; pass n_features")
            n_features = widths[-1]
        if int(n_features) != n_features or n_features < 1:
            raise ValidationError("n_features", f"must be a positive integer, got {n_features!r}")
        self.n_features = int(n_features)

    def __call__(self, obs: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            features = self.module(torch.as_tensor(obs))
        if features.shape[-1] != self.n_features:
            raise ValidationError("n_features", f"module returned {features.shape[-1]} features, expected {self.n_features}")
        return features
