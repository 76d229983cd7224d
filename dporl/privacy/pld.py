"""Privacy loss distributions (PLDs) on a grid adapted to each event.

A pessimistic PLD (``dp_accounting.pld``, Meiser & Mohammadi 2018; Koskela, Jalko, Honkela 2020) rounds the privacy
loss onto a grid of spacing ``d``; the connect-the-dots construction (Doroshenko, Ghazi, Kamath, Kumar, Manurangsi
2022, "Connect the Dots: Tighter Discrete Approximations of Privacy Loss Distributions") keeps every hockey-stick
divergence it reports an upper bound at any ``d``. What ``d`` changes is how loose that bound is: over many
compositions the relative overstatement of epsilon is, to a good approximation, a function of d / s alone, where s is
the spread of ONE event's privacy loss (for a Poisson-subsampled Gaussian, s = q sqrt(e^{1/sigma^2} - 1), at most
1 / sigma). Measured from 10^2 to 10^6 compositions at epsilon ~ 1 and ~ 10 and q from 1e-3 to 1: about
8.5 (d / s)^2 percent in the many-step regime (0.2% at d = s / 7, 3.3% at d = s / 1.6, 13% at d = 1.2 s), and far
less for short runs. A fixed grid is therefore loose exactly where long runs take small steps (1e-3 at q = 1e-3, 10^5
steps, epsilon 1 overstates epsilon by 14%) and needlessly fine elsewhere.

Each event here gets the coarsest grid of the nested ladder COARSEST / 2^j with d <= GRID_SCALE * s (its relative
overstatement below ~0.13%); an (epsilon, delta) event, built by connect-the-dots around its two finite losses
(``approx_dp_pld``: compositions of them lose almost nothing on any grid), gets d <= epsilon / 128, which bounds
the rounding of a lone one. A history is composed on the finest grid any of its events asks for, floored
so that no event's single-step PLD exceeds MAX_EVENT_POINTS grid points. The grid depends on the events only, never
on how many times they are composed: for a fixed set of events the reported epsilon is non-decreasing in every count
(what budget checks and step-count searches rely on). Finer nested grids never report more (the connect-the-dots
hockey-stick curve interpolates more knots of the same convex curve), so epsilon also falls with the noise multiplier
across the grid switches.

The Gaussian PLD is dp_accounting's connect-the-dots construction with the inverse privacy loss evaluated as one
vector operation instead of a Python call per grid point (the same formulas; equal to dp_accounting's PMF to
floating-point rounding): 5-8x faster at fine grids.

Resources are bounded before anything is built. One event's PMF has at most ``event_points`` points, computed from
its parameters; an event whose privacy loss spans more than MAX_LOSS_RANGE (a tiny noise multiplier), or whose PMF
would exceed MAX_EVENT_POINTS, is refused with ``AnalysisTooLarge``, which depends on the set of events only, and
the accountants then answer with another upper bound (RDP or closed form). A composition's size is predicted from the single-step PMFs
(``pld_fft.plan_self_composition``); above MAX_COMPOSED_POINTS the history is composed on a grid 2, 4, ... times
coarser, which fits (the window shrinks with the grid) and never reports less (nested grids, as above). Because the
predicted size is non-decreasing in every count, that coarsening is too, and epsilon stays non-decreasing in every
count. Only a composition too large on every grid up to MAX_COARSENING x raises ``CompositionTooLarge``.

Replace-one neighbours (``ReplaceOneEvent``): the replace-one PLD of the add/remove event (``replace_one_pld``; see
``dporl.privacy.relations``) on the add/remove grid of its event, at most REPLACE_ONE_DISCRETIZATION.
"""

from __future__ import annotations

import functools
import math
import numbers
from collections import OrderedDict
from typing import Any, Iterable, Mapping, Optional

import numpy as np

from dporl.privacy.events import (
    ApproxDPEvent,
    LaplaceEvent,
    MixtureEvent,
    PoissonGaussianEvent,
    PrivacyEvent,
    ReplaceOneEvent,
    SampledWithoutReplacementGaussianEvent,
    SelectionEvent,
)
from dporl.privacy.pld_fft import epsilon_for_delta, plan_self_composition, self_compose_planned
from dporl.utils.validation import ValidationError

