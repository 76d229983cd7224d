"""Audits of reward-level private Q-learning (privacy unit "reward": sup |r - r'| <= 1).

Three audits attack what the REAL pipeline (``dporl.pipelines.fnq.train_one``: config -> learner -> source -> Trainer
-> ``released.pt``) releases on FIXED neighbouring reward functions, one whole training run per trial, reading
only the released network:

* ``paper_attack_audit`` ("fnq_paper_attack"): the paper's Algorithm 1 at its settings (the 1-D line MDP, alpha =
  3e-4, Theorem 5's sigma for (eps, delta)); D' is the environment with every reward + 1. Rewards reach the
  parameters additively through the TD targets: each SGD step moves the sum of the output biases by
  -alpha mean_t (Q + g - y)_t, so r + 1 shifts it by alpha per update whatever the paths and L are. The statistic is
  that sum's change divided by alpha. It must REFUTE Theorem 5's figure (the paper's, NOT a guarantee).
* ``gaussian_update_audit`` ("fnq_gaussian"): dporl's mechanism (``RewardPrivateQLearning``, public-iterate
  Gaussian updates) at its claimed eps, on the worst case we could design: an offline dataset whose transitions are
  all the same terminal (s0, a0), so every minibatch is the same public history and every update's target is the
  reward itself. With rewards r = Q_0(s0, a0) - 1/2 in D and r + 1 in D', the clipped TD errors are +1/2 and -1/2
  (they differ by exactly 1), and the per-transition Jacobian has norm >= 1 >= G (the output bias alone gives 1), so
  every update's mean gradient differs by exactly G s = G along u = J_0 / ||J_0||: the sensitivity bound holds with
  equality at every update and the shifts add up along one direction. The statistic <theta_0 - theta_U, u> / alpha
  is the likelihood-ratio test of the composed Gaussian mechanism (up to the drift of J, kept tiny by a small step),
  so its privacy curve is the claim's own: the audit must PASS at the claimed eps; with the noise multiplier cut
  (``noise_factor``, run at the budget that noise really costs) it must be caught (power).

The paper's figure is also probed two ways that do not run the pipeline: ``functional_noise_audit``
("functional_noise") audits the Gaussian-process mechanism of Theorem 5's proof in isolation, with the per-update
RKHS sensitivity sqrt(C) that the proof assumes (it passes: the flaw is the assumption, not the GP mechanism), and
``update_shift_norms`` measures, on the real learner, how far one SGD step on r vs r + 1 moves Q in that norm.

Theorem 5's GP-mechanism model (``functional_noise_audit``). Update j releases the function f_j + g_j with g_j a
sample path of GP(0, sigma^2 exp(-beta |x - y|)) on [0, 1] (``dporl.privacy.gp_noise``), independent across updates;
sigma, beta and the paper's (eps, delta) come from ``calibrate_functional_noise`` (via ``smallest_tail_parameter``).
The proof turns the neighbouring relation into ||f_D - f_D'||_H^2 <= C = (v^2 + v) L^2 in the RKHS H of the kernel
(Lemma 6's Sobolev norm). The worst case used here meets that bound with equality at every update:

    Delta = sqrt(C) * k_w / ||k_w||_H,   k_w = sum_i K(x_i, .) (one bump per query point x_i),
    ||k_w||_H^2 = 1^T K_X 1   (reproducing property),  so ||Delta||_H = sqrt(C) exactly.

D releases Delta + g_j at every update, D' releases g_j. Statistic: the exact log-likelihood ratio of the released
paths (Delta lies in the span of K(x_i, .), so by Cameron-Martin the values at x_1..x_m are sufficient): the score
sum_j Delta(X)^T (sigma^2 K_X)^{-1} y_j is N(+-mu^2 / 2-shifted, mu^2) with mu = sqrt(T/B) ||Delta||_H / sigma.
The paths' values at sorted query points are drawn by the exact Markov recursion
    g(x_1) = sigma z_1,   g(x_{i+1}) = a_i g(x_i) + sigma sqrt(1 - a_i^2) z_{i+1},   a_i = exp(-beta (x_{i+1} - x_i)),
batched in torch (``OrnsteinUhlenbeckPath``'s law for a sorted batch of new points; same numbers from the same
normals, tested); ``sampler="library"`` runs ``OrnsteinUhlenbeckPath`` itself at small trial counts.

Layering: the pipeline audits import ``dporl.pipelines.fnq`` inside their builders. The pipeline sits above the
audit layer, but an audit of a release must run the code that produces the release (an audit that rebuilt the
mechanism here would test a model of dporl, not dporl).
"""

