"""Unit-level DP importance sampling: weighted IS, per-decision IS and doubly robust, one Gaussian release.

- ``kind="wis"``: weighted (self-normalised) trajectory-wise importance sampling (Precup, Sutton, Singh 2000):
  V = sum_e w_e G_e / sum_e w_e, w_e = prod_t pi(a_t|s_t) / mu(a_t|s_t).
- ``kind="pdis"``: per-decision importance sampling, normalised by the number of episodes.
- ``kind="dr"``: doubly robust (Jiang & Li 2016): per episode sum_t gamma^t [rho_{0:t} (r_t - Q(s_t, a_t)) +
  rho_{0:t-1} V(s_t)], with a model Q fitted on OTHER units (``dporl.eval.ope_dr``), clamped into the value range.

Each is a ratio of sums over units in centred value units (``dporl.eval.ope_release``): WIS a_u = sum of
w_e (G_e - centre) / half over the unit's episodes and b_u = sum of w_e; PDIS / DR a_u = the sum of the unit's
centred per-episode estimates, b_u its number of episodes. A declared ``min_propensity`` p raises every logged
propensity below p to p, so each per-step ratio is at most 1 / p (``dporl.eval.ope_scales``). Before anything is
spent, the noise of the estimate is predicted from the public or released number of units and the run refuses if it
would exceed the tolerance (``dporl.eval.ope_feasibility``).
"""

from __future__ import annotations

import math
from typing import Any, Callable, Literal, Optional, Sequence

import torch

from dporl.data.dataset import TrajectoryDataset
from dporl.eval.ope_calibration import importance_caveat
from dporl.eval.ope_feasibility import check_feasible, predict_ratio
from dporl.eval.ope_policies import logged_action_probabilities, target_is_deterministic
from dporl.eval.ope_interval import ratio_interval
from dporl.eval.ope_release import open_stage, per_unit, release_ratio, unit_pairs
from dporl.eval.ope_result import OPEResult, finish
from dporl.eval.ope_scales import OPEScales
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.randomness import SecretRoot
from dporl.privacy.relations import ADD_REMOVE
from dporl.utils.validation import ValidationError, check_positive, check_probability


def episode_terms(
    dataset: TrajectoryDataset, policy: Any, gamma: float, q_model: Optional[Callable] = None,
    min_propensity: Optional[float] = None, q_range: Optional[tuple[float, float]] = None,
) -> dict[str, torch.Tensor]:
    """Per episode: return G, trajectory weight w, per-decision IS and (with ``q_model``) DR estimates [N]. The
    target is called on logged states only; ``min_propensity`` raises smaller logged propensities to it; ``q_range``
    clamps the model's Q-values (public bounds)."""
    padded = dataset.padded()
    if padded.behavior_log_probs is None:
        raise ValidationError("dataset.behavior_log_probs", "importance sampling needs the logged propensities")
    n, width = padded.actions.shape
    n_actions = dataset.metadata.n_actions
    obs = padded.observations[:, :width].reshape(n * width, *dataset.metadata.obs_shape)
    mask = padded.mask.double()
    probs = logged_action_probabilities(policy, obs, padded.mask.reshape(-1), n_actions).reshape(n, width, n_actions)
    taken = probs.gather(2, padded.actions.unsqueeze(2)).squeeze(2)
    behaviour = padded.behavior_log_probs.double()
    if min_propensity is not None:
        behaviour = behaviour.clamp_min(math.log(min_propensity))
    log_ratio = (torch.log(taken) - behaviour) * mask  # padded steps: log 1
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
        if q_range is not None:
            q = q.clamp(*q_range)
        q = torch.nan_to_num(q) * mask.unsqueeze(2)
        v = (q * probs).sum(2)
        q_taken = q.gather(2, padded.actions.unsqueeze(2)).squeeze(2)
        prev = torch.cat([torch.ones(n, 1, dtype=torch.float64), cum[:, :-1]], dim=1)  # rho_{0:t-1}
        out["dr"] = (discount * mask * (cum * (rewards - q_taken) + prev * v)).sum(1)
    return out


