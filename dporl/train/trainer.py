"""The one training loop of dporl.

Every algorithm (private CQL, GPOPE, functional-noise Q-learning, their baselines) trains here. The loop owns:
sampling (a batch source from ``dporl.privacy.samplers``), the DP-SGD engine, the privacy ledger, the budget
(private runs take the largest number of steps whose accounted epsilon fits the stage budget, never more),
evaluation hooks, TensorBoard, checkpoint / resume and the run's secret streams.

Where things go (``dporl.train.run_dir``): the run directory's ``release/`` receives the privacy report, the public
scalars (evaluators named in ``public_evaluators``, e.g. returns in the public simulator; privacy spent; the
learning rate) and a public summary; ``curator/`` receives the checkpoints (with generator states), the privacy
journal, the full summary and, only with ``trainer.curator_diagnostics``, TensorBoard diagnostics computed from
private batches without noise. Evaluators not named public are curator-only.

Privacy randomness: the private sampler and the DP noise are the streams ``"<stage>/sampler"`` and
``"<stage>/noise"`` of one ``SecretRoot`` (the pipeline's, shared with its other mechanisms, or one made from
``dp.noise_seed``). The journal (the ledger's write-ahead log) authorises blocks of ``journal_every`` steps before
they run; on resume every authorised step is charged as recorded, run or not.

No paid step is thrown away. A checkpoint (with the sampler's and the noise's generator states) is written before
every block is authorised (step 0 included) and at least every ``checkpoint_every`` steps, so after a crash the
journal charges at most one block more than the checkpoint holds. A resumed loop restores the checkpoint and first
runs those charged steps again: same iterate, same generator states, hence the same batches and the same noise (the
same mechanism run, bit for bit on the CPU; on CUDA, non-deterministic kernels may change the last bits of the
replayed iterates, never the draws), consuming their authorisation instead of charging anew. At the end the steps
the model was trained for equal the steps charged, whatever interrupted the run; the step a crash interrupted is
one of the replayed ones. Only when a resumed run's per-step event differs from the one that was charged (a library
user changing the source) are such steps counted as charged and lost, and the run says so.

Interrupts (``dporl.train.interrupt``): SIGINT / SIGTERM finish the step in flight, checkpoint, and raise
``Interrupted`` (the command line prints where it stopped and the command that continues it).

An algorithm is a ``dporl.algos.base.PrivateAlgorithm``: it declares its privacy unit, the batch keys it reads and
its loss form, and the loop dispatches on that declaration: ``row_losses(batch)`` (autograd; the engine clips per
unit), ``weighted_row_losses(batch)`` (row losses and weights |w| <= 1 that scale each unit's gradient after
clipping: reward-level Q-learning's clipped-TD semi-gradient) or ``unit_directions(batch)`` (closed-form update
directions, e.g. GPOPE, clipped as whole vectors), then ``on_step_end(step)`` (target-network updates and other
post-processing). It never adds noise itself.

Accounting: every step records the source's per-step event (a mixture event for Algorithm 3, whatever branch
the step took), because the analysis is of the mechanism the sampler runs, not of the branch it happened to draw;
in a ledger for replace-one neighbours, that event analysed for replace-one (``relations.analysed_for``).
"""

from __future__ import annotations

import inspect
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Collection, Mapping, Optional, Sequence

import torch
from torch import nn

from dporl.algos.base import LossForm, PrivateAlgorithm, declaration_of
from dporl.logging import CURATOR_PREFIX, RunLogger
from dporl.privacy.calibration import STEP_SEARCH_LIMIT, calibrate_noise_multiplier, max_steps
from dporl.privacy.dpsgd import DPSGDEngine, write_flat_gradients
from dporl.privacy.events import PrivacyEvent, event_to_dict
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.randomness import SecretRoot
from dporl.privacy.relations import analysed_for
from dporl.privacy.units import as_unit
from dporl.train import interrupt
from dporl.train.checkpoint import load_checkpoint, save_checkpoint
from dporl.train.config import DPConfig, OptimizerConfig, TrainerConfig
from dporl.train.run_dir import RunDirectory, config_sha256
from dporl.utils.config import to_dict
from dporl.utils.device import resolve_device
from dporl.utils.io import atomic_write_json
from dporl.utils.seeding import public_generator
from dporl.utils.validation import PrivacyBudgetError, ValidationError

