"""Private evaluation of a target policy on logged data, at the level of the dataset's privacy unit.

Estimators (all return an ``OPEResult``: a value with a confidence interval covering sampling AND privacy noise,
every release recorded in the run's ``PrivacyLedger``):

- ``dp_importance_sampling(kind="wis")``: weighted (self-normalised) trajectory-wise importance sampling
  (Precup, Sutton, Singh 2000): V = sum_e w_e G_e / sum_e w_e, w_e = prod_t pi(a_t|s_t) / mu(a_t|s_t).
- ``kind="pdis"``: per-decision importance sampling, normalised by the number of episodes.
- ``kind="dr"``: doubly robust (Jiang & Li 2016): per episode sum_t gamma^t [rho_{0:t} (r_t - Q(s_t, a_t))
  + rho_{0:t-1} V(s_t)], with a model Q fitted on OTHER units (``dp_doubly_robust`` fits it by DP-FQE on the
  held-out cell of a ``UnitPartition`` and spends the two budgets in parallel).
- ``dp_fqe``: DP fitted-Q evaluation (unit-level DP-SGD through the Trainer; needs no propensities), run on K
  disjoint folds of units.

Sensitivity on FIXED neighbouring datasets (add/remove one unit, which may own many episodes). Every estimator is a
ratio of two sums over units, sum_u a_u / sum_u b_u (WIS: a_u = sum of w_e G_e over the unit's episodes, b_u = sum
of w_e; PDIS / DR / FQE's initial-state value: a_u = sum of the unit's per-episode estimates, b_u = its number of
episodes). Each unit's pair is scaled to x_u = (a_u / value_scale, b_u) * min(1, C / ||(a_u / value_scale, b_u)||)
/ C: its L2 norm is <= 1 whatever the data, and scaling both coordinates by one factor keeps the unit's own ratio
(a clipped unit is down-weighted, not distorted). Removing a unit removes one x_u: no other unit's contribution
changes, and nothing divides by the number of units, so that number stays private. DP-FQE's DP-SGD divides its
noisy sum by the expected batch: ``FQETraining.expected_units`` (a public constant), else sample_rate x a released
count of the fold's units (``units``: the run's count, or one ``dp_fqe`` releases itself per fold with a
``count_fraction`` of the budget, ``dporl.privacy.count``), never the private count. The released vector is
z = sum_u (x_u1, x_u2, x_u1^2, sqrt(2) x_u1 x_u2, x_u2^2) + N(0, (sigma sqrt 2)^2 I): ||z_u||^2 =
|x_u|^2 + |x_u|^4 <= 2, so one Gaussian mechanism with L2 sensitivity sqrt 2 and noise multiplier sigma, recorded as
``PoissonGaussianEvent(sigma, 1)`` and calibrated to the stage's budget by PLD. ``value_scale`` and ``C``
(``unit_clip``, in episodes) are public choices; clipping biases the estimate when a unit exceeds C (it is
down-weighted), which the coverage study measures.

Confidence interval (delta method for a ratio of sums over independently drawn units, plus the Gaussian noise):
Var(V) = value_scale^2 [Q + s^2 (1 + r^2)] / B^2 with r = A / B, s = sigma sqrt 2 the noise std per coordinate and
Q = S_aa - 2 r S_ab + r^2 S_bb the within-sample variance of a_u - r b_u, computed from the NOISY second moments:
the sampling variance is itself estimated privately, in the same release. When the noisy denominator is below
``min_signal`` noise standard deviations the linearisation is not trusted and the interval is the public
``value_range`` (or unbounded). DP-FQE's interval instead comes from K folds of units split by a keyed hash
(``dporl.privacy.partition``): each fold is trained and evaluated on its own units only, so the folds compose in
parallel (the guarantee is one fold's budget) and their K estimates are independent draws of the whole
procedure, sampling and privacy noise included; the interval is Student-t over the K estimates.

The target policy is a callable obs [B, d] -> action probabilities [B, A], or a dporl policy: a module with
``action_probabilities(obs)`` or a greedy ``act(obs)`` (one-hot probabilities). It is public.

Flags and notes are functions of public inputs or of the release. Whether a result is ``calibrated`` (and the
caveat that says why not) depends on the estimator, the config and a DECLARED property of the target: whether it
is deterministic (``target_is_deterministic``), never on the probabilities it gives the LOGGED states. Read off the
logged states, the flag of a target deterministic in some states only would tell which states were logged. The
notes on the noisy denominator and the noisy variance read the released sums only.

Neighbouring relation: the ledger's (``PrivacyLedger.relation``). For replace-one neighbours every release is
calibrated and recorded for replace-one (``relations.analysed_for``: the Gaussian at twice the sensitivity, DP-FQE's
steps by the replace-one PLD), and the number of units is public (``units`` may then be the exact counts).
"""

