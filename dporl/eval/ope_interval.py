"""The confidence interval of a released ratio of noisy unit sums (DP-WIS, DP-PDIS, DP-DR's estimate).

The release (``dporl.eval.ope_release.release_ratio``) gives, in the unit ball's units, A = sum_u x_u + n_A and
B = sum_u y_u + n_B, the second moments S_aa, S_ab, S_bb of the same rows with their own noise, and the noise std s
per coordinate (public: it comes from epsilon, delta and the sensitivity). The estimate is rho = A / B in centred
value units (value = centre + half rho). The interval is a Fieller-type set (Fieller 1954, "Some problems in
interval estimation"): the values rho0 in [-1, 1] (the declared value range) that a test of "the truth is rho0"
does not reject. At the true rho0, T = A - rho0 B is a sum over independently drawn units (mean 0: E[x - rho0 y] = 0)
plus independent Gaussian noise, so T ~ N(0, V + s^2 (1 + rho0^2)) by the central limit theorem over units, where V
is the sampling variance of sum_u (x_u - rho0 y_u). No linearisation of the ratio and no division by a noisy B.

V is estimated from the released moments: Q(rho0) = S_aa - 2 rho0 S_ab + rho0^2 S_bb, whose noise-free value
sum_u (x_u - rho0 y_u)^2 has expectation V for units drawn alike (and at least V otherwise), and whose own noise is
Gaussian with std s (1 + rho0^2) (the release's S_ab coordinate carries sqrt 2 x y). Where the privacy noise is small
that noise is comparable to V itself, and plugging Q in as if exact under-covers: with s = 0.71 (epsilon 10 at delta
1e-5 for one unit-ball release) the coverage of such a 95% test falls to 0.92 in the worst case over V. The test here
adds a margin kappa s (1 + rho0^2) to Q before use and accepts rho0 when

    T^2 <= z^2 [max(Q(rho0) + kappa s (1 + rho0^2), 0) + s^2 (1 + rho0^2)],

with z the normal quantile of the confidence and kappa (``variance_margin``) the smallest margin whose exact
coverage, integrated over the Gaussian noise of Q, is at least the confidence for EVERY sampling variance V >= 0.
In units of the noise variance n^2 = s^2 (1 + rho0^2) the problem has one parameter: with u = V / n^2, T / n ~
N(0, 1 + u) and Q / n^2 = u + xi / s (xi ~ N(0, 1)), so kappa depends on s and the confidence only, and so does
the guarantee (up to the central limit theorem over units, as for any sampling interval).

The accepted set is the union of two quadratic sets in rho0 (with and without the sampling term, from the max),
reported by its hull within [-1, 1] (a superset: coverage only grows); when nothing is accepted (noisy moments that
contradict each other) the interval is the whole range. Everything here is post-processing of released values and
public inputs: no further read of the data and no further privacy cost.
"""

from __future__ import annotations

import functools
import math
from typing import Optional

import numpy as np

from dporl.eval.ope_scales import OPEScales

# Quadrature for variance_margin: the noise of Q (standard normal xi) and the sampling variance in noise units (u).
_XI = np.linspace(-9.0, 9.0, 1801)
_XI_WEIGHTS = np.exp(-0.5 * _XI**2) / math.sqrt(2 * math.pi) * (_XI[1] - _XI[0])
_U = np.concatenate([[0.0], np.geomspace(1e-4, 1e7, 331)])


def acceptance_probability(kappa: float, noise_std: float, confidence: float, u: np.ndarray = _U) -> np.ndarray:
    """The exact probability that the test (module docstring) accepts the true ratio, for each sampling variance
    ``u`` (in units of the noise variance), integrated over the Gaussian noise of the second moments."""
    from scipy import stats

    z = float(stats.norm.ppf(0.5 + confidence / 2))
    u = np.asarray(u, dtype=np.float64)[:, None]
    estimated = 1.0 + np.maximum(u + (_XI[None, :] + kappa) / noise_std, 0.0)
    accept = 2.0 * stats.norm.cdf(z * np.sqrt(estimated / (1.0 + u))) - 1.0
    return (accept * _XI_WEIGHTS[None, :]).sum(axis=1)


