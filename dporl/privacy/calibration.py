"""Calibration: the noise a budget needs, and the number of steps a budget allows.

Both search the accountant itself (no closed-form approximation stands in for it), so the answer is exactly as
sound as the accountant: ``calibrate_noise_multiplier`` returns a sigma whose accounted epsilon is <= the target
(the fitting end of a bracket, never an interpolated point), and ``max_steps`` returns the exact largest integer n
with epsilon(n steps) <= target (for "rdp" and "pld"), using that epsilon grows with n (more releases never reduce
the privacy loss) and falls with sigma.

Few evaluations. An analysis of 10^6 composed steps costs tens of milliseconds (PLD) to seconds (PRV), so the
searches do not double and bisect. ``max_steps`` starts from the RDP answer, which is closed-form per Renyi order
(n_a = (epsilon - conversion_a) / RDP_a(event)), brackets by power-law extrapolation, then predicts the crossing
by inverse interpolation of log n against log epsilon (epsilon is smooth in n), with a bisection whenever that
stops halving the bracket: typically 2-6 evaluations of the requested analysis, against 34 for doubling and
bisection at 10^5 steps. ``calibrate_noise_multiplier`` starts where the central-limit (Gaussian DP)
approximation of the composition meets the budget and interpolates log sigma against log epsilon the same way.

Two grids. A PLD search runs first on a grid ``COARSENING`` times coarser than the events' own (an eighth of the
cost, a few percent looser, and smooth in sigma), then on the events' own grid from that answer, the coarse
evaluations rescaled by the ratio of the two analyses at it: 2-4 evaluations of the real analysis. The answer is
always the real analysis' own (the coarse pass only chooses where to look).

Prior events. Both searches take ``prior``: events already spent (or about to be) that the answer is composed
with by the same analysis, e.g. a stage that shares its run's budget with an earlier one is calibrated so that
one joint PLD over the earlier stage's events and its own fits the run's budget (``PrivacyLedger.shared_budget``).
The answer is then the largest count / smallest sigma with epsilon(prior + n x event) <= target; a prior that
alone does not fit (strictly) is refused with ``PrivacyBudgetError`` naming what it spent.

PRV (Opacus' accountant, about a second per evaluation at 10^5 steps) is searched with PLD first (milliseconds per
evaluation), and the PLD answer is the starting guess of the same search run with PRV: PRV's exact answer in a
few PRV evaluations (4-6, against 34 for doubling and bisection), never PLD's answer passed off as PRV's.
"""

from __future__ import annotations

import math
from typing import Callable, Optional, Sequence

import numpy as np

from dporl.privacy.accountants import (
    RDP_ORDERS,
    Mechanism,
    check_count,
    check_delta,
    coarse_pld_epsilon,
    epsilon_for,
    pld_is_coarsest,
    rdp_curve,
    spends_nothing,
    within_budget,
)
from dporl.privacy.events import MixtureEvent, PoissonGaussianEvent, PrivacyEvent
from dporl.privacy.pld import loss_spread
from dporl.utils.validation import PrivacyBudgetError, ValidationError, check_positive

# Beyond these the budget is meaningless for training (or the search would not terminate).
SIGMA_RANGE = (1e-3, 1e6)
STEP_SEARCH_LIMIT = 10**9
# Accountant evaluations one search may make (each is bounded by the accountants' grid cap); the searches converge in
# well under 60 on a monotone analysis, so reaching this means the analysis is not monotone here.
MAX_EVALUATIONS = 200


Events = Sequence[tuple[PrivacyEvent, int]]


def _check_budget(epsilon: float, delta: float) -> None:
    check_positive("epsilon", epsilon)
    check_delta(delta)


def _check_prior(prior: Events, epsilon: float, delta: float, mechanism: Mechanism) -> list[tuple[PrivacyEvent, int]]:
    """``prior`` as a list, refused (``PrivacyBudgetError``) when it alone leaves nothing of (epsilon, delta)."""
    prior = [(event, check_count("prior.count", count)) for event, count in prior]
    if prior:
        spent = epsilon_for(prior, delta, mechanism)
        if spent >= epsilon or not within_budget(spent, epsilon):
            raise PrivacyBudgetError(
                "epsilon", f"the events already spent take eps={spent:.6g} of epsilon={epsilon:g} at delta={delta:g} "
                f"({mechanism}): nothing is left to calibrate"
            )
    return prior


