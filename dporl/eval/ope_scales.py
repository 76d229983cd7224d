"""Public scales of a private evaluation, derived from declared public facts (never read from the data).

A private estimate clips every unit's contribution, so its noise and its clip bias depend on scales: the range of a
policy's value, the largest importance weight, the number of episodes a unit logs. Each is either declared by the
user (a public fact about the problem) or derived here from declared facts, and every result says which:

- **value range** ``[lo, hi]``: bounds on every episode's discounted return, hence on any policy's value. Declared
  directly (``value_range``: e.g. "at most 0.1 of treatment cost per step and one final reward 1": [-2, 1]) or
  derived from the declared per-step ``reward_range`` [r_lo, r_hi], ``gamma`` and the declared ``horizon`` H (the most
  steps an episode takes; None: unbounded) with S = sum_{t < H} gamma^t (1 / (1 - gamma) without a horizon):
  lo = r_lo S if r_lo < 0 else r_lo (an episode may end after one step), hi = r_hi S if r_hi > 0 else r_hi. A table
  whose rewards are all negative gets an all-negative range. Estimates work in centred units: a return G enters as
  (G - centre) / half, within [-1, 1] (``centre``, ``half``).
- **importance-weight clip**: from a declared minimum logging propensity ``min_propensity`` p (every logged action had
  at least this probability under the behaviour policy): a per-step ratio pi / mu is at most 1 / p, and every
  logged propensity below p is raised to p (so the bound holds whatever the logs say); a trajectory's weight is then
  at most W = (1 / p)^H.
- **unit clip** C (``unit_clip``): the norm bound of a unit's clipped contribution (``dporl.eval.ope_release``). With
  the declared ``episodes_per_unit`` k (the most episodes one unit logs) the public maximum of that norm is
  sqrt 2 k W for WIS (sqrt 3 k for DP-FQE's value release: value, episode count, out-of-range count): a C at least
  that large clips nothing (no clip bias, more noise); a smaller declared C scales the largest units down (less
  noise, a bias the interval does not contain). ``clip_choice`` explains the choice in one line.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

from dporl.utils.validation import ValidationError, check_positive, check_probability

SQRT2, SQRT3 = math.sqrt(2.0), math.sqrt(3.0)


def discounted_steps(gamma: float, horizon: Optional[int]) -> float:
    """sum_{t < horizon} gamma^t (``horizon`` None: unbounded episodes, 1 / (1 - gamma); inf when gamma = 1)."""
    if horizon is None:
        return math.inf if gamma >= 1 else 1.0 / (1.0 - gamma)
    return float(horizon) if gamma >= 1 else (1.0 - gamma**horizon) / (1.0 - gamma)


def return_range(reward_range: Sequence[float], gamma: float, horizon: Optional[int]) -> tuple[float, float]:
    """Bounds on an episode's discounted return from per-step reward bounds (module docstring)."""
    r_lo, r_hi = float(reward_range[0]), float(reward_range[1])
    steps = discounted_steps(gamma, horizon)
    return (r_lo * steps if r_lo < 0 else r_lo), (r_hi * steps if r_hi > 0 else r_hi)


def _pair(field: str, value) -> tuple[float, float]:
    try:
        lo, hi = (float(v) for v in value)
    except (TypeError, ValueError):
        raise ValidationError(field, f"expected [low, high], got {value!r}") from None
    if not (math.isfinite(lo) and math.isfinite(hi) and lo < hi):
        raise ValidationError(field, f"expected finite low < high, got {value!r}")
    return lo, hi


