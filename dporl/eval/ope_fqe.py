"""DP fitted-Q evaluation (Le, Voloshin, Yue 2019) at the unit level, on K disjoint folds of units.

Per fold: unit-level DP-SGD FQE through the Trainer (``fit_dp_fqe``: Poisson over the fold's units, each sampled
unit's gradient the mean over at most ``rows_per_unit`` of its own rows drawn without replacement, clipped, then
weighted by the unit's transitions per episode over the declared horizon (``row_weights``: a unit's plain mean would
weigh a transition by one over the unit's rows, which depends on how its episodes turned out and biased the fixed
point, measured +0.7 on the suite's hospital stays without noise), Gaussian noise), at (train_fraction epsilon,
delta / 2); then the fold's mean initial-state value released by one Gaussian
mechanism at the rest (``dporl.eval.ope_release``): every unit's row (sum of its episodes' centred V(s0) / half, its
number of episodes, its number of episodes whose V(s0) lies outside the value range by a quarter of its width),
with V(s0) clamped into the value range. Its interval is Student-t over the K fold values: the folds are split by a
keyed hash (``dporl.privacy.partition``), each trained and evaluated on its own units only, so they compose in
parallel (the guarantee is one fold's budget) and their values are independent draws of the whole procedure.

Scales (``dporl.eval.ope_scales``): Q is learnt in units of half the value range (``reward_scale``), every TD
target is clipped to the value range widened by its width on each side (``target_range``, ``scaled_training``),
the value release's unit clip is declared or sqrt 3 times the declared episodes per unit. DP-SGD divides its noisy sum by the expected batch: ``FQETraining.expected_units``
(a public constant), else sample_rate x a released count of the fold's units (``units``: the run's counts, or one
count per fold released here with ``count_fraction`` of the budget, ``dporl.privacy.count``), never the private
count. Before training, the noise is predicted from those counts and the run refuses if it exceeds the tolerance
(``dporl.eval.ope_feasibility``).

Divergence, from released quantities only: a fold whose released Q-network has a non-finite parameter, or whose
released out-of-range count exceeds half its released episode count by more than three noise standard deviations
(the fit left the value range on most initial states, beyond what the noise explains), has diverged; the result
is then NaN with the value range as its interval, ``calibrated=False``, and a note naming the fold. The target policy is called on logged states only (never on a terminal placeholder).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal, Optional, Sequence

import numpy as np
import torch

from dporl.algos.fqe import FQE_KEYS, UNIT_WEIGHT, DiscreteFQE, FQEConfig
from dporl.data.dataset import TrajectoryDataset
from dporl.eval.ope_calibration import fqe_caveat
from dporl.eval.ope_feasibility import check_feasible, count_upper, predict_fqe
from dporl.eval.ope_policies import action_probabilities, logged_action_probabilities
from dporl.eval.ope_release import dpsgd_mechanism, dpsgd_noise_multiplier, open_stage, per_unit, release_sums, unit_rows
from dporl.eval.ope_result import OPEResult, finish
from dporl.eval.ope_scales import OPEScales
from dporl.privacy.count import CountPlan, release_count
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.partition import fold_partition
from dporl.privacy.randomness import SecretRoot
from dporl.privacy.relations import ADD_REMOVE
from dporl.privacy.samplers import PoissonUnitSource
from dporl.privacy.units import dataset_unit
from dporl.train.config import DPConfig, OptimizerConfig, TrainerConfig
from dporl.train.trainer import Trainer
from dporl.utils.seeding import seeded
from dporl.utils.validation import ValidationError, check_positive, check_probability

OUTSIDE_MARGIN = 0.25  # a V(s0) beyond the value range by this fraction of its width counts as out of range
DIVERGED_SHARE = 0.5  # a fold whose released out-of-range share exceeds this (beyond the noise) has diverged
DIVERGED_MARGIN = 3.0  # ... by this many noise standard deviations


@dataclass
class FQETraining:
    """DP-SGD settings of DP-FQE (per fold), with the FQE model's (``fqe``). The defaults are those the benchmark
    suite measured stable (``dporl.eval.ope_suite``)."""

    steps: int = 300
    sample_rate: float = 0.05  # Poisson rate over units (a public constant, not derived from the data)
    rows_per_unit: int = 8  # at most this many distinct transitions per sampled unit (its gradient averages them)
    max_grad_norm: float = 1.0
    optimizer: Literal["sgd", "adam"] = "sgd"
    lr: float = 0.2
    train_fraction: float = 0.8  # of each fold's epsilon; the rest releases the initial-state value
    # DP-SGD divides the noisy sum of clipped unit gradients by the expected batch: this public constant, or (None)
    # sample_rate x a released count of the units trained on (the run's count, or dp_fqe's own per fold).
    expected_units: Optional[float] = None
    fqe: FQEConfig = field(default_factory=FQEConfig)
    progress: bool = False  # a progress bar per fold's DP-SGD training
    # Public: the Q-network's initialisation (dp_fqe's fold i starts from seed + i). Seeded, so a run with a fixed
    # noise_seed reproduces exactly.
    seed: int = 0

    def __post_init__(self) -> None:
        if self.steps < 1 or self.rows_per_unit < 1:
            raise ValidationError("fqe.steps", "steps and rows_per_unit must be >= 1")
        check_probability("fqe.sample_rate", self.sample_rate, allow_zero=False)
        check_positive("fqe.max_grad_norm", self.max_grad_norm)
        check_positive("fqe.lr", self.lr)
        check_probability("fqe.train_fraction", self.train_fraction, allow_zero=False, allow_one=False)
        if self.expected_units is not None:
            check_positive("fqe.expected_units", self.expected_units)

    def averaged_steps(self) -> int:
        return max(1, self.steps - int(self.steps * (1 - self.fqe.average_last))) if self.fqe.average_last else 1


def fqe_normaliser(training: FQETraining, units: Optional[float], what: str = "fqe") -> float:
    """The public expected batch DP-FQE divides by: ``training.expected_units``, else sample_rate x ``units`` (a
    released or public count; at least one unit). Refused by name when neither is given."""
    if training.expected_units is not None:
        return float(training.expected_units)
    if units is None:
        raise ValidationError(
            "fqe.expected_units", f"{what}: DP-SGD divides by the expected batch, and the number of units trained on "
            "is private: give a public fqe.expected_units, or units= (a released count of the fold's units)"
        )
    return training.sample_rate * max(float(units), 1.0)


@dataclass(frozen=True)
class FoldCounts:
    """Each fold's count for DP-FQE's normaliser (None: a public normaliser), what is left of each fold's epsilon,
    and the privacy of the counts (None: exact, public counts)."""

    counts: dict[str, Optional[float]]
    epsilon_left: float
    count_epsilon: Optional[float] = None


def fold_counts(ledger: PrivacyLedger, root: SecretRoot, parts: dict[str, TrajectoryDataset], units: Optional[Any],
                epsilon: float, count_fraction: float, stage: str, training: FQETraining) -> FoldCounts:
    """A public normaliser or given counts cost nothing; otherwise one count per fold is released (parallel: one
    stage over the folds' cells) with ``count_fraction`` of epsilon. Whether a fold is empty is private under
    add/remove: an empty fold is DP-FQE over no units (``dporl.privacy.count``), never a refusal."""
    if training.expected_units is not None:
        return FoldCounts({cell: None for cell in parts}, epsilon)
    if units is not None:
        return FoldCounts({cell: (units.of(cell) if hasattr(units, "of") else float(units[cell])) for cell in parts},
                          epsilon, getattr(units, "epsilon", None) if getattr(units, "released", False) else None)
    if ledger.relation != ADD_REMOVE:  # replace-one: the number of units is public
        return FoldCounts({cell: float(part.n_units) for cell, part in parts.items()}, epsilon)
    check_probability("count_fraction", count_fraction, allow_zero=False, allow_one=False)
    plan = CountPlan(count_fraction * epsilon, tuple(parts))
    unit = dataset_unit(next(iter(parts.values())))
    released = release_count(plan, {cell: part.n_units for cell, part in parts.items()}, ledger=ledger, root=root,
                             unit=unit, stage=f"{stage}/count")
    return FoldCounts({cell: float(released.counts[cell]) for cell in parts}, epsilon - plan.epsilon, plan.epsilon)


TARGET_MARGIN = 1.0  # TD targets are clipped to the value range widened by this many widths on each side


def scaled_training(training: FQETraining, scales: OPEScales, gamma: Optional[float]) -> FQETraining:
    """``training`` evaluating the discounted value ``gamma`` defines (None: the model's), with Q learnt in units of
    half the value range and every TD target clipped to the value range widened by ``TARGET_MARGIN`` widths on each
    side (public scales): wide enough that DP-SGD noise around a value near the range's edge is rarely clipped (a
    clip at the edge itself truncates that noise on one side, a bias measured on the suite), narrow enough that a
    noisy target network cannot run away."""
    fqe = training.fqe
    gamma = fqe.gamma if gamma is None else gamma
    lo, hi = scales.value_range
    margin = TARGET_MARGIN * scales.width
    return replace(training, fqe=replace(fqe, gamma=gamma, reward_scale=scales.half,
                                         target_range=((lo - margin) / scales.half, (hi + margin) / scales.half)))


def fit_dp_fqe(
    dataset: TrajectoryDataset,
    policy: Any,
    *,
    epsilon: float,
    delta: float,
    ledger: PrivacyLedger,
    root: SecretRoot,
    run_dir: str | Path,
    stage: str,
    cells: Optional[Sequence[str]] = None,
    training: FQETraining = FQETraining(),
    units: Optional[float] = None,
    length_cap: Optional[int] = None,
) -> DiscreteFQE:
    """Unit-level DP-SGD fitted-Q evaluation through the Trainer, at (epsilon, delta) in ``stage``. DP-SGD divides
    by ``fqe_normaliser(training, units)`` (``units``: a released or public count of ``dataset``'s units).
    ``length_cap``: a public bound on an episode's length (the declared horizon): every transition then weighs
    alike (``row_weights``); None: every unit weighs alike (biased where episode lengths depend on outcomes)."""
    if len(dataset.metadata.obs_shape) != 1:
        raise ValidationError("dataset.metadata.obs_shape", "FQE needs flat observations")
    normaliser = fqe_normaliser(training, units, stage)
    t = dataset.transitions().to_torch()
    # The target is called on logged next states only: after a terminal step the next state is a placeholder
    # (masked by 1 - done in the TD target).
    t["next_pi"] = logged_action_probabilities(policy, t["next_obs"], ~t["terminated"].bool(),
                                               dataset.metadata.n_actions, "logged next states").float()
    data = {k: t[k] for k in FQE_KEYS}
    if length_cap is not None:
        data[UNIT_WEIGHT] = row_weights(dataset, length_cap)
    source = PoissonUnitSource.from_dataset(dataset, data, training.sample_rate, training.rows_per_unit,
                                            expected_batch=normaliser, replace=False)
    relation = ledger.relation
    mechanism = dpsgd_mechanism(relation)
    with seeded(training.seed):  # not the global generator: its state depends on whatever ran before
        algorithm = DiscreteFQE(dataset.metadata.obs_shape[0], dataset.metadata.n_actions, training.fqe,
                                dataset_unit(dataset))
    open_stage(ledger, stage, (epsilon, delta), dataset, cells, mechanism=mechanism)
    steps = training.steps
    algorithm.plan_averaging(steps)
    Trainer(
        algorithm, source,
        config=TrainerConfig(max_steps=steps, progress=training.progress, log_every=steps, eval_every=steps,
                             checkpoint_every=steps, curator_diagnostics=False,
                             optimizer=OptimizerConfig(name=training.optimizer, lr=training.lr)),
        dp=DPConfig(epsilon=epsilon, delta=delta, max_grad_norm=training.max_grad_norm, accountant=mechanism,
                    noise_multiplier=dpsgd_noise_multiplier(epsilon, delta, steps, training.sample_rate, relation)),
        ledger=ledger, run_dir=run_dir, pipeline="dp_fqe", pipeline_config={"stage": stage}, stage=stage,
        secret_root=root,  # streams "<stage>/sampler" and "<stage>/noise" of the run's root
    ).fit()
    algorithm.eval()
    return algorithm


def row_weights(dataset: TrajectoryDataset, length_cap: int) -> torch.Tensor:
    """Every transition's unit weight [n_transitions]: the unit's transitions per episode / ``length_cap`` (<= 1
    when no episode is longer than the cap; clamped to 1 otherwise). With these weights a unit's clipped mean
    gradient counts in proportion to its transitions per episode, so every transition of a unit with a given number
    of episodes weighs alike, whatever its episodes' outcomes (``DiscreteFQE.weighted_row_losses``)."""
    units = torch.from_numpy(dataset.unit_ids.astype(np.int64))
    lengths = torch.from_numpy(np.asarray(dataset.episode_lengths, dtype=np.float64))
    rows = torch.zeros(dataset.n_units, dtype=torch.float64).index_add_(0, units, lengths)
    episodes = torch.zeros(dataset.n_units, dtype=torch.float64).index_add_(0, units, torch.ones_like(lengths))
    per_unit = (rows / episodes.clamp_min(1) / float(length_cap)).clamp(max=1.0)
    return per_unit[units].repeat_interleave(lengths.long()).float()


def _fold_parts(dataset, ledger, folds, salt, stage, fold_cells) -> dict[str, TrajectoryDataset]:
    """The folds' datasets. Under add/remove an empty fold is a dataset of no units (whether it is empty is private,
    ``dporl.privacy.count``); under replace-one it is refused here (the counts are public)."""
    empty = ledger.relation == ADD_REMOVE
    if fold_cells is None:
        return ledger.partition(fold_partition(salt, folds, prefix=f"{stage}-fold")).split(dataset, empty)
    if ledger.unit_partition is None:
        raise ValidationError("fold_cells", "declare the partition on the ledger first")
    if len(fold_cells) < 2 or len(set(fold_cells)) != len(fold_cells):
        raise ValidationError("fold_cells", f"need at least two distinct cells, got {fold_cells!r}")
    every = ledger.unit_partition.split(dataset, empty)
    unknown = [c for c in fold_cells if c not in every]
    if unknown:
        raise ValidationError("fold_cells", f"unknown cell {unknown[0]!r} (cells: {list(every)})")
    return {cell: every[cell] for cell in fold_cells}


def _release_value(model: DiscreteFQE, part: TrajectoryDataset, policy, scales: OPEScales, unit_clip: float,
                   ledger: PrivacyLedger, stage: str, root: SecretRoot) -> tuple[float, bool]:
    """(the fold's released mean initial-state value, whether its released out-of-range count says it diverged):
    one Gaussian release."""
    first = torch.from_numpy(part.initial_observations())
    pi = action_probabilities(policy, first, part.metadata.n_actions, "logged initial states").float()
    v0 = model.state_values(first, pi).double()
    lo, hi = scales.value_range
    margin = OUTSIDE_MARGIN * scales.width
    outside = (~torch.isfinite(v0) | (v0 < lo - margin) | (v0 > hi + margin)).double()
    v0 = torch.nan_to_num(v0, nan=scales.centre).clamp(lo, hi)
    episodes = torch.ones(part.n_episodes, dtype=torch.float64)
    rows = unit_rows([per_unit((v0 - scales.centre) / scales.half, part), per_unit(episodes, part),
                      per_unit(outside, part)], unit_clip)
    sums, std = release_sums(rows, ledger=ledger, stage=stage, noise=root.noise(f"{stage}/noise"))
    A, B, O = (float(x) for x in sums)
    diverged = O > DIVERGED_SHARE * B + DIVERGED_MARGIN * std
    return (scales.centre + scales.half * A / B if B > 0 else math.nan), diverged


def dp_fqe(
    dataset: TrajectoryDataset,
    policy: Any,
    *,
    epsilon: float,
    delta: float,
    ledger: PrivacyLedger,
    root: SecretRoot,
    run_dir: str | Path,
    unit_clip: Optional[float] = None,
    folds: int = 3,
    salt: str = "dporl-fqe-folds",
    training: FQETraining = FQETraining(),
    stage: str = "fqe",
    confidence: float = 0.95,
    gamma: Optional[float] = None,
    scales: Optional[OPEScales] = None,
    value_range: Optional[tuple[float, float]] = None,
    reward_range: Optional[tuple[float, float]] = None,
    horizon: Optional[int] = None,
    episodes_per_unit: Optional[float] = None,
    fold_cells: Optional[Sequence[str]] = None,
    units: Optional[Any] = None,
    count_fraction: float = 0.01,
    tolerance: Optional[float] = None,
) -> OPEResult:
    """DP-FQE on K folds of units (module docstring; parallel composition: the guarantee is one fold's budget).

    ``gamma``: the discount of the value evaluated (None: ``training.fqe.gamma``). Scales: ``scales`` or the
    declared facts (``dporl.eval.ope_scales``). DP-SGD's normaliser: ``fqe_normaliser`` with ``units`` (released or
    public counts per fold cell: a ``dporl.privacy.count.Units`` or a mapping), else, with neither it nor
    ``training.expected_units``, a count per fold released here first (stage "<stage>/count", ``count_fraction`` of
    epsilon). The folds are a new keyed-hash partition (``folds``, ``salt``), or, with ``fold_cells``, those cells of
    the partition the ledger already holds (``dataset`` is then the whole dataset).
    """
    from scipy import stats

    from dporl.eval.ope_importance import resolve_scales

    check_probability("confidence", confidence, allow_zero=False, allow_one=False)
    scales = resolve_scales(scales, training.fqe.gamma if gamma is None else gamma, value_range=value_range,
                            reward_range=reward_range, horizon=horizon, episodes_per_unit=episodes_per_unit)
    clip = scales.unit_clip("fqe", unit_clip)
    training = scaled_training(training, scales, gamma)
    parts = _fold_parts(dataset, ledger, folds, salt, stage, fold_cells)
    found = fold_counts(ledger, root, parts, units, epsilon, count_fraction, stage, training)
    counts, epsilon = found.counts, found.epsilon_left
    if all(c is not None for c in counts.values()):
        fold_units = sum(counts.values())
        high = (None if found.count_epsilon is None else
                sum(count_upper(c, found.count_epsilon) for c in counts.values()))
    else:  # the public normaliser states the expected batch: its fold size is expected_units / sample_rate
        fold_units, high = len(parts) * training.expected_units / training.sample_rate, None
    check_feasible(predict_fqe(
        epsilon=epsilon, delta=delta, relation=ledger.relation, units=fold_units, folds=len(parts), unit_clip=clip,
        scales=scales, steps=training.steps, sample_rate=training.sample_rate,
        train_fraction=training.train_fraction, averaged_steps=training.averaged_steps(), confidence=confidence,
        tolerance=tolerance, units_high=high))
    eps_train = epsilon * training.train_fraction
    values, stages, failures = [], [], []
    for index, (cell, part) in enumerate(parts.items()):
        # Each fold starts from its own public initialisation (seed + index): an initialisation shared by the folds
        # biases them alike, which the spread over folds cannot see; independent starts turn it into spread.
        model = fit_dp_fqe(part, policy, epsilon=eps_train, delta=delta / 2, ledger=ledger, root=root,
                           run_dir=Path(run_dir) / cell, stage=f"{cell}/train", cells=[cell],
                           training=replace(training, seed=training.seed + index), units=counts[cell],
                           length_cap=scales.horizon)
        value_stage = f"{cell}/value"
        open_stage(ledger, value_stage, (epsilon - eps_train, delta / 2), part, [cell],
                   analysis="Gaussian mechanism on clipped unit sums")
        value, diverged = _release_value(model, part, policy, scales, clip, ledger, value_stage, root)
        stages += [f"{cell}/train", value_stage]
        values.append(value)
        if not model.parameters_finite():
            failures.append(f"fold {cell!r} diverged: its released Q-network has non-finite parameters")
        elif not math.isfinite(value):
            failures.append(f"fold {cell!r}: its noisy episode count was <= 0")
        elif diverged:
            failures.append(f"fold {cell!r} diverged: its released count of initial-state values outside the value "
                            f"range by more than {OUTSIDE_MARGIN:.0%} of its width exceeds half its released episode "
                            "count")
    variance = f"Student-t over {len(values)} disjoint folds of units (each fold's sampling and privacy noise; private)"
    notes = [scales.origin, scales.clip_choice("fqe", clip)]
    if failures:
        status = "diverged" if any("diverged" in f for f in failures) else "no_estimate"
        return finish("fqe", math.nan, math.nan, math.nan, confidence=confidence, stages=stages, variance=variance,
                      value_range=scales.value_range, notes=notes, caveat=fqe_caveat(), fold_values=values,
                      status=status, failure="; ".join(failures) + ("; lower fqe.lr, or raise fqe.obs_scale (the "
                      "observations' public scale)" if status == "diverged" else "; raise epsilon or the units per fold"))
    array = np.clip(np.asarray(values), *scales.value_range)  # post-processing with public bounds
    mean = float(np.mean(array))
    half = float(stats.t.ppf(0.5 + confidence / 2, df=len(array) - 1) * np.std(array, ddof=1) / math.sqrt(len(array)))
    return finish("fqe", mean, mean - half, mean + half, confidence=confidence, stages=stages, variance=variance,
                  value_range=scales.value_range, notes=notes, caveat=fqe_caveat(), fold_values=values)
