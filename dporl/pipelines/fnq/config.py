"""Typed configuration of the "fnq" pipeline and the runs it plans (YAML via ``dporl.utils.config``; dotted
``key=value`` overrides). ``methods`` are names of ``dporl.methods.reward_level``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Optional

from dporl.algos.fnq import FNQConfig, check_reward_range
from dporl.envs.registry import check_no_module
from dporl.methods.reward_level import METHODS, RewardLevelMethod, reward_level_method
from dporl.privacy.accountants import check_delta
from dporl.privacy.functional_calibration import calibrate_functional_noise, smallest_tail_parameter, theorem5_terms
from dporl.train.config import OptimizerConfig
from dporl.utils.validation import PrivacyBudgetError, ValidationError, check_positive


@dataclass
class TheoremConfig:
    """Theorem 5 inputs besides T, B and alpha (taken from the run), for the paper's figure (``fnq_paper``)."""

    lipschitz: float = 4.0  # L (the paper's L^2 = 16), a premise of the theorem
    tail_k: Optional[int] = None  # None: the smallest k that makes the theorem's delta fit
    mechanism_share: float = 0.5  # of delta, for the mechanism; the rest bounds the path tails


@dataclass
class FNQPipelineConfig:
    pipeline: str = "fnq"
    run_dir: str = "runs/fnq"
    env_id: str = "dporl/Line1D-v0"
    dataset: Optional[str] = None  # a TrajectoryDataset .npz: the offline variant
    state_low: Optional[list[float]] = None  # public state bounds (default: the observation space's)
    state_high: Optional[list[float]] = None
    methods: list[str] = field(default_factory=lambda: ["fnq"])
    sigmas: list[float] = field(default_factory=lambda: [0.0, 0.2, 0.4, 0.6, 0.8, 1.0])  # fnq_paper sweep
    reset_factors: list[int] = field(default_factory=lambda: [78])
    epsilons: list[float] = field(default_factory=list)
    delta: float = 1e-4  # total delta of every certified run
    seeds: list[int] = field(default_factory=lambda: [0])
    samples: int = 5000  # T
    batch_size: int = 64  # B
    env_steps_per_update: Optional[int] = None  # None: B (Algorithm 1)
    replay_capacity: int = 0
    optimizer: OptimizerConfig = field(default_factory=lambda: OptimizerConfig(name="sgd", lr=3e-4))
    gamma: float = 0.99
    hidden_sizes: list[int] = field(default_factory=lambda: [16, 16])  # [] = linear Q
    beta: Optional[float] = None  # path kernel (None: Theorem 5's 1/v for fnq_paper sweeps, 1.0 for exploration)
    theorem: TheoremConfig = field(default_factory=TheoremConfig)
    exploration: float = 0.0  # epsilon-greedy probability (online)
    exploration_sigma: float = 0.0  # GP exploration path scale of the fnq / non_private / input_perturbation learner
    clip_norm: float = 1.0  # G: per-transition Jacobian clip (fnq)
    td_clip: float = 1.0  # kappa: TD-error clip, 0 < kappa <= 1 (fnq, and the learner of the other sound methods)
    reward_scale: float = 1.0  # c: rewards enter the TD target as r / c (public constant)
    target_update_every: int = 0  # 0: targets from the current iterate
    noise_multiplier: Optional[float] = None  # z for fnq (relative to the sensitivity); None: calibrated for U
    # Declared public reward range: rewards outside it are clamped into it (never refused; the count of clamped
    # rewards is curator-only, in each run's curator/rewards.json).
    reward_range: Optional[list[float]] = None
    max_grad_norm: float = 1.0  # dp_sgd clip C
    accountant: str = "pld"  # analysis of the Gaussian events (fnq, dp_sgd)
    clipping: str = "bookkeeping"  # per-transition clipping of the engine (opacus for non-Linear layers)
    eval_episodes: int = 10
    evaluations: int = 10  # evaluation points along each run (0: none, e.g. audits)
    noise_seed: Optional[int] = None  # None: secret per invocation; an int makes runs reproducible (experiments only)
    progress: bool = True

    def __post_init__(self) -> None:
        check_no_module("env_id", self.env_id)  # a checkpoint's config is a file too: never a module to import
        for i, method in enumerate(self.methods):
            reward_level_method(method, f"methods[{i}]")
        if not self.seeds:
            raise ValidationError("seeds", "need at least one seed")
        if not self.reset_factors or any(j < 1 for j in self.reset_factors):
            raise ValidationError("reset_factors", f"need J >= 1, got {self.reset_factors}")
        for eps in self.epsilons:
            check_positive("epsilons", eps)
        for sigma in self.sigmas:
            check_positive("sigmas", sigma, allow_zero=True)
        check_delta(self.delta)
        if self.samples < 1 or self.batch_size < 1 or self.eval_episodes < 1:
            raise ValidationError("samples", "samples, batch_size and eval_episodes must be >= 1")
        if self.evaluations < 0:
            raise ValidationError("evaluations", f"must be >= 0, got {self.evaluations}")
        check_positive("clip_norm", self.clip_norm)
        check_positive("max_grad_norm", self.max_grad_norm)
        check_positive("exploration_sigma", self.exploration_sigma, allow_zero=True)
        if self.noise_multiplier is not None:
            check_positive("noise_multiplier", self.noise_multiplier)
        check_reward_range(self.reward_range)
        if self.accountant not in ("rdp", "pld", "prv"):
            raise ValidationError("accountant", f"must be rdp, pld or prv, got {self.accountant!r}")
        if self.clipping not in ("bookkeeping", "ghost", "opacus", "naive"):
            raise ValidationError("clipping", f"must be bookkeeping, ghost, opacus or naive, got {self.clipping!r}")
        self.learner_config([0.0], [1.0])  # validates td_clip, reward_scale, gamma, hidden sizes, ...
        if self.updates < 1:
            raise ValidationError("samples", f"{self.samples} samples make no update of {self.steps_per_update}")

    @property
    def steps_per_update(self) -> int:
        if self.dataset is not None:
            return self.batch_size
        return self.batch_size if self.env_steps_per_update is None else self.env_steps_per_update

    @property
    def updates(self) -> int:
        return self.samples // self.steps_per_update

    def learner_config(self, low, high, *, sigma: Optional[float] = None, beta: Optional[float] = None,
                       reset_every: int = 1) -> FNQConfig:
        return FNQConfig(
            hidden_sizes=list(self.hidden_sizes), gamma=self.gamma,
            sigma=self.exploration_sigma if sigma is None else sigma,
            beta=(self.beta or 1.0) if beta is None else beta, reset_every=reset_every,
            state_low=list(low), state_high=list(high), td_clip=self.td_clip, reward_scale=self.reward_scale,
            target_update_every=self.target_update_every,
        )


