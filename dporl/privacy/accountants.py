"""Privacy accountants: turn a history of privacy events into one (epsilon, delta) guarantee.

Opacus-style interface (``step`` / ``record`` / ``get_epsilon(delta)`` / ``history`` / ``state_dict``) over three
analyses of the events in ``dporl.privacy.events``:

- ``"rdp"``: Renyi DP summed over a fixed grid of orders, converted with the tight conversion of Balle et al. 2020
  (``dporl.privacy.rdp``: Poisson Gaussian, Laplace, sampling without replacement, Algorithm 3's mixture step).
  An (epsilon, delta) event has no RDP curve: refused, use "pld".
- ``"pld"``: privacy loss distributions (``dp_accounting.pld``, pessimistic "connect the dots" discretisation,
  both add and remove directions, on a grid adapted to the events: ``dporl.privacy.pld``), composed exactly by
  FFT. Tight for (epsilon, delta) pairs
  (Kairouz-Oh-Viswanath style: each pair as its worst-case PLD), Laplace, Poisson Gaussian and the mixture
  PLD_mix = (1 - p) point_mass(0) + p PLD_q. Sampling without replacement is refused (no PLD construction here).
- ``"prv"``: Opacus' PRV accountant (Gopi et al. 2021), Poisson Gaussian only; other events are refused. Opacus
  builds the privacy loss of the remove direction only; tests check it against the two-direction PLD (the
  remove direction dominates for the Poisson Gaussian on the tested grid). Prefer "pld" when in doubt.

Every analysis is an upper bound on epsilon (pessimistic rounding, RDP conversion), never an estimate.
Curves and PLDs are cached per event and per composed history, so ``get_epsilon`` after thousands of steps of the
same event costs one FFT self-composition (PLD) or one vector sum (RDP).
"""

from __future__ import annotations

import math
import warnings
from collections import Counter
from typing import Any, Callable, Iterable, Literal, Sequence

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
    event_from_dict,
    event_to_dict,
)
from dporl.privacy.pld import (
    COARSEST,
    AnalysisTooLarge,
    CompositionTooLarge,
    check_constructible,
    check_grid,
    compose,
    epsilon_for_delta,
    history_interval,
)
from dporl.privacy.rdp import RDP_ORDERS, rdp_curve, swor_gaussian_rdp
from dporl.privacy.rdp import rdp_epsilon as _rdp_epsilon
from dporl.privacy.units import Relation
from dporl.utils.validation import ValidationError, check_probability

Mechanism = Literal["rdp", "prv", "pld"]
MECHANISMS: tuple[str, ...] = ("rdp", "prv", "pld")

# Opacus' PRV accountant: epsilon is reported to within this additive error (its upper bound is returned).
PRV_EPS_ERROR = 0.01
# An (epsilon, delta) guarantee with delta this large protects nobody (delta is the chance that everything leaks);
# there the analyses degenerate (the exact epsilon is 0 for most mechanisms), so the accountants refuse it.
MAX_DELTA = 0.1

ANALYSIS_NAMES = {
    "rdp": "RDP (Renyi DP over orders 1.1-1024, Balle et al. 2020 conversion to (eps, delta))",
    "pld": "PLD (dp_accounting privacy loss distributions, pessimistic, exact composition)",
    "prv": "PRV (Opacus privacy random variables, upper bound)",
}

# Which neighbouring relation an event's analysis uses; histories never mix two relations.
ADD_REMOVE, REPLACE_ONE = Relation.ADD_REMOVE, Relation.REPLACE_ONE


def adjacency(event: PrivacyEvent) -> Relation:
    replace_one = isinstance(event, (SampledWithoutReplacementGaussianEvent, ReplaceOneEvent)) or (
        isinstance(event, ApproxDPEvent) and event.replace_one
    )
    return REPLACE_ONE if replace_one else ADD_REMOVE


def check_mechanism(mechanism: str, field: str = "mechanism") -> str:
    if mechanism not in MECHANISMS:
        raise ValidationError(field, f"unknown accountant {mechanism!r}; choose one of {list(MECHANISMS)}")
    return mechanism


