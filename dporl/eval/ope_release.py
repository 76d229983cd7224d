"""The Gaussian release shared by the private estimators: clipped unit sums, one mechanism, their interval.

Every estimator is a ratio of two sums over units, sum_u a_u / sum_u b_u, in centred value units (a return G enters
as (G - centre) / half, ``dporl.eval.ope_scales``). Each unit's row (a_u, b_u, ...) is scaled into the unit ball,
x_u = row_u * min(1, C / ||row_u||) / C (``unit_rows``): its norm is <= 1 whatever the data, and scaling every
coordinate by one factor keeps the unit's own ratio (a clipped unit is down-weighted, not distorted). Removing a unit
removes one x_u: nothing else changes and nothing divides by the number of units, so that number stays private.

``release_ratio`` releases z = sum_u (x1, x2, x1^2, sqrt 2 x1 x2, x2^2) + N(0, (sigma sqrt 2)^2 I): ||z_u||^2 =
|x|^2 + |x|^4 <= 2, one Gaussian mechanism of L2 sensitivity sqrt 2 and noise multiplier sigma, recorded as
``PoissonGaussianEvent(sigma, 1)`` and calibrated to the stage's budget by PLD; ``release_sums`` releases plain sums
(sensitivity 1). Both pay before anything is computed from the data.

Interval: ``dporl.eval.ope_interval.ratio_interval`` (post-processing of what ``release_ratio`` returns).

Neighbouring relation: the ledger's. For replace-one neighbours every release is calibrated and recorded for
replace-one (``relations.analysed_for``: the Gaussian at twice the sensitivity).
"""

from __future__ import annotations

import functools
import math
from typing import Optional, Sequence

import torch

from dporl.data.dataset import TrajectoryDataset
from dporl.privacy.calibration import calibrate_noise_multiplier
from dporl.privacy.events import PoissonGaussianEvent
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.noise import NoiseSource
from dporl.privacy.relations import ADD_REMOVE, CONVERSION, analysed_for
from dporl.privacy.units import dataset_unit
from dporl.utils.validation import ValidationError

SQRT2 = math.sqrt(2.0)


def open_stage(ledger: PrivacyLedger, stage: str, budget: tuple[float, float], dataset: TrajectoryDataset,
               cells: Optional[Sequence[str]], mechanism: str = "pld", analysis: Optional[str] = None) -> None:
    """Open ``stage`` (refused if it exists: every release needs its own stage)."""
    if stage in ledger.stages:
        raise ValidationError("stage", f"stage {stage!r} already exists: every release needs its own stage")
    if ledger.relation != ADD_REMOVE:
        analysis = CONVERSION if analysis is None else f"{analysis}; {CONVERSION}"
    ledger.stage(stage, budget=budget, mechanism=mechanism, unit=dataset_unit(dataset), cells=cells,
                 analysis=analysis)


def dpsgd_mechanism(relation) -> str:
    """The analysis of DP-SGD stages: PLD for either relation (the replace-one PLD has no RDP curve, and for
    add/remove the PLD is tighter than RDP and is the analysis of the fold's joint guarantee, so a stage calibrated
    by it uses its budget)."""
    return "pld"


@functools.lru_cache(maxsize=256)
def dpsgd_noise_multiplier(epsilon: float, delta: float, steps: int, sample_rate: float, relation=ADD_REMOVE
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


def per_unit(values: torch.Tensor, dataset: TrajectoryDataset) -> torch.Tensor:
    """Per-episode values [n_episodes] summed per unit [n_units] (float64)."""
    units = torch.from_numpy(dataset.unit_ids.copy())
    return torch.zeros(dataset.n_units, dtype=torch.float64).index_add_(0, units, values.double())


def unit_rows(columns: Sequence[torch.Tensor], unit_clip: float) -> torch.Tensor:
    """Every unit's row of ``columns`` scaled into the unit ball: [n_units, k], norms <= 1 (module docstring)."""
    rows = torch.stack([c.double() for c in columns], dim=1)
    norms = rows.norm(dim=1)
    factor = torch.where(norms > unit_clip, unit_clip / norms.clamp_min(1e-300), torch.ones_like(norms))
    return rows * (factor / unit_clip).unsqueeze(1)


def unit_pairs(a_units: torch.Tensor, b_units: torch.Tensor, value_scale: float, unit_clip: float) -> torch.Tensor:
    """Every unit's (a_u / value_scale, b_u) scaled into the unit ball: [n_units, 2], norms <= 1."""
    return unit_rows([a_units / value_scale, b_units], unit_clip)


def moment_rows(pairs: torch.Tensor) -> torch.Tensor:
    """Every unit's (x, y, x^2, sqrt 2 x y, y^2) [n_units, 5]: norm^2 = |p|^2 + |p|^4 <= 2 for pairs in the unit ball."""
    x, y = pairs[:, 0], pairs[:, 1]
    return torch.stack([x, y, x * x, SQRT2 * x * y, y * y], dim=1)


def _pay(ledger: PrivacyLedger, stage: str) -> float:
    sigma = gaussian_noise_multiplier(*ledger.stages[stage].budget, ledger.relation)
    ledger.record(stage, analysed_for(ledger.relation, PoissonGaussianEvent(sigma, 1.0)))  # paid before computing
    return sigma


def release_sums(rows: torch.Tensor, *, ledger: PrivacyLedger, stage: str, noise: NoiseSource
                 ) -> tuple[torch.Tensor, float]:
    """Pay for, then release, the noisy sum of every unit's row (rows [n_units, k] in the unit ball: sensitivity 1).
    Returns (noisy sums [k], noise std per coordinate)."""
    if rows.dim() != 2 or (len(rows) and rows.norm(dim=1).max() > 1 + 1e-9):
        raise ValidationError("rows", "expected [n_units, k] rows inside the unit ball (use unit_rows)")
    std = _pay(ledger, stage)
    return rows.sum(dim=0) + noise.gaussian(rows.shape[1], std, dtype=torch.float64), std


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
    sigma = _pay(ledger, stage)
    rows, sensitivity = (moment_rows(pairs), SQRT2) if moments else (pairs, 1.0)
    std = sigma * sensitivity
    sums = rows.sum(dim=0) + noise.gaussian(rows.shape[1], std, dtype=torch.float64)
    out = {"A": float(sums[0]), "B": float(sums[1]), "noise_std": std, "noise_multiplier": sigma}
    if moments:
        out.update(S_aa=float(sums[2]), S_ab=float(sums[3]) / SQRT2, S_bb=float(sums[4]))
    return out
