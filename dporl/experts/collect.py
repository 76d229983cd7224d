"""Rollouts: log trajectories of every expert in one environment, all experts and trajectories advancing together.

``collect`` is the data generator of Sharma et al. 2024: each expert logs ``n`` trajectories in the DEFAULT
environment, sampling its actions from the SOFTENED policy (so pi_i(a|s) >= p_min truly holds for the logged data)
and recording the behaviour log-probability of every taken action. One vector environment holds
``experts_per_chunk * n`` slots, expert-major (slot ``i * n + j`` is expert i's j-th trajectory); every time step is
one ``ExpertSet.log_probs_paired`` call and one vector-env step. Each slot runs exactly one episode: whatever the
vector env does after a slot's episode ends (autoreset) is ignored, and a slot still running at
``max_episode_steps`` is marked truncated.

``evaluate_policies`` is the same loop with greedy actions and a per-slot physics setting: it scores candidate
experts on the setting they were built for (the paper's "keep the best k per setting").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import gymnasium as gym
import numpy as np
import torch
from tqdm.auto import tqdm

import dporl.envs  # noqa: F401  (registers the dporl/ environment ids)
from dporl.data.dataset import DatasetMetadata, TrajectoryDataset
from dporl.envs.process_env import make_vector_env
from dporl.envs.vector import logging_physics
from dporl.experts.expert_set import ExpertSet, sample_from_log_probs
from dporl.experts.policies import StackedPolicy
from dporl.utils.validation import ValidationError

# act(observations [n_slots, d] float32) -> (actions [n_slots] int64, log_probs [n_slots] float32 or None)
Actor = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]


@dataclass
class Rollout:
    """Time-major buffers of one batch of slots, each slot one episode of ``lengths[slot]`` transitions.

    Also what the stable-prefix release fills with its fresh rollouts (``dporl.algos.stable_prefix``).
    """

    observations: np.ndarray  # [T + 1, N, d]
    actions: np.ndarray  # [T, N]
    rewards: np.ndarray  # [T, N]
    log_probs: np.ndarray | None  # [T, N]
    lengths: np.ndarray  # [N]
    terminated: np.ndarray  # [N]
    truncated: np.ndarray  # [N]

    def returns(self) -> np.ndarray:
        live = np.arange(self.rewards.shape[0])[:, None] < self.lengths[None, :]
        return np.where(live, self.rewards, 0.0).sum(axis=0, dtype=np.float64)

    def slots(self, index: np.ndarray) -> "Rollout":
        """The listed slots only (e.g. those with at least one transition, which ``flatten_rollout`` needs)."""
        return Rollout(
            self.observations[:, index], self.actions[:, index], self.rewards[:, index],
            None if self.log_probs is None else self.log_probs[:, index],
            self.lengths[index], self.terminated[index], self.truncated[index],
        )


def _rollout(vector_env: gym.vector.VectorEnv, act: Actor, max_steps: int, seed: int, record_log_probs: bool,
             progress: tqdm | None = None) -> Rollout:
    n_slots = vector_env.num_envs
    obs, _ = vector_env.reset(seed=seed)
    obs = np.asarray(obs, dtype=np.float32).reshape(n_slots, -1)
    observations = np.zeros((max_steps + 1, *obs.shape), dtype=np.float32)
    actions = np.zeros((max_steps, n_slots), dtype=np.int64)
    rewards = np.zeros((max_steps, n_slots), dtype=np.float32)
    log_probs = np.zeros((max_steps, n_slots), dtype=np.float32) if record_log_probs else None
    lengths = np.zeros(n_slots, dtype=np.int64)
    terminated = np.zeros(n_slots, dtype=bool)
    truncated = np.zeros(n_slots, dtype=bool)
    alive = np.ones(n_slots, dtype=bool)
    observations[0] = obs
    for t in range(max_steps):
        chosen, chosen_log_probs = act(torch.from_numpy(observations[t]))
        actions[t] = chosen.numpy()
        if log_probs is not None:
            log_probs[t] = chosen_log_probs.numpy()
        obs, reward, term, trunc, _ = vector_env.step(actions[t])
        # Next-step autoreset: the obs returned on an episode's last step is its true final observation.
        observations[t + 1] = np.asarray(obs, dtype=np.float32).reshape(n_slots, -1)
        rewards[t] = reward
        lengths += alive
        ended = alive & (np.asarray(term) | np.asarray(trunc))
        terminated |= ended & np.asarray(term)
        truncated |= ended & np.asarray(trunc)
        alive &= ~ended
        if progress is not None:
            progress.update(1)
        if not alive.any():
            break
    truncated |= alive  # still running at max_steps: cut off
    return Rollout(observations, actions, rewards, log_probs, lengths, terminated, truncated)


def flatten_rollout(rollout: Rollout) -> dict[str, np.ndarray]:
    """Slot-major flat arrays in the TrajectoryDataset layout (one vectorised mask per field, no per-slot loop).

    Every slot must hold at least one transition (``Rollout.slots`` selects those).
    """
    steps = rollout.actions.shape[0]
    live = np.arange(steps)[None, :] < rollout.lengths[:, None]  # [N, T]
    live_obs = np.arange(steps + 1)[None, :] <= rollout.lengths[:, None]  # [N, T + 1]
    last = np.cumsum(rollout.lengths) - 1
    terminations = np.zeros(int(rollout.lengths.sum()), dtype=bool)
    truncations = np.zeros_like(terminations)
    terminations[last] = rollout.terminated
    truncations[last] = rollout.truncated
    flat = {
        "observations": rollout.observations.transpose(1, 0, 2)[live_obs],
        "actions": rollout.actions.T[live],
        "rewards": rollout.rewards.T[live],
        "terminations": terminations,
        "truncations": truncations,
        "episode_lengths": rollout.lengths.copy(),
    }
    if rollout.log_probs is not None:
        flat["behavior_log_probs"] = rollout.log_probs.T[live]
    return flat


def collect(
    expert_set: ExpertSet,
    env_id: str,
    trajectories_per_expert: int,
    max_episode_steps: int,
    seed: int,
    *,
    env_params: Mapping[str, Any] | None = None,
    env_kwargs: Mapping[str, Any] | None = None,
    experts_per_chunk: int = 1000,
    workers: int = 1,
    progress: bool = True,
    extra: Mapping[str, Any] | None = None,
) -> TrajectoryDataset:
    """Log ``trajectories_per_expert`` episodes of every expert (softened policy) in ``env_id``.

    ``env_params`` = physics of the logging env (None or {} = the default environment, as in the paper);
    ``env_kwargs`` = other make arguments (e.g. HIV ``treatment_interval``).
    Chunks of ``experts_per_chunk`` experts bound memory; chunk c uses env seed and action-sampling seed derived
    from ``(seed, c)``, so the dataset is a deterministic function of (experts, config, seed, chunk size).
    """
    if trajectories_per_expert < 1:
        raise ValidationError("trajectories_per_expert", f"must be >= 1, got {trajectories_per_expert}")
    if max_episode_steps < 1:
        raise ValidationError("max_episode_steps", f"must be >= 1, got {max_episode_steps}")
    if experts_per_chunk < 1:
        raise ValidationError("experts_per_chunk", f"must be >= 1, got {experts_per_chunk}")
    env_params = dict(env_params or {})
    env_kwargs = dict(env_kwargs or {})
    m, n = expert_set.n_experts, trajectories_per_expert
    chunks = [slice(start, min(start + experts_per_chunk, m)) for start in range(0, m, experts_per_chunk)]
    parts: list[dict[str, np.ndarray]] = []
    expert_ids: list[np.ndarray] = []
    obs_shape: tuple[int, ...] | None = None
    n_actions = None
    bar = tqdm(total=len(chunks) * max_episode_steps, desc=f"logging {m}x{n} episodes", unit="step",
               disable=not progress)
    with bar:
        for index, chunk in enumerate(chunks):
            count = chunk.stop - chunk.start
            env_seed, action_seed = np.random.SeedSequence([seed, index]).generate_state(2)
            generator = torch.Generator().manual_seed(int(action_seed))
            vector_env = make_vector_env(env_id, count * n, max_episode_steps,
                                         [env_params] * (count * n) if env_params else None, env_kwargs, workers)
            try:
                space = vector_env.single_action_space
                if not isinstance(space, gym.spaces.Discrete) or space.n != expert_set.n_actions:
                    raise ValidationError("env_id", f"{env_id} has action space {space}; the experts have "
                                          f"{expert_set.n_actions} discrete actions")
                obs_shape = tuple(vector_env.single_observation_space.shape)
                n_actions = int(space.n)

                def act(obs: torch.Tensor, chunk=chunk, count=count) -> tuple[torch.Tensor, torch.Tensor]:
                    log_probs = expert_set.log_probs_paired(obs.view(count, n, -1), experts=chunk)
                    actions = sample_from_log_probs(log_probs, generator)
                    taken = log_probs.gather(2, actions.unsqueeze(2)).squeeze(2)
                    return actions.reshape(-1), taken.reshape(-1)

                before = bar.n
                rollout = _rollout(vector_env, act, max_episode_steps, int(env_seed), True, bar)
                bar.update(max_episode_steps - (bar.n - before))  # chunks that end early still fill their share
            finally:
                vector_env.close()
            parts.append(flatten_rollout(rollout))
            expert_ids.append(np.repeat(np.arange(chunk.start, chunk.stop), n))
    flat = {key: np.concatenate([part[key] for part in parts]) for key in parts[0]}
    flat["observations"] = flat["observations"].reshape(-1, *obs_shape)
    metadata = DatasetMetadata(
        env_id=env_id,
        n_actions=n_actions,
        n_units=m,
        obs_shape=obs_shape,
        env_params=logging_physics(env_id, env_params, env_kwargs),
        p_min=expert_set.p_min,
        seed=seed,
        expert_set=expert_set.reference(),
        extra={
            "trajectories_per_expert": n,
            "max_episode_steps": max_episode_steps,
            "env_kwargs": env_kwargs,
            "behavior": f"expert policies with {expert_set.softening!r} p_min softening",
            "experts_per_chunk": experts_per_chunk,
            **dict(extra or {}),
        },
    )
    return TrajectoryDataset(unit_ids=np.concatenate(expert_ids), metadata=metadata, **flat)


def evaluate_policies(
    policy: StackedPolicy,
    env_id: str,
    settings: Sequence[Mapping[str, Any]],
    episodes: int,
    max_episode_steps: int,
    seed: int,
    *,
    env_kwargs: Mapping[str, Any] | None = None,
    experts_per_chunk: int = 256,
    workers: int = 1,
    progress: bool = False,
) -> np.ndarray:
    """Mean greedy return [m] of each expert i over ``episodes`` episodes on physics ``settings[i]``.

    Greedy = the argmax action of the expert's logits, i.e. the expert itself before any p_min softening.
    """
    if len(settings) != policy.n_experts:
        raise ValidationError("settings", f"need one setting per expert ({policy.n_experts}), got {len(settings)}")
    if episodes < 1:
        raise ValidationError("episodes", f"must be >= 1, got {episodes}")
    means = np.zeros(policy.n_experts)
    starts = range(0, policy.n_experts, experts_per_chunk)
    for index, start in enumerate(tqdm(starts, desc="evaluating experts", disable=not progress)):
        chunk = slice(start, min(start + experts_per_chunk, policy.n_experts))
        count = chunk.stop - chunk.start
        slot_settings = [settings[i] for i in range(chunk.start, chunk.stop) for _ in range(episodes)]
        vector_env = make_vector_env(env_id, count * episodes, max_episode_steps, slot_settings, env_kwargs, workers)

        def act(obs: torch.Tensor, chunk=chunk, count=count) -> tuple[torch.Tensor, None]:
            with torch.no_grad():
                logits = policy.forward_paired(obs.view(count, episodes, -1), experts=chunk)
            return logits.argmax(dim=-1).reshape(-1), None

        try:
            rollout = _rollout(vector_env, act, max_episode_steps, seed + index, False)
        finally:
            vector_env.close()
        means[chunk] = rollout.returns().reshape(count, episodes).mean(axis=1)
    return means
