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

Public scales (``dporl.eval.ope_scales``): the evaluation needs the declared per-step ``reward_range`` (with the run's
gamma and the declared ``horizon``) or the declared ``value_range``; it is refused by name, before anything is
written, without one. The unit clip is declared (``unit_clip``) or derived from the declared ``episodes_per_unit``
(and, for importance sampling, ``min_propensity`` and ``horizon``). Feasibility (``check_feasible``): once the
number of units per cell is known (the run's released count, or public under replace-one) and before anything else
is spent, the noise of the estimate is predicted and the run refuses, naming how many units or how much epsilon
would be needed, when it exceeds ``tolerance`` (default: the width of the value range).

The ledger's report says which composition it applied. Estimators (``estimator``): ``fqe`` (DP fitted-Q evaluation
on ``folds`` held-out cells; needs no propensities; the default, ``auto``: the learned policy is greedy, and clipped
importance sampling of a deterministic policy is biased by its clip), ``wis`` (weighted importance sampling),
``pdis``, ``dr`` (doubly robust: a DP-FQE model on one held-out cell, the estimate on another; these three need
logged propensities), ``none``. Cells: "train" and "evaluate" (wis, pdis), "evaluate0".. (fqe), "model" and
"estimate" (dr). The target is the released greedy policy; the interval accounts for sampling and privacy noise
(``calibrated`` says whether the benchmark suite measured it nominal, ``dporl.eval.ope_calibration``).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Optional

from dporl.data.dataset import TrajectoryDataset
from dporl.eval.ope_feasibility import Feasibility, check_feasible, count_upper, predict_fqe, predict_ratio
from dporl.eval.ope_fqe import FQETraining, dp_fqe, fit_dp_fqe, scaled_training
from dporl.eval.ope_importance import dp_importance_sampling
from dporl.eval.ope_release import gaussian_noise_multiplier
from dporl.eval.ope_result import OPEResult
from dporl.eval.ope_scales import OPEScales
from dporl.privacy.count import Units, check_cells_hold_units
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.partition import UnitPartition
from dporl.privacy.randomness import SecretRoot
from dporl.privacy.relations import ADD_REMOVE
from dporl.utils.validation import PrivacyBudgetError, ValidationError, check_positive, check_probability

Estimator = Literal["auto", "wis", "pdis", "dr", "fqe", "none"]
TRAIN_CELL = "train"


FIELD = "eval.offline."


