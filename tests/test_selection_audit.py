"""The selection audit: best-of-K randomised-response searches on a fixed pair stay under the accounted bound, and
the variant that releases the best of a fixed number of trials under one trial's epsilon is caught."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dporl.audit.experiment import run_audit
from dporl.audit.registry import AUDITS, POWER_SETTINGS, build_audit
from dporl.privacy.selection import TrialCount


def _exact_epsilon(count: TrialCount, eps0: float) -> float:
    """The pair's exact epsilon at delta ~ 0: the largest log-ratio of the three outcomes (nothing, 0, 1)."""
    p = math.exp(eps0) / (1 + math.exp(eps0))
    nothing = float(count.pmf(np.array([0]))[0])

    def law(zero: float) -> np.ndarray:
        best_zero = float(count.pgf(np.array([zero]))[0]) - nothing
        return np.array([nothing, best_zero, 1 - nothing - best_zero])

    d, dp = law(1 - p), law(p)
    mask = (d > 0) & (dp > 0)
    return float(np.max(np.abs(np.log(d[mask] / dp[mask]))))


@pytest.mark.parametrize("settings", [{}, {"distribution": "negative_binomial", "mean": 10.0, "eta": 1.0},
                                      {"distribution": "negative_binomial", "mean": 4.0, "eta": 0.0,
                                       "trial_epsilon": 1.0}])
def test_accounted_selection_stays_below_its_claim(settings):
    experiment = build_audit("selection", settings)
    result = run_audit(experiment, 100_000, seed=3)
    count = TrialCount.with_mean(settings.get("mean", 6.0), settings.get("distribution", "poisson"),
                                 settings.get("eta", 1.0))
    exact = _exact_epsilon(count, settings.get("trial_epsilon", 0.5))
    assert not result.violated
    assert exact <= experiment.claimed_epsilon  # the pair's true epsilon is under the bound
    assert result.epsilon_lower_bound > settings.get("trial_epsilon", 0.5)  # and the attack sees more than 1 trial


def test_power_unaccounted_best_of_ten_is_caught():
    experiment = build_audit("selection", power=True)
    assert experiment.settings["fixed_trials"] == 10
    result = run_audit(experiment, 20_000, seed=5)
    assert result.violated and result.epsilon_lower_bound > 4 * experiment.claimed_epsilon


def test_registered():
    assert "selection" in AUDITS and POWER_SETTINGS["selection"] == {"fixed_trials": 10}
