"""What a "train" run releases at its end: the greedy policy (``release/policy/``), the privacy report, the final
privacy scalars, the public summary with its headline, and the lines it prints. Everything here is a function of
released values and public inputs: never a count of the private logged data."""

from __future__ import annotations

import math
from typing import Any, Optional

import gymnasium as gym
import numpy as np

from dporl.algos.base import PrivateAlgorithm
from dporl.logging import RunLogger
from dporl.methods.unit_level import TRAIN_STAGE
from dporl.pipelines.train.config import PIPELINE_NAME, TrainPipelineConfig
from dporl.pipelines.unit_count import with_released_count
from dporl.privacy.accountants import paper_mixture_epsilon
from dporl.privacy.count import ReleasedCount
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.samplers import MixtureSource
from dporl.train.export import save_policy
from dporl.train.run_dir import RunDirectory
from dporl.train.trainer import TrainResult
from dporl.utils.config import to_dict
from dporl.utils.io import atomic_write_json

PAPER_MIXTURE_CLAIM = "Algorithm 3's training stage accounted at rate p_dp * q"


def record_paper_figure(config: TrainPipelineConfig, source: Any, result: TrainResult, ledger: PrivacyLedger) -> None:
    """The expert-level paper's epsilon for the training stage of Algorithm 3, as a paper claim (never a guarantee)."""
    if not isinstance(source, MixtureSource) or result.budget_steps == 0:
        return
    eps2, delta2 = config.stage_budgets()[TRAIN_STAGE]
    epsilon = paper_mixture_epsilon(source.private_probability, source.private_source.sample_rate,
                                    result.noise_multiplier, result.budget_steps, delta2, config.dp.accountant)
    if any(claim.name == PAPER_MIXTURE_CLAIM for claim in ledger.paper_claims):  # a resumed run recovered it
        return
    ledger.paper_claim(
        PAPER_MIXTURE_CLAIM, epsilon, delta2,
        "Sharma et al. 2024: every step as a subsampled Gaussian at rate p_dp * q; the branch a step takes is "
        "observable, so the sound analysis is the mixture (recorded in stage 'train')",
    )


def log_final_scalars(run: RunDirectory, step: int, report, offline: Optional[dict]) -> None:
    """The run's final privacy scalars (every stage, the evaluation's included) and the released policy value."""
    logger = RunLogger(run.release / "tensorboard")
    values = report.scalars()
    if offline is not None:
        values.update({"offline/value": offline["value"], "offline/ci_low": offline["ci_low"],
                       "offline/ci_high": offline["ci_high"]})
    logger.scalars(values, step)
    logger.close()


def spaces(env, meta) -> tuple[Any, Any]:
    """The policy's observation and action spaces: the simulator's, or what the data declare."""
    if env is not None:
        return env.single_observation_space, env.single_action_space
    return (gym.spaces.Box(-np.inf, np.inf, shape=meta.obs_shape, dtype=np.float32),
            gym.spaces.Discrete(meta.n_actions))


def headline(last: list[float], offline: Optional[dict]) -> dict[str, str]:
    """The few numbers a person reads first (all public: released values, the budget)."""
    lines = {}
    if last:
        lines[f"return in the simulator (mean of the last {len(last)} evaluations)"] = f"{sum(last) / len(last):.4g}"
    if offline is not None:
        lines[f"policy value (DP-{offline['estimator'].upper()}, {100 * offline['confidence']:g}% interval)"] = (
            f"{offline['value']:.4g} [{offline['ci_low']:.4g}, {offline['ci_high']:.4g}]"
            + ("" if offline.get("calibrated", True) else " (interval NOT calibrated: see the evaluation's notes)")
        )
    return lines


def release_outputs(config: TrainPipelineConfig, run: RunDirectory, ledger: PrivacyLedger, algorithm: PrivateAlgorithm,
                    result: TrainResult, *, env, meta, env_id: Optional[str], plan, offline: Optional[dict],
                    released_count: Optional[ReleasedCount], release_public: Optional[dict],
                    stable_transitions: Optional[int]) -> dict:
    """Write the run's released files and summaries, print its end lines; the public summary."""
    report = ledger.report()
    privacy = with_released_count(report.to_dict(), released_count)
    atomic_write_json(run.release / "privacy_report.json", privacy)  # every stage, the evaluation's included
    log_final_scalars(run, result.steps, report, offline)
    returns = [metrics["eval/return_mean"] for _, metrics in result.eval_history if "eval/return_mean" in metrics]
    last = returns[-config.eval.last_evals:]
    observation_space, action_space = spaces(env, meta)
    save_policy(
        algorithm, run.policy_dir, env_id=env_id, observation_space=observation_space, action_space=action_space,
        privacy={"guarantee": privacy["guarantee"], "void": privacy["void"], "text": privacy["text"]},
        extra={"pipeline": PIPELINE_NAME, "algorithm": config.algorithm.name, "method": config.method,
               "max_episode_steps": config.eval.max_episode_steps,
               **({"offline_evaluation": offline} if offline is not None else {})},
        action_labels=meta.action_labels,  # declared (public), like the action count
    )
    evaluation = ({"mode": "simulator", "env_id": env_id} if env is not None else
                  {"mode": "offline", "composition": plan.composition, **offline} if offline is not None else
                  {"mode": "none"})
    public = {
        "pipeline": PIPELINE_NAME,
        "algorithm": config.algorithm.name,
        "method": config.method,
        "budget": {"epsilon": config.epsilon, "delta": config.delta},
        "env_id": env_id,
        "steps": result.steps,
        "noise_multiplier": result.noise_multiplier,
        "final_metrics": result.public_metrics,
        "return_mean_last_evals": sum(last) / len(last) if last else math.nan,
        "evaluation": evaluation,
        "release": release_public,
        "unit_count": None if released_count is None else released_count.to_dict(),
        "stable_transitions": stable_transitions,
        "privacy": privacy,
        "policy": "policy/",
        "headline": headline(last, offline),
    }
    run.write_summaries(public, {**public, "run_dir": str(run.root), "config": to_dict(config), "inputs": run.inputs,
                                 "final_metrics_all": result.metrics})
    if report.stages or report.void is not None:
        print(report.describe())
    else:
        print(f"NO PRIVACY GUARANTEE: non-private baseline (method {config.method})")
    print(f"release (safe to share): {run.release}; curator-only (never share): {run.curator}")
    return public
