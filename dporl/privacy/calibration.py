"""Calibration: the noise a budget needs, and the number of steps a budget allows.

Both search the accountant itself (no closed-form approximation), so the answer is exactly as sound as the
accountant: ``calibrate_noise_multiplier`` returns a sigma whose accounted epsilon is <= the target (the upper
end of a bisection, never the midpoint), and ``max_steps`` returns the exact largest integer n with
epsilon(n steps) <= target, using that epsilon grows with n (more releases never reduce the privacy loss).
"""

from __future__ import annotations

import math
from typing import Callable, Optional

from dporl.privacy.accountants import Mechanism, check_count, epsilon_for, spends_nothing, within_budget
from dporl.privacy.events import PrivacyEvent
from dporl.utils.validation import PrivacyBudgetError, ValidationError, check_positive, check_probability

# Beyond these the budget is meaningless for training (or the search would not terminate).
SIGMA_RANGE = (1e-3, 1e6)
STEP_SEARCH_LIMIT = 10**9


def _check_budget(epsilon: float, delta: float) -> None:
    check_positive("epsilon", epsilon)
    check_probability("delta", delta, allow_zero=False, allow_one=False)


def calibrate_noise_multiplier(
    epsilon: float,
    delta: float,
    steps: int,
    *,
    make_event: Callable[[float], Optional[PrivacyEvent]],
    mechanism: Mechanism = "rdp",
    rel_tolerance: float = 1e-3,
) -> float:
    """Smallest noise multiplier (to ``rel_tolerance``) such that ``steps`` events fit (epsilon, delta).

    ``make_event(sigma)`` builds the per-step event for a noise multiplier (e.g. a batch source's ``step_event``).
    """
    _check_budget(epsilon, delta)
    steps = check_count("steps", steps, minimum=1)

    def spent(sigma: float) -> float:
        event = make_event(sigma)
        if event is None or spends_nothing(event):
            raise ValidationError("make_event", "the event spends no privacy: there is no noise to calibrate")
        return epsilon_for([(event, steps)], delta, mechanism)

    # Bracket from sigma = 1 outwards (each evaluation of a new sigma costs a fresh analysis).
    low, high = 1.0, 1.0
    if within_budget(spent(1.0), epsilon):
        while within_budget(spent(low), epsilon):
            high, low = low, low / 4
            if low < SIGMA_RANGE[0]:
                return high
    else:
        while not within_budget(spent(high), epsilon):
            low, high = high, high * 4
            if high > SIGMA_RANGE[1]:
                raise PrivacyBudgetError(
                    "epsilon",
                    f"even noise multiplier {SIGMA_RANGE[1]:g} does not fit epsilon={epsilon} at delta={delta} "
                    f"over {steps} steps",
                )
    # Invariant: spent(low) > epsilon >= spent(high). Bisect in log space.
    while high / low > 1 + rel_tolerance:
        middle = math.sqrt(low * high)
        if within_budget(spent(middle), epsilon):
            high = middle
        else:
            low = middle
    return high


def max_steps(
    event: PrivacyEvent, epsilon: float, delta: float, *, mechanism: Mechanism = "rdp", limit: Optional[int] = None
) -> int:
    """Largest n with epsilon(n x ``event``) <= ``epsilon`` at ``delta`` (0 if not even one fits).

    ``limit`` caps the search (the answer is then min(limit, n)); without it an event that spends nothing, or a
    budget allowing more than 10^9 steps, is an error rather than an endless search.
    """
    _check_budget(epsilon, delta)
    limit = None if limit is None else check_count("limit", limit)
    cap = STEP_SEARCH_LIMIT if limit is None else limit
    if spends_nothing(event):
        if limit is None:
            raise ValidationError("event", f"{event} spends no privacy: the number of steps is unbounded")
        return limit

    def fits(n: int) -> bool:
        return within_budget(epsilon_for([(event, n)], delta, mechanism), epsilon)

    if cap == 0 or not fits(1):
        return 0
    good, bad = 1, None  # fits(good); not fits(bad)
    while bad is None:
        trial = min(2 * good, cap)
        if trial == good:  # reached the cap
            if limit is None:
                raise ValidationError("epsilon", f"the budget allows more than {cap} steps of {event}; set a step cap")
            return cap
        if fits(trial):
            good = trial
        else:
            bad = trial
    while bad - good > 1:
        middle = (good + bad) // 2
        if fits(middle):
            good = middle
        else:
            bad = middle
    return good
