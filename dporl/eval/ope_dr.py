"""DP doubly robust evaluation: a DP-FQE model on one cell of units, the DR estimate released on another.

The model is fitted by DP-FQE (``dporl.eval.ope_fqe.fit_dp_fqe``) on the "model" cell of a keyed-hash
``UnitPartition`` and released (DP) before the estimate uses it; the estimate (``dporl.eval.ope_importance``,
``kind="dr"``) is released on the "estimate" cell with the model's Q-values clamped into the value range. Both stages
run at (epsilon, delta) on disjoint cells: parallel composition, guarantee (epsilon, delta). The model evaluates the
discount DR's ``gamma`` defines (by default the model's own), so the defaults agree.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from dporl.algos.fqe import DiscreteFQE
from dporl.data.dataset import TrajectoryDataset
from dporl.eval.ope_fqe import FQETraining, fit_dp_fqe, fold_counts, scaled_training
from dporl.eval.ope_importance import dp_importance_sampling, resolve_scales
from dporl.eval.ope_result import OPEResult
from dporl.eval.ope_scales import OPEScales
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.partition import UnitPartition
from dporl.privacy.relations import ADD_REMOVE
from dporl.privacy.randomness import SecretRoot
from dporl.utils.validation import ValidationError


def dp_doubly_robust(
    dataset: TrajectoryDataset,
    policy: Any,
    *,
    epsilon: float,
    delta: float,
    ledger: PrivacyLedger,
    root: SecretRoot,
    run_dir: str | Path,
    unit_clip: Optional[float] = None,
    gamma: Optional[float] = None,
    partition: Optional[UnitPartition] = None,
    training: FQETraining = FQETraining(),
    confidence: float = 0.95,
    scales: Optional[OPEScales] = None,
    value_range: Optional[tuple[float, float]] = None,
    reward_range: Optional[tuple[float, float]] = None,
    horizon: Optional[int] = None,
    min_propensity: Optional[float] = None,
    episodes_per_unit: Optional[float] = None,
    min_signal: float = 0.0,
    units: Optional[Any] = None,
    count_fraction: float = 0.01,
    tolerance: Optional[float] = None,
) -> tuple[OPEResult, DiscreteFQE]:
    """DR with its Q-model fitted by DP-FQE on the "model" cell and the estimate released on the "estimate" cell
    (module docstring). ``gamma`` None: the model's. The model's DP-SGD normaliser comes from ``units`` /
    ``count_fraction`` as in ``dp_fqe`` (cell "model"); ``units`` (cell "estimate") also feeds the estimate's
    feasibility check."""
    gamma = training.fqe.gamma if gamma is None else gamma
    scales = resolve_scales(scales, gamma, value_range=value_range, reward_range=reward_range, horizon=horizon,
                            min_propensity=min_propensity, episodes_per_unit=episodes_per_unit)
    partition = ledger.partition(partition or UnitPartition("dporl-dr-split", {"estimate": 0.5, "model": 0.5}))
    if set(partition.names) != {"estimate", "model"}:
        raise ValidationError("partition", "the DR split needs cells 'estimate' and 'model'")
    parts = partition.split(dataset, allow_empty=ledger.relation == ADD_REMOVE)  # (private under add/remove)
    training = scaled_training(training, scales, gamma)
    found = fold_counts(ledger, root, {"model": parts["model"]}, units, epsilon, count_fraction, "dr", training)
    counts, model_epsilon = found.counts, found.epsilon_left
    estimate_units = None
    if units is not None:
        estimate_units = units.of("estimate") if hasattr(units, "of") else float(units["estimate"])
    model = fit_dp_fqe(parts["model"], policy, epsilon=model_epsilon, delta=delta, ledger=ledger, root=root,
                       run_dir=Path(run_dir) / "model", stage="dr/model", cells=["model"], training=training,
                       units=counts["model"], length_cap=scales.horizon)
    result = dp_importance_sampling(
        parts["estimate"], policy, epsilon=epsilon, delta=delta, ledger=ledger, root=root, unit_clip=unit_clip,
        kind="dr", gamma=gamma, q_model=model.q_values, stage="dr/estimate", cells=["estimate"],
        confidence=confidence, scales=scales, min_signal=min_signal, units=estimate_units, tolerance=tolerance,
    )
    return OPEResult(**{**result.to_dict(), "stages": ["dr/model", "dr/estimate"]}), model
