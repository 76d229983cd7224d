"""Audits of the mechanisms a user's pipeline config would run, with that config's parameters.

What is audited is each mechanism's per-release claim (one DP-SGD / mixture / GPOPE step, one stable-prefix run,
one output-perturbation release) with the config's noise multiplier, sample rate, p_min, budgets and accountant;
the composition over steps is the accountant's and is not re-derived empirically. The canary constructions
use few units: a Poisson step's event depends only on (sigma, q), not on the population, so the claim is the same.

- ``expert_cql``: ``dp_sgd`` -> one DP-SGD step; ``mixed`` -> one mixture step (and the paper's figure beside it);
  ``stable_only`` / ``mixed`` -> one stable-prefix run (needs m and p_min: from the dataset's metadata, or given).
- ``ope``: one GPOPE update (Poisson or paper mode, smallest m of the sweep) and the configured DP-LSW / DP-LSL
  releases.
"""

from __future__ import annotations

from typing import Any, Mapping, Optional

import torch

from dporl.audit.dpsgd_audits import step_event_factory
from dporl.audit.experiment import Experiment
from dporl.audit.registry import build_audit
from dporl.privacy.calibration import calibrate_noise_multiplier
from dporl.utils.config import from_dict
from dporl.utils.validation import ValidationError

SUPPORTED = ("expert_cql", "ope")


def _experts_and_p_min(config, n_experts: Optional[int], p_min: Optional[float]) -> tuple[int, Optional[float]]:
    if n_experts is not None:
        return n_experts, p_min
    path = config.data.dataset
    if path is None:
        raise ValidationError("n_experts", "the config generates its data: pass --n-experts (and --p-min)")
    from dporl.data.dataset import TrajectoryDataset

    meta = TrajectoryDataset.load(path).metadata
    return meta.n_experts, meta.p_min if p_min is None else p_min


def expert_cql_audits(
    data: Mapping[str, Any], *, n_experts: Optional[int] = None, p_min: Optional[float] = None
) -> list[Experiment]:
    from dporl.pipelines.expert_cql import RELEASE_STAGE, TRAIN_STAGE, ExpertCQLConfig

    config = from_dict(ExpertCQLConfig, data)
    budgets = config.stage_budgets()
    if not budgets:
        raise ValidationError("method", "a non_private run makes no privacy claim to audit")
    m, p_min = _experts_and_p_min(config, n_experts, p_min)
    audits = []
    if TRAIN_STAGE in budgets:
        eps2, delta2 = budgets[TRAIN_STAGE]
        q = config.batch_size / m
        mixed = config.method == "mixed"
        sigma = config.dp.noise_multiplier
        if sigma is None:
            if config.trainer.max_steps is None:
                raise ValidationError("trainer.max_steps", "needed to calibrate dp.noise_multiplier")
            sigma = calibrate_noise_multiplier(
                eps2, delta2, config.trainer.max_steps,
                make_event=step_event_factory(q, config.dp.p_dp if mixed else None), mechanism=config.dp.accountant,
            )
        common = {"noise_multiplier": sigma, "sample_rate": q, "max_grad_norm": config.dp.max_grad_norm,
                  "delta": delta2, "accountant": config.dp.accountant}
        if mixed:
            audits.append(build_audit("mixture", {"private_probability": config.dp.p_dp, **common}))
        else:
            audits.append(build_audit("dpsgd_step", {**common, "mode": config.dp.clipping}))
    if RELEASE_STAGE in budgets:
        if p_min is None:
            raise ValidationError("p_min", "the dataset records no p_min: pass --p-min")
        eps1, delta1 = budgets[RELEASE_STAGE]
        audits.append(build_audit("stable_prefix", {
            "epsilon": eps1, "delta": delta1, "trajectories": config.release.trajectories, "n_experts": m, "p_min": p_min,
        }))
    return audits


def ope_audits(data: Mapping[str, Any]) -> list[Experiment]:
    from dporl.pipelines.ope import OPEConfig
    from dporl.privacy.samplers import FixedSizeSource

    config = from_dict(OPEConfig, data)
    settings = config.gpope
    m = min(config.m_values)  # the smallest dataset of the sweep: the largest per-step claim
    clip = settings.clip_norm or 1.0  # sigma is relative to h: the claim does not depend on h (tuned when None)
    if settings.mode == "poisson":
        q = min(1.0, settings.expected_batch_size / m)  # as the pipeline samples
        make_event, steps = step_event_factory(q), max(1, round(settings.epochs / q))
    else:  # the paper's one trajectory per update, replace-one
        make_event = FixedSizeSource({"x": torch.zeros(m, 1)}, torch.arange(m), m, 1).step_event
        steps = max(1, round(settings.epochs * m))
    sigma = settings.noise_multiplier
    if sigma is None:
        sigma = calibrate_noise_multiplier(
            config.epsilon, config.delta, steps, make_event=make_event, mechanism=settings.accountant
        )
    common = {"noise_multiplier": sigma, "max_grad_norm": clip, "delta": config.delta}
    if settings.mode == "poisson":
        audits = [build_audit("gpope", {**common, "sample_rate": q, "accountant": settings.accountant})]
    else:
        audits = [build_audit("gpope_paper", {**common, "n_trajectories": m})]
    # The pipeline runs DP-LSW / DP-LSL on finite state spaces only (the chain), as their analysis requires.
    for method in config.output_perturbation.methods if config.experiment == "chain" else []:
        audits.append(build_audit(method, {"epsilon": config.epsilon, "delta": config.delta}))
    return audits


def audits_for_config(data: Mapping[str, Any], **kwargs) -> list[Experiment]:
    pipeline = data.get("pipeline")
    if pipeline == "expert_cql":
        return expert_cql_audits(data, **kwargs)
    if pipeline == "ope":
        return ope_audits(data)
    raise ValidationError("pipeline", f"no audit for pipeline {pipeline!r} yet (supported: {', '.join(SUPPORTED)})")