from __future__ import annotations

import functools
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable, Literal, Optional, Sequence

import numpy as np
import torch

from dporl.algos.fqe import FQE_KEYS, DiscreteFQE, FQEConfig
from dporl.data.dataset import TrajectoryDataset
from dporl.privacy.calibration import calibrate_noise_multiplier
from dporl.privacy.count import CountPlan, release_count
from dporl.privacy.events import PoissonGaussianEvent
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.noise import NoiseSource
from dporl.privacy.partition import UnitPartition, fold_partition
from dporl.privacy.randomness import SecretRoot
from dporl.privacy.relations import ADD_REMOVE, CONVERSION, analysed_for
from dporl.privacy.samplers import PoissonUnitSource
from dporl.privacy.units import dataset_unit
from dporl.train.config import DPConfig, OptimizerConfig, TrainerConfig
from dporl.train.trainer import Trainer
from dporl.utils.seeding import seeded
from dporl.utils.validation import ValidationError, check_positive, check_probability

Policy = Callable[[torch.Tensor], torch.Tensor]
_SQRT2 = math.sqrt(2.0)


# ---------------------------------------------------------------------------------------------------- results
@dataclass(frozen=True)
class OPEResult:
    estimator: str
    value: float
    ci_low: float
    ci_high: float
    confidence: float
    stages: list[str]
    variance: str  # how the interval's variance was obtained (and that it is private)
    fold_values: Optional[list[float]] = None
    notes: list[str] = field(default_factory=list)
    # Whether simulation found the interval's coverage nominal in this use (docs/results.md); False: the interval
    # accounts for sampling and privacy noise but NOT for a bias the notes name (read it as indicative only).
    calibrated: bool = True

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def describe(self) -> str:
        return (
            f"{self.estimator}: value {self.value:.4g}, {100 * self.confidence:g}% interval "
            f"[{self.ci_low:.4g}, {self.ci_high:.4g}] ({self.variance})"
            + ("" if self.calibrated else "; NOT CALIBRATED: " + self.notes[-1])
        )


# ---------------------------------------------------------------------------------------------------- policies
def action_probabilities(policy: Any, obs: torch.Tensor, n_actions: int) -> torch.Tensor:
    """pi(. | s) [B, n_actions] (float64) from a callable or a dporl policy module; validated."""
    with torch.no_grad():
        if hasattr(policy, "action_probabilities"):
            probs = policy.action_probabilities(obs)
        elif hasattr(policy, "act") and isinstance(policy, torch.nn.Module):
            probs = torch.nn.functional.one_hot(policy.act(obs).long().cpu(), n_actions)
        elif callable(policy):
            probs = policy(obs)
        else:
            raise ValidationError("policy", f"expected a callable obs -> probabilities or a dporl policy, got {policy!r}")
    probs = torch.as_tensor(probs).detach().cpu().double()
    if probs.shape != (obs.shape[0], n_actions):
        raise ValidationError("policy", f"expected probabilities of shape {(obs.shape[0], n_actions)}, got {tuple(probs.shape)}")
    if not torch.isfinite(probs).all() or (probs < 0).any() or (probs.sum(1) - 1).abs().max() > 1e-4:
        raise ValidationError("policy", "action probabilities must be finite, >= 0 and sum to 1 in every state")
    return probs


def target_is_deterministic(policy: Any) -> Optional[bool]:
    """Whether ``policy`` is deterministic, as it declares itself (public): a ``deterministic`` attribute (True /
    False), else True for a dporl module acting greedily (``act`` and no ``action_probabilities``), else None
    (undeclared). Never computed from the states a dataset logged (module docstring)."""
    declared = getattr(policy, "deterministic", None)
    if isinstance(declared, bool):
        return declared
    if declared is not None:
        raise ValidationError("policy.deterministic", f"expected True or False, got {declared!r}")
    if isinstance(policy, torch.nn.Module) and hasattr(policy, "act") and not hasattr(policy, "action_probabilities"):
        return True
    return None


