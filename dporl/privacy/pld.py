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
    SampledWithoutReplacementGaussianEvent,
)
from dporl.utils.validation import ValidationError

COARSEST = 1e-3  # the coarsest grid (events with a wide per-step loss)
FINEST_LEVEL = 14  # the finest grid is COARSEST / 2^14 ~ 6e-8
GRID_SCALE = 0.125  # d <= GRID_SCALE * s: relative overstatement of epsilon ~ 8.5 GRID_SCALE^2 % (0.13%) at most
APPROX_DP_GRID = 1 / 128  # (epsilon, delta) events: d <= epsilon / 128 (a lone one is rounded up by < 0.8%)
MAX_EVENT_POINTS = 2**21  # a history's grid is never so fine that one event's PLD exceeds this many points


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
    Laplace: the loss lies in [-1/b, 1/b].
    """
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
    if isinstance(event, ApproxDPEvent):
        return event.epsilon * APPROX_DP_GRID if event.epsilon > 0 else COARSEST
    spread = loss_spread(event)
    return COARSEST if spread is None else min(COARSEST, GRID_SCALE * spread)


def event_interval(event: PrivacyEvent) -> float:
    """The grid one event asks for (see the module docstring)."""
    return _ladder(_wanted_interval(event))


def _loss_range(event: PrivacyEvent) -> float:
    """Width of the finite part of one event's (truncated) privacy loss, both directions."""
    if isinstance(event, MixtureEvent):
        event = event.event
    if isinstance(event, PoissonGaussianEvent):
        from dp_accounting.pld import privacy_loss_mechanism as plm

        width = 0.0
        directions = [plm.AdjacencyType.REMOVE] + ([plm.AdjacencyType.ADD] if event.sample_rate < 1 else [])
        for direction in directions:
            bounds = plm.GaussianPrivacyLoss(
                event.noise_multiplier, sampling_prob=event.sample_rate, adjacency_type=direction
            ).connect_dots_bounds()
            width = max(width, bounds.epsilon_upper - bounds.epsilon_lower)
        return width
    if isinstance(event, LaplaceEvent):
        return 2.0 / event.noise_multiplier
    if isinstance(event, ApproxDPEvent):
        return 2.0 * event.epsilon
    return 0.0


@functools.lru_cache(maxsize=1024)
def _finest_affordable(event: PrivacyEvent) -> float:
    """The finest ladder grid on which ``event``'s single-step PLD has at most MAX_EVENT_POINTS points."""
    return COARSEST / 2 ** min(FINEST_LEVEL, max(0, math.floor(math.log2(MAX_EVENT_POINTS * COARSEST /
                                                                         max(_loss_range(event), 1e-300)))))


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


@functools.lru_cache(maxsize=128)
def event_pld(event: PrivacyEvent, interval: Optional[float] = None):
    """Pessimistic PLD (both add/remove directions) of one event, on ``interval`` (default: its own grid)."""
    from dp_accounting.pld import privacy_loss_distribution as plds

    d = event_interval(event) if interval is None else interval
    if isinstance(event, PoissonGaussianEvent):
        return gaussian_pld(event.noise_multiplier, event.sample_rate, d)
    if isinstance(event, MixtureEvent):
        # PLD of (branch, output) is (1 - p) * point_mass(0) + p * PLD_q, for the add and the remove direction.
        return event_pld(event.event, d).compute_mixture(plds.identity(d), event.probability)
    if isinstance(event, LaplaceEvent):
        return plds.from_laplace_mechanism(event.noise_multiplier, value_discretization_interval=d)
    if isinstance(event, ApproxDPEvent):
        return approx_dp_pld(event.epsilon, event.delta, d)
    if isinstance(event, SampledWithoutReplacementGaussianEvent):
        raise ValidationError(
            "accountant.mechanism",
            "the pld accountant has no construction for sampling without replacement; use mechanism='rdp'",
        )
    raise ValidationError("event", f"the pld accountant cannot analyse {type(event).__name__}")


def _convolution_bounds(probs: np.ndarray, count: int, tail_mass_truncation: float) -> tuple[int, int]:
    """dp_accounting's Chernoff bounds on the support of ``count`` self-convolutions of ``probs`` outside of which
    at most ``tail_mass_truncation`` lies (``compute_self_convolve_bounds``), tightened with more orders: it tries
    t = j / len for j = 1..20 (per grid index), too large when a short PMF (a wide grid step relative to its loss,
    as at large noise) is composed 10^5-10^6 times; orders down to 10^-4 / len then give a window up to 3x narrower.
    Every order gives a valid bound, so the minimum over more of them is one too."""
    from dp_accounting.pld import common
    from scipy.special import logsumexp

    low, high = common.compute_self_convolve_bounds(probs, count, tail_mass_truncation)
    if probs.size > 4096:  # long PMFs: dp_accounting's orders are already near the optimum, and more cost time
        return low, high
    orders = np.geomspace(1e-4, 1.0, 17)[:-1] / probs.size
    index = np.arange(probs.size, dtype=float)
    with np.errstate(divide="ignore"):
        log_probs = np.log(probs)
    for sign in (1.0, -1.0):
        log_mgf = logsumexp(sign * np.outer(orders, index) + log_probs[None, :], axis=1)
        bound = (count * log_mgf + math.log(2 / tail_mass_truncation)) / (sign * orders)
        bound = bound[np.isfinite(bound)]
        if bound.size and sign > 0:
            high = min(high, math.ceil(float(bound.min())))
        elif bound.size:
            low = max(low, math.floor(float(bound.max())))
    return low, max(high, low)


