"""Multilayer perceptrons of dporl's algorithms and released policies, with their sizes checked before allocation.

Declared network sizes are checked against the bounds below before anything is allocated (absurd hidden sizes, or a
dataset declaring 10^12 actions, must be a named error, not an attempt to allocate a petabyte).
"""

from __future__ import annotations

import numbers
from typing import Any

from torch import nn

from dporl.utils.validation import ValidationError

# Declared network sizes are checked against these before anything is allocated (absurd hidden sizes, or a dataset
# declaring 10^12 actions, must be a named error, not an attempt to allocate a petabyte).
MAX_OBS_DIM = 1 << 16
MAX_ACTIONS = 1 << 20
MAX_WIDTH = 1 << 16
MAX_LAYERS = 64
MAX_PARAMETERS = 1 << 30  # 4 GiB of float32


def _bounded_count(field: str, value: Any, bound: int, minimum: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral) or not minimum <= value <= bound:
        raise ValidationError(field, f"must be an integer in [{minimum}, {bound}], got {value!r}")
    return int(value)


def check_hidden_sizes(field: str, hidden_sizes: Any) -> list[int]:
    if not isinstance(hidden_sizes, (list, tuple)) or not 1 <= len(hidden_sizes) <= MAX_LAYERS:
        raise ValidationError(field, f"expected 1 to {MAX_LAYERS} positive layer sizes, got {hidden_sizes!r}")
    return [_bounded_count(f"{field}[{i}]", h, MAX_WIDTH) for i, h in enumerate(hidden_sizes)]


def check_mlp_sizes(field: str, obs_dim: Any, hidden_sizes: Any, n_actions: Any) -> tuple[int, list[int], int]:
    """Validated (obs_dim, hidden_sizes, n_actions) of an MLP, refusing absurd sizes before allocation."""
    obs_dim = _bounded_count(f"{field}.obs_dim", obs_dim, MAX_OBS_DIM)
    n_actions = _bounded_count(f"{field}.n_actions", n_actions, MAX_ACTIONS, minimum=2)
    hidden = check_hidden_sizes(f"{field}.hidden_sizes", hidden_sizes)
    sizes = [obs_dim, *hidden, n_actions]
    parameters = sum((a + 1) * b for a, b in zip(sizes[:-1], sizes[1:]))
    if parameters > MAX_PARAMETERS:
        raise ValidationError(f"{field}.hidden_sizes", f"{parameters:.3g} parameters; at most {MAX_PARAMETERS:.3g}")
    return obs_dim, hidden, n_actions


def mlp(in_dim: int, hidden_sizes: list[int], out_dim: int) -> nn.Sequential:
    layers: list[nn.Module] = []
    for width in hidden_sizes:
        layers += [nn.Linear(in_dim, width), nn.ReLU()]
        in_dim = width
    layers.append(nn.Linear(in_dim, out_dim))
    return nn.Sequential(*layers)
