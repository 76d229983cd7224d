"""One "train" run: its inputs read and checked (``run``), then its stages in order (``train_policy``): the private
count of the units, the stable-prefix release, the training stage through the Trainer, the private offline
evaluation, and what it releases (``dporl.pipelines.train.report``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

from dporl.algos.base import PrivateAlgorithm
from dporl.algos.stable_prefix import RELEASE_STAGE
from dporl.data.dataset import DatasetMetadata, TrajectoryDataset
from dporl.experts.expert_set import ExpertSet
from dporl.methods.unit_level import TRAIN_STAGE
from dporl.pipelines.inputs import check_inputs_outside, data_inputs, import_dataset, save_imported
from dporl.pipelines.offline_eval import EvaluationPlan
from dporl.pipelines.train.config import PIPELINE_NAME, Budget, TrainPipelineConfig
from dporl.pipelines.train.data import check_generation, load_data
from dporl.pipelines.train.evaluation import (
    announce_evaluation,
    evaluate_offline_once,
    evaluation_plan,
    resolved_budgets,
    returns_evaluator,
    simulator_id,
)
from dporl.pipelines.train.planning import Checked, after_count, preflight, train_dp_config
from dporl.pipelines.train.release import check_no_orphan_release, check_recorded, run_release
from dporl.pipelines.train.report import record_paper_figure, release_outputs
from dporl.pipelines.unit_count import count_once, describe_count
from dporl.privacy.count import ReleasedCount, Units
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.randomness import SecretRoot
from dporl.privacy.relations import CONVERSION, analysed_for
from dporl.privacy.units import dataset_unit
from dporl.train import interrupt
from dporl.train.run_dir import RunDirectory, RunMode
from dporl.train.trainer import Trainer
from dporl.utils.config import to_dict
from dporl.utils.device import resolve_device
from dporl.utils.seeding import seeded
from dporl.utils.validation import ValidationError


@dataclass
class ResolvedRun:
    """Everything a run decided before its first spend: the config, its run directory and secret root, the ledger,
    each stage's budget, the checks' outcome, the data (and experts), the algorithm built for them, the simulator's
    evaluator and environment (None without one) and the offline evaluation's plan (None without one)."""

    config: TrainPipelineConfig
    run: RunDirectory
    root: SecretRoot
    ledger: PrivacyLedger
    budgets: dict[str, Budget]
    checked: Checked
    dataset: TrajectoryDataset
    experts: Optional[ExpertSet]
    algorithm: PrivateAlgorithm
    evaluate: Optional[Callable[[PrivateAlgorithm], dict]]
    env: Any
    plan: Optional[EvaluationPlan]

    @property
    def meta(self) -> DatasetMetadata:
        return self.dataset.metadata


@dataclass
class Spent:
    """What the stages before training released: the units every count-dependent quantity uses, the calibrated
    noise, the released count, D_stable and the release's public summary."""

    units: Optional[Units]
    sigma: Optional[float]
    released_count: Optional[ReleasedCount] = None
    stable: Optional[TrajectoryDataset] = None
    release_public: Optional[dict] = None


def run(config: TrainPipelineConfig, mode: RunMode = "new", dataset: Optional[TrajectoryDataset] = None) -> dict:
    """One "train" run in ``config.run_dir`` (``mode``: see ``dporl.train.run_dir``); returns the public summary.

    ``dataset``: a dataset handed over in Python (``data.format: memory``; the Python API's path).
    The run directory is locked first (one process per run directory). Every check (config hash, input hashes,
    data, evaluation, network sizes, budgets) happens before the run begins; data generated into the run directory
    are its only earlier writes, removed again if the run is refused. A finished run with the same provenance is
    read back, not repeated.
    """
    device = resolve_device(config.trainer.device, "trainer.device")  # a named error before any write
    if (dataset is not None) != (config.data.format == "memory"):
        raise ValidationError("data.format", "format 'memory' is for a dataset handed over in Python "
                              "(run(config, dataset=...)), and only it takes one")
    if config.eval.enabled and config.eval.env_id is not None:
        simulator_id(config.eval, config.eval.env_id)  # a config-only refusal, before the run directory is touched
    with RunDirectory(config.run_dir, pipeline=PIPELINE_NAME, config=to_dict(config), mode=mode) as run_dir:
        check_inputs_outside(run_dir, data_inputs(config.data))  # --overwrite never deletes the user's inputs
        dataset, experts, frame = _inputs(config, run_dir, device, dataset)
        if run_dir.finished:
            return run_dir.read_summary()
        return _resolve_and_train(config, run_dir, dataset, experts, frame)


