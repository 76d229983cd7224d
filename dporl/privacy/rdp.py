"""Renyi differential privacy (RDP) curves of privacy events and their conversion to (epsilon, delta).

RDP is summed over a fixed grid of orders and converted with the tight conversion of Balle et al. 2020 ("Hypothesis
Testing Interpretations and Renyi Differential Privacy"; ``dp_accounting.rdp.compute_epsilon``). Poisson Gaussian
from Opacus' RDP analysis (Mironov, Talwar, Zhang 2019, "Renyi Differential Privacy of the Sampled Gaussian
Mechanism"); Laplace from ``dp_accounting``'s ``RdpAccountant``; sampling without replacement (Wang, Balle,
Kasiviswanathan 2019, "Subsampled Renyi Differential Privacy and Analytical Moments Accountant", Theorem 27,
replace-one adjacency) by a vectorised form of ``dp_accounting``'s bound at every order of the grid
(``swor_gaussian_rdp``); the mixture step of Algorithm 3 from the exact formula
RDP_mix(a) = 1/(a-1) log(1 - p + p exp((a-1) RDP_q(a))) (the branch taken is observable). An (epsilon, delta)
event and a replace-one conversion have no RDP curve here: refused, with the way out.
"""

from __future__ import annotations

import functools
import math
from typing import Sequence

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
from dporl.utils.validation import ValidationError

# Renyi orders: fractional ones to 11 (large epsilons; the subsampled Gaussian's cumulant is too convex there to
# interpolate between integers), every integer to 256 (its optimum sits near a sharp transition in alpha: gaps in
# the grid cost up to 10% of epsilon), then a few large ones for tiny epsilons.
FRACTIONAL_ORDERS = tuple(
    [round(1 + x / 10, 2) for x in range(1, 30) if x % 10] + [round(4 + x / 4, 2) for x in range(1, 28) if x % 4]
)
RDP_ORDERS = np.sort(np.array(list(FRACTIONAL_ORDERS) + list(range(2, 257)) + [320, 384, 512, 768, 1024], float))
_INTEGER_ORDERS = RDP_ORDERS[RDP_ORDERS == np.round(RDP_ORDERS)].astype(np.int64)
_IS_FRACTIONAL = RDP_ORDERS != np.round(RDP_ORDERS)
# Sampling without replacement: Theorem 27 of Wang, Balle, Kasiviswanathan (2019) uses forward differences of the
# Gaussian's exp-CGF up to this order and a Stirling-type bound above it (dp_accounting's split). Every order of
# RDP_ORDERS is evaluated: capping the orders at 64 floored epsilon at ~0.101 for delta = 1e-5 (the conversion
# needs large orders for small epsilons), which made calibration fall back to the unamplified bound.
SWOR_EXACT_MAX_ORDER = 256


@functools.lru_cache(maxsize=1024)
def rdp_curve(event: PrivacyEvent) -> np.ndarray:
    """RDP of one event at every order of ``RDP_ORDERS`` (add/remove, or replace-one for sampling without replacement
    and replace-one (epsilon, delta) events)."""
    if isinstance(event, PoissonGaussianEvent):
        from opacus.accountants.analysis.rdp import compute_rdp

        q, sigma = event.sample_rate, event.noise_multiplier
        # Opacus' series for the fractional orders; the exact binomial sum, vectorised, for the integer ones.
        curve = np.empty(len(RDP_ORDERS))
        curve[_IS_FRACTIONAL] = compute_rdp(q=q, noise_multiplier=sigma, steps=1, orders=list(FRACTIONAL_ORDERS))
        curve[~_IS_FRACTIONAL] = _poisson_gaussian_rdp_integer(q, sigma, _INTEGER_ORDERS)
        return curve
    if isinstance(event, MixtureEvent):
        inner = rdp_curve(event.event)
        p = event.probability
        if p == 0:
            return np.zeros_like(inner)
        # log(1 - p + p exp((a-1) r)) / (a-1), evaluated in log space (r can be huge at large orders).
        with np.errstate(divide="ignore"):
            log_mix = np.logaddexp(math.log1p(-p) if p < 1 else -np.inf, math.log(p) + (RDP_ORDERS - 1) * inner)
        return log_mix / (RDP_ORDERS - 1)
    if isinstance(event, SampledWithoutReplacementGaussianEvent):
        return swor_gaussian_rdp(event.sample_size / event.population, event.noise_multiplier)
    if isinstance(event, LaplaceEvent):
        import dp_accounting
        from dp_accounting.rdp import RdpAccountant

        accountant = RdpAccountant(
            orders=list(RDP_ORDERS), neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
        )
        accountant.compose(dp_accounting.LaplaceDpEvent(event.noise_multiplier))
        return np.asarray(accountant.rdp, dtype=float)
    if isinstance(event, SelectionEvent):  # Papernot & Steinke 2022 (dporl.privacy.selection)
        from dporl.privacy.selection import selection_rdp

        return selection_rdp(event)
    if isinstance(event, ReplaceOneEvent):
        raise ValidationError(
            "accountant.mechanism",
            f"{event} is analysed for replace-one neighbours by its privacy loss distribution; account it with "
            "mechanism='pld'",
        )
    if isinstance(event, ApproxDPEvent):
        raise ValidationError(
            "accountant.mechanism",
            f"{event} is only known to be (epsilon, delta)-DP and has no Renyi curve; account it with mechanism='pld' "
            "(the privacy ledger composes an RDP training stage with a PLD release stage jointly)",
        )
    raise ValidationError("event", f"the rdp accountant cannot analyse {type(event).__name__}")


