"""Private offline evaluation of a learned policy on logged data: the evaluation of a run without a simulator.

A training pipeline that cannot (or is told not to: ``eval.simulator: false``) evaluate in a simulator evaluates the
policy it learned on logged data instead, privately (``dporl.eval.private_ope``), in the run's ledger:

- ``holdout > 0`` (the default): ONE ``UnitPartition`` (a keyed hash of each unit's own id with the public
  ``salt``, never a function of the data) splits the units into a "train" cell and held-out cell(s). Training runs
  on "train" only; the learned policy is a released (DP) output, so evaluating it on the held-out units is a new
  mechanism on other units: the stages compose in PARALLEL and the run's guarantee is the larger cell's, not the
  sum. Both the training stage and the evaluation get the run's whole (epsilon, delta) by default.
- ``holdout: 0``: the evaluation reuses the training units: the stages compose SEQUENTIALLY, so the evaluation's
  (epsilon, delta) must be given and the training stage gets what is left of the run's budget.

The ledger's report says which composition it applied. Estimators (``estimator``): ``fqe`` (DP fitted-Q evaluation
on ``folds`` held-out cells; needs no propensities; the default, ``auto``: the learned policy is greedy, and clipped
importance sampling of a deterministic policy is biased by its clip), ``wis`` (weighted importance sampling),
``pdis``, ``dr`` (doubly robust: a DP-FQE model on one held-out cell, the estimate on another; these three need
logged propensities), ``none``. Cells: "train" and "evaluate" (wis, pdis),
"evaluate0".. (fqe), "model" and "estimate" (dr). The target is the released greedy policy; the interval accounts
for sampling and privacy noise (see ``dporl.eval.private_ope`` and ``docs/results.md`` for its measured coverage:
nominal for WIS; DR, FQE and PDIS carry the caveats printed in their results).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from dporl.algos.fqe import FQEConfig
from dporl.data.dataset import TrajectoryDataset
from dporl.eval.private_ope import (
    FQETraining,
    OPEResult,
    dp_fqe,
    dp_importance_sampling,
    fit_dp_fqe,
    gaussian_noise_multiplier,
)
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.partition import UnitPartition
from dporl.privacy.count import Units
from dporl.privacy.randomness import SecretRoot
from dporl.privacy.relations import ADD_REMOVE
from dporl.utils.validation import PrivacyBudgetError, ValidationError, check_positive, check_probability

Estimator = Literal["auto", "wis", "pdis", "dr", "fqe", "none"]
TRAIN_CELL = "train"


def default_fqe_training() -> FQETraining:
    """DP-FQE as measured on the treatment chain (docs/results.md): a Q-function linear in the observation columns
    (scale them to about unit range; ``fqe.hidden_sizes`` for a non-linear one), squared TD error, SGD at lr 0.5,
    300 steps at Poisson rate 0.05 over a fold's units, 8 transitions per unit, the mean of the last half of the
    iterates evaluated."""
    return FQETraining(steps=300, sample_rate=0.05, rows_per_unit=8, max_grad_norm=1.0, optimizer="sgd", lr=0.5,
                       fqe=FQEConfig(hidden_sizes=[], td_loss="mse", target_update_every=25, average_last=0.5))


@dataclass
class OfflineEvalConfig:
    """Private evaluation of the learned policy on logged data (module docstring)."""

    # auto: fqe. The learned policy is greedy, and a deterministic target's importance weights are too heavy-tailed
    # for clipped importance sampling (docs/results.md: DP-WIS of a greedy policy on the treatment chain is biased
    # by the clip); wis / pdis / dr need logged propensities.
    estimator: Estimator = "auto"
    holdout: float = 0.5  # fraction of the units held out for evaluation; 0: reuse the training units
    salt: str = "dporl-holdout"  # public: the keyed hash of unit ids that splits train / held out
    # (epsilon, delta) of the evaluation. None: the run's budget when held out (parallel composition); required
    # when the units are reused (sequential: the training stage gets the rest).
    epsilon: Optional[float] = None
    delta: Optional[float] = None
    unit_clip: float = 12.0  # C: norm bound of a unit's (value sum / value_scale, weight or episode count)
    value_scale: float = 1.0  # public scale of a unit's value sums (about the largest episode return)
    value_range: Optional[tuple[float, float]] = None  # public bounds on the policy value (clip the interval)
    confidence: float = 0.95
    folds: int = 3  # fqe: held-out cells, one DP-FQE each (parallel); the interval is Student-t over them
    fqe: FQETraining = field(default_factory=lambda: default_fqe_training())

    def __post_init__(self) -> None:
        check_probability("eval.offline.holdout", self.holdout, allow_one=False)
        if not self.salt:
            raise ValidationError("eval.offline.salt", "a public, non-empty string chosen before seeing the data")
        if self.epsilon is not None:
            check_positive("eval.offline.epsilon", self.epsilon)
        if self.delta is not None:
            check_probability("eval.offline.delta", self.delta, allow_zero=False, allow_one=False)
        check_positive("eval.offline.unit_clip", self.unit_clip)
        check_positive("eval.offline.value_scale", self.value_scale)
        check_probability("eval.offline.confidence", self.confidence, allow_zero=False, allow_one=False)
        if self.folds < 2:
            raise ValidationError("eval.offline.folds", f"need >= 2 folds for an interval, got {self.folds}")
        if self.value_range is not None and not self.value_range[0] < self.value_range[1]:
            raise ValidationError("eval.offline.value_range", f"expected (low, high), got {self.value_range}")

    @property
    def held_out(self) -> bool:
        return self.holdout > 0


@dataclass(frozen=True)
class EvaluationPlan:
    """What a run's offline evaluation will do, decided before anything is written or spent."""

    estimator: str  # wis | pdis | dr | fqe | none
    partition: Optional[UnitPartition]  # the run's one partition (None: no cells)
    train_cells: Optional[tuple[str, ...]]  # cells training touches (None: every unit)
    budget: Optional[tuple[float, float]]  # the evaluation's (epsilon, delta)
    train_budget: Optional[tuple[float, float]]  # what is left for training (None: no private training)

    @property
    def composition(self) -> str:
        if self.estimator == "none":
            return "none"
        return "parallel (held-out units)" if self.train_cells is not None else "sequential (units reused)"

    def evaluation_cells(self) -> list[str]:
        if self.partition is None:
            return []
        return [name for name in self.partition.names if name != TRAIN_CELL]


