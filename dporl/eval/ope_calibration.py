"""Which private estimators and configurations give calibrated intervals, as the benchmark suite measured them.

``OPEResult.calibrated`` is True only for an estimator and configuration whose 95% interval covered the truth at
least 95% of the time on every problem of the suite where it answers (``python -m dporl.eval.ope_suite``: the
treatment chain, a supervised-to-bandit problem on sklearn's digits, logged CartPole, a problem with negative
rewards; >= 100 datasets per cell at eps 0.1, 1 and 10), with the clip bias included. Anything else carries a caveat
(its last note) that says what was measured. The decision reads public inputs only: the estimator, the
configuration, the declared scales and whether the target DECLARES itself deterministic, never the data.

One configuration meets the bar: DP-WIS with nothing clipped (the unit clip at least the public maximum of a unit's
contribution, so no clip bias) on a target that declares itself stochastic. Its interval (``dporl.eval.ope_interval``)
is valid by construction up to the central limit theorem over units, and the suite measured it (``WIS_MEASURED``)
on the one problem where it answers (digits; on the multi-step problems a nothing-clipped unit sum is refused before
spending, naming the units needed).
"""

from __future__ import annotations

from typing import Optional

from dporl.eval.ope_scales import OPEScales

SUITE = "python -m dporl.eval.ope_suite; docs/results.md"
# DP-WIS, nothing clipped, stochastic target: (covered, datasets) per problem and epsilon where it answered, from
# ``python -m dporl.eval.ope_suite --problems digits --estimators wis --datasets 1000`` (seed 0): 0.966 [0.953, 0.976]
# at eps 1, 0.965 [0.952, 0.976] at eps 10 (Clopper-Pearson); eps 0.1 and the multi-step problems are refused
# before spending.
WIS_MEASURED = {"digits": {1.0: (966, 1000), 10.0: (965, 1000)}}

_CAVEATS = {
    "pdis": "clipping heavy-tailed per-decision weights biases PDIS, and its interval does not contain that bias "
            f"(measured below 0.95 coverage on the suite: {SUITE}); use WIS",
    "dr": "DR's correction terms on a noisy DP-FQE model are heavy-tailed, clipping them biases the estimate, and "
          f"its interval does not contain that bias (measured below 0.95 coverage on the suite: {SUITE})",
    "deterministic": "the target policy is deterministic: its importance weights are heavy-tailed and clipping them "
                     f"biases WIS (measured below 0.95 coverage: {SUITE}); use DP-FQE",
    "undeclared": "the target policy does not declare whether it is deterministic (deterministic=, or "
                  "dporl.eval.ope_policies.declare_deterministic): WIS's interval was measured nominal for stochastic "
                  "targets only, and a deterministic target's clipped weights bias it",
    "clipped": "the unit clip is below the public maximum of a unit's contribution (or no maximum was declared: "
               "min_propensity, horizon, episodes_per_unit), so clipping may bias the estimate by an amount the "
               "interval does not contain (no public bound exists: the share of weight above the clip depends on the "
               "logging policy beyond its declared minimum propensity; WIS was measured nominal with nothing clipped: "
               f"{SUITE})",
    "fqe": "DP-SGD noise and the fitted Q-function's approximation bias the fold values alike, and the Student-t "
           f"interval over folds sees their spread, not that bias (measured below 0.95 coverage on the suite: {SUITE})",
}


def importance_caveat(kind: str, *, deterministic: Optional[bool], clip: float, scales: OPEScales,
                      epsilon: float) -> Optional[str]:
    """None when DP-WIS / PDIS / DR in this configuration was measured nominal on the suite (DP-WIS with nothing
    clipped on a target that declares itself stochastic), else why not."""
    if kind != "wis":
        return _CAVEATS[kind]
    if deterministic is None:
        return _CAVEATS["undeclared"]
    if deterministic:
        return _CAVEATS["deterministic"]
    maximum = scales.max_unit_norm("wis")
    if maximum is None or clip < maximum * (1 - 1e-12):
        return _CAVEATS["clipped"]
    return None


def fqe_caveat() -> str:
    return _CAVEATS["fqe"]
