"""Pipeline ``dataset``: generate (or load) an expert set, log its trajectories in the default env, save both.

Outputs under ``out_dir``: ``experts.pt`` (ExpertSet, atomic), ``dataset.npz`` (TrajectoryDataset, atomic),
``summary.json`` and ``expert_returns.png`` (each expert's greedy return on its own physics setting and its mean
logged return in the default env, sorted). Nothing here is released: this is the data curator's side, producing
the logged data that the private learners consume, so ``out_dir`` is a curator-only run directory
(``dporl.train.run_dir``, with its ``provenance.json``): an existing one is refused (mode "new"), reused when it
holds this very generation (mode "resume"; the train pipeline's ``data.generate`` uses this), or replaced ("overwrite").
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import numpy as np

from dporl.envs.process_env import make_vector_env
from dporl.experts.collect import collect
from dporl.experts.expert_set import ExpertSet, check_p_min
from dporl.experts.generate import GenerationConfig, generate_experts, return_summary
from dporl.logging import plot_lines
from dporl.pipelines import Pipeline, curator_note
from dporl.pipelines.inputs import check_inputs_outside
from dporl.train.run_dir import RunDirectory, RunMode
from dporl.utils.config import to_dict
from dporl.utils.validation import ValidationError, check_positive


@dataclass
class DatasetConfig:
    pipeline: str = "dataset"
    out_dir: str = "runs/dataset"
    experts: GenerationConfig = field(default_factory=GenerationConfig)
    expert_set_path: Optional[str] = None  # log with a saved ExpertSet instead of generating one
    p_min: float = 0.1  # the argmax softening: best action 1 - (n_A - 1) p_min, every other action p_min
    softening: Literal["argmax", "none"] = "argmax"
    trajectories_per_expert: int = 20  # the paper: 20
    max_episode_steps: int = 200  # the paper: 200 for CartPole and Acrobot
    seed: int = 0  # logging seed (env resets and action sampling)
    experts_per_chunk: int = 1000  # experts whose trajectories advance together (bounds memory)
    progress: bool = True

    def __post_init__(self) -> None:
        if self.pipeline != "dataset":
            raise ValidationError("pipeline", f"expected 'dataset', got {self.pipeline!r}")
        check_positive("p_min", self.p_min)
        for name in ("trajectories_per_expert", "max_episode_steps", "experts_per_chunk"):
            if getattr(self, name) < 1:
                raise ValidationError(name, f"must be >= 1, got {getattr(self, name)}")


def run(config: DatasetConfig, mode: RunMode = "new") -> dict[str, Any]:
    out_dir = Path(config.out_dir)
    with RunDirectory(out_dir, pipeline="dataset", config=to_dict(config), mode=mode, curator_only=True) as run_dir:
        check_inputs_outside(run_dir, {"expert_set_path": config.expert_set_path})  # --overwrite keeps the user's input
        return _generate(config, run_dir, out_dir)


def _generate(config: DatasetConfig, run_dir: RunDirectory, out_dir: Path) -> dict[str, Any]:
    if run_dir.finished:  # this very generation is already on disk
        return run_dir.read_summary()
    # Refuse an impossible p_min before spending minutes to hours on experts.
    check_p_min(config.p_min, _action_count(config.experts.env_id, config.experts.env_kwargs), config.softening)
    loaded = ExpertSet.load(config.expert_set_path) if config.expert_set_path is not None else None  # before writing
    run_dir.begin()
    timings: dict[str, float] = {}
    load = {"start": os.getloadavg()[0]}  # the machine may be shared: say how loaded it was
    start, cpu = time.perf_counter(), time.process_time()
    if config.expert_set_path is None:
        generated = generate_experts(config.experts, progress=config.progress)
        expert_set = ExpertSet(generated.policy, config.p_min, config.softening, generated.info(config.experts))
    else:
        expert_set = ExpertSet(loaded.policy, config.p_min, config.softening, loaded.info)
    timings["experts_s"] = time.perf_counter() - start
    timings["experts_cpu_s"] = time.process_time() - cpu  # this process, all threads (env workers not included)
    load["after_experts"] = os.getloadavg()[0]
    expert_set.save(out_dir / "experts.pt")

    start, cpu = time.perf_counter(), time.process_time()
    dataset = collect(
        expert_set,
        config.experts.env_id,
        config.trajectories_per_expert,
        config.max_episode_steps,
        config.seed,
        env_kwargs=config.experts.env_kwargs,
        experts_per_chunk=config.experts_per_chunk,
        workers=config.experts.env_workers,
        progress=config.progress,
        extra={"pipeline_config": to_dict(config)},
    )
    timings["logging_s"] = time.perf_counter() - start
    timings["logging_cpu_s"] = time.process_time() - cpu
    load["end"] = os.getloadavg()[0]
    dataset.save(out_dir / "dataset.npz")

    logged = _per_expert_mean_return(dataset)
    eval_returns = expert_set.info.get("per_expert", {}).get("eval_return")
    candidates = expert_set.info.get("candidate_returns")
    summary = {
        "out_dir": str(out_dir),
        "expert_set": str(out_dir / "experts.pt"),
        "dataset": str(out_dir / "dataset.npz"),
        "n_experts": expert_set.n_experts,
        "expert_family": expert_set.info.get("source"),
        "expert_eval_return_on_own_setting": return_summary(eval_returns) if eval_returns else None,
        "candidate_eval_return_on_own_setting": candidates,
        "expert_logged_return_default_env": return_summary(logged),
        "dataset_summary": dataset.summary(),
        "timings_s": {k: round(v, 2) for k, v in timings.items()},
        "load_average_1min": {k: round(v, 2) for k, v in load.items()},
        "cpu_count": os.cpu_count(),
    }
    series = {"mean logged return (softened, default env)": (list(range(len(logged))), sorted(logged), None)}
    if eval_returns:
        series["greedy return on own setting"] = (list(range(len(eval_returns))), sorted(eval_returns), None)
    plot_lines(out_dir / "expert_returns.png", series, xlabel="expert (sorted)", ylabel="episodic return",
               title=f"{expert_set.n_experts} experts, {config.experts.env_id}")
    run_dir.write_summaries(None, summary)  # written last: marks the generation complete
    # The logged data are the private input of every private pipeline: this line describes them to their curator,
    # on stderr (a private run that generates its data first prints its guarantee on stdout).
    curator_note(f"the logged data themselves: dataset: {dataset.n_episodes} episodes / {dataset.n_transitions} "
                 f"transitions from {expert_set.n_experts} experts (p_min={expert_set.p_min}, {config.softening}) in "
                 f"{timings['experts_s']:.1f}s + {timings['logging_s']:.1f}s; mean logged return "
                 f"{float(np.mean(logged)):.1f}; saved under {out_dir}")
    return summary


def _action_count(env_id: str, env_kwargs: dict) -> int:
    env = make_vector_env(env_id, 1, 1, env_kwargs=env_kwargs)
    try:
        return int(env.single_action_space.n)
    finally:
        env.close()


def _per_expert_mean_return(dataset) -> list[float]:
    totals = np.bincount(dataset.unit_ids, weights=dataset.episode_returns(), minlength=dataset.metadata.n_units)
    counts = np.bincount(dataset.unit_ids, minlength=dataset.metadata.n_units)
    return (totals / np.maximum(counts, 1)).tolist()


PIPELINE = Pipeline("dataset", DatasetConfig, run)