def check_count(field: str, value: Any, minimum: int = 0) -> int:
    """An integer count (Python or numpy) >= ``minimum``."""
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValidationError(field, f"must be an integer >= {minimum}, got {value!r}")
    return int(value)


def check_delta(delta: Any, field: str = "delta", allow_zero: bool = False) -> float:
    """A delta an (epsilon, delta) guarantee can use: in (0, MAX_DELTA] (``allow_zero``: [0, MAX_DELTA], e.g. the
    budget of a pure-DP stage)."""
    delta = check_probability(field, delta, allow_zero=allow_zero, allow_one=False)
    if delta > MAX_DELTA:
        raise ValidationError(
            field, f"{delta:g} is too large for a guarantee: delta is the probability that the privacy protection fails "
            f"outright, so it must be far below 1 / (number of people) (at most {MAX_DELTA:g} here; 1e-5 is usual)")
    return delta


def spends_nothing(event: PrivacyEvent) -> bool:
    return isinstance(event, MixtureEvent) and event.probability == 0


# --------------------------------------------------------------------------------------------- PLDs
def _spent_counts(history: Iterable[tuple[PrivacyEvent, int]]) -> Counter:
    counts: Counter = Counter()
    for event, count in history:
        if count and not spends_nothing(event):
            counts[event] += count
    return counts


def composed_pld(history: Iterable[tuple[PrivacyEvent, int]], coarsening: int = 1):
    """PLD of a whole history (order does not matter: composition commutes) on its events' grid
    (``dporl.privacy.pld.history_interval``), or on a grid ``coarsening`` times coarser (at most the coarsest);
    None when nothing was spent. Sized before it is built (``dporl.privacy.pld.compose``)."""
    counts = _spent_counts(history)
    if not counts:
        return None
    return compose(counts, interval=history_interval(counts, coarsening))


def _pld_epsilon(history: Sequence[tuple[PrivacyEvent, int]], delta: float, coarsening: int = 1) -> float:
    """The PLD's epsilon, never below one step of its grid: below that the grid does not resolve it (a PLD that
    reports (0, delta) is then charged one step, so epsilon stays positive and non-decreasing in every count, and
    non-increasing in the noise, whose grid gets finer as it grows; a composition coarsened to fit its size cap
    only coarsens further as counts grow)."""
    pld = composed_pld(history, coarsening)
    if pld is None:
        return 0.0
    return max(float(epsilon_for_delta(pld, delta)), pld._pmf_remove._discretization)


# --------------------------------------------------------------------------------------------- PRV
def _check_prv(event: PrivacyEvent) -> None:
    if not isinstance(event, PoissonGaussianEvent):
        raise ValidationError(
            "accountant.mechanism",
            f"Opacus' PRV accountant analyses Poisson-subsampled Gaussian steps only, not {type(event).__name__}; "
            "use mechanism='pld' (mixtures, Laplace, (epsilon, delta) releases) or 'rdp'",
        )


def _prv_epsilon(history: Sequence[tuple[PrivacyEvent, int]], delta: float) -> float:
    from opacus.accountants import PRVAccountant

    from opacus.accountants.analysis.prv import PoissonSubsampledGaussianPRV, compute_safe_domain_size

    accountant = PRVAccountant()
    for event, count in history:
        _check_prv(event)
        if count:
            accountant.history.append((event.noise_multiplier, event.sample_rate, count))
    if not accountant.history:
        return 0.0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        # Opacus' domain (PRVAccountant._get_domain, delta_error = delta / 1000), sized before it is discretised.
        counts = [count for _, _, count in accountant.history]
        prvs = [PoissonSubsampledGaussianPRV(q, sigma) for sigma, q, _ in accountant.history]
        half_width = compute_safe_domain_size(prvs, counts, eps_error=PRV_EPS_ERROR, delta_error=delta / 1000)
        mesh = PRV_EPS_ERROR / math.sqrt(sum(counts) * math.log(12 / (delta / 1000)) / 2)
        check_grid("the PRV domain", 2 * half_width / mesh)
        return max(0.0, float(accountant.get_epsilon(delta, eps_error=PRV_EPS_ERROR)))


