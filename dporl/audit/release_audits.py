"""Audits of one-shot releases: DP-LSW / DP-LSL output perturbation, and reward input perturbation (FNQ baseline).

Trials are vectorised by releasing ``n`` independent copies at once through the library's own noise call
(``gaussian_output_perturbation`` on the estimate expanded to [n, d]: i.i.d. rows, the same law as n calls).
"""

from __future__ import annotations

import numpy as np
import torch

from dporl.audit.experiment import Experiment
from dporl.privacy.noise import NoiseSource
from dporl.privacy.output_perturbation import gaussian_output_perturbation
from dporl.utils.validation import ValidationError, check_positive


def _first_visit_pair(n_trajectories: int, n_states: int, return_bound: float):
    """Replace-one neighbours for first-visit MC: one rare state, visited only by the replaced trajectory.

    Every trajectory visits the common states with returns spread in [0, F_max]; the last state is visited by
    trajectory 0 alone, with return 0 in D and F_max in D' (the largest change the analysis allows), so the
    estimate at that state moves by F_max, the worst case for a state with |X_s| = 1.
    """
    from dporl.algos.dp_lsw_lsl import FirstVisitData

    generator = torch.Generator().manual_seed(99)
    returns = torch.rand(n_trajectories, n_states, generator=generator, dtype=torch.float64) * return_bound
    visited = torch.ones(n_trajectories, n_states, dtype=torch.bool)
    visited[1:, -1] = False
    returns[1:, -1] = 0.0
    d_returns, dp_returns = returns.clone(), returns.clone()
    d_returns[0, -1], dp_returns[0, -1] = 0.0, return_bound
    return FirstVisitData(d_returns, visited), FirstVisitData(dp_returns, visited.clone())


def output_perturbation_audit(
    method: str = "lsw",
    epsilon: float = 1.0,
    delta: float = 1e-5,
    n_trajectories: int = 20,
    n_states: int = 3,
    return_bound: float = 1.0,
    noise_factor: float = 1.0,
) -> Experiment:
    """DP-LSW or DP-LSL (tabular features) on replace-one neighbours; statistic: projection on theta_D - theta_D'.

    The smooth-sensitivity analysis multiplies the local sensitivity by alpha = 5 sqrt(2 ln(2/delta)) / eps (~25
    at eps = 1, delta = 1e-5), so the honest audit sees little; the power check cuts the noise to 1/100.
    """
    from dporl.algos import dp_lsw_lsl as lsw

    if method not in ("lsw", "lsl"):
        raise ValidationError("method", f"must be 'lsw' or 'lsl', got {method!r}")
    check_positive("noise_factor", noise_factor)
    d_data, dp_data = _first_visit_pair(n_trajectories, n_states, return_bound)
    features = torch.eye(n_states, dtype=torch.float64)
    lam = 2.0 * float(n_trajectories) ** 0.5 + 1.0  # > ||Phi||^2 ||rho||_inf = 1, proportional to sqrt(m)

    def estimate_and_sigma(data) -> tuple[torch.Tensor, float]:
        weights = torch.ones(n_states, dtype=torch.float64)
        if method == "lsw":
            sigma, _ = lsw.dp_lsw_sigma(data.visit_counts, features, weights, epsilon, delta, return_bound)
            return lsw.lsw_estimate(data, features, weights), sigma
        sigma, _ = lsw.dp_lsl_sigma(
            data.visit_counts, data.n_trajectories, features, weights, lam, epsilon, delta, return_bound
        )
        return lsw.lsl_estimate(data, features, weights, lam), sigma

    released = {True: estimate_and_sigma(d_data), False: estimate_and_sigma(dp_data)}
    gap = released[True][0] - released[False][0]
    direction = gap / gap.norm()

    def scores(n: int, on_d: bool, seed: int) -> np.ndarray:
        theta, sigma = released[on_d]
        outputs = gaussian_output_perturbation(theta.expand(n, -1).clone(), sigma * noise_factor, NoiseSource(seed))
        return (outputs @ direction).numpy()

    return Experiment(
        name=f"dp_{method}",
        claimed_epsilon=epsilon,
        delta=delta,
        privacy_unit="trajectory",
        analysis=f"{lsw.ANALYSIS}: (eps, delta) by construction of sigma_X",
        neighbours="replace-one: the only visitor of a state changes its first-visit return from 0 to F_max",
        scores=scores,
        chunk_trials=100_000,
        settings={"method": method, "n_trajectories": n_trajectories, "n_states": n_states,
                  "sigma_D": released[True][1], "sigma_D'": released[False][1], "noise_factor": noise_factor},
    )


def reward_perturbation_audit(
    epsilon: float = 1.0, delta: float = 1e-5, n_rewards: int = 16, noise_factor: float = 1.0
) -> Experiment:
    """The FNQ input-perturbation baseline: Gaussian noise on each of n rewards; neighbours shift every reward by 1.

    Statistic: the sum of the released rewards (the likelihood ratio of two isotropic Gaussians along 1).
    """
    from dporl.privacy.functional_calibration import reward_perturbation_std

    std = reward_perturbation_std(epsilon, delta, n_rewards)
    check_positive("noise_factor", noise_factor)
    rewards = torch.linspace(0.0, 1.0, n_rewards, dtype=torch.float64)

    def scores(n: int, on_d: bool, seed: int) -> np.ndarray:
        base = rewards + (1.0 if on_d else 0.0)
        noisy = base + NoiseSource(seed).gaussian((n, n_rewards), std * noise_factor, dtype=torch.float64)
        return noisy.sum(1).numpy()

    return Experiment(
        name="reward_perturbation",
        claimed_epsilon=epsilon,
        delta=delta,
        privacy_unit="reward",
        analysis="analytic Gaussian mechanism, L2 sensitivity sqrt(n) (reward_perturbation_std)",
        neighbours="every reward shifted by 1 (sup |r - r'| = 1)",
        scores=scores,
        chunk_trials=100_000,
        settings={"n_rewards": n_rewards, "std": std, "noise_factor": noise_factor},
    )
