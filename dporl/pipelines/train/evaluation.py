"""Where a "train" run's policy is evaluated: returns in the public simulator (post-processing: no privacy cost), or,
without one, privately on logged data (``dporl.pipelines.offline_eval``): by default one keyed-hash partition of
the units holds some out, training runs on the rest, and the learned policy's value is released by DP importance
sampling (or DP-FQE without propensities) on the held-out units, in the same ledger, composed in parallel."""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Optional

from dporl.algos.base import PrivateAlgorithm
from dporl.data.dataset import TrajectoryDataset
from dporl.envs.registry import check_env_id, is_registered, make_vec
from dporl.eval.returns import evaluate_returns
from dporl.methods.unit_level import TRAIN_STAGE
from dporl.pipelines.offline_eval import EvaluationPlan, check_cells, evaluate_offline, plan_evaluation
from dporl.pipelines.offline_eval import stage_names as evaluation_stages
from dporl.pipelines.train.config import EvalConfig, TrainPipelineConfig
from dporl.privacy.count import Units
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.randomness import SecretRoot
from dporl.train.run_dir import RunDirectory
from dporl.utils.validation import PrivacyBudgetError, ValidationError


def simulator_id(config: EvalConfig, dataset_env_id: str) -> Optional[str]:
    """The environment a run evaluates its policy in, or None: evaluation in a simulator is off, or there is none.

    ``eval.env_id`` must name a registered Gymnasium environment (an error otherwise); the dataset's env id is used
    when it is one (an imported table's usually is not: then there is no simulator). Either id is refused if it
    names a module to import (``dporl.envs.registry``)."""
    if not config.enabled or not config.simulator:
        return None
    if config.env_id:
        return check_env_id("eval.env_id", config.env_id)
    return dataset_env_id if is_registered("dataset.metadata.env_id", dataset_env_id) else None


def make_eval_env(config: EvalConfig, env_id: str):
    kwargs = {} if config.max_episode_steps is None else {"max_episode_steps": config.max_episode_steps}
    field = "eval.env_id" if config.env_id else "dataset.metadata.env_id"
    return make_vec(field, env_id, num_envs=config.num_envs, vectorization_mode="sync", **kwargs)


def returns_evaluator(config: EvalConfig, env_id: str, progress: bool = False):
    """fn(module) -> return statistics of the greedy policy; one vector env reused across evaluations."""
    env = make_eval_env(config, env_id)

    def evaluate(module: PrivateAlgorithm) -> dict[str, float]:
        return evaluate_returns(module.act, env, config.episodes, config.seed, progress=progress).to_dict()

    return evaluate, env


def evaluation_plan(config: TrainPipelineConfig, dataset: TrajectoryDataset, env_id: Optional[str]):
    """The offline evaluation of a run without a simulator (None with one; the release methods evaluate only there)."""
    if not config.eval.enabled:  # evaluation off: nothing is estimated and none of the budget is planned for it
        return None
    if env_id is not None or not config.method_spec.evaluates_offline:
        return None
    gamma = config.discount()
    if gamma is None and config.eval.offline.estimator != "none":  # the value range derives from it
        raise ValidationError("eval.gamma", f"algorithm {config.algorithm.name!r} has no discount: give eval.gamma, the "
                              "discount of the policy value the offline evaluation releases")
    return plan_evaluation(config.eval.offline, dataset, config.spendable(), config.stage_budgets().get(TRAIN_STAGE),
                           gamma)


def resolved_budgets(config: TrainPipelineConfig, plan: Optional[EvaluationPlan]) -> dict[str, tuple[float, float]]:
    """Each private stage's budget once the evaluation is planned (reusing the training units for a private
    evaluation takes its budget out of training's)."""
    budgets = config.stage_budgets()
    if plan is not None and TRAIN_STAGE in budgets:
        budgets[TRAIN_STAGE] = plan.train_budget
    return budgets


def training_plan(config: TrainPipelineConfig, dataset: TrajectoryDataset):
    """(stage budgets, the data the training stage samples from, the evaluation plan) for ``config`` on
    ``dataset``, as ``run`` decides them: the "train" cell when units are held out for a private evaluation (the
    audits use this)."""
    plan = evaluation_plan(config, dataset, simulator_id(config.eval, dataset.metadata.env_id))
    parts = check_cells(plan, dataset, config.neighbours) if plan is not None else {}
    train_data = parts["train"] if plan is not None and plan.train_cells is not None else dataset
    return resolved_budgets(config, plan), train_data, plan


def announce_evaluation(config: TrainPipelineConfig, env_id: Optional[str], plan: Optional[EvaluationPlan],
                         dataset_env_id: str) -> None:
    """Say where the policy will be evaluated (public facts of the config and the environment registry only)."""
    if env_id is not None:
        print(f"evaluation: returns in the simulator {env_id!r} (post-processing: no privacy cost)")
        return
    if not config.eval.enabled:
        print("evaluation is off (eval.enabled: false); the policy is not evaluated")
        return
    why = ("simulator evaluation is off (eval.simulator: false)" if not config.eval.simulator else
           f"no simulator: {dataset_env_id!r} is not a registered Gymnasium environment")
    if plan is None or plan.estimator == "none":
        print(f"{why}; the policy is not evaluated")
        return
    offline = config.eval.offline
    where = (f"on {offline.holdout:.0%} of the units held out by a keyed hash of their ids (salt {offline.salt!r}), "
             "composed in parallel with training" if offline.held_out else
             "on the training units, composed sequentially with training")
    print(f"{why}; evaluating the learned policy privately on logged data: DP-{plan.estimator.upper()} {where}, at "
          f"(eps={plan.budget[0]:g}, delta={plan.budget[1]:g})")
    for line in plan.describe_scales():  # the declared scales and the clip's bias-variance choice (config only)
        print(line)


OFFLINE_EVALUATION = "offline_evaluation"


def evaluate_offline_once(config: TrainPipelineConfig, run: RunDirectory, root: SecretRoot, ledger: PrivacyLedger,
                          plan: EvaluationPlan, dataset: TrajectoryDataset, algorithm: PrivateAlgorithm,
                          units: Optional[Units]) -> dict[str, Any]:
    """The private evaluation of the learned policy, paid once: a resumed run reuses a completed one and refuses to
    repeat one an earlier attempt started (its releases are charged in the journal)."""
    manifest = run.completed(OFFLINE_EVALUATION)
    if manifest is not None:
        return manifest
    started = [name for name in evaluation_stages(plan) if name in ledger.stages]
    if started:
        raise PrivacyBudgetError(
            "eval.offline", f"an earlier attempt of this run started the offline evaluation (stage {started[0]!r} is "
            f"in {run.journal_path}) but did not finish it; a second evaluation would not fit its budget. Start a "
            "new run_dir (or --overwrite: the interrupted attempt's spend is then not part of the new guarantee)"
        )
    offline = replace(config.eval.offline, fqe=replace(config.eval.offline.fqe, progress=config.trainer.progress))
    result = evaluate_offline(plan, offline, dataset, algorithm, gamma=config.discount(), ledger=ledger, root=root,
                              work_dir=run.curator / "offline_evaluation", units=units)
    manifest = {**result.to_dict(), "estimator": plan.estimator}
    run.complete(OFFLINE_EVALUATION, manifest)
    print(f"offline evaluation: {result.describe()}")
    return manifest
