"""Typed configs of the shared training loop (loaded from YAML by dporl.utils.config)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from dporl.utils.device import resolve_device
from dporl.utils.validation import ValidationError, check_positive, check_probability


@dataclass
class OptimizerConfig:
    """The optimizer of the training steps (privatised gradients go through it unchanged)."""

    name: Literal["adam", "sgd", "rmsprop"] = "adam"
    lr: float = 1e-3  # learning rate
    weight_decay: float = 0.0  # L2 penalty (the optimizer's own)
    momentum: float = 0.0  # sgd / rmsprop momentum
    # "inverse_time": lr_i = lr / (i + time_offset), i = 1, 2, ... (GPOPE's Theorem-3 schedule is lr = eta / lambda_min)
    schedule: Literal["constant", "inverse_time"] = "constant"
    time_offset: float = 0.0  # "inverse_time": the offset of the step index

    def __post_init__(self) -> None:
        check_positive("optimizer.lr", self.lr)
        check_positive("optimizer.weight_decay", self.weight_decay, allow_zero=True)
        check_positive("optimizer.time_offset", self.time_offset, allow_zero=True)


@dataclass
class DPConfig:
    """The private training stage: its budget, its noise and its analysis."""

    enabled: bool = True
    epsilon: Optional[float] = None  # budget of this stage; required when enabled
    delta: float = 1e-5
    noise_multiplier: Optional[float] = None  # None: the smallest that fits `epsilon` within trainer.max_steps
    max_grad_norm: float = 1.0
    accountant: Literal["rdp", "prv", "pld"] = "rdp"
    clipping: Literal["bookkeeping", "ghost", "opacus", "naive"] = "bookkeeping"
    # True: `epsilon` is this stage's nominal share of the run budget of the ledger it records in; the stage is
    # calibrated (sigma or steps) so that the RUN's guarantee, one joint PLD over every stage's events at the total
    # delta, meets the run budget (PrivacyLedger.shared_budget), and may spend past its share to get there.
    share_run_budget: bool = False
    # None: the run's secret root comes from the OS CSPRNG. An integer (>= 128 bits of it for a real release)
    # reproduces the run exactly and must be kept like the data: anyone who knows it can subtract the noise and
    # knows which units each step sampled. Pipelines pass their run's SecretRoot to the Trainer instead.
    noise_seed: Optional[int] = None

    def __post_init__(self) -> None:
        if not self.enabled:
            return
        if self.epsilon is None:
            raise ValidationError("dp.epsilon", "a private run needs a budget (set dp.enabled=false for none)")
        check_positive("dp.epsilon", self.epsilon)
        check_probability("dp.delta", self.delta, allow_zero=False, allow_one=False)
        check_positive("dp.max_grad_norm", self.max_grad_norm)
        if self.noise_multiplier is not None:
            check_positive("dp.noise_multiplier", self.noise_multiplier)


@dataclass
class TrainerConfig:
    """The training loop: its length, logging, evaluation and checkpoint cadence, device and optimizer."""

    max_steps: Optional[int] = 10_000  # cap on optimizer steps; a private run also stops at its budget
    seed: int = 0  # public seed of the network's initialisation and of non-private sampling
    log_every: int = 100  # steps between scalar logs (TensorBoard)
    eval_every: int = 1_000  # steps between evaluations in the simulator (and privacy scalars)
    checkpoint_every: int = 1_000  # steps between checkpoints (RUN/curator/checkpoints; a resume starts there)
    # Steps are authorised in blocks of this size in a write-ahead journal, so a crash can never under-count.
    journal_every: int = 50
    device: str = "cpu"  # cpu, cuda, cuda:N or auto
    progress: bool = True  # a progress bar on stderr (steps, eps spent / budget)
    # Raw losses / gradient norms / step timings of private batches, in RUN/curator/tensorboard only: computed
    # without noise, NOT covered by the guarantee, never in release/. Off unless asked for.
    curator_diagnostics: bool = False
    # Library use: a Trainer given a path continues its own earlier run found there (same provenance) or refuses.
    # Whole run directories are governed by train.py's --resume / --overwrite (RunDirectory modes).
    resume: bool = True
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)

    def __post_init__(self) -> None:
        if self.max_steps is not None and self.max_steps < 0:
            raise ValidationError("trainer.max_steps", f"must be >= 0, got {self.max_steps}")
        for name in ("log_every", "eval_every", "checkpoint_every", "journal_every"):
            if getattr(self, name) < 1:
                raise ValidationError(f"trainer.{name}", f"must be >= 1, got {getattr(self, name)}")
        resolve_device(self.device, "trainer.device")  # refused at parse time: before anything is written
