"""Typed configuration of the "ope" pipeline (YAML via ``dporl.utils.config``; dotted ``key=value`` overrides)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional

from dporl.eval.ope_problems import ChainSettings, HIVSettings, MountainCarSettings
from dporl.privacy.accountants import check_delta
from dporl.utils.validation import ValidationError, check_positive, check_probability


@dataclass
class GPOPESettings:
    mode: Literal["poisson", "paper"] = "poisson"
    # The neighbouring relation the budget is for. "replace_one" is what DP-LSW / DP-LSL and the paper mode
    # guarantee; Poisson-mode events (add/remove) are then analysed for replace-one neighbours
    # (dporl.privacy.relations) and sigma is calibrated so that this analysis fits the budget.
    relation: Literal["replace_one", "add_remove"] = "replace_one"
    expected_batch_size: float = 1.0  # trajectories per update (Poisson: q = B / m; paper: exactly round(B))
    # Larger batches for large m: B = max(expected_batch_size, m / max_steps_per_epoch). None: the paper's B.
    max_steps_per_epoch: Optional[int] = None
    # Passes over the data: N = epochs * m / B updates, sigma calibrated for N. None: tuned over epochs_grid.
    epochs: Optional[float] = None
    epochs_grid: list[float] = field(default_factory=lambda: [1.0, 5.0, 20.0])
    # Given: N = the most updates this noise fits in the budget (native relation only). None: calibrated for N.
    noise_multiplier: Optional[float] = None
    # Released estimate: the last iterate, the mean of the last tail_fraction of the iterates, or of all of them.
    averaging: Literal["last", "tail", "polyak"] = "tail"
    tail_fraction: float = 0.5
    # The paper's h. None: h = a quantile of the per-trajectory gradient norms on the public data (at theta = 0 and
    # at the public LSTD solution), the quantile tuned over clip_quantile_grid.
    clip_norm: Optional[float] = None
    clip_quantile_grid: list[float] = field(default_factory=lambda: [0.5, 0.9])
    # The paper's step size beta for one trajectory per update. An update averaging B trajectories takes B * beta
    # (linear scaling: a pass moves as far whatever B). None: tuned on public data over step_size_grid, per m.
    step_size: Optional[float] = None
    step_size_grid: list[float] = field(default_factory=lambda: [0.01, 0.1, 1.0, 10.0])
    step_size_multipliers: list[float] = field(default_factory=lambda: [1.0, 0.1, 10.0])
    schedule: Literal["constant", "inverse_time"] = "constant"
    time_offset: float = 0.0
    accountant: Literal["rdp", "prv", "pld"] = "rdp"

    def __post_init__(self) -> None:
        check_positive("gpope.expected_batch_size", self.expected_batch_size)
        for name in ("epochs", "clip_norm", "step_size", "noise_multiplier"):
            if getattr(self, name) is not None:
                check_positive(f"gpope.{name}", getattr(self, name))
        if self.max_steps_per_epoch is not None and self.max_steps_per_epoch < 1:
            raise ValidationError("gpope.max_steps_per_epoch", f"must be >= 1 or null, got {self.max_steps_per_epoch}")
        if not self.step_size_grid or not self.step_size_multipliers or not self.epochs_grid \
                or not self.clip_quantile_grid:
            raise ValidationError("gpope.step_size_grid", "every tuning grid needs at least one value")
        for i, value in enumerate(self.step_size_grid + self.step_size_multipliers + self.epochs_grid):
            check_positive(f"gpope.grids[{i}]", value)
        for i, value in enumerate(self.clip_quantile_grid):
            check_probability(f"gpope.clip_quantile_grid[{i}]", value, allow_zero=False)
        check_probability("gpope.tail_fraction", self.tail_fraction, allow_zero=False)
        if self.mode == "paper" and self.accountant != "rdp":
            raise ValidationError("gpope.accountant", "paper mode (sampling without replacement) is analysed by 'rdp'")
        if self.mode == "paper" and self.relation != "replace_one":
            raise ValidationError(
                "gpope.relation", "paper mode samples without replacement, which is analysed for replace-one only"
            )
        if self.noise_multiplier is not None and self.mode == "poisson" and self.relation == "replace_one":
            raise ValidationError(
                "gpope.noise_multiplier",
                "a given noise multiplier runs the most steps its native analysis allows; for a replace-one budget "
                "in Poisson mode give gpope.epochs instead (sigma is then calibrated for replace-one)",
            )


@dataclass
class OutputPerturbationSettings:
    methods: list[str] = field(default_factory=lambda: ["dp_lsw", "dp_lsl"])
    # Public bound F_max on first-visit returns; None: R_max / (1 - gamma). The chain pays at most one unit
    # reward per episode, so 1 is a public bound there (and the better baseline).
    return_bound: Optional[float] = 1.0
    lsl_lambda_scale: Optional[float] = None  # lambda = scale * sqrt(m); None: tuned on public data
    lsl_lambda_grid: list[float] = field(default_factory=lambda: [1.0, 3.0, 10.0, 30.0, 100.0])

    def __post_init__(self) -> None:
        unknown = sorted(set(self.methods) - {"dp_lsw", "dp_lsl"})
        if unknown:
            raise ValidationError("output_perturbation.methods", f"unknown method(s) {unknown}; use dp_lsw, dp_lsl")
        if self.return_bound is not None:
            check_positive("output_perturbation.return_bound", self.return_bound)
        if self.lsl_lambda_scale is not None:
            check_positive("output_perturbation.lsl_lambda_scale", self.lsl_lambda_scale)
        for i, value in enumerate(self.lsl_lambda_grid):
            check_positive(f"output_perturbation.lsl_lambda_grid[{i}]", value)


@dataclass
class OPEConfig:
    pipeline: str = "ope"
    experiment: Literal["chain", "mountain_car", "hiv"] = "chain"
    run_dir: str = "runs/ope_chain"
    seed: int = 0
    trials: int = 5
    m_values: list[int] = field(default_factory=lambda: [100, 1000, 10000])
    gamma: float = 0.99
    epsilon: float = 0.1
    delta: float = 1e-5
    # The invocation's SecretRoot: None draws 256 bits from the OS CSPRNG (real use). A fixed seed makes the run
    # reproducible but voids the guarantee for anyone who knows it.
    noise_seed: Optional[int] = None
    progress: bool = True
    chain: ChainSettings = field(default_factory=ChainSettings)
    mountain_car: MountainCarSettings = field(default_factory=MountainCarSettings)
    hiv: HIVSettings = field(default_factory=HIVSettings)
    gpope: GPOPESettings = field(default_factory=GPOPESettings)
    output_perturbation: OutputPerturbationSettings = field(default_factory=OutputPerturbationSettings)

    def __post_init__(self) -> None:
        if self.pipeline != "ope":
            raise ValidationError("pipeline", f"this config is for pipeline 'ope', got {self.pipeline!r}")
        if self.trials < 1:
            raise ValidationError("trials", f"must be >= 1, got {self.trials}")
        if not self.m_values or any(m < 2 for m in self.m_values):
            raise ValidationError("m_values", f"need dataset sizes >= 2, got {self.m_values}")
        check_probability("gamma", self.gamma, allow_one=False)
        check_positive("epsilon", self.epsilon)
        check_delta(self.delta)
        if self.delta * min(self.m_values) >= 1:  # the unit is one trajectory; m is declared, hence public
            raise ValidationError("delta", f"delta={self.delta:g} is not below 1/m for m = {min(self.m_values)} "
                                  "trajectories (m_values): a guarantee at such a delta allows releasing a whole "
                                  "trajectory; lower delta")


def build_problem(config: OPEConfig):
    """The experiment's OPE problem (public setup: behaviour policies, features, truth), from its settings."""
    from dporl.eval.ope_problems import chain_problem, hiv_problem, mountain_car_problem

    if config.experiment == "chain":
        return chain_problem(config.chain, config.gamma)
    if config.experiment == "mountain_car":
        return mountain_car_problem(config.mountain_car, config.gamma, config.seed)
    return hiv_problem(config.hiv, config.gamma, config.seed)