def declare_deterministic(policy: Policy, deterministic: bool) -> Policy:
    """``policy`` (a callable) marked as deterministic or not, for ``target_is_deterministic``; returns it."""
    if not isinstance(deterministic, bool):
        raise ValidationError("deterministic", f"expected True or False, got {deterministic!r}")
    policy.deterministic = deterministic  # type: ignore[attr-defined]
    return policy


# ---------------------------------------------------------------------------------------------------- mechanism
def _open_stage(ledger: PrivacyLedger, stage: str, budget: tuple[float, float], dataset: TrajectoryDataset,
                cells: Optional[Sequence[str]], mechanism: str = "pld", analysis: Optional[str] = None) -> None:
    if stage in ledger.stages:
        raise ValidationError("stage", f"stage {stage!r} already exists: every release needs its own stage")
    if ledger.relation != ADD_REMOVE:
        analysis = CONVERSION if analysis is None else f"{analysis}; {CONVERSION}"
    ledger.stage(stage, budget=budget, mechanism=mechanism, unit=dataset_unit(dataset), cells=cells,
                 analysis=analysis)


def dpsgd_mechanism(relation) -> str:
    """The analysis of DP-SGD stages: RDP for add/remove, the replace-one PLD otherwise (no RDP curve for it)."""
    return "rdp" if relation == ADD_REMOVE else "pld"


@functools.lru_cache(maxsize=256)
def _dpsgd_noise_multiplier(epsilon: float, delta: float, steps: int, sample_rate: float, relation=ADD_REMOVE
                            ) -> float:
    """sigma for ``steps`` Poisson-subsampled Gaussian steps at (epsilon, delta) for ``relation``; public inputs,
    cached."""
    return calibrate_noise_multiplier(
        epsilon, delta, steps, make_event=lambda sigma: analysed_for(relation, PoissonGaussianEvent(sigma, sample_rate)),
        mechanism=dpsgd_mechanism(relation),
    )


@functools.lru_cache(maxsize=256)
def gaussian_noise_multiplier(epsilon: float, delta: float, relation=ADD_REMOVE) -> float:
    """sigma of one Gaussian mechanism at (epsilon, delta) for ``relation`` neighbours, by PLD."""
    return calibrate_noise_multiplier(
        epsilon, delta, 1, make_event=lambda sigma: analysed_for(relation, PoissonGaussianEvent(sigma, 1.0)),
        mechanism="pld"
    )


def unit_pairs(a_units: torch.Tensor, b_units: torch.Tensor, value_scale: float, unit_clip: float) -> torch.Tensor:
    """Every unit's (a_u / value_scale, b_u) scaled into the unit ball: [n_units, 2], norms <= 1 (module docstring)."""
    pairs = torch.stack([a_units / value_scale, b_units], dim=1).double()
    norms = pairs.norm(dim=1)
    factor = torch.where(norms > unit_clip, unit_clip / norms.clamp_min(1e-300), torch.ones_like(norms))
    return pairs * (factor / unit_clip).unsqueeze(1)


def moment_rows(pairs: torch.Tensor) -> torch.Tensor:
    """Every unit's (x, y, x^2, sqrt 2 x y, y^2) [n_units, 5]: norm^2 = |p|^2 + |p|^4 <= 2 for pairs in the unit ball."""
    x, y = pairs[:, 0], pairs[:, 1]
    return torch.stack([x, y, x * x, _SQRT2 * x * y, y * y], dim=1)


