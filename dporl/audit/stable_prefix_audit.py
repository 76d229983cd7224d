"""Audit of one run of the sparse-vector stable-prefix release (expert-level paper, Algorithms 1-2).

Privacy model audited (the analysis's): D is a set of experts; one run picks an expert uniformly, takes a fresh
rollout of it, and releases the longest prefix that passes the noisy stability queries. Each run is
(2 eps', beta)-DP for add/remove one expert (``stable_prefix_budget(...).event``).

Worst-case neighbour (the brief's): D' = m experts that all prefer action 0; D = D' plus a canary expert that
prefers action 1, an action every other expert takes only with probability p_min. A released prefix with many
1s is then likely under D (the canary's rollouts) and very unlikely under D'. Statistic: the number of 1s in the
released prefix. Observations are a constant public state, so a trajectory is its action sequence.

Trials are vectorised: n independent runs are n runs of the release's own lockstep query loop
(``dporl.algos.stable_prefix.stable_prefix_lengths``: stability queries through the real ``ExpertSet``, Laplace noise from
``NoiseSource``), each on its own fresh rollout, with one threshold draw per run exactly as the release does.

Power: ``threshold_factor`` scales the calibrated threshold G = G0 / p_min + t_beta (0: no threshold at all) and
``noise_factor`` the Laplace scale; a release without a threshold (0, noise 1e-3: whole rollouts released) leaks
the canary's rollouts. The bound can only exceed log(P[canary chosen] / P_D'[many 1s] upper bound) ~ log(trials /
(m + 1)), so the defaults keep m small; at T = 1 and delta = 1e-5 the threshold (~67) then exceeds m + 1 and the
honest release releases nothing. With m = 60, eps = 2 prefixes of 1-4 steps are released (eps_lb = 0 at 50k
trials per neighbour; 4.28 > 2 without the threshold).
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch

from dporl.audit.experiment import Experiment
from dporl.utils.seeding import make_generator
from dporl.utils.validation import ValidationError, check_positive


def _expert_set(n_experts: int, p_min: float, with_canary: bool):
    from dporl.experts import ExpertSet, StackedLinearPolicy

    m = n_experts + int(with_canary)
    bias = torch.zeros(m, 2)
    bias[:, 0] = 1.0  # every ordinary expert prefers action 0
    if with_canary:
        bias[0] = torch.tensor([0.0, 1.0])  # the canary prefers action 1
    policy = StackedLinearPolicy.from_weights(torch.zeros(m, 1, 2), bias)
    return ExpertSet(policy, p_min, softening="argmax")


def _rollouts(expert_set, n: int, horizon: int, generator: torch.Generator):
    """n fresh rollouts, each of a uniformly chosen expert (the run's first step), as a TrajectoryDataset."""
    from dporl.data.dataset import DatasetMetadata, TrajectoryDataset
    from dporl.experts import sample_from_log_probs

    m = expert_set.n_experts
    experts = torch.randint(0, m, (n,), generator=generator)
    log_probs = expert_set.log_probs(torch.zeros(1, 1))[:, 0]  # [m, 2]: the policies ignore the (constant) state
    actions = sample_from_log_probs(log_probs[experts].unsqueeze(1).expand(n, horizon, 2), generator)
    terminations = np.zeros((n, horizon), dtype=bool)
    terminations[:, -1] = True
    metadata = DatasetMetadata(env_id="audit/constant-state", n_actions=2, n_experts=m, obs_shape=(1,), p_min=expert_set.p_min)
    return TrajectoryDataset(
        observations=np.zeros((n * (horizon + 1), 1), dtype=np.float32),
        actions=actions.reshape(-1).numpy(),
        rewards=np.zeros(n * horizon, dtype=np.float32),
        terminations=terminations.reshape(-1),
        truncations=np.zeros(n * horizon, dtype=bool),
        episode_lengths=np.full(n, horizon, dtype=np.int64),
        expert_ids=experts.numpy(),
        metadata=metadata,
    )


def stable_prefix_audit(
    epsilon: float = 1.0,
    delta: float = 1e-5,
    n_experts: int = 20,
    p_min: float = 0.2,
    horizon: int = 10,
    trajectories: int = 1,
    threshold_factor: float = 1.0,
    noise_factor: float = 1.0,
) -> Experiment:
    """One run of a release whose stage budget (epsilon, delta) covers ``trajectories`` runs, on D = canary +
    n_experts vs D' = the n_experts; the claim audited is the per-run (2 eps', beta)."""
    from dporl.algos.stable_prefix import StablePrefixConfig, stable_prefix_lengths
    from dporl.privacy.noise import NoiseSource
    from dporl.privacy.sparse_vector import stable_prefix_budget

    if horizon < 1:
        raise ValidationError("horizon", f"must be >= 1, got {horizon}")
    check_positive("threshold_factor", threshold_factor, allow_zero=True)
    check_positive("noise_factor", noise_factor)
    # The claim is about D, the larger set (m + 1 experts); the precondition m p_min >= G0 is checked for D'.
    budget = stable_prefix_budget(epsilon, delta, trajectories, p_min, n_experts, monotone=True)
    if n_experts * p_min < budget.g0:
        raise ValidationError("n_experts", f"m p_min = {n_experts * p_min:g} < G0 = {budget.g0:g}: the release refuses")
    used = dataclasses.replace(
        budget, threshold=budget.threshold * threshold_factor, noise_scale=budget.noise_scale * noise_factor
    )
    config = StablePrefixConfig(trajectories=1)
    expert_sets = {True: _expert_set(n_experts, p_min, True), False: _expert_set(n_experts, p_min, False)}

    def scores(n: int, on_d: bool, seed: int) -> np.ndarray:
        expert_set = expert_sets[on_d]
        dataset = _rollouts(expert_set, n, horizon, make_generator(seed))
        noise = NoiseSource(seed + 1)
        threshold = used.threshold + noise.laplace((n,), used.noise_scale)
        lengths, _ = stable_prefix_lengths(dataset, expert_set, np.arange(n), threshold, used, noise, config)
        actions = dataset.actions.reshape(n, horizon)
        released = np.arange(horizon)[None, :] < lengths[:, None]
        return ((actions == 1) & released).sum(1).astype(np.float64)

    return Experiment(
        name="stable_prefix",
        claimed_epsilon=2 * budget.epsilon_prime,
        delta=budget.beta,
        privacy_unit="expert",
        analysis=f"sparse vector per run: ApproxDPEvent(2 eps' = {2 * budget.epsilon_prime:.4g}, beta = {budget.beta:.3g})",
        neighbours=f"add/remove a canary expert preferring action 1; the {n_experts} others give it p_min = {p_min}",
        scores=scores,
        chunk_trials=10_000,
        settings={"epsilon": epsilon, "delta": delta, "trajectories": trajectories, "n_experts": n_experts, "p_min": p_min, "horizon": horizon,
                  "threshold": budget.threshold, "noise_scale": budget.noise_scale,
                  "threshold_factor": threshold_factor, "noise_factor": noise_factor},
    )