COARSEST = 1e-3  # the coarsest grid (events with a wide per-step loss)
FINEST_LEVEL = 14  # the finest grid is COARSEST / 2^14 ~ 6e-8
GRID_SCALE = 0.125  # d <= GRID_SCALE * s: relative overstatement of epsilon ~ 8.5 GRID_SCALE^2 % (0.13%) at most
APPROX_DP_GRID = 1 / 128  # (epsilon, delta) events: d <= epsilon / 128 (a lone one is rounded up by < 0.8%)
MAX_EVENT_POINTS = 2**21  # a history's grid is never so fine that one event's PLD exceeds this many points
# An event whose privacy loss spans more than this many nats (a tiny noise multiplier: a single step already costs
# epsilon ~ 100, beyond any budget) has no PLD here: its histories are answered by the RDP bound, in milliseconds.
MAX_LOSS_RANGE = 256.0
MAX_COMPOSED_POINTS = 2**22  # points of a composed PLD (each direction); beyond, a coarser grid
MAX_COARSENING = 2**16  # compositions are coarsened at most this many times (then CompositionTooLarge)
# Replace-one PLDs: at most this grid (at sample rates 1e-3..1e-2 and up to 3e4 steps within 0.3% of 2e-5, where
# 1e-3 overstates epsilon by up to 30%).
REPLACE_ONE_DISCRETIZATION = 1e-4


class AnalysisTooLarge(ValidationError):
    """A PLD (or PRV) grid would be too large to build; the accountants answer with another upper bound."""


class CompositionTooLarge(AnalysisTooLarge):
    """A composition too large on every grid up to MAX_COARSENING times the history's (a count-dependent refusal:
    only a bound that grows with every count, the closed form, may replace it)."""


def check_grid(what: str, points: float, cap: int = MAX_COMPOSED_POINTS) -> None:
    """Refuse (``AnalysisTooLarge``) a privacy-loss grid of more than ``cap`` points, before it is built."""
    if points > cap:
        raise AnalysisTooLarge(
            "accountant", f"{what} needs a privacy-loss grid of about {points:.3g} points (at most {cap}); its noise "
            "is too small for a numerical analysis at this resolution")


def _ladder(target: float) -> float:
    """The coarsest grid COARSEST / 2^j (0 <= j <= FINEST_LEVEL) that is <= ``target``."""
    if not target < COARSEST:
        return COARSEST
    level = min(FINEST_LEVEL, math.ceil(math.log2(COARSEST / target) - 1e-12))
    return COARSEST / 2**level


def loss_spread(event: PrivacyEvent) -> Optional[float]:
    """The spread s of one event's privacy loss that sets its grid (None for (epsilon, delta) events).

    Poisson Gaussian: the standard deviation of the loss for small q, q sqrt(e^{1/sigma^2} - 1), capped by the
    Gaussian's 1 / sigma. A mixture step composes its inner event's loss (or none), so it needs the inner grid.
    Laplace: the loss lies in [-1/b, 1/b]. A replacement (a removal and an addition): twice its event's.
    """
    if isinstance(event, ReplaceOneEvent):
        spread = loss_spread(event.event)
        return None if spread is None else 2 * spread
    if isinstance(event, MixtureEvent):
        event = event.event
    if isinstance(event, PoissonGaussianEvent):
        sigma, q = event.noise_multiplier, event.sample_rate
        inverse = 1.0 / sigma
        return min(q * math.sqrt(math.expm1(min(inverse**2, 700.0))), inverse)
    if isinstance(event, LaplaceEvent):
        return 1.0 / event.noise_multiplier
    return None


def _wanted_interval(event: PrivacyEvent) -> float:
    """The grid spacing one event asks for, before it is rounded down onto the ladder."""
    if isinstance(event, ReplaceOneEvent):
        return min(REPLACE_ONE_DISCRETIZATION, _wanted_interval(event.event))
    if isinstance(event, ApproxDPEvent):
        return event.epsilon * APPROX_DP_GRID if event.epsilon > 0 else COARSEST
    spread = loss_spread(event)
    return COARSEST if spread is None else min(COARSEST, GRID_SCALE * spread)


def event_interval(event: PrivacyEvent) -> float:
    """The grid one event asks for (see the module docstring)."""
    if isinstance(event, ReplaceOneEvent):
        return min(REPLACE_ONE_DISCRETIZATION, event_interval(event.event))
    return _ladder(_wanted_interval(event))


