"""Arithmetic on discretised privacy loss distributions: self-composition by FFT, sized before it is built, and
epsilon for a delta.

The k-fold self-composition of a dense privacy-loss PMF is its k-th convolution power: one real-input FFT, the k-th
power of the transform by repeated squaring, one inverse FFT, on a window of losses outside of which at most
``TAIL_MASS`` of the composed mass lies (Chernoff bounds; the truncated mass is added to the loss +infinity, so the
result stays pessimistic). This is what ``dp_accounting``'s ``DensePLDPmf.self_compose`` computes (Koskela, Jalko,
Honkela 2020, "Computing Tight Differential Privacy Guarantees Using FFT"), with the transform of the real masses
half the size, the power 10x faster than exp(k log z), and more Chernoff orders for short PMFs.

``plan_self_composition`` predicts the points of that window (and of the FFT buffer) from the single-step PMF before the
composed one is built. It is non-decreasing in k: each Chernoff bound of the window's upper end, minus k times the
mean loss index, is non-decreasing in k (Jensen: log E e^{tX} >= t E X for the normalised PMF), and each bound of
its lower end, minus the same, is non-increasing; so a composition refused at k is refused at every larger k.
"""

from __future__ import annotations

import math

import numpy as np

TAIL_MASS = 1e-15  # mass a self-composition may move from outside its window to the loss +infinity


def _chernoff_orders(size: int) -> np.ndarray:
    """Positive orders t (per grid index) of the window's Chernoff bounds: dp_accounting's j / size, j = 1..20
    (``compute_self_convolve_bounds``), and for short PMFs (a wide grid step relative to the loss, as at large
    noise, composed 10^5-10^6 times) orders down to 1e-4 / size, which narrow the window up to 3x there. Every order
    gives a valid bound, so the minimum over more of them is one too."""
    orders = np.arange(1, 21, dtype=float) / size
    if size <= 4096:  # long PMFs: dp_accounting's orders are already near the optimum, and more cost time
        orders = np.concatenate([orders, np.geomspace(1e-4, 1.0, 17)[:-1] / size])
    return orders


def _log_mgfs(probs: np.ndarray, orders: np.ndarray) -> np.ndarray:
    """log E exp(t X) of the grid index X under the normalised ``probs``, at every order t (rows of a matrix for
    short PMFs, one pass per order for long ones)."""
    from scipy.special import logsumexp

    index = np.arange(probs.size, dtype=float)
    with np.errstate(divide="ignore"):
        log_probs = np.log(probs) - math.log(probs.sum())
    if probs.size * orders.size <= 1 << 20:
        return logsumexp(np.outer(orders, index) + log_probs[None, :], axis=1)
    return np.array([logsumexp(order * index + log_probs) for order in orders])


def convolution_window(probs: np.ndarray, count: int, tail_mass: float = TAIL_MASS) -> tuple[float, float]:
    """Real bounds (low, high) on the grid indices of ``count`` self-convolutions of ``probs`` outside of which at
    most ``tail_mass`` lies: the best Chernoff bound over ``_chernoff_orders`` on each side (of the normalised PMF:
    valid, and at most a factor (1 - infinity mass)^-count looser in probability), clipped to the full support."""
    orders = _chernoff_orders(probs.size)
    log_two_over_tail = math.log(2 / tail_mass)
    high, low = float((probs.size - 1) * count), 0.0
    for sign in (1.0, -1.0):
        bounds = (count * _log_mgfs(probs, sign * orders) + log_two_over_tail) / (sign * orders)
        bounds = bounds[np.isfinite(bounds)]
        if bounds.size and sign > 0:
            high = min(high, float(bounds.min()))
        elif bounds.size:
            low = max(low, float(bounds.max()))
    return low, max(high, low)


def dense_size(pmf) -> int:
    """Points of ``pmf`` once dense (what composing it with a dense PMF allocates)."""
    losses = getattr(pmf, "_loss_probs", None)
    if losses is None:
        return pmf.size
    return max(losses) - min(losses) + 1 if losses else 1


def plan_self_composition(pmf, count: int):
    """(the PMF to compose, its Chernoff window or None, the points of the result) for ``count`` self-compositions
    of ``pmf``, before anything is built. The points (window or FFT buffer, the larger) are an upper bound,
    non-decreasing in ``count`` (module docstring)."""
    if count <= 1 or pmf.size <= 1:
        return pmf, None, dense_size(pmf)
    dense = pmf.to_dense_pmf()
    low, high = convolution_window(np.asarray(dense._probs, dtype=float), count)
    return dense, (low, high), max(math.floor(high - low) + 3, dense.size)


def _power(values: np.ndarray, exponent: int) -> np.ndarray:
    """values ** exponent by repeated squaring, in place (``values`` is consumed): 2 log2(exponent) products, 10x
    faster than the complex power (which evaluates exp(exponent log z)) and as accurate (relative error
    ~ exponent * 1e-16 either way), with two arrays alive at a time."""
    result = None
    while exponent:
        if exponent & 1:
            if result is None:
                result = values.copy() if exponent > 1 else values
            else:
                result *= values
        exponent >>= 1
        if exponent:
            values *= values
    return result


def self_compose_planned(pmf, count: int, window):
    """``count`` self-compositions of ``pmf`` as ``plan_self_composition`` planned them (module docstring)."""
    from dp_accounting.pld import pld_pmf
    from scipy import fft

    if window is None:
        return pmf.self_compose(count, TAIL_MASS) if count > 1 else pmf
    probs = np.asarray(pmf._probs, dtype=float)
    low, high = math.floor(window[0]), math.ceil(window[1])
    length = high - low + 1
    size = fft.next_fast_len(max(length, probs.size), real=True)
    composed = fft.irfft(_power(fft.rfft(probs, size), count), size, overwrite_x=True)
    start = low % size  # the window starts at index low of the circular convolution
    composed = composed[start:start + length] if start + length <= size else np.concatenate(
        [composed[start:], composed[:start + length - size]])
    infinity = TAIL_MASS - math.expm1(count * math.log1p(-pmf._infinity_mass))
    return pld_pmf.DensePLDPmf(pmf._discretization, pmf._lower_loss * count + low, composed, infinity,
                               pmf._pessimistic_estimate)


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


__all__ = ["TAIL_MASS", "convolution_window", "epsilon_for_delta", "plan_self_composition", "self_compose_planned"]