# A PLD search first runs on a grid this many times coarser than the events' own (the relative overstatement of
# epsilon grows as the square of the grid: ~64x, a few percent, at an eighth of the cost), then on the events' own
# grid from that answer, rescaling the coarse evaluations by the ratio measured at it.
COARSENING = 8
_COARSE = "pld, coarse grid"


def _passes(mechanism: Mechanism) -> list[str]:
    """The analyses a search runs in turn, each from the previous one's answer; the last is ``mechanism`` itself."""
    return {"rdp": ["rdp"], "pld": [_COARSE, "pld"], "prv": [_COARSE, "pld", "prv"]}[mechanism]


def _evaluate(events: Events, delta: float, analysis: str) -> float:
    if analysis == _COARSE:
        return coarse_pld_epsilon(events, delta, COARSENING)
    return epsilon_for(events, delta, analysis)


def _rescaled(known: dict, hint: Optional[dict], anchor: float) -> Optional[dict]:
    """The previous pass's evaluations ``hint`` scaled by this pass's epsilon over the previous one's at ``anchor``
    (the previous answer, where this pass starts), merged with this pass's own evaluations ``known``: a model of
    this pass's epsilon curve before it has points of its own. None without a usable anchor."""
    if hint is None or anchor not in known or anchor not in hint:
        return None
    here, there = known[anchor], hint[anchor]
    if not (0 < here < math.inf and 0 < there < math.inf):
        return None
    model = {x: value * here / there for x, value in hint.items() if 0 < value < math.inf}
    model.update(known)
    return model


def _inverse_interpolate(known: dict, target: float, points: int = 3) -> Optional[tuple[float, int]]:
    """(x where f(x) = target, points used) from evaluated pairs ``known`` {x: f(x)}: log x fitted as a polynomial
    in log f (degree points - 1, inverse interpolation as in Brent's method) through the pairs whose f is nearest
    the target; None with fewer than two usable pairs."""
    usable = [x for x, value in known.items() if x > 0 and 0 < value < math.inf]
    usable = sorted(usable, key=lambda x: abs(math.log(known[x] / target)))[:points]
    logs = [math.log(known[x] / target) for x in usable]
    if len(usable) < 2 or len(set(logs)) < len(logs):
        return None
    coefficients = np.polyfit(np.array(logs), np.log(np.array(usable, dtype=float)), len(usable) - 1)
    predicted = math.exp(float(coefficients[-1]))
    return (predicted, len(usable)) if math.isfinite(predicted) else None


# --------------------------------------------------------------------------------------------------- step counts
def rdp_step_guess(event: PrivacyEvent, epsilon: float, delta: float) -> Optional[int]:
    """Largest n whose RDP bound fits (epsilon, delta), in closed form per Renyi order; None without an RDP curve.

    Per order a, n composed events have RDP n r(a), converted to epsilon = n r(a) + log(1 - 1/a) - (log delta +
    log a) / (a - 1) (Balle et al. 2020, the conversion ``dp_accounting`` uses in its main case); the answer is the
    best order's floor. A starting point for the search only: every answer is verified by the accountant.
    """
    try:
        curve = rdp_curve(event)
    except ValidationError:
        return None
    orders = RDP_ORDERS
    offset = np.log1p(-1.0 / orders) - (math.log(delta) + np.log(orders)) / (orders - 1)
    with np.errstate(divide="ignore", invalid="ignore"):
        counts = np.floor((epsilon - offset) / curve)
    counts = counts[np.isfinite(counts) & (curve > 0)]
    if counts.size == 0:
        return None
    return int(min(max(counts.max(), 0.0), STEP_SEARCH_LIMIT))


def _count_evaluation(known: dict, what: str) -> None:
    if len(known) >= MAX_EVALUATIONS:
        raise ValidationError("accountant", f"the {what} search made {MAX_EVALUATIONS} accountant evaluations without "
                              "converging (the analysis is not monotone for these parameters); refused")


def _bracket_prediction(known: dict, hint: Optional[dict], anchor: float, target: float) -> Optional[float]:
    """Where the curve crosses ``target``, while a search is still bracketing: by the previous pass rescaled
    (``_rescaled``) while this pass has one point, then by this pass's own points."""
    model = _rescaled(known, hint, anchor) if len(known) < 2 else known
    prediction = None if model is None else _inverse_interpolate(model, target)
    return None if prediction is None else prediction[0]


