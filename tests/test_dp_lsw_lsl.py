import math

import pytest
import torch

from dporl.algos.dp_lsw_lsl import (
    dp_lsl,
    dp_lsw,
    first_visit_returns,
    lsl_estimate,
    lsw_estimate,
)
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.noise import NoiseSource
from dporl.utils.validation import ValidationError

GAMMA = 0.5
EPS, DELTA = 1.0, 0.1


def tiny_dataset():
    """Three trajectories on three states; first-visit returns worked out by hand below (gamma = 0.5).

    x1: states 0,1,2 rewards 0,0,1 -> F(0)=0.25, F(1)=0.5, F(2)=1
    x2: states 1,1,2 rewards 0,1,1 -> returns-to-go 0.75, 1.5, 1; first visits F(1)=0.75, F(2)=1
    x3: states 0,2   rewards 1,0   -> F(0)=1, F(2)=0
    The last observation of each row is the (ignored) successor of the final step.
    """
    observations = torch.tensor([[0, 1, 2, 2], [1, 1, 2, 2], [0, 2, 2, 0]], dtype=torch.float32).unsqueeze(-1)
    rewards = torch.tensor([[0.0, 0.0, 1.0], [0.0, 1.0, 1.0], [1.0, 0.0, 0.0]])
    mask = torch.tensor([[1, 1, 1], [1, 1, 1], [1, 1, 0]], dtype=torch.bool)
    return {"observations": observations, "rewards": rewards, "mask": mask, "actions": torch.zeros(3, 3, dtype=torch.long),
            "terminated": torch.ones(3, dtype=torch.bool)}