@dataclass
class OfflineEvalConfig:
    """Private evaluation of the learned policy on logged data (module docstring). Every scale is public: declared
    here, never read from the data."""

    # auto: fqe. The learned policy is greedy, and a deterministic target's importance weights are too heavy-tailed
    # for clipped importance sampling; wis / pdis / dr need logged propensities.
    estimator: Estimator = "auto"
    holdout: float = 0.5  # fraction of the units held out for evaluation; 0: reuse the training units
    salt: str = "dporl-holdout"  # public: the keyed hash of unit ids that splits train / held out
    # (epsilon, delta) of the evaluation. None: the run's budget when held out (parallel composition); required
    # when the units are reused (sequential: the training stage gets the rest).
    epsilon: Optional[float] = None
    delta: Optional[float] = None
    # Declared public bounds (one of the two is required): the per-step reward range, from which the value range is
    # derived with the run's gamma and the horizon; or the value range itself (bounds on any episode's discounted
    # return, e.g. [-2, 1] when a treatment costs at most 0.1 a step at gamma 0.95 and one final reward pays 1).
    reward_range: Optional[tuple[float, float]] = None
    value_range: Optional[tuple[float, float]] = None
    horizon: Optional[int] = None  # the most steps an episode takes (None: unbounded)
    episodes_per_unit: Optional[float] = None  # the most episodes one unit logs (units with more are scaled down)
    min_propensity: Optional[float] = None  # every logged action's probability under the behaviour policy is >= it
    # C: the norm bound of a unit's contribution. None: the public maximum (from episodes_per_unit, and for
    # importance sampling min_propensity and horizon): nothing clipped. Smaller: less noise, a clip bias.
    unit_clip: Optional[float] = None
    tolerance: Optional[float] = None  # the widest acceptable predicted interval (None: the value range's width)
    confidence: float = 0.95
    folds: int = 3  # fqe: held-out cells, one DP-FQE each (parallel); the interval is Student-t over them
    fqe: FQETraining = field(default_factory=FQETraining)

    def __post_init__(self) -> None:
        check_probability(FIELD + "holdout", self.holdout, allow_one=False)
        if not self.salt:
            raise ValidationError(FIELD + "salt", "a public, non-empty string chosen before seeing the data")
        if self.epsilon is not None:
            check_positive(FIELD + "epsilon", self.epsilon)
        if self.delta is not None:
            check_probability(FIELD + "delta", self.delta, allow_zero=False, allow_one=False)
        if self.unit_clip is not None:
            check_positive(FIELD + "unit_clip", self.unit_clip)
        if self.tolerance is not None:
            check_positive(FIELD + "tolerance", self.tolerance)
        check_probability(FIELD + "confidence", self.confidence, allow_zero=False, allow_one=False)
        if self.folds < 2:
            raise ValidationError(FIELD + "folds", f"need >= 2 folds for an interval, got {self.folds}")
        OPEScales.check_declared(value_range=self.value_range, reward_range=self.reward_range, horizon=self.horizon,
                                 min_propensity=self.min_propensity, episodes_per_unit=self.episodes_per_unit,
                                 prefix=FIELD)

    @property
    def held_out(self) -> bool:
        return self.holdout > 0

    def scales(self, gamma: float) -> OPEScales:
        """The public scales at the run's ``gamma`` (refused by name when no range is declared)."""
        return OPEScales.declare(value_range=self.value_range, reward_range=self.reward_range, gamma=gamma,
                                 horizon=self.horizon, min_propensity=self.min_propensity,
                                 episodes_per_unit=self.episodes_per_unit, prefix=FIELD)


@dataclass(frozen=True)
class EvaluationPlan:
    """What a run's offline evaluation will do, decided before anything is written or spent."""

    estimator: str  # wis | pdis | dr | fqe | none
    partition: Optional[UnitPartition]  # the run's one partition (None: no cells)
    train_cells: Optional[tuple[str, ...]]  # cells training touches (None: every unit)
    budget: Optional[tuple[float, float]]  # the evaluation's (epsilon, delta)
    train_budget: Optional[tuple[float, float]]  # what is left for training (None: no private training)
    scales: Optional[OPEScales] = None  # the declared public scales (None: no evaluation)
    unit_clip: Optional[float] = None  # the clip of the estimate's release (declared or derived)

    @property
    def composition(self) -> str:
        if self.estimator == "none":
            return "none"
        return "parallel (held-out units)" if self.train_cells is not None else "sequential (units reused)"

    def evaluation_cells(self) -> list[str]:
        if self.partition is None:
            return []
        return [name for name in self.partition.names if name != TRAIN_CELL]

    def describe_scales(self) -> list[str]:
        """The lines a run prints about its public scales (config-derived only)."""
        if self.scales is None:
            return []
        kind = "fqe" if self.estimator == "fqe" else self.estimator
        return [f"public scales: {self.scales.origin}", f"clip: {self.scales.clip_choice(kind, self.unit_clip)}"]


def resolve_estimator(config: OfflineEvalConfig, dataset: TrajectoryDataset) -> str:
    """The estimator ``auto`` stands for, and a refusal when the data cannot feed the one asked for."""
    has_propensities = dataset.behavior_log_probs is not None
    if config.estimator == "auto":
        return "fqe"
    if config.estimator in ("wis", "pdis", "dr") and not has_propensities:
        raise ValidationError(
            FIELD + "estimator", f"{config.estimator} needs the behaviour policy's propensities, and the data "
            "log none (give the table's propensity column, or use estimator fqe)"
        )
    return config.estimator


