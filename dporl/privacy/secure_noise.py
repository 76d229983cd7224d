"""Secure noise: exact discrete Laplace and discrete Gaussian samplers driven by the operating system's CSPRNG.

What the default ``NoiseSource`` does, and what it does not protect against:

- It draws float32/float64 Gaussian (Box-Muller / Ziggurat inside torch) and Laplace (difference of two
  exponentials) noise from a Philox/Mersenne generator seeded from ``secrets``. Two attacks remain:
  (1) *floating-point attacks* (Mironov 2012): the set of doubles a float sampler can output depends on the
  exact value it was added to, so the low-order bits of ``value + noise`` can reveal ``value`` exactly; the
  printed epsilon assumes real-valued noise and does not hold against an attacker who reads those bits;
  (2) *generator state*: a torch generator is not cryptographic; anyone holding its 64-bit seed or a saved
  state (checkpoints store it) can regenerate and subtract the noise.

- This module's samplers (Canonne, Kamath, Steinke 2020, "The discrete Gaussian for differential privacy",
  Algorithms 1-3) return *integers* whose distribution is exactly the discrete Laplace
  ``P[z] ∝ exp(-|z| / scale)`` or the discrete Gaussian ``P[z] ∝ exp(-z^2 / (2 sigma^2))``, using only
  rational arithmetic on integers from the OS CSPRNG (``os.urandom``, as ``secrets``, unseedable and unrecoverable).
  Adding integer noise to an integer-valued query (or to a query rounded onto a public grid, see
  ``SecureNoiseSource``) leaves no low-order bits to attack, and there is no seed or state to leak.

Guarantees (integer query with sensitivity Delta, in grid units): discrete Laplace with scale t is
(Delta / t)-DP exactly; the discrete Gaussian is (eps, delta)-DP with the exact delta of CKS Theorem 7,
``discrete_gaussian_delta`` below (per coordinate; for vectors the L2 analysis is CKS Theorem 14, rho-zCDP with
rho = Delta^2 / (2 sigma^2) up to a tiny correction, which dporl's accountants do not consume yet).

Cost: exact sampling is a Python loop over coordinates. Measured (2 shared cores, std 3 on the default 2^-10
grid): torch's float Gaussian 0.05 us per coordinate; the discrete Gaussian 66 us from a seeded ``random.Random``
and 220 us from the OS CSPRNG (one system call per integer), the discrete Laplace 22 / 113 us: 1000-4000x slower.
Use it for scalar and low-dimensional releases (sparse-vector thresholds and queries, DP-LSW/LSL outputs,
counts), not for million-parameter DP-SGD steps. For tests, pass a seeded ``random.Random`` as ``rng``.
"""

from __future__ import annotations

import math
import secrets
from fractions import Fraction
from typing import Any, Protocol, Sequence

import numpy as np
import torch

from dporl.privacy.noise import NoiseSource
from dporl.utils.validation import ValidationError, check_positive, check_probability


class RandomIntegers(Protocol):
    def randrange(self, stop: int) -> int: ...


def system_rng() -> RandomIntegers:
    """The OS CSPRNG (``getrandom`` / ``/dev/urandom``, as ``secrets``): no seed, no recoverable state."""
    return secrets.SystemRandom()


# ---------------------------------------------------------------------------------------------- exact Bernoullis
def _bernoulli(numerator: int, denominator: int, rng: RandomIntegers) -> bool:
    """True with probability numerator / denominator (0 <= numerator <= denominator)."""
    return rng.randrange(denominator) < numerator


def _bernoulli_exp_at_most_one(numerator: int, denominator: int, rng: RandomIntegers) -> bool:
    """True with probability exp(-gamma), gamma = numerator / denominator in [0, 1] (CKS Algorithm 1, first case).

    Draw A_k ~ Bernoulli(gamma / k) for k = 1, 2, ... until one fails at index K: P[K > k] = gamma^k / k!, so
    P[K odd] = sum_j (P[K > 2j] - P[K > 2j + 1]) = sum_k (-gamma)^k / k! = exp(-gamma).
    """
    k = 1
    while _bernoulli(numerator, denominator * k, rng):
        k += 1
    return k % 2 == 1


