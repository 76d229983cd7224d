import math

import pytest
import torch

from dporl.algos.lstd import LinearTDStatistics
from dporl.eval.ope_metrics import (
    exact_td_statistics,
    monte_carlo_values,
    mspbe,
    on_policy_distribution,
    relative_mspbe,
    rmse,
)
from dporl.utils.validation import ValidationError

N, P_STAY, GAMMA = 5, 0.5, 0.9


def small_chain():
    """Xie et al. 2019's chain on N states: stay with p, else advance; state N-1 absorbing (its row is zero)."""
    P = torch.zeros(N, N, dtype=torch.float64)
    for s in range(N - 1):
        P[s, s], P[s, s + 1] = P_STAY, 1 - P_STAY
    rewards = torch.zeros(N, dtype=torch.float64)
    rewards[N - 2] = 1 - P_STAY  # expected reward: 1 on entering the absorbing state
    q = 1 - P_STAY
    true = torch.tensor([q / (1 - GAMMA * P_STAY) * (q * GAMMA / (1 - GAMMA * P_STAY)) ** (N - 2 - s) for s in range(N - 1)]
                        + [0.0], dtype=torch.float64)
    start = torch.tensor([1.0] * (N - 1) + [0.0], dtype=torch.float64) / (N - 1)
    return P, rewards, true, start


def test_on_policy_distribution_counts_expected_visits():
    P, _, _, start = small_chain()
    d = on_policy_distribution(P, start)
    # From uniform starts over N-1 states, state s is reached from s+1 starts, and each visit lasts 1/(1-p) steps.
    visits = torch.tensor([(s + 1) / (N - 1) / (1 - P_STAY) for s in range(N - 1)] + [0.0], dtype=torch.float64)
    torch.testing.assert_close(d, visits / visits.sum())


def test_true_values_have_zero_mspbe_and_the_zero_estimate_does_not():
    P, r, true, start = small_chain()
    stats = exact_td_statistics(torch.eye(N), P, r, on_policy_distribution(P, start), GAMMA)
    # The closed form solves the Bellman equation exactly, so its projected Bellman error vanishes,
    # even though C is singular (the absorbing state's feature is never visited: pseudo-inverse).
    assert float(mspbe(true, stats)) == pytest.approx(0.0, abs=1e-20)
    assert float(mspbe(torch.zeros(N), stats)) > 1e-3
    torch.testing.assert_close(torch.linalg.solve(stats.A[:-1, :-1], stats.b[:-1]), true[:-1])


def test_mspbe_by_hand_and_batched():
    stats = LinearTDStatistics(A=torch.tensor([[2.0, 0.0], [0.0, 1.0]]), b=torch.tensor([1.0, 1.0]),
                               C=torch.tensor([[4.0, 0.0], [0.0, 0.5]]))
    theta = torch.tensor([[0.0, 0.0], [0.5, 1.0], [1.0, 0.0]])
    # residual b - A theta: (1, 1) -> 1/4 + 1/0.5 = 2.25; (0, 0) -> 0; (-1, 1) -> 1/4 + 2 = 2.25
    torch.testing.assert_close(mspbe(theta, stats), torch.tensor([2.25, 0.0, 2.25], dtype=torch.float64))
    torch.testing.assert_close(relative_mspbe(theta, stats, 10.0), torch.tensor([0.0225, 0.0, 0.0225], dtype=torch.float64))
    with pytest.raises(ValidationError, match="reward_scale"):
        relative_mspbe(theta, stats, 0.0)


def test_rmse_plain_and_weighted():
    values, true = torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 0.0, 3.0])
    assert float(rmse(values, true)) == pytest.approx(math.sqrt(4 / 3))
    assert float(rmse(values, true, torch.tensor([1.0, 3.0, 0.0]))) == pytest.approx(math.sqrt(3.0))
    with pytest.raises(ValidationError, match="values"):
        rmse(values, true[:2])


def test_monte_carlo_values_discount_rewards():
    rewards = torch.tensor([[1.0, 1.0, 1.0], [2.0, 5.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    torch.testing.assert_close(monte_carlo_values(rewards, mask, 0.5), torch.tensor([1.75, 2.0], dtype=torch.float64))


def test_exact_statistics_reject_mismatched_shapes():
    P, r, _, start = small_chain()
    with pytest.raises(ValidationError, match="transitions"):
        exact_td_statistics(torch.eye(N), P[:-1], r, start, GAMMA)
    with pytest.raises(ValidationError, match="transitions"):
        on_policy_distribution(P, start[:-1])