def plan_evaluation(
    config: OfflineEvalConfig,
    dataset: TrajectoryDataset,
    run_budget: tuple[float, float],
    train_budget: Optional[tuple[float, float]],
    gamma: float = 0.99,
) -> EvaluationPlan:
    """The partition, cells, budgets and public scales of an offline evaluation (pure: refusals come before any
    write).

    ``run_budget`` is the run's (epsilon, delta); ``train_budget`` the training stage's budget without an evaluation
    (None: the training is not private); ``gamma`` the run's discount (the value range derives from it).
    """
    estimator = resolve_estimator(config, dataset)
    if estimator == "none":
        return EvaluationPlan("none", None, None, None, train_budget)
    scales = config.scales(gamma)
    clip = scales.unit_clip("fqe" if estimator == "fqe" else estimator, config.unit_clip, FIELD + "unit_clip")
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
                FIELD + "epsilon", f"the evaluation's ({budget[0]:g}, {budget[1]:g}) exceeds the run's budget "
                f"({run_budget[0]:g}, {run_budget[1]:g})"
            )
        return EvaluationPlan(estimator, partition, (TRAIN_CELL,), budget, train_budget, scales, clip)
    if config.epsilon is None or config.delta is None:
        raise ValidationError(
            FIELD + "epsilon", "holdout 0 reuses the training units, so the evaluation composes sequentially "
            "with training: give its share of the budget (eval.offline.epsilon and eval.offline.delta), or hold "
            "units out (eval.offline.holdout > 0: parallel composition, no budget taken from training)"
        )
    budget = (config.epsilon, config.delta)
    if train_budget is not None:
        left = (train_budget[0] - budget[0], train_budget[1] - budget[1])
        if left[0] <= 0 or left[1] <= 0:
            raise ValidationError(
                FIELD + "epsilon", f"the evaluation's ({budget[0]:g}, {budget[1]:g}) leaves nothing of the "
                f"training budget ({train_budget[0]:g}, {train_budget[1]:g}) when the units are reused"
            )
        train_budget = left
    return EvaluationPlan(estimator, partition, None, budget, train_budget, scales, clip)


def check_cells(plan: EvaluationPlan, dataset: TrajectoryDataset, relation=ADD_REMOVE) -> dict[str, TrajectoryDataset]:
    """Every cell's dataset. Under replace-one (the counts are public) a cell without units is refused by name,
    before anything is spent; under add/remove whether a cell is empty is private, so an empty cell is a dataset of
    no units here (its mechanisms run over no units), and the run refuses a cell only on its released count
    (``check_cell_counts``, after the count)."""
    if plan.partition is None:
        return {}
    parts = plan.partition.split(dataset, allow_empty=relation == ADD_REMOVE)
    if plan.estimator in ("wis", "pdis", "dr"):  # the noise multipliers are public functions of the budget
        gaussian_noise_multiplier(*plan.budget, relation)
    return parts


def check_cell_counts(plan: EvaluationPlan, units: Units, remedy: str = "") -> None:
    """Refuse, by name, a run with a cell whose count in ``units`` (released, or public under replace-one) is below
    one: ``dporl.privacy.count.check_cells_hold_units``."""
    if plan.partition is not None:
        check_cells_hold_units(units, dict(plan.partition.cells), "eval.offline.holdout", remedy)