def resolve_scales(scales: Optional[OPEScales], gamma: Optional[float], **declared) -> OPEScales:
    """``scales`` as given, else built from the declared facts (``OPEScales.declare``)."""
    if scales is not None:
        if any(v is not None for v in declared.values()):
            raise ValidationError("scales", "give either scales or the declared facts it is built from, not both")
        return scales
    return OPEScales.declare(gamma=gamma, **declared)


def dp_importance_sampling(
    dataset: TrajectoryDataset,
    policy: Any,
    *,
    epsilon: float,
    delta: float,
    ledger: PrivacyLedger,
    root: SecretRoot,
    unit_clip: Optional[float] = None,
    kind: Literal["wis", "pdis", "dr"] = "wis",
    gamma: float = 1.0,
    q_model: Optional[Callable] = None,
    stage: Optional[str] = None,
    cells: Optional[Sequence[str]] = None,
    confidence: float = 0.95,
    scales: Optional[OPEScales] = None,
    value_range: Optional[tuple[float, float]] = None,
    reward_range: Optional[tuple[float, float]] = None,
    horizon: Optional[int] = None,
    min_propensity: Optional[float] = None,
    episodes_per_unit: Optional[float] = None,
    min_signal: float = 0.0,
    deterministic: Optional[bool] = None,
    units: Optional[float] = None,
    tolerance: Optional[float] = None,
) -> OPEResult:
    """Unit-level DP importance sampling (module docstring): one Gaussian release at (epsilon, delta).

    Scales: ``scales``, or the declared facts (``value_range`` or ``reward_range`` with ``gamma`` and ``horizon``;
    ``min_propensity``, ``episodes_per_unit``), see ``dporl.eval.ope_scales``. ``unit_clip`` (C, public): declared,
    else the public maximum of a unit's contribution. ``deterministic``: whether the target is deterministic
    (public; default: as the policy declares itself). ``units``: a public or released count of ``dataset``'s units
    (public by definition under a replace-one ledger): with it the predicted noise is checked against ``tolerance``
    (default: the value range's width) before anything is spent.
    """
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
    scales = resolve_scales(scales, gamma, value_range=value_range, reward_range=reward_range, horizon=horizon,
                            min_propensity=min_propensity, episodes_per_unit=episodes_per_unit)
    clip = scales.unit_clip(kind, unit_clip)
    if units is None and ledger.relation != ADD_REMOVE:
        units = float(dataset.n_units)  # replace-one: the number of units is public
    if units is not None:
        check_positive("units", units, allow_zero=True)
        check_feasible(predict_ratio(kind, epsilon=epsilon, delta=delta, relation=ledger.relation, units=units,
                                     unit_clip=clip, scales=scales, confidence=confidence, tolerance=tolerance))
    if dataset.behavior_log_probs is None:
        raise ValidationError("dataset.behavior_log_probs", "importance sampling needs the logged propensities")
    stage = stage or f"ope/{kind}"
    open_stage(ledger, stage, (epsilon, delta), dataset, cells, analysis="Gaussian mechanism on clipped unit sums")
    q_range = None if q_model is None else scales.value_range
    terms = episode_terms(dataset, policy, gamma, q_model, scales.min_propensity, q_range)
    c, h = scales.centre, scales.half
    if kind == "wis":
        a, b = per_unit(terms["w"] * (terms["G"] - c), dataset), per_unit(terms["w"], dataset)
    else:
        a, b = per_unit(terms[kind] - c, dataset), per_unit(torch.ones(dataset.n_episodes), dataset)
    released = release_ratio(unit_pairs(a, b, h, clip), ledger=ledger, stage=stage,
                             noise=root.noise(f"{stage}/noise"), moments=True)
    value, low, high, notes = ratio_interval(released, scales, confidence, min_signal)
    caveat = importance_caveat(kind, deterministic=deterministic, clip=clip, scales=scales, epsilon=epsilon)
    return finish(
        kind, value, low, high, confidence=confidence, stages=[stage],
        variance="Fieller-type set; sampling variance from the noisy second moments of the same release (private), "
                 "with a margin for their noise",
        value_range=scales.value_range, notes=[scales.origin, scales.clip_choice(kind, clip)] + notes, caveat=caveat,
        failure=None if math.isfinite(value) else "the noisy denominator was <= 0",
    )