from __future__ import annotations

import math
import tempfile
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from dporl.audit.experiment import Experiment
from dporl.privacy.accountants import epsilon_for
from dporl.privacy.events import PoissonGaussianEvent
from dporl.privacy.functional_calibration import (
    ANALYSIS,
    UNIT,
    gaussian_noise_multiplier,
    smallest_tail_parameter,
    update_event,
)
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
            f"Theorem 5's GP mechanism in isolation (the proof's model, NOT the released network: see "
            f"fnq_paper_attack): sup|r - r'| <= 1 as its sensitivity term, at each of {steps} updates the function "
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


# ------------------------------------------------------------------------------ audits through the real pipeline
LINE_ENV = "dporl/Line1D-v0"
PUBLIC_SEED = 0  # the public seed of every audited run: network initialisation and evaluation are fixed
POWER_TRIALS = 100  # fnq_gaussian: at mu ~ 2.9 (noise / 10) 50 held-out trials per side certify eps ~ 1.4 > 0.9
ATTACK_TRIALS = 40  # fnq_paper_attack: a perfect separation of 20 held-out trials per side certifies eps >= 1.6


def _released_network(settings: dict[str, Any], noise_seed: int, make_env: Optional[Callable[[], Any]] = None):
    """The Q-network that one run of the real "fnq" pipeline releases (``released.pt``, weights-only load)."""
    from dporl.algos.fnq import load_noisy_q
    from dporl.pipelines.fnq import FNQPipelineConfig, context, plan, train_one  # see "Layering" above
    from dporl.utils.config import from_dict

    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory(prefix="dporl_audit_") as tmp:
        config = from_dict(FNQPipelineConfig, {
            **settings, "run_dir": tmp, "noise_seed": int(noise_seed), "progress": False, "evaluations": 0,
        })
        (spec,) = [spec for spec in plan(config) if spec.epsilon is not None]
        record = train_one(config, spec, PUBLIC_SEED, context(config, make_env))
        function, _ = load_noisy_q(Path(record["run_dir"]) / "release" / "released.pt")
    return function.q_network


def _trial_seeds(n: int, seed: int) -> list[int]:
    """Independent secret roots, one per trial (each trial is a fresh run with its own noise)."""
    return [int(s) for s in np.random.SeedSequence(seed).generate_state(2 * n, np.uint64).view(np.uint64)[:n]]


def _shifted_line_env(shift: float) -> Callable[[], Any]:
    def make():
        import gymnasium as gym

        import dporl.envs  # noqa: F401

        env = gym.make(LINE_ENV)
        return gym.wrappers.TransformReward(env, lambda r: r + shift) if shift else env

    return make


def _public_initial_network(obs_dim: int, n_actions: int, hidden_sizes: list[int]) -> torch.nn.Module:
    """The network every audited run starts from (the pipeline's public initialisation at ``PUBLIC_SEED``)."""
    from dporl.algos.networks import mlp

    torch.manual_seed(PUBLIC_SEED)
    return mlp(obs_dim, list(hidden_sizes), n_actions)


def _output_bias_sum(network: torch.nn.Module) -> float:
    last = [m for m in network.modules() if isinstance(m, torch.nn.Linear)][-1]
    return float(last.bias.detach().double().sum())