def predict_noise(plan: EvaluationPlan, config: OfflineEvalConfig, units: Units, dataset: TrajectoryDataset,
                  gamma: float, relation=ADD_REMOVE) -> Optional[Feasibility]:
    """The predicted noise of the planned estimate from ``units`` (the run's released counts, or public under
    replace-one) and public inputs (None without an evaluation)."""
    if plan.estimator == "none" or plan.scales is None:
        return None
    eps, delta = plan.budget
    count_eps = units.epsilon if units.released else None
    common = dict(epsilon=eps, delta=delta, relation=relation, unit_clip=plan.unit_clip, scales=plan.scales,
                  confidence=config.confidence, tolerance=config.tolerance, field=FIELD + "estimator")
    if plan.estimator in ("wis", "pdis", "dr"):
        cell = {"dr": "estimate", "wis": "evaluate", "pdis": "evaluate"}[plan.estimator]
        count = units.of(cell if plan.partition is not None else None)
        high = None if count_eps is None else count_upper(count, count_eps)
        return predict_ratio(plan.estimator, units=count, units_high=high, **common)
    training = scaled_training(config.fqe, plan.scales, gamma)
    cells = plan.evaluation_cells()
    counts = [units.of(c) for c in cells]
    high = None if count_eps is None else sum(count_upper(c, count_eps) for c in counts)
    return predict_fqe(units=sum(counts), folds=len(cells), steps=training.steps, sample_rate=training.sample_rate,
                       train_fraction=training.train_fraction, averaged_steps=training.averaged_steps(),
                       units_high=high, **common)


def check_noise(plan: EvaluationPlan, config: OfflineEvalConfig, units: Units, dataset: TrajectoryDataset,
                gamma: float, relation=ADD_REMOVE) -> None:
    """Refuse, before anything but the count is spent, an evaluation whose predicted noise exceeds its tolerance
    (``dporl.eval.ope_feasibility``); the refusal names the units or epsilon needed."""
    prediction = predict_noise(plan, config, units, dataset, gamma, relation)
    if prediction is not None:
        label = "held-out units" if plan.train_cells is not None else "units"
        check_feasible(replace(prediction, units_label=label))


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
    the run's counts per cell (released, or public under replace-one), DP-FQE's normalisers. A cell without units
    (add/remove: private, ``check_cells``) is estimated over no units."""
    eps, delta = plan.budget
    common = dict(ledger=ledger, root=root, unit_clip=plan.unit_clip, confidence=config.confidence,
                  scales=plan.scales, tolerance=config.tolerance)
    cells = plan.evaluation_cells()
    if plan.estimator in ("wis", "pdis"):
        held = plan.partition.split(dataset, allow_empty=True)["evaluate"] if plan.partition is not None else dataset
        # (its feasibility was checked before training: ``check_noise``)
        return dp_importance_sampling(held, policy, epsilon=eps, delta=delta, kind=plan.estimator, gamma=gamma,
                                      cells=cells or None, **common)
    if plan.estimator == "fqe":
        return dp_fqe(dataset, policy, epsilon=eps, delta=delta, run_dir=work_dir, training=config.fqe, gamma=gamma,
                      fold_cells=cells, stage="fqe", units=units, **common)
    if plan.estimator == "dr":
        parts = plan.partition.split(dataset, allow_empty=True)
        training = scaled_training(config.fqe, plan.scales, gamma)
        model = fit_dp_fqe(parts["model"], policy, epsilon=eps, delta=delta, ledger=ledger, root=root,
                           run_dir=work_dir / "model", stage="dr/model", cells=["model"], training=training,
                           units=None if units is None else units.of("model"), length_cap=plan.scales.horizon)
        result = dp_importance_sampling(
            parts["estimate"], policy, epsilon=eps, delta=delta, kind="dr", gamma=gamma, q_model=model.q_values,
            stage="dr/estimate", cells=["estimate"], **common,
        )
        return OPEResult(**{**result.to_dict(), "stages": ["dr/model", "dr/estimate"]})
    raise ValidationError(FIELD + "estimator", f"unknown estimator {plan.estimator!r}")


def stage_names(plan: EvaluationPlan) -> list[str]:
    """The ledger stages the evaluation opens (for resuming: a paid evaluation is never repeated)."""
    if plan.estimator in ("wis", "pdis"):
        return [f"ope/{plan.estimator}"]
    if plan.estimator == "dr":
        return ["dr/model", "dr/estimate"]
    if plan.estimator == "fqe":
        return [f"{cell}/{part}" for cell in plan.evaluation_cells() for part in ("train", "value")]
    return []