@dataclass(frozen=True)
class OPEScales:
    """The declared (public) facts a private evaluation's scales come from; build with ``declare``."""

    value_range: tuple[float, float]
    origin: str  # where the range comes from, for the printed notes
    min_propensity: Optional[float] = None
    horizon: Optional[int] = None
    episodes_per_unit: Optional[float] = None

    @staticmethod
    def check_declared(*, value_range=None, reward_range=None, horizon=None, min_propensity=None,
                       episodes_per_unit=None, prefix: str = "") -> None:
        """Refuse, by name, a declared fact that is malformed (whether one is missing is ``declare``'s call)."""
        if horizon is not None and (int(horizon) != horizon or horizon < 1):
            raise ValidationError(f"{prefix}horizon", f"expected a whole number of steps >= 1, got {horizon!r}")
        if min_propensity is not None:
            check_probability(f"{prefix}min_propensity", min_propensity, allow_zero=False)
        if episodes_per_unit is not None:
            check_positive(f"{prefix}episodes_per_unit", episodes_per_unit)
        if value_range is not None:
            _pair(f"{prefix}value_range", value_range)
        if reward_range is not None:
            _pair(f"{prefix}reward_range", reward_range)

    @classmethod
    def declare(
        cls,
        *,
        value_range: Optional[Sequence[float]] = None,
        reward_range: Optional[Sequence[float]] = None,
        gamma: Optional[float] = None,
        horizon: Optional[int] = None,
        min_propensity: Optional[float] = None,
        episodes_per_unit: Optional[float] = None,
        prefix: str = "",
    ) -> "OPEScales":
        """Scales from declared facts (``prefix``: how the caller's config names the fields, in errors)."""
        cls.check_declared(value_range=value_range, reward_range=reward_range, horizon=horizon,
                           min_propensity=min_propensity, episodes_per_unit=episodes_per_unit, prefix=prefix)
        if value_range is not None:
            lo, hi = _pair(f"{prefix}value_range", value_range)
            origin = f"declared value range [{lo:g}, {hi:g}]"
        elif reward_range is not None:
            r = _pair(f"{prefix}reward_range", reward_range)
            if gamma is None:
                raise ValidationError(f"{prefix}gamma", "deriving the value range from the reward range needs gamma")
            check_probability(f"{prefix}gamma", gamma)
            if gamma >= 1 and horizon is None:
                raise ValidationError(f"{prefix}horizon", "with gamma = 1 the value range needs the declared horizon "
                                      "(the most steps an episode takes)")
            lo, hi = return_range(r, gamma, horizon)
            steps = "unbounded episodes" if horizon is None else f"horizon {int(horizon)}"
            origin = (f"value range [{lo:.4g}, {hi:.4g}] derived from the declared reward range [{r[0]:g}, {r[1]:g}] "
                      f"per step, gamma {gamma:g}, {steps}")
        else:
            raise ValidationError(
                f"{prefix}reward_range", "a private evaluation needs public bounds on the rewards: declare the per-step "
                "reward range (reward_range: [low, high], never read from the data; the value range is derived from "
                "it, gamma and horizon) or the value range itself (value_range: bounds on any episode's discounted "
                "return)")
        return cls((lo, hi), origin, min_propensity, None if horizon is None else int(horizon), episodes_per_unit)

    @property
    def centre(self) -> float:
        return 0.5 * (self.value_range[0] + self.value_range[1])

    @property
    def half(self) -> float:
        """Half the value range: a centred return (G - centre) / half lies in [-1, 1]."""
        return 0.5 * (self.value_range[1] - self.value_range[0])

    @property
    def width(self) -> float:
        return self.value_range[1] - self.value_range[0]

    def max_step_ratio(self) -> Optional[float]:
        """The largest per-step importance ratio, 1 / min_propensity (None: undeclared)."""
        return None if self.min_propensity is None else 1.0 / self.min_propensity

    def max_weight(self) -> Optional[float]:
        """The largest trajectory weight (1 / min_propensity)^horizon (None: either undeclared)."""
        if self.min_propensity is None or self.horizon is None:
            return None
        return math.exp(-self.horizon * math.log(self.min_propensity))

    def max_unit_norm(self, kind: str) -> Optional[float]:
        """The public maximum of a unit's contribution norm for estimator ``kind`` (None: not derivable from what
        was declared). For PDIS / DR it assumes per-episode estimates within max weight x half the range."""
        if self.episodes_per_unit is None:
            return None
        if kind == "fqe":
            return SQRT3 * self.episodes_per_unit
        weight = self.max_weight()
        return None if weight is None else SQRT2 * self.episodes_per_unit * weight

    def unit_clip(self, kind: str, declared: Optional[float], field: str = "unit_clip") -> float:
        """C for ``kind``: the declared one, else the public maximum (refused by name when neither exists)."""
        if declared is not None:
            return check_positive(field, declared)
        maximum = self.max_unit_norm(kind)
        if maximum is None or not math.isfinite(maximum):
            needs = "episodes_per_unit" if kind == "fqe" else "episodes_per_unit, min_propensity and horizon"
            raise ValidationError(field, f"declare the unit clip, or the public facts it is derived from ({needs}): "
                                  "clipping decides the noise and the bias of the estimate")
        return maximum

    def clip_choice(self, kind: str, clip: float) -> str:
        """One line on the bias-variance choice the unit clip makes (public inputs only)."""
        maximum = self.max_unit_norm(kind)
        if maximum is None:
            return (f"unit clip {clip:.4g} (declared; no public maximum: declare episodes_per_unit"
                    f"{'' if kind == 'fqe' else ', min_propensity and horizon'} for one): units above it are scaled "
                    "down, a bias the interval does not contain")
        if clip >= maximum * (1 - 1e-12):
            return (f"unit clip {clip:.4g} >= the public maximum {maximum:.4g} of a unit's contribution: nothing is "
                    "clipped (no clip bias); the noise grows with the clip, a smaller declared unit_clip trades bias "
                    "for noise")
        return (f"unit clip {clip:.4g} below the public maximum {maximum:.4g}: units above it are scaled down (less "
                "noise, a clip bias the interval does not contain)")