def _largest_fitting(
    spent: Callable[[int], float], epsilon: float, cap: int, guess: int, hint: Optional[dict] = None
) -> tuple[int, dict]:
    """Largest n in [0, cap] with ``spent(n)`` within ``epsilon``; ``spent`` is non-decreasing and spent(0) = 0.
    Returns (n, every evaluation {n: spent(n)}).

    Brackets from ``guess`` by power-law extrapolation (the exponent measured on the last two fitting counts), or,
    given ``hint`` (a previous pass's evaluations, ``guess`` its answer), by the crossing of the rescaled hint and
    then its successor; then predicts the crossing by inverse interpolation through the evaluations nearest the
    target, probing the prediction (and its successor once three evaluations back it); a bisection after two rounds
    that fail to halve the bracket keeps the worst case logarithmic.
    """
    known: dict[int, float] = {0: 0.0}

    def fits(n: int) -> bool:
        if n not in known:
            _count_evaluation(known, "steps")
            known[n] = spent(n)
        return within_budget(known[n], epsilon)

    def extrapolate(n: int) -> Optional[float]:
        """Where epsilon ~ n^p meets the target, p from the last two fitting counts (1/2 with only one)."""
        value = known[n]
        if not 0 < value < math.inf:
            return None
        below = sorted(k for k in known if 0 < k < n and 0 < known[k] < value)
        power = 0.5
        if below:
            power = math.log(value / known[below[-1]]) / math.log(n / below[-1])
            power = min(max(power, 0.05), 1.0)
        return n * (epsilon / value) ** (1 / power)

    low, high = 0, None  # low fits (0 steps spend nothing); high, once known, does not
    start = n = min(max(guess, 1), cap)
    guided = 2  # probes placed by the rescaled hint before the extrapolation takes over
    while high is None:
        if not fits(n):
            high = n
            break
        low = n
        if n == cap:
            return cap, known
        model = _rescaled(known, hint, start) if guided else None
        prediction = None if model is None else _inverse_interpolate(model, epsilon)
        if prediction is not None:  # the rescaled previous pass: its crossing, then (once that fits) its successor
            guided -= 1
            n = min(cap, max(int(prediction[0]), n + 1))
            continue
        aim = extrapolate(n)  # 5% past the predicted crossing, so that the next count usually does not fit
        n = min(cap, max(2 * n if aim is None else int(aim * 1.05) + 1, n + 1))
    stalls = 0
    while high - low > 1:
        width = high - low
        prediction = _inverse_interpolate(known, epsilon)
        if prediction is None:
            middle, confident = (low + high) // 2, False
        else:
            middle, confident = min(max(int(prediction[0]), low + 1), high - 1), prediction[1] >= 3
        if fits(middle):
            low = middle
            if confident and middle + 1 < high:  # a three-point prediction is usually exact: check its successor
                if fits(middle + 1):
                    low = middle + 1
                else:
                    high = middle + 1
        else:
            high = middle
        stalls = stalls + 1 if high - low > width / 2 else 0
        if stalls >= 2 and high - low > 1:  # interpolation is not converging: bisect once
            stalls, middle = 0, (low + high) // 2
            if fits(middle):
                low = middle
            else:
                high = middle
    return low, known


def max_steps(
    event: PrivacyEvent, epsilon: float, delta: float, *, mechanism: Mechanism = "rdp", limit: Optional[int] = None,
    prior: Events = (),
) -> int:
    """Largest n with epsilon(``prior`` + n x ``event``) <= ``epsilon`` at ``delta`` (0 if not even one fits).

    ``limit`` caps the search (the answer is then min(limit, n)); without it an event that spends nothing, or a
    budget allowing more than 10^9 steps, is an error rather than an endless search. With ``mechanism="prv"`` the
    PRV search starts from the PLD answer (see the module docstring). ``prior``: events composed with the n steps
    (see the module docstring); refused when they alone leave nothing.
    """
    _check_budget(epsilon, delta)
    prior = _check_prior(prior, epsilon, delta, mechanism)
    limit = None if limit is None else check_count("limit", limit)
    cap = STEP_SEARCH_LIMIT if limit is None else limit
    if spends_nothing(event):
        if limit is None:
            raise ValidationError("event", f"{event} spends no privacy: the number of steps is unbounded")
        return limit
    if cap == 0:
        return 0
    if mechanism == "prv" and not isinstance(event, PoissonGaussianEvent):
        epsilon_for([(event, 1)], delta, mechanism)  # raises the PRV accountant's named refusal

    def spent_by(analysis: str) -> Callable[[int], float]:
        return lambda n: _evaluate([*prior, (event, n)], delta, analysis)

    found: Optional[int] = None
    hint: Optional[dict] = None
    for analysis in _passes(mechanism):
        if analysis == "pld" and pld_is_coarsest([*prior, (event, 1)]):
            continue  # the coarse pass already ran on this grid: its answer is exact
        # The first pass from the RDP answer (without the prior: an upper end the search brackets down).
        guess = (rdp_step_guess(event, epsilon, delta) or 1) if found is None else max(found, 1)
        found, hint = _largest_fitting(spent_by(analysis), epsilon, cap, guess, hint)
    if found == cap and limit is None:
        raise ValidationError("epsilon", f"the budget allows more than {cap} steps of {event}; set a step cap")
    return found