def bernoulli_exp(numerator: int, denominator: int, rng: RandomIntegers) -> bool:
    """True with probability exp(-numerator / denominator) exactly, for integers numerator >= 0, denominator > 0."""
    if numerator < 0 or denominator <= 0:
        raise ValidationError("gamma", f"need numerator >= 0 and denominator > 0, got {numerator}/{denominator}")
    while numerator > denominator:  # exp(-gamma) = exp(-1)^floor(gamma) * exp(-frac): stop at the first failure
        if not _bernoulli_exp_at_most_one(1, 1, rng):
            return False
        numerator -= denominator
    return _bernoulli_exp_at_most_one(numerator, denominator, rng)


# ---------------------------------------------------------------------------------------------- samplers
def _as_fraction(field: str, value: float | Fraction) -> Fraction:
    """The exact rational value of a float (no rounding, so the scale is never silently reduced)."""
    check_positive(field, float(value))
    return value if isinstance(value, Fraction) else Fraction(float(value))


def sample_discrete_laplace(scale: float | Fraction, rng: RandomIntegers | None = None) -> int:
    """One draw of P[z] ∝ exp(-|z| / scale) over the integers (CKS Algorithm 2, scale = t / s)."""
    rng = rng or system_rng()
    scale = _as_fraction("scale", scale)
    t, s = scale.numerator, scale.denominator
    while True:
        u = rng.randrange(t)
        if not bernoulli_exp(u, t, rng):
            continue
        v = 0
        while bernoulli_exp(1, 1, rng):
            v += 1
        y = (u + t * v) // s  # u + t v is geometric with ratio exp(-1/t); dividing by s gives ratio exp(-s/t)
        negative = rng.randrange(2) == 1
        if negative and y == 0:
            continue  # otherwise 0 would be drawn twice as often as it should
        return -y if negative else y


def sample_discrete_gaussian(sigma: float | Fraction, rng: RandomIntegers | None = None) -> int:
    """One draw of P[z] ∝ exp(-z^2 / (2 sigma^2)) over the integers (CKS Algorithm 3).

    Rejection from the discrete Laplace with integer scale t = floor(sigma) + 1: accept y with probability
    exp(-(|y| - sigma^2/t)^2 / (2 sigma^2)), computed as an exact integer ratio.
    """
    rng = rng or system_rng()
    variance = _as_fraction("sigma", sigma) ** 2
    a, b = variance.numerator, variance.denominator  # sigma^2 = a / b
    t = math.floor(math.sqrt(a / b)) + 1
    while True:
        y = sample_discrete_laplace(t, rng)
        # (|y| - sigma^2/t)^2 / (2 sigma^2) = (|y| t b - a)^2 / (2 a b t^2)
        if bernoulli_exp((abs(y) * t * b - a) ** 2, 2 * a * b * t * t, rng):
            return y


# ---------------------------------------------------------------------------------------------- exact analysis
def discrete_gaussian_pmf(sigma: float, radius: int | None = None) -> tuple[np.ndarray, np.ndarray]:
    """(support -R..R, probabilities) of the discrete Gaussian; R = 40 sigma + 40 leaves < 1e-300 mass outside."""
    check_positive("sigma", sigma)
    radius = int(math.ceil(40 * sigma + 40)) if radius is None else radius
    support = np.arange(-radius, radius + 1)
    weights = np.exp(-(support.astype(np.float64) ** 2) / (2 * sigma**2))
    return support, weights / weights.sum()


def discrete_gaussian_delta(epsilon: float, sigma: float, sensitivity: int = 1) -> float:
    """Smallest delta for which integer noise N_Z(0, sigma^2) on a sensitivity-``sensitivity`` integer query is
    (epsilon, delta)-DP (CKS Theorem 7, tight): P[Y > eps s^2/D - D/2] - e^eps P[Y > eps s^2/D + D/2]."""
    check_positive("epsilon", epsilon, allow_zero=True)
    if sensitivity < 1 or int(sensitivity) != sensitivity:
        raise ValidationError("sensitivity", f"must be a positive integer, got {sensitivity}")
    support, pmf = discrete_gaussian_pmf(sigma)
    shift = epsilon * sigma**2 / sensitivity
    first = pmf[support > shift - sensitivity / 2].sum()
    second = pmf[support > shift + sensitivity / 2].sum()
    return float(max(first - math.exp(epsilon) * second, 0.0))


