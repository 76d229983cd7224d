"""Pipeline "fnq": reward-level private Q-learning (privacy unit "reward", sup |r - r'| <= 1) and its baselines.

Methods (``dporl.algos.fnq``, ``dporl.algos.fnq_baselines``):

* ``fnq``: dporl's sound mechanism, public-iterate Gaussian updates (``RewardPrivateQLearning``): per-transition
  Jacobians clipped to ``clip_norm`` G, TD errors clipped to ``td_clip``, N(0, (z G s)^2) on every mean update,
  U updates accounted as U Gaussian events through the Trainer and the ledger (GUARANTEE). ``noise_multiplier`` z
  given: the run stops when the budget is spent (at most U = ``updates``); not given: z is calibrated for U.
  The GP paths (``exploration_sigma``) are exploration only; any optimizer is post-processing.
* ``input_perturbation``: Gaussian noise on every reward once (N = all logged rewards offline, the T environment
  steps online), then the same learner without noise (GUARANTEE, one Gaussian event of sensitivity sqrt(N)).
* ``dpsgd``: the paper's DP-SGD baseline (whole batch one unit, GUARANTEE).
* ``fnq_paper``: the paper's Algorithm 1 with Theorem 5's sigma (1-D states, plain SGD). Theorem 5 does not cover
  what it releases: its (eps, delta) is printed as "the paper's figure, NOT a guarantee" and the run reports NO
  GUARANTEE.
* ``nonprivate``: ``RewardPrivateQLearning`` without clipping or noise; ``random_policy`` and ``untrained`` (greedy on
  the initial network) are data-free rows, so that "learns" means something.

Two kinds of experiment, both over ``seeds``:

* Sweep (``epsilons`` empty): the paper's mechanism (``fnq_paper``) for every path scale in ``sigmas`` and reset
  factor J in ``reset_factors`` (paths reset every U / J updates), uncalibrated: no epsilon (NO GUARANTEE).
* Comparison (``epsilons`` given): every method in ``methods`` at each epsilon and total ``delta``; ``nonprivate``
  and the data-free rows run once. The table gives the final return with a 95% Student-t interval over seeds and,
  per certified method, the smallest epsilon of the grid reaching 90% of the non-private return (and 90% of its
  gain over the best data-free row).

Data: online (``env_id``: ``samples`` environment steps, ``env_steps_per_update`` new transitions per update, optional
replay) or offline (``dataset``: ``samples / batch_size`` updates of uniform minibatches of logged transitions).

Randomness: one ``SecretRoot`` per pipeline invocation (``noise_seed``, else 256 bits of OS entropy) derives one
root per run ("<label>/seed<k>/root"), whose named streams serve every mechanism of that run: the Trainer's
"train/sampler" and "train/noise", and "paths" (GP paths), "env" (episode seeds, exploration coins),
"reward_noise" (input perturbation), "release_paths" (future draws of the released paths). Network initialisation
and evaluation episodes use the public seed.

Evaluation returns in the environment are computed from the protected reward function itself: they are curator-only
(the Trainer keeps them out of ``release/``; ``results.json``, ``table.md`` and the PNGs go to ``run_dir/curator``)
and never part of a release. Each (method, seed) is a Trainer run directory ``run_dir/<label>/seed<k>`` whose
``release/released.pt`` is the released Q-network with its paths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from dporl.algos.fnq import (
    EnvInteractionSource,
    FNQConfig,
    FunctionalNoiseQLearning,
    RewardLevelSource,
    RewardClamp,
    RewardPrivateQLearning,
    check_reward_range,
    dataset_source,
    save_noisy_q,
)
from dporl.algos.fnq_baselines import GaussianRewardNoise, WholeBatchUnitSource
from dporl.envs.registry import check_no_module, make, make_vec
from dporl.eval.returns import confidence_interval
from dporl.logging import plot_lines
from dporl.pipelines import Pipeline, curator_note, register
from dporl.pipelines.inputs import check_inputs_outside
from dporl.privacy.accountants import check_delta
from dporl.privacy.events import PoissonGaussianEvent
from dporl.privacy.functional_calibration import (
    calibrate_functional_noise,
    gaussian_noise_multiplier,
    smallest_tail_parameter,
    theorem5_terms,
)
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.randomness import SecretRoot
from dporl.privacy.units import REWARD
from dporl.train.config import DPConfig, OptimizerConfig, TrainerConfig
from dporl.train.run_dir import RunDirectory, RunMode
from dporl.train.trainer import Trainer
from dporl.utils.config import from_dict, to_dict
from dporl.utils.io import atomic_write_json, atomic_write_text
from dporl.utils.validation import PrivacyBudgetError, ValidationError, check_positive

CERTIFIED = ("fnq", "input_perturbation", "dpsgd")
DATA_FREE = ("random_policy", "untrained")
METHODS = (*CERTIFIED, "fnq_paper", "nonprivate", *DATA_FREE)
# Evaluators (greedy on the released Q + g, and on Q_theta alone). Their returns are computed from the protected
# reward function itself, so they are never public evaluators: the Trainer keeps them out of release/.
RETURN, RETURN_Q = "return", "return_q"
RETURN_KEY, RETURN_Q_KEY = f"{RETURN}/return_mean", f"{RETURN_Q}/return_mean"
SOUND_ANALYSIS = (
    "public-iterate Gaussian updates: each update releases a mean of per-transition Jacobians clipped to G, weighted "
    "by TD errors clipped to kappa, plus N(0, (z G s)^2); L2 sensitivity G s, s = min(1/c, 2 kappa), per update; "
    "no sampling amplification"
)
INPUT_ANALYSIS = "Gaussian input perturbation: every released reward once, N releases = one Gaussian of sensitivity sqrt(N)"


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
    exploration_sigma: float = 0.0  # GP exploration path scale of the fnq / nonprivate / input_perturbation learner
    clip_norm: float = 1.0  # G: per-transition Jacobian clip (fnq)
    td_clip: float = 1.0  # kappa: TD-error clip, 0 < kappa <= 1 (fnq, and the learner of the other sound methods)
    reward_scale: float = 1.0  # c: rewards enter the TD target as r / c (public constant)
    target_update_every: int = 0  # 0: targets from the current iterate
    noise_multiplier: Optional[float] = None  # z for fnq (relative to the sensitivity); None: calibrated for U
    # Declared public reward range: rewards outside it are clamped into it (never refused; the count of clamped
    # rewards is curator-only, in each run's curator/rewards.json).
    reward_range: Optional[list[float]] = None
    max_grad_norm: float = 1.0  # dpsgd clip C
    accountant: str = "pld"  # analysis of the Gaussian events (fnq, dpsgd)
    clipping: str = "bookkeeping"  # per-transition clipping of the engine (opacus for non-Linear layers)
    eval_episodes: int = 10
    evaluations: int = 10  # evaluation points along each run (0: none, e.g. audits)
    noise_seed: Optional[int] = None  # None: secret per invocation; an int makes runs reproducible (experiments only)
    progress: bool = True

    def __post_init__(self) -> None:
        check_no_module("env_id", self.env_id)  # a checkpoint's config is a file too: never a module to import
        unknown = sorted(set(self.methods) - set(METHODS))
        if unknown:
            raise ValidationError("methods", f"unknown method {unknown[0]!r} (known: {', '.join(METHODS)})")
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


def _make_env(config: FNQPipelineConfig, **kwargs):
    return make("env_id", config.env_id, **kwargs)


def _state_bounds(config: FNQPipelineConfig) -> tuple[list[float], list[float]]:
    if config.state_low is not None and config.state_high is not None:
        return list(config.state_low), list(config.state_high)
    space = _make_env(config).observation_space
    low, high = np.asarray(space.low, dtype=float).ravel(), np.asarray(space.high, dtype=float).ravel()
    if not (np.isfinite(low).all() and np.isfinite(high).all()):
        raise ValidationError("state_low", f"{config.env_id} has unbounded observations; give state_low/state_high")
    return low.tolist(), high.tolist()


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
    once = [RunSpec(m, m, reset_factor=config.reset_factors[0]) for m in ("nonprivate", *DATA_FREE) if m in config.methods]
    per_eps = [
        RunSpec(f"{method}_eps{eps:g}", method, reset_factor=config.reset_factors[0], epsilon=eps)
        for eps in config.epsilons
        for method in config.methods
        if method in (*CERTIFIED, "fnq_paper")
    ]
    return once + per_eps


def _reset_every(config: FNQPipelineConfig, reset_factor: int) -> tuple[int, int]:
    """(updates between resets, number of noise windows actually used) for J = ``reset_factor``."""
    every = max(1, math.ceil(config.updates / reset_factor))
    return every, math.ceil(config.updates / every)


def theorem5_calibration(config: FNQPipelineConfig, spec: RunSpec):
    opt = config.optimizer
    if opt.name != "sgd" or opt.momentum or opt.weight_decay or opt.schedule != "constant":
        raise ValidationError("optimizer", "Theorem 5's figure is for plain SGD with a constant step: use sgd")
    _, windows = _reset_every(config, spec.reset_factor)
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


def _paper_beta(config: FNQPipelineConfig) -> float:
    if config.beta is not None:
        return check_positive("beta", config.beta)
    if config.theorem.tail_k is None:
        raise ValidationError("beta", "a sweep needs beta, or theorem.tail_k to take Theorem 5's beta = 1/v")
    return theorem5_terms(config.optimizer.lr, config.theorem.tail_k, config.batch_size, config.theorem.lipschitz)[1]


def _evaluator(config: FNQPipelineConfig, seed: int):
    from dporl.eval.returns import evaluate_returns

    if config.evaluations == 0:
        return {}, None
    env = make_vec("env_id", config.env_id, num_envs=config.eval_episodes, vectorization_mode="sync")

    def evaluate(module) -> dict[str, float]:
        return evaluate_returns(module.act, env, config.eval_episodes, seed).to_dict()

    def evaluate_network(module) -> dict[str, float]:
        return evaluate_returns(lambda obs: module.q_network(obs).argmax(-1), env, config.eval_episodes, seed).to_dict()

    return {RETURN: evaluate, RETURN_Q: evaluate_network}, env


@dataclass
class RunContext:
    """What every run of one invocation shares: state bounds, spaces, the secret root, the environment factory."""

    bounds: tuple[list[float], list[float]]
    obs_dim: int
    n_actions: int
    root: SecretRoot
    make_env: Callable[[], Any]


def context(config: FNQPipelineConfig, make_env: Optional[Callable[[], Any]] = None) -> RunContext:
    """The shared context; ``make_env`` replaces ``gym.make(env_id)`` for training (audits: a neighbour's rewards)."""
    bounds = _state_bounds(config)
    probe = _make_env(config)
    obs_dim, n_actions = int(np.prod(probe.observation_space.shape)), int(probe.action_space.n)
    probe.close()
    return RunContext(bounds, obs_dim, n_actions, SecretRoot(config.noise_seed), make_env or (lambda: _make_env(config)))


def _source(config, ctx: RunContext, algorithm, root: SecretRoot, clamp: RewardClamp, reward_transform=None):
    if config.dataset is None:
        return EnvInteractionSource(
            ctx.make_env(), algorithm.act, config.batch_size, env_steps_per_update=config.env_steps_per_update,
            replay_capacity=config.replay_capacity, exploration=config.exploration, reward_transform=reward_transform,
            env_generator=root.torch_generator("env"), reward_range=clamp,
        )
    return dataset_source(_dataset(config), config.batch_size, reward_transform, clamp)


def _write_reward_clamp(run_dir: Path, config: FNQPipelineConfig, clamp: RewardClamp) -> None:
    """How many rewards the run clamped into the declared range: a count of private values, so curator-only (a file
    under the run's curator/, never release/ or stdout)."""
    if clamp.reward_range is None:
        return
    atomic_write_json(run_dir / "curator" / "rewards.json", {
        "curator_only": True, "reward_range": list(clamp.reward_range), "clamped_rewards": clamp.clamped,
        "note": "rewards outside the declared public range were clamped into it (never refused); this count "
                "describes the private rewards and is covered by no guarantee",
    })


def _data_free(config: FNQPipelineConfig, spec: RunSpec, seed: int, ctx: RunContext) -> dict:
    """A row that uses no data: the uniform random policy, or greedy on the untrained network."""
    evaluators, env = _evaluator(config, 10_000 + seed)
    curve, curve_q = [], []
    if env is not None:
        from dporl.eval.returns import evaluate_returns

        if spec.method == "random_policy":
            generator = torch.Generator().manual_seed(20_000 + seed)  # public randomness
            policy = lambda obs: torch.randint(0, ctx.n_actions, (obs.shape[0],), generator=generator)  # noqa: E731
            value = evaluate_returns(policy, env, config.eval_episodes, 10_000 + seed).mean
            curve = curve_q = [(x, value) for x in (0, config.samples)]
        else:
            torch.manual_seed(seed)  # the same public initialisation as every learner of this seed
            learner = RewardPrivateQLearning(ctx.obs_dim, ctx.n_actions, config.learner_config(*ctx.bounds, sigma=0.0))
            with torch.no_grad():
                value = evaluators[RETURN_Q](learner)["return_mean"]
            curve = curve_q = [(x, value) for x in (0, config.samples)]
        env.close()
    return _record(spec, seed, curve, curve_q, sigma=0.0, beta=None, every=0, windows=0,
                   privacy={"analysis": "data-free: uses no data (eps = 0)"}, ledger=None, steps=0)


def _record(spec, seed, curve, curve_q, **fields) -> dict:
    return {
        "label": spec.label, "method": spec.method, "seed": seed, "epsilon": spec.epsilon, "curve": curve,
        "curve_q": curve_q, "final_return": curve[-1][1] if curve else math.nan,
        "final_return_q": curve_q[-1][1] if curve_q else math.nan, **fields,
    }


def train_one(config: FNQPipelineConfig, spec: RunSpec, seed: int, ctx: RunContext) -> dict:
    """One run of ``spec`` with public seed ``seed`` (network initialisation, evaluation), through the Trainer."""
    if spec.method in DATA_FREE:
        return _data_free(config, spec, seed, ctx)
    run_dir = Path(config.run_dir) / spec.label / f"seed{seed}"
    root = ctx.root.child(f"{spec.label}/seed{seed}/root")  # this run's secret root (a stream of the invocation's)
    paths_noise = root.noise("paths")
    ledger = PrivacyLedger()
    every, windows = _reset_every(config, spec.reset_factor)
    learner_config = config.learner_config(*ctx.bounds, reset_every=every)
    dp, privacy, reward_transform, learner_cls = None, None, None, RewardPrivateQLearning
    if spec.method == "fnq_paper":
        learner_cls = FunctionalNoiseQLearning
        if spec.epsilon is None:  # the paper's uncalibrated sweep
            learner_config = config.learner_config(*ctx.bounds, sigma=spec.sigma, beta=_paper_beta(config), reset_every=every)
            ledger.void("the paper's Algorithm 1 with an uncalibrated path scale: no analysis covers it")
        else:
            if ctx.obs_dim != 1:
                raise ValidationError("epsilons", "Theorem 5 is stated for one-dimensional states; run a sweep instead")
            calibration = theorem5_calibration(config, spec)
            learner_config = config.learner_config(*ctx.bounds, sigma=calibration.sigma, beta=calibration.beta,
                                                   reset_every=every)
            calibration.paper_claim(ledger)
            ledger.void("Theorem 5 does not cover Algorithm 1's released network (dporl.audit: fnq_paper_attack)")
            privacy = calibration.to_dict()
    elif spec.method == "nonprivate":
        ledger.void("non-private reference: no privacy mechanism")
    elif spec.method == "input_perturbation":
        n_rewards = config.samples if config.dataset is None else _dataset(config).n_transitions
        # N Gaussian releases of sensitivity 1 and std s are exactly one of sensitivity sqrt(N): multiplier s/sqrt(N).
        std = gaussian_noise_multiplier(spec.epsilon, config.delta, 1, config.accountant) * math.sqrt(n_rewards)
        reward_transform = GaussianRewardNoise(std, root.noise("reward_noise"), n_rewards)
        ledger.stage("rewards", budget=(spec.epsilon, config.delta), mechanism=config.accountant, unit=REWARD,
                     analysis=INPUT_ANALYSIS)
        ledger.record("rewards", PoissonGaussianEvent(std / math.sqrt(n_rewards), 1.0))
        privacy = {"reward_noise_std": std, "n_rewards": n_rewards, "unit": "reward", "analysis": INPUT_ANALYSIS}
    elif spec.method == "fnq":
        z = config.noise_multiplier
        if z is None:  # calibrated for U updates (else: budget-driven stopping at the given z)
            z = gaussian_noise_multiplier(spec.epsilon, config.delta, config.updates, config.accountant)
        # The engine adds sigma_e G to the sum of B weighted clipped Jacobians: sigma_e = z B s (RewardLevelSource).
        engine_sigma = z * config.batch_size * learner_config.update_sensitivity
        dp = DPConfig(epsilon=spec.epsilon, delta=config.delta, noise_multiplier=engine_sigma,
                      max_grad_norm=config.clip_norm, accountant=config.accountant, clipping=config.clipping)
        ledger.stage("train", budget=(spec.epsilon, config.delta), mechanism=config.accountant, unit=REWARD,
                     analysis=SOUND_ANALYSIS)
    elif spec.method == "dpsgd":
        learner_cls = FunctionalNoiseQLearning
        learner_config = config.learner_config(*ctx.bounds, sigma=0.0, reset_every=every)
        dp = DPConfig(epsilon=spec.epsilon, delta=config.delta, max_grad_norm=config.max_grad_norm,
                      accountant=config.accountant)
        ledger.stage("train", budget=(spec.epsilon, config.delta), mechanism=config.accountant, unit=REWARD,
                     analysis="DP-SGD, the whole batch one unit (sensitivity 2C), no sampling amplification")
    torch.manual_seed(seed)  # network initialisation: public
    algorithm = learner_cls(ctx.obs_dim, ctx.n_actions, learner_config, paths_noise)
    clamp = RewardClamp(check_reward_range(config.reward_range))
    source = _source(config, ctx, algorithm, root, clamp, reward_transform)
    if spec.method == "fnq":
        source = RewardLevelSource(source, learner_config.update_sensitivity)
    elif spec.method == "dpsgd":
        source = WholeBatchUnitSource(source)
    evaluators, eval_env = _evaluator(config, 10_000 + seed)
    updates = config.updates
    trainer_config = TrainerConfig(
        max_steps=updates, seed=seed, log_every=max(1, updates // 20),
        eval_every=max(1, updates // max(config.evaluations, 1)), checkpoint_every=updates, progress=False,
        optimizer=config.optimizer,
    )
    run_config = {**to_dict(config), "run": {"label": spec.label, "method": spec.method, "seed": seed}}
    trainer = Trainer(
        algorithm, source, config=trainer_config, dp=dp, ledger=ledger, run_dir=run_dir, pipeline="fnq",
        pipeline_config=run_config, stage="train", evaluators=evaluators, secret_root=root,
    )
    result = trainer.fit()
    _write_reward_clamp(run_dir, config, clamp)
    if eval_env is not None:
        eval_env.close()
    released = algorithm.release(root.noise("release_paths"))
    save_noisy_q(run_dir / "release" / "released.pt", released, {"label": spec.label, "privacy": result.privacy})
    curve = [(step * config.steps_per_update, m[RETURN_KEY]) for step, m in result.eval_history if RETURN_KEY in m]
    curve_q = [(step * config.steps_per_update, m[RETURN_Q_KEY]) for step, m in result.eval_history if RETURN_Q_KEY in m]
    if spec.method == "fnq":
        z = result.noise_multiplier / (config.batch_size * learner_config.update_sensitivity)
        privacy = {"noise_multiplier": z, "engine_noise_multiplier": result.noise_multiplier,
                   "clip_norm": config.clip_norm, "update_sensitivity": config.clip_norm * learner_config.update_sensitivity,
                   "noise_std_mean_update": z * config.clip_norm * learner_config.update_sensitivity,
                   "updates": result.budget_steps, "unit": "reward", "analysis": SOUND_ANALYSIS}
    elif spec.method == "dpsgd":
        privacy = {"noise_multiplier": result.noise_multiplier / 2, "unit": "reward",
                   "analysis": f"DP-SGD, whole batch one unit, {config.accountant}"}
    return _record(spec, seed, curve, curve_q, sigma=learner_config.sigma, beta=learner_config.beta, every=every,
                   windows=windows, privacy=privacy, ledger=result.privacy, steps=result.steps, run_dir=str(run_dir))


_DATASETS: dict[str, Any] = {}


def _dataset(config: FNQPipelineConfig):
    from dporl.data.dataset import TrajectoryDataset

    if config.dataset not in _DATASETS:
        _DATASETS[config.dataset] = TrajectoryDataset.load(config.dataset)
    return _DATASETS[config.dataset]


def _guarantee(run: dict) -> str:
    ledger = run.get("ledger")
    if run["method"] in DATA_FREE:
        return "data-free (eps = 0)"
    guarantee = (ledger or {}).get("guarantee")
    if guarantee is not None:
        return f"({guarantee['epsilon']:.3g}, {guarantee['delta']:.2g})"
    claims = (ledger or {}).get("paper_figures_NOT_guarantees") or []
    if claims:
        return f"NO GUARANTEE; the paper's figure, NOT a guarantee: ({claims[0]['epsilon']:g}, {claims[0]['delta']:.2g})"
    return "NO GUARANTEE"


def summarise(runs: list[dict]) -> list[dict]:
    """One row per label: final return over seeds with a 95% Student-t interval, mean curves, the guarantee."""
    rows = []
    for label in dict.fromkeys(r["label"] for r in runs):
        group = [r for r in runs if r["label"] == label]
        finals = [r["final_return"] for r in group]
        stats = confidence_interval(finals) if not any(math.isnan(f) for f in finals) else None
        finals_q = [r["final_return_q"] for r in group]
        first = group[0]
        curves = [[y for _, y in r["curve"]] for r in group]
        rows.append({
            "label": label, "method": first["method"], "epsilon": first["epsilon"], "sigma": first["sigma"],
            "reset_every": first["every"], "windows": first["windows"], "guarantee": _guarantee(first),
            "seeds": len(group), "finals": finals,
            "final_mean": stats.mean if stats else math.nan, "final_ci": [stats.ci_low, stats.ci_high] if stats else None,
            "final_std": stats.std if stats else math.nan,
            "final_q_mean": float(np.mean(finals_q)) if finals_q else math.nan,
            "curve_x": [x for x, _ in first["curve"]],
            "curve_mean": np.mean(curves, axis=0).tolist() if curves and curves[0] else [],
            "curve_std": np.std(curves, axis=0).tolist() if curves and curves[0] else [],
            "curve_q_mean": np.mean([[y for _, y in r["curve_q"]] for r in group], axis=0).tolist()
            if first["curve_q"] else [],
        })
    return rows


def epsilon_to_reach(rows: list[dict], fraction: float = 0.9) -> dict[str, dict[str, Optional[float]]]:
    """Per certified method: the smallest epsilon of the grid whose mean return reaches ``fraction`` of the
    non-private mean ("return"), and ``fraction`` of the non-private gain over the best data-free row ("gain")."""
    reference = next((r["final_mean"] for r in rows if r["method"] == "nonprivate"), None)
    if reference is None:
        return {}
    floor = max((r["final_mean"] for r in rows if r["method"] in DATA_FREE), default=None)
    out = {}
    for method in dict.fromkeys(r["method"] for r in rows if r["method"] in CERTIFIED):
        grid = sorted((r["epsilon"], r["final_mean"]) for r in rows if r["method"] == method)
        reach = next((eps for eps, value in grid if value >= fraction * reference), None)
        gain = None
        if floor is not None and reference > floor:
            gain = next((eps for eps, value in grid if value - floor >= fraction * (reference - floor)), None)
        out[method] = {"return": reach, "gain": gain, "largest_epsilon_run": grid[-1][0] if grid else None}
    return out


def table(rows: list[dict]) -> str:
    lines = [
        "| run | method | eps | guarantee (unit reward) | final return, mean [95% CI] over seeds | greedy on Q_theta |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        ci = row["final_ci"]
        interval = f"{row['final_mean']:.2f} [{ci[0]:.2f}, {ci[1]:.2f}] (n={row['seeds']})" if ci else "n/a"
        eps = "-" if row["epsilon"] is None else f"{row['epsilon']:g}"
        lines.append(
            f"| {row['label']} | {row['method']} | {eps} | {row['guarantee']} | {interval} | {row['final_q_mean']:.2f} |"
        )
    reach = epsilon_to_reach(rows)
    if reach:
        lines += ["", "| method | smallest eps reaching 90% of non-private return | 90% of its gain over data-free |",
                  "|---|---|---|"]
        for method, values in reach.items():
            def show(value):
                return f"{value:g}" if value is not None else f"not reached (up to {values['largest_epsilon_run']:g})"

            lines.append(f"| {method} | {show(values['return'])} | {show(values['gain'])} |")
    return "\n".join(lines) + "\n"


def _plots(config: FNQPipelineConfig, rows: list[dict], out_dir: Path) -> list[str]:
    out, groups = [], {}
    for row in rows:
        if not row["curve_x"]:
            continue
        if config.epsilons:
            key = "reference" if row["epsilon"] is None else f"{row['epsilon']:g}"
        else:
            key = f"J{row['label'].rsplit('_J', 1)[1]}"
        groups.setdefault(key, []).append(row)
    reference = groups.pop("reference", [])
    for key, group in groups.items():
        series = {r["label"]: (r["curve_x"], r["curve_mean"], r["curve_std"]) for r in reference + group}
        series.update({f"{r['label']} (Q_theta)": (r["curve_x"], r["curve_q_mean"], None)
                       for r in reference + group if r["sigma"] > 0})
        title = f"{config.env_id}: " + (f"eps = {key}, delta = {config.delta:g}" if config.epsilons else key)
        path = out_dir / f"curves_{'eps' if config.epsilons else ''}{key}.png"
        plot_lines(path, series, xlabel="samples", ylabel="return (curator-only; mean +- 1 std over seeds)", title=title)
        out.append(str(path))
    certified = [r for r in rows if r["method"] in (*CERTIFIED, "fnq_paper") and r["epsilon"] is not None]
    if config.epsilons and len(config.epsilons) > 1 and certified:
        eps_grid = sorted(config.epsilons)
        series = {}
        for method in dict.fromkeys(r["method"] for r in certified):
            by_eps = {r["epsilon"]: r for r in certified if r["method"] == method}
            xs = [e for e in eps_grid if e in by_eps]
            label = method + (" (the paper's figure, NOT a guarantee)" if method == "fnq_paper" else "")
            series[label] = (xs, [by_eps[e]["final_mean"] for e in xs],
                             [by_eps[e]["final_mean"] - by_eps[e]["final_ci"][0] for e in xs])
        for row in rows:
            if row["epsilon"] is None and row["final_ci"]:
                series[row["label"]] = (eps_grid, [row["final_mean"]] * len(eps_grid), None)
        path = out_dir / "return_vs_epsilon.png"
        plot_lines(path, series, xlabel="epsilon (delta = %g)" % config.delta,
                   ylabel="final return (mean, 95% CI over seeds)", title=f"{config.env_id}: return vs epsilon", logx=True)
        out.append(str(path))
    return out


def run(config: FNQPipelineConfig, mode: RunMode = "new") -> dict:
    with RunDirectory(config.run_dir, pipeline="fnq", config=to_dict(config), mode=mode) as directory:
        check_inputs_outside(directory, {"dataset": config.dataset})  # --overwrite keeps the user's input
        return _run(config, directory)


def _run(config: FNQPipelineConfig, directory: RunDirectory) -> dict:
    from tqdm.auto import tqdm

    torch.set_num_threads(1)
    specs = plan(config)
    ctx = context(config)
    if config.dataset is not None:  # declared sizes (public) must match the environment's before anything runs
        meta = _dataset(config).metadata
        if (meta.n_actions, int(np.prod(meta.obs_shape))) != (ctx.n_actions, ctx.obs_dim):
            raise ValidationError("dataset.metadata.n_actions", f"the dataset declares {meta.n_actions} actions and "
                                  f"{meta.obs_shape} observations; {config.env_id} has {ctx.n_actions} and "
                                  f"{ctx.obs_dim}")
    for spec in specs:  # calibrations (and their refusals) before the first write
        if spec.method == "fnq_paper" and spec.epsilon is not None:
            if ctx.obs_dim != 1:
                raise ValidationError("epsilons", "Theorem 5 is stated for one-dimensional states; run a sweep instead")
            theorem5_calibration(config, spec)
    directory.begin()  # each (method, seed) below is a Trainer run directory of its own under run_dir
    runs = []
    for spec, seed in tqdm([(s, k) for s in specs for k in config.seeds], desc="fnq runs", disable=not config.progress):
        runs.append(train_one(config, spec, seed, ctx))
    rows = summarise(runs)
    # Under reward-level privacy the returns are computed from the protected rewards: curator-only (files under
    # curator/ and a labelled stderr note). What returns to the command line is public: each run's guarantee.
    out_dir = directory.curator
    text = table(rows)
    atomic_write_text(out_dir / "table.md", text)
    plots = _plots(config, rows, out_dir)
    atomic_write_json(out_dir / "results.json", {"config": to_dict(config), "rows": rows, "runs": runs,
                                                 "epsilon_to_reach_90": epsilon_to_reach(rows)})
    curator_note(f"returns computed from the protected reward function, in {out_dir / 'table.md'}:\n{text}")
    guarantees = {row["label"]: row["guarantee"] for row in rows}
    return {"pipeline": "fnq", "runs": len(runs), "curator_results": str(out_dir / "results.json"),
            "guarantees": guarantees, "headline": {f"{label} (privacy unit: reward)": guarantee
                                                  for label, guarantee in guarantees.items()}}


def evaluate(payload: dict, *, episodes: int, seed: int, out_dir: str | Path) -> dict:
    """evaluate.py: play the run's released function (``released.pt`` beside its checkpoints) greedily.

    The returns use the environment's rewards: curator-only under reward-level privacy."""
    from dporl.algos.fnq import load_noisy_q
    from dporl.eval.returns import evaluate_returns

    config = from_dict(FNQPipelineConfig, {k: v for k, v in payload["config"].items() if k != "run"})
    released = Path(out_dir) / "release" / "released.pt"
    if not released.exists():
        raise ValidationError("checkpoint", f"no released function at {released}")
    function, metadata = load_noisy_q(released)
    env = make_vec("env_id", config.env_id, num_envs=min(episodes, 16), vectorization_mode="sync")
    stats = evaluate_returns(function.act, env, episodes, seed)
    env.close()
    metrics = {**stats.to_dict(), "label": metadata.get("label"), "privacy": metadata.get("privacy"),
               "note": "curator-only: computed from the protected reward function"}
    atomic_write_json(Path(out_dir) / "eval.json", metrics)
    return metrics


register(Pipeline("fnq", FNQPipelineConfig, run, evaluate))