def _power(values: np.ndarray, exponent: int) -> np.ndarray:
    """values ** exponent by repeated squaring: 2 log2(exponent) products, 10x faster than the complex power
    (which evaluates exp(exponent log z)) and as accurate (relative error ~ exponent * 1e-16 either way)."""
    result, base = None, values
    while exponent:
        if exponent & 1:
            result = base if result is None else result * base
        exponent >>= 1
        if exponent:
            base = base * base
    return result


def _self_compose_pmf(pmf, count: int, tail_mass_truncation: float = 1e-15):
    """``pmf.self_compose(count)`` as dp_accounting computes it for a dense PMF (Chernoff bounds on the composed
    support, one FFT, the count-th power, the inverse FFT, the truncated tail mass added to infinity), with the
    real-input FFT (dp_accounting transforms the real masses as complex numbers: twice the size), the power by
    squaring and tighter bounds (``_convolution_bounds``)."""
    from dp_accounting.pld import pld_pmf
    from scipy import fft

    if count == 1:
        return pmf
    if count <= 64 or pmf.size <= 1:
        # dp_accounting's own path (its sparse composition for few points); above 64 compositions of two or more
        # points it goes dense anyway, deciding so by computing size ** count exactly (seconds at 10^6 steps).
        return pmf.self_compose(count, tail_mass_truncation)
    dense = pmf.to_dense_pmf()
    probs = np.asarray(dense._probs, dtype=float)
    low, high = _convolution_bounds(probs, count, tail_mass_truncation)
    length = high - low + 1
    size = fft.next_fast_len(max(length, probs.size), real=True)
    composed = fft.irfft(_power(fft.rfft(probs, size), count), size)
    composed = np.roll(composed, -low)[:length]
    infinity = tail_mass_truncation - math.expm1(count * math.log1p(-dense._infinity_mass))
    return pld_pmf.DensePLDPmf(dense._discretization, dense._lower_loss * count + low, composed, infinity,
                               dense._pessimistic_estimate)


def self_compose(distribution, count: int):
    """``distribution.self_compose(count)``, both directions (``_self_compose_pmf``)."""
    from dp_accounting.pld import privacy_loss_distribution as plds

    remove = _self_compose_pmf(distribution._pmf_remove, count)
    if distribution._symmetric:
        return plds.PrivacyLossDistribution(remove)
    return plds.PrivacyLossDistribution(remove, _self_compose_pmf(distribution._pmf_add, count))


def _pmf_epsilon(pmf, delta: float) -> float:
    """dp_accounting's ``_get_epsilon_for_delta`` over a dense PMF, with its running sums as cumulative sums (the same
    sequential additions) instead of a Python loop over the losses above epsilon."""
    from dp_accounting.pld import pld_pmf

    if not isinstance(pmf, pld_pmf.DensePLDPmf):
        return float(pmf.get_epsilon_for_delta(delta))
    infinity = pmf._infinity_mass
    if infinity > delta:
        return math.inf
    probs = np.flip(np.asarray(pmf._probs, dtype=float))
    n = probs.size
    losses = (pmf._lower_loss + n - 1 - np.arange(n)) * pmf._discretization  # descending
    with np.errstate(over="ignore", invalid="ignore"):
        upper_after = infinity + np.cumsum(probs)
        lower_after = np.cumsum(np.exp(-losses) * probs)
    upper_before = np.concatenate([[infinity], upper_after[:-1]])
    lower_before = np.concatenate([[0.0], lower_after[:-1]])
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        stop = (upper_before > delta) & (lower_before > 0) & (
            np.log((upper_before - delta) / np.where(lower_before > 0, lower_before, 1.0)) >= losses
        )
    zero = (upper_after >= delta) & (lower_after == 0)
    first_stop = int(np.argmax(stop)) if stop.any() else n
    first_zero = int(np.argmax(zero)) if zero.any() else n
    if first_zero < first_stop:
        return max(0.0, float(losses[first_zero]))
    if first_stop < n:
        upper, lower = upper_before[first_stop], lower_before[first_stop]
    else:
        upper, lower = upper_after[-1], lower_after[-1]
    if upper <= lower + delta:
        return 0.0
    return math.log((upper - delta) / lower)


def epsilon_for_delta(distribution, delta: float) -> float:
    """``distribution.get_epsilon_for_delta(delta)`` (the larger of the two directions), vectorised."""
    epsilon = _pmf_epsilon(distribution._pmf_remove, delta)
    if distribution._symmetric:
        return epsilon
    return max(epsilon, _pmf_epsilon(distribution._pmf_add, delta))


_COMPOSED: "OrderedDict[tuple, Any]" = OrderedDict()
_COMPOSED_CACHE_SIZE = 8


def compose(counts: Mapping[PrivacyEvent, int], build=event_pld, interval: Optional[float] = None):
    """PLD of ``count`` compositions of each event (composition commutes), on ``interval`` (default: the history's
    grid); ``build(event, interval)`` makes one event's PLD. None when nothing is composed."""
    counts = {event: count for event, count in counts.items() if count}
    if not counts:
        return None
    d = history_interval(counts) if interval is None else interval
    key = (build, d, tuple(sorted(counts.items(), key=repr)))
    if key in _COMPOSED:
        _COMPOSED.move_to_end(key)
        return _COMPOSED[key]
    result = None
    for event, count in key[2]:
        part = self_compose(build(event, d), count)
        result = part if result is None else result.compose(part)
    _COMPOSED[key] = result
    if len(_COMPOSED) > _COMPOSED_CACHE_SIZE:
        _COMPOSED.popitem(last=False)
    return result


def clear_caches() -> None:
    event_pld.cache_clear()
    _COMPOSED.clear()


__all__ = [
    "COARSEST",
    "approx_dp_pld",
    "GRID_SCALE",
    "compose",
    "event_interval",
    "event_pld",
    "gaussian_pld",
    "history_interval",
    "loss_spread",
]