# --------------------------------------------------------------------------------------------------- noise
def calibrate_noise_multiplier(
    epsilon: float,
    delta: float,
    steps: int,
    *,
    make_event: Callable[[float], Optional[PrivacyEvent]],
    mechanism: Mechanism = "rdp",
    rel_tolerance: float = 1e-3,
    prior: Events = (),
) -> float:
    """Smallest noise multiplier (to ``rel_tolerance``) such that ``steps`` events fit (epsilon, delta).

    ``make_event(sigma)`` builds the per-step event for a noise multiplier (e.g. a batch source's ``step_event``).
    With ``mechanism="prv"`` the PRV search starts from the PLD answer (see the module docstring). ``prior``:
    events composed with the ``steps`` events (see the module docstring); refused when they alone leave nothing.
    """
    _check_budget(epsilon, delta)
    steps = check_count("steps", steps, minimum=1)
    prior = _check_prior(prior, epsilon, delta, mechanism)

    def spent_by(analysis: str) -> Callable[[float], float]:
        def spent(sigma: float) -> float:
            event = make_event(sigma)
            if event is None or spends_nothing(event):
                raise ValidationError("make_event", "the event spends no privacy: there is no noise to calibrate")
            return _evaluate([*prior, (event, steps)], delta, analysis)

        return spent

    if mechanism == "prv":
        event = make_event(1.0)
        if event is not None and not isinstance(event, PoissonGaussianEvent):
            epsilon_for([(event, 1)], delta, mechanism)  # raises the PRV accountant's named refusal
    sigma, hint = _gaussian_start(make_event, prior, steps, epsilon, delta), None
    for analysis in _passes(mechanism):
        if analysis == "pld" and pld_is_coarsest([*prior, (make_event(sigma), steps)]):
            # The coarse pass ran on the events' own grid at its answer, and at every smaller sigma (wider losses,
            # the same coarsest grid): its answer is exact.
            continue
        sigma, hint = _smallest_fitting_sigma(spent_by(analysis), epsilon, delta, steps, rel_tolerance, sigma, hint)
    return sigma


def _gaussian_dp_mu(epsilon: float, delta: float) -> Optional[float]:
    """The mu of mu-GDP (Dong, Roth, Su 2019, "Gaussian Differential Privacy") that is exactly (epsilon, delta)-DP:
    delta = Phi(-epsilon / mu + mu / 2) - e^epsilon Phi(-epsilon / mu - mu / 2)."""
    from scipy.optimize import brentq
    from scipy.stats import norm

    def excess(log_mu: float) -> float:
        mu = math.exp(log_mu)
        return float(norm.cdf(-epsilon / mu + mu / 2) - math.exp(epsilon + norm.logcdf(-epsilon / mu - mu / 2))) - delta

    try:
        return math.exp(brentq(excess, math.log(1e-6), math.log(1e3), xtol=1e-6))
    except ValueError:
        return None


def _gaussian_start(make_event: Callable[[float], Optional[PrivacyEvent]], prior: Events, steps: int, epsilon: float,
                    delta: float) -> float:
    """Where a noise search starts: the sigma at which the central-limit (Gaussian DP) approximation of the
    composition meets the budget (Dong, Roth, Su 2019: n steps of per-step loss variance v compose to about
    mu-GDP with mu^2 = n v). Close in the many-step regime, where evaluations are costly; a rough start elsewhere;
    1 when the approximation does not apply. Only a starting point: every answer is the accountant's."""
    from scipy.optimize import brentq

    def variance(event: Optional[PrivacyEvent]) -> float:
        spread = None if event is None else loss_spread(event)
        if spread is None:
            return 0.0
        return spread**2 * (event.probability if isinstance(event, MixtureEvent) else 1.0)

    mu = _gaussian_dp_mu(epsilon, delta)
    if mu is None:
        return 1.0
    try:
        spent = sum(count * variance(event) for event, count in prior)
        excess = lambda log_sigma: math.log(spent + steps * variance(make_event(math.exp(log_sigma))) + 1e-300) \
            - 2 * math.log(mu)
        low, high = math.log(SIGMA_RANGE[0]), math.log(SIGMA_RANGE[1])
        if not excess(low) > 0 > excess(high):
            return 1.0
        return math.exp(brentq(excess, low, high, xtol=1e-3))
    except (ValidationError, ValueError, OverflowError, ZeroDivisionError):
        return 1.0


