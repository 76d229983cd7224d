"""One guarantee, two neighbouring relations: analyse add/remove events for replace-one neighbours.

Add/remove neighbours differ by one unit present in one dataset only; replace-one neighbours have the same size m and
differ in the content of one unit. Neither guarantee implies the other with the same epsilon, so results computed
under different relations must not be compared as if their budgets were equal (GPOPE's Poisson mode is add/remove,
DP-LSW / DP-LSL (Balle et al. 2016) and GPOPE's paper mode are replace-one).

Replacing x by x' is removing x and then adding x' (D -> D + x' -> D'), and this module analyses exactly that:

- Poisson-subsampled Gaussian (and Algorithm 3's mixture step, whose branch is observable): tight, by
  ``dp_accounting``'s privacy loss distribution for ``NeighboringRelation.REPLACE_ONE``. x and x' are each sampled
  with probability q and pull the clipped sum in opposite directions, so the worst pair of outputs is
  (1 - q) N(0, s^2) + q N(-1, s^2) against (1 - q) N(0, s^2) + q N(+1, s^2) (per-unit norm 1, noise multiplier s):
  its privacy loss is the remove loss plus the add loss at the same output (``ReplaceOneEvent``, built by
  ``dporl.privacy.pld.replace_one_pld``). Composed exactly (FFT, sized before it is built), pessimistic
  discretisation on the events' add/remove grid (``dporl.privacy.pld``: finer for narrower per-step losses), at most
  ``REPLACE_ONE_DISCRETIZATION`` (1e-4: at sample rates 1e-3..1e-2 and up to 3e4 steps it is within 0.3% of 2e-5,
  while 1e-3 overstates epsilon by up to 30%).
- Laplace: the replace-one L1 sensitivity is at most twice the add/remove one (triangle inequality through D + x'),
  exact for the unsampled mechanism.
- An event known only as (eps, delta)-DP for add/remove: group privacy over the two steps, (2 eps, (1 + e^eps) delta)
  (loose; used only where nothing tighter is known).
- Events already analysed for replace-one (sampling without replacement, DP-LSW / DP-LSL) pass through unchanged.

Like ``epsilon_for``, the result is never reported as free: it is the smaller of the PLD bound and the closed-form
zCDP bound of the same events at twice the sensitivity. The reverse conversion (a replace-one guarantee to
add/remove) is refused: a guarantee about datasets of one size says nothing about datasets of another.
"""

from __future__ import annotations

import math
from typing import Callable, Sequence

from dporl.privacy.accountants import (
    Mechanism,
    adjacency,
    check_count,
    check_delta,
    epsilon_for,
    spends_nothing,
    within_budget,
)
from dporl.privacy.events import (
    ApproxDPEvent,
    LaplaceEvent,
    MixtureEvent,
    PoissonGaussianEvent,
    PrivacyEvent,
    ReplaceOneEvent,
)
from dporl.privacy.pld import REPLACE_ONE_DISCRETIZATION, replace_one_pld
from dporl.privacy.units import Relation
from dporl.utils.validation import PrivacyBudgetError, ValidationError, check_positive

ADD_REMOVE, REPLACE_ONE = Relation.ADD_REMOVE, Relation.REPLACE_ONE
RELATIONS = (ADD_REMOVE, REPLACE_ONE)

CONVERSION = (
    "add/remove events analysed for replace-one neighbours (a replacement = one removal + one addition): "
    "Poisson-subsampled Gaussian steps by dp_accounting's replace-one PLD (tight), Laplace at twice the "
    "sensitivity, (eps, delta)-only events by group privacy (2 eps, (1 + e^eps) delta)"
)


def analysed_for(relation: Relation | str, event: PrivacyEvent | None) -> PrivacyEvent | None:
    """``event`` as a run whose neighbouring relation is ``relation`` records it: an add/remove event of a
    replace-one run is wrapped in ``ReplaceOneEvent`` (analysed as the module docstring says); anything else, and
    ``None`` (a step that releases nothing), is returned as is."""
    relation = check_relation("relation", relation)
    if event is None or relation != REPLACE_ONE or spends_nothing(event) or adjacency(event) == REPLACE_ONE:
        return event
    return ReplaceOneEvent(event)


def relation_of(history: Sequence[tuple[PrivacyEvent, int]]) -> Relation:
    """The one neighbouring relation a history's events were analysed under (add/remove for an empty history)."""
    relations = {adjacency(event) for event, count in history if count and not spends_nothing(event)}
    if len(relations) > 1:
        raise ValidationError("events", f"a history mixes neighbouring relations {sorted(map(str, relations))}")
    return relations.pop() if relations else ADD_REMOVE