def discrete_gaussian_epsilon(delta: float, sigma: float, sensitivity: int = 1) -> float:
    """Smallest epsilon with ``discrete_gaussian_delta(epsilon) <= delta`` (bisection; delta is decreasing)."""
    check_probability("delta", delta, allow_zero=False, allow_one=False)
    low, high = 0.0, 1.0
    while discrete_gaussian_delta(high, sigma, sensitivity) > delta:
        high *= 2
        if high > 1e6:
            raise ValidationError("delta", f"no finite epsilon reaches delta={delta} at sigma={sigma}")
    for _ in range(60):
        mid = (low + high) / 2
        if discrete_gaussian_delta(mid, sigma, sensitivity) > delta:
            low = mid
        else:
            high = mid
    return high


# ---------------------------------------------------------------------------------------------- NoiseSource twin
class SecureNoiseSource(NoiseSource):
    """A ``NoiseSource`` (accepted wherever one is: DP-SGD engine, output perturbation, sparse vector) whose
    ``gaussian`` and ``laplace`` return exact discrete noise on the grid ``granularity * Z`` from the OS CSPRNG.

    A Gaussian of std ``std`` becomes ``granularity * N_Z(0, (std / granularity)^2)``; a Laplace of scale ``b``
    becomes ``granularity * DLap(b / granularity)``. With ``granularity`` a power of two, multiples of it are exact
    floats, and a released value ``snap(value) + noise`` lies on the grid: its low bits carry nothing. Rounding the
    query to the grid (``snap``) adds at most ``granularity / 2`` to each coordinate's sensitivity; account for it
    (sensitivity in grid units ``ceil(Delta / granularity) + 1`` is always safe).

    What it protects where: against a leaked seed or checkpointed generator state, everywhere (there is none);
    against floating-point attacks, where the released value is snapped to the grid before the noise is added
    (``snap``; dporl's release sites do not do this yet, see the AUDIT note). There is no state to save:
    ``state_dict`` records only the grid, and a resumed run draws fresh noise.
    """

    def __init__(self, granularity: float = 2.0**-10, rng: RandomIntegers | None = None):
        super().__init__()  # the parent's torch generator is never drawn from
        self.reproducible = False
        granularity = check_positive("noise.granularity", granularity)
        mantissa, _ = math.frexp(granularity)
        if mantissa != 0.5:
            raise ValidationError("noise.granularity", f"must be a power of two (exact on the float grid), got {granularity}")
        self.granularity = granularity
        self._rng = rng or system_rng()

    def snap(self, values: torch.Tensor) -> torch.Tensor:
        """Round values to the nearest grid point (do this to the query before adding grid noise)."""
        return torch.round(values / self.granularity) * self.granularity

    def _draw(self, shape: Sequence[int] | int, sampler, parameter: Fraction, dtype: torch.dtype) -> torch.Tensor:
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        count = math.prod(shape)
        draws = [sampler(parameter, self._rng) for _ in range(count)]
        return (torch.tensor(draws, dtype=torch.float64).reshape(shape) * self.granularity).to(dtype)

    def gaussian(self, shape: Sequence[int] | int, std: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        std = check_positive("noise.std", std, allow_zero=True)
        if std == 0:
            shape = (shape,) if isinstance(shape, int) else tuple(shape)
            return torch.zeros(shape, dtype=dtype)
        return self._draw(shape, sample_discrete_gaussian, Fraction(std) / Fraction(self.granularity), dtype)

    def laplace(self, shape: Sequence[int] | int, scale: float, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        scale = check_positive("noise.scale", scale)
        return self._draw(shape, sample_discrete_laplace, Fraction(scale) / Fraction(self.granularity), dtype)

    def state_dict(self) -> dict[str, Any]:
        return {"secure": True, "granularity": self.granularity, "reproducible": False}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if not state.get("secure"):
            raise ValidationError("noise", "cannot resume a secure noise source from a seeded one's state")
        self.granularity = float(state["granularity"])