@functools.lru_cache(maxsize=256)
def variance_margin(noise_std: float, confidence: float) -> float:
    """kappa: the smallest margin (in noise stds of Q) whose test covers at least ``confidence`` for every sampling
    variance (module docstring); public inputs only, cached."""
    from scipy import optimize

    if not (noise_std > 0 and math.isfinite(noise_std)):
        return 0.0

    def shortfall(kappa: float) -> float:
        return float(acceptance_probability(kappa, noise_std, confidence).min()) - confidence

    if shortfall(0.0) >= 0:
        return 0.0
    high = 1.0
    while shortfall(high) < 0:
        high *= 2.0
    return float(optimize.brentq(shortfall, high / 2 if high > 1 else 0.0, high, xtol=1e-6)) + 1e-6


def _quadratic_hull(a2: float, a1: float, a0: float) -> Optional[tuple[float, float]]:
    """The hull of {r in [-1, 1]: a2 r^2 + a1 r + a0 <= 0} (None: empty)."""
    points = [-1.0, 1.0]
    if a2 != 0.0:
        disc = a1 * a1 - 4.0 * a2 * a0
        if disc >= 0.0:
            root = math.sqrt(disc)
            points += [(-a1 - root) / (2 * a2), (-a1 + root) / (2 * a2)]
    elif a1 != 0.0:
        points.append(-a0 / a1)
    points = sorted(p for p in points if -1.0 <= p <= 1.0)

    def f(r: float) -> float:
        return (a2 * r + a1) * r + a0

    inside = [p for p in points if f(p) <= 1e-12 * (abs(a2) + abs(a1) + abs(a0))]
    inside += [p for left, right in zip(points, points[1:]) for p in (left, right) if f(0.5 * (left + right)) <= 0]
    return (min(inside), max(inside)) if inside else None


def ratio_set(released: dict[str, float], confidence: float) -> Optional[tuple[float, float]]:
    """The hull of the accepted ratios in [-1, 1] (centred units; module docstring), None when none is accepted."""
    from scipy import stats

    A, B, s = released["A"], released["B"], released["noise_std"]
    z2 = float(stats.norm.ppf(0.5 + confidence / 2)) ** 2
    margin = variance_margin(s, confidence) * s
    # (A - r B)^2 - z^2 [Q(r) + (margin + s^2)(1 + r^2)] <= 0, and (A - r B)^2 - z^2 s^2 (1 + r^2) <= 0
    extra = margin + s * s
    with_sampling = _quadratic_hull(B * B - z2 * (released["S_bb"] + extra), -2 * (A * B - z2 * released["S_ab"]),
                                    A * A - z2 * (released["S_aa"] + extra))
    noise_only = _quadratic_hull(B * B - z2 * s * s, -2 * A * B, A * A - z2 * s * s)
    pieces = [p for p in (with_sampling, noise_only) if p is not None]
    if not pieces:
        return None
    return min(p[0] for p in pieces), max(p[1] for p in pieces)


def ratio_interval(released: dict[str, float], scales: OPEScales, confidence: float, min_signal: float = 0.0
                   ) -> tuple[float, float, float, list[str]]:
    """(value, low, high, notes) in value units from ``release_ratio(moments=True)``'s output (post-processing
    only). The value is NaN when the noisy denominator is <= 0 (no estimate); when it is below ``min_signal`` noise
    stds the interval is the declared range (the set above needs no such guard: it is the range when B is small)."""
    A, B, s = released["A"], released["B"], released["noise_std"]
    lo, hi = scales.value_range
    value = scales.centre + scales.half * A / B if B > 0 else math.nan
    if B <= 0 or B <= min_signal * s:
        return value, lo, hi, [f"noisy denominator {B:.3g} is below {min_signal:g} noise std ({s:.3g}): interval = "
                               "public range"]
    found = ratio_set(released, confidence)
    if found is None:
        return value, lo, hi, ["the released moments reject every value in the range: interval = public range"]
    return value, scales.centre + scales.half * found[0], scales.centre + scales.half * found[1], []
