"""The runs of a stable-prefix release: fresh rollouts in the public simulator (the sound default) or the paper's
walk over logged episodes, all runs advancing in lockstep (see ``dporl.algos.stable_prefix``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from tqdm.auto import tqdm

from dporl.algos.stable_prefix.plan import STREAMS, ReleasePlan
from dporl.algos.stable_prefix.prefix import _expert_log_probs, stable_prefix_lengths
from dporl.data.dataset import DatasetMetadata, TrajectoryDataset
from dporl.experts.collect import Rollout, flatten_rollout
from dporl.experts.expert_set import ExpertSet, sample_from_log_probs
from dporl.privacy.randomness import SecretRoot
from dporl.utils.validation import ValidationError


@dataclass
class ReleaseRuns:
    """The outcome of ``trials`` independent releases of T runs each (run r of trial t is slot t * T + r).

    ``prefixes`` holds each run's released prefix (``lengths`` = released transitions, 0 = nothing released) in
    time-major buffers. ``experts`` (the expert each run followed) and ``episodes`` (logged: the episode each run
    walked, -1 if its expert had none left) are the mechanism's secret randomness: curator-only.
    """

    prefixes: Rollout
    experts: np.ndarray
    episodes: Optional[np.ndarray]
    trials: int
    runs_per_trial: int
    states_evaluated: int  # states shown to the experts (x m evaluations)
    # [m, n_runs] float64: sum over each released prefix of log pi_i(a_t | s_t) for every expert i (log q_K per
    # expert; what the release compared, without the failed query's action). Curator-only, never saved.
    log_mass: Optional[torch.Tensor] = None

    @property
    def lengths(self) -> np.ndarray:
        return self.prefixes.lengths

    def stable_dataset(self, metadata: DatasetMetadata) -> TrajectoryDataset:
        """D_stable: every released prefix (runs with >= 1 transition), identities removed."""
        kept = np.flatnonzero(self.lengths > 0)
        if len(kept) == 0:
            flat = _empty_flat(metadata.obs_shape)
        else:
            flat = flatten_rollout(self.prefixes.slots(kept))
            flat.pop("behavior_log_probs", None)
        return TrajectoryDataset(unit_ids=np.zeros(len(kept), dtype=np.int64), metadata=metadata, **flat)


def execute_release(
    plan: ReleasePlan,
    dataset: TrajectoryDataset,
    expert_set: ExpertSet,
    root: SecretRoot,
    *,
    trials: int = 1,
    progress: bool = False,
) -> ReleaseRuns:
    """Run ``trials`` independent releases of ``plan.trajectories`` runs each, all in lockstep (see the package).

    All randomness comes from ``root``'s streams ``STREAMS`` (each taken once). ``trials > 1`` is for audits: every
    trial is a release of its own (the logged variant's "no episode twice" rule applies within a trial).
    """
    if trials < 1:
        raise ValidationError("trials", f"must be >= 1, got {trials}")
    if plan.source == "fresh":
        return _fresh_runs(plan, expert_set, root, trials, progress)
    return _logged_runs(plan, dataset, expert_set, root, trials)


def _fresh_runs(plan: ReleasePlan, expert_set: ExpertSet, root: SecretRoot, trials: int, progress: bool) -> ReleaseRuns:
    budget, simulator = plan.budget, plan.simulator
    n, m, horizon = trials * plan.trajectories, expert_set.n_experts, simulator.horizon
    choice = root.torch_generator(STREAMS[0])
    env_seed = root.integer(STREAMS[1])
    action_generator = root.torch_generator(STREAMS[2])
    noise = root.noise(STREAMS[3])
    device = next(expert_set.parameters()).device

    experts = torch.randint(0, m, (n,), generator=choice)
    noisy_threshold = budget.threshold + noise.laplace((n,), budget.noise_scale)  # one draw per run
    observations = np.zeros((horizon + 1, n, expert_set.obs_dim), dtype=np.float32)
    actions = np.zeros((horizon, n), dtype=np.int64)
    rewards = np.zeros((horizon, n), dtype=np.float32)
    lengths = np.zeros(n, dtype=np.int64)
    terminated = np.zeros(n, dtype=bool)
    alive = np.ones(n, dtype=bool)
    log_mass = torch.zeros(m, n, dtype=torch.float64, device=device)  # sum_{t<k} log pi_i(a_t | s_t) per run
    chosen = experts.to(device)
    states_evaluated = 0
    env = simulator.make(n)
    try:
        first, _ = env.reset(seed=env_seed)
        observations[0] = np.asarray(first, dtype=np.float32).reshape(n, -1)
        for k in tqdm(range(horizon), desc="stable-prefix release", unit="step", disable=not progress):
            runs = np.flatnonzero(alive)
            if len(runs) == 0:
                break
            index = torch.from_numpy(runs).to(device)
            log_probs = _expert_log_probs(expert_set, torch.from_numpy(observations[k, runs]), plan.expert_chunk)
            own = log_probs[chosen[index], torch.arange(len(runs), device=device)]  # each run's own expert [n', n_A]
            sampled = sample_from_log_probs(own.cpu(), action_generator)
            taken = log_probs.gather(2, sampled.to(device).view(1, -1, 1).expand(m, -1, 1)).squeeze(2)
            mass = log_mass.index_select(1, index) + taken.to(torch.float64)
            log_q = torch.logsumexp(mass, dim=0).cpu()
            states_evaluated += len(runs)
            passed = (log_q.exp() + noise.laplace((len(runs),), budget.noise_scale) >= noisy_threshold[runs]).numpy()
            keep = torch.from_numpy(np.flatnonzero(passed)).to(device)  # a failed query's action is not released
            log_mass.index_copy_(1, index.index_select(0, keep), mass.index_select(1, keep))
            alive[runs[~passed]] = False
            moving = runs[passed]
            step_actions = np.zeros(n, dtype=np.int64)
            step_actions[moving] = sampled.numpy()[passed]
            obs, reward, term, trunc, _ = env.step(step_actions)
            obs = np.asarray(obs, dtype=np.float32).reshape(n, -1)
            actions[k, moving] = step_actions[moving]
            rewards[k, moving] = np.asarray(reward, dtype=np.float32)[moving]
            observations[k + 1, moving] = obs[moving]
            lengths[moving] += 1
            term, trunc = np.asarray(term, dtype=bool), np.asarray(trunc, dtype=bool)
            ended = moving[term[moving] | trunc[moving]]
            terminated[ended] = term[ended]
            alive[ended] = False
    finally:
        env.close()
    # A prefix ends by a failed query, a truncation or the horizon (truncated) or by a termination (terminated).
    prefixes = Rollout(observations, actions, rewards, None, lengths, terminated, ~terminated)
    return ReleaseRuns(prefixes, experts.numpy(), None, trials, plan.trajectories, states_evaluated, log_mass.cpu())


def _logged_runs(
    plan: ReleasePlan, dataset: TrajectoryDataset, expert_set: ExpertSet, root: SecretRoot, trials: int
) -> ReleaseRuns:
    """The paper's variant: each run walks one logged episode (NO guarantee on fixed data; see the package)."""

    budget, runs_per_trial = plan.budget, plan.trajectories
    n = trials * runs_per_trial
    choice = root.torch_generator(STREAMS[0])
    noise = root.noise(STREAMS[3])
    experts, episodes = _choose_trajectories(dataset, expert_set.n_experts, trials, runs_per_trial, choice)
    processed = np.flatnonzero(episodes >= 0)
    noisy_threshold = budget.threshold + noise.laplace((n,), budget.noise_scale)
    lengths = np.zeros(n, dtype=np.int64)
    states_evaluated = 0
    width = int(dataset.episode_lengths[episodes[processed]].max()) if len(processed) else 0
    observations = np.zeros((width + 1, n, expert_set.obs_dim), dtype=np.float32)
    actions = np.zeros((width, n), dtype=np.int64)
    rewards = np.zeros((width, n), dtype=np.float32)
    terminated = np.zeros(n, dtype=bool)
    log_mass = torch.zeros(expert_set.n_experts, n, dtype=torch.float64)
    if len(processed):
        padded = dataset.padded(episodes[processed])
        lengths[processed], states_evaluated, log_mass[:, processed] = stable_prefix_lengths(
            padded, expert_set, noisy_threshold[processed], budget, noise, plan.expert_chunk
        )
        observations[:, processed] = padded.observations.transpose(0, 1).reshape(width + 1, len(processed), -1).numpy()
        actions[:, processed] = padded.actions.T.numpy()
        rewards[:, processed] = padded.rewards.T.numpy()
        terminated[processed] = padded.terminated.numpy() & (lengths[processed] == padded.lengths.numpy())
    prefixes = Rollout(observations, actions, rewards, None, lengths, terminated, ~terminated)
    return ReleaseRuns(prefixes, experts, episodes, trials, runs_per_trial, states_evaluated, log_mass)


def _choose_trajectories(
    dataset: TrajectoryDataset, m: int, trials: int, runs: int, generator: torch.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(expert, episode) of every run of every trial: expert uniform over all m; then that expert's next unused
    episode of the trial, in a random order per trial. Episode -1: the expert had none left (nothing released)."""
    experts = torch.randint(0, m, (trials, runs), generator=generator).numpy()
    keys = torch.rand(trials, dataset.n_episodes, generator=generator, dtype=torch.float64).numpy()
    # Episodes grouped by expert, random order within (keys in [0, 1) never reorder two experts), per trial.
    shuffled = np.argsort(dataset.unit_ids[None, :] + keys, axis=1, kind="stable")
    counts = np.bincount(dataset.unit_ids, minlength=m)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    # occurrence[t, r]: how many earlier runs of trial t chose the same expert.
    flat = (np.arange(trials)[:, None] * m + experts).ravel()
    order = np.argsort(flat, kind="stable")
    occurrence = np.empty(len(flat), dtype=np.int64)
    occurrence[order] = np.arange(len(flat)) - np.searchsorted(flat[order], flat[order], side="left")
    occurrence = occurrence.reshape(trials, runs)
    available = occurrence < counts[experts]
    episodes = np.full((trials, runs), -1, dtype=np.int64)
    trial_of = np.broadcast_to(np.arange(trials)[:, None], (trials, runs))
    episodes[available] = shuffled[trial_of[available], offsets[experts[available]] + occurrence[available]]
    return experts.ravel(), episodes.ravel()


def _empty_flat(obs_shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    return {
        "observations": np.zeros((0, *obs_shape), dtype=np.float32),
        "actions": np.zeros(0, dtype=np.int64),
        "rewards": np.zeros(0, dtype=np.float32),
        "terminations": np.zeros(0, dtype=bool),
        "truncations": np.zeros(0, dtype=bool),
        "episode_lengths": np.zeros(0, dtype=np.int64),
    }