def test_first_visit_returns_by_hand():
    data = first_visit_returns(tiny_dataset(), 3, GAMMA, return_bound=2.0)
    expected = torch.tensor([[0.25, 0.5, 1.0], [0.0, 0.75, 1.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    torch.testing.assert_close(data.returns, expected)
    assert data.visit_counts.tolist() == [2, 2, 3]
    torch.testing.assert_close(data.mean_returns(), torch.tensor([0.625, 0.625, 2 / 3], dtype=torch.float64))


def test_returns_are_clipped_to_the_public_bound():
    data = first_visit_returns(tiny_dataset(), 3, GAMMA, return_bound=0.8)
    assert float(data.returns.max()) == pytest.approx(0.8)


def _alpha_beta(d):
    return 5 * math.sqrt(2 * math.log(2 / DELTA)) / EPS, EPS / (4 * (d + math.log(2 / DELTA)))


def test_dp_lsw_sigma_and_release_match_hand_computation():
    data = first_visit_returns(tiny_dataset(), 3, GAMMA, return_bound=2.0)
    weights = torch.tensor([1.0, 2.0, 1.0])
    alpha, beta = _alpha_beta(3)
    counts = [2, 2, 3]
    phi = [sum(w / max(n - k, 1) ** 2 for w, n in zip([1.0, 2.0, 1.0], counts)) for k in range(4)]  # k <= max |X_s|
    psi = max(math.exp(-k * beta) * phi[k] for k in range(4))
    # (Gamma^{1/2} I)^+ = diag(1 / sqrt(w)): spectral norm 1 / sqrt(min w) = 1.
    sigma = alpha * 2.0 * 1.0 * math.sqrt(psi)
    release = dp_lsw(data, torch.eye(3), epsilon=EPS, delta=DELTA, return_bound=2.0, noise=NoiseSource(7), weights=weights)
    assert release.psi == pytest.approx(psi, rel=1e-12)
    assert release.sigma == pytest.approx(sigma, rel=1e-12)
    noise = NoiseSource(7).gaussian(3, sigma, dtype=torch.float64)
    torch.testing.assert_close(release.theta, torch.tensor([0.625, 0.625, 2 / 3], dtype=torch.float64) + noise)
    assert release.unit == "trajectory" and "smooth sensitivity" in release.analysis


def test_dp_lsl_sigma_and_estimate_match_hand_computation():
    data = first_visit_returns(tiny_dataset(), 3, GAMMA, return_bound=2.0)
    rho = torch.tensor([1.0, 0.5, 1.0])
    lam, m = 5.0, 3
    alpha, beta = _alpha_beta(3)
    c = 1.0 * 1.0 / math.sqrt(2 * lam)  # ||Phi|| = 1 (identity), ||rho||_inf = 1
    rho_l2 = math.sqrt(1 + 0.25 + 1)
    phi = [(c * math.sqrt(sum(r * min(n + k, m) for r, n in zip([1.0, 0.5, 1.0], [2, 2, 3]))) + rho_l2) ** 2
           for k in range(m + 1)]
    psi = max(math.exp(-k * beta) * phi[k] for k in range(m + 1))
    sigma = 2 * alpha * 2.0 * 1.0 / (lam - 1.0) * math.sqrt(psi)
    release = dp_lsl(data, torch.eye(3), epsilon=EPS, delta=DELTA, return_bound=2.0, lam=lam, noise=NoiseSource(3),
                     regression_weights=rho)
    assert release.psi == pytest.approx(psi, rel=1e-12)
    assert release.sigma == pytest.approx(sigma, rel=1e-12)
    # Tabular: theta_s = Gamma_s F_s / (Gamma_s + lambda / (2m)), Gamma_s = rho_s |X_s| / m.
    gamma_x = [1.0 * 2 / 3, 0.5 * 2 / 3, 1.0 * 3 / 3]
    expected = torch.tensor([g * f / (g + lam / (2 * m)) for g, f in zip(gamma_x, [0.625, 0.625, 2 / 3])], dtype=torch.float64)
    torch.testing.assert_close(lsl_estimate(data, torch.eye(3), rho, lam), expected)
    torch.testing.assert_close(release.theta, expected + NoiseSource(3).gaussian(3, sigma, dtype=torch.float64))


def test_lsw_with_aggregated_features_is_weighted_least_squares():
    data = first_visit_returns(tiny_dataset(), 3, GAMMA, return_bound=2.0)
    features = torch.tensor([[1.0], [1.0], [1.0]])  # one aggregate: the w-weighted mean of F_X
    weights = torch.tensor([1.0, 2.0, 1.0])
    expected = (weights.double() * data.mean_returns()).sum() / weights.sum()
    torch.testing.assert_close(lsw_estimate(data, features, weights.double()), expected.reshape(1))


def test_refuses_continuous_states_and_off_policy_data():
    data = tiny_dataset()
    continuous = dict(data, observations=data["observations"] + 0.25)
    with pytest.raises(ValidationError, match="finite state space"):
        first_visit_returns(continuous, 3, GAMMA, 2.0)
    two_dim = dict(data, observations=data["observations"].repeat(1, 1, 2))
    with pytest.raises(ValidationError, match="finite state space"):
        first_visit_returns(two_dim, 3, GAMMA, 2.0)
    with pytest.raises(ValidationError, match="off-policy"):
        first_visit_returns(data, 3, GAMMA, 2.0, target_policy=lambda obs: torch.ones(*obs.shape[:-1], 1))
    with pytest.raises(ValidationError, match="observations"):
        first_visit_returns(data, 2, GAMMA, 2.0)  # state 2 outside a 2-state space


def test_refuses_bad_parameters():
    data = first_visit_returns(tiny_dataset(), 3, GAMMA, return_bound=2.0)
    with pytest.raises(ValidationError, match="lam"):
        dp_lsl(data, torch.eye(3), epsilon=EPS, delta=DELTA, return_bound=2.0, lam=1.0, noise=NoiseSource(0))
    with pytest.raises(ValidationError, match="features"):
        dp_lsw(data, torch.eye(2), epsilon=EPS, delta=DELTA, return_bound=2.0, noise=NoiseSource(0))
    for bad in ([1.0, -1.0, 1.0], [0.0, 0.0, 0.0], [1.0, math.nan, 1.0]):  # zero weights are allowed, not all-zero
        with pytest.raises(ValidationError, match="weight"):
            dp_lsw(data, torch.eye(3), epsilon=EPS, delta=DELTA, return_bound=2.0, noise=NoiseSource(0),
                   weights=torch.tensor(bad))
    with pytest.raises(ValidationError, match="regression_weights"):
        dp_lsl(data, torch.eye(3), epsilon=EPS, delta=DELTA, return_bound=2.0, lam=5.0, noise=NoiseSource(0),
               regression_weights=torch.tensor([1.0, 1.5, 1.0]))
    with pytest.raises(ValidationError, match="noise"):
        dp_lsw(data, torch.eye(3), epsilon=EPS, delta=DELTA, return_bound=2.0, noise=torch.Generator())


def test_release_is_recorded_in_the_ledger_at_its_epsilon():
    data = first_visit_returns(tiny_dataset(), 3, GAMMA, return_bound=2.0)
    release = dp_lsw(data, torch.eye(3), epsilon=EPS, delta=DELTA, return_bound=2.0, noise=NoiseSource(0))
    ledger = PrivacyLedger()
    ledger.stage("dp_lsw", mechanism="pld", unit="trajectory", delta=DELTA)
    ledger.record("dp_lsw", release.event())
    assert ledger.spent("dp_lsw") == pytest.approx(EPS, rel=1e-9)
    # Balle et al.'s smooth-sensitivity guarantee is for replacing one trajectory, and the report must say so.
    assert "replace one unit" in ledger.report().describe()


def test_zero_weight_state_is_left_out_of_the_fit_and_the_noise_scale():
    # w = (1, 0, 1): state 1 no longer enters LSW's weighted least squares (with tabular features its coordinate is
    # the minimum-norm 0 before noise) nor phi(k), and ||(Gamma^1/2 Phi)^+|| = 1 / sqrt(min positive w) = 1.
    data = first_visit_returns(tiny_dataset(), 3, GAMMA, return_bound=2.0)
    weights = torch.tensor([1.0, 0.0, 1.0])
    estimate = lsw_estimate(data, torch.eye(3), weights.double())
    torch.testing.assert_close(estimate, torch.tensor([0.625, 0.0, 2 / 3], dtype=torch.float64))
    alpha, beta = _alpha_beta(3)
    counts = [2, 2, 3]
    phi = [sum(w / max(n - k, 1) ** 2 for w, n in zip([1.0, 0.0, 1.0], counts)) for k in range(4)]
    psi = max(math.exp(-k * beta) * phi[k] for k in range(4))
    release = dp_lsw(data, torch.eye(3), epsilon=EPS, delta=DELTA, return_bound=2.0, noise=NoiseSource(7),
                     weights=weights)
    assert release.psi == pytest.approx(psi, rel=1e-12)
    assert release.sigma == pytest.approx(alpha * 2.0 * math.sqrt(psi), rel=1e-12)
