"""Budget of the stable-prefix release (Sharma et al. 2024, Algorithms 1-2 and Lemma 5.1), derived in full below.

Per processed trajectory, with per-query budget eps' (the threshold as derived here):

- G0 = 1 / (1 - exp(-eps')): above it, the chance that a uniformly chosen expert generates a prefix moves by at
  most e^{+-eps'} when one expert is added or removed (sampling stability);
- Laplace scale b = 2 / eps' for monotone stability queries (4 / eps' otherwise), used for the threshold noise
  and for every query's noise;
- a bad prefix (q_k < G0 / p_min) passes with probability at most beta = P[nu - rho >= t], nu, rho ~ Laplace(b),
  P[nu - rho >= t] = (1/2 + t / (4b)) exp(-t / b); t_beta solves it for beta;
- threshold G = G0 / p_min + t_beta, and each run is (2 eps', beta)-DP for the expert unit.

Composition over T runs (spec "Composition over T"): rule used here, beta = delta / (2 T) (half the stage's delta
goes to the bad-prefix events, the other half is the slack of the tight composition), then the largest eps' such
that the PLD composition of T (2 eps', beta) pairs (optimal composition of (eps, delta) pairs, dp_accounting) is
within (epsilon, delta) at the stage's delta. The search keeps a bracket [fits, does not fit] and narrows it by the
Illinois variant of regula falsi (the composed epsilon is smooth and increasing in eps', so it converges in a few
PLD evaluations where bisection needs ~20); the value returned is the bracket's verified-to-fit end.

Replace-one neighbours (``relation``): replacing an expert is removing it and adding another, so each run is
analysed by group privacy over the two steps, (4 eps', (1 + e^{2 eps'}) beta) (``relations.analysed_for``; the
path D -> D + x' -> D' keeps every intermediate pool at least as large as D, so the precondition below still
covers it). beta is then delta / (2 T (1 + e^{2 eps'})), so that the converted runs' deltas again total delta / 2.

Precondition: m p_min >= G0 (``check_stability_precondition``), on the number of experts the caller can vouch for:
the public count (replace-one), or a released lower bound of a private count (``dporl.privacy.count``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from typing import Optional

from dporl.privacy.accountants import check_count, epsilon_for
from dporl.privacy.events import ApproxDPEvent, PrivacyEvent
from dporl.privacy.relations import ADD_REMOVE, analysed_for, check_relation
from dporl.privacy.units import Relation
from dporl.utils.validation import PrivacyBudgetError, ValidationError, check_positive, check_probability

# Relative precision of the eps' search (the last verified value is returned, so this only costs utility).
EPSILON_PRIME_TOLERANCE = 1e-4


def laplace_difference_tail(t: float, scale: float) -> float:
    """P[nu - rho >= t] for independent nu, rho ~ Laplace(scale), t >= 0."""
    return (0.5 + t / (4 * scale)) * math.exp(-t / scale)


def laplace_difference_quantile(beta: float, scale: float) -> float:
    """The t >= 0 with P[nu - rho >= t] = beta (0 < beta <= 1/2); the tail decreases strictly in t."""
    from scipy.optimize import brentq

    check_probability("beta", beta, allow_zero=False)
    if beta > 0.5:
        raise ValidationError("beta", f"the tail is at most 1/2 for t >= 0; got beta={beta}")
    if beta == 0.5:
        return 0.0
    # In units of the scale, u = t / b solves f(u) = log(1/2 + u/4) - u - log(beta) = 0. With L = -log(beta):
    # f(0) = log(1/2) + L > 0 and f(2 + 2L) = log(1 + L/2) - 2 - L < 0, so [0, 2 + 2L] brackets the root.
    target = math.log(beta)
    u = brentq(lambda x: math.log(0.5 + x / 4) - x - target, 0.0, 2 * (1 - target), xtol=1e-14, rtol=1e-15)
    return u * scale


@dataclass(frozen=True)
class StablePrefixThreshold:
    g0: float
    noise_scale: float
    t_beta: float
    threshold: float


def stable_prefix_threshold(epsilon_prime: float, beta: float, p_min: float, monotone: bool = True) -> StablePrefixThreshold:
    """G0, Laplace scale, t_beta and G = G0 / p_min + t_beta for one run with budget eps' and failure beta."""
    check_positive("epsilon_prime", epsilon_prime)
    check_probability("p_min", p_min, allow_zero=False, allow_one=False)
    g0 = 1.0 / (-math.expm1(-epsilon_prime))
    scale = (2.0 if monotone else 4.0) / epsilon_prime
    t_beta = laplace_difference_quantile(beta, scale)
    return StablePrefixThreshold(g0, scale, t_beta, g0 / p_min + t_beta)


