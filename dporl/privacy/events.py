"""Descriptions of privacy-relevant releases.

An event describes exactly one release as the code performs it (sampling scheme, rate, noise), so that any
accountant can analyse it and a ledger can replay a whole run's events into a joint analysis. Noise multipliers
are noise standard deviation (or Laplace scale) divided by the L2 (or L1) sensitivity of the released sum.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Union

from dporl.utils.validation import ValidationError, check_positive, check_probability


@dataclass(frozen=True)
class PoissonGaussianEvent:
    """Gaussian sum over a Poisson sample (each unit independently with ``sample_rate``); add/remove adjacency.

    ``sample_rate = 1`` is the plain Gaussian mechanism.
    """

    noise_multiplier: float
    sample_rate: float = 1.0

    def __post_init__(self) -> None:
        check_positive("noise_multiplier", self.noise_multiplier)
        check_probability("sample_rate", self.sample_rate, allow_zero=False)


@dataclass(frozen=True)
class MixtureEvent:
    """With probability ``probability`` run ``event``; otherwise a data-independent step.

    The branch taken is observable (a noiseless step is visible in the iterates), so the privacy loss is a
    mixture of zero loss and ``event``'s loss: PLD = (1 - p) * point_mass(0) + p * PLD(event).
    """

    probability: float
    event: PoissonGaussianEvent

    def __post_init__(self) -> None:
        check_probability("probability", self.probability)
        if not isinstance(self.event, PoissonGaussianEvent):
            raise ValidationError("event", "a mixture wraps a PoissonGaussianEvent")


@dataclass(frozen=True)
class ApproxDPEvent:
    """A mechanism known only to be (epsilon, delta)-DP (e.g. one sparse-vector stable-prefix run).

    ``replace_one`` marks guarantees proved for replace-one adjacency (DP-LSW / DP-LSL) rather than add/remove.
    """

    epsilon: float
    delta: float = 0.0
    replace_one: bool = False

    def __post_init__(self) -> None:
        check_positive("epsilon", self.epsilon, allow_zero=True)
        check_probability("delta", self.delta, allow_one=False)


@dataclass(frozen=True)
class LaplaceEvent:
    """Laplace noise with scale = noise_multiplier * L1 sensitivity (pure eps = 1 / noise_multiplier)."""

    noise_multiplier: float

    def __post_init__(self) -> None:
        check_positive("noise_multiplier", self.noise_multiplier)


@dataclass(frozen=True)
class SampledWithoutReplacementGaussianEvent:
    """Gaussian sum over a uniformly random subset of fixed size ``sample_size`` out of ``population`` units.

    Replace-one adjacency; ``noise_multiplier`` is relative to the replace-one L2 sensitivity (2 x clip norm for
    a clipped sum), so callers pass sigma_noise / (2 C).
    """

    noise_multiplier: float
    sample_size: int
    population: int

    def __post_init__(self) -> None:
        check_positive("noise_multiplier", self.noise_multiplier)
        if self.sample_size < 1 or self.population < self.sample_size:
            raise ValidationError(
                "sample_size", f"need 1 <= sample_size <= population, got {self.sample_size}, {self.population}"
            )


@dataclass(frozen=True)
class ReplaceOneEvent:
    """``event`` (a release analysed for add/remove neighbours) analysed for replace-one neighbours instead.

    A replacement is one removal and one addition; ``dporl.privacy.relations`` gives the analysis (tight for the
    Poisson-subsampled Gaussian and the mixture step, twice the sensitivity for Laplace, group privacy for an event
    known only as (eps, delta)-DP). Recorded by runs whose neighbouring relation is replace-one, so that every
    accountant, calibration and budget check of such a run analyses what its guarantee states.
    """

    event: Union[PoissonGaussianEvent, MixtureEvent, ApproxDPEvent, LaplaceEvent]

    def __post_init__(self) -> None:
        if not isinstance(self.event, (PoissonGaussianEvent, MixtureEvent, ApproxDPEvent, LaplaceEvent)):
            raise ValidationError("event", f"no replace-one conversion for {type(self.event).__name__}")
        if isinstance(self.event, ApproxDPEvent) and self.event.replace_one:
            raise ValidationError("event", "this event is already analysed for replace-one neighbours")


@dataclass(frozen=True)
class SelectionEvent:
    """Release the best of K independent runs of one trial mechanism, K random (Liu & Talwar 2019, "Private selection
    from private candidates"; Papernot & Steinke 2022, "Hyperparameter tuning with Renyi differential privacy").

    ``trial``: the trial's events as its ledger records them, as parts composed in parallel (one per cell of the
    trial's partition of the units; a single part without one), each part a sequential composition of
    (event, count) pairs. ``distribution``: "negative_binomial" (K on {1, 2, ...} with P[K = k] proportional to
    (1 - gamma)^k prod_{l<k} (l + eta) / (l + 1); eta = 1 geometric, eta = 0 logarithmic, gamma = 1 exactly one run)
    or "poisson" (K ~ Poisson(mu) on {0, 1, ...}; K = 0 releases nothing). ``dporl.privacy.selection`` analyses it.
    """

    trial: tuple
    distribution: str = "negative_binomial"
    eta: float = 1.0
    gamma: float = 1.0
    mu: float = 1.0

    def __post_init__(self) -> None:
        if self.distribution not in ("negative_binomial", "poisson"):
            raise ValidationError("selection.distribution", f"expected 'negative_binomial' or 'poisson', got "
                                  f"{self.distribution!r}")
        if isinstance(self.eta, bool) or not isinstance(self.eta, (int, float)) or not 0 <= self.eta < float("inf"):
            raise ValidationError("selection.eta", f"must be a finite number >= 0, got {self.eta!r}")
        check_probability("selection.gamma", self.gamma, allow_zero=False)
        check_positive("selection.mu", self.mu)
        if not isinstance(self.trial, tuple) or not self.trial:
            raise ValidationError("selection.trial", "the trial's events: a non-empty tuple of parts")
        for part in self.trial:
            if not isinstance(part, tuple) or not all(
                isinstance(pair, tuple) and len(pair) == 2 and isinstance(pair[1], int) and pair[1] >= 0
                and isinstance(pair[0], _EVENT_CLASSES) and not isinstance(pair[0], SelectionEvent) for pair in part
            ):
                raise ValidationError("selection.trial", "each part is a tuple of (event, count) pairs (a trial is no "
                                      f"selection itself), got {part!r}")


PrivacyEvent = Union[
    PoissonGaussianEvent, MixtureEvent, ApproxDPEvent, LaplaceEvent, SampledWithoutReplacementGaussianEvent,
    ReplaceOneEvent, SelectionEvent,
]

_EVENT_CLASSES = (PoissonGaussianEvent, MixtureEvent, ApproxDPEvent, LaplaceEvent,
                  SampledWithoutReplacementGaussianEvent, ReplaceOneEvent, SelectionEvent)
_EVENT_TYPES = {cls.__name__: cls for cls in _EVENT_CLASSES}


def event_to_dict(event: PrivacyEvent) -> dict[str, Any]:
    """JSON/torch-safe description of an event (used in checkpoints and reports)."""
    payload: dict[str, Any] = {"type": type(event).__name__}
    for field in dataclasses.fields(event):
        value = getattr(event, field.name)
        payload[field.name] = event_to_dict(value) if dataclasses.is_dataclass(value) else value
    if isinstance(event, SelectionEvent):  # parts of (event, count) pairs
        payload["trial"] = [[[event_to_dict(e), c] for e, c in part] for part in event.trial]
    return payload


def event_from_dict(payload: dict[str, Any]) -> PrivacyEvent:
    payload = dict(payload)
    name = payload.pop("type", None)
    if name not in _EVENT_TYPES:
        raise ValidationError("event.type", f"unknown privacy event {name!r}")
    if name == "SelectionEvent":
        trial = payload.get("trial")
        if not isinstance(trial, list) or not all(
            isinstance(part, list) and all(isinstance(pair, list) and len(pair) == 2 and isinstance(pair[0], dict)
                                           for pair in part) for part in trial
        ):
            raise ValidationError("event.trial", "a selection's trial: a list of parts of [event, count] pairs")
        payload["trial"] = tuple(tuple((event_from_dict(e), c) for e, c in part) for part in trial)
    kwargs = {k: event_from_dict(v) if isinstance(v, dict) else v for k, v in payload.items()}
    return _EVENT_TYPES[name](**kwargs)