def _smallest_fitting_sigma(
    spent: Callable[[float], float], epsilon: float, delta: float, steps: int, rel_tolerance: float,
    start: float = 1.0, hint: Optional[dict] = None,
) -> tuple[float, dict]:
    """Smallest sigma (to ``rel_tolerance``) with spent(sigma) within epsilon; spent falls as sigma grows. Returns
    (sigma, every evaluation {sigma: spent(sigma)}).

    Brackets from ``start`` with the model epsilon ~ 1/sigma (one jump usually crosses), or, given ``hint`` (a
    previous pass's evaluations, ``start`` its answer), by probing just above the crossing of the rescaled hint and
    then a tolerance below; then predicts the crossing by inverse interpolation (log sigma against log epsilon) and
    probes just above it and a tolerance below it; a log-space bisection after two rounds that fail to halve the
    bracket keeps the worst case bounded.
    """
    known: dict[float, float] = {}

    def fits(sigma: float) -> bool:
        if sigma not in known:
            _count_evaluation(known, "noise multiplier")
            known[sigma] = spent(sigma)
        return within_budget(known[sigma], epsilon)

    done = (1 + rel_tolerance) * (1 + 1e-9)  # a bracket this narrow is the answer
    low, high = None, None  # spent(low) > epsilon >= spent(high)
    sigma = start
    guided = 3  # probes placed by interpolation (the rescaled hint, then this pass's points) before the 1/sigma model
    while low is None or high is None:
        if fits(sigma):
            high = sigma if high is None else min(high, sigma)
            if low is not None:
                break
            prediction = _bracket_prediction(known, hint, start, epsilon) if guided else None
            if prediction is not None:  # just above the predicted crossing, or (once that fits) a tolerance below
                guided -= 1
                sigma = max(min(prediction * (1 + rel_tolerance / 2), high / (1 + rel_tolerance)), high / 64)
            else:
                value = known[sigma]
                aim = sigma * value / epsilon / 1.05 if value > 0 else sigma / 4
                sigma = min(max(aim, sigma / 64), sigma / (1 + rel_tolerance))
            if sigma < SIGMA_RANGE[0]:
                if fits(SIGMA_RANGE[0]):
                    return SIGMA_RANGE[0], known
                low = SIGMA_RANGE[0]
        else:
            low = sigma if low is None else max(low, sigma)
            if high is not None:
                break
            prediction = _bracket_prediction(known, hint, start, epsilon) if guided else None
            if prediction is not None:
                guided -= 1
                aim = prediction * (1 + rel_tolerance / 2)
            else:
                value = known[sigma]
                aim = sigma * value / epsilon * 1.05 if math.isfinite(value) else sigma * 64
            sigma = min(max(aim, sigma * (1 + rel_tolerance)), sigma * 64)
            if sigma > SIGMA_RANGE[1]:
                if not fits(SIGMA_RANGE[1]):
                    raise PrivacyBudgetError(
                        "epsilon",
                        f"even noise multiplier {SIGMA_RANGE[1]:g} does not fit epsilon={epsilon} at delta={delta} "
                        f"over {steps} steps",
                    )
                high = SIGMA_RANGE[1]
    stalls = 0
    while high / low > done:
        ratio = high / low
        prediction = _inverse_interpolate(known, epsilon)
        point = math.sqrt(low * high) if prediction is None else prediction[0]
        # Just above the predicted crossing (so it likely fits), then a tolerance below (so that likely does not).
        probe = min(max(point * (1 + rel_tolerance / 2), low * (1 + rel_tolerance / 4)), high / (1 + rel_tolerance / 4))
        if fits(probe):
            high = probe
            below = high / (1 + rel_tolerance)
            if below > low and high / low > done:
                if fits(below):
                    high = below
                else:
                    low = below
        else:
            low = probe
        stalls = stalls + 1 if high / low > math.sqrt(ratio) else 0
        if stalls >= 2 and high / low > done:  # interpolation is not converging: bisect in log space
            stalls, middle = 0, math.sqrt(low * high)
            if fits(middle):
                high = middle
            else:
                low = middle
    return high, known