def release_ratio(
    pairs: torch.Tensor,
    *,
    ledger: PrivacyLedger,
    stage: str,
    noise: NoiseSource,
    moments: bool,
) -> dict[str, float]:
    """Pay for, then release, the noisy sums of every unit's pair (and second moments): one Gaussian mechanism.

    ``pairs`` [n_units, 2] with norms <= 1 (``unit_pairs``). Returns the noisy sums and the noise std per coordinate.
    """
    if pairs.dim() != 2 or pairs.shape[1] != 2 or (len(pairs) and pairs.norm(dim=1).max() > 1 + 1e-9):
        raise ValidationError("pairs", "expected [n_units, 2] pairs inside the unit ball (use unit_pairs)")
    s = ledger.stages[stage]
    sigma = gaussian_noise_multiplier(*s.budget, ledger.relation)
    # paid before anything is computed from the data
    ledger.record(stage, analysed_for(ledger.relation, PoissonGaussianEvent(sigma, 1.0)))
    rows, sensitivity = (moment_rows(pairs), _SQRT2) if moments else (pairs, 1.0)
    std = sigma * sensitivity
    sums = rows.sum(dim=0) + noise.gaussian(rows.shape[1], std, dtype=torch.float64)
    out = {"A": float(sums[0]), "B": float(sums[1]), "noise_std": std, "noise_multiplier": sigma}
    if moments:
        out.update(S_aa=float(sums[2]), S_ab=float(sums[3]) / _SQRT2, S_bb=float(sums[4]))
    return out


def ratio_interval(
    released: dict[str, float], value_scale: float, confidence: float, value_range: Optional[tuple[float, float]],
    min_signal: float,
) -> tuple[float, float, float, list[str]]:
    """(value, low, high, notes) from ``release_ratio(moments=True)``'s output (post-processing only)."""
    from scipy import stats

    A, B, s = released["A"], released["B"], released["noise_std"]
    notes: list[str] = []
    lo_pub, hi_pub = value_range if value_range is not None else (-math.inf, math.inf)
    if B <= min_signal * s:
        notes.append(f"noisy denominator {B:.3g} is below {min_signal:g} noise std ({s:.3g}): interval = public range")
        value = min(max(A / B, lo_pub), hi_pub) * value_scale if B > 0 else (
            0.5 * (lo_pub + hi_pub) if math.isfinite(lo_pub + hi_pub) else math.nan)
        return value, lo_pub, hi_pub, notes
    r = A / B
    q = released["S_aa"] - 2 * r * released["S_ab"] + r * r * released["S_bb"]
    if q < 0:
        notes.append("noisy within-sample variance was negative: clamped to 0")
        q = 0.0
    std = value_scale * math.sqrt(q + s * s * (1 + r * r)) / B
    z = float(stats.norm.ppf(0.5 + confidence / 2))
    value = value_scale * r
    return value, max(value - z * std, lo_pub), min(value + z * std, hi_pub), notes


# ---------------------------------------------------------------------------------------------------- per episode
def _episode_terms(
    dataset: TrajectoryDataset, policy: Any, gamma: float, q_model: Optional[Callable] = None
) -> dict[str, torch.Tensor]:
    """Per episode: return G, trajectory weight w, per-decision IS and (with ``q_model``) DR estimates [N]."""
    padded = dataset.padded()
    if padded.behavior_log_probs is None:
        raise ValidationError("dataset.behavior_log_probs", "importance sampling needs the logged propensities")
    n, width = padded.actions.shape
    n_actions = dataset.metadata.n_actions
    obs = padded.observations[:, :width].reshape(n * width, *dataset.metadata.obs_shape)
    mask = padded.mask.double()
    probs = action_probabilities(policy, obs, n_actions).reshape(n, width, n_actions)
    taken = probs.gather(2, padded.actions.unsqueeze(2)).squeeze(2)
    log_ratio = (torch.log(taken) - padded.behavior_log_probs.double()) * mask  # padded steps: log 1
    log_ratio = torch.nan_to_num(log_ratio, neginf=-math.inf)
    cum = torch.exp(torch.cumsum(log_ratio, dim=1))  # rho_{0:t}
    discount = gamma ** torch.arange(width, dtype=torch.float64)
    rewards = padded.rewards.double() * mask
    out = {
        "G": (rewards * discount).sum(1),
        "w": cum[:, -1] if width else torch.ones(n, dtype=torch.float64),
        "pdis": (cum * rewards * discount).sum(1),
    }
    if q_model is not None:
        with torch.no_grad():
            q = torch.as_tensor(q_model(obs)).double().reshape(n, width, n_actions)
        v = (q * probs).sum(2)
        q_taken = q.gather(2, padded.actions.unsqueeze(2)).squeeze(2)
        prev = torch.cat([torch.ones(n, 1, dtype=torch.float64), cum[:, :-1]], dim=1)  # rho_{0:t-1}
        out["dr"] = (discount * mask * (cum * (rewards - q_taken) + prev * v)).sum(1)
    return out