@functools.lru_cache(maxsize=1024)
def _loss_range(event: PrivacyEvent) -> float:
    """Width of the finite part of one event's (truncated) privacy loss and 0, in either direction: what its PMF
    spans on any grid (a mixture adds the loss 0)."""
    replace_one = isinstance(event, ReplaceOneEvent)
    if replace_one:
        event = event.event
    if isinstance(event, MixtureEvent):
        event = event.event
    if isinstance(event, PoissonGaussianEvent):
        from dp_accounting.pld import privacy_loss_mechanism as plm

        kind = plm.AdjacencyType
        directions = [kind.REPLACE] if replace_one else [kind.REMOVE] + ([kind.ADD] if event.sample_rate < 1 else [])
        width = 0.0
        for direction in directions:
            bounds = plm.GaussianPrivacyLoss(
                event.noise_multiplier, sampling_prob=event.sample_rate, adjacency_type=direction
            ).connect_dots_bounds()
            width = max(width, max(bounds.epsilon_upper, 0.0) - min(bounds.epsilon_lower, 0.0))
        return width
    factor = 2.0 if replace_one else 1.0  # twice the sensitivity; group privacy for (eps, delta)
    if isinstance(event, LaplaceEvent):
        return 2.0 * factor / event.noise_multiplier
    if isinstance(event, ApproxDPEvent):
        return 2.0 * factor * event.epsilon
    return 0.0


def event_points(event: PrivacyEvent, interval: float) -> int:
    """An upper bound on the points of ``event``'s PMF (either direction, dense) on a grid of ``interval``, from its
    parameters alone (before it is built)."""
    return int(min(_loss_range(event) / interval, 1e18)) + 3


def check_event_size(event: PrivacyEvent, interval: float) -> None:
    """``AnalysisTooLarge`` (before anything is built) for an event whose loss spans more than MAX_LOSS_RANGE or whose
    PMF on ``interval`` would exceed MAX_EVENT_POINTS (on a history's grid: only an event too wide for the coarsest)."""
    if _loss_range(event) > MAX_LOSS_RANGE:
        raise AnalysisTooLarge(
            "accountant", f"{event}: its privacy loss spans {_loss_range(event):.3g} nats per event (at most "
            f"{MAX_LOSS_RANGE:g} are analysed by PLD); its noise is too small for any budget")
    check_grid(f"{event}", event_points(event, interval), MAX_EVENT_POINTS)


@functools.lru_cache(maxsize=1024)
def _finest_affordable(event: PrivacyEvent) -> float:
    """The finest ladder grid on which ``event``'s single-step PLD has at most MAX_EVENT_POINTS points."""
    steps = (MAX_EVENT_POINTS - 3) * COARSEST / max(_loss_range(event), 1e-300)
    return COARSEST / 2 ** min(FINEST_LEVEL, max(0, math.floor(math.log2(steps))))


def history_interval(events: Iterable[PrivacyEvent], coarsening: float = 1) -> float:
    """The one grid a history's events are composed on: the finest any asks for, floored by the coarsest grid on
    which every event's PLD still fits MAX_EVENT_POINTS. Depends on the set of events, not on their counts.

    ``coarsening`` > 1: ``coarsening`` times the finest spacing asked for (at most COARSEST), NOT rounded onto the
    ladder, so that it varies continuously with the events' parameters: a cheaper, looser analysis whose epsilon is
    smooth in the noise multiplier, which searches use to get close (the ladder's switches would make it a staircase).
    """
    events = list(events)
    if not events:
        return COARSEST
    if coarsening == 1:
        wanted = min(event_interval(event) for event in events)
    else:
        wanted = min(COARSEST, coarsening * min(_wanted_interval(event) for event in events))
    return max(wanted, max(_finest_affordable(event) for event in events))