def paper_attack_audit(
    epsilon: float = 0.9,
    delta: float = 1e-4,
    samples: int = 5000,
    batch_size: int = 64,
    learning_rate: float = 3e-4,
    reset_factor: int = 78,
    hidden_sizes: tuple[int, ...] = (16, 16),
    gamma: float = 0.99,
    trials: int = ATTACK_TRIALS,
) -> Experiment:
    """The paper's Algorithm 1 through the real pipeline, r vs r + 1 on the line MDP (module docstring).

    Defaults are the paper's: T = 5000, B = 64 (78 updates), alpha = 3e-4, fresh paths every update (J = T/B),
    Theorem 5's sigma for (0.9, 1e-4) (k from ``smallest_tail_parameter``; sigma ~ 20.9, total delta ~ 5e-5).
    """
    from dporl.pipelines.fnq import FNQPipelineConfig, plan, theorem5_calibration
    from dporl.utils.config import from_dict

    epsilon = check_positive("epsilon", epsilon)
    delta = check_probability("delta", delta, allow_zero=False, allow_one=False)
    settings = {
        "pipeline": "fnq", "env_id": LINE_ENV, "methods": ["fnq_paper"], "epsilons": [epsilon], "delta": delta,
        "samples": int(samples), "batch_size": int(batch_size), "reset_factors": [int(reset_factor)],
        "optimizer": {"name": "sgd", "lr": float(learning_rate)}, "hidden_sizes": list(hidden_sizes),
        "gamma": float(gamma),
    }
    config = from_dict(FNQPipelineConfig, {**settings, "progress": False})
    (spec,) = [s for s in plan(config) if s.epsilon is not None]
    calibration = theorem5_calibration(config, spec)
    initial = _output_bias_sum(_public_initial_network(1, 2, list(hidden_sizes)))

    def scores(n: int, on_d: bool, seed: int) -> np.ndarray:
        # D = the line MDP's rewards, D' = rewards + 1; a larger score (a smaller bias sum) looks like D.
        make_env = _shifted_line_env(0.0 if on_d else 1.0)
        return np.array([
            -(_output_bias_sum(_released_network(settings, trial, make_env)) - initial) / learning_rate
            for trial in _trial_seeds(n, seed)
        ])

    return Experiment(
        name="fnq_paper_attack",
        claimed_epsilon=calibration.epsilon,
        delta=calibration.delta_total,
        privacy_unit=UNIT,
        analysis=calibration.describe(),
        neighbours=(
            f"the line MDP's reward r vs r + 1 (sup distance 1), same public initialisation; each trial one run of "
            f"the fnq pipeline (method fnq_paper, {config.updates} updates); statistic: change of the summed output "
            "biases of the released network divided by alpha (r + 1 adds ~1 per update)"
        ),
        scores=scores,
        chunk_trials=max(8, int(trials)),
        max_trials=int(trials),
        settings={**settings, "sigma": calibration.sigma, "beta": calibration.beta, "tail_k": calibration.tail_k,
                  "updates": config.updates},
    )


