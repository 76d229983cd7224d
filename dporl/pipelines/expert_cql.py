"""Pipeline "expert_cql": expert-level private offline RL with discrete CQL (spec/expert_level.md).

Methods (``method``):

- ``non_private``: CQL on all logged transitions (the upper bound; no guarantee).
- ``dp_sgd``: expert-level DP-SGD (Algorithm 4) on all data: Poisson over the m experts at rate q = B / m, k
  transitions per sampled expert averaged into one per-expert gradient, clipped, Gaussian noise. Whole budget.
  Needs neither a simulator nor the expert set.
- ``stable_only``: the stable-prefix release (Algorithms 1-2) with the whole budget, then noiseless CQL on D_stable.
- ``mixed``: Algorithm 3. Release with (eps1, delta1) = (f eps, delta / 2), then each step is, with probability p_dp,
  an expert-level DP-SGD step on D_unstable, else a noiseless step on D_stable; training delta delta / 2, and (fresh
  release) the training takes what the release leaves of the run budget under one joint PLD over both stages, so
  the run's guarantee meets (eps, delta) instead of about 0.71 eps for a fixed eps - eps1 (the paper's fixed split
  is kept for the logged variant).

The release (``release.source: fresh``, the default) rolls the experts out in the public simulator of the logging
environment and never reads the logged data, so D_unstable is the whole logged dataset. ``release.source: logged``
is the paper's variant, kept for reproduction: the run prints "the paper's mechanism: NO guarantee" and never a
GUARANTEE line (its figure is shown as a paper claim).

Neighbouring relation (``relation``). ``add_remove`` (the default): D and D' differ by one unit, so the number of
units m is private and the run never uses it: its first spend is a private count m~ (stage "unit_count", a
``count_fraction`` share of the budget, ``dporl.privacy.count``), and every count-dependent quantity is derived
from m~: the Poisson rate B / m~ (DP-SGD still divides by the public B), the calibrated noise and step count, the
stable-prefix precondition (on m~'s lower confidence bound), DP-FQE's normalisers (one count per cell of the
evaluation partition), and refusals (which name m~ as the released estimate). ``replace_one``: D and D' have the
same units, one unit's data replaced; m is public by that definition and is used as is, and every mechanism is
analysed for replace-one neighbours (``dporl.privacy.relations``: DP-SGD and mixture steps by the replace-one PLD,
the stable-prefix runs by group privacy), which the GUARANTEE line states ("replace one unit's data; the number of
units is public").

Privacy unit: one expert (its policy and every trajectory it logged). Accounting: the release stage composes T
(2 eps', beta) runs by PLD; the training stage records one event per step as the sampler states it (a
``MixtureEvent`` for Algorithm 3: the branch taken is observable, so the paper's rate-(p_dp q) figure is recorded as
a paper claim, not a guarantee). Training runs for as many steps as the budget allows (``trainer.max_steps``
caps it; ``dp.noise_multiplier: null`` calibrates sigma for that cap). The guarantee printed at the end is the ledger's (the smaller of basic composition and one joint PLD over
both stages).

Data (``data``, ``dporl.pipelines.inputs``): a saved or generated expert dataset (``format: npz``), a CSV / Parquet
table with its column mapping (``format: table``), or a Minari dataset (``format: minari``). The privacy unit is the
data's: the logging expert, or the column the user named (``dp_sgd`` is then unit-level DP-SGD over that column's
values). ``stable_only`` and ``mixed`` need the queryable experts and a simulator, and refuse data grouped by any
other unit.

Evaluation. With a simulator (the dataset's env id, or ``eval.env_id``, is a registered Gymnasium environment):
returns of the greedy Q-policy in the public environment, post-processing that costs nothing. Without one (or with
``eval.enabled: false``) the run says so and evaluates privately on logged data instead
(``dporl.pipelines.offline_eval``): by default ONE keyed-hash partition of the units holds some out, training runs
on the rest and the learned policy's value is released by DP importance sampling (or DP-FQE without propensities)
on the held-out units, in the same ledger, composed in parallel.

Run directory (``dporl.train.run_dir``): ``RUN/release/`` receives what the guarantee covers (the greedy policy in
``policy/``, D_stable, the release's public parameters, the privacy report, the public summary and public
TensorBoard scalars); ``RUN/curator/`` everything else (provenance, the journal, checkpoints, the release's per-run
diagnostics: which expert each run followed, the full summary, generated data by default). Nothing printed or in
``release/`` counts the private logged data. All secret randomness of a run comes from one ``SecretRoot``
(``noise_seed``, else 256 bits from the OS CSPRNG): streams "release/expert_choice", "release/env",
"release/actions", "release/laplace", "train/sampler", "train/noise". The whole run has the budget (``epsilon``,
``delta``): the ledger refuses any stage or state that would take the guarantee past it. The count draws from the
stream "unit_count/noise".
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Literal, Optional

import torch

from dporl.algos.cql import CQLConfig, DiscreteCQL
from dporl.algos.expert_sources import Method, expert_source, training_source
from dporl.algos.stable_prefix import (
    RELEASE_STAGE,
    ReleasePlan,
    StablePrefixConfig,
    account,
    check_precondition,
    plan_release,
    release_stable_prefixes,
)
from dporl.data.dataset import TrajectoryDataset
from dporl.envs.registry import check_env_id, check_no_module, is_registered, make_vec
from dporl.eval.returns import evaluate_returns
from dporl.experts.expert_set import ExpertSet
from dporl.pipelines import Pipeline, curator_note, get_pipeline, register
from dporl.pipelines.inputs import DataConfig, check_inputs_outside, data_inputs, import_dataset, save_imported
from dporl.pipelines.offline_eval import EvaluationPlan, OfflineEvalConfig, check_cells, evaluate_offline, plan_evaluation
from dporl.pipelines.offline_eval import check_noise
from dporl.pipelines.offline_eval import stage_names as evaluation_stages
from dporl.pipelines.unit_count import (
    check_delta_below_one_over_n,
    count_once,
    describe_count,
    public_units,
    with_released_count,
)
from dporl.privacy.accountants import check_delta, paper_mixture_epsilon
from dporl.privacy.count import COUNT_STAGE, LOWER_BOUND_FAILURE, CountPlan, Units
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.randomness import SecretRoot
from dporl.privacy.relations import CONVERSION, analysed_for
from dporl.privacy.units import Relation
from dporl.privacy.samplers import MixtureSource
from dporl.privacy.units import dataset_unit
from dporl.train.config import DPConfig, TrainerConfig
from dporl.train.export import save_policy
from dporl.train.run_dir import RunDirectory, RunMode
from dporl.train.trainer import Trainer, plan_privacy
from dporl.utils.config import from_dict, to_dict
from dporl.utils.device import resolve_device
from dporl.utils.io import atomic_write_json
from dporl.utils.seeding import seeded
from dporl.utils.validation import PrivacyBudgetError, ValidationError, check_positive, check_probability

TRAIN_STAGE = "train"


@dataclass
class PrivateTrainingConfig:
    """Expert-level DP-SGD steps (Algorithm 4) and their mixing with stable steps (Algorithm 3)."""

    noise_multiplier: Optional[float] = None  # None: the smallest that fits trainer.max_steps in the budget
    max_grad_norm: float = 1.0  # C, per-expert gradient clip
    rows_per_expert: int = 1  # k transitions per sampled expert (1: the paper; >1: user-level DP-SGD, same privacy)
    p_dp: float = 0.5  # "mixed": probability of a DP-SGD step (the paper's grid: 0.1, 0.2, 0.5, 1)
    # The training stage's analysis. PLD, the analysis of the run's joint guarantee: a private run composes the count
    # (and the release) with training, and the report's joint PLD is tighter than RDP or PRV, so a stage calibrated
    # by either of those would leave part of the budget unused (measured: 0.91 of 1.0 on the table quickstart).
    accountant: Literal["rdp", "prv", "pld"] = "pld"
    clipping: Literal["bookkeeping", "ghost", "opacus", "naive"] = "bookkeeping"

    def __post_init__(self) -> None:
        if self.noise_multiplier is not None:
            check_positive("dp.noise_multiplier", self.noise_multiplier)
        check_positive("dp.max_grad_norm", self.max_grad_norm)
        if self.rows_per_expert < 1:
            raise ValidationError("dp.rows_per_expert", f"must be >= 1, got {self.rows_per_expert}")
        check_probability("dp.p_dp", self.p_dp, allow_zero=False)


@dataclass
class EvalConfig:
    # Evaluate in a simulator: the dataset's environment (default physics, where the data were logged) when its id
    # is a registered Gymnasium environment, or env_id. False, or no simulator: private evaluation on logged data.
    enabled: bool = True
    env_id: Optional[str] = None
    episodes: int = 10
    num_envs: int = 4
    max_episode_steps: Optional[int] = None  # the paper evaluates CartPole with 1000
    seed: int = 12345
    last_evals: int = 10  # the summary also reports the mean of the last this-many evaluations (the paper's protocol)
    offline: OfflineEvalConfig = field(default_factory=OfflineEvalConfig)  # without a simulator

    def __post_init__(self) -> None:
        if self.env_id is not None:
            check_no_module("eval.env_id", self.env_id)  # refused even with evaluation off: never a module
        for name in ("episodes", "num_envs", "last_evals"):
            if getattr(self, name) < 1:
                raise ValidationError(f"eval.{name}", f"must be >= 1, got {getattr(self, name)}")
        if self.max_episode_steps is not None and self.max_episode_steps < 1:
            raise ValidationError("eval.max_episode_steps", f"must be >= 1, got {self.max_episode_steps}")


@dataclass
class ExpertCQLConfig:
    pipeline: str = "expert_cql"
    method: Method = "mixed"
    run_dir: str = "runs/expert_cql"
    epsilon: float = 10.0  # total expert-level budget of the run (release + training)
    delta: float = 1e-5  # total delta; "mixed" gives half to each stage (the paper)
    release_fraction: float = 0.5  # "mixed": eps1 = release_fraction * (epsilon less the count's share)
    batch_size: int = 256  # B: expected experts per DP-SGD step (rate B / m~) and transitions per noiseless step
    # add_remove: one unit added or removed (the number of units is private: released by a count, m~); replace_one:
    # one unit's data replaced (the number of units is public), every mechanism analysed for replace-one.
    relation: Literal["add_remove", "replace_one"] = "add_remove"
    count_fraction: float = 0.01  # add_remove: the count's share of epsilon (its delta: 0, or its lower bound's)
    # Secret by default: a known noise seed lets anyone subtract the noise (see dporl.privacy.noise).
    noise_seed: Optional[int] = None
    data: DataConfig = field(default_factory=lambda: DataConfig(dataset="data/cartpole.npz"))
    release: StablePrefixConfig = field(default_factory=StablePrefixConfig)
    dp: PrivateTrainingConfig = field(default_factory=PrivateTrainingConfig)
    cql: CQLConfig = field(default_factory=CQLConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        if self.pipeline != "expert_cql":
            raise ValidationError("pipeline", f"expected 'expert_cql', got {self.pipeline!r}")
        check_positive("epsilon", self.epsilon)
        check_delta(self.delta)
        check_probability("release_fraction", self.release_fraction, allow_zero=False, allow_one=False)
        check_probability("count_fraction", self.count_fraction, allow_zero=False, allow_one=False)
        if self.relation not in ("add_remove", "replace_one"):
            raise ValidationError("relation", f"expected 'add_remove' or 'replace_one', got {self.relation!r}")
        if self.batch_size < 1:
            raise ValidationError("batch_size", f"must be >= 1, got {self.batch_size}")

    @property
    def neighbours(self) -> Relation:
        return Relation.ADD_REMOVE if self.relation == "add_remove" else Relation.REPLACE_ONE

    def count_budget(self) -> Optional[tuple[float, float]]:
        """(epsilon, delta) of the private count of the units: add/remove runs with a guarantee only. Its delta is
        the charged failure of the lower bound the stable-prefix precondition is checked on (0 without a release)."""
        if self.method == "non_private" or self.relation != "add_remove":
            return None
        failure = LOWER_BOUND_FAILURE * self.delta if self.method in ("stable_only", "mixed") else 0.0
        return self.count_fraction * self.epsilon, 2 * failure

    def spendable(self) -> tuple[float, float]:
        """The run budget less the count's share: what the release, training and evaluation divide."""
        count = self.count_budget() or (0.0, 0.0)
        return self.epsilon - count[0], self.delta - count[1]

    def stage_budgets(self) -> dict[str, tuple[float, float]]:
        """(epsilon, delta) of each private stage this method runs (the count first, when there is one)."""
        if self.method == "non_private":
            return {}
        count = self.count_budget()
        budgets = {} if count is None else {COUNT_STAGE: count}
        eps, delta = self.spendable()
        if self.method == "dp_sgd":
            return {**budgets, TRAIN_STAGE: (eps, delta)}
        if self.method == "stable_only":
            return {**budgets, RELEASE_STAGE: (eps, delta)}
        eps1 = self.release_fraction * eps
        return {**budgets, RELEASE_STAGE: (eps1, delta / 2), TRAIN_STAGE: (eps - eps1, delta / 2)}

    def count_plan(self, plan: Optional["EvaluationPlan"]) -> Optional[CountPlan]:
        """The count this run releases (None without one): one per cell of the evaluation's partition."""
        count = self.count_budget()
        if count is None:
            return None
        cells = None if plan is None or plan.partition is None else plan.partition.names
        return CountPlan(count[0], cells, count[1] / 2)


