"""Stable-prefix budget: Sharma et al. 2024's threshold formulas, the Laplace-difference tail, composition over
T runs."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dporl.privacy.accountants import epsilon_for
from dporl.privacy.events import ApproxDPEvent
from dporl.privacy.sparse_vector import (
    laplace_difference_quantile,
    laplace_difference_tail,
    stable_prefix_budget,
    stable_prefix_threshold,
)
from dporl.utils.validation import PrivacyBudgetError, ValidationError


def test_threshold_by_hand():
    # eps' = 0.5, monotone: b = 2 / 0.5 = 4. Choose beta so that the root is t = 10 b = 40:
    # beta = (1/2 + 40 / 16) exp(-10) = 3 exp(-10). G0 = 1 / (1 - exp(-0.5)) = 2.541494...; p_min = 0.05.
    beta = 3 * math.exp(-10)
    result = stable_prefix_threshold(0.5, beta, 0.05, monotone=True)
    assert result.noise_scale == 4.0
    assert result.g0 == pytest.approx(2.5414940825367984, rel=1e-12)
    assert result.t_beta == pytest.approx(40.0, rel=1e-10)
    assert result.threshold == pytest.approx(2.5414940825367984 / 0.05 + 40.0, rel=1e-10)
    # Non-monotone queries double the scale, hence t_beta (same beta).
    assert stable_prefix_threshold(0.5, beta, 0.05, monotone=False).t_beta == pytest.approx(80.0, rel=1e-10)


def test_laplace_difference_tail_monte_carlo():
    rng = np.random.default_rng(0)
    n, scale = 2_000_000, 1.5
    difference = rng.laplace(0, scale, n) - rng.laplace(0, scale, n)
    for t in (0.0, scale, 3 * scale):
        p = laplace_difference_tail(t, scale)
        # 5 binomial standard errors: a correct formula fails this with probability ~6e-7 per point.
        assert abs(np.mean(difference >= t) - p) < 5 * math.sqrt(p * (1 - p) / n)


def test_quantile_inverts_tail():
    for beta in (0.4, 1e-3, 1e-9):
        t = laplace_difference_quantile(beta, 2.0)
        assert laplace_difference_tail(t, 2.0) == pytest.approx(beta, rel=1e-9)
    assert laplace_difference_quantile(0.5, 2.0) == 0.0
    with pytest.raises(ValidationError):
        laplace_difference_quantile(0.6, 2.0)


@pytest.mark.parametrize("epsilon,trajectories", [(5.0, 25), (2.5, 62)])
def test_budget_is_the_largest_that_fits_under_tight_composition(epsilon, trajectories):
    delta = 5e-6
    budget = stable_prefix_budget(epsilon, delta, trajectories, p_min=0.05, n_experts=3000)
    assert budget.beta == delta / (2 * trajectories)
    assert budget.event == ApproxDPEvent(2 * budget.epsilon_prime, budget.beta)
    composed = epsilon_for([(budget.event, trajectories)], delta, "pld")
    assert composed <= epsilon and composed == budget.composed_epsilon
    # Maximal up to the search tolerance (1e-4) plus one 1e-3 step of the PLD grid in 2 eps'.
    bigger = ApproxDPEvent(2 * budget.epsilon_prime + 2e-3, budget.beta)
    assert epsilon_for([(bigger, trajectories)], delta, "pld") > epsilon
    # Tight composition beats the basic split eps / (2T).
    assert budget.epsilon_prime > epsilon / (2 * trajectories)
    expected = stable_prefix_threshold(budget.epsilon_prime, budget.beta, 0.05)
    assert (budget.threshold, budget.g0, budget.t_beta, budget.noise_scale) == (
        expected.threshold, expected.g0, expected.t_beta, expected.noise_scale
    )


def test_precondition_m_pmin_at_least_g0():
    # eps' ~ 0.1 gives G0 ~ 10.5: 100 experts at p_min = 0.05 (m p_min = 5) cannot be stable.
    with pytest.raises(PrivacyBudgetError, match="p_min"):
        stable_prefix_budget(5.0, 5e-6, 25, p_min=0.05, n_experts=100)
    with pytest.raises(ValidationError):
        stable_prefix_budget(5.0, 5e-6, 0, p_min=0.05, n_experts=3000)
    with pytest.raises(ValidationError):
        stable_prefix_budget(5.0, 5e-6, 25, p_min=0.0, n_experts=3000)