@dataclass
class RunSpec:
    label: str
    method: str
    sigma: float = 0.0
    reset_factor: int = 1
    epsilon: Optional[float] = None

    @property
    def spec(self) -> RewardLevelMethod:
        """The method object this run's ``method`` names."""
        return METHODS[self.method]



def plan(config: FNQPipelineConfig) -> list[RunSpec]:
    """The runs of ``config``, data-free and non-private rows first (once), then every method at every epsilon."""
    if not config.epsilons:
        if config.methods != ["fnq_paper"]:
            raise ValidationError("methods", "a sweep (no epsilons) runs the paper's mechanism only: methods: [fnq_paper]")
        return [
            RunSpec(f"fnq_paper_sigma{sigma:g}_J{j}", "fnq_paper", sigma=sigma, reset_factor=j)
            for j in config.reset_factors
            for sigma in config.sigmas
        ]
    once = [RunSpec(m.name, m.name, reset_factor=config.reset_factors[0]) for m in METHODS.values()
            if not m.per_epsilon and m.name in config.methods]
    per_eps = [
        RunSpec(f"{method}_eps{eps:g}", method, reset_factor=config.reset_factors[0], epsilon=eps)
        for eps in config.epsilons
        for method in config.methods
        if METHODS[method].per_epsilon
    ]
    return once + per_eps


def reset_every(config: FNQPipelineConfig, reset_factor: int) -> tuple[int, int]:
    """(updates between resets, number of noise windows actually used) for J = ``reset_factor``."""
    every = max(1, math.ceil(config.updates / reset_factor))
    return every, math.ceil(config.updates / every)


def theorem5_calibration(config: FNQPipelineConfig, spec: RunSpec):
    opt = config.optimizer
    if opt.name != "sgd" or opt.momentum or opt.weight_decay or opt.schedule != "constant":
        raise ValidationError("optimizer", "Theorem 5's figure is for plain SGD with a constant step: use sgd")
    _, windows = reset_every(config, spec.reset_factor)
    common = dict(
        updates=config.updates, batch_size=config.batch_size, learning_rate=opt.lr,
        lipschitz=config.theorem.lipschitz, reset_factor=windows,
    )
    if config.theorem.tail_k is None:
        return smallest_tail_parameter(spec.epsilon, config.delta, mechanism_share=config.theorem.mechanism_share, **common)
    result = calibrate_functional_noise(
        spec.epsilon, config.delta * config.theorem.mechanism_share, tail_k=config.theorem.tail_k, **common
    )
    if result.delta_total > config.delta:
        raise PrivacyBudgetError("theorem.tail_k", f"total delta {result.delta_total:.3g} exceeds {config.delta:g}")
    return result


def paper_beta(config: FNQPipelineConfig) -> float:
    if config.beta is not None:
        return check_positive("beta", config.beta)
    if config.theorem.tail_k is None:
        raise ValidationError("beta", "a sweep needs beta, or theorem.tail_k to take Theorem 5's beta = 1/v")
    return theorem5_terms(config.optimizer.lr, config.theorem.tail_k, config.batch_size, config.theorem.lipschitz)[1]