Evaluator = Callable[[nn.Module], Mapping[str, float]]


@dataclass
class TrainResult:
    steps: int  # optimizer steps taken by the returned model
    budget_steps: int  # privacy-costing steps of this stage charged by the ledger (== steps of a private run)
    noise_multiplier: Optional[float]
    metrics: dict[str, float]  # every metric of the last evaluation (curator view)
    privacy: dict[str, Any]
    run_dir: Path
    eval_history: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    public_metrics: dict[str, float] = field(default_factory=dict)  # the public part of ``metrics``


_OPTIMIZERS = {"adam": torch.optim.Adam, "rmsprop": torch.optim.RMSprop, "sgd": torch.optim.SGD}


def build_optimizer(params: Sequence[nn.Parameter], config: OptimizerConfig) -> torch.optim.Optimizer:
    """The configured optimizer with torch's fused kernel where it has one (Adam, SGD), else its foreach kernels.

    One kernel over all parameters instead of a Python loop per parameter: a 2 x 256 CQL step takes 0.88x the time
    with fused Adam. Private and non-private runs use the same construction, so their costs compare honestly.
    """
    params = list(params)
    kind = _OPTIMIZERS[config.name]
    kwargs: dict[str, Any] = {"lr": config.lr, "weight_decay": config.weight_decay}
    if config.name != "adam":
        kwargs["momentum"] = config.momentum
    if "fused" in inspect.signature(kind).parameters:
        try:
            return kind(params, fused=True, **kwargs)
        except RuntimeError:  # no fused kernel for these parameters' device or dtype
            pass
    return kind(params, foreach=True, **kwargs)


def _lr_factor(config: OptimizerConfig) -> Callable[[int], float]:
    if config.schedule == "constant":
        return lambda step: 1.0
    # LambdaLR passes the number of completed steps; step i (1-based) uses lr / (i + offset).
    return lambda step: 1.0 / (step + 1 + config.time_offset)


def plan_privacy(
    dp: Optional[DPConfig],
    cap: Optional[int],
    step_event: Callable[[float], Optional[PrivacyEvent]],
    *,
    ledger: Optional[PrivacyLedger] = None,
    stage: str = "train",
) -> tuple[Optional[float], Optional[PrivacyEvent], int]:
    """(noise multiplier, per-step event, steps allowed) of a training stage whose source states ``step_event``.

    With ``dp.share_run_budget`` the stage ``stage`` of ``ledger`` (the run's, or a scratch ledger holding the
    earlier stages' events as they will be recorded) is planned against the run budget: its steps composed with
    every other stage's events by one PLD fit the run's epsilon at the total delta (``PrivacyLedger.shared_budget``).
    Pure: pipelines call it before their first write, so an impossible budget is refused with nothing written.
    """
    if dp is None or not dp.enabled:
        if cap is None:
            raise ValidationError("trainer.max_steps", "a non-private run needs a step cap")
        return None, None, cap
    epsilon, delta, mechanism, prior = dp.epsilon, dp.delta, dp.accountant, ()
    if dp.share_run_budget:
        if ledger is None:
            raise ValidationError("dp.share_run_budget",
                                  "a stage sharing the run budget is planned in the run's ledger")
        target = ledger.shared_budget(stage, dp.delta)
        epsilon, delta, prior, mechanism = target.epsilon, target.delta, target.prior, target.mechanism
    sigma = dp.noise_multiplier
    if sigma is None:
        if cap is None:
            raise ValidationError(
                "dp.noise_multiplier", "give a noise multiplier, or trainer.max_steps to calibrate one for"
            )
        sigma = calibrate_noise_multiplier(epsilon, delta, cap, make_event=step_event, mechanism=mechanism, prior=prior)
    event = step_event(sigma)
    if event is None:
        raise ValidationError("dp.enabled", "the batch source has no private branch; disable dp for it")
    allowed = max_steps(event, epsilon, delta, mechanism=mechanism, limit=cap, prior=prior)
    if allowed == 0:
        raise PrivacyBudgetError(
            "dp.epsilon", f"not even one step fits epsilon={epsilon} at delta={delta} with sigma={sigma:g}"
            + (" beside the run's other stages" if prior else "")
        )
    return sigma, event, allowed