def _per_unit(values: torch.Tensor, dataset: TrajectoryDataset) -> torch.Tensor:
    units = torch.from_numpy(dataset.unit_ids.copy())
    return torch.zeros(dataset.n_units, dtype=torch.float64).index_add_(0, units, values.double())


# ---------------------------------------------------------------------------------------------------- estimators
def dp_importance_sampling(
    dataset: TrajectoryDataset,
    policy: Any,
    *,
    epsilon: float,
    delta: float,
    ledger: PrivacyLedger,
    root: SecretRoot,
    unit_clip: float,
    value_scale: float = 1.0,
    kind: Literal["wis", "pdis", "dr"] = "wis",
    gamma: float = 1.0,
    q_model: Optional[Callable] = None,
    stage: Optional[str] = None,
    cells: Optional[Sequence[str]] = None,
    confidence: float = 0.95,
    value_range: Optional[tuple[float, float]] = None,
    min_signal: float = 10.0,
    deterministic: Optional[bool] = None,
) -> OPEResult:
    """Unit-level DP importance sampling (see the module docstring): one Gaussian release at (epsilon, delta).

    ``unit_clip`` (C, public): the norm bound of a unit's (a_u / value_scale, b_u); b_u counts episodes (PDIS, DR)
    or sums weights (WIS), so C of about the episodes a unit owns keeps typical units unclipped.
    ``deterministic``: whether the target is deterministic (public; default: as the policy declares itself,
    ``target_is_deterministic``). WIS's interval is calibrated only for a target declared stochastic.
    """
    check_positive("unit_clip", unit_clip)
    check_positive("value_scale", value_scale)
    check_probability("confidence", confidence, allow_zero=False, allow_one=False)
    check_probability("gamma", gamma)
    if kind not in ("wis", "pdis", "dr"):
        raise ValidationError("kind", f"expected 'wis', 'pdis' or 'dr', got {kind!r}")
    if (kind == "dr") != (q_model is not None):
        raise ValidationError("q_model", "the doubly robust estimator needs a q_model (and only it uses one)")
    if deterministic is None:
        deterministic = target_is_deterministic(policy)
    elif not isinstance(deterministic, bool):
        raise ValidationError("deterministic", f"expected True, False or None, got {deterministic!r}")
    stage = stage or f"ope/{kind}"
    _open_stage(ledger, stage, (epsilon, delta), dataset, cells, analysis="Gaussian mechanism on clipped unit sums")
    terms = _episode_terms(dataset, policy, gamma, q_model)
    if kind == "wis":
        a, b = _per_unit(terms["w"] * terms["G"], dataset), _per_unit(terms["w"], dataset)
    else:
        a, b = _per_unit(terms[kind], dataset), _per_unit(torch.ones(dataset.n_episodes), dataset)
    released = release_ratio(unit_pairs(a, b, value_scale, unit_clip), ledger=ledger, stage=stage,
                             noise=root.noise(f"{stage}/noise"), moments=True)
    value, low, high, notes = ratio_interval(released, value_scale, confidence, value_range, min_signal)
    if kind != "wis":
        caveat = _CAVEATS.get(kind)
    else:
        caveat = {True: _CAVEATS["deterministic"], False: None, None: _CAVEATS["undeclared"]}[deterministic]
    return OPEResult(
        kind, value, low, high, confidence, [stage],
        "delta method; sampling variance from the noisy second moments of the same release (private)", None,
        notes + ([caveat] if caveat else []), calibrated=caveat is None,
    )