# --------------------------------------------------------------------------------------------- construction
@functools.lru_cache(maxsize=None)
def _gaussian_loss_class():
    """dp_accounting's Gaussian privacy loss with the inverse privacy loss of many losses as one vector operation
    (a class made on first use: dp_accounting is imported lazily)."""
    from dp_accounting.pld import privacy_loss_mechanism as plm

    adjacency = plm.AdjacencyType

    class VectorisedGaussianPrivacyLoss(plm.GaussianPrivacyLoss):
        def _inverse_privacy_losses(self, losses: np.ndarray) -> np.ndarray:
            """``inverse_privacy_loss`` at every loss of ``losses`` (the formulas of dp_accounting, vectorised)."""
            sensitivity, q, variance = self.sensitivity, self.sampling_prob, self._standard_deviation**2
            kind = self.adjacency_type
            with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
                if kind == adjacency.REPLACE:
                    if q == 1.0:
                        return -losses * variance / sensitivity / 2
                    magnitude = np.abs(losses)
                    log_alpha = 0.5 * (sensitivity / self._standard_deviation) ** 2 + math.log1p(-q) - math.log(q)
                    log_sinh = magnitude / 2 + np.log1p(-np.exp(-magnitude)) - math.log(2)
                    term = log_alpha + log_sinh  # log(sinh(|loss| / 2) alpha)
                    sign = np.where(losses >= 0, 1.0, -1.0)
                    asinh = -sign * np.logaddexp(0.5 * np.logaddexp(0, 2 * term), term)
                    inverse = variance / sensitivity * (asinh - losses / 2)
                    return np.where(losses == 0, 0.0, inverse)
                if kind == adjacency.ADD:
                    if q == 1.0:
                        unsampled = losses
                    else:
                        # -log(e^{-loss} / q + 1 - 1 / q), as dp_accounting's log_a_times_exp_b_plus_c evaluates it
                        log_a_exp_b = -losses + np.log(1 / q)
                        unsampled = -(log_a_exp_b + np.log1p(-np.exp(np.log(-(1 - 1 / q)) - log_a_exp_b)))
                        at_limit = np.isclose(losses, -math.log(1 - q), rtol=1e-9, atol=0.0)
                        unsampled = np.where(at_limit, np.inf, unsampled)
                    return sensitivity + (-0.5 * sensitivity - unsampled * variance / sensitivity)
                if q == 1.0:
                    unsampled = losses
                else:
                    log_a_exp_b = losses + np.log(1 / q)
                    unsampled = log_a_exp_b + np.log1p(-np.exp(np.log(-(1 - 1 / q)) - log_a_exp_b))
                    at_limit = np.isclose(losses, math.log(1 - q), rtol=1e-9, atol=0.0)
                    unsampled = np.where(at_limit, -np.inf, unsampled)
                return -0.5 * sensitivity - unsampled * variance / sensitivity

        def get_delta_for_epsilon(self, epsilon):
            """dp_accounting's ``get_delta_for_epsilon`` with the inverse privacy losses computed at once."""
            scalar = isinstance(epsilon, numbers.Number)
            epsilons = np.array([epsilon], dtype=float) if scalar else np.asarray(epsilon, dtype=float)
            deltas = np.zeros_like(epsilons, dtype=float)
            q = self.sampling_prob
            if q == 1.0 or self.adjacency_type == adjacency.REPLACE:
                inverse = np.full_like(epsilons, True, dtype=bool)
            elif self.adjacency_type == adjacency.ADD:
                inverse = epsilons < -math.log1p(-q)
            else:
                inverse = epsilons > math.log1p(-q)
                deltas[~inverse] = -np.expm1(epsilons[~inverse])
            cutoffs = self._inverse_privacy_losses(epsilons[inverse])
            deltas[inverse] = self.mu_upper_cdf(cutoffs) - np.exp(epsilons[inverse] + self.mu_lower_log_cdf(cutoffs))
            deltas = np.clip(deltas, 0, 1)
            return float(deltas[0]) if scalar else deltas

    return VectorisedGaussianPrivacyLoss


def gaussian_pld(noise_multiplier: float, sample_rate: float, interval: float, *, replace_one: bool = False,
                 sensitivity: float = 1.0):
    """dp_accounting's pessimistic connect-the-dots PLD of the Poisson-subsampled Gaussian mechanism
    (``from_gaussian_mechanism``: add/remove, both directions; or replace-one), built with vectorised inverse losses."""
    from dp_accounting.pld import privacy_loss_distribution as plds
    from dp_accounting.pld import privacy_loss_mechanism as plm

    def single(direction):
        loss = _gaussian_loss_class()(noise_multiplier, sensitivity=sensitivity, sampling_prob=sample_rate,
                              adjacency_type=direction)
        return plds._create_pld_pmf_from_monotone_privacy_loss(
            loss, pessimistic_estimate=True, value_discretization_interval=interval, use_connect_dots=True
        )

    if replace_one:
        return plds.PrivacyLossDistribution(single(plm.AdjacencyType.REPLACE))
    return plds._pld_for_subsampled_mechanism(single, sample_rate)