def _poisson_gaussian_rdp_integer(q: float, sigma: float, orders: np.ndarray) -> np.ndarray:
    """Exact RDP of the Poisson-subsampled Gaussian at integer orders a >= 2 (Mironov, Talwar, Zhang 2019):

    RDP(a) = log(sum_{k=0..a} C(a, k) (1-q)^(a-k) q^k exp((k^2 - k) / (2 sigma^2))) / (a - 1).
    """
    from scipy.special import gammaln, logsumexp

    if q == 1.0:
        return orders / (2 * sigma**2)
    a = orders[:, None].astype(float)
    k = np.arange(orders.max() + 1, dtype=float)[None, :]
    valid = k <= a
    k_safe = np.where(valid, k, 0.0)
    log_terms = (
        gammaln(a + 1) - gammaln(k_safe + 1) - gammaln(a - k_safe + 1)
        + (a - k_safe) * math.log1p(-q) + k_safe * math.log(q) + (k_safe**2 - k_safe) / (2 * sigma**2)
    )
    return logsumexp(np.where(valid, log_terms, -np.inf), axis=1) / (orders - 1)


# --------------------------------------------------------------------------------------------- sampling w/o replacement
@functools.lru_cache(maxsize=512)
def _swor_log_differences(sigma: float) -> np.ndarray:
    """Upper bounds on log |Delta^(j+1) g(0)|, j = 0..SWOR_EXACT_MAX_ORDER + 1, for g = (1, e^K(0), e^K(1), ...) and
    K(x) = x (x + 1) / (2 sigma^2): the forward differences of Theorem 27 (Wang, Balle, Kasiviswanathan 2019).

    The differences are taken in log space exactly as ``dp_accounting`` does (``_get_forward_diffs``), one
    vectorised pass per order. At large sigma they cancel catastrophically in float64 (dp_accounting's values are
    rounding noise there, sometimes below the exact ones), so each is returned as log(|computed| + E_j) with the
    forward-error bound E_j = 8 (j + 1) eps_64 sum_k C(j + 1, k) g_k: an upper bound on the exact magnitude that
    exceeds the computed one by the relative rounding bound E_j / |computed| wherever float64 resolves it. Depends on
    sigma only (cached).
    """
    n = SWOR_EXACT_MAX_ORDER
    x = np.arange(n + 2, dtype=float)
    log_g = np.concatenate([[0.0], x * (x + 1) / (2.0 * sigma**2)])  # log of g_0 .. g_{n+2}
    values, signs = log_g.copy(), np.ones(n + 3, dtype=bool)
    computed = np.empty(n + 2)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        for j in range(n + 2):
            k = n + 2 - j
            left, right = values[:k], values[1 : k + 1]
            left_sign, right_sign = signs[:k], signs[1 : k + 1]
            high, low = np.maximum(left, right), np.minimum(left, right)
            gap = low - high
            # Same signs: log |e^right - e^left|; different signs: log (e^left + e^right).
            difference = np.where(left == right, -np.inf, high + np.log1p(-np.exp(gap)))
            total = np.where(low == -np.inf, high, high + np.log1p(np.exp(gap)))
            difference_sign = np.where(right_sign, right >= left, right < left)
            same = left_sign == right_sign
            values[:k] = np.where(same, difference, total)
            signs[:k] = np.where(same, difference_sign, right_sign)
            computed[j] = values[0]
    from scipy.special import gammaln, logsumexp

    order = np.arange(1, n + 3, dtype=float)[:, None]  # difference order j + 1
    k = np.arange(n + 3, dtype=float)[None, :]
    inside = k <= order
    log_binomial = gammaln(order + 1) - gammaln(np.minimum(k, order) + 1) - gammaln(np.maximum(order - k, 0) + 1)
    scale = logsumexp(np.where(inside, log_binomial + log_g[None, :], -np.inf), axis=1)
    error = scale + np.log(8.0 * np.finfo(float).eps * order[:, 0])
    return np.logaddexp(computed, error)


