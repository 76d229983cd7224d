"""Audits of the mechanisms a user's pipeline config would run, with that config's parameters.

What is audited is each mechanism's per-release claim (one DP-SGD / mixture / GPOPE step, one stable-prefix run,
one output-perturbation release) with the config's noise multiplier, sample rate, p_min, budgets and accountant;
the composition over steps is the accountant's and is not re-derived empirically. The canary constructions
use few units: a Poisson step's event depends only on (sigma, q), not on the population, so the claim is the same.

- ``train`` (any registered algorithm: the mechanisms are the method's, the algorithm only computes the gradients
  they clip): ``dp_sgd`` -> one DP-SGD step; ``mixed`` -> one mixture step (and the paper's figure beside it),
  both on fixed canary datasets through the pipeline's own sources; ``stable_only`` / ``mixed`` -> one run of the
  stable-prefix release with the config's budget, T and ``release.source``, on the config's OWN fixed data (its
  dataset and expert set, when they exist on disk: D, and D minus expert ``target``) or, without them, on the
  built-in CartPole pair with m and p_min given.
- ``ope``: one GPOPE update (Poisson or paper mode, smallest m of the sweep) and the configured DP-LSW / DP-LSL
  releases.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Optional

import torch

from dporl.audit.dpsgd_audits import step_event_factory
from dporl.audit.experiment import Experiment
from dporl.audit.registry import build_audit
from dporl.privacy.calibration import calibrate_noise_multiplier
from dporl.utils.config import from_dict
from dporl.utils.validation import ValidationError



def _logged_data(config):
    """(dataset, expert set) the config trains on, if they exist on disk (generated data: once train.py ran)."""
    from dporl.data.dataset import TrajectoryDataset
    from dporl.experts.expert_set import ExpertSet

    if config.data.imported:  # a table or Minari dataset: read it as the pipeline does (no expert set)
        from dporl.pipelines.inputs import import_dataset

        if config.data.format == "memory":
            raise ValidationError("data.format", "a dataset handed over in Python has no file to audit")
        return import_dataset(config.data, progress=False)[0], None
    if config.data.npz_path is not None:
        dataset_path, expert_path = Path(config.data.npz_path), config.data.expert_set
    else:
        # Generated data live in RUN/curator/data unless the config names an out_dir (the train pipeline).
        out_dir = Path(config.data.generate.get("out_dir") or Path(config.run_dir) / "curator" / "data")
        dataset_path, expert_path = out_dir / "dataset.npz", config.data.expert_set or out_dir / "experts.pt"
    if not dataset_path.is_file():
        return None, None
    dataset = TrajectoryDataset.load(dataset_path)
    expert_path = expert_path or (dataset.metadata.expert_set or {}).get("path")
    experts = ExpertSet.load(expert_path) if expert_path is not None and Path(expert_path).is_file() else None
    return dataset, experts


def _release_plan(config, budgets, dataset, experts, m: int, p_min: Optional[float]):
    """The release a run of ``config`` would record before training: planned on the config's data where they are on
    disk (every refusal the run would raise), else from public quantities (m experts, p_min; checked by the caller)
    for its accounting."""
    from dporl.algos.stable_prefix import accounting_plan, plan_release
    from dporl.pipelines.train import RELEASE_STAGE

    eps1, delta1 = budgets[RELEASE_STAGE]
    if dataset is not None and experts is not None:
        return plan_release(dataset, experts, epsilon=eps1, delta=delta1, config=config.release)
    return accounting_plan(epsilon=eps1, delta=delta1, config=config.release, p_min=p_min, n_experts=m)


def train_audits(
    data: Mapping[str, Any], *, n_experts: Optional[int] = None, p_min: Optional[float] = None, target: int = 0
) -> list[Experiment]:
    from dporl.audit.stable_prefix_audit import neighbours_of, stable_prefix_audit
    from dporl.pipelines.train import RELEASE_STAGE, TRAIN_STAGE, TrainPipelineConfig, training_noise, training_plan

    config = from_dict(TrainPipelineConfig, data)
    budgets = config.stage_budgets()
    if not config.method_spec.private:
        raise ValidationError("method", f"a {config.method} run makes no privacy claim to audit")
    dataset, experts = _logged_data(config)
    train_data, plan = dataset, None
    if dataset is not None:  # the budgets and training cell the run would use (units held out for evaluation)
        budgets, train_data, plan = training_plan(config, dataset)
    m = n_experts if n_experts is not None else (train_data.metadata.n_units if train_data is not None else None)
    p_min = p_min if p_min is not None else (dataset.metadata.p_min if dataset is not None else None)
    if m is None:
        raise ValidationError("n_experts", "the config's data are not on disk (generated data: run train.py first): "
                                           "pass --n-experts (and --p-min)")
    own_data = dataset is not None and experts is not None  # the release is planned and attacked on them
    if RELEASE_STAGE in budgets and not own_data and p_min is None:
        raise ValidationError("p_min", "the dataset records no p_min: pass --p-min")
    audits = []
    if TRAIN_STAGE in budgets:
        eps2, delta2 = budgets[TRAIN_STAGE]
        q = config.batch_size / m
        mixed = config.method_spec.trains_on == "mixture"
        sigma = config.dp.noise_multiplier
        if sigma is None:  # the run's own calibration (against what its release leaves, for Algorithm 3)
            if config.trainer.max_steps is None:
                raise ValidationError("trainer.max_steps", "needed to calibrate dp.noise_multiplier")
            planned = (_release_plan(config, budgets, dataset, experts, m, p_min) if RELEASE_STAGE in budgets
                       else None)
            sigma = training_noise(config, budgets, planned, step_event_factory(q, config.dp.p_dp if mixed else None),
                                   plan)
        common = {"noise_multiplier": sigma, "sample_rate": q, "max_grad_norm": config.dp.max_grad_norm,
                  "delta": delta2, "accountant": config.dp.accountant, "rows_per_unit": config.dp.rows_per_unit}
        if mixed:
            audits.append(build_audit("mixture", {"private_probability": config.dp.p_dp, **common}))
        else:
            audits.append(build_audit("dpsgd_step", {**common, "mode": config.dp.clipping}))
    if RELEASE_STAGE in budgets:
        eps1, delta1 = budgets[RELEASE_STAGE]
        release = {"epsilon": eps1, "delta": delta1, "trajectories": config.release.trajectories,
                   "source": config.release.source}
        if own_data:  # the config's own fixed data
            audits.append(stable_prefix_audit(**release, neighbours=neighbours_of(dataset, experts, target)))
        else:
            audits.append(stable_prefix_audit(**release, n_experts=m, p_min=p_min))
    return audits


def ope_audits(data: Mapping[str, Any]) -> list[Experiment]:
    from dporl.pipelines.ope import OPEConfig
    from dporl.pipelines.ope.runners import make_plan, planned_noise

    config = from_dict(OPEConfig, data)
    settings = config.gpope
    m = min(config.m_values)  # the smallest dataset of the sweep: the largest per-step claim
    clip = settings.clip_norm or 1.0  # sigma is relative to h: the claim does not depend on h (tuned when None)
    # The fewest passes the run may choose: the least noise per step, so the largest per-step claim.
    plan = make_plan(config, m, settings.epochs if settings.epochs is not None else min(settings.epochs_grid))
    q = min(1.0, plan.batch / m)
    sigma, budget = planned_noise(config, plan)  # sigma calibrated for a replace-one budget where asked
    if sigma is None:
        sigma = calibrate_noise_multiplier(
            budget, config.delta, plan.steps, make_event=plan.event, mechanism=settings.accountant
        )
    common = {"noise_multiplier": sigma, "max_grad_norm": clip, "delta": config.delta}
    if settings.mode == "poisson":
        audits = [build_audit("gpope", {**common, "sample_rate": q, "accountant": settings.accountant,
                                        "replace_one": settings.relation == "replace_one"})]
    else:
        if plan.batch != 1:
            raise ValidationError("gpope.expected_batch_size", "the paper-mode audit covers one trajectory per update")
        audits = [build_audit("gpope_paper", {**common, "n_trajectories": m})]
    # The pipeline runs DP-LSW / DP-LSL on finite state spaces only (the chain), as their analysis requires.
    for method in config.output_perturbation.methods if config.experiment == "chain" else []:
        audits.append(build_audit(method, {"epsilon": config.epsilon, "delta": config.delta}))
    return audits


def _ope_audits(data: Mapping[str, Any], **kwargs) -> list[Experiment]:
    return ope_audits(data)


# Pipeline -> the audits of what a config of it would release (``dporl.pipelines.PIPELINES`` names the pipelines).
AUDITS = {"train": train_audits, "ope": _ope_audits}


def audits_for_config(data: Mapping[str, Any], **kwargs) -> list[Experiment]:
    pipeline = data.get("pipeline")
    if pipeline not in AUDITS:
        raise ValidationError("pipeline", f"no audit for pipeline {pipeline!r} yet (supported: {', '.join(AUDITS)})")
    return AUDITS[pipeline](data, **kwargs)