# ---------------------------------------------------------------------------------------------------- data
def dataset_config(generate: dict[str, Any], out_dir: Optional[str | Path] = None):
    """The "dataset" pipeline config of ``generate`` (validated: errors are named before anything is written)."""
    generator = get_pipeline("dataset")
    data = {"pipeline": "dataset", **generate}
    if out_dir is not None and "out_dir" not in generate:
        data["out_dir"] = str(out_dir)
    return generator, from_dict(generator.config_cls, data)


def check_generation(generate: dict[str, Any], out_dir: Optional[str | Path] = None, replaced: Optional[Path] = None) -> None:
    """Refuse, writing nothing, a generation whose config is invalid or whose out_dir holds another generation
    (unless that out_dir lies inside ``replaced``, a run directory --overwrite is about to remove)."""
    try:
        _, config = dataset_config(generate, out_dir)
    except ValidationError as exc:  # named as the run's config says it: data.generate.<field>
        raise type(exc)(f"data.generate.{exc.field}", str(exc).split(": ", 1)[-1]) from None
    if replaced is not None and Path(config.out_dir).resolve().is_relative_to(replaced.resolve()):
        return
    try:
        RunDirectory(config.out_dir, pipeline="dataset", config=to_dict(config), mode="resume", curator_only=True)
    except ValidationError as exc:
        if exc.field != "run_dir":
            raise
        raise ValidationError("data.generate.out_dir", str(exc).split(": ", 1)[1]) from None


