"""Which private estimators and configurations give calibrated intervals, as the benchmark suite measured them.

``OPEResult.calibrated`` is True only for an estimator and configuration whose 95% interval covered the truth at
least 95% of the time on every problem of the suite (``python -m dporl.eval.ope_suite``: the treatment chain, a
supervised-to-bandit problem on sklearn's digits, logged CartPole, a problem with negative rewards; >= 100 datasets
per cell at eps 0.1, 1 and 10), with the clip bias included. Anything else carries a caveat (its last note) that
says what was measured. No configuration meets that bar today (the closest, DP-WIS with nothing clipped on a
stochastic target, covered 0.939 at eps 10 on digits), so every result says calibrated=False with the measured
reason. The decision reads public inputs only: the estimator, the configuration, the declared
scales and whether the target DECLARES itself deterministic, never the data.
"""

from __future__ import annotations

from typing import Optional

from dporl.eval.ope_scales import OPEScales

SUITE = "python -m dporl.eval.ope_suite; docs/results.md"

_CAVEATS = {
    "pdis": "clipping heavy-tailed per-decision weights biases PDIS, and its interval does not contain that bias "
            f"(measured below 0.95 coverage on the suite: {SUITE}); use WIS",
    "dr": "the delta method underestimates the variance of DR terms built on a noisy DP-FQE model (measured below "
          f"0.95 coverage on the suite: {SUITE})",
    "deterministic": "the target policy is deterministic: its importance weights are heavy-tailed and clipping them "
                     f"biases WIS (measured below 0.95 coverage: {SUITE}); use DP-FQE",
    "undeclared": "the target policy does not declare whether it is deterministic (deterministic=, or "
                  "dporl.eval.ope_policies.declare_deterministic): WIS's interval was measured nominal for stochastic "
                  "targets only, and a deterministic target's clipped weights bias it",
    "clipped": "the unit clip is below the public maximum of a unit's contribution (or no maximum was declared: "
               "min_propensity, horizon, episodes_per_unit), so clipping may bias the estimate by an amount the "
               f"interval does not contain (WIS was measured nominal with nothing clipped: {SUITE})",
    "wis": "with nothing clipped and a stochastic target, WIS's delta-method interval was measured slightly narrow "
           "where the privacy noise is small: coverage 0.939 [0.922, 0.953] over 1000 digits datasets at eps 10 "
           f"(nominal at eps 1, where the interval is the value range; refused on the multi-step problems): {SUITE}",
    "fqe": "DP-SGD noise and the fitted Q-function's approximation bias the fold values alike, and the Student-t "
           f"interval over folds sees their spread, not that bias (measured below 0.95 coverage on the suite: {SUITE})",
}


def importance_caveat(kind: str, *, deterministic: Optional[bool], clip: float, scales: OPEScales,
                      epsilon: float) -> Optional[str]:
    """None when DP-WIS / PDIS / DR in this configuration was measured nominal on the suite, else why not (no
    configuration is, today: see the module docstring)."""
    if kind != "wis":
        return _CAVEATS[kind]
    if deterministic is None:
        return _CAVEATS["undeclared"]
    if deterministic:
        return _CAVEATS["deterministic"]
    maximum = scales.max_unit_norm("wis")
    if maximum is None or clip < maximum * (1 - 1e-12):
        return _CAVEATS["clipped"]
    return _CAVEATS["wis"]


def fqe_caveat() -> str:
    return _CAVEATS["fqe"]
