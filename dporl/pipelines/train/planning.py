"""What a "train" run decides before it spends anything: every refusal it can know (``preflight``), the checks and the
calibration that depend on the number of units (``after_count``: on the released count under add/remove, on the
public count under replace-one), the training stage's noise (``training_noise``, which the audits call too) and its
DP configuration (``train_dp_config``)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any, Callable, Optional

from dporl.algos.expert_sources import expert_source
from dporl.algos.stable_prefix import RELEASE_STAGE, ReleasePlan, account, check_precondition, plan_release
from dporl.data.dataset import TrajectoryDataset
from dporl.experts.expert_set import ExpertSet
from dporl.methods.unit_level import TRAIN_STAGE
from dporl.pipelines.offline_eval import EvaluationPlan, check_cell_counts, check_cells, check_noise
from dporl.pipelines.train.config import Budget, TrainPipelineConfig
from dporl.pipelines.unit_count import check_delta_below_one_over_n, public_units
from dporl.privacy.count import COUNT_STAGE, CountPlan, ReleasedCount, Units
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.relations import analysed_for
from dporl.train.config import DPConfig
from dporl.train.trainer import plan_privacy
from dporl.utils.validation import ValidationError

Budgets = dict[str, Budget]


@dataclass(frozen=True)
class Checked:
    """What ``preflight`` decided before the run's first write: the release plan (its precondition on the number
    of experts deferred until a count exists under add/remove), the data training reads and its cell, and, where
    the number of units is public (replace-one), the units and the training noise."""

    release: Optional[ReleasePlan]
    train_data: TrajectoryDataset
    train_cell: Optional[str]
    units: Optional[Units] = None
    sigma: Optional[float] = None


def shares_run_budget(config: TrainPipelineConfig, plan: Optional[EvaluationPlan]) -> bool:
    """Whether the training stage takes what the earlier stages leave of the run budget under the run's joint PLD
    (instead of a fixed share): after an accounted release (Algorithm 3) or a count, when it is the run's last
    stage (no private evaluation follows) and no cells of a partition are involved (the ledger composes a sharing
    stage sequentially only)."""
    if TRAIN_STAGE not in config.stage_budgets() or (plan is not None and plan.estimator != "none"):
        return False
    fresh_release = config.release.source == "fresh" and config.released_stable is None  # a release of its own
    return config.method_spec.shares_run_budget(fresh_release, config.count_budget() is not None)


def train_dp_config(config: TrainPipelineConfig, budget: Budget, sigma: Optional[float] = None,
                    plan: Optional[EvaluationPlan] = None) -> DPConfig:
    """The training stage's DP configuration at ``budget`` (``sigma``: the calibrated noise, else the config's)."""
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


def preflight(config: TrainPipelineConfig, dataset: TrajectoryDataset, experts: Optional[ExpertSet],
              budgets: Budgets, plan: Optional[EvaluationPlan]) -> Checked:
    """Every refusal the run can know before it spends anything, raised before its first write: the method's needs,
    the release's preconditions and budget, the evaluation's cells and discount, delta against the batch size and,
    where the number of units is public (replace-one), everything that depends on it (the batch size, delta < 1/m,
    the release's m p_min >= G0, whether one training step fits; the training noise is calibrated here once). Under
    add/remove those follow the count (``after_count``): they are functions of a released value."""
    method = config.method_spec
    column = dataset.metadata.unit_column
    if column is not None and method.release:
        raise ValidationError(
            "method", f"{method.name!r} runs the stable-prefix release, which queries the experts that logged the "
            f"data and rolls them out in a public simulator; these data are grouped by column {column!r}, not by "
            f"queryable experts: use method dp_sgd (unit-level DP-SGD over {column!r}, no simulator needed)"
        )
    release = None
    if RELEASE_STAGE in budgets:  # no simulator, no (or a foreign) expert set, p_min, budget: every refusal
        eps1, delta1 = budgets[RELEASE_STAGE]
        release = plan_release(dataset, experts, epsilon=eps1, delta=delta1, config=config.release,
                               defer_precondition=True, relation=config.neighbours)
    # Under add/remove an empty cell is no refusal here (whether a cell holds units is private): ``after_count``.
    parts = check_cells(plan, dataset, config.neighbours) if plan is not None else {}
    held_out = plan is not None and plan.train_cells is not None
    checked = Checked(release, parts["train"] if held_out else dataset, "train" if held_out else None)
    if TRAIN_STAGE in budgets and config.trainer.max_steps == 0:
        raise ValidationError("trainer.max_steps", "a private training stage needs at least one step (or null: as "
                              "many as the budget allows)")
    if TRAIN_STAGE in budgets and config.delta * config.batch_size >= 1:  # B <= m is required: delta < 1/B is too
        raise ValidationError("delta", f"delta={config.delta:g} is not below 1/batch_size = 1/{config.batch_size}, "
                              "so not below 1/n for any number of units n DP-SGD can sample from; lower delta")
    if budgets and config.relation == "replace_one":  # the counts are public: every check now
        units = public_units(dataset, None if plan is None else plan.partition)
        return replace(checked, units=units, sigma=after_count(config, budgets, checked, units, plan))
    if budgets and config.released_count is not None:  # released (and accounted) before the run: every check now
        cells = None if plan is None or plan.partition is None else plan.partition.names
        units = ReleasedCount.from_dict(config.released_count,
                                        CountPlan(config.released_count.get("epsilon"), cells)).units()
        return replace(checked, units=units, sigma=after_count(config, budgets, checked, units, plan))
    return checked


def after_count(config: TrainPipelineConfig, budgets: Budgets, checked: Checked, units: Units,
                plan: Optional[EvaluationPlan]) -> Optional[float]:
    """The checks and the calibration that depend on the number of units, from ``units`` (released or public):
    the evaluation's predicted noise, the cells' counts, delta < 1/n, the release's precondition, the batch size, and
    the training noise (None without training)."""
    if plan is not None:  # the evaluation's predicted noise, then a cell whose count is below one unit
        check_noise(plan, config.eval.offline, units, checked.train_data, config.discount(), config.neighbours)
        check_cell_counts(plan, units)
    check_delta_below_one_over_n(config.delta, units)
    if checked.release is not None:
        check_precondition(checked.release, units)
    if TRAIN_STAGE not in budgets:
        return None
    # The sampling rate B / m does not depend on which rows (nor on the columns the algorithm reads).
    private = expert_source(checked.train_data, config.batch_size, config.dp.rows_per_unit, units,
                            checked.train_cell, config.algorithm.algorithm.batch_keys)
    source = config.method_spec.step_source(private, config.dp.p_dp)
    return training_noise(config, budgets, checked.release, source.step_event, plan)


def training_noise(
    config: TrainPipelineConfig, budgets: Budgets, release: Optional[ReleasePlan], step_event: Callable[[float], Any],
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

    return plan_privacy(train_dp_config(config, budgets[TRAIN_STAGE], plan=plan), config.trainer.max_steps, analysed,
                        ledger=planned, stage=TRAIN_STAGE)[0]