def resolve_estimator(config: OfflineEvalConfig, dataset: TrajectoryDataset) -> str:
    """The estimator ``auto`` stands for, and a refusal when the data cannot feed the one asked for."""
    has_propensities = dataset.behavior_log_probs is not None
    if config.estimator == "auto":
        return "fqe"
    if config.estimator in ("wis", "pdis", "dr") and not has_propensities:
        raise ValidationError(
            "eval.offline.estimator", f"{config.estimator} needs the behaviour policy's propensities, and the data "
            "log none (give the table's propensity column, or use estimator fqe)"
        )
    return config.estimator


def plan_evaluation(
    config: OfflineEvalConfig,
    dataset: TrajectoryDataset,
    run_budget: tuple[float, float],
    train_budget: Optional[tuple[float, float]],
) -> EvaluationPlan:
    """The partition, cells and budgets of an offline evaluation (pure: refusals come before any write).

    ``run_budget`` is the run's (epsilon, delta); ``train_budget`` the training stage's budget without an evaluation
    (None: the training is not private).
    """
    estimator = resolve_estimator(config, dataset)
    if estimator == "none":
        return EvaluationPlan("none", None, None, None, train_budget)
    h = config.holdout
    cells: dict[str, float] = {TRAIN_CELL: 1 - h} if config.held_out else {}
    share = h if config.held_out else 1.0
    if estimator == "fqe":
        cells.update({f"evaluate{i}": share / config.folds for i in range(config.folds)})
    elif estimator == "dr":
        cells.update({"model": share / 2, "estimate": share / 2})
    elif config.held_out:
        cells["evaluate"] = h
    partition = UnitPartition(config.salt, cells) if len(cells) >= 2 else None
    if config.held_out:
        budget = (run_budget[0] if config.epsilon is None else config.epsilon,
                  run_budget[1] if config.delta is None else config.delta)
        if budget[0] > run_budget[0] or budget[1] > run_budget[1]:
            raise PrivacyBudgetError(
                "eval.offline.epsilon", f"the evaluation's ({budget[0]:g}, {budget[1]:g}) exceeds the run's budget "
                f"({run_budget[0]:g}, {run_budget[1]:g})"
            )
        return EvaluationPlan(estimator, partition, (TRAIN_CELL,), budget, train_budget)
    if config.epsilon is None or config.delta is None:
        raise ValidationError(
            "eval.offline.epsilon", "holdout 0 reuses the training units, so the evaluation composes sequentially "
            "with training: give its share of the budget (eval.offline.epsilon and eval.offline.delta), or hold "
            "units out (eval.offline.holdout > 0: parallel composition, no budget taken from training)"
        )
    budget = (config.epsilon, config.delta)
    if train_budget is not None:
        left = (train_budget[0] - budget[0], train_budget[1] - budget[1])
        if left[0] <= 0 or left[1] <= 0:
            raise ValidationError(
                "eval.offline.epsilon", f"the evaluation's ({budget[0]:g}, {budget[1]:g}) leaves nothing of the "
                f"training budget ({train_budget[0]:g}, {train_budget[1]:g}) when the units are reused"
            )
        train_budget = left
    return EvaluationPlan(estimator, partition, None, budget, train_budget)


