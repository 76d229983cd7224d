"""Audit of the functional-noise release (DP Q-learning with functional noise, Wang & Hegde 2019, Theorem 5).

What is audited: the Gaussian-process mechanism at the core of Theorem 5's proof, composed over the T/B updates
exactly as the proof composes it. Update j releases the function f_j + g_j with g_j a sample path of
GP(0, sigma^2 exp(-beta |x - y|)) on [0, 1] (``dporl.privacy.gp_noise``), independent across updates; sigma, beta
and the claimed (eps, delta) come from ``calibrate_functional_noise`` (via ``smallest_tail_parameter``).

Neighbours (unit "reward", sup |r - r'| <= 1): the proof turns this relation into one per-update sensitivity
bound, ||f_D - f_D'||_H^2 <= C = (v^2 + v) L^2 in the RKHS H of the kernel (Lemma 6's Sobolev norm), and the
calibration covers every pair within it. The worst case used here meets that bound with equality at every update:

    Delta = sqrt(C) * k_w / ||k_w||_H,   k_w = sum_i K(x_i, .) (one bump per query point x_i),
    ||k_w||_H^2 = 1^T K_X 1   (reproducing property),  so ||Delta||_H = sqrt(C) exactly.

(The proof's intermediate bounds, sup |f| <= vL and |f'| <= L, admit at most ||f||_H^2 = (v^2 + 2v/3) L^2 < C; we
audit the sensitivity the calibration charges for, which is the claim's own premise.) D releases Delta + g_j at
every update, D' releases g_j: a constant canary, as in the multi-step DP-SGD audit.

Statistic: the exact log-likelihood ratio of the whole released paths. Delta lies in the span of K(x_i, .), so by
Cameron-Martin the values at x_1..x_m are sufficient for D vs D': the log-ratio is affine in
sum_j Delta(X)^T (sigma^2 K_X)^{-1} y_j, and that sum (the score) is N(+-mu^2 / 2-shifted, mu^2) with
mu = sqrt(T/B) ||Delta||_H / sigma. Querying more points cannot help the adversary; fewer would lose power.

Sampling: the paths' values at the sorted query points are drawn by the exact Markov recursion
    g(x_1) = sigma z_1,   g(x_{i+1}) = a_i g(x_i) + sigma sqrt(1 - a_i^2) z_{i+1},   a_i = exp(-beta (x_{i+1} - x_i)),
batched in torch over trials and updates. This is literally ``OrnsteinUhlenbeckPath``'s law for a sorted batch
of new points (each is conditioned on its only stored neighbour, the previous point: mean e^{-beta d} g, variance
sigma^2 (1 - e^{-2 beta d})), and with the same standard normals it returns the same numbers (tested). The library
path is one Python object per path, so ``sampler="library"`` (one path per trial and update, through
``OrnsteinUhlenbeckPath`` itself) is offered for end-to-end checks at small trial counts.

Not covered by the distinguishing experiment: whether a change of rewards really moves the trained Q-network by at
most sqrt(C) in H (the proof's step |Q - Q0| <= 2 alpha L (k + 1) / B, Lemma 8's band, the assumed Lipschitz bound
L); the sharing of one path across the T / (J B) updates of a reset window (the proof composes independent draws);
the tail term of delta (the canary's shift holds with certainty here, so the audit runs at the guarantee's total
delta, a weaker test). ``update_shift_norms`` probes the first of these on the real learner: it takes one
Algorithm-1 SGD step on rewards r and r + 1 from the same parameters and noise paths and measures the Lemma 6 norm
of Q_D - Q_D' (an empirical check of the premise, not a bound: a value above sqrt(C) shows the premise fails).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from dporl.audit.experiment import Experiment
from dporl.privacy.accountants import epsilon_for
from dporl.privacy.events import PoissonGaussianEvent
from dporl.privacy.functional_calibration import ANALYSIS, UNIT, smallest_tail_parameter
from dporl.privacy.gp_noise import OrnsteinUhlenbeckPath, laplace_kernel
from dporl.privacy.noise import NoiseSource
from dporl.privacy.samplers import Batch
from dporl.utils.validation import ValidationError, check_positive, check_probability


def ou_values(points: torch.Tensor, sigma: float, beta: float, normals: torch.Tensor) -> torch.Tensor:
    """Values of independent OU paths at sorted ``points`` [m] from standard normals [..., m] (exact Markov law)."""
    decay = torch.exp(-beta * torch.diff(points))  # a_i, [m - 1]
    innovation = sigma * torch.sqrt(-torch.expm1(-2 * beta * torch.diff(points)))
    values = torch.empty_like(normals)
    values[..., 0] = sigma * normals[..., 0]
    for i in range(1, points.numel()):  # m is a handful of points; trials and updates are batched
        values[..., i] = decay[i - 1] * values[..., i - 1] + innovation[i - 1] * normals[..., i]
    return values


def worst_case_shift(points: torch.Tensor, beta: float, rkhs_norm: float) -> torch.Tensor:
    """Delta(X) for Delta = rkhs_norm * sum_i K(x_i, .) / ||sum_i K(x_i, .)||_H, K = exp(-beta |x - y|)."""
    gram = laplace_kernel(points.unsqueeze(1), points.unsqueeze(1), 1.0, beta)
    ones = torch.ones(points.numel(), dtype=torch.float64)
    return rkhs_norm * (gram @ ones) / torch.sqrt(ones @ gram @ ones)


def lemma6_norm(values: torch.Tensor, grid: torch.Tensor, beta: float) -> torch.Tensor:
    """||f||_H for f sampled on a fine uniform ``grid`` of [0, 1] (values [..., n_grid]), Lemma 6's inner product:
    ||f||^2 = (f(0)^2 + f(1)^2) / 2 + 1/(2 beta) int_0^1 f'^2 + beta^2 f^2 (f' by finite differences, trapezoid
    rule)."""
    values = values.to(torch.float64)
    derivative = torch.gradient(values, spacing=(grid,), dim=-1)[0]
    integral = torch.trapezoid(derivative**2 + beta**2 * values**2, grid, dim=-1)
    return torch.sqrt((values[..., 0] ** 2 + values[..., -1] ** 2) / 2 + integral / (2 * beta))


def update_shift_norms(
    algorithm, batch: Batch, learning_rate: float, beta: float, grid_size: int = 100_001
) -> tuple[torch.Tensor, torch.Tensor]:
    """(||Q_D - Q_D'||_H, sup |Q_D - Q_D'|) per action after one plain-SGD step of ``algorithm`` (a 1-D-state
    ``FunctionalNoiseQLearning``) on ``batch`` with its rewards (D) and the rewards + 1 (D'), from the same parameters
    and noise-path state (deep copies, so both steps draw the same path values). The norm is in scaled states."""
    import copy

    if algorithm.obs_dim != 1:
        raise ValidationError("algorithm.obs_dim", f"Lemma 6's norm is one-dimensional, got {algorithm.obs_dim}")
    grid = torch.linspace(0.0, 1.0, grid_size, dtype=torch.float64)
    states = algorithm.noise.state_low + grid.unsqueeze(1) * algorithm.noise.state_scale  # raw states [n_grid, 1]
    outputs = []
    for shift in (0.0, 1.0):
        learner = copy.deepcopy(algorithm)
        data = dict(batch.data, rewards=batch.data["rewards"] + shift)
        learner.zero_grad()
        learner.row_losses(Batch(data, batch.unit_index, batch.n_units, batch.private)).mean().backward()
        with torch.no_grad():
            for parameter in learner.q_network.parameters():
                parameter -= learning_rate * parameter.grad
            outputs.append(learner.q_network(states.float()).double().T)  # [n_actions, n_grid]
    difference = outputs[0] - outputs[1]
    return lemma6_norm(difference, grid, beta), difference.abs().amax(dim=-1)


def functional_noise_audit(
    epsilon: float = 1.0,
    delta: float = 1e-5,
    updates: int = 8,
    batch_size: int = 64,
    learning_rate: float = 3e-4,
    lipschitz: float = 4.0,
    reset_factor: int = 1,
    n_points: int = 5,
    noise_factor: float = 1.0,
    sampler: str = "recursion",
) -> Experiment:
    """Theorem 5's GP mechanism over ``updates`` updates, worst-case RKHS shift sqrt(C) each (module docstring).

    ``delta`` is the guarantee's total delta (mechanism + path tails, split as ``smallest_tail_parameter`` does);
    ``noise_factor < 1`` shrinks sigma below the calibration (the power check).
    """
    # Numbers as numbers (command-line settings may arrive as strings): the calibration uses them as given.
    epsilon = check_positive("epsilon", epsilon)
    delta = check_probability("delta", delta, allow_zero=False, allow_one=False)
    learning_rate = check_positive("learning_rate", learning_rate)
    lipschitz = check_positive("lipschitz", lipschitz)
    check_positive("noise_factor", noise_factor)
    if int(n_points) != n_points or n_points < 1:
        raise ValidationError("n_points", f"must be an integer >= 1, got {n_points}")
    if sampler not in ("recursion", "library"):
        raise ValidationError("sampler", f"must be 'recursion' or 'library', got {sampler!r}")
    calibration = smallest_tail_parameter(
        epsilon, delta, updates=updates, batch_size=batch_size, learning_rate=learning_rate,
        lipschitz=lipschitz, reset_factor=reset_factor,
    )
    sigma, beta, steps = calibration.sigma * noise_factor, calibration.beta, int(math.ceil(calibration.updates))
    # Query points one kernel length 1/beta apart (at most 1/n_points, to stay inside [0, 1]) around the middle:
    # correlated, all informative.
    spacing = min(1.0 / beta, 1.0 / n_points)
    points = 0.5 + (torch.arange(n_points, dtype=torch.float64) - (n_points - 1) / 2) * spacing
    shift = worst_case_shift(points, beta, math.sqrt(calibration.C))
    covariance = laplace_kernel(points.unsqueeze(1), points.unsqueeze(1), sigma, beta)
    direction = torch.linalg.solve(covariance, shift)  # (sigma^2 K_X)^{-1} Delta(X): the likelihood-ratio weights
    mu = math.sqrt(steps * float(shift @ direction))  # = sqrt(T/B) sqrt(C) / sigma

    def released(n: int, seed: int) -> torch.Tensor:
        """Noise path values [n, steps, m], one independent path per trial and update."""
        noise = NoiseSource(seed)
        if sampler == "recursion":
            return ou_values(points, sigma, beta, noise.gaussian((n, steps, n_points), 1.0, dtype=torch.float64))
        values = [OrnsteinUhlenbeckPath(sigma, beta, noise)(points) for _ in range(n * steps)]
        return torch.stack(values).reshape(n, steps, n_points).to(torch.float64)

    def scores(n: int, on_d: bool, seed: int) -> np.ndarray:
        outputs = released(n, seed) + (shift if on_d else 0.0)
        return (outputs @ direction).sum(dim=1).numpy()

    gaussian_equivalent = epsilon_for([(PoissonGaussianEvent(1.0 / mu), 1)], calibration.delta_total, "pld")
    return Experiment(
        name="functional_noise",
        claimed_epsilon=calibration.epsilon,
        delta=calibration.delta_total,
        privacy_unit=UNIT,
        analysis=f"{ANALYSIS} (calibrate_functional_noise): {calibration.describe()}",
        neighbours=(
            f"sup|r - r'| <= 1, as Theorem 5's sensitivity term: at each of {steps} updates the released function "
            f"moves by Delta with ||Delta||_H = sqrt(C) = {math.sqrt(calibration.C):.4g} (kernel bumps at "
            f"{n_points} query points); independent paths per update, as the proof composes them"
        ),
        scores=scores,
        chunk_trials=20_000 if sampler == "recursion" else 500,
        references={"exact eps of the audited GP mechanism (Gaussian, PLD)": gaussian_equivalent},
        settings={
            "sigma": sigma, "beta": beta, "C": calibration.C, "updates": steps, "tail_k": calibration.tail_k,
            "n_points": n_points, "mu": mu, "noise_factor": noise_factor, "sampler": sampler,
        },
    )