def generate_dataset(generate: dict[str, Any], out_dir: Optional[str | Path] = None) -> tuple[str, str]:
    """Run the "dataset" pipeline with config ``generate``; (dataset path, expert set path).

    Its out_dir (``generate.out_dir``, else ``out_dir``) is reused when it holds this very generation (same config)
    and refused when it holds another one: logged data are never overwritten by a changed config.
    """
    check_generation(generate, out_dir)
    generator, config = dataset_config(generate, out_dir)
    outputs = generator.run(config, mode="resume")
    return outputs["dataset"], outputs["expert_set"]


def load_data(
    config: DataConfig, out_dir: Optional[str | Path] = None, need_experts: bool = True
) -> tuple[TrajectoryDataset, Optional[ExpertSet]]:
    """The logged dataset and, when asked for and known, the expert set that logged it (``out_dir``: where a
    generated dataset goes when ``generate`` names no out_dir)."""
    if config.generate is not None:
        dataset_path, expert_path = generate_dataset(config.generate, out_dir)
        expert_path = config.expert_set or expert_path
    else:
        dataset_path, expert_path = config.npz_path, config.expert_set
    dataset = TrajectoryDataset.load(dataset_path, mmap=config.mmap)
    if not need_experts:
        return dataset, None
    if expert_path is None:
        expert_path = (dataset.metadata.expert_set or {}).get("path")
    experts = ExpertSet.load(expert_path) if expert_path is not None else None
    return dataset, experts