def approx_dp_pld(epsilon: float, delta: float, interval: float):
    """The pessimistic PLD of a mechanism known only to be (epsilon, delta)-DP, by connect-the-dots.

    Its worst case (Kairouz, Oh, Viswanath 2015) has privacy loss +infinity with probability delta, epsilon with
    (1 - delta) / (1 + e^-epsilon) and -epsilon with (1 - delta) / (1 + e^epsilon), so its hockey-stick divergence
    is delta(x) = delta + sum over the two finite losses L of P(L) (1 - e^(x - L))_+. dp_accounting's
    ``from_privacy_parameters`` rounds both losses up to the grid (every composition then moves up by up to a grid
    step); here the connect-the-dots PMF (Doroshenko et al. 2022) is built on the grid points around -epsilon and
    epsilon from the exact delta(x) at those points: delta(x) is convex in e^x and linear between the two kinks, so the
    interpolation is exact there and an upper bound everywhere, and compositions lose almost nothing (< 0.01% on the
    1e-3 grid at 10 or more events in tests, where rounding up costs up to 20%). A lone event still reports epsilon
    rounded up to the grid.
    """
    from dp_accounting.pld import pld_pmf
    from dp_accounting.pld import privacy_loss_distribution as plds

    points = sorted({math.floor(-epsilon / interval), math.ceil(-epsilon / interval),
                     math.floor(epsilon / interval), math.ceil(epsilon / interval)})
    upper = (1 - delta) / (1 + math.exp(-epsilon))
    lower = (1 - delta) / (1 + math.exp(epsilon))
    x = np.array(points, dtype=float) * interval
    deltas = delta + upper * np.maximum(0.0, -np.expm1(x - epsilon)) + lower * np.maximum(0.0, -np.expm1(x + epsilon))
    return plds.PrivacyLossDistribution(pld_pmf.create_pmf_pessimistic_connect_dots(interval, points, deltas))


def _unanalysable(event: PrivacyEvent) -> ValidationError:
    if isinstance(event, SampledWithoutReplacementGaussianEvent):
        return ValidationError(
            "accountant.mechanism",
            "the pld accountant has no construction for sampling without replacement; use mechanism='rdp'",
        )
    if isinstance(event, SelectionEvent):
        return ValidationError("accountant.mechanism", "a private selection's analysis is a Renyi curve (Papernot & "
                               "Steinke 2022), not a privacy loss distribution; use mechanism='rdp'")
    return ValidationError("event", f"the pld accountant cannot analyse {type(event).__name__}")


def check_constructible(event: PrivacyEvent) -> None:
    """Raise the named refusal if no PLD of ``event`` can be built (whatever its size); nothing is built."""
    inner = event.event if isinstance(event, ReplaceOneEvent) else event
    inner = inner.event if isinstance(inner, MixtureEvent) else inner
    if not isinstance(inner, (PoissonGaussianEvent, LaplaceEvent, ApproxDPEvent)):
        raise _unanalysable(inner)


@functools.lru_cache(maxsize=128)
def replace_one_pld(event: PrivacyEvent, interval: Optional[float] = None):
    """The replace-one privacy loss distribution of one add/remove ``event`` (``dporl.privacy.relations``' module
    docstring), on ``interval`` (default: the grid of ``ReplaceOneEvent(event)``)."""
    from dp_accounting.pld import privacy_loss_distribution as plds

    d = event_interval(ReplaceOneEvent(event)) if interval is None else interval
    if isinstance(event, PoissonGaussianEvent):
        return gaussian_pld(event.noise_multiplier, event.sample_rate, d, replace_one=True)
    if isinstance(event, MixtureEvent):
        return replace_one_pld(event.event, d).compute_mixture(plds.identity(d), event.probability)
    if isinstance(event, LaplaceEvent):
        return plds.from_laplace_mechanism(event.noise_multiplier, sensitivity=2, value_discretization_interval=d)
    if isinstance(event, ApproxDPEvent):
        epsilon, delta = (
            (event.epsilon, event.delta) if event.replace_one
            else (2 * event.epsilon, min(1.0, (1 + math.exp(event.epsilon)) * event.delta))
        )
        return approx_dp_pld(epsilon, delta, d)
    raise ValidationError(
        "event", f"no replace-one PLD for {type(event).__name__}; it is analysed for replace-one natively (use rdp)"
    )