@dataclass(frozen=True)
class StablePrefixBudget:
    epsilon_prime: float  # per-query budget eps' of one run
    beta: float  # per-run delta (bad prefix passes)
    threshold: float  # G = G0 / p_min + t_beta
    noise_scale: float  # Laplace scale b of the threshold and of every query
    g0: float
    t_beta: float
    event: PrivacyEvent  # one run: (2 eps', beta)-DP, privacy unit: expert (as the run's relation analyses it)
    trajectories: int  # T runs
    composed_epsilon: float  # PLD epsilon of the T runs at `delta` (<= the stage's epsilon)
    delta: float


def stable_prefix_budget(
    epsilon: float, delta: float, trajectories: int, p_min: float, n_experts: Optional[float], monotone: bool = True,
    relation: Relation | str = ADD_REMOVE,
) -> StablePrefixBudget:
    """Largest per-run eps' for T = ``trajectories`` runs within the stage budget (epsilon, delta); see module.

    ``n_experts``: the count the precondition is checked on (None: the caller checks it later, e.g. on a count
    released after this plan)."""
    check_positive("release.epsilon", epsilon)
    check_probability("release.delta", delta, allow_zero=False, allow_one=False)
    trajectories = check_count("release.trajectories", trajectories, minimum=1)
    check_probability("p_min", p_min, allow_zero=False, allow_one=False)
    relation = check_relation("relation", relation)
    if n_experts is not None:
        check_positive("n_experts", n_experts)

    def beta_of(eps_prime: float) -> float:
        if relation == ADD_REMOVE:
            return delta / (2 * trajectories)
        return delta / (2 * trajectories * (1 + math.exp(2 * eps_prime)))

    def event(eps_prime: float) -> PrivacyEvent:
        return analysed_for(relation, ApproxDPEvent(2 * eps_prime, beta_of(eps_prime)))

    def composed(eps_prime: float) -> float:
        return epsilon_for([(event(eps_prime), trajectories)], delta, "pld")

    # Bracket: low fits, high does not. Basic composition (T x 2 eps' <= epsilon) always fits up to the PLD grid.
    low = epsilon / (2 * trajectories) * (0.5 if relation == ADD_REMOVE else 0.25)  # replace-one: 4 eps' per run
    f_low = composed(low) - epsilon
    if f_low > 0:
        raise PrivacyBudgetError("release.epsilon", f"epsilon={epsilon} is too small to split over {trajectories} runs")
    high = 2 * low
    f_high = composed(high) - epsilon
    while f_high <= 0:
        low, f_low, high = high, f_high, 2 * high
        f_high = composed(high) - epsilon
    kept = 0  # which end survived the previous step twice (Illinois: halve its value to force progress)
    while high - low > EPSILON_PRIME_TOLERANCE * low:
        middle = (low * f_high - high * f_low) / (f_high - f_low)
        margin = 0.05 * (high - low)  # never evaluate at the ends (no progress) or outside the bracket
        middle = min(max(middle, low + margin), high - margin)
        f_middle = composed(middle) - epsilon
        if f_middle <= 0:
            low, f_low = middle, f_middle
            f_high, kept = (f_high / 2, 1) if kept == 1 else (f_high, 1)
        else:
            high, f_high = middle, f_middle
            f_low, kept = (f_low / 2, -1) if kept == -1 else (f_low, -1)
    eps_prime = low
    beta = beta_of(eps_prime)

    threshold = stable_prefix_threshold(eps_prime, beta, p_min, monotone)
    budget = StablePrefixBudget(
        epsilon_prime=eps_prime,
        beta=beta,
        threshold=threshold.threshold,
        noise_scale=threshold.noise_scale,
        g0=threshold.g0,
        t_beta=threshold.t_beta,
        event=event(eps_prime),
        trajectories=trajectories,
        composed_epsilon=composed(eps_prime),
        delta=delta,
    )
    if n_experts is not None:
        check_stability_precondition(budget, p_min, n_experts, "the number of experts")
    return budget


def check_stability_precondition(budget: StablePrefixBudget, p_min: float, n_experts: float, what: str,
                                 remedy: str = "") -> None:
    """Refuse (``PrivacyBudgetError`` naming p_min) a release whose experts cannot make even the first action stable:
    ``n_experts`` p_min < G0. ``what`` says in words which count ``n_experts`` is (it appears in the message);
    ``remedy``, a way out beyond the usual ones (appended to the message)."""
    if n_experts * p_min < budget.g0:
        raise PrivacyBudgetError(
            "p_min",
            f"n_experts * p_min = {n_experts:g} * {p_min:g} = {n_experts * p_min:.4g} < G0 = 1/(1 - exp(-eps')) = "
            f"{budget.g0:.4g} (eps' = {budget.epsilon_prime:.4g}, T={budget.trajectories}; n_experts: {what}): not "
            "even the first action is stable and the release would not be private; use more experts, a larger "
            f"p_min, a larger release epsilon or fewer trajectories{remedy}",
        )