# ---------------------------------------------------------------------------------------------------- release
def run_release(
    dataset: TrajectoryDataset,
    experts: Optional[ExpertSet],
    budget: tuple[float, float],
    config: ExpertCQLConfig,
    ledger: PrivacyLedger,
    run: RunDirectory,
    root: SecretRoot,
    units: Units,
) -> tuple[TrajectoryDataset, dict[str, Any]]:
    """(D_stable, the release's public summary); a paid release of this run is reused, never repeated. The
    precondition m p_min >= G0 is checked on ``units`` (the released count's lower bound, or the public count).

    Order (write-ahead): the release stage's T events are journaled before any query is answered (the ledger is
    the run's journaled ledger), then the artifacts are written (D_stable and its public summary to release/, which
    expert each run followed to curator/), then the journal marks the release complete with D_stable's
    fingerprint. A resumed run reuses a complete release after checking that fingerprint; an attempt that was
    authorised but never completed has spent its budget, and a second release is refused rather than left
    uncounted. D_unstable is the whole logged dataset (the release never reads it): nothing to write.
    """
    manifest = run.completed(RELEASE_STAGE)
    if manifest is not None:
        stable = TrajectoryDataset.load(run.release / "d_stable.npz")
        if stable.fingerprint() != manifest["d_stable"]:
            raise ValidationError("release", f"the release files in {run.root} differ from the release its journal "
                                  "recorded: refusing to train on them")
        return stable, manifest["public"]
    if RELEASE_STAGE in ledger.stages and len(ledger.stages[RELEASE_STAGE].accountant):
        raise PrivacyBudgetError(
            "release",
            f"an earlier attempt of this run authorised the stable-prefix release (its events are charged in "
            f"{run.journal_path}) but did not finish writing it; a second release would not fit the budget. Start a "
            "new run_dir (or --overwrite: the interrupted attempt's spend is then not part of the new guarantee)",
        )
    result = release_stable_prefixes(
        dataset, experts, epsilon=budget[0], delta=budget[1], config=config.release, root=root, ledger=ledger,
        progress=config.trainer.progress, units=units,
    )
    result.save(run.release, run.curator)
    if experts is not None and experts.repaired_queries:
        curator_note(f"the release lifted {experts.repaired_queries} (expert, state) distributions below p_min to "
                     "p_min (mixing with the uniform policy) instead of refusing them")
    public = result.summary()
    run.complete(RELEASE_STAGE, {"public": public, "d_stable": result.stable.fingerprint()})
    return result.stable, public


# ---------------------------------------------------------------------------------------------------- evaluation
def simulator_id(config: EvalConfig, dataset_env_id: str) -> Optional[str]:
    """The environment a run evaluates its policy in, or None: evaluation in a simulator is off, or there is none.

    ``eval.env_id`` must name a registered Gymnasium environment (an error otherwise); the dataset's env id is used
    when it is one (an imported table's usually is not: then there is no simulator). Either id is refused if it
    names a module to import (``dporl.envs.registry``)."""
    if not config.enabled:
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

    def evaluate(module: DiscreteCQL) -> dict[str, float]:
        return evaluate_returns(module.act, env, config.episodes, config.seed, progress=progress).to_dict()

    return evaluate, env


def _evaluation_plan(config: ExpertCQLConfig, dataset: TrajectoryDataset, env_id: Optional[str]):
    """The offline evaluation of a run without a simulator (None with one; the release methods evaluate only there)."""
    if env_id is not None or config.method in ("stable_only", "mixed"):
        return None
    return plan_evaluation(config.eval.offline, dataset, config.spendable(), config.stage_budgets().get(TRAIN_STAGE),
                           config.cql.gamma)