_EPSILON_FUNCTIONS = {"rdp": _rdp_epsilon, "pld": _pld_epsilon, "prv": _prv_epsilon}


def check_analysable(event: PrivacyEvent, mechanism: str) -> None:
    """Raise (with the reason) if ``mechanism`` cannot analyse ``event``; cheap (nothing is composed)."""
    check_mechanism(mechanism)
    if spends_nothing(event):
        return
    if mechanism == "rdp":
        rdp_curve(event)
    elif mechanism == "pld":
        check_constructible(event)  # whatever its size: one too large to build is answered by another bound
    else:
        _check_prv(event)


# Float round-off of the analyses (a single (0.1, delta) release composes to 0.10000000000000007): a spend within
# this relative margin of a budget is the budget itself, not past it.
BUDGET_RTOL = 1e-12


def within_budget(spent: float, budget: float) -> bool:
    return spent <= budget * (1 + BUDGET_RTOL)


def _closed_form_epsilon(history: Sequence[tuple[PrivacyEvent, int]], delta: float) -> float:
    """A coarse but sound epsilon, used where a numerical analysis underflows to exactly 0.

    Every Gaussian-type step is charged as an unsampled Gaussian with its noise multiplier (subsampling and mixing
    only reduce the loss), composed in zCDP (rho = sum count / (2 sigma^2); eps = rho + 2 sqrt(rho ln(1/delta')),
    Bun & Steinke 2016); Laplace and (eps, delta) events add by basic composition.
    """
    rho, pure_epsilon, spent_delta = 0.0, 0.0, 0.0
    for event, count in history:
        if not count or spends_nothing(event):
            continue
        if isinstance(event, ReplaceOneEvent):  # a replacement moves the release by twice the sensitivity
            from dporl.privacy.relations import doubled_sensitivity

            event = doubled_sensitivity(event.event)
        if isinstance(event, MixtureEvent):
            event = event.event
        if isinstance(event, SelectionEvent):  # no closed form: the Renyi analysis alone answers
            return math.inf
        if isinstance(event, (PoissonGaussianEvent, SampledWithoutReplacementGaussianEvent)):
            rho += count / (2 * event.noise_multiplier**2)
        elif isinstance(event, LaplaceEvent):
            pure_epsilon += count / event.noise_multiplier
        else:
            pure_epsilon += count * event.epsilon
            spent_delta += count * event.delta
    remaining = delta - spent_delta
    if rho == 0:  # pure and (eps, delta) events only: basic composition, exact at the deltas they spend
        return pure_epsilon if remaining >= 0 else math.inf
    if remaining <= 0:
        return math.inf
    return pure_epsilon + rho + 2 * math.sqrt(rho * math.log(1 / remaining))


def _checked_history(events: Sequence[tuple[PrivacyEvent, int]], delta: float) -> list[tuple[PrivacyEvent, int]]:
    check_delta(delta, allow_zero=True)
    history = [(event, check_count("count", count)) for event, count in events]
    relations = {adjacency(e) for e, c in history if c and not spends_nothing(e)}
    if len(relations) > 1 and delta > 0:
        raise ValidationError(
            "events", f"cannot compose events analysed under different neighbouring relations {sorted(relations)}"
        )
    return history


def _rdp_fallback(history: Sequence[tuple[PrivacyEvent, int]], delta: float) -> float:
    """The RDP bound of ``history`` where every spending event has a Renyi curve, else inf (the closed-form bound of
    ``epsilon_for`` then answers): what a PLD or PRV analysis too large to build is replaced by."""
    try:
        return _rdp_epsilon([(e, c) for e, c in history if c and not spends_nothing(e)], delta)
    except ValidationError:  # an (epsilon, delta) event or a replace-one conversion: no Renyi curve
        return math.inf


