import math

import pytest

from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.functional_calibration import (
    calibrate_functional_noise,
    reward_perturbation_std,
    smallest_tail_parameter,
)
from dporl.utils.validation import PrivacyBudgetError, ValidationError

PAPER = dict(updates=5000 / 64, batch_size=64, learning_rate=3e-4, lipschitz=4.0)


def test_theorem5_terms_match_a_hand_computation():
    # k = 419 puts the tail margin near 5, so both delta-tail terms are visible; every term computed by hand below.
    alpha, k, B, L, T, J, eps, delta = 1e-6, 419, 32, 2.0, 3200, 10, 1.0, 1e-5
    result = calibrate_functional_noise(
        eps, delta, updates=T / B, batch_size=B, learning_rate=alpha, tail_k=k, lipschitz=L, reset_factor=J
    )
    v = 4 * 1e-6 * 420 / 32  # 5.25e-5
    C = (v**2 + v) * 4
    sigma = math.sqrt(2 * 100 * math.log(math.e + 1e5) * C) / 1.0
    margin = 838 - 8.68 * math.sqrt(1 / v) * sigma
    assert 4 < margin < 6
    p = math.exp(-margin**2 / 2)
    assert result.v == pytest.approx(v, rel=1e-12)
    assert result.beta == pytest.approx(1 / v, rel=1e-12)
    assert result.C == pytest.approx(C, rel=1e-12)
    assert result.sigma == result.sigma_min == pytest.approx(sigma, rel=1e-12)
    assert result.tail_margin == pytest.approx(margin, rel=1e-12)
    assert result.delta_tail_union == pytest.approx(J * p, rel=1e-9)
    assert result.delta_tail == pytest.approx(1 - (1 - p) ** J, rel=1e-6)
    assert result.delta_tail <= result.delta_tail_union  # the appendix's bound is the tighter one
    assert result.delta_total == pytest.approx(delta + result.delta_tail, rel=1e-12)
    assert result.unit == "reward" and "Thm 5" in result.analysis and "NOT a guarantee" in result.analysis
    ledger = PrivacyLedger()
    result.paper_claim(ledger)  # recorded as the paper's figure: never a stage, never a guarantee
    assert [(c.epsilon, c.delta) for c in ledger.paper_claims] == [(eps, result.delta_total)]
    assert not ledger.stages and ledger.report().guarantee is None
    assert "not reproducible" in result.to_dict()["note"]


def test_seed_worked_example_is_refused_by_its_own_theorem():
    # seeds/004 appendix E.3 claims sigma ~ 0.313 with k = 23. By the formula: v = 4.5e-4, sigma >= 3.56, and
    # 8.68 sqrt(beta) sigma ~ 1456 > 2k = 46, so the theorem certifies nothing.
    v = 4 * 3e-4 * 24 / 64
    sigma = math.sqrt(2 * (5000 / 64) * math.log(math.e + 0.9 / 1e-4) * (v**2 + v) * 16) / 0.9
    assert v == pytest.approx(4.5e-4) and sigma == pytest.approx(3.557, abs=1e-3)
    with pytest.raises(PrivacyBudgetError, match="2k > 8.68"):
        calibrate_functional_noise(0.9, 1e-4, tail_k=23, reset_factor=78, **PAPER)
    with pytest.raises(PrivacyBudgetError, match="below Theorem 5's minimum"):
        calibrate_functional_noise(0.9, 1e-4, tail_k=800, reset_factor=78, sigma=0.313, **PAPER)


def test_smallest_tail_parameter_is_minimal_and_fits_the_total_delta():
    result = smallest_tail_parameter(0.9, 1e-4, reset_factor=78, **PAPER)
    assert result.delta_total <= 1e-4 and result.delta == pytest.approx(5e-5)
    with pytest.raises(PrivacyBudgetError):  # k - 1 either violates the condition or overspends the tail
        smaller = calibrate_functional_noise(0.9, 5e-5, tail_k=result.tail_k - 1, reset_factor=78, **PAPER)
        if smaller.delta_total > 1e-4:
            raise PrivacyBudgetError("k", "over")
    # Halving epsilon needs more noise.
    assert smallest_tail_parameter(0.45, 1e-4, reset_factor=78, **PAPER).sigma > result.sigma


def test_bad_parameters_name_their_field():
    with pytest.raises(ValidationError, match="fnq.reset_factor"):
        calibrate_functional_noise(1.0, 1e-5, tail_k=5000, reset_factor=0, **PAPER)
    with pytest.raises(ValidationError, match="fnq.delta"):
        calibrate_functional_noise(1.0, 0.0, tail_k=5000, reset_factor=1, **PAPER)


def test_reward_perturbation_matches_the_exact_gaussian_mechanism():
    from dp_accounting.pld.privacy_loss_mechanism import GaussianPrivacyLoss

    std = reward_perturbation_std(0.9, 1e-4, 5000)
    # n rewards with sensitivity 1 each: one Gaussian mechanism of sensitivity sqrt(n); dp_accounting's exact delta.
    exact = GaussianPrivacyLoss(std, sensitivity=math.sqrt(5000)).get_delta_for_epsilon(0.9)
    assert exact <= 1e-4 and exact == pytest.approx(1e-4, rel=1e-6)
    assert reward_perturbation_std(0.9, 1e-4, 20000) == pytest.approx(2 * std, rel=1e-6)


def test_reward_perturbation_calibrates_at_large_epsilon_without_overflow():
    # e^eps overflows a float beyond eps ~ 709; the exact delta is computed in log space.
    from dporl.privacy.functional_calibration import gaussian_delta

    for eps in (1e3, 1e5):
        std = reward_perturbation_std(eps, 1e-4, 5000)
        assert 0 < std < 5000**0.5 and gaussian_delta(eps, std, 5000**0.5) <= 1e-4
        assert gaussian_delta(eps, std * 0.99, 5000**0.5) > 1e-4  # and it is the smallest such std (to 1%)