def _swor_log_moments(q: float, sigma: float, orders: np.ndarray) -> np.ndarray:
    """log A_a of Theorem 27 at integer orders a >= 1 (dp_accounting's ``_compute_rdp_sample_wor_gaussian_int``,
    all orders in one matrix): log(1 + sum_{i=2..a} C(a, i) q^i B_i) with B_2 = min(4 (e^{1/sigma^2} - 1),
    2 e^{1/sigma^2}), and for i >= 3 B_i = min(4 sqrt(|D_lo| |D_hi|), 2 e^{K(i-1)}) (differences D as above) when
    a <= SWOR_EXACT_MAX_ORDER, else 2 e^{K(i-1)}."""
    from scipy.special import gammaln, logsumexp

    orders = np.asarray(orders, dtype=np.int64)
    top = int(orders.max())
    if top < 2:
        return np.zeros(len(orders))
    i = np.arange(2, top + 1, dtype=float)
    cgf = i * (i - 1) / (2.0 * sigma**2)  # K(i - 1)
    inv = 1.0 / sigma**2
    first = min(math.log(4) + inv + math.log(-math.expm1(-inv)), inv + math.log(2))
    loose = np.concatenate([[first], math.log(2) + cgf[1:]])
    tight = loose.copy()
    n_exact = min(top, SWOR_EXACT_MAX_ORDER)
    if n_exact >= 3:
        differences = _swor_log_differences(float(sigma))
        j = np.arange(3, n_exact + 1)
        low = differences[2 * (j // 2) - 1]
        high = differences[2 * ((j + 1) // 2) - 1]
        tight[1 : n_exact - 1] = np.minimum(math.log(4) + 0.5 * (low + high), loose[1 : n_exact - 1])
    a = orders[:, None].astype(float)
    log_binomial = gammaln(a + 1) - gammaln(i + 1) - gammaln(np.maximum(a - i, 0) + 1)
    per_term = np.where((orders <= SWOR_EXACT_MAX_ORDER)[:, None], tight[None, :], loose[None, :])
    terms = np.where(i[None, :] <= a, per_term + i * math.log(q) + log_binomial, -np.inf)
    return logsumexp(np.concatenate([np.zeros((len(orders), 1)), terms], axis=1), axis=1)


@functools.lru_cache(maxsize=1024)
def swor_gaussian_rdp(q: float, sigma: float) -> np.ndarray:
    """RDP at every order of ``RDP_ORDERS`` of the Gaussian mechanism (noise multiplier ``sigma`` relative to the
    replace-one sensitivity) on a uniformly random subset of fraction ``q``, replace-one adjacency.

    Theorem 27 of Wang, Balle, Kasiviswanathan (2019) as ``dp_accounting`` evaluates it (fractional orders by its
    Corollary 10 interpolation of log A between the neighbouring integers), at every order up to 1024 in ~20 ms
    instead of dp_accounting's ~3.5 s; equal to dp_accounting's values to 1e-9 at the sample rates and noise levels
    calibration visits, and an upper bound of the exact bound where float64 cannot resolve the forward differences
    (see ``_swor_log_differences``).
    """
    if q >= 1.0:
        return RDP_ORDERS / (2 * sigma**2)
    integer = np.unique(np.concatenate([np.floor(RDP_ORDERS), np.ceil(RDP_ORDERS)]).astype(np.int64))
    log_moments = dict(zip(integer.tolist(), _swor_log_moments(q, sigma, integer)))
    log_moments[1] = 0.0
    low = np.floor(RDP_ORDERS).astype(np.int64)
    high = np.ceil(RDP_ORDERS).astype(np.int64)
    t = RDP_ORDERS - low
    x = np.array([log_moments[int(v)] for v in low])
    y = np.array([log_moments[int(v)] for v in high])
    return ((1 - t) * x + t * y) / (RDP_ORDERS - 1)


def rdp_epsilon(history: Sequence[tuple[PrivacyEvent, int]], delta: float) -> float:
    from dp_accounting.rdp.rdp_privacy_accountant import compute_epsilon

    total = np.zeros_like(RDP_ORDERS)
    for event, count in history:
        total = total + count * rdp_curve(event)
    if not np.any(total):
        return 0.0
    epsilon, _ = compute_epsilon(RDP_ORDERS, total, delta)
    if epsilon <= 0.0:
        # dp_accounting answers exactly 0 when RDP at the smallest order is below delta^2 (a valid Pinsker-type
        # bound). epsilon_for would then replace it by the coarse closed-form bound, so 1 step would cost more
        # than 10 (max_steps assumes epsilon grows with the steps). Report the conversion of Balle et al. 2020
        # (Proposition 12) without that shortcut instead: positive and nondecreasing in the RDP curve.
        usable = RDP_ORDERS > 1.01
        a, r = RDP_ORDERS[usable], np.maximum(total[usable], 0.0)
        epsilon = float(np.min(r + np.log1p(-1 / a) - np.log(delta * a) / (a - 1)))
    return max(0.0, float(epsilon))


__all__ = ["FRACTIONAL_ORDERS", "RDP_ORDERS", "rdp_curve", "rdp_epsilon", "swor_gaussian_rdp"]