def _bounded(analysis: Callable[[], float], history: Sequence[tuple[PrivacyEvent, int]], delta: float) -> float:
    """``analysis()``, or where its grid would be too large to build the bound that replaces it, then never free:
    the smaller of that and the closed-form bound (the latter alone where the backend reports 0).

    Monotone in every count like the analyses themselves: an event too large to build (``AnalysisTooLarge``) is a
    property of the set of events, answered by the RDP bound for every count; a composition too large on every grid
    (``CompositionTooLarge``) stays so at larger counts, and is answered by the closed-form bound, which is at least
    what any smaller count reported (that is the smaller of its backend and the same closed form)."""
    try:
        epsilon = analysis()
    except CompositionTooLarge:
        epsilon = math.inf
    except AnalysisTooLarge:
        epsilon = _rdp_fallback(history, delta)
    if any(c and not spends_nothing(e) for e, c in history):
        bound = _closed_form_epsilon(history, delta)
        epsilon = bound if epsilon == 0.0 else min(epsilon, bound)
    return epsilon


def epsilon_for(events: Sequence[tuple[PrivacyEvent, int]], delta: float, mechanism: Mechanism) -> float:
    """Epsilon at ``delta`` of the composition of ``count`` runs of each ``event``, by ``mechanism``.

    The result is the smaller of two upper bounds: the backend's and the closed-form one of ``_closed_form_epsilon``.
    The latter matters only at very large noise multipliers, where the numerical analyses hit their floors (the
    RDP conversion at the largest order) or underflow to exactly 0, which would report a spend as free. At
    ``delta`` = 0: the pure-DP epsilon (``pure_epsilon``).

    Bounded in time and memory: ``delta`` above ``MAX_DELTA`` is refused (``check_delta``); PLD grids are sized
    before they are built (``dporl.privacy.pld``): an event whose PMF would be too large (a tiny noise multiplier)
    is answered by the RDP bound (or the closed-form one for events without a Renyi curve), a composition too large
    is built on a coarser grid (or answered by the closed-form bound); a PRV domain too large, by the RDP bound.
    Every answer is an upper bound, and PLD answers stay non-decreasing in every count.
    """
    check_mechanism(mechanism)
    history = _checked_history(events, delta)
    if delta == 0:
        return pure_epsilon(history)
    if not any(c for _, c in history):
        for event, _ in history:
            check_analysable(event, mechanism)
        return 0.0
    delta = float(delta)
    return _bounded(lambda: _EPSILON_FUNCTIONS[mechanism](history, delta), history, delta)


def coarse_pld_epsilon(events: Sequence[tuple[PrivacyEvent, int]], delta: float, coarsening: int) -> float:
    """``epsilon_for(events, delta, "pld")`` on a grid ``coarsening`` times coarser than the events' own (at most the
    coarsest grid, where it is ``epsilon_for`` itself): a looser upper bound at a fraction of the cost, which searches
    use to get close before they evaluate the real analysis."""
    history = _checked_history(events, delta)
    if delta == 0:
        return pure_epsilon(history)
    if not _spent_counts(history):
        return 0.0
    delta = float(delta)
    return _bounded(lambda: _pld_epsilon(history, delta, coarsening), history, delta)


def pld_is_coarsest(events: Sequence[tuple[PrivacyEvent, int]]) -> bool:
    """Whether the PLD analysis of ``events`` already uses the coarsest grid (``coarse_pld_epsilon`` is then exact)."""
    counts = _spent_counts(events)
    return not counts or history_interval(counts) >= COARSEST


