"""Episodic returns of a policy in a (vector) environment, with t-based confidence intervals.

Evaluation touches only the released model and the public environment, so it is post-processing: it costs no
privacy budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional, Sequence

import numpy as np
import torch
from gymnasium.vector import AutoresetMode

from dporl.utils.validation import ValidationError

Policy = Callable[[torch.Tensor], torch.Tensor]  # observations [B, *obs] -> actions [B]


@dataclass(frozen=True)
class ReturnStats:
    mean: float
    std: float
    stderr: float
    ci_low: float
    ci_high: float
    confidence: float
    n: int
    returns: list[float] = field(repr=False)

    def to_dict(self) -> dict[str, float]:
        return {
            "return_mean": self.mean,
            "return_std": self.std,
            "return_ci_low": self.ci_low,
            "return_ci_high": self.ci_high,
            "episodes": float(self.n),
        }


def confidence_interval(values: Sequence[float], confidence: float = 0.95) -> ReturnStats:
    """Mean with a Student-t interval (exact for normal returns, the usual large-sample choice otherwise)."""
    from scipy import stats

    values = np.asarray(values, dtype=np.float64)
    if values.size == 0:
        raise ValidationError("returns", "no episodes to summarise")
    mean = float(values.mean())
    std = float(values.std(ddof=1)) if values.size > 1 else 0.0
    stderr = std / math.sqrt(values.size)
    half = float(stats.t.ppf(0.5 + confidence / 2, df=max(values.size - 1, 1))) * stderr
    return ReturnStats(mean, std, stderr, mean - half, mean + half, confidence, int(values.size), values.tolist())


def evaluate_returns(
    policy: Policy, vector_env, episodes: int, seed: int, confidence: float = 0.95, progress: bool = False
) -> ReturnStats:
    """Run exactly ``ceil(episodes / num_envs)`` episodes in every sub-env and keep the first ``episodes``.

    A fixed quota per sub-env, rather than "the first N episodes to finish", avoids biasing the mean towards
    short episodes. ``progress``: a bar over finished episodes.
    """
    from tqdm.auto import tqdm

    if episodes < 1:
        raise ValidationError("episodes", f"must be >= 1, got {episodes}")
    n_envs = vector_env.num_envs
    quota = math.ceil(episodes / n_envs)
    next_step_reset = vector_env.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP) == AutoresetMode.NEXT_STEP
    obs, _ = vector_env.reset(seed=seed)
    running = np.zeros(n_envs)
    finished: list[list[float]] = [[] for _ in range(n_envs)]
    resetting = np.zeros(n_envs, dtype=bool)
    bar = tqdm(total=quota * n_envs, desc="evaluate", unit="episode", disable=not progress, dynamic_ncols=True,
               leave=False)
    while min(len(f) for f in finished) < quota:
        with torch.no_grad():
            actions = policy(torch.as_tensor(np.asarray(obs), dtype=torch.float32))
        obs, rewards, terminated, truncated, _ = vector_env.step(np.asarray(actions.cpu()))
        live = ~resetting
        running[live] += np.asarray(rewards)[live]
        done = (np.asarray(terminated) | np.asarray(truncated)) & live
        for i in np.flatnonzero(done):
            if len(finished[i]) < quota:
                finished[i].append(float(running[i]))
                bar.update(1)
            running[i] = 0.0
        # In next-step mode the step after an episode's end only resets that sub-env.
        resetting = done if next_step_reset else np.zeros(n_envs, dtype=bool)
    bar.close()
    returns = [r for per_env in zip(*finished) for r in per_env][:episodes]
    return confidence_interval(returns, confidence)


def evaluate_released_policy(
    policy_dir: str | Path, *, episodes: int, seed: int, env_id: Optional[str] = None, num_envs: int = 10,
    max_episode_steps: Optional[int] = None, out: Optional[str | Path] = None, progress: bool = True,
) -> dict:
    """Returns of a released policy (``RUN/release/policy``, read alone, weights-only) in its public simulator.

    Writes the returns to ``<policy>/../evaluations/eval_seed<S>_episodes<N>.json`` (or ``out``). Public-simulator
    returns of a released policy are post-processing: they cost no privacy.
    """
    from dporl.envs.registry import check_env_id, make_vec
    from dporl.train.export import load_policy
    from dporl.utils.io import atomic_write_json

    if episodes < 1:
        raise ValidationError("episodes", f"must be >= 1, got {episodes}")
    field = "env" if env_id else "policy.env_id"
    if env_id:
        check_env_id(field, env_id)  # before the policy is read: a bad --env is named first
    policy = load_policy(policy_dir)
    env_id = env_id or policy.spec.get("env_id")
    if not env_id:
        raise ValidationError("env", "the policy names no environment (trained without a simulator); pass --env")
    max_episode_steps = max_episode_steps or (policy.spec.get("extra") or {}).get("max_episode_steps")
    kwargs = {} if max_episode_steps is None else {"max_episode_steps": int(max_episode_steps)}
    env = make_vec(field, env_id, num_envs=min(num_envs, episodes), vectorization_mode="sync", **kwargs)
    try:
        observation_dim = int(env.single_observation_space.shape[0])
        if observation_dim != policy.obs_dim or int(env.single_action_space.n) != policy.n_actions:
            raise ValidationError("env", f"{env_id} has {observation_dim}-dim observations and "
                                  f"{env.single_action_space.n} actions; the policy expects {policy.obs_dim} and "
                                  f"{policy.n_actions}")
        stats = evaluate_returns(policy.act, env, episodes, seed, progress=progress)
    finally:
        env.close()
    privacy = policy.spec.get("privacy") or {}
    metrics = {**stats.to_dict(), "env_id": env_id, "seed": seed, "privacy": privacy}
    out = Path(out) if out is not None else Path(policy_dir).resolve().parent / "evaluations"
    atomic_write_json(out / f"eval_seed{seed}_episodes{episodes}.json", {**metrics, "returns": stats.returns})
    metrics["headline"] = {f"return ({stats.n} episodes, {100 * stats.confidence:g}% interval)":
                           f"{stats.mean:.4g} [{stats.ci_low:.4g}, {stats.ci_high:.4g}]"}
    return metrics