def resolved_budgets(config: ExpertCQLConfig, plan: Optional[EvaluationPlan]) -> dict[str, tuple[float, float]]:
    """Each private stage's budget once the evaluation is planned (reusing the training units for a private
    evaluation takes its budget out of training's)."""
    budgets = config.stage_budgets()
    if plan is not None and TRAIN_STAGE in budgets:
        budgets[TRAIN_STAGE] = plan.train_budget
    return budgets


def training_plan(config: ExpertCQLConfig, dataset: TrajectoryDataset):
    """(stage budgets, the data the training stage samples from, the evaluation plan) for ``config`` on
    ``dataset``, as ``run`` decides them: the "train" cell when units are held out for a private evaluation (the
    audits use this)."""
    plan = _evaluation_plan(config, dataset, simulator_id(config.eval, dataset.metadata.env_id))
    parts = check_cells(plan, dataset, config.neighbours) if plan is not None else {}
    train_data = parts["train"] if plan is not None and plan.train_cells is not None else dataset
    return resolved_budgets(config, plan), train_data, plan


def _announce_evaluation(config: ExpertCQLConfig, env_id: Optional[str], plan: Optional[EvaluationPlan],
                         dataset_env_id: str) -> None:
    """Say where the policy will be evaluated (public facts of the config and the environment registry only)."""
    if env_id is not None:
        print(f"evaluation: returns in the simulator {env_id!r} (post-processing: no privacy cost)")
        return
    why = ("simulator evaluation is off (eval.enabled: false)" if not config.eval.enabled else
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


# ---------------------------------------------------------------------------------------------------- run
def run(config: ExpertCQLConfig, mode: RunMode = "new", dataset: Optional[TrajectoryDataset] = None) -> dict:
    """One expert_cql run in ``config.run_dir`` (``mode``: see ``dporl.train.run_dir``); returns the public summary.

    ``dataset``: a dataset handed over in Python (``data.format: memory``; the Python API's path).
    Every check (config hash, input hashes, data, evaluation, network sizes, budgets) happens before the first
    write; a finished run with the same provenance is read back, not repeated.
    """
    device = resolve_device(config.trainer.device, "trainer.device")  # a named error before any write
    if (dataset is not None) != (config.data.format == "memory"):
        raise ValidationError("data.format", "format 'memory' is for a dataset handed over in Python "
                              "(run(config, dataset=...)), and only it takes one")
    run = RunDirectory(config.run_dir, pipeline="expert_cql", config=to_dict(config), mode=mode)
    check_inputs_outside(run, data_inputs(config.data))  # --overwrite never deletes the user's inputs
    budgets = config.stage_budgets()
    experts, frame = None, None
    if config.data.format == "npz":
        if config.data.generate is not None:
            replaced = run.root if run.mode == "overwrite" and run.existing else None
            check_generation(config.data.generate, run.curator / "data", replaced)  # named errors before any write
            run.begin()  # generated data live in RUN/curator/data unless the config says otherwise
        # dp_sgd and non_private need neither the expert set nor a simulator: they never look for them.
        dataset, experts = load_data(config.data, run.curator / "data", need_experts=RELEASE_STAGE in budgets)
        if experts is not None and config.data.generate is None and config.data.expert_set is None:
            check_inputs_outside(run, {"dataset.metadata.expert_set.path": experts.path})
        if experts is not None:  # the release evaluates the experts where the trainer runs (trainer.device)
            experts.to(device)
    elif dataset is None:
        dataset, frame = import_dataset(config.data, progress=config.trainer.progress)
    meta = dataset.metadata
    if len(meta.obs_shape) != 1:
        raise ValidationError("dataset.metadata.obs_shape", f"CQL needs flat observations, got {meta.obs_shape}")
    # The content hash covers the metadata too: the unit column and every unit's key.
    run.check_inputs(dataset=dataset.fingerprint(), **({"expert_set": experts.fingerprint()} if experts else {}))
    if run.finished:
        return run.read_summary()
    env_id = simulator_id(config.eval, meta.env_id)
    plan = _evaluation_plan(config, dataset, env_id)
    budgets = resolved_budgets(config, plan)
    checked = _preflight(config, dataset, experts, budgets, plan)
    with seeded(config.trainer.seed):  # public initialisation: the same weights whatever ran before
        algorithm = DiscreteCQL(meta.obs_shape[0], meta.n_actions, config.cql, privacy_unit=dataset_unit(dataset))
    evaluate, env = (returns_evaluator(config.eval, env_id, config.trainer.progress) if env_id is not None else
                     (None, None))
    if env is not None and getattr(env.single_action_space, "n", meta.n_actions) != meta.n_actions:
        env.close()  # both are public declarations: refused before anything is written
        raise ValidationError("dataset.metadata.n_actions", f"the data declare {meta.n_actions} actions, the "
                              f"simulator {env_id!r} has {env.single_action_space}")
    _announce_evaluation(config, env_id, plan, meta.env_id)
    try:
        run.begin()
        if config.data.imported:
            save_imported(dataset, run.curator / "data", frame)  # curator-only copy of what was imported
        root = SecretRoot(config.noise_seed)
        ledger = run.ledger((config.epsilon, config.delta) if budgets else None, config.neighbours)
        summary = _train(config, run, root, ledger, budgets, checked, dataset, experts, algorithm, evaluate, env,
                         plan)
    finally:
        if env is not None:
            env.close()
    return summary


def shares_run_budget(config: ExpertCQLConfig, plan: Optional[EvaluationPlan]) -> bool:
    """Whether the training stage takes what the earlier stages leave of the run budget under the run's joint PLD
    (instead of a fixed share): after an accounted release (Algorithm 3) or a count, when it is the run's last
    stage (no private evaluation follows) and no cells of a partition are involved (the ledger composes a sharing
    stage sequentially only)."""
    if TRAIN_STAGE not in config.stage_budgets() or (plan is not None and plan.estimator != "none"):
        return False
    return (config.method == "mixed" and config.release.source == "fresh") or config.count_budget() is not None


def _train_dp_config(config: ExpertCQLConfig, budget: tuple[float, float], sigma: Optional[float] = None,
                     plan: Optional[EvaluationPlan] = None) -> DPConfig:
    return DPConfig(
        epsilon=budget[0],
        delta=budget[1],
        noise_multiplier=config.dp.noise_multiplier if sigma is None else sigma,
        max_grad_norm=config.dp.max_grad_norm,
        # replace-one steps are analysed by their replace-one PLD (dporl.privacy.relations): no RDP curve for them
        accountant=config.dp.accountant if config.relation == "add_remove" else "pld",
        clipping=config.dp.clipping,
        # Algorithm 3 with an accounted release: the training stage takes what the release leaves of the run budget
        # under the joint PLD of both stages (the run's guarantee), not a fixed eps - eps1.
        share_run_budget=shares_run_budget(config, plan),
    )


@dataclass(frozen=True)
class Checked:
    """What ``_preflight`` decided before the run's first write: the release plan (its precondition on the number
    of experts deferred until a count exists under add/remove), the data training reads and its cell, and, where
    the number of units is public (replace-one), the units and the training noise."""

    release: Optional[ReleasePlan]
    train_data: TrajectoryDataset
    train_cell: Optional[str]
    units: Optional[Units] = None
    sigma: Optional[float] = None


def _preflight(
    config: ExpertCQLConfig, dataset: TrajectoryDataset, experts: Optional[ExpertSet], budgets,
    plan: Optional[EvaluationPlan],
) -> Checked:
    """Every refusal the run can know before it spends anything, raised before its first write: the method's needs,
    the release's preconditions and budget, the evaluation's cells, delta against the batch size and, where the
    number of units is public (replace-one), everything that depends on it (the batch size, delta < 1/m, the
    release's m p_min >= G0, whether one training step fits; the training noise is calibrated here once). Under
    add/remove those follow the count (``_after_count``): they are functions of a released value."""
    column = dataset.metadata.unit_column
    if column is not None and config.method in ("stable_only", "mixed"):
        raise ValidationError(
            "method", f"{config.method!r} runs the stable-prefix release, which queries the experts that logged the "
            f"data and rolls them out in a public simulator; these data are grouped by column {column!r}, not by "
            f"queryable experts: use method dp_sgd (unit-level DP-SGD over {column!r}, no simulator needed)"
        )
    release = None
    if RELEASE_STAGE in budgets:  # no simulator, no (or a foreign) expert set, p_min, budget: every refusal
        eps1, delta1 = budgets[RELEASE_STAGE]
        release = plan_release(dataset, experts, epsilon=eps1, delta=delta1, config=config.release,
                               defer_precondition=True, relation=config.neighbours)
    parts = check_cells(plan, dataset, config.neighbours) if plan is not None else {}
    held_out = plan is not None and plan.train_cells is not None
    checked = Checked(release, parts["train"] if held_out else dataset, "train" if held_out else None)
    if TRAIN_STAGE in budgets and config.delta * config.batch_size >= 1:  # B <= m is required: delta < 1/B is too
        raise ValidationError("delta", f"delta={config.delta:g} is not below 1/batch_size = 1/{config.batch_size}, "
                              "so not below 1/n for any number of units n DP-SGD can sample from; lower delta")
    if budgets and config.relation == "replace_one":  # the counts are public: every check now
        units = public_units(dataset, None if plan is None else plan.partition)
        return replace(checked, units=units, sigma=_after_count(config, budgets, checked, units, plan))
    return checked


def _after_count(config: ExpertCQLConfig, budgets, checked: Checked, units: Units,
                 plan: Optional[EvaluationPlan]) -> Optional[float]:
    """The checks and the calibration that depend on the number of units, from ``units`` (released or public):
    delta < 1/n, the release's precondition, the batch size, and the training noise (None without training)."""
    if plan is not None:  # the evaluation's predicted noise, before anything but the count is spent
        check_noise(plan, config.eval.offline, units, checked.train_data, config.cql.gamma, config.neighbours)
    check_delta_below_one_over_n(config.delta, units)
    if checked.release is not None:
        check_precondition(checked.release, units)
    if TRAIN_STAGE not in budgets:
        return None
    # The sampling rate B / m does not depend on which rows.
    private = expert_source(checked.train_data, config.batch_size, config.dp.rows_per_expert, units,
                            checked.train_cell)
    source = private if config.method == "dp_sgd" else MixtureSource(config.dp.p_dp, private, None)
    return training_noise(config, budgets, checked.release, source.step_event, plan)


def training_noise(
    config: ExpertCQLConfig, budgets, release: Optional[ReleasePlan], step_event: Callable[[float], Any],
    plan: Optional[EvaluationPlan] = None,
) -> Optional[float]:
    """The training stage's noise multiplier as a run of ``config`` calibrates it (None without a training stage):
    for its own stage budget, or, when the stage shares the run budget (Algorithm 3 after a fresh release), for what
    the count's and the release's events (recorded first) leave of the run budget under one joint PLD. The audits
    call this too, so that what they attack is the noise the run would add. ``step_event`` is the add/remove event
    of the run's sampler; a replace-one run analyses it for replace-one. ``plan``: the run's evaluation plan."""
    if TRAIN_STAGE not in budgets:
        return None
    planned = PrivacyLedger((config.epsilon, config.delta), config.neighbours)  # scratch: earlier stages as recorded
    count = config.count_plan(None)
    if count is not None:  # the count's events do not depend on its cells
        planned.stage(COUNT_STAGE, budget=count.budget, mechanism="pld")
        for event, times in count.events:
            planned.record(COUNT_STAGE, event, times)
    if release is not None:
        account(release, planned)

    def analysed(sigma: float):
        return analysed_for(config.neighbours, step_event(sigma))

    return plan_privacy(_train_dp_config(config, budgets[TRAIN_STAGE], plan=plan), config.trainer.max_steps, analysed,
                        ledger=planned, stage=TRAIN_STAGE)[0]


def _train(config, run, root, ledger, budgets, checked: Checked, dataset, experts, algorithm, evaluate, env,
           plan) -> dict:
    meta = dataset.metadata
    stable, release_public = None, None
    train_data = checked.train_data
    partition = None if plan is None else plan.partition
    if partition is not None:
        ledger.partition(partition)  # the run's one split of the units (a keyed hash of their ids)
    units, sigma, released_count = checked.units, checked.sigma, None
    count = config.count_plan(plan)
    if count is not None:  # the first spend: everything count-dependent is derived from its released value
        released_count = count_once(run, ledger, root, count, dataset, partition)
        print(describe_count(released_count))
        units = released_count.units()
        sigma = _after_count(config, budgets, checked, units, plan)
    if RELEASE_STAGE in budgets:
        stable, release_public = run_release(dataset, experts, budgets[RELEASE_STAGE], config, ledger, run, root,
                                             units)
        # Only functions of the release are printed: never a count of the private logged data.
        print(
            f"stable-prefix release ({release_public.get('source', config.release.source)} prefixes): "
            f"{stable.n_episodes} prefixes of {config.release.trajectories} runs, {stable.n_transitions} transitions "
            f"in D_stable"
        )
    dp = _train_dp_config(config, budgets[TRAIN_STAGE], sigma, plan) if TRAIN_STAGE in budgets else None
    if dp is not None and TRAIN_STAGE not in ledger.stages:  # (a resumed run recovered it from its journal)
        # Opened here for its cells (the Trainer opens the same stage otherwise and checks it matches).
        ledger.stage(TRAIN_STAGE, budget=budgets[TRAIN_STAGE], mechanism=dp.accountant,
                     unit=dataset_unit(dataset), cells=None if plan is None else plan.train_cells,
                     shares_run_budget=dp.share_run_budget,
                     analysis=None if config.relation == "add_remove" else CONVERSION)
    source = training_source(
        config.method, train_data, stable, batch_size=config.batch_size, units=units, cell=checked.train_cell,
        rows_per_expert=config.dp.rows_per_expert, p_dp=config.dp.p_dp,
    )

    env_id = None if env is None else (config.eval.env_id or meta.env_id)
    pipeline_config = {**to_dict(config), "resolved": {"env_id": env_id}}
    evaluators = {} if evaluate is None else {"eval": evaluate}
    result = Trainer(
        algorithm,
        source,
        config=config.trainer,
        dp=dp,
        ledger=ledger,
        run_dir=run,
        pipeline="expert_cql",
        pipeline_config=pipeline_config,
        stage=TRAIN_STAGE,
        evaluators=evaluators,
        public_evaluators=tuple(evaluators),  # returns of the released iterate in the public simulator
        secret_root=root,
    ).fit()

    _record_paper_figure(config, source, result, ledger)
    offline = None
    if plan is not None and plan.estimator != "none":
        if config.method == "non_private" and ledger.void_reason is None:
            ledger.void("method non_private: the policy was trained without privacy")
        offline = _evaluate_offline_once(config, run, root, ledger, plan, dataset, algorithm, units)
    report = ledger.report()
    privacy = with_released_count(report.to_dict(), released_count)
    atomic_write_json(run.release / "privacy_report.json", privacy)  # every stage, the evaluation's included
    _log_final_scalars(run, result.steps, report, offline)
    returns = [metrics["eval/return_mean"] for _, metrics in result.eval_history if "eval/return_mean" in metrics]
    last = returns[-config.eval.last_evals :]
    observation_space, action_space = _spaces(env, meta)
    save_policy(
        algorithm, run.policy_dir, env_id=env_id, observation_space=observation_space, action_space=action_space,
        privacy={"guarantee": privacy["guarantee"], "void": privacy["void"], "text": privacy["text"]},
        extra={"pipeline": "expert_cql", "method": config.method, "max_episode_steps": config.eval.max_episode_steps,
               **({"offline_evaluation": offline} if offline is not None else {})},
        action_labels=meta.action_labels,  # declared (public), like the action count
    )
    evaluation = ({"mode": "simulator", "env_id": env_id} if env is not None else
                  {"mode": "offline", "composition": plan.composition, **offline} if offline is not None else
                  {"mode": "none"})
    public = {
        "pipeline": "expert_cql",
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
        "stable_transitions": None if stable is None else int(stable.n_transitions),
        "privacy": privacy,
        "policy": "policy/",
        "headline": _headline(config, last, offline),
    }
    run.write_summaries(public, {**public, "run_dir": str(run.root), "config": to_dict(config), "inputs": run.inputs,
                                 "final_metrics_all": result.metrics})
    if report.stages or report.void is not None:
        print(report.describe())
    else:
        print("NO PRIVACY GUARANTEE: non-private baseline (method non_private)")
    print(f"release (safe to share): {run.release}; curator-only (never share): {run.curator}")
    return public


OFFLINE_EVALUATION = "offline_evaluation"


def _evaluate_offline_once(config, run, root, ledger, plan: EvaluationPlan, dataset, algorithm,
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
    result = evaluate_offline(plan, offline, dataset, algorithm, gamma=config.cql.gamma, ledger=ledger, root=root,
                              work_dir=run.curator / "offline_evaluation", units=units)
    manifest = {**result.to_dict(), "estimator": plan.estimator}
    run.complete(OFFLINE_EVALUATION, manifest)
    print(f"offline evaluation: {result.describe()}")
    return manifest


def _log_final_scalars(run: RunDirectory, step: int, report, offline: Optional[dict]) -> None:
    """The run's final privacy scalars (every stage, the evaluation's included) and the released policy value."""
    from dporl.logging import RunLogger

    logger = RunLogger(run.release / "tensorboard")
    values = report.scalars()
    if offline is not None:
        values.update({"offline/value": offline["value"], "offline/ci_low": offline["ci_low"],
                       "offline/ci_high": offline["ci_high"]})
    logger.scalars(values, step)
    logger.close()


def _spaces(env, meta):
    """The policy's observation and action spaces: the simulator's, or what the data declare."""
    if env is not None:
        return env.single_observation_space, env.single_action_space
    import gymnasium as gym
    import numpy as np

    return (gym.spaces.Box(-np.inf, np.inf, shape=meta.obs_shape, dtype=np.float32),
            gym.spaces.Discrete(meta.n_actions))


def _headline(config: ExpertCQLConfig, last: list[float], offline: Optional[dict]) -> dict[str, str]:
    """The few numbers a person reads first (all public: released values, the budget)."""
    headline = {}
    if last:
        headline[f"return in the simulator (mean of the last {len(last)} evaluations)"] = f"{sum(last) / len(last):.4g}"
    if offline is not None:
        headline[f"policy value (DP-{offline['estimator'].upper()}, {100 * offline['confidence']:g}% interval)"] = (
            f"{offline['value']:.4g} [{offline['ci_low']:.4g}, {offline['ci_high']:.4g}]"
            + ("" if offline.get("calibrated", True) else " (interval NOT calibrated: see the evaluation's notes)")
        )
    return headline


def _record_paper_figure(config: ExpertCQLConfig, source: Any, result, ledger: PrivacyLedger) -> None:
    """The expert-level paper's epsilon for the training stage of Algorithm 3, as a paper claim (never a guarantee)."""
    if not isinstance(source, MixtureSource) or result.budget_steps == 0:
        return
    eps2, delta2 = config.stage_budgets()[TRAIN_STAGE]
    epsilon = paper_mixture_epsilon(
        source.private_probability,
        source.private_source.sample_rate,
        result.noise_multiplier,
        result.budget_steps,
        delta2,
        config.dp.accountant,
    )
    name = "Algorithm 3's training stage accounted at rate p_dp * q"
    if any(claim.name == name for claim in ledger.paper_claims):  # a resumed run recovered it from its journal
        return
    ledger.paper_claim(
        name, epsilon, delta2,
        "Sharma et al. 2024: every step as a subsampled Gaussian at rate p_dp * q; the branch a step takes is "
        "observable, so the sound analysis is the mixture (recorded in stage 'train')",
    )


register(Pipeline("expert_cql", ExpertCQLConfig, run))
