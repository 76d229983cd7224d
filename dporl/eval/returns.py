"""Episodic returns of a policy in a (vector) environment, with t-based confidence intervals.

Evaluation touches only the released model and the public environment, so it is post-processing: it costs no
privacy budget.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

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


def evaluate_returns(policy: Policy, vector_env, episodes: int, seed: int, confidence: float = 0.95) -> ReturnStats:
    """Run exactly ``ceil(episodes / num_envs)`` episodes in every sub-env and keep the first ``episodes``.

    A fixed quota per sub-env, rather than "the first N episodes to finish", avoids biasing the mean towards
    short episodes.
    """
    if episodes < 1:
        raise ValidationError("episodes", f"must be >= 1, got {episodes}")
    n_envs = vector_env.num_envs
    quota = math.ceil(episodes / n_envs)
    next_step_reset = vector_env.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP) == AutoresetMode.NEXT_STEP
    obs, _ = vector_env.reset(seed=seed)
    running = np.zeros(n_envs)
    finished: list[list[float]] = [[] for _ in range(n_envs)]
    resetting = np.zeros(n_envs, dtype=bool)
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
            running[i] = 0.0
        # In next-step mode the step after an episode's end only resets that sub-env.
        resetting = done if next_step_reset else np.zeros(n_envs, dtype=bool)
    returns = [r for per_env in zip(*finished) for r in per_env][:episodes]
    return confidence_interval(returns, confidence)