# Where simulation (dporl.eval.ope_coverage, dporl.pipelines.offline_coverage, docs/results.md) found an interval
# below its nominal coverage: the interval is exact about the noise and the sampling, not about a bias (of clipping
# heavy-tailed unit sums; of DP-SGD's noisy fixed point for FQE).
_CAVEATS = {
    "fqe": "DP-SGD noise in the clipped TD updates biases the fitted fixed point (here low, by 0.08-0.11), and the "
           "spread over folds does not include that bias; measured coverage 0.89 [0.81, 0.94] over 100 table runs and "
           "0.895 [0.84, 0.93] over 200 treatment-chain datasets at eps 1 (docs/results.md)",
    "pdis": "clipping heavy-tailed per-decision weights biases PDIS; measured coverage 0.23 at eps 1 on the treatment "
            "chain (docs/results.md); use WIS, or a larger unit_clip",
    "dr": "the delta method underestimates the variance of DR terms built on a noisy DP-FQE model; measured coverage "
          "0.84 at eps 1 on the treatment chain (docs/results.md)",
    "deterministic": "the target policy is deterministic: its importance weights are heavy-tailed and clipping them "
                     "biases WIS (measured coverage 0.55 / 0.00 at 1000 / 3000 units on the treatment chain, "
                     "docs/results.md); use DP-FQE",
    "undeclared": "the target policy does not declare whether it is deterministic (deterministic=, or "
                  "dporl.eval.private_ope.declare_deterministic): WIS's interval was measured nominal for stochastic "
                  "targets only, and a deterministic target's clipped weights bias it",
}


@dataclass
class FQETraining:
    """DP-SGD settings of DP-FQE (per fold)."""

    steps: int = 500
    sample_rate: float = 0.05  # Poisson rate over units (a public constant, not derived from the data)
    rows_per_unit: int = 8  # transitions drawn per sampled unit (its gradient averages them)
    max_grad_norm: float = 1.0
    optimizer: Literal["sgd", "adam"] = "sgd"
    lr: float = 0.5
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


def _fold_counts(ledger: PrivacyLedger, root: SecretRoot, parts: dict[str, TrajectoryDataset],
                 units: Optional[Any], epsilon: float, count_fraction: float, stage: str, training: FQETraining
                 ) -> tuple[dict[str, Optional[float]], float]:
    """(each fold's count for DP-FQE's normaliser, what is left of each fold's epsilon). A public normaliser or
    given counts cost nothing; otherwise one count per fold is released (parallel: one stage over the folds'
    cells) with ``count_fraction`` of epsilon."""
    if training.expected_units is not None:
        return {cell: None for cell in parts}, epsilon
    if units is not None:
        return {cell: (units.of(cell) if hasattr(units, "of") else float(units[cell])) for cell in parts}, epsilon
    if ledger.relation != ADD_REMOVE:  # replace-one: the number of units is public
        return {cell: float(part.n_units) for cell, part in parts.items()}, epsilon
    check_probability("count_fraction", count_fraction, allow_zero=False, allow_one=False)
    plan = CountPlan(count_fraction * epsilon, tuple(parts))
    unit = dataset_unit(next(iter(parts.values())))
    released = release_count(plan, {cell: part.n_units for cell, part in parts.items()}, ledger=ledger, root=root,
                             unit=unit, stage=f"{stage}/count")
    return {cell: float(released.counts[cell]) for cell in parts}, epsilon - plan.epsilon


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
) -> DiscreteFQE:
    """Unit-level DP-SGD fitted-Q evaluation through the Trainer, at (epsilon, delta) in ``stage``. DP-SGD divides
    by ``fqe_normaliser(training, units)`` (``units``: a released or public count of ``dataset``'s units)."""
    if len(dataset.metadata.obs_shape) != 1:
        raise ValidationError("dataset.metadata.obs_shape", "FQE needs flat observations")
    normaliser = fqe_normaliser(training, units, stage)
    t = dataset.transitions().to_torch()
    t["next_pi"] = action_probabilities(policy, t["next_obs"], dataset.metadata.n_actions).float()
    source = PoissonUnitSource.from_dataset(dataset, {k: t[k] for k in FQE_KEYS}, training.sample_rate,
                                            training.rows_per_unit, expected_batch=normaliser)
    relation = ledger.relation
    mechanism = dpsgd_mechanism(relation)
    with seeded(training.seed):  # not the global generator: its state depends on whatever ran before
        algorithm = DiscreteFQE(dataset.metadata.obs_shape[0], dataset.metadata.n_actions, training.fqe,
                                dataset_unit(dataset))
    _open_stage(ledger, stage, (epsilon, delta), dataset, cells, mechanism=mechanism)
    steps = training.steps
    algorithm.plan_averaging(steps)
    Trainer(
        algorithm, source,
        config=TrainerConfig(max_steps=steps, progress=training.progress, log_every=steps, eval_every=steps,
                             checkpoint_every=steps, curator_diagnostics=False,
                             optimizer=OptimizerConfig(name=training.optimizer, lr=training.lr)),
        dp=DPConfig(epsilon=epsilon, delta=delta, max_grad_norm=training.max_grad_norm, accountant=mechanism,
                    noise_multiplier=_dpsgd_noise_multiplier(epsilon, delta, steps, training.sample_rate, relation)),
        ledger=ledger, run_dir=run_dir, pipeline="dp_fqe", pipeline_config={"stage": stage}, stage=stage,
        secret_root=root,  # streams "<stage>/sampler" and "<stage>/noise" of the run's root
    ).fit()
    algorithm.eval()
    return algorithm


