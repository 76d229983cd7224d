"""One release of each private OPE method, and the public-data tuning of their hyper-parameters.

GPOPE (Xie, Thomas, Miklau 2019) runs through the shared Trainer: Poisson sampling over trajectories (add/remove
events) or the paper's fixed-size sampling without replacement (replace-one events). Its schedule is N = epochs *
m / B updates with sigma calibrated for N at the target budget, where m is the experiment's DECLARED number of
trajectories (``m_values``), never the size of the data handed in: under add/remove neighbours the data may hold one
trajectory more or fewer, and the rate B / m, N, sigma and the normaliser B stay what the configuration says (the
Poisson sampler runs over whatever trajectories are present), and the released estimate is the last iterate or an
average of the iterates (post-processing). When the budget is for replace-one neighbours, Poisson-mode sigma is
calibrated by the replace-one analysis of ``dporl.privacy.relations`` and the stage's add/remove budget is what the
ledger's own analysis charges for those N steps.

The step size is per trajectory (the paper's beta at B = 1): an update that averages B trajectories takes B * beta.
Hyper-parameters (step size, clip norm h, number of passes) come from an independent public dataset of the same size,
never from the private one. h is a quantile of the per-trajectory gradient norms on that public data, taken at
theta = 0 and at the public LSTD solution (the two ends of the optimisation path), so the grid always contains clip
norms that leave part of the gradients unclipped (a fixed h below every norm makes only lr * h matter).

DP-LSW / DP-LSL (Balle et al. 2016) are one smooth-sensitivity Gaussian release each (replace-one), DP-LSL's
lambda = scale * sqrt(m) tuned on the same public data.

Randomness: every private draw (GPOPE's sampler and noise, DP-LSW / DP-LSL's noise) comes from a named stream of the
invocation's ``SecretRoot``: each GPOPE release gets a child root (its Trainer names its streams by stage), each
output perturbation one ``root.noise`` stream. Tuning runs on public data draw from public seeds (``config.seed``).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from dporl.algos.dp_lsw_lsl import dp_lsl, dp_lsw, first_visit_returns
from dporl.algos.gpope import GPOPE, GPOPEConfig, paper_lemma1_epsilon
from dporl.algos.lstd import lstd
from dporl.pipelines.ope.config import OPEConfig
from dporl.privacy.accountants import epsilon_for, within_budget
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.noise import NoiseSource
from dporl.privacy.randomness import SecretRoot
from dporl.privacy.relations import ADD_REMOVE, REPLACE_ONE, calibrate_for_relation, epsilon_for_relation
from dporl.privacy.samplers import Batch, FixedSizeSource, PoissonUnitSource
from dporl.train.config import DPConfig, OptimizerConfig, TrainerConfig
from dporl.train.trainer import Trainer
from dporl.utils.config import to_dict
from dporl.utils.seeding import public_generator
from dporl.utils.validation import PrivacyBudgetError, ValidationError

RELATIONS = {"replace_one": REPLACE_ONE, "add_remove": ADD_REMOVE}
SMOOTH_SENSITIVITY_ANALYSIS = "smooth-sensitivity Gaussian output perturbation (Balle et al. 2016)"


@dataclass(frozen=True)
class GPOPEHyper:
    step_size: float
    clip_norm: float
    epochs: float
    clip_quantile: Optional[float] = None  # where h came from (None: given)


@dataclass(frozen=True)
class GPOPEPlan:
    """How one GPOPE release samples at m trajectories: batch size, number of updates, its per-step event."""

    mode: str
    m: int
    batch: float  # expected (Poisson) or exact (paper) trajectories per update
    steps: int

    def source(self, data: dict[str, torch.Tensor]):
        present = int(data["mask"].shape[0])  # the population the sampler runs over (inside the mechanism only)
        units = torch.arange(present)
        if self.mode == "poisson":  # rate and normaliser from the declared m: the same for D and D'
            return PoissonUnitSource(data, units, present, sample_rate=min(1.0, self.batch / self.m),
                                     expected_batch=self.batch)
        # replace-one (paper mode): neighbours have the same size, so the population is public
        return FixedSizeSource(data, units, present, sample_size=int(self.batch))

    def event(self, sigma: float):
        if self.mode == "poisson":
            from dporl.privacy.events import PoissonGaussianEvent

            return PoissonGaussianEvent(sigma, min(1.0, self.batch / self.m))
        from dporl.privacy.events import SampledWithoutReplacementGaussianEvent

        return SampledWithoutReplacementGaussianEvent(sigma / 2, int(self.batch), self.m)


def make_plan(config: OPEConfig, m: int, epochs: float) -> GPOPEPlan:
    settings = config.gpope
    batch = settings.expected_batch_size
    if settings.max_steps_per_epoch is not None:
        batch = max(batch, m / settings.max_steps_per_epoch)
    if settings.mode == "paper":
        batch = float(min(m, max(1, round(batch))))
    batch = min(batch, float(m))
    return GPOPEPlan(settings.mode, m, batch, max(1, round(epochs * m / batch)))


@functools.lru_cache(maxsize=256)
def _replace_one_noise(plan: GPOPEPlan, epsilon: float, delta: float) -> float:
    return calibrate_for_relation(epsilon, delta, plan.steps, make_event=plan.event, relation=REPLACE_ONE)


def planned_noise(config: OPEConfig, plan: GPOPEPlan) -> tuple[Optional[float], float]:
    """(noise multiplier or None for the Trainer to calibrate, the stage's budget in the events' own relation)."""
    settings = config.gpope
    if plan.mode == "poisson" and settings.relation == "replace_one":
        sigma = _replace_one_noise(plan, config.epsilon, config.delta)
        return sigma, epsilon_for([(plan.event(sigma), plan.steps)], config.delta, settings.accountant)
    return settings.noise_multiplier, config.epsilon


def _average_from(config: OPEConfig, steps: int) -> Optional[int]:
    averaging = config.gpope.averaging
    if averaging == "last":
        return None
    return 0 if averaging == "polyak" else int(math.floor(steps * (1 - config.gpope.tail_fraction)))


def run_gpope(
    config: OPEConfig, problem, data: dict, hyper: GPOPEHyper, run_dir: Path, root: SecretRoot, run_info: dict,
) -> dict[str, Any]:
    """One private GPOPE release through the Trainer; its metrics and its epsilon under both relations. ``root`` is
    this release's own root (its sampler and noise are the streams "train/sampler" and "train/noise" of it);
    ``run_info["m"]`` the declared number of trajectories the schedule is planned for (module docstring)."""
    settings = config.gpope
    m = int(run_info["m"])
    plan = make_plan(config, m, hyper.epochs)
    source = plan.source(data)
    sigma, budget = planned_noise(config, plan)
    steps = plan.steps
    if sigma is not None and settings.noise_multiplier is not None:  # N = the most steps this noise fits
        from dporl.privacy.calibration import max_steps

        steps = max_steps(source.step_event(sigma), config.epsilon, config.delta, mechanism=settings.accountant)
        if steps == 0:
            raise ValidationError("gpope.noise_multiplier", f"not one step fits epsilon={config.epsilon} at this noise")
    if plan.mode == "poisson" and settings.relation == "replace_one":
        planned = epsilon_for_relation([(plan.event(sigma), steps)], config.delta, REPLACE_ONE)
        if not within_budget(planned, config.epsilon):  # calibration guarantees it; never run past the budget
            raise PrivacyBudgetError("epsilon", f"planned replace-one epsilon {planned:g} exceeds {config.epsilon}")
    module = GPOPE(problem.features, GPOPEConfig(gamma=config.gamma, average_from=_average_from(config, steps)),
                   target_policy=problem.target_policy)
    ledger = PrivacyLedger()
    trainer = Trainer(
        module,
        source,
        config=TrainerConfig(
            max_steps=steps, seed=run_info.get("trial", 0), log_every=max(1, steps // 20), eval_every=steps,
            checkpoint_every=steps, journal_every=max(50, steps // 20), progress=False,
            optimizer=OptimizerConfig(name="sgd", lr=hyper.step_size * plan.batch, schedule=settings.schedule,
                                      time_offset=settings.time_offset),
        ),
        dp=DPConfig(
            epsilon=budget, delta=config.delta, noise_multiplier=sigma, max_grad_norm=hyper.clip_norm,
            accountant=settings.accountant, clipping="naive",
        ),
        ledger=ledger,
        secret_root=root,
        run_dir=run_dir,
        pipeline="ope",
        pipeline_config={"ope": to_dict(config), **run_info, "step_size": hyper.step_size,
                         "clip_norm": hyper.clip_norm, "epochs": hyper.epochs},
        evaluators={"ope": lambda mod: problem.metrics(mod.estimate())},
    )
    result = trainer.fit()
    history = ledger.stages["train"].accountant.history
    native = ledger.spent("train")
    if plan.mode == "poisson":
        epsilons = {"epsilon_add_remove": native,
                    "epsilon_replace_one": epsilon_for_relation(history, config.delta, REPLACE_ONE)}
    else:
        epsilons = {"epsilon_add_remove": math.nan, "epsilon_replace_one": native}
    out = {**problem.metrics(module.estimate()), **epsilons, "steps": result.steps, "batch": plan.batch,
           "noise_multiplier": result.noise_multiplier, "step_size": hyper.step_size, "clip_norm": hyper.clip_norm,
           "epochs": hyper.epochs}
    out["epsilon"] = out[f"epsilon_{settings.relation}"]
    if plan.mode == "paper":
        out["paper_lemma1_epsilon"] = paper_lemma1_epsilon(result.noise_multiplier, m, result.steps, config.delta)
    return out


def public_gradient_norms(problem, data: dict, gamma: float, chunk: int = 4096) -> torch.Tensor:
    """||B_i(theta, 0)|| of every public trajectory at theta = 0 and at the public (per-trajectory) LSTD solution."""
    module = GPOPE(problem.features, GPOPEConfig(gamma=gamma, dtype="float64"), target_policy=problem.target_policy)
    solution = lstd(problem.features, data, gamma, target_policy=problem.target_policy, weighting="trajectory")
    m = int(data["mask"].shape[0])
    norms = []
    for theta in (torch.zeros_like(solution), solution):
        with torch.no_grad():
            module.theta.copy_(theta)
            module.w.zero_()
        for start in range(0, m, chunk):
            rows = {k: v[start : start + chunk] for k, v in data.items()}
            n = int(rows["mask"].shape[0])
            norms.append(module.unit_directions(Batch(rows, torch.arange(n), n, private=False)).norm(dim=1))
    return torch.cat(norms)


def tune_gpope(
    config: OPEConfig, problem, public: dict, m: int, run_dir: Path, progress=None
) -> tuple[GPOPEHyper, list[dict[str, Any]]]:
    """The (step size, clip norm, passes) with the lowest headline metric of a GPOPE run on public data, and the
    score of every grid point (public runs: Figure 1(b)'s sensitivity to the step size comes from them)."""
    settings = config.gpope
    epochs = [settings.epochs] if settings.epochs is not None else settings.epochs_grid
    steps = [settings.step_size] if settings.step_size is not None else settings.step_size_grid
    if settings.clip_norm is not None:
        clips = [(settings.clip_norm, None)]
    else:
        norms = public_gradient_norms(problem, public, config.gamma).double()
        clips = [(float(torch.quantile(norms, q)), q) for q in settings.clip_quantile_grid]
    grid = [GPOPEHyper(lr, h, e, q) for e in epochs for lr in steps for h, q in clips]
    if len(grid) == 1:
        return grid[0], []
    scores = {}
    # Public data: its noise needs no secret; a root from the public seed keeps tuning reproducible.
    public_root = SecretRoot(config.seed)
    for k, hyper in enumerate(grid):
        result = run_gpope(config, problem, public, hyper, run_dir / f"run{k}",
                           public_root.child(f"tuning/m{m}/run{k}"), {"m": m, "trial": -1})
        scores[hyper] = result["mspbe"]
        if progress is not None:
            progress.update(1)
    best = min(scores, key=scores.get)
    return best, [{"step_size": h.step_size, "clip_norm": h.clip_norm, "clip_quantile": h.clip_quantile,
                   "epochs": h.epochs, "score": v} for h, v in scores.items()]


def tuning_runs(config: OPEConfig) -> int:
    settings = config.gpope
    sizes = [
        1 if settings.epochs is not None else len(settings.epochs_grid),
        1 if settings.step_size is not None else len(settings.step_size_grid),
        1 if settings.clip_norm is not None else len(settings.clip_quantile_grid),
    ]
    total = math.prod(sizes)
    return 0 if total == 1 else total


def run_output_perturbation(
    method: str, config: OPEConfig, problem, data: dict, lambda_scale: float, noise: NoiseSource
) -> dict[str, Any]:
    """One DP-LSW or DP-LSL release (smooth sensitivity, replace-one) with ``noise`` (a secret stream for private
    data), recorded in its own ledger stage."""
    settings = config.output_perturbation
    bound = settings.return_bound if settings.return_bound is not None else problem.reward_max / (1 - config.gamma)
    visits = first_visit_returns(data, problem.n_states, config.gamma, bound)
    if method == "dp_lsw":
        release = dp_lsw(visits, problem.feature_matrix, epsilon=config.epsilon, delta=config.delta,
                         return_bound=bound, noise=noise, weights=problem.lsw_weights)
    else:
        lam = lambda_scale * math.sqrt(visits.n_trajectories)
        release = dp_lsl(visits, problem.feature_matrix, epsilon=config.epsilon, delta=config.delta,
                         return_bound=bound, lam=lam, noise=noise)
    ledger = PrivacyLedger()
    # An (epsilon, delta) release has no RDP curve; PLD reproduces its epsilon (to float rounding).
    ledger.stage(method, mechanism="pld", unit="trajectory", delta=config.delta, analysis=SMOOTH_SENSITIVITY_ANALYSIS)
    ledger.record(method, release.event())
    spent = ledger.spent(method)
    return {**problem.metrics(release.theta), "epsilon_replace_one": spent, "epsilon_add_remove": math.nan,
            "epsilon": spent if config.gpope.relation == "replace_one" else math.nan}


def tune_lsl_lambda(config: OPEConfig, problem, public: dict, m: int) -> float:
    settings = config.output_perturbation
    if settings.lsl_lambda_scale is not None:
        return settings.lsl_lambda_scale
    # lambda must exceed ||Phi||^2 ||rho||_inf; grid values that do not are skipped.
    floor = float(torch.linalg.matrix_norm(problem.feature_matrix, ord=2)) ** 2
    scores = {}
    for scale in settings.lsl_lambda_grid:
        if scale * math.sqrt(m) > floor:
            noise = NoiseSource(generator=public_generator(config.seed, f"tuning/dp_lsl/m{m}/scale{scale!r}"),
                                reproducible=True)  # public data: public noise
            scores[scale] = run_output_perturbation("dp_lsl", config, problem, public, scale, noise)["mspbe"]
    if not scores:
        raise ValidationError(
            "output_perturbation.lsl_lambda_grid", f"no lambda exceeds ||Phi||^2 = {floor:g} at m={m}"
        )
    return min(scores, key=scores.get)
