"""A hyperparameter search space: dotted config keys, each with the distribution a trial draws its value from.

    space:
      trainer.optimizer.lr: {loguniform: [1.0e-4, 1.0e-2]}
      batch_size: {choices: [128, 256, 512]}
      algorithm.alpha: {uniform: [0.1, 4.0]}
      trainer.max_steps: {int: [500, 2000]}        # uniform over the integers, both ends included

Each trial draws every value independently from its own secret stream. The draws depend on no data, but they must
be fresh and hidden for the selection's analysis: Papernot & Steinke's theorems are about K runs of ONE randomised
mechanism, so each trial's hyperparameters are part of that mechanism's internal randomness. A public sequence of
candidates (a fixed grid walked in order, or draws from a known seed) would make trial i a different mechanism from
trial j, which those theorems do not cover, and the released winner's place in the sequence would bound K from
below. Only the selected trial's values are released.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np

from dporl.utils.validation import ValidationError

KINDS = ("choices", "loguniform", "uniform", "int")
MAX_CHOICES = 1000


@dataclass(frozen=True)
class Dimension:
    """One tuned key: ``choices`` (a list of values), or a range ``loguniform`` / ``uniform`` (floats) / ``int``."""

    key: str
    kind: str
    values: tuple  # choices: the values; ranges: (low, high)

    @property
    def finite(self) -> bool:
        """Whether the dimension has finitely many values (``choices``)."""
        return self.kind == "choices"

    def draw(self, rng: np.random.Generator) -> Any:
        if self.kind == "choices":
            return self.values[int(rng.integers(len(self.values)))]
        low, high = self.values
        if self.kind == "loguniform":
            return float(math.exp(rng.uniform(math.log(low), math.log(high))))
        if self.kind == "uniform":
            return float(rng.uniform(low, high))
        return int(rng.integers(low, high + 1))

    def extremes(self) -> tuple:
        """The values whose validity stands for the whole dimension's (every choice; a range's two ends)."""
        return self.values

    def to_dict(self) -> dict[str, Any]:
        return {self.kind: list(self.values)}


@dataclass(frozen=True)
class SearchSpace:
    dimensions: tuple[Dimension, ...]

    @property
    def keys(self) -> tuple[str, ...]:
        return tuple(d.key for d in self.dimensions)

    def draw(self, rng: np.random.Generator) -> dict[str, Any]:
        """One candidate: a value per key, in the space's order (the same rng gives the same candidate)."""
        return {d.key: d.draw(rng) for d in self.dimensions}

    def to_dict(self) -> dict[str, Any]:
        return {d.key: d.to_dict() for d in self.dimensions}

    @staticmethod
    def parse(space: Any, field: str = "space") -> "SearchSpace":
        """A space from its YAML mapping (module docstring); every error names the key."""
        if not isinstance(space, Mapping) or not space:
            raise ValidationError(field, "a search space maps dotted config keys to {choices|loguniform|uniform|int: "
                                  "...}; give at least one")
        dimensions = []
        for key, spec in space.items():
            where = f"{field}.{key}"
            if not isinstance(key, str) or not key or any(not part for part in key.split(".")):
                raise ValidationError(where, f"not a dotted config key: {key!r}")
            if not isinstance(spec, Mapping) or len(spec) != 1 or next(iter(spec)) not in KINDS:
                raise ValidationError(where, f"expected one of {{{', '.join(f'{k}: ...' for k in KINDS)}}}, got {spec!r}")
            kind, values = next(iter(spec.items()))
            if not isinstance(values, (list, tuple)) or not values:
                raise ValidationError(f"{where}.{kind}", f"expected a non-empty list, got {values!r}")
            if kind == "choices":
                if len(values) > MAX_CHOICES:
                    raise ValidationError(f"{where}.choices", f"at most {MAX_CHOICES} choices, got {len(values)}")
                dimensions.append(Dimension(key, kind, tuple(values)))
                continue
            if len(values) != 2:
                raise ValidationError(f"{where}.{kind}", f"expected [low, high], got {values!r}")
            low, high = values
            number = (int,) if kind == "int" else (int, float)
            if any(isinstance(v, bool) or not isinstance(v, number) or not math.isfinite(v) for v in (low, high)):
                raise ValidationError(f"{where}.{kind}", f"expected two finite {'integers' if kind == 'int' else 'numbers'}"
                                      f", got {values!r}")
            if not low < high:
                raise ValidationError(f"{where}.{kind}", f"expected low < high, got {values!r}")
            if kind == "loguniform" and low <= 0:
                raise ValidationError(f"{where}.{kind}", f"a log-uniform range needs low > 0, got {low!r}")
            cast = int if kind == "int" else float
            dimensions.append(Dimension(key, kind, (cast(low), cast(high))))
        return SearchSpace(tuple(dimensions))


def set_key(data: dict[str, Any], key: str, value: Any) -> dict[str, Any]:
    """``data`` (a plain config mapping) with dotted ``key`` set to ``value`` (nested sections created), in place."""
    from dporl.utils.config import set_dotted

    return set_dotted(data, key.split("."), value)


def get_key(data: Mapping[str, Any], key: str) -> Any:
    """The value at dotted ``key`` of a nested mapping (KeyError when absent)."""
    node: Any = data
    for part in key.split("."):
        if not isinstance(node, Mapping) or part not in node:
            raise KeyError(key)
        node = node[part]
    return node


__all__ = ["Dimension", "SearchSpace", "get_key", "set_key"]