def _inputs(config: TrainPipelineConfig, run: RunDirectory, device, dataset: Optional[TrajectoryDataset]):
    """(dataset, expert set or None, the imported frame or None), their hashes checked against the run's."""
    experts, frame = None, None
    if config.data.format == "npz":
        if config.data.generate is not None:
            replaced = run.root if run.mode == "overwrite" and run.existing else None
            check_generation(config.data.generate, run.curator / "data", replaced)  # named errors before any write
            run.prepare()  # generated data live in RUN/curator/data unless the config says otherwise
        # Methods without the release need neither the expert set nor a simulator: they never look for them.
        dataset, experts = load_data(config.data, run.curator / "data", need_experts=config.method_spec.release)
        if experts is not None and config.data.generate is None and config.data.expert_set is None:
            check_inputs_outside(run, {"dataset.metadata.expert_set.path": experts.path})
        if experts is not None:  # the release evaluates the experts where the trainer runs (trainer.device)
            experts.to(device)
    elif dataset is None:
        dataset, frame = import_dataset(config.data, progress=config.trainer.progress)
    if len(dataset.metadata.obs_shape) != 1:
        raise ValidationError("dataset.metadata.obs_shape",
                              f"{config.algorithm.name} needs flat observations, got {dataset.metadata.obs_shape}")
    # The content hash covers the metadata too: the unit column and every unit's key.
    run.check_inputs(dataset=dataset.fingerprint(), **({"expert_set": experts.fingerprint()} if experts else {}))
    return dataset, experts, frame


def _resolve_and_train(config: TrainPipelineConfig, run: RunDirectory, dataset: TrajectoryDataset,
                       experts: Optional[ExpertSet], frame) -> dict:
    meta = dataset.metadata
    env_id = simulator_id(config.eval, meta.env_id)
    plan = evaluation_plan(config, dataset, env_id)
    budgets = resolved_budgets(config, plan)
    checked = preflight(config, dataset, experts, budgets, plan)
    with seeded(config.trainer.seed):  # public initialisation: the same weights whatever ran before
        algorithm = config.algorithm.build(meta.obs_shape[0], meta.n_actions, dataset_unit(dataset))
    evaluate, env = (returns_evaluator(config.eval, env_id, config.trainer.progress) if env_id is not None else
                     (None, None))
    if env is not None and getattr(env.single_action_space, "n", meta.n_actions) != meta.n_actions:
        env.close()  # both are public declarations: refused before anything is written
        raise ValidationError("dataset.metadata.n_actions", f"the data declare {meta.n_actions} actions, the "
                              f"simulator {env_id!r} has {env.single_action_space}")
    announce_evaluation(config, env_id, plan, meta.env_id)
    try:
        run.begin()
        if config.data.imported:
            save_imported(dataset, run.curator / "data", frame)  # curator-only copy of what was imported
        ledger = run.ledger((config.epsilon, config.delta) if budgets else None, config.neighbours)
        resolved = ResolvedRun(config, run, SecretRoot(config.noise_seed), ledger, budgets, checked, dataset,
                               experts, algorithm, evaluate, env, plan)
        return train_policy(resolved)
    finally:
        if env is not None:
            env.close()


def train_policy(r: ResolvedRun) -> dict:
    """The run's stages in order, then what it releases (``report.release_outputs``); the public summary."""
    if r.plan is not None and r.plan.partition is not None:
        r.ledger.partition(r.plan.partition)  # the run's one split of the units (a keyed hash of their ids)
    if RELEASE_STAGE in r.budgets:
        check_no_orphan_release(r.run, r.ledger)  # before the count: a refused resume spends nothing
    spent = _count_stage(r)
    if RELEASE_STAGE in r.budgets:
        _release_stage(r, spent)
    source, result = _training_stage(r, spent)
    record_paper_figure(r.config, source, result, r.ledger)
    offline = _offline_evaluation(r, spent)
    env_id = None if r.env is None else (r.config.eval.env_id or r.meta.env_id)
    return release_outputs(r.config, r.run, r.ledger, r.algorithm, result, env=r.env, meta=r.meta, env_id=env_id,
                           plan=r.plan, offline=offline, released_count=spent.released_count,
                           release_public=spent.release_public,
                           stable_transitions=None if spent.stable is None else int(spent.stable.n_transitions))