def check_cells(plan: EvaluationPlan, dataset: TrajectoryDataset, relation=ADD_REMOVE) -> dict[str, TrajectoryDataset]:
    """Every cell's dataset (a cell without units is refused by name, before anything is spent)."""
    if plan.partition is None:
        return {}
    parts = plan.partition.split(dataset)
    if plan.estimator in ("wis", "pdis", "dr"):  # the noise multipliers are public functions of the budget
        gaussian_noise_multiplier(*plan.budget, relation)
    return parts


def evaluate_offline(
    plan: EvaluationPlan,
    config: OfflineEvalConfig,
    dataset: TrajectoryDataset,
    policy: Any,
    *,
    gamma: float,
    ledger: PrivacyLedger,
    root: SecretRoot,
    work_dir: Path,
    units: Optional[Units] = None,
) -> OPEResult:
    """Run the planned estimator on the evaluation cells (the ledger holds ``plan.partition`` already). ``units``:
    the run's counts per cell (released, or public under replace-one), DP-FQE's normalisers."""
    eps, delta = plan.budget
    common = dict(ledger=ledger, root=root, unit_clip=config.unit_clip, value_scale=config.value_scale,
                  confidence=config.confidence, value_range=config.value_range)
    cells = plan.evaluation_cells()
    if plan.estimator in ("wis", "pdis"):
        held = plan.partition.split(dataset)["evaluate"] if plan.partition is not None else dataset
        return dp_importance_sampling(held, policy, epsilon=eps, delta=delta, kind=plan.estimator, gamma=gamma,
                                      cells=cells or None, **common)
    if plan.estimator == "fqe":
        training = _fqe_training(config.fqe, gamma)
        return dp_fqe(dataset, policy, epsilon=eps, delta=delta, run_dir=work_dir, training=training,
                      fold_cells=cells, stage="fqe", units=units, **common)
    if plan.estimator == "dr":
        parts = plan.partition.split(dataset)
        training = _fqe_training(config.fqe, gamma)
        model = fit_dp_fqe(parts["model"], policy, epsilon=eps, delta=delta, ledger=ledger, root=root,
                           run_dir=work_dir / "model", stage="dr/model", cells=["model"], training=training,
                           units=None if units is None else units.of("model"))
        result = dp_importance_sampling(
            parts["estimate"], policy, epsilon=eps, delta=delta, kind="dr", gamma=gamma, q_model=model.q_values,
            stage="dr/estimate", cells=["estimate"], **common,
        )
        return OPEResult(**{**result.to_dict(), "stages": ["dr/model", "dr/estimate"]})
    raise ValidationError("eval.offline.estimator", f"unknown estimator {plan.estimator!r}")


def _fqe_training(training: FQETraining, gamma: float) -> FQETraining:
    """FQE evaluates the discounted value the run's gamma defines."""
    if math.isclose(training.fqe.gamma, gamma):
        return training
    from dataclasses import replace

    return replace(training, fqe=replace(training.fqe, gamma=gamma))


def stage_names(plan: EvaluationPlan) -> list[str]:
    """The ledger stages the evaluation opens (for resuming: a paid evaluation is never repeated)."""
    if plan.estimator in ("wis", "pdis"):
        return [f"ope/{plan.estimator}"]
    if plan.estimator == "dr":
        return ["dr/model", "dr/estimate"]
    if plan.estimator == "fqe":
        return [f"{cell}/{part}" for cell in plan.evaluation_cells() for part in ("train", "value")]
    return []