def dp_fqe(
    dataset: TrajectoryDataset,
    policy: Any,
    *,
    epsilon: float,
    delta: float,
    ledger: PrivacyLedger,
    root: SecretRoot,
    run_dir: str | Path,
    unit_clip: float,
    value_scale: float = 1.0,
    folds: int = 5,
    salt: str = "dporl-fqe-folds",
    training: FQETraining = FQETraining(),
    stage: str = "fqe",
    confidence: float = 0.95,
    value_range: Optional[tuple[float, float]] = None,
    fold_cells: Optional[Sequence[str]] = None,
    units: Optional[Any] = None,
    count_fraction: float = 0.01,
) -> OPEResult:
    """DP-FQE on K folds of units (parallel composition: the guarantee is one fold's (epsilon, delta)).

    Per fold: DP-SGD FQE at (train_fraction epsilon, delta / 2), then the fold's mean initial-state value
    sum_u sum_e V(s0_e) / sum_u n_u released by one Gaussian mechanism at the rest of the budget (delta / 2).
    The interval is Student-t over the K fold values (module docstring). DP-SGD's normaliser: ``fqe_normaliser``
    with ``units`` (released or public counts per fold cell: a ``dporl.privacy.count.Units`` or a mapping), else,
    with neither it nor ``training.expected_units``, a count per fold released here first (stage
    "<stage>/count", ``count_fraction`` of epsilon, taken from the folds' budgets).

    The folds are a new keyed-hash partition (``folds``, ``salt``), or, with ``fold_cells``, those cells of the
    partition the ledger already holds (e.g. cells {"train", "eval0", ..., "eval4"}: a policy trained on "train"
    and evaluated on the others, all in parallel); ``dataset`` is then the whole dataset.
    """
    from scipy import stats

    check_probability("confidence", confidence, allow_zero=False, allow_one=False)
    if fold_cells is None:
        partition = ledger.partition(fold_partition(salt, folds, prefix=f"{stage}-fold"))
        parts = partition.split(dataset)
    else:
        if ledger.unit_partition is None:
            raise ValidationError("fold_cells", "declare the partition on the ledger first")
        if len(fold_cells) < 2 or len(set(fold_cells)) != len(fold_cells):
            raise ValidationError("fold_cells", f"need at least two distinct cells, got {fold_cells!r}")
        every = ledger.unit_partition.split(dataset)
        unknown = [c for c in fold_cells if c not in every]
        if unknown:
            raise ValidationError("fold_cells", f"unknown cell {unknown[0]!r} (cells: {list(every)})")
        parts = {cell: every[cell] for cell in fold_cells}
    counts, epsilon = _fold_counts(ledger, root, parts, units, epsilon, count_fraction, stage, training)
    eps_train = epsilon * training.train_fraction
    values, stages = [], []
    for index, (cell, part) in enumerate(parts.items()):
        # Each fold starts from its own public initialisation (seed + index): an initialisation shared by the folds
        # biases them alike, which the spread over folds cannot see (measured: coverage 0.82, not 0.94, on 100
        # table runs; docs/results.md). Independent starts turn that error into fold-to-fold variance.
        fold_training = replace(training, seed=training.seed + index)
        model = fit_dp_fqe(part, policy, epsilon=eps_train, delta=delta / 2, ledger=ledger, root=root,
                           run_dir=Path(run_dir) / cell, stage=f"{cell}/train", cells=[cell], training=fold_training,
                           units=counts[cell])
        first = torch.from_numpy(part.initial_observations())
        v0 = model.state_values(first, action_probabilities(policy, first, part.metadata.n_actions).float()).double()
        value_stage = f"{cell}/value"
        _open_stage(ledger, value_stage, (epsilon - eps_train, delta / 2), part, [cell],
                    analysis="Gaussian mechanism on clipped unit sums")
        released = release_ratio(
            unit_pairs(_per_unit(v0, part), _per_unit(torch.ones(part.n_episodes), part), value_scale, unit_clip),
            ledger=ledger, stage=value_stage, noise=root.noise(f"{value_stage}/noise"), moments=False,
        )
        values.append(value_scale * released["A"] / released["B"] if released["B"] > 0 else math.nan)
        stages += [f"{cell}/train", value_stage]
    array = np.asarray(values)
    notes = []
    lo, hi = value_range if value_range is not None else (-math.inf, math.inf)
    if not np.all(np.isfinite(array)):
        notes.append("a fold's noisy denominator was <= 0 (no estimate): interval = public range; raise epsilon, "
                     "unit_clip or the number of units per fold")
        return OPEResult("fqe", math.nan, lo, hi, confidence, stages,
                         f"Student-t over {len(array)} disjoint folds of units: unavailable", values,
                         notes + [_CAVEATS["fqe"]], calibrated=False)
    if value_range is not None:  # post-processing with public bounds: a fold's value outside them is surely wrong
        array = np.clip(array, lo, hi)
    mean = float(np.mean(array))
    half = float(stats.t.ppf(0.5 + confidence / 2, df=len(array) - 1) * np.std(array, ddof=1) / math.sqrt(len(array)))
    return OPEResult(
        "fqe", mean, max(mean - half, lo), min(mean + half, hi), confidence, stages,
        f"Student-t over {len(array)} disjoint folds of units (each fold's sampling and privacy noise; private)",
        values, notes + [_CAVEATS["fqe"]], calibrated=False,
    )