def _count_stage(r: ResolvedRun) -> Spent:
    """The first spend under add/remove: the private count, and everything count-dependent derived from it (under
    replace-one the preflight derived it from the public count)."""
    count = r.config.count_plan(r.plan)
    if count is None:
        return Spent(r.checked.units, r.checked.sigma)
    partition = None if r.plan is None else r.plan.partition
    released = count_once(r.run, r.ledger, r.root, count, r.dataset, partition)
    print(describe_count(released))
    units = released.units()
    return Spent(units, after_count(r.config, r.budgets, r.checked, units, r.plan), released)


def _release_stage(r: ResolvedRun, spent: Spent) -> None:
    with interrupt.deferred_interrupts():  # a signal stops the run after the paid release is whole
        spent.stable, spent.release_public = run_release(r.dataset, r.experts, r.budgets[RELEASE_STAGE], r.config,
                                                         r.ledger, r.run, r.root, spent.units, r.checked.release)
    # Only functions of the release are printed: never a count of the private logged data.
    print(
        f"stable-prefix release ({spent.release_public.get('source', r.config.release.source)} prefixes): "
        f"{spent.stable.n_episodes} prefixes of {r.config.release.trajectories} runs, {spent.stable.n_transitions} "
        "transitions in D_stable"
    )


def _training_stage(r: ResolvedRun, spent: Spent):
    """(the batch source, the Trainer's result): the method's source over the algorithm's batch keys, its stage
    opened in the ledger (with its cells), what an earlier attempt charged checked, then the loop."""
    config = r.config
    dp = train_dp_config(config, r.budgets[TRAIN_STAGE], spent.sigma, r.plan) if TRAIN_STAGE in r.budgets else None
    if dp is not None and TRAIN_STAGE not in r.ledger.stages:  # (a resumed run recovered it from its journal)
        # Opened here for its cells (the Trainer opens the same stage otherwise and checks it matches).
        r.ledger.stage(TRAIN_STAGE, budget=r.budgets[TRAIN_STAGE], mechanism=dp.accountant,
                       unit=dataset_unit(r.dataset), cells=None if r.plan is None else r.plan.train_cells,
                       shares_run_budget=dp.share_run_budget,
                       analysis=None if config.relation == "add_remove" else CONVERSION)
    source = config.method_spec.source(
        r.checked.train_data, spent.stable, batch_size=config.batch_size, units=spent.units,
        cell=r.checked.train_cell, rows_per_unit=config.dp.rows_per_expert, p_dp=config.dp.p_dp,
        keys=config.algorithm.algorithm.batch_keys,
    )
    if dp is not None:  # what an earlier attempt charged must be what this configuration calibrates
        check_recorded(r.ledger, TRAIN_STAGE, [analysed_for(r.ledger.relation, source.step_event(dp.noise_multiplier))],
                       r.run.journal_path)
    env_id = None if r.env is None else (config.eval.env_id or r.meta.env_id)
    evaluators = {} if r.evaluate is None else {"eval": r.evaluate}
    result = Trainer(
        r.algorithm, source, config=config.trainer, dp=dp, ledger=r.ledger, run_dir=r.run, pipeline=PIPELINE_NAME,
        pipeline_config={**to_dict(config), "resolved": {"env_id": env_id}}, stage=TRAIN_STAGE,
        evaluators=evaluators,
        public_evaluators=tuple(evaluators),  # returns of the released iterate in the public simulator
        secret_root=r.root,
    ).fit()
    return source, result


def _offline_evaluation(r: ResolvedRun, spent: Spent) -> Optional[dict]:
    """The private evaluation of the learned policy on logged data, when the run plans one."""
    if r.plan is None or r.plan.estimator == "none":
        return None
    if not r.config.method_spec.private and r.ledger.void_reason is None:
        r.ledger.void(f"method {r.config.method}: the policy was trained without privacy")
    with interrupt.deferred_interrupts():  # a signal stops the run after the paid evaluation is whole
        return evaluate_offline_once(r.config, r.run, r.root, r.ledger, r.plan, r.dataset, r.algorithm, spent.units)


__all__ = ["ResolvedRun", "Spent", "run", "train_policy"]