def check_relation(field: str, relation: Relation | str) -> Relation:
    """``relation`` as a ``Relation`` (add/remove or replace-one; its value string is accepted too)."""
    try:
        relation = Relation(relation)
    except ValueError:
        relation = None
    if relation not in RELATIONS:
        raise ValidationError(field, f"unknown neighbouring relation; use one of {[str(r) for r in RELATIONS]}")
    return relation


def doubled_sensitivity(event: PrivacyEvent) -> PrivacyEvent:
    """The same release with twice the sensitivity: what the closed-form fallback charges for a replacement."""
    if isinstance(event, MixtureEvent):
        event = event.event
    if isinstance(event, PoissonGaussianEvent):
        return PoissonGaussianEvent(event.noise_multiplier / 2, 1.0)
    if isinstance(event, LaplaceEvent):
        return LaplaceEvent(event.noise_multiplier / 2)
    if isinstance(event, ApproxDPEvent) and not event.replace_one:
        return ApproxDPEvent(2 * event.epsilon, min(1.0, (1 + math.exp(event.epsilon)) * event.delta))
    return event


def _converted_epsilon(history: Sequence[tuple[PrivacyEvent, int]], delta: float) -> float:
    """An add/remove history's epsilon for replace-one neighbours: each event as ``ReplaceOneEvent`` (the replace-one
    PLD, ``dporl.privacy.pld.replace_one_pld``), composed by ``epsilon_for``'s PLD analysis (sized, and never below
    one grid step or above the closed-form bound at twice the sensitivity)."""
    return epsilon_for([(ReplaceOneEvent(e), c) for e, c in history if c and not spends_nothing(e)], delta, "pld")


def epsilon_for_relation(
    history: Sequence[tuple[PrivacyEvent, int]], delta: float, relation: Relation, *, mechanism: Mechanism = "rdp"
) -> float:
    """Epsilon at ``delta`` of ``history`` for ``relation`` neighbours.

    A history already analysed under ``relation`` goes to ``epsilon_for`` with ``mechanism``; an add/remove history
    asked for replace-one is converted as the module docstring says; replace-one to add/remove is refused.
    """
    relation = check_relation("relation", relation)
    check_delta(delta)
    history = [(event, check_count("count", count)) for event, count in history]
    native = relation_of(history)
    if native == relation:
        return epsilon_for(history, delta, mechanism)
    if native == REPLACE_ONE:
        raise ValidationError(
            "relation",
            "a replace-one guarantee (datasets of one size m) implies nothing for add/remove neighbours (sizes m and "
            "m + 1); report it as replace-one",
        )
    return _converted_epsilon(history, delta)


def calibrate_for_relation(
    epsilon: float,
    delta: float,
    steps: int,
    *,
    make_event: Callable[[float], PrivacyEvent],
    relation: Relation,
    mechanism: Mechanism = "rdp",
    rel_tolerance: float = 1e-3,
) -> float:
    """Smallest noise multiplier (to ``rel_tolerance``) whose ``steps`` events fit (epsilon, delta) for ``relation``.

    The root of epsilon(sigma) = target is found in log sigma (Brent) and then checked: the returned sigma is the
    upper end of the final bracket, whose analysed epsilon is <= the target (never the midpoint).
    """
    from scipy.optimize import brentq

    check_positive("epsilon", epsilon)
    check_delta(delta)
    relation = check_relation("relation", relation)
    steps = check_count("steps", steps, minimum=1)

    def spent(sigma: float) -> float:
        return epsilon_for_relation([(make_event(sigma), steps)], delta, relation, mechanism=mechanism)

    # Bracket: spent(low) > epsilon >= spent(high), doubling outwards from sigma = 1.
    if within_budget(spent(1.0), epsilon):
        low, high = 0.5, 1.0
        while within_budget(spent(low), epsilon):
            low, high = low / 2, low
            if low < 1e-3:
                return high
    else:
        low, high = 1.0, 2.0
        while not within_budget(spent(high), epsilon):
            low, high = high, high * 2
            if high > 1e6:
                raise PrivacyBudgetError(
                    "epsilon", f"even noise multiplier 1e6 does not fit epsilon={epsilon} at delta={delta} over "
                    f"{steps} steps",
                )
    root = math.exp(brentq(lambda log_sigma: spent(math.exp(log_sigma)) - epsilon, math.log(low), math.log(high),
                           xtol=rel_tolerance / 4))
    sigma = min(high, root * (1 + rel_tolerance / 2))
    while not within_budget(spent(sigma), epsilon):  # pessimistic rounding can make epsilon(sigma) slightly bumpy
        sigma *= 1 + rel_tolerance / 2
    return sigma


__all__ = [
    "CONVERSION",
    "analysed_for",
    "RELATIONS",
    "calibrate_for_relation",
    "check_relation",
    "epsilon_for_relation",
    "relation_of",
    "REPLACE_ONE_DISCRETIZATION",
    "replace_one_pld",
]