class Trainer:
    """Runs ``algorithm`` on batches from ``source`` until its step cap or its privacy budget is reached.

    ``run_dir`` is a path (the Trainer then owns a run directory there: a new one, or, with ``trainer.resume``,
    its own earlier run if the provenance matches) or the pipeline's ``RunDirectory``. ``public_evaluators`` names
    the evaluators whose metrics are public (computed in a public simulator from the released iterate);
    ``secret_root`` is the run's ``SecretRoot`` (default: one from ``dp.noise_seed``).
    """

    def __init__(
        self,
        algorithm: PrivateAlgorithm,
        source: Any,
        *,
        config: TrainerConfig,
        dp: Optional[DPConfig],
        ledger: PrivacyLedger,
        run_dir: str | Path | RunDirectory,
        pipeline: str,
        pipeline_config: Mapping[str, Any],
        stage: str = "train",
        evaluators: Mapping[str, Evaluator] | None = None,
        public_evaluators: Collection[str] = (),
        secret_root: Optional[SecretRoot] = None,
    ):
        self.declaration = declaration_of(algorithm)  # a ContractError before anything is written
        _check_same_unit(algorithm, source)
        self.algorithm = algorithm
        self.source = source
        self.config = config
        self.dp = dp if dp is not None and dp.enabled else None
        self.ledger = ledger
        self.run = run_dir if isinstance(run_dir, RunDirectory) else None
        self.run_dir = self.run.root if self.run is not None else Path(run_dir)
        self.pipeline = pipeline
        self.pipeline_config = dict(pipeline_config)
        self.stage = stage
        self.evaluators = dict(evaluators or {})
        self.public_evaluators = frozenset(public_evaluators)
        unknown = sorted(self.public_evaluators - set(self.evaluators))
        if unknown:
            raise ValidationError("public_evaluators", f"{unknown} are not evaluators ({sorted(self.evaluators)})")
        self.secret_root = secret_root
        self.device = resolve_device(config.device, "trainer.device")
        self._engine: Optional[DPSGDEngine] = None
        self.current_step = 0  # the step being taken (1-based) while fit() runs; for progress hooks

    @property
    def checkpoint_path(self) -> Path:
        return (self.run.checkpoint_path if self.run is not None else self.run_dir / "curator" / "checkpoints" /
                "last.pt")

    @property
    def journal_path(self) -> Path:
        return self.run.journal_path if self.run is not None else self.run_dir / "curator" / "journal.json"

    def provenance_config(self) -> dict[str, Any]:
        """What this loop computes, as hashed into its checkpoints (and its run directory when it owns one)."""
        return {
            "pipeline": self.pipeline,
            "pipeline_config": self.pipeline_config,
            "stage": self.stage,
            "trainer": to_dict(self.config),
            "dp": None if self.dp is None else to_dict(self.dp),
        }

    # ------------------------------------------------------------------ setup
    def _plan_privacy(self) -> tuple[Optional[float], Optional[PrivacyEvent], int]:
        """(noise multiplier, per-step event, total privacy-costing steps allowed)."""
        relation = self.ledger.relation  # a replace-one run records (and so calibrates) replace-one events

        def step_event(sigma: float) -> Optional[PrivacyEvent]:
            return analysed_for(relation, self.source.step_event(sigma))

        return plan_privacy(self.dp, self.config.max_steps, step_event, ledger=self.ledger, stage=self.stage)

    def _open_stage(self) -> None:
        """The private stage of this run, in the ledger: budget, analysis and the privacy unit (the source's grouping
        owns it: an algorithm declaring another unit was refused at construction, ``_check_same_unit``)."""
        unit = self.algorithm.privacy_unit
        if unit is None:
            raise ValidationError("algorithm.privacy_unit", "a private run must say what it protects")
        unit = as_unit(unit)
        budget = (self.dp.epsilon, self.dp.delta)
        shares = self.dp.share_run_budget
        if self.stage not in self.ledger.stages:
            self.ledger.stage(self.stage, budget=budget, mechanism=self.dp.accountant, unit=unit,
                              shares_run_budget=shares)
            return
        existing = self.ledger.stages[self.stage]
        # A stage opened by the pipeline must be the one this loop plans for, or the step count would be wrong.
        if (existing.budget, existing.mechanism, existing.unit, existing.shares_run_budget) != (
            budget, self.dp.accountant, unit, shares
        ):
            raise ValidationError(
                "ledger.stage",
                f"stage {self.stage!r} exists with budget {existing.budget}, {existing.mechanism}, unit "
                f"{existing.unit}, shares the run budget: {existing.shares_run_budget}; this run needs {budget}, "
                f"{self.dp.accountant}, unit {unit}, {shares}",
            )

    def _trainable(self) -> list[nn.Parameter]:
        params = [p for p in self.algorithm.parameters() if p.requires_grad]
        if not params:
            raise ValidationError("algorithm", "has no trainable parameters")
        return params

    # ------------------------------------------------------------------ main loop
    def fit(self) -> TrainResult:
        try:
            return self._fit()
        finally:  # the engine's hooks leave the module with the run, whatever happened
            if self._engine is not None:
                self._engine.close()
                self._engine = None

    def _fit(self) -> TrainResult:
        # Checks first, writes after: a refused run leaves its directory as it found it.
        owned = self.run is None
        run = self.run or RunDirectory(
            self.run_dir, pipeline=self.pipeline, config=self.provenance_config(),
            mode="resume" if self.config.resume else "new",
        )
        try:
            return self._fit_in(run)
        finally:
            if owned:
                run.close()

    def _fit_in(self, run: RunDirectory) -> TrainResult:
        config = self.config
        trainer_sha256 = config_sha256(self.provenance_config())
        self.algorithm.to(self.device)
        if hasattr(self.source, "to"):  # rows live on the device; sampling decisions stay on the CPU
            self.source.to(self.device)
        params = self._trainable()
        optimizer = build_optimizer(params, config.optimizer)
        scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, _lr_factor(config.optimizer))
        sigma, event, planned = self._plan_privacy()
        generator, noise = self._streams()

        step, eval_history, checkpointed = 0, [], 0
        saved_at: Optional[int] = None  # the step the checkpoint on disk holds
        if run.checkpoint_path.exists():
            if not config.resume:
                raise ValidationError("trainer.resume", f"{run.checkpoint_path} exists; resume or use a new run_dir")
            state = load_checkpoint(run.checkpoint_path)
            self._check_same_run(state, trainer_sha256, run.inputs)
            # The journal must charge at least what the checkpoint saw charged, with the same events.
            run.check_witness(state["journal"], f"the checkpoint {run.checkpoint_path} (step {state['step']})")
            self._restore(state, optimizer, scheduler, generator, noise)
            step, checkpointed, eval_history = state["step"], state["budget_steps"], state["eval_history"]
            saved_at = step

        run.begin()
        if not self.ledger.journaled:
            run.attach(self.ledger)  # from here on every charge is journaled before the step it pays for runs
        engine = None
        if self.dp is not None:
            engine = DPSGDEngine(
                self.algorithm,
                max_grad_norm=self.dp.max_grad_norm,
                noise_multiplier=sigma,
                expected_batch_size=self.source.expected_batch_size,
                noise=noise,
                # Closed-form directions are clipped as whole vectors: no per-layer tape, any parameter type.
                mode="naive" if self.declaration.loss_form is LossForm.UNIT_DIRECTIONS else self.dp.clipping,
            )
            self._engine = engine
            self._open_stage()
            charged, ahead, total_budget_steps = self._resume_plan(event, planned, checkpointed)
            if ahead:
                self.ledger.adopt_authorised(self.stage, event, ahead)
        else:
            charged, ahead, total_budget_steps = checkpointed, 0, planned
        budget_steps = checkpointed  # steps of this stage the model has taken (each one charged)
        authorised = checkpointed + ahead
        if step or charged:
            self._announce_resume(step, charged, ahead, total_budget_steps)

        public = RunLogger(run.release / "tensorboard")
        curator = RunLogger(run.curator / "tensorboard", enabled=config.curator_diagnostics, wall_clock=True)
        curator.text("config", f"```\n{self.pipeline_config}\n```")
        if event is not None:
            public.text("privacy/plan", f"per-step event: {event_to_dict(event)}; steps allowed: {total_budget_steps}")
        progress = _progress(total_budget_steps, budget_steps, config.progress, self.stage)
        last_log = time.perf_counter()

        def save() -> None:
            nonlocal saved_at
            if saved_at != step:
                self._save(run, trainer_sha256, step, budget_steps, optimizer, scheduler, generator, noise,
                           eval_history)
                saved_at = step

        try:
            with interrupt.deferred_interrupts():
                while budget_steps < total_budget_steps:
                    if event is not None and budget_steps >= authorised:  # write-ahead: journaled before they run
                        save()  # every block starts from a checkpoint: a resume replays at most this block
                        block = min(total_budget_steps - budget_steps, config.journal_every)
                        self.ledger.authorise(self.stage, event, block)
                        authorised = budget_steps + block
                    if event is not None:  # consumes the authorisation: a step the ledger refuses never happens
                        self.ledger.record(self.stage, event)
                    self.current_step = step + 1
                    # Curator diagnostics are computed on logging steps only (each one waits for the device).
                    wanted = config.curator_diagnostics and (step + 1) % config.log_every == 0
                    diagnostics = self._step(self.source.sample(generator), engine, optimizer, diagnostics=wanted)
                    scheduler.step()
                    step += 1
                    budget_steps += 1
                    progress.update(1)
                    self.algorithm.on_step_end(step)
                    if step % config.log_every == 0:
                        now = time.perf_counter()
                        public.scalars({"train/lr": optimizer.param_groups[0]["lr"]}, step)
                        # Step timing depends on realised batch sizes: curator-only, like the diagnostics.
                        timing = {CURATOR_PREFIX + "steps_per_second": config.log_every / max(now - last_log, 1e-9)}
                        last_log = now
                        curator.scalars({**timing, **{CURATOR_PREFIX + k: v for k, v in diagnostics.items()}}, step)
                    if step % config.eval_every == 0 or budget_steps == total_budget_steps:
                        metrics = self._evaluate()
                        if self.dp is not None:  # the run's guarantee (every stage) and each stage's epsilon
                            metrics.update(self.ledger.report().scalars())
                        eval_history.append((step, metrics))
                        public.scalars(self._public(metrics), step)
                        curator.scalars(metrics, step)
                        progress.set_postfix({k.split("/")[-1]: f"{v:.3g}"
                                              for k, v in list(self._public(metrics).items())[:3]})
                    if step % config.checkpoint_every == 0 or budget_steps == total_budget_steps:
                        save()
                    signum = interrupt.pending()
                    if signum is not None and budget_steps < total_budget_steps:
                        save()  # the step in flight finished: nothing trained is lost
                        spent = len(self.ledger.stages[self.stage].accountant) if self.dp is not None else step
                        raise interrupt.Interrupted(
                            signum, step=step, total=total_budget_steps,
                            detail=(f"{step} steps trained and checkpointed; {spent} charged"
                                    + (f" ({spent - step} authorised ahead: a resume trains them first)"
                                       if spent > step else "")),
                        )
        except BaseException:  # flush what was logged; the checkpoint and the journal say where the run stopped
            public.close()
            curator.close()
            raise
        finally:
            progress.close()

        report = self.ledger.report()
        final = dict(eval_history[-1][1]) if eval_history else {}
        curator.hparams(
            {"pipeline": self.pipeline, **self.pipeline_config},
            {k: v for k, v in final.items() if isinstance(v, (int, float))},
        )
        public.text("privacy/report", report.describe())
        public.close()
        curator.close()
        result = TrainResult(
            steps=step,
            budget_steps=len(self.ledger.stages[self.stage].accountant) if self.dp is not None else budget_steps,
            noise_multiplier=sigma,
            metrics=final,
            privacy=report.to_dict(),
            run_dir=self.run_dir,
            eval_history=eval_history,
            public_metrics=self._public(final),
        )
        summary = {"pipeline": self.pipeline, "stage": self.stage, "steps": step, "budget_steps": budget_steps,
                   "noise_multiplier": sigma, "privacy": result.privacy}
        atomic_write_json(run.release / "privacy_report.json", result.privacy)
        atomic_write_json(
            run.release / "train_summary.json",
            {**summary, "metrics": result.public_metrics,
             "eval_history": [(s, self._public(m)) for s, m in eval_history]},
        )
        atomic_write_json(run.curator / "train_summary.json",
                          {**summary, "metrics": final, "eval_history": eval_history})
        return result

    def _public(self, metrics: Mapping[str, float]) -> dict[str, float]:
        """The metrics a run may publish: public evaluators' and the privacy spent."""
        return {k: v for k, v in metrics.items()
                if k.split("/", 1)[0] in ("privacy", *self.public_evaluators)}

    def _streams(self) -> tuple[torch.Generator, Any]:
        """(sampler generator, noise source): secret streams of the run's root for a private run."""
        if self.dp is None:  # public sampling of a non-private run: an ordinary, named public stream
            return public_generator(self.config.seed, f"{self.stage}/sampler"), None
        root = self.secret_root
        if root is None:
            root = SecretRoot(self.dp.noise_seed)
        elif self.dp.noise_seed is not None:
            raise ValidationError("dp.noise_seed", "the run's SecretRoot is given: its seed is the run's noise_seed")
        return root.torch_generator(f"{self.stage}/sampler"), root.noise(f"{self.stage}/noise")

    def _resume_plan(self, event: PrivacyEvent, planned: int, checkpointed: int) -> tuple[int, int, int]:
        """(steps of this stage charged, charged steps the checkpoint has not trained and this run replays, steps
        the model will have trained at the end). An earlier attempt's authorisations count as spent."""
        history = self.ledger.stages[self.stage].accountant.history
        charged = sum(count for _, count in history)
        if charged < checkpointed:
            raise ValidationError(
                "journal", f"the checkpoint records {checkpointed} private steps but the journal only {charged}: "
                "refusing to under-count (was the journal removed?)"
            )
        unrun = charged - checkpointed
        if all(recorded == event for recorded, _ in history):
            return charged, unrun, max(planned, charged)
        # The journal holds other events (an earlier attempt's, charged as recorded): fit what is left around them.
        # Charged steps of another event cannot be replayed under this one: they stay charged, and are lost.
        tail_event, tail_count = history[-1]
        ahead = min(unrun, tail_count) if tail_event == event else 0
        if unrun > ahead:
            print(f"resume: stage {self.stage!r}: {unrun - ahead} charged steps were authorised under another "
                  "per-step event and cannot be replayed under this run's: they stay charged and are lost",
                  file=sys.stderr)
        cap = STEP_SEARCH_LIMIT if self.config.max_steps is None else max(self.config.max_steps - charged, 0)
        return charged, ahead, checkpointed + ahead + self.ledger.remaining(self.stage, event, cap)

    def _announce_resume(self, step: int, charged: int, ahead: int, total: int) -> None:
        """What a resumed loop found and will do (step counts are functions of the budget and the config)."""
        replay = (f"; {ahead} charged steps are not in the checkpoint: they run first, from it, with the secret "
                  "randomness they were charged for (charged once)" if ahead else "")
        print(f"resume: stage {self.stage!r}: {step} steps trained, {charged if self.dp is not None else step} "
              f"charged{replay}; {max(total - step, 0)} steps to come (of {total})", file=sys.stderr)
    def _step(
        self, batch: Any, engine: Optional[DPSGDEngine], optimizer: torch.optim.Optimizer, diagnostics: bool = True
    ) -> dict[str, float]:
        """One optimizer step; curator diagnostics (raw losses, clip statistics) only when ``diagnostics``."""
        batch = batch.to(self.device)
        optimizer.zero_grad(set_to_none=True)
        closed_form = self.declaration.loss_form is LossForm.UNIT_DIRECTIONS
        values: dict[str, float] = {}
        if batch.private:
            if engine is None:
                raise ValidationError("dp.enabled", "the source produced a private batch but dp is disabled")
            if closed_form:
                direction = engine.private_direction(self.algorithm.unit_directions(batch))
                engine.write_gradients(direction)
                stats = engine.last_stats
            else:
                losses, weights = self._row_losses(batch)
                stats = engine.private_backward(
                    losses, batch.unit_index, batch.n_units, layout=getattr(batch, "layout", None), row_weights=weights
                )
                if diagnostics:
                    values["private_loss"] = float(losses.detach().mean()) if losses.numel() else math.nan
            if diagnostics:
                values.update(
                    {"units": float(stats.n_units), "clip_fraction": stats.clip_fraction, "grad_norm": stats.mean_norm}
                )
        elif closed_form:
            write_flat_gradients(self._trainable(), self.algorithm.unit_directions(batch).mean(dim=0))
        else:
            losses, weights = self._row_losses(batch)
            if weights is not None:  # the same semi-gradient, unclipped: d/dtheta of mean(w * loss), w constant
                losses = losses * weights
            if engine is not None:  # lets the engine drop what its hooks recorded on this noiseless step
                engine.public_backward(losses)
            else:
                losses.mean().backward()
            if diagnostics:
                values["public_loss"] = float(losses.detach().mean())
        optimizer.step()
        return values

    def _row_losses(self, batch: Any) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(row losses, row weights or None), as the algorithm's loss form declares: weighted row losses (weights
        scale each unit's gradient after clipping, see ``DPSGDEngine.private_backward``) or plain ones."""
        if self.declaration.loss_form is LossForm.WEIGHTED_ROW_LOSSES:
            return self.algorithm.weighted_row_losses(batch)
        return self.algorithm.row_losses(batch), None

    def _evaluate(self) -> dict[str, float]:
        metrics: dict[str, float] = {}
        was_training = self.algorithm.training
        self.algorithm.eval()
        with torch.no_grad():
            for name, evaluator in self.evaluators.items():
                metrics.update({f"{name}/{k}": float(v) for k, v in evaluator(self.algorithm).items()})
        self.algorithm.train(was_training)
        return metrics

    def _save(self, run, trainer_sha256, step, budget_steps, optimizer, scheduler, generator, noise, eval_history):
        save_checkpoint(
            run.checkpoint_path,
            {
                "pipeline": self.pipeline,
                "config_sha256": trainer_sha256,
                "inputs": dict(run.inputs),  # hashes of the input data (dataset content, expert set)
                "config": self.pipeline_config,  # JSON data (pipelines' checkpoint hooks read it; curator-only)
                "step": step,
                "budget_steps": budget_steps,
                # what the journal charged when this was written: a resumed run refuses a journal charging less
                "journal": run.journal_witness(self.stage),
                "algorithm": self.algorithm.state_dict(),
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict(),
                "eval_history": [[s, dict(m)] for s, m in eval_history],
                "rng": {"sampler": generator.get_state(), **({"noise": noise.state_dict()} if noise is not None else {})},
            },
        )

    def _check_same_run(self, state: Mapping[str, Any], trainer_sha256: str, inputs: Mapping[str, str]) -> None:
        if state["pipeline"] != self.pipeline or state["config_sha256"] != trainer_sha256:
            raise ValidationError(
                "trainer.resume", f"{self.checkpoint_path} belongs to a different configuration; use a new run_dir"
            )
        recorded = state.get("inputs") or {}
        differing = sorted(name for name in set(recorded) & set(inputs) if recorded[name] != inputs[name])
        if differing:
            raise ValidationError(f"inputs.{differing[0]}", f"{self.checkpoint_path} was trained on another "
                                  f"{differing[0]}; refusing to resume from it")

    def _restore(self, state, optimizer, scheduler, generator, noise) -> None:
        """Load a checkpoint's states; a mismatch is a ValidationError naming the part, before anything is written."""
        parts = [("algorithm", lambda: self.algorithm.load_state_dict(state["algorithm"])),
                 ("optimizer", lambda: optimizer.load_state_dict(state["optimizer"])),
                 ("scheduler", lambda: scheduler.load_state_dict(state["scheduler"])),
                 ("rng.sampler", lambda: generator.set_state(state["rng"]["sampler"]))]
        if noise is not None:
            parts.append(("rng.noise", lambda: noise.load_state_dict(state["rng"]["noise"])))
        for name, load in parts:
            try:
                load()
            except ValidationError:
                raise
            except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as exc:
                raise ValidationError(f"checkpoint.{name}", f"does not match this run: {str(exc)[:300]}") from None
        try:
            state["eval_history"][:] = [(int(s), {str(k): float(v) for k, v in m.items()})
                                        for s, m in state["eval_history"]]
        except (TypeError, ValueError, AttributeError) as exc:
            raise ValidationError("checkpoint.eval_history", f"malformed: {exc}") from None


def _check_same_unit(algorithm: PrivateAlgorithm, source: Any) -> None:
    """The source's grouping owns the privacy unit: an algorithm declaring another one is refused."""
    declared, grouped = algorithm.privacy_unit, getattr(source, "unit", None)
    if declared is None or grouped is None:
        return
    declared, grouped = as_unit(declared), as_unit(grouped)
    if declared != grouped:
        raise ValidationError(
            "algorithm.privacy_unit",
            f"the algorithm declares unit {declared} ({declared.meaning}) but the batch source groups rows by "
            f"{grouped} ({grouped.meaning}); build the algorithm with the data's unit",
        )


def _progress(total: int, initial: int, enabled: bool, desc: str = "train"):
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, disable=not enabled, desc=desc, unit="step", dynamic_ncols=True)
