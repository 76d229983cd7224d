"""Audit of private selection (``dporl.privacy.selection``): the best of a random number of private trials.

Each trial is randomised response on a FIXED neighbouring pair: it outputs a score bit that is 1 with probability
p = e^eps0 / (1 + e^eps0) on D and 1 - p on D' (the worst case of a pure eps0-DP trial), as the search's trials output
a private score. The search draws K with the distribution a ``dporl tune`` search uses (``TrialCount.sample``, the
same sampler), runs K trials and releases the best score only (nothing when K = 0); the test statistic is that
released score. The claim is the search's accounted epsilon: the ``SelectionEvent`` over the trial's event
``ApproxDPEvent(eps0, 0)``, analysed by ``selection_rdp`` and converted like every Renyi history. Thousands of searches
run per second, so the bound is tight enough to be informative.

Power (``fixed_trials``): the variant that releases the best of a FIXED number of trials and claims only one trial's
epsilon (selection treated as free, as when someone tunes on private evaluations without accounting). Best-of-k of
randomised response is k eps0-DP (the all-zero outcome has likelihood ratio e^(k eps0)), so the audit must exceed the
claim.
"""

from __future__ import annotations

import math
from typing import Optional

import numpy as np

from dporl.audit.experiment import Experiment
from dporl.privacy.accountants import epsilon_for
from dporl.privacy.events import ApproxDPEvent
from dporl.privacy.selection import TrialCount, selection_epsilon
from dporl.utils.validation import ValidationError, check_positive


def selection_audit(
    trial_epsilon: float = 0.5, mean: float = 6.0, distribution: str = "poisson", eta: float = 1.0,
    delta: float = 1e-5, fixed_trials: Optional[int] = None,
) -> Experiment:
    eps0 = check_positive("trial_epsilon", trial_epsilon)
    count = TrialCount.with_mean(mean, distribution, eta)
    if fixed_trials is not None and (isinstance(fixed_trials, bool) or int(fixed_trials) != fixed_trials
                                     or fixed_trials < 1):
        raise ValidationError("fixed_trials", f"must be an integer >= 1, got {fixed_trials!r}")
    p_one = math.exp(eps0) / (1 + math.exp(eps0))
    trial = ((ApproxDPEvent(eps0, 0.0), 1),)

    def scores(n: int, on_d: bool, seed: int) -> np.ndarray:
        rng = np.random.default_rng(seed)
        k = np.full(n, int(fixed_trials), dtype=np.int64) if fixed_trials else count.sample(rng, n)
        bits = rng.random(int(k.sum())) < (p_one if on_d else 1 - p_one)
        owner = np.repeat(np.arange(n), k)
        best = np.where(k > 0, 0.0, -np.inf)  # nothing released when no trial ran
        best[np.unique(owner[bits])] = 1.0
        return best

    if fixed_trials:
        claimed = epsilon_for([trial[0]], delta, "pld")  # one trial's epsilon: the selection left unaccounted
        analysis = (f"NOT an accounted claim: the best of {int(fixed_trials)} randomised-response trials released "
                    "under one trial's epsilon (selection treated as free)")
    else:
        claimed = selection_epsilon(count.event((trial,)), delta)
        analysis = f"SelectionEvent over ApproxDPEvent({eps0:g}, 0), {count.describe()}: selection_rdp (Papernot & " \
                   "Steinke 2022), RDP conversion"
    return Experiment(
        name="selection",
        claimed_epsilon=claimed,
        delta=delta,
        privacy_unit="record",
        analysis=analysis,
        neighbours=f"each trial is randomised response at eps0={eps0:g} on a fixed pair (score bit 1 with "
                   f"probability {p_one:.3f} on D, {1 - p_one:.3f} on D')",
        scores=scores,
        chunk_trials=100_000,
        settings={"trial_epsilon": eps0, "trials": count.to_dict(), "fixed_trials": fixed_trials},
    )


__all__ = ["selection_audit"]
