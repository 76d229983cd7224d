"""Expert generation: candidates per physics setting, keep the best k on that setting, stack the survivors.

The paper's protocol (Sharma et al. 2024, Section 6): for each of 1000 physics settings (10 values
of 3 parameters) train PPO experts and keep the best 3 on that setting: 3000 experts. Here:

- ``family="ppo"``: ``candidates_per_setting`` PPO actors per setting, scored by their greedy return over
  ``eval_episodes`` episodes ON THAT SETTING; the best ``keep_best`` survive. Candidates train as one batched model
  (``dporl.experts.batched_ppo``) in chunks of ``batch_experts`` (memory; the experts do not depend on it), in-process
  by default or one Ray task per chunk (``ray.enabled``: ``ray.init()`` locally, ``ray.address`` to join a cluster,
  for when one machine is outgrown). Box2D (LunarLander) sub-envs step in ``env_workers`` processes. Every
  candidate's seed is derived from ``(seed, setting index, candidate index)`` and batched training equals
  per-expert training (``dporl.experts.ppo.train_ppo``, one process per expert, kept as the reference and the
  benchmark's baseline), so every path gives the same experts.
- ``family="analytic"``: the cheap stand-ins of ``dporl.experts.analytic`` (LQR, energy pumping, the lander
  heuristic with varied gains, a switching rule), selected the same way.

Settings come from ``dporl.envs.variants.physics_grid`` (``points_per_axis`` values per parameter over the paper's
ranges), optionally subsampled to ``n_settings`` with the seed. Experts are ordered setting-major, best first.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

import numpy as np
import torch
from tqdm.auto import tqdm

from dporl.envs.registry import check_env_id
from dporl.envs.variants import physics_grid
from dporl.experts.analytic import analytic_experts
from dporl.experts.batched_ppo import train_ppo_batched
from dporl.experts.collect import evaluate_policies
from dporl.experts.policies import StackedMLPPolicy, StackedPolicy
from dporl.experts.ppo import PPOConfig
from dporl.utils.config import to_dict
from dporl.utils.validation import ValidationError


@dataclass
class RayConfig:
    enabled: bool = False
    address: Optional[str] = None  # None: start a local Ray instance; "auto" or "ray://host:10001" joins a cluster
    num_cpus: Optional[int] = None  # cap for a local instance (ignored when joining a cluster)


@dataclass
class GenerationConfig:
    env_id: str = "CartPole-v1"
    family: Literal["analytic", "ppo"] = "analytic"
    points_per_axis: Optional[int] = None  # grid values per physics parameter; None: the paper's grid
    n_settings: Optional[int] = None  # draw this many settings from the grid (seeded); None: all of them
    candidates_per_setting: int = 3
    keep_best: int = 3
    eval_episodes: int = 5  # greedy episodes per candidate on its own setting, to rank candidates
    max_episode_steps: int = 200
    env_kwargs: dict[str, Any] = field(default_factory=dict)  # other make arguments, e.g. HIV treatment_interval
    seed: int = 0
    logit_scale: float = 1.0  # analytic family: logit = logit_scale * control signal (matters only without argmax)
    ppo: PPOConfig = field(default_factory=PPOConfig)
    batch_experts: int = 1000  # PPO candidates trained together as one batched model (bounds memory only)
    env_workers: int = 1  # > 1: sub-envs step in this many processes (Box2D LunarLander; numpy envs need none)
    device: str = "cpu"  # where the batched PPO model trains ("cuda" if available); envs stay on the CPU
    # torch threads of a batched PPO chunk. 1 by default: on a shared machine threads that wait for each other at every
    # matmul lose to one thread (measured 6x slower at load 12 on 2 cores); raise it on an idle many-core host.
    torch_threads: int = 1
    ray: RayConfig = field(default_factory=RayConfig)

    def __post_init__(self) -> None:
        check_env_id("experts.env_id", self.env_id)  # named before minutes of generation, and never a module
        for name in ("candidates_per_setting", "keep_best", "eval_episodes", "max_episode_steps", "batch_experts",
                     "env_workers", "torch_threads"):
            if getattr(self, name) < 1:
                raise ValidationError(f"experts.{name}", f"must be >= 1, got {getattr(self, name)}")
        if self.keep_best > self.candidates_per_setting:
            raise ValidationError("experts.keep_best", f"cannot keep {self.keep_best} of "
                                  f"{self.candidates_per_setting} candidates per setting")
        if self.n_settings is not None and self.n_settings < 1:
            raise ValidationError("experts.n_settings", f"must be >= 1 or null, got {self.n_settings}")
        if self.points_per_axis is not None and self.points_per_axis < 1:
            raise ValidationError("experts.points_per_axis", f"must be >= 1 or null, got {self.points_per_axis}")
        if not (self.device == "cpu" or self.device.startswith("cuda")):
            raise ValidationError("experts.device", f"must be 'cpu' or 'cuda[:index]', got {self.device!r}")
        if self.device.startswith("cuda") and not torch.cuda.is_available():
            raise ValidationError("experts.device", "CUDA is not available on this machine")
        if self.ray.num_cpus is not None and self.ray.num_cpus < 1:
            raise ValidationError("experts.ray.num_cpus", f"must be >= 1 or null, got {self.ray.num_cpus}")


@dataclass
class GeneratedExperts:
    policy: StackedPolicy  # survivors, setting-major, best first
    settings: list[dict]  # the physics settings used
    setting_index: np.ndarray  # [m] setting of each survivor
    eval_returns: np.ndarray  # [m] its greedy return on its setting
    candidate_returns: np.ndarray  # [n_settings, candidates_per_setting] every candidate's return
    # PPO: [n_settings, candidates_per_setting] mean return of each candidate's last training episodes (nan: none)
    candidate_train_returns: Optional[np.ndarray] = None

    def info(self, config: GenerationConfig) -> dict[str, Any]:
        """JSON-safe provenance for ``ExpertSet.info`` (per-expert lists are kept aligned by ``ExpertSet.select``)."""
        return {
            "source": f"dporl.experts.generate ({config.family})",
            "generation": to_dict(config),
            "settings": self.settings,
            "candidate_return_mean": float(self.candidate_returns.mean()),
            "candidate_returns": return_summary(self.candidate_returns),
            "per_expert": {
                "setting_index": self.setting_index.tolist(),
                "eval_return": [float(r) for r in self.eval_returns],
            },
        }


def return_summary(values) -> dict[str, float]:
    """Mean, standard deviation and the 0/10/25/50/75/90/100 % quantiles of returns (JSON-safe): the spread of the
    experts' quality."""
    values = np.asarray(values, dtype=np.float64).reshape(-1)
    quantiles = dict(zip(("min", "q10", "q25", "median", "q75", "q90", "max"),
                         np.percentile(values, [0, 10, 25, 50, 75, 90, 100]).tolist()))
    return {"mean": float(values.mean()), "std": float(values.std()), **quantiles}