def gaussian_update_audit(
    epsilon: float = 0.9,
    delta: float = 1e-4,
    updates: int = 10,
    batch_size: int = 8,
    clip_norm: float = 0.5,
    learning_rate: float = 1e-3,
    hidden_sizes: tuple[int, ...] = (16, 16),
    noise_factor: float = 1.0,
    accountant: str = "pld",
    trials: int = POWER_TRIALS,
) -> Experiment:
    """dporl's reward-level mechanism through the real pipeline on its worst case (module docstring).

    ``noise_factor < 1`` cuts the noise multiplier below the claim's calibration; the pipeline then runs at the
    budget that noise really costs (it refuses to overspend a budget), while the claim stays the original eps.
    """
    from dporl.data.dataset import DatasetMetadata, TrajectoryDataset

    epsilon = check_positive("epsilon", epsilon)
    delta = check_probability("delta", delta, allow_zero=False, allow_one=False)
    clip_norm = check_positive("clip_norm", clip_norm)
    noise_factor = check_positive("noise_factor", noise_factor)
    if clip_norm > 1:
        raise ValidationError("clip_norm", "the worst case needs G <= 1 (the Jacobian's norm is >= 1, from the bias)")
    if int(updates) != updates or updates < 1 or int(batch_size) != batch_size or batch_size < 1:
        raise ValidationError("updates", f"updates and batch_size must be integers >= 1, got {updates}, {batch_size}")
    z = gaussian_noise_multiplier(epsilon, delta, int(updates), accountant) * noise_factor
    budget = epsilon if noise_factor >= 1 else 1.001 * epsilon_for([(update_event(z), int(updates))], delta, accountant)
    state, action = 0.5, 1
    initial = _public_initial_network(1, 2, list(hidden_sizes))
    obs = torch.tensor([[state]])
    q0 = initial(obs)[0, action]
    jacobian = torch.cat([g.reshape(-1) for g in torch.autograd.grad(q0, list(initial.parameters()))]).detach().double()
    if float(jacobian.norm()) < clip_norm:
        raise ValidationError("clip_norm", f"||J_0|| = {float(jacobian.norm()):.3g} < G: the worst case is not clipped")
    direction = jacobian / jacobian.norm()
    theta0 = torch.cat([p.detach().reshape(-1) for p in initial.parameters()]).double()
    reward_d = float(q0.detach()) - 0.5  # TD error +1/2 in D, -1/2 in D' (rewards + 1)
    folder = tempfile.TemporaryDirectory(prefix="dporl_audit_data_")
    paths = {}
    for name, reward in (("D", reward_d), ("D'", reward_d + 1.0)):
        episodes = [
            {"observations": np.full((2, 1), state, np.float32), "actions": np.array([action]),
             "rewards": np.array([reward], np.float32), "terminated": True, "truncated": False, "unit_id": 0}
            for _ in range(batch_size)
        ]
        dataset = TrajectoryDataset.from_episodes(episodes, DatasetMetadata(LINE_ENV, 2, 1, (1,)))
        paths[name] = dataset.save(Path(folder.name) / f"{'d' if name == 'D' else 'd_prime'}.npz")
    settings = {
        "pipeline": "fnq", "env_id": LINE_ENV, "methods": ["fnq"], "epsilons": [budget], "delta": delta,
        "samples": int(updates) * int(batch_size), "batch_size": int(batch_size), "hidden_sizes": list(hidden_sizes),
        "optimizer": {"name": "sgd", "lr": float(learning_rate)}, "clip_norm": clip_norm, "td_clip": 1.0,
        "noise_multiplier": z, "accountant": accountant,
    }

    def scores(n: int, on_d: bool, seed: int) -> np.ndarray:
        run = {**settings, "dataset": str(paths["D" if on_d else "D'"])}
        out = []
        for trial in _trial_seeds(n, seed):
            network = _released_network(run, trial)
            theta = torch.cat([p.detach().reshape(-1) for p in network.parameters()]).double()
            out.append(float((theta0 - theta) @ direction) / learning_rate)
        folder.name  # keeps the datasets' folder alive as long as the experiment
        return np.array(out)

    mu = math.sqrt(updates) / z
    return Experiment(
        name="fnq_gaussian",
        claimed_epsilon=epsilon,
        delta=delta,
        privacy_unit=UNIT,
        analysis=(
            f"public-iterate Gaussian updates (dporl.algos.fnq.RewardPrivateQLearning): {updates} updates, noise "
            f"multiplier z = {z / noise_factor:.4g} calibrated by {accountant} for ({epsilon:g}, {delta:g})"
        ),
        neighbours=(
            f"offline, {batch_size} identical terminal transitions (s0 = {state}, a0 = {action}); rewards "
            f"Q_0(s0, a0) - 1/2 vs + 1/2 (sup distance 1): TD errors +-1/2, Jacobian clipped to G = {clip_norm:g}, "
            "every update's mean gradient shifted by exactly G along J_0; statistic <theta_0 - theta_U, J_0> / alpha"
        ),
        scores=scores,
        chunk_trials=max(8, int(trials)),
        max_trials=int(trials),
        references={"exact eps of the audited Gaussian composition (PLD)": epsilon_for(
            [(PoissonGaussianEvent(1.0 / mu), 1)], delta, "pld")},
        settings={**settings, "noise_factor": noise_factor, "mu": mu, "jacobian_norm": float(jacobian.norm())},
    )
