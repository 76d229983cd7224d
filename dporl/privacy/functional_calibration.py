"""Noise calibration for reward-level privacy of Q-learning: Theorem 5 of Wang & Hegde 2019 (seeds/004), kept as
the paper's figure, and the input-perturbation baseline.

Privacy unit "reward": neighbouring reward functions r, r' with sup |r - r'| <= 1; every reward the learner
observes may differ.

Theorem 5 is the paper's figure, NOT a guarantee. It states that Algorithm 1 (T samples, batch B, SGD learning
rate alpha, reset factor J, Q-network Lipschitz bound L, tail parameter k) with Gaussian-process noise of scale
sigma, kernel exp(-beta |x - y|) on [0, 1], is (eps, delta + J exp(-(2k - 8.68 sqrt(beta) sigma)^2 / 2))-DP, where

    v = 4 alpha (k + 1) / B,   beta = 1 / v,   C = (v^2 + v) L^2,
    sigma >= sqrt(2 (T / B) ln(e + eps / delta) C) / eps,   provided 2k > 8.68 sqrt(beta) sigma.

The theorem does not cover what Algorithm 1 releases: the rewards reach the network's parameters additively through
the TD targets (the output biases alone move by alpha per update and per unit of reward shift, whatever L is), and
an attack that reads only the released network tells r from r + 1 at the theorem's calibration
(``dporl.audit.functional_audits.paper_attack_audit``). dporl therefore records its figure with
``PrivacyLedger.paper_claim`` and never as a guarantee; the sound reward-level learners are
``dporl.algos.fnq.RewardPrivateQLearning`` (public-iterate Gaussian updates, accounted as Gaussian events by the
ledger) and input perturbation (below).

The second delta term is the probability that one of the J sample paths leaves the band of half-width 2k that the
proof needs (Lemma 8); the appendix replaces the union bound J p by the exact 1 - (1 - p)^J for J independent
paths, p = exp(-(2k - 8.68 sqrt(beta) sigma)^2 / 2). Both are reported; the figure uses the tighter one.

The seed's worked example is NOT reproducible from its own formula. With T = 5000, B = 64, alpha = 3e-4,
L^2 = 16, eps = 0.9, delta = 1e-4 and k = 23 it states v = 6.19e-5 and sigma ~ 0.313, but 4 alpha (k + 1) / B
= 4.5e-4, and the theorem then demands sigma >= 3.56, for which 8.68 sqrt(beta) sigma ~ 1456 > 2k = 46: the
condition fails and nothing is certified. Because sqrt(beta) sigma ~ sqrt(2 (T/B) ln(e + eps/delta) (1 + v)) L / eps
does not shrink with v, the condition forces k of order 700 here (``smallest_tail_parameter``) and then
sigma ~ 20. We implement the theorem as stated and report every term; we do not tune towards 0.313.

The theorem's premises (stated in every description): the Q-network's Lipschitz constant is at most L, states are
scaled to [0, 1], and the update is plain SGD with step alpha on the mean loss of B samples (T / B is replaced by
the number of updates when transitions are replayed).

Also here, for the input-perturbation baseline (Venkitasubramaniam 2013), a sound guarantee: Gaussian noise on each
of n released rewards; n Gaussian releases of sensitivity 1 compose exactly into one Gaussian mechanism of L2
sensitivity sqrt(n), calibrated exactly (analytic Gaussian mechanism).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass
from typing import Any, Optional

from dporl.privacy.events import PoissonGaussianEvent
from dporl.utils.validation import PrivacyBudgetError, ValidationError, check_positive, check_probability

ANALYSIS = "functional noise, Wang & Hegde 2019 Thm 5 (the paper's figure, NOT a guarantee)"
PAPER_CLAIM_SOURCE = (
    "Wang & Hegde 2019, Theorem 5; it does not cover the released network: rewards reach the parameters through "
    "the TD targets, and dporl.audit's fnq_paper_attack refutes it"
)
UNIT = "reward"
# The constant of Lemma 8 (uniform bound of an Ornstein-Uhlenbeck sample path on [0, 1]).
PATH_BOUND_CONSTANT = 8.68
SEED_EXAMPLE_NOTE = (
    "the seed's worked example (T=5000, B=64, alpha=3e-4, L^2=16, eps=0.9, delta=1e-4, k=23 -> sigma~0.313) is not "
    "reproducible from its own formula: 4 alpha (k+1)/B = 4.5e-4, not 6.19e-5, giving sigma >= 3.56 and violating "
    "2k > 8.68 sqrt(beta) sigma"
)
ASSUMPTIONS = (
    "Q-network Lipschitz constant <= L",
    "states scaled to [0, 1] (1-D kernel exp(-beta|x-y|))",
    "plain SGD with step alpha on the mean loss of B transitions per update",
)


@dataclass(frozen=True)
class FunctionalNoiseCalibration:
    """Every term of Theorem 5 for one configuration; ``epsilon`` / ``delta_total`` is the paper's figure (NOT a
    guarantee: record it with ``paper_claim``)."""

    epsilon: float
    delta: float  # the mechanism's delta (first term)
    updates: float  # T / B in Algorithm 1
    batch_size: int
    learning_rate: float
    tail_k: float
    lipschitz: float
    reset_factor: int
    v: float
    beta: float
    C: float
    sigma_min: float  # the theorem's lower bound on sigma
    sigma: float  # the sigma used (>= sigma_min)
    tail_margin: float  # 2k - 8.68 sqrt(beta) sigma (> 0)
    tail_probability: float  # p = exp(-margin^2 / 2): one path leaves its band
    delta_tail_union: float  # J p (Theorem 5)
    delta_tail: float  # 1 - (1 - p)^J (appendix E.3, used)
    delta_total: float  # delta + delta_tail
    unit: str = UNIT
    analysis: str = ANALYSIS

    def paper_claim(self, ledger) -> None:
        """Record the theorem's (eps, delta) on ``ledger`` as the paper's figure, NOT a guarantee."""
        ledger.paper_claim("Theorem 5 (functional noise)", self.epsilon, self.delta_total, PAPER_CLAIM_SOURCE)

    def to_dict(self) -> dict[str, Any]:
        payload = asdict(self)
        payload.update(assumptions=list(ASSUMPTIONS), note=SEED_EXAMPLE_NOTE, text=self.describe())
        return payload

    def describe(self) -> str:
        return (
            f"the paper's figure, NOT a guarantee: ({self.epsilon:g}, {self.delta_total:.3g}), unit '{self.unit}' "
            f"(sup|r - r'| <= 1), {self.analysis}: "
            f"sigma={self.sigma:.4g} (theorem's minimum {self.sigma_min:.4g}), beta={self.beta:.4g}, v={self.v:.4g}, "
            f"C={self.C:.4g}, T/B={self.updates:g}, k={self.tail_k:g}, J={self.reset_factor}, "
            f"margin 2k - 8.68 sqrt(beta) sigma = {self.tail_margin:.4g}, delta = {self.delta:.3g} + "
            f"tail {self.delta_tail:.3g} (union bound {self.delta_tail_union:.3g}). The theorem's premises: "
            + "; ".join(ASSUMPTIONS)
        )


def theorem5_terms(learning_rate: float, tail_k: float, batch_size: int, lipschitz: float) -> tuple[float, float, float]:
    """(v, beta, C) of Theorem 5."""
    v = 4 * learning_rate * (tail_k + 1) / batch_size
    return v, 1 / v, (v * v + v) * lipschitz**2


def minimum_sigma(epsilon: float, delta: float, updates: float, C: float) -> float:
    """sqrt(2 (T/B) ln(e + eps/delta) C) / eps."""
    return math.sqrt(2 * updates * math.log(math.e + epsilon / delta) * C) / epsilon


def _check_inputs(epsilon, delta, updates, batch_size, learning_rate, tail_k, lipschitz, reset_factor) -> None:
    check_positive("fnq.epsilon", epsilon)
    check_probability("fnq.delta", delta, allow_zero=False, allow_one=False)
    check_positive("fnq.updates", updates)
    check_positive("fnq.learning_rate", learning_rate)
    check_positive("fnq.tail_k", tail_k)
    check_positive("fnq.lipschitz", lipschitz)
    if int(batch_size) != batch_size or batch_size < 1:
        raise ValidationError("fnq.batch_size", f"must be an integer >= 1, got {batch_size}")
    if int(reset_factor) != reset_factor or not 1 <= reset_factor <= math.ceil(updates):
        raise ValidationError("fnq.reset_factor", f"J must be an integer in [1, T/B = {updates:g}], got {reset_factor}")


def calibrate_functional_noise(
    epsilon: float,
    delta: float,
    *,
    updates: float,
    batch_size: int,
    learning_rate: float,
    tail_k: float,
    lipschitz: float,
    reset_factor: int,
    sigma: Optional[float] = None,
) -> FunctionalNoiseCalibration:
    """Theorem 5 for the given parameters (``sigma=None``: the theorem's minimum). Refuses what it cannot certify."""
    _check_inputs(epsilon, delta, updates, batch_size, learning_rate, tail_k, lipschitz, reset_factor)
    v, beta, C = theorem5_terms(learning_rate, tail_k, batch_size, lipschitz)
    sigma_min = minimum_sigma(epsilon, delta, updates, C)
    if sigma is None:
        sigma = sigma_min
    elif sigma < sigma_min:
        raise PrivacyBudgetError(
            "fnq.sigma", f"sigma={sigma:g} is below Theorem 5's minimum {sigma_min:.4g} for eps={epsilon:g}, delta={delta:g}"
        )
    margin = 2 * tail_k - PATH_BOUND_CONSTANT * math.sqrt(beta) * sigma
    if margin <= 0:
        raise PrivacyBudgetError(
            "fnq.tail_k",
            f"Theorem 5 needs 2k > 8.68 sqrt(beta) sigma, but 2k = {2 * tail_k:g} <= {2 * tail_k - margin:.4g} "
            f"(beta={beta:.4g}, sigma={sigma:.4g}); increase k (smallest_tail_parameter finds one)",
        )
    p = math.exp(-margin * margin / 2)
    tail = -math.expm1(reset_factor * math.log1p(-p)) if p < 1 else 1.0
    return FunctionalNoiseCalibration(
        epsilon=float(epsilon),
        delta=float(delta),
        updates=float(updates),
        batch_size=int(batch_size),
        learning_rate=float(learning_rate),
        tail_k=float(tail_k),
        lipschitz=float(lipschitz),
        reset_factor=int(reset_factor),
        v=v,
        beta=beta,
        C=C,
        sigma_min=sigma_min,
        sigma=float(sigma),
        tail_margin=margin,
        tail_probability=p,
        delta_tail_union=reset_factor * p,
        delta_tail=tail,
        delta_total=float(delta) + tail,
    )


def smallest_tail_parameter(
    epsilon: float,
    delta_total: float,
    *,
    updates: float,
    batch_size: int,
    learning_rate: float,
    lipschitz: float,
    reset_factor: int,
    mechanism_share: float = 0.5,
) -> FunctionalNoiseCalibration:
    """The calibration with the smallest integer k whose total delta fits ``delta_total``.

    ``mechanism_share`` of ``delta_total`` goes to the mechanism, the rest to the path tails (the paper splits
    1e-4 as 5e-5 + 5e-5). With v linear in k, f(k) = 2k - 8.68 sqrt(beta(k)) sigma_min(k) is convex and
    negative at k = 0, so {k : f(k) >= m} is a half-line: doubling then bisection finds its first integer.
    """
    delta_total = check_probability("fnq.delta_total", delta_total, allow_zero=False, allow_one=False)
    mechanism_share = check_probability("fnq.mechanism_share", mechanism_share, allow_zero=False, allow_one=False)
    delta = delta_total * mechanism_share

    def fits(k: int) -> Optional[FunctionalNoiseCalibration]:
        try:
            result = calibrate_functional_noise(
                epsilon, delta, updates=updates, batch_size=batch_size, learning_rate=learning_rate, tail_k=k,
                lipschitz=lipschitz, reset_factor=reset_factor,
            )
        except PrivacyBudgetError:
            return None
        return result if result.delta_total <= delta_total else None

    high = 1
    while fits(high) is None:
        high *= 2
        if high > 2**40:
            raise PrivacyBudgetError("fnq.tail_k", "no tail parameter k certifies this budget")
    low = high // 2  # fits(low) is None (or low == 0)
    while high - low > 1:
        mid = (low + high) // 2
        if fits(mid) is None:
            low = mid
        else:
            high = mid
    return fits(high)


def update_event(noise_multiplier: float) -> PoissonGaussianEvent:
    """One update of ``RewardPrivateQLearning``: the Gaussian mechanism with noise multiplier z (noise std over the
    update's L2 sensitivity G s), no sampling amplification (every reward may differ between neighbours)."""
    return PoissonGaussianEvent(check_positive("noise_multiplier", noise_multiplier), 1.0)


@functools.lru_cache(maxsize=64)
def gaussian_noise_multiplier(epsilon: float, delta: float, releases: int, accountant: str = "pld") -> float:
    """The smallest z (to 0.1%) whose ``releases`` Gaussian releases (``update_event``) fit (epsilon, delta) under
    ``accountant``: the U updates of ``RewardPrivateQLearning``, or (releases = 1) input perturbation's one Gaussian
    of sensitivity sqrt(N). Calibrating with the ledger's own analysis makes the recorded events fit by construction."""
    from dporl.privacy.calibration import calibrate_noise_multiplier

    return calibrate_noise_multiplier(epsilon, delta, releases, make_event=update_event, mechanism=accountant)


def updates_within_budget(
    noise_multiplier: float, epsilon: float, delta: float, accountant: str = "pld", limit: Optional[int] = None
) -> int:
    """The largest number of Gaussian updates with multiplier z that fits (epsilon, delta) (budget-driven stopping)."""
    from dporl.privacy.calibration import max_steps

    return max_steps(update_event(noise_multiplier), epsilon, delta, mechanism=accountant, limit=limit)


def gaussian_delta(epsilon: float, noise_std: float, sensitivity: float) -> float:
    """Exact delta(epsilon) of the Gaussian mechanism (Balle & Wang 2018, Theorem 8)."""
    from scipy.stats import norm

    ratio = sensitivity / noise_std
    # e^eps Phi(b) in log space: at large eps (input perturbation over a wide grid) e^eps alone overflows.
    second = math.exp(epsilon + float(norm.logcdf(-ratio / 2 - epsilon / ratio)))
    return max(0.0, float(norm.cdf(ratio / 2 - epsilon / ratio)) - second)


def reward_perturbation_std(epsilon: float, delta: float, n_rewards: int) -> float:
    """Std of Gaussian noise on each of ``n_rewards`` rewards for (epsilon, delta)-DP, unit "reward".

    Neighbours change every reward by at most 1, so the vector of n noisy rewards is one Gaussian mechanism of
    L2 sensitivity sqrt(n) (n adaptively chosen releases compose exactly into it). The std is the smallest with
    exact delta(epsilon) <= delta (analytic Gaussian mechanism), found by bisection on a 1e-9 relative grid.
    """
    check_positive("epsilon", epsilon)
    check_probability("delta", delta, allow_zero=False, allow_one=False)
    if int(n_rewards) != n_rewards or n_rewards < 1:
        raise ValidationError("n_rewards", f"must be an integer >= 1, got {n_rewards}")
    sensitivity = math.sqrt(n_rewards)
    low, high = 1e-6 * sensitivity, sensitivity
    while gaussian_delta(epsilon, high, sensitivity) > delta:
        low, high = high, 2 * high
    while high - low > 1e-9 * high:
        mid = (low + high) / 2
        if gaussian_delta(epsilon, mid, sensitivity) > delta:
            low = mid
        else:
            high = mid
    return high
