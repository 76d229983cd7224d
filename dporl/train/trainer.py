"""The one training loop of dporl.

Every algorithm (private CQL, GPOPE, functional-noise Q-learning, their baselines) trains here. The loop owns:
sampling (a batch source from ``dporl.privacy.samplers``), the DP-SGD engine, the privacy ledger, the budget
(private runs take the largest number of steps whose accounted epsilon fits the stage budget, never more),
evaluation hooks, TensorBoard, checkpoint / resume and seeding.

An algorithm is an ``nn.Module`` with a ``privacy_unit`` and either
``row_losses(batch) -> Tensor[n_rows]`` (autograd; the engine clips per unit) or
``unit_directions(batch) -> Tensor[n_units, D]`` (closed-form update directions, e.g. GPOPE), and optionally
``on_step_end(step)`` (target-network updates and other post-processing). It never adds noise itself.

Accounting: every step records the source's per-step event (a mixture event for Algorithm 3, whatever branch
the step took), because the analysis is of the mechanism the sampler runs, not of the branch it happened to draw.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import torch
from torch import nn

from dporl.logging import CURATOR_PREFIX, RunLogger
from dporl.privacy.calibration import calibrate_noise_multiplier, max_steps
from dporl.privacy.dpsgd import DPSGDEngine, write_flat_gradients
from dporl.privacy.events import PrivacyEvent, event_to_dict
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.noise import NoiseSource, secret_generator
from dporl.privacy.units import as_unit
from dporl.train.checkpoint import load_checkpoint, read_journal, save_checkpoint, write_journal
from dporl.train.config import DPConfig, OptimizerConfig, TrainerConfig
from dporl.utils.io import atomic_write_json
from dporl.utils.seeding import global_rng_state, make_generator, seed_everything, set_global_rng_state
from dporl.utils.validation import PrivacyBudgetError, ValidationError

Evaluator = Callable[[nn.Module], Mapping[str, float]]


@dataclass
class TrainResult:
    steps: int  # optimizer steps taken by the returned model
    budget_steps: int  # privacy-costing steps counted by the ledger (>= steps after an interruption)
    noise_multiplier: Optional[float]
    metrics: dict[str, float]
    privacy: dict[str, Any]
    run_dir: Path
    eval_history: list[tuple[int, dict[str, float]]] = field(default_factory=list)


def build_optimizer(params: Sequence[nn.Parameter], config: OptimizerConfig) -> torch.optim.Optimizer:
    if config.name == "adam":
        return torch.optim.Adam(params, lr=config.lr, weight_decay=config.weight_decay)
    if config.name == "rmsprop":
        return torch.optim.RMSprop(params, lr=config.lr, weight_decay=config.weight_decay, momentum=config.momentum)
    return torch.optim.SGD(params, lr=config.lr, weight_decay=config.weight_decay, momentum=config.momentum)


def _lr_factor(config: OptimizerConfig) -> Callable[[int], float]:
    if config.schedule == "constant":
        return lambda step: 1.0
    # LambdaLR passes the number of completed steps; step i (1-based) uses lr / (i + offset).
    return lambda step: 1.0 / (step + 1 + config.time_offset)


class Trainer:
    """Runs ``algorithm`` on batches from ``source`` until its step cap or its privacy budget is reached."""

    def __init__(
        self,
        algorithm: nn.Module,
        source: Any,
        *,
        config: TrainerConfig,
        dp: Optional[DPConfig],
        ledger: PrivacyLedger,
        run_dir: str | Path,
        pipeline: str,
        pipeline_config: Mapping[str, Any],
        stage: str = "train",
        evaluators: Mapping[str, Evaluator] | None = None,
    ):
        if not hasattr(algorithm, "row_losses") and not hasattr(algorithm, "unit_directions"):
            raise ValidationError("algorithm", "needs row_losses(batch) or unit_directions(batch)")
        self.algorithm = algorithm
        self.source = source
        self.config = config
        self.dp = dp if dp is not None and dp.enabled else None
        self.ledger = ledger
        self.run_dir = Path(run_dir)
        self.pipeline = pipeline
        self.pipeline_config = dict(pipeline_config)
        self.stage = stage
        self.evaluators = dict(evaluators or {})
        self.device = torch.device(config.device)
        self.checkpoint_path = self.run_dir / "checkpoints" / "last.pt"
        self.journal_path = self.run_dir / "privacy_journal.json"

    # ------------------------------------------------------------------ setup
    def _plan_privacy(self) -> tuple[Optional[float], Optional[PrivacyEvent], int]:
        """(noise multiplier, per-step event, total privacy-costing steps allowed)."""
        cap = self.config.max_steps
        if self.dp is None:
            if cap is None:
                raise ValidationError("trainer.max_steps", "a non-private run needs a step cap")
            return None, None, cap
        dp = self.dp
        sigma = dp.noise_multiplier
        if sigma is None:
            if cap is None:
                raise ValidationError(
                    "dp.noise_multiplier", "give a noise multiplier, or trainer.max_steps to calibrate one for"
                )
            sigma = calibrate_noise_multiplier(
                dp.epsilon, dp.delta, cap, make_event=self.source.step_event, mechanism=dp.accountant
            )
        event = self.source.step_event(sigma)
        if event is None:
            raise ValidationError("dp.enabled", "the batch source has no private branch; disable dp for it")
        allowed = max_steps(event, dp.epsilon, dp.delta, mechanism=dp.accountant, limit=cap)
        if allowed == 0:
            raise PrivacyBudgetError(
                "dp.epsilon", f"not even one step fits epsilon={dp.epsilon} at delta={dp.delta} with sigma={sigma:g}"
            )
        return sigma, event, allowed

    def _open_stage(self) -> None:
        """The private stage of this run, in the ledger: budget, analysis and the algorithm's privacy unit."""
        unit = getattr(self.algorithm, "privacy_unit", None)
        if unit is None:
            raise ValidationError("algorithm.privacy_unit", "a private run must say what it protects")
        unit = as_unit(unit)
        budget = (self.dp.epsilon, self.dp.delta)
        if self.stage not in self.ledger.stages:
            self.ledger.stage(self.stage, budget=budget, mechanism=self.dp.accountant, unit=unit)
            return
        existing = self.ledger.stages[self.stage]
        # A stage opened by the pipeline must be the one this loop plans for, or the step count would be wrong.
        if (existing.budget, existing.mechanism, existing.unit) != (budget, self.dp.accountant, unit):
            raise ValidationError(
                "ledger.stage",
                f"stage {self.stage!r} exists with budget {existing.budget}, {existing.mechanism}, unit "
                f"{existing.unit}; this run needs {budget}, {self.dp.accountant}, unit {unit}",
            )

    def _trainable(self) -> list[nn.Parameter]:
        params = [p for p in self.algorithm.parameters() if p.requires_grad]
        if not params:
            raise ValidationError("algorithm", "has no trainable parameters")
        return params

    # ------------------------------------------------------------------ main loop
    def fit(self) -> TrainResult:
        config = self.config
        seed_everything(config.seed)
        self.algorithm.to(self.device)
        params = self._trainable()
        optimizer = build_optimizer(params, config.optimizer)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_factor(config.optimizer))
        # A private run's sampling is part of its mechanism: secret, unless noise_seed asks for a reproduction.
        if self.dp is None:
            generator = make_generator(config.seed + 1)
        else:
            generator = secret_generator(None if self.dp.noise_seed is None else self.dp.noise_seed + 1)
        sigma, event, total_budget_steps = self._plan_privacy()
        noise = NoiseSource(self.dp.noise_seed if self.dp else None)
        engine = None
        if self.dp is not None:
            engine = DPSGDEngine(
                self.algorithm,
                max_grad_norm=self.dp.max_grad_norm,
                noise_multiplier=sigma,
                expected_batch_size=self.source.expected_batch_size,
                noise=noise,
                # Closed-form directions are clipped as whole vectors: no per-layer tape, any parameter type.
                mode="naive" if hasattr(self.algorithm, "unit_directions") else self.dp.clipping,
            )
            self._open_stage()

        step, budget_steps, eval_history = 0, 0, []
        if self.checkpoint_path.exists():
            if not config.resume:
                raise ValidationError("trainer.resume", f"{self.checkpoint_path} exists; resume or use a new run_dir")
            state = load_checkpoint(self.checkpoint_path)
            self._check_same_run(state)
            self.algorithm.load_state_dict(state["algorithm"])
            optimizer.load_state_dict(state["optimizer"])
            scheduler.load_state_dict(state["scheduler"])
            self.ledger.load_state_dict(state["ledger"])
            generator.set_state(state["rng"]["sampler"])
            noise.load_state_dict(state["rng"]["noise"])
            set_global_rng_state(state["rng"]["global"])
            step, budget_steps, eval_history = state["step"], state["budget_steps"], state["eval_history"]
        if event is not None:
            # Steps authorised before a crash may have leaked through logs or evaluations: count them as spent.
            authorised = read_journal(self.journal_path)
            if authorised > budget_steps:
                self.ledger.record(self.stage, event, authorised - budget_steps)
                budget_steps = authorised
        authorised = budget_steps

        self.run_dir.mkdir(parents=True, exist_ok=True)
        logger = RunLogger(self.run_dir / "tensorboard")
        logger.text("config", f"```\n{self.pipeline_config}\n```")
        if event is not None:
            logger.text("privacy/plan", f"per-step event: {event_to_dict(event)}; steps allowed: {total_budget_steps}")
        progress = _progress(total_budget_steps, budget_steps, config.progress)
        last_log = time.perf_counter()
        try:
            while budget_steps < total_budget_steps:
                if event is not None and budget_steps >= authorised:
                    authorised = min(total_budget_steps, budget_steps + config.journal_every)
                    write_journal(self.journal_path, authorised)
                if event is not None:  # paid before it runs: a step the ledger refuses never happens
                    self.ledger.record(self.stage, event)
                diagnostics = self._step(self.source.sample(generator), engine, optimizer)
                scheduler.step()
                step += 1
                budget_steps += 1
                progress.update(1)
                if hasattr(self.algorithm, "on_step_end"):
                    self.algorithm.on_step_end(step)
                if step % config.log_every == 0:
                    now = time.perf_counter()
                    scalars = {"train/steps_per_second": config.log_every / max(now - last_log, 1e-9)}
                    scalars["train/lr"] = optimizer.param_groups[0]["lr"]
                    last_log = now
                    if config.curator_diagnostics:
                        scalars.update({CURATOR_PREFIX + k: v for k, v in diagnostics.items()})
                    logger.scalars(scalars, step)
                if step % config.eval_every == 0 or budget_steps == total_budget_steps:
                    metrics = self._evaluate()
                    if self.dp is not None:
                        metrics["privacy/epsilon"] = self.ledger.spent(self.stage)
                    eval_history.append((step, metrics))
                    logger.scalars(metrics, step)
                    progress.set_postfix({k.split("/")[-1]: f"{v:.3g}" for k, v in list(metrics.items())[:3]})
                if step % config.checkpoint_every == 0 or budget_steps == total_budget_steps:
                    self._save(step, budget_steps, optimizer, scheduler, generator, noise, eval_history)
        finally:
            progress.close()

        report = self.ledger.report()
        final = dict(eval_history[-1][1]) if eval_history else {}
        logger.hparams(
            {"pipeline": self.pipeline, **self.pipeline_config},
            {k: v for k, v in final.items() if isinstance(v, (int, float))},
        )
        logger.text("privacy/report", report.describe())
        logger.close()
        result = TrainResult(
            steps=step,
            budget_steps=budget_steps,
            noise_multiplier=sigma,
            metrics=final,
            privacy=report.to_dict(),
            run_dir=self.run_dir,
            eval_history=eval_history,
        )
        atomic_write_json(
            self.run_dir / "summary.json",
            {
                "pipeline": self.pipeline,
                "steps": step,
                "budget_steps": budget_steps,
                "noise_multiplier": sigma,
                "metrics": final,
                "privacy": result.privacy,
                "eval_history": eval_history,
            },
        )
        return result

    def _step(self, batch: Any, engine: Optional[DPSGDEngine], optimizer: torch.optim.Optimizer) -> dict[str, float]:
        batch = batch.to(self.device)
        optimizer.zero_grad(set_to_none=True)
        closed_form = hasattr(self.algorithm, "unit_directions")
        diagnostics: dict[str, float] = {}
        if batch.private:
            if engine is None:
                raise ValidationError("dp.enabled", "the source produced a private batch but dp is disabled")
            if closed_form:
                direction = engine.private_direction(self.algorithm.unit_directions(batch))
                engine.write_gradients(direction)
                stats = engine.last_stats
            else:
                losses = self.algorithm.row_losses(batch)
                stats = engine.private_backward(losses, batch.unit_index, batch.n_units)
                diagnostics["private_loss"] = float(losses.detach().mean()) if losses.numel() else math.nan
            diagnostics.update(
                {"units": float(stats.n_units), "clip_fraction": stats.clip_fraction, "grad_norm": stats.mean_norm}
            )
        elif closed_form:
            write_flat_gradients(self._trainable(), self.algorithm.unit_directions(batch).mean(dim=0))
        else:
            losses = self.algorithm.row_losses(batch)
            if engine is not None:  # lets the engine drop what its hooks recorded on this noiseless step
                engine.public_backward(losses)
            else:
                losses.mean().backward()
            diagnostics["public_loss"] = float(losses.detach().mean())
        optimizer.step()
        return diagnostics

    def _evaluate(self) -> dict[str, float]:
        metrics: dict[str, float] = {}
        was_training = self.algorithm.training
        self.algorithm.eval()
        with torch.no_grad():
            for name, evaluator in self.evaluators.items():
                metrics.update({f"{name}/{k}": float(v) for k, v in evaluator(self.algorithm).items()})
        self.algorithm.train(was_training)
        return metrics

    def _save(self, step, budget_steps, optimizer, scheduler, generator, noise, eval_history) -> None:
        save_checkpoint(
            self.checkpoint_path,
            {
                "pipeline": self.pipeline,
                "config": self.pipeline_config,
                "step": step,
                "budget_steps": budget_steps,
                "algorithm": self.algorithm.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "ledger": self.ledger.state_dict(),
                "eval_history": eval_history,
                "rng": {"sampler": generator.get_state(), "noise": noise.state_dict(), "global": global_rng_state()},
            },
        )

    def _check_same_run(self, state: Mapping[str, Any]) -> None:
        if state["pipeline"] != self.pipeline or state["config"] != self.pipeline_config:
            raise ValidationError(
                "trainer.resume", f"{self.checkpoint_path} belongs to a different configuration; use a new run_dir"
            )


def _progress(total: int, initial: int, enabled: bool):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, desc="train", unit="step", dynamic_ncols=True)