def physics_settings(config: GenerationConfig) -> list[dict]:
    """The grid of the paper's physics ranges (or a coarser one), optionally subsampled to ``n_settings``."""
    grid = list(physics_grid(config.env_id, config.points_per_axis))
    if config.n_settings is None:
        return grid
    if config.n_settings > len(grid):
        raise ValidationError("experts.n_settings", f"the grid has only {len(grid)} settings, asked for "
                              f"{config.n_settings}")
    chosen = np.sort(np.random.default_rng(config.seed).choice(len(grid), config.n_settings, replace=False))
    return [grid[i] for i in chosen]


def generate_experts(config: GenerationConfig, settings: list[dict] | None = None,
                     progress: bool = True) -> GeneratedExperts:
    """Candidates per setting, best ``keep_best`` kept; ``settings`` overrides the grid ({} = default physics)."""
    settings = physics_settings(config) if settings is None else [dict(s) for s in settings]
    if not settings:
        raise ValidationError("settings", "need at least one physics setting")
    if config.family == "analytic":
        return _generate_analytic(config, settings, progress)
    return _generate_ppo(config, settings, progress)


def _keep_best(returns: np.ndarray, keep: int) -> np.ndarray:
    """[S, c] returns -> flat candidate indices [S * keep] of each setting's best ``keep`` (stable order on ties)."""
    order = np.argsort(-returns, axis=1, kind="stable")[:, :keep]
    return (order + np.arange(returns.shape[0])[:, None] * returns.shape[1]).reshape(-1)


def _generate_analytic(config: GenerationConfig, settings: list[dict], progress: bool) -> GeneratedExperts:
    candidates, _ = analytic_experts(config.env_id, settings, config.candidates_per_setting, config.seed,
                                     config.logit_scale)
    return _select_best(config, settings, candidates, progress)