def pure_epsilon(history: Sequence[tuple[PrivacyEvent, int]]) -> float:
    """Epsilon at delta = 0: the sum over pure events (Laplace, (eps, 0) releases; basic composition, exact for pure
    DP), infinite when any spending event has no pure guarantee (a Gaussian, a delta > 0)."""
    total = 0.0
    for event, count in history:
        if not count or spends_nothing(event):
            continue
        factor = 1.0
        if isinstance(event, ReplaceOneEvent):  # twice the sensitivity; group privacy for (eps, 0)
            event, factor = event.event, 2.0
        if isinstance(event, LaplaceEvent):
            total += factor * count / event.noise_multiplier
        elif isinstance(event, ApproxDPEvent) and event.delta == 0:
            total += factor * count * event.epsilon
        else:
            return math.inf
    return total


def paper_mixture_epsilon(
    probability: float, sample_rate: float, noise_multiplier: float, steps: int, delta: float,
    mechanism: Mechanism = "rdp",
) -> float:
    """The expert-level paper's figure for Algorithm 3: NOT A GUARANTEE.

    The paper accounts each mixed step as a Poisson-subsampled Gaussian with rate p * q. The branch (noisy or
    noiseless step) is visible in the iterates, so this understates epsilon; dporl's guarantee uses
    ``MixtureEvent`` instead. Provided only to print the paper's number beside the sound one, labelled as such.
    """
    check_probability("probability", probability, allow_zero=False)
    check_probability("sample_rate", sample_rate, allow_zero=False)
    return epsilon_for([(PoissonGaussianEvent(noise_multiplier, probability * sample_rate), steps)], delta, mechanism)


class Accountant:
    """History of (event, count) pairs analysed by one mechanism; consecutive equal events are merged."""

    def __init__(self, mechanism: Mechanism = "rdp"):
        self.mechanism = check_mechanism(mechanism)
        self.history: list[tuple[PrivacyEvent, int]] = []
        self._cache: dict[tuple, float] = {}

    def step(self, *, noise_multiplier: float, sample_rate: float) -> None:
        """Opacus-compatible: one Poisson-subsampled Gaussian step."""
        self.record(PoissonGaussianEvent(noise_multiplier, sample_rate))

    def record(self, event: PrivacyEvent, count: int = 1) -> None:
        count = check_count("count", count)
        check_analysable(event, self.mechanism)
        relations = {adjacency(e) for e, _ in self.history} | {adjacency(event)}
        if len(relations) > 1:
            raise ValidationError(
                "event", f"this accountant already holds events under another neighbouring relation: {relations}"
            )
        if count == 0:
            return
        if self.history and self.history[-1][0] == event:
            self.history[-1] = (event, self.history[-1][1] + int(count))
        else:
            self.history.append((event, int(count)))

    def get_epsilon(self, delta: float) -> float:
        key = (tuple(self.history), float(delta))
        if key not in self._cache:
            self._cache = {key: epsilon_for(self.history, delta, self.mechanism)}  # keep only the latest
        return self._cache[key]

    def epsilon_with(self, extra: Sequence[tuple[PrivacyEvent, int]], delta: float) -> float:
        """Epsilon if ``extra`` were recorded too (the history is not changed)."""
        return epsilon_for(list(self.history) + list(extra), delta, self.mechanism)

    def __len__(self) -> int:
        """Number of recorded events (Opacus' accountants count steps the same way)."""
        return sum(count for _, count in self.history)

    def state_dict(self) -> dict[str, Any]:
        return {
            "mechanism": self.mechanism,
            "history": [[event_to_dict(event), count] for event, count in self.history],
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mechanism = check_mechanism(state["mechanism"], "accountant.mechanism")
        if mechanism != self.mechanism:
            raise ValidationError("accountant.mechanism", f"state is for {mechanism!r}, this is {self.mechanism!r}")
        self.history = [(event_from_dict(event), int(count)) for event, count in state["history"]]
        self._cache = {}


def make_accountant(mechanism: Mechanism) -> Accountant:
    return Accountant(mechanism)


def analysis_name(mechanism: str) -> str:
    return ANALYSIS_NAMES[check_mechanism(mechanism)]


__all__ = [
    "Accountant",
    "make_accountant",
    "epsilon_for",
    "paper_mixture_epsilon",
    "analysis_name",
    "adjacency",
]
