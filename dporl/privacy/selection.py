"""Private selection: release the best of a random number of private trials, with one accounted guarantee.

Liu & Talwar 2019, "Private selection from private candidates"; Papernot & Steinke 2022, "Hyperparameter tuning
with Renyi differential privacy" (ICLR 2022; theorem numbers of arXiv:2110.03620v2). A search draws the number of
trials K from a public distribution with secret randomness, runs K independent trials of ONE randomised mechanism Q
(a trial draws its own hyperparameters with its own secret randomness, so every trial is the same mechanism), and
releases only the output of the trial with the best score (a function of that trial's output). What the losing
trials produced, and K itself, are never released. The record of such a search is ``SelectionEvent`` (in
``dporl.privacy.events``, apart from this analysis, as dp_accounting keeps ``RepeatAndSelectDpEvent`` apart from
its accountants); ``selection_rdp`` is its Renyi curve, which ``dporl.privacy.accountants.rdp_curve`` answers for it.

The trial's privacy is its Renyi curve eps(lambda) over ``RDP_ORDERS``: the events of the trial's ledger, composed
(sums over a part), parts in parallel (the largest part at each order: a unit lives in one cell of the trial's
partition, so only the stages touching that cell see it). An event known only as (eps, 0)-DP has the curve of
randomised response at eps (every pure eps-DP pair is a post-processing of that pair, Kairouz, Oh, Viswanath 2015, so
by data processing no pure eps-DP mechanism has a larger Renyi divergence); an (eps, delta) event with delta > 0 (the
stable-prefix release's runs) has no curve and is refused by name.

Truncated negative binomial K (Definition 1): P[K = k] = (1 - gamma)^k / (gamma^-eta - 1) * prod_{l=0}^{k-1}
(l + eta) / (l + 1) for k >= 1 (eta > 0), the logarithmic distribution (1 - gamma)^k / (k log(1 / gamma)) for
eta = 0, geometric for eta = 1; E[K] = eta (1 - gamma) / (gamma (1 - gamma^eta)) (eta > 0),
(1 / gamma - 1) / log(1 / gamma) (eta = 0). Theorem 2: if Q is (lambda, eps)-RDP and (lambda_hat, eps_hat)-RDP, the
search is (lambda, eps')-RDP with

    eps' = eps + (1 + eta) (1 - 1 / lambda_hat) eps_hat + (1 + eta) log(1 / gamma) / lambda_hat
           + log(E[K]) / (lambda - 1),

taken here at the best lambda_hat of the order grid for every lambda. gamma = 1 is exactly one run: the trial's own
curve.

Poisson K (Theorem 6): if Q is (lambda, eps)-RDP and (eps_hat, delta_hat)-DP with e^eps_hat <= 1 + 1 / (lambda - 1),
the search (K ~ Poisson(mu); K = 0 releases nothing) is (lambda, eps')-RDP with

    eps' = eps + mu delta_hat + log(mu) / (lambda - 1),

with eps_hat = log(1 + 1 / (lambda - 1)) and delta_hat the trial's delta there: the smaller of the conversion of its
Renyi curve and its privacy loss distribution's (pessimistic, so an upper bound too), which is much smaller for
Gaussian trials (the Renyi conversion overstates a Gaussian's delta at small eps_hat several-fold).

Both bounds are then made nondecreasing in lambda (RDP is: eps'(lambda) <= eps'(lambda') for lambda <= lambda').
The search composes with the run's other stages through the ledger (basic composition with stages that are not
Renyi-accounted) and is converted to (eps, delta) like every RDP history (Balle et al. 2020).

Which distribution (``DEFAULT_DISTRIBUTION``, ``DEFAULT_MEAN``): Poisson with mean 6. At a fixed E[K] a smaller eta
costs less privacy ((1 + eta) multiplies the lambda_hat term) but spreads K wider, and the Poisson pays
mu delta_hat instead, small when delta_hat comes from the trial's privacy loss distribution. Measured on the table
quickstart's trials (docs/results.md, "Private hyperparameter selection"): at E[K] = 6 the Poisson leaves each trial a
larger budget than the logarithmic and the geometric while running fewer than three trials 6% of the time (48% and
31% for those two); around E[K] = 12 the logarithmic overtakes it.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Any, Callable, Literal, Optional

import numpy as np

from dporl.privacy.accountants import RDP_ORDERS, epsilon_for, rdp_curve
from dporl.privacy.events import ApproxDPEvent, PrivacyEvent, ReplaceOneEvent, SelectionEvent
from dporl.utils.validation import PrivacyBudgetError, ValidationError, check_positive

Distribution = Literal["negative_binomial", "poisson"]
DEFAULT_DISTRIBUTION: Distribution = "poisson"
DEFAULT_MEAN = 6.0
DEFAULT_ETA = 1.0  # a negative binomial's shape: geometric
TrialParts = tuple  # tuple of parts, each a tuple of (event, count)


# --------------------------------------------------------------------------------------------- the trial's curve
def pure_dp_rdp(epsilon: float) -> np.ndarray:
    """Renyi divergence of randomised response at ``epsilon`` (P = (p, 1 - p), Q = (1 - p, p), p = e^eps / (1 + e^eps))
    at every order of ``RDP_ORDERS``: 1/(a-1) log(p^a (1-p)^(1-a) + (1-p)^a p^(1-a)), the largest of any pure
    eps-DP mechanism (module docstring)."""
    check_positive("epsilon", epsilon, allow_zero=True)
    if epsilon == 0:
        return np.zeros(len(RDP_ORDERS))
    log_p = -math.log1p(math.exp(-epsilon))  # log(e^eps / (1 + e^eps))
    log_q = -math.log1p(math.exp(epsilon))  # log(1 / (1 + e^eps))
    a = RDP_ORDERS
    curve = np.logaddexp(a * log_p + (1 - a) * log_q, a * log_q + (1 - a) * log_p) / (a - 1)
    return np.minimum(curve, epsilon)  # (never above eps; guards the rounding of the log at large orders)


def event_rdp(event: PrivacyEvent) -> np.ndarray:
    """The Renyi curve of one event of a trial: the accountants' curve, or randomised response's for a pure
    (eps, 0) event; refused by name for events without one."""
    if isinstance(event, ApproxDPEvent) and not event.replace_one:
        if event.delta > 0:
            raise ValidationError(
                "selection.trial", f"{event} is known only as (epsilon, delta)-DP with delta > 0 (e.g. a stable-prefix "
                "release run): it has no Renyi curve, and the selection bounds used here (Papernot & Steinke 2022) "
                "need one; tune a method whose trials are Renyi-accounted (dp_sgd)")
        return pure_dp_rdp(event.epsilon)
    if isinstance(event, ReplaceOneEvent) or (isinstance(event, ApproxDPEvent) and event.replace_one):
        raise ValidationError(
            "selection.trial", f"{event} is analysed for replace-one neighbours by its privacy loss distribution and "
            "has no Renyi curve here; private selection needs one: use relation add_remove")
    if isinstance(event, SelectionEvent):
        raise ValidationError("selection.trial", "a trial is no selection itself")
    return rdp_curve(event)


def trial_rdp(trial: TrialParts) -> np.ndarray:
    """The trial's Renyi curve: each part's events composed (RDP adds), the largest part at every order (parallel
    composition over the cells of the trial's partition)."""
    curves = []
    for part in trial:
        total = np.zeros(len(RDP_ORDERS))
        for event, count in part:
            if count:
                total = total + count * event_rdp(event)
        curves.append(total)
    return np.max(np.stack(curves), axis=0)


# --------------------------------------------------------------------------------------------- the theorems
def expected_trials(eta: float, gamma: float) -> float:
    """E[K] of the truncated negative binomial (module docstring); 1 at gamma = 1."""
    if gamma >= 1.0:
        return 1.0
    log_gamma = math.log(gamma)
    if eta == 0:  # logarithmic: (1 / gamma - 1) / log(1 / gamma)
        return (1.0 / gamma - 1.0) / -log_gamma
    return eta * (1.0 / gamma - 1.0) / -math.expm1(eta * log_gamma)


def negative_binomial_gamma(mean: float, eta: float, tolerance: float = 1e-12) -> float:
    """The gamma whose truncated negative binomial (shape ``eta``) has expectation ``mean`` (>= 1): exactly 1 / mean
    for the geometric, else by bisection (E[K] falls as gamma grows). The analysis uses the gamma returned, whatever
    rounding the search made: the drawn K and the bound always share one distribution."""
    check_positive("trials.mean", mean)
    if mean < 1:
        raise ValidationError("trials.mean", f"a truncated negative binomial runs at least one trial: mean >= 1, got "
                              f"{mean:g}")
    if mean == 1:
        return 1.0
    if eta == 1:
        return 1.0 / mean
    low, high = 1e-300, 1.0
    for _ in range(2000):
        middle = math.sqrt(low * high) if high / low > 4 else (low + high) / 2
        if expected_trials(eta, middle) > mean:
            low = middle
        else:
            high = middle
        if high - low <= tolerance * high:
            break
    return high


def negative_binomial_rdp(curve: np.ndarray, eta: float, gamma: float) -> np.ndarray:
    """Theorem 2 of Papernot & Steinke 2022 at every order of ``RDP_ORDERS`` (module docstring), lambda_hat chosen
    on the grid per lambda, then the nondecreasing envelope; gamma = 1 returns ``curve`` (one run)."""
    curve = np.asarray(curve, dtype=float)
    if gamma >= 1.0:
        return curve.copy()
    a = RDP_ORDERS
    hat = float(np.min((1 - 1 / a) * curve + math.log(1 / gamma) / a))  # min over lambda_hat >= 1.1 of the grid
    bound = curve + (1 + eta) * hat + math.log(expected_trials(eta, gamma)) / (a - 1)
    return _nondecreasing(bound)


def poisson_rdp(curve: np.ndarray, mu: float, profile: Optional[Callable[[np.ndarray], np.ndarray]] = None
                ) -> np.ndarray:
    """Theorem 6 of Papernot & Steinke 2022 at every order of ``RDP_ORDERS`` (module docstring): delta_hat is the
    trial's delta at eps_hat = log(1 + 1 / (lambda - 1)), the smaller of the RDP conversion of its whole curve and
    ``profile(eps_hats)`` (the trial's deltas by another sound analysis, e.g. its privacy loss distribution)."""
    curve = np.asarray(curve, dtype=float)
    a = RDP_ORDERS
    eps_hat = np.log1p(1 / (a - 1))
    delta_hat = rdp_deltas(curve, eps_hat)
    if profile is not None:
        delta_hat = np.minimum(delta_hat, profile(eps_hat))
    bound = curve + mu * np.minimum(1.0, delta_hat) + math.log(mu) / (a - 1)
    return _nondecreasing(bound)


def rdp_deltas(curve: np.ndarray, epsilons: np.ndarray) -> np.ndarray:
    """delta at each of ``epsilons`` from a Renyi curve over ``RDP_ORDERS``: dp_accounting's ``compute_delta`` (the
    conversion of Balle et al. 2020, Proposition 12, and sqrt(1 - exp(-eps(a))) >= sqrt(1 - exp(-KL))), for every
    epsilon at once."""
    a = RDP_ORDERS[:, None]
    r = np.asarray(curve, dtype=float)[:, None]
    eps = np.asarray(epsilons, dtype=float)[None, :]
    with np.errstate(divide="ignore", invalid="ignore"):
        kl_bound = np.where(r > 0, 0.5 * np.log1p(-np.exp(-r)), -np.inf) + 0 * eps
        conversion = (a - 1) * (r - eps + np.log1p(-1 / a)) - np.log(a)
    log_delta = np.where(a > 1.01, np.minimum(kl_bound, conversion), kl_bound)
    return np.minimum(np.exp(np.min(log_delta, axis=0)), 1.0)


def trial_deltas(trial: TrialParts) -> Optional[Callable[[np.ndarray], np.ndarray]]:
    """eps -> the trial's delta by its privacy loss distributions (dp_accounting's pessimistic PLDs: each part's
    events composed, the largest part), or None where an event has none or its grid is too large to build."""
    from dporl.privacy.accountants import AnalysisTooLarge, composed_pld

    try:
        plds = [composed_pld(part) for part in trial]
    except AnalysisTooLarge:
        return None
    except ValidationError:
        return None

    def deltas(epsilons: np.ndarray) -> np.ndarray:
        order = np.argsort(epsilons)  # dp_accounting wants them ascending
        ascending = [float(e) for e in np.asarray(epsilons)[order]]
        values = [np.zeros(len(order)) if pld is None else np.asarray(pld.get_delta_for_epsilon(ascending), float)
                  for pld in plds]
        result = np.empty(len(order))
        result[order] = np.max(np.stack(values), axis=0)
        return result

    return deltas


def _nondecreasing(bound: np.ndarray) -> np.ndarray:
    """RDP is nondecreasing in the order: each order takes the smallest bound of any order at or above it."""
    return np.minimum.accumulate(bound[::-1])[::-1]


@functools.lru_cache(maxsize=256)
def selection_rdp(event: SelectionEvent) -> np.ndarray:
    """The Renyi curve of ``event`` (module docstring): Theorem 2 or Theorem 6 applied to its trial's curve."""
    curve = trial_rdp(event.trial)
    if event.distribution == "poisson":
        return poisson_rdp(curve, event.mu, trial_deltas(event.trial))
    return negative_binomial_rdp(curve, event.eta, event.gamma)


# --------------------------------------------------------------------------------------------- K
@dataclass(frozen=True)
class TrialCount:
    """The distribution of the number of trials: ``negative_binomial`` (eta, gamma) or ``poisson`` (mu)."""

    distribution: Distribution = DEFAULT_DISTRIBUTION
    eta: float = DEFAULT_ETA
    gamma: float = 1.0
    mu: float = DEFAULT_MEAN

    def __post_init__(self) -> None:
        SelectionEvent(((),), self.distribution, self.eta, self.gamma, self.mu)  # the same checks as the record

    @staticmethod
    def with_mean(mean: float, distribution: Distribution = DEFAULT_DISTRIBUTION, eta: float = DEFAULT_ETA
                  ) -> "TrialCount":
        """The distribution with expectation ``mean`` (a truncated negative binomial's gamma is solved for)."""
        check_positive("trials.mean", mean)
        if distribution == "poisson":
            return TrialCount("poisson", mu=float(mean))
        if distribution != "negative_binomial":
            raise ValidationError("trials.distribution", f"expected 'negative_binomial' or 'poisson', got "
                                  f"{distribution!r}")
        if isinstance(eta, bool) or not isinstance(eta, (int, float)) or not 0 <= eta < math.inf:
            raise ValidationError("trials.eta", f"must be a finite number >= 0, got {eta!r}")
        return TrialCount("negative_binomial", eta=float(eta), gamma=negative_binomial_gamma(mean, eta))

    @property
    def mean(self) -> float:
        return self.mu if self.distribution == "poisson" else expected_trials(self.eta, self.gamma)

    def event(self, trial: TrialParts) -> SelectionEvent:
        """The record of a search over ``trial`` with this distribution."""
        return SelectionEvent(trial, self.distribution, self.eta, self.gamma, self.mu)

    def sample(self, rng: np.random.Generator, size: Optional[int] = None):
        """K (an int; ``size``: an int64 array of independent draws) from ``rng`` (a secret stream for a search)."""
        n = 1 if size is None else int(size)
        if self.distribution == "poisson":
            draws = rng.poisson(self.mu, n).astype(np.int64)
        elif self.gamma >= 1.0:
            draws = np.ones(n, dtype=np.int64)
        elif self.eta == 0:
            draws = rng.logseries(1.0 - self.gamma, n).astype(np.int64)
        else:  # the negative binomial conditioned on K >= 1: redraw the zeros
            draws = rng.negative_binomial(self.eta, self.gamma, n).astype(np.int64)
            zero = draws == 0
            while zero.any():
                draws[zero] = rng.negative_binomial(self.eta, self.gamma, int(zero.sum()))
                zero = draws == 0
        return int(draws[0]) if size is None else draws

    def pmf(self, k: np.ndarray) -> np.ndarray:
        """P[K = k] (for tests and for the curator's expectations)."""
        from scipy.special import gammaln

        k = np.asarray(k, dtype=float)
        if self.distribution == "poisson":
            return np.exp(k * math.log(self.mu) - self.mu - gammaln(k + 1))
        if self.gamma >= 1.0:
            return (k == 1).astype(float)
        log_rest = math.log1p(-self.gamma)
        if self.eta == 0:
            values = np.exp(np.where(k >= 1, k, 1) * log_rest) / (np.where(k >= 1, k, 1) * math.log(1 / self.gamma))
        else:
            safe = np.where(k >= 1, k, 1)
            log_norm = math.log(math.expm1(-self.eta * math.log(self.gamma)))  # log(gamma^-eta - 1)
            values = np.exp(gammaln(safe + self.eta) - gammaln(self.eta) - gammaln(safe + 1) + safe * log_rest
                            - log_norm)
        return np.where(k >= 1, values, 0.0)

    def pgf(self, x: np.ndarray) -> np.ndarray:
        """E[x^K] for x in [0, 1]."""
        x = np.asarray(x, dtype=float)
        if self.distribution == "poisson":
            return np.exp(self.mu * (x - 1))
        if self.gamma >= 1.0:
            return x
        rest = 1.0 - self.gamma
        if self.eta == 0:
            return np.log1p(-rest * x) / math.log(self.gamma)
        return np.expm1(-self.eta * np.log1p(-rest * x)) / math.expm1(-self.eta * math.log(self.gamma))

    def describe(self) -> str:
        if self.distribution == "poisson":
            return f"Poisson(mu={self.mu:g}) trials (K = 0 releases nothing)"
        name = {0.0: "logarithmic", 1.0: "geometric"}.get(float(self.eta), f"truncated negative binomial (eta={self.eta:g})")
        return f"{name} number of trials (gamma={self.gamma:.6g}, E[K]={self.mean:.4g})"

    def to_dict(self) -> dict[str, Any]:
        if self.distribution == "poisson":
            return {"distribution": "poisson", "mu": self.mu, "mean": self.mean}
        return {"distribution": "negative_binomial", "eta": self.eta, "gamma": self.gamma, "mean": self.mean}


# --------------------------------------------------------------------------------------------- calibration
def selection_epsilon(event: SelectionEvent, delta: float) -> float:
    """(epsilon at ``delta``) of one search: its Renyi curve converted as every RDP history is."""
    return epsilon_for([(event, 1)], delta, "rdp")


def calibrate_trial_budget(
    selection_of: Callable[[float], SelectionEvent], epsilon: float, delta: float, *, upper: float,
    rtol: float = 2e-3, lower: Optional[float] = None,
) -> tuple[float, SelectionEvent, float]:
    """(trial budget, the search's event, its epsilon): the largest per-trial epsilon in (``lower``, ``upper``]
    whose search ``selection_of(trial_epsilon)`` fits ``epsilon`` at ``delta``, to relative precision ``rtol``.

    ``selection_of`` builds the record of the search from a trial budget (the events each trial's pipeline would
    record at that budget). Inverse interpolation on log(trial epsilon) (typically 5-8 evaluations); only budgets
    evaluated as fitting are returned, so the answer fits whether or not the search's epsilon is monotone in the
    trial's budget. Refused
    (``PrivacyBudgetError``) when not even ``lower`` fits.
    """
    check_positive("epsilon", epsilon)
    check_positive("upper", upper)
    lower = upper * 1e-3 if lower is None else check_positive("lower", lower)
    cache: dict[float, tuple[SelectionEvent, float]] = {}

    def spent(trial_epsilon: float) -> float:
        if trial_epsilon not in cache:
            event = selection_of(trial_epsilon)
            cache[trial_epsilon] = (event, selection_epsilon(event, delta))
        return cache[trial_epsilon][1]

    if spent(upper) <= epsilon:
        return upper, *cache[upper]
    # Bracket from above: the search's epsilon grows about linearly with the trial's, so scale down until one fits.
    bad, guess = upper, upper * epsilon / spent(upper)
    while True:
        guess = max(guess, lower)
        if spent(guess) <= epsilon:
            good = guess
            break
        if guess <= lower:
            raise PrivacyBudgetError(
                "epsilon", f"even trials at epsilon={lower:.4g} make a search of eps={cache[lower][1]:.4g} at "
                f"delta={delta:g}, more than its budget {epsilon:g}: raise the budget or lower the expected number of "
                "trials")
        bad, guess = guess, guess * 0.9 * epsilon / spent(guess)
    # Inverse interpolation of log(spent) against log(trial epsilon), aimed just below the budget so that the fitting
    # end moves up; a bisection whenever that does not halve the bracket.
    width = math.log(bad / good)
    while bad / good > 1 + rtol:
        low_value, high_value = math.log(spent(good)), math.log(spent(bad))
        aim = math.log(epsilon) - 0.25 * rtol
        t = (aim - low_value) / (high_value - low_value) if high_value > low_value else 0.5
        middle = good * (bad / good) ** min(max(t, 0.02), 0.98)
        good, bad = (middle, bad) if spent(middle) <= epsilon else (good, middle)
        if math.log(bad / good) > width / 2:  # the interpolation stalled: bisect once
            middle = math.sqrt(good * bad)
            good, bad = (middle, bad) if spent(middle) <= epsilon else (good, middle)
        width = math.log(bad / good)
    return good, cache[good][0], cache[good][1]


def describe_search(count: TrialCount) -> str:
    """The analysis a search's ledger stage names."""
    theorem = "Theorem 6 (Poisson)" if count.distribution == "poisson" else "Theorem 2 (truncated negative binomial)"
    return (f"private selection of the best of a random number of trials, {count.describe()} (Papernot & Steinke "
            f"2022, {theorem}; Liu & Talwar 2019); each trial's Renyi curve from its ledger's events")


__all__ = [
    "DEFAULT_DISTRIBUTION",
    "DEFAULT_ETA",
    "DEFAULT_MEAN",
    "TrialCount",
    "calibrate_trial_budget",
    "describe_search",
    "event_rdp",
    "expected_trials",
    "negative_binomial_gamma",
    "negative_binomial_rdp",
    "poisson_rdp",
    "pure_dp_rdp",
    "selection_epsilon",
    "selection_rdp",
    "trial_rdp",
]