def _select_best(config: GenerationConfig, settings: list[dict], candidates: StackedPolicy,
                 progress: bool) -> GeneratedExperts:
    """Score every candidate greedily on its own setting; keep each setting's best ``keep_best`` (best first)."""
    per_candidate = [s for s in settings for _ in range(config.candidates_per_setting)]
    returns = evaluate_policies(candidates, config.env_id, per_candidate, config.eval_episodes,
                                config.max_episode_steps, config.seed, env_kwargs=config.env_kwargs,
                                workers=config.env_workers, progress=progress)
    returns = returns.reshape(len(settings), config.candidates_per_setting)
    keep = _keep_best(returns, config.keep_best)
    return GeneratedExperts(
        policy=candidates.select(torch.as_tensor(keep)),
        settings=settings,
        setting_index=keep // config.candidates_per_setting,
        eval_returns=returns.reshape(-1)[keep],
        candidate_returns=returns,
    )


def candidate_seeds(config: GenerationConfig, n_settings: int) -> list[int]:
    """Seed of candidate c of setting s at position s * candidates_per_setting + c: from (seed, s, c) only."""
    return [int(np.random.SeedSequence([config.seed, s, c]).generate_state(1)[0])
            for s in range(n_settings) for c in range(config.candidates_per_setting)]


def train_chunk(config: GenerationConfig, settings: list[dict], seeds: list[int], progress: bool = False) -> dict:
    """One unit of work: train candidates ``seeds`` on ``settings`` (one each) as one batched model.

    A plain function (no closures) so Ray can ship it; returns plain tensors and arrays. Batched training gives every
    candidate what it would get alone (``dporl.experts.batched_ppo``), so chunking and placement do not change
    the experts.
    """
    threads = torch.get_num_threads()
    torch.set_num_threads(config.torch_threads)
    try:
        result = train_ppo_batched(config.env_id, settings, config.ppo, seeds,
                                   max_episode_steps=config.max_episode_steps, env_kwargs=config.env_kwargs,
                                   device=config.device, env_workers=config.env_workers, progress=progress)
    finally:
        torch.set_num_threads(threads)
    return {"config": result.actor.config(), "state_dict": result.actor.state_dict(),
            "train_returns": result.recent_returns}


def _generate_ppo(config: GenerationConfig, settings: list[dict], progress: bool) -> GeneratedExperts:
    per_candidate = [s for s in settings for _ in range(config.candidates_per_setting)]
    seeds = candidate_seeds(config, len(settings))
    chunks = [slice(start, min(start + config.batch_experts, len(seeds)))
              for start in range(0, len(seeds), config.batch_experts)]
    results: list[dict[str, Any] | None] = [None] * len(chunks)
    bar = tqdm(total=len(seeds), desc=f"PPO candidates ({config.env_id}, batched)", unit="expert",
               disable=not progress)
    with bar:
        if config.ray.enabled:
            for index, result in _run_on_ray(config, [(per_candidate[c], seeds[c]) for c in chunks]):
                results[index] = result
                bar.update(chunks[index].stop - chunks[index].start)
        else:
            for index, chunk in enumerate(chunks):
                results[index] = train_chunk(config, per_candidate[chunk], seeds[chunk], progress=progress)
                bar.update(chunk.stop - chunk.start)
    policies = []
    for result in results:
        policy = StackedMLPPolicy(**result["config"])
        policy.load_state_dict(result["state_dict"])
        policies.append(policy)
    generated = _select_best(config, settings, StackedMLPPolicy.concatenate(policies), progress)
    generated.candidate_train_returns = np.concatenate([r["train_returns"] for r in results]).reshape(
        len(settings), config.candidates_per_setting)
    return generated


def _run_on_ray(config: GenerationConfig, chunks: list[tuple[list[dict], list[int]]]):
    """Yield (chunk index, result) as Ray tasks finish (one task and one CPU per chunk of candidates)."""
    try:
        import ray
    except ImportError:
        raise ValidationError("experts.ray.enabled", "Ray is not installed: pip install 'dporl[ray]'") from None
    started_here = not ray.is_initialized()
    if started_here:
        if config.ray.address is None:
            ray.init(num_cpus=config.ray.num_cpus, include_dashboard=False, logging_level="WARNING")
        else:
            ray.init(address=config.ray.address, logging_level="WARNING")
    try:
        task = ray.remote(num_cpus=max(config.torch_threads, config.env_workers))(train_chunk)
        config_ref = ray.put(config)
        pending = {task.remote(config_ref, chunk_settings, chunk_seeds): i
                   for i, (chunk_settings, chunk_seeds) in enumerate(chunks)}
        while pending:
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                yield pending.pop(ref), ray.get(ref)
    finally:
        if started_here:
            ray.shutdown()