@functools.lru_cache(maxsize=128)
def event_pld(event: PrivacyEvent, interval: Optional[float] = None):
    """Pessimistic PLD (both add/remove directions, or the replace-one PLD of a ``ReplaceOneEvent``) of one event,
    on ``interval`` (default: its own grid). Sized first: ``AnalysisTooLarge`` above MAX_EVENT_POINTS."""
    from dp_accounting.pld import privacy_loss_distribution as plds

    d = event_interval(event) if interval is None else interval
    check_constructible(event)
    check_event_size(event, d)
    if isinstance(event, ReplaceOneEvent):
        return replace_one_pld(event.event, d)
    if isinstance(event, PoissonGaussianEvent):
        return gaussian_pld(event.noise_multiplier, event.sample_rate, d)
    if isinstance(event, MixtureEvent):
        # PLD of (branch, output) is (1 - p) * point_mass(0) + p * PLD_q, for the add and the remove direction.
        return event_pld(event.event, d).compute_mixture(plds.identity(d), event.probability)
    if isinstance(event, LaplaceEvent):
        return plds.from_laplace_mechanism(event.noise_multiplier, value_discretization_interval=d)
    return approx_dp_pld(event.epsilon, event.delta, d)


def _directions(distribution) -> list:
    return [distribution._pmf_remove] + ([] if distribution._symmetric else [distribution._pmf_add])


def _planned(counts: Mapping[PrivacyEvent, int], interval: float) -> Optional[list]:
    """For every (event, count): its PMFs on ``interval`` with their self-composition plans, or None when the
    composed history would exceed MAX_COMPOSED_POINTS in either direction (sized before anything is composed)."""
    plans, sizes = [], [0, 0]
    for event, count in counts.items():
        distribution = event_pld(event, interval)
        planned = [plan_self_composition(pmf, count) for pmf in _directions(distribution)]
        for direction in (0, 1):
            sizes[direction] += planned[min(direction, len(planned) - 1)][2]
        plans.append((count, planned))
    return plans if max(sizes) <= MAX_COMPOSED_POINTS else None


_COMPOSED: "OrderedDict[tuple, Any]" = OrderedDict()
_COMPOSED_CACHE_SIZE = 8


def compose(counts: Mapping[PrivacyEvent, int], interval: Optional[float] = None):
    """PLD of ``count`` compositions of each event (composition commutes), on ``interval`` (default: the history's
    grid) or, where that composition would exceed MAX_COMPOSED_POINTS, on the first grid 2, 4, ... times coarser on
    which it fits (module docstring). None when nothing is composed. ``AnalysisTooLarge`` when an event's PMF would
    exceed MAX_EVENT_POINTS on ``interval``; ``CompositionTooLarge`` when no grid up to MAX_COARSENING x fits."""
    from dp_accounting.pld import privacy_loss_distribution as plds

    counts = {event: count for event, count in sorted(counts.items(), key=repr) if count}
    if not counts:
        return None
    d = history_interval(counts) if interval is None else interval
    key = (d, tuple(counts.items()))
    if key in _COMPOSED:
        _COMPOSED.move_to_end(key)
        return _COMPOSED[key]
    for event in counts:  # the events' own sizes, before anything is built
        check_event_size(event, d)
    coarsening, plans = 1, _planned(counts, d)
    while plans is None:
        coarsening *= 2
        if coarsening > MAX_COARSENING:
            raise CompositionTooLarge(
                "accountant", f"composing {sum(counts.values())} events needs more than {MAX_COMPOSED_POINTS} "
                f"privacy-loss points even on a grid {MAX_COARSENING} times coarser than {d:.3g}")
        plans = _planned(counts, d * coarsening)
    result = None
    for count, planned in plans:
        parts = [self_compose_planned(pmf, count, window) for pmf, window, _ in planned]
        part = plds.PrivacyLossDistribution(*parts)
        result = part if result is None else result.compose(part)
    _COMPOSED[key] = result
    if len(_COMPOSED) > _COMPOSED_CACHE_SIZE:
        _COMPOSED.popitem(last=False)
    return result


def clear_caches() -> None:
    event_pld.cache_clear()
    replace_one_pld.cache_clear()
    _COMPOSED.clear()


__all__ = [
    "COARSEST",
    "AnalysisTooLarge",
    "CompositionTooLarge",
    "GRID_SCALE",
    "MAX_COMPOSED_POINTS",
    "MAX_EVENT_POINTS",
    "approx_dp_pld",
    "check_constructible",
    "compose",
    "epsilon_for_delta",
    "event_interval",
    "event_pld",
    "event_points",
    "gaussian_pld",
    "history_interval",
    "loss_spread",
    "replace_one_pld",
]