def dp_doubly_robust(
    dataset: TrajectoryDataset,
    policy: Any,
    *,
    epsilon: float,
    delta: float,
    ledger: PrivacyLedger,
    root: SecretRoot,
    run_dir: str | Path,
    unit_clip: float,
    value_scale: float = 1.0,
    gamma: float = 1.0,
    partition: Optional[UnitPartition] = None,
    training: FQETraining = FQETraining(),
    confidence: float = 0.95,
    value_range: Optional[tuple[float, float]] = None,
    min_signal: float = 10.0,
    units: Optional[Any] = None,
    count_fraction: float = 0.01,
) -> tuple[OPEResult, DiscreteFQE]:
    """DR with its Q-model fitted by DP-FQE on the held-out cell and the estimate released on the train cell.

    Both stages run at (epsilon, delta) on disjoint cells: parallel composition, guarantee (epsilon, delta).
    The model is released (DP) before the estimate uses it: for a held-out unit the estimate is post-processing.
    The model's DP-SGD normaliser comes from ``units`` / ``count_fraction`` as in ``dp_fqe`` (cell "model").
    """
    partition = ledger.partition(partition or UnitPartition("dporl-dr-split", {"estimate": 0.5, "model": 0.5}))
    if set(partition.names) != {"estimate", "model"}:
        raise ValidationError("partition", "the DR split needs cells 'estimate' and 'model'")
    parts = partition.split(dataset)
    if abs(gamma - training.fqe.gamma) > 1e-12:
        raise ValidationError("gamma", f"DR's gamma {gamma} differs from the FQE model's {training.fqe.gamma}")
    counts, model_epsilon = _fold_counts(ledger, root, {"model": parts["model"]}, units, epsilon, count_fraction,
                                         "dr", training)
    model = fit_dp_fqe(parts["model"], policy, epsilon=model_epsilon, delta=delta, ledger=ledger, root=root,
                       run_dir=Path(run_dir) / "model", stage="dr/model", cells=["model"], training=training,
                       units=counts["model"])
    result = dp_importance_sampling(
        parts["estimate"], policy, epsilon=epsilon, delta=delta, ledger=ledger, root=root, unit_clip=unit_clip,
        value_scale=value_scale, kind="dr", gamma=gamma, q_model=model.q_values, stage="dr/estimate",
        cells=["estimate"], confidence=confidence, value_range=value_range, min_signal=min_signal,
    )
    return OPEResult(**{**result.to_dict(), "stages": ["dr/model", "dr/estimate"]}), model
