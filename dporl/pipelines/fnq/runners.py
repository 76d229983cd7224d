"""The runs of the "fnq" pipeline: one (method, seed) each, through the Trainer, in its own run directory under
``run_dir``; the mechanism of each method as ``dporl.methods.reward_level`` declares it."""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from dporl.algos.fnq import (
    EnvInteractionSource,
    FNQConfig,
    FunctionalNoiseQLearning,
    RewardClamp,
    RewardLevelSource,
    RewardPrivateQLearning,
    check_reward_range,
    dataset_source,
    save_noisy_q,
)
from dporl.algos.fnq_baselines import GaussianRewardNoise, WholeBatchUnitSource
from dporl.envs.registry import make, make_vec
from dporl.methods.reward_level import RANDOM_POLICY, RewardLevelMethod
from dporl.pipelines.fnq.config import (
    FNQPipelineConfig,
    RunSpec,
    paper_beta,
    reset_every,
    theorem5_calibration,
)
from dporl.privacy.events import PoissonGaussianEvent
from dporl.privacy.functional_calibration import gaussian_noise_multiplier
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.randomness import SecretRoot
from dporl.privacy.units import REWARD
from dporl.train.config import DPConfig, TrainerConfig
from dporl.train.trainer import Trainer
from dporl.utils.config import to_dict
from dporl.utils.io import atomic_write_json
from dporl.utils.validation import ValidationError

PIPELINE_NAME = "fnq"
RETURN, RETURN_Q = "return", "return_q"
RETURN_KEY, RETURN_Q_KEY = f"{RETURN}/return_mean", f"{RETURN_Q}/return_mean"
SOUND_ANALYSIS = (
    "public-iterate Gaussian updates: each update releases a mean of per-transition Jacobians clipped to G, weighted "
    "by TD errors clipped to kappa, plus N(0, (z G s)^2); L2 sensitivity G s, s = min(1/c, 2 kappa), per update; "
    "no sampling amplification"
)
INPUT_ANALYSIS = "Gaussian input perturbation: every released reward once, N releases = one Gaussian of sensitivity sqrt(N)"


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
    return dataset_source(dataset_of(config), config.batch_size, reward_transform, clamp)


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

        if spec.method == RANDOM_POLICY.name:
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


@dataclass
class Mechanism:
    """How one run of a method trains: its learner and the learner's config, its DP configuration (None: no private
    step), the noise on the rewards (input perturbation) and what it reports of its privacy before training."""

    learner_cls: type
    learner_config: FNQConfig
    dp: Optional[DPConfig] = None
    reward_transform: Optional[GaussianRewardNoise] = None
    privacy: Optional[dict] = None


LEARNERS = {"reward_private": RewardPrivateQLearning, "functional_noise": FunctionalNoiseQLearning}


def mechanism(config: FNQPipelineConfig, spec: RunSpec, ctx: RunContext, root: SecretRoot, ledger: PrivacyLedger,
              every: int) -> Mechanism:
    """The mechanism of ``spec``'s method (``dporl.methods.reward_level``), its stage opened in ``ledger``: the
    paper's (a claim, the run void), none (the non-private reference, void), Gaussian reward noise (no private step:
    the method is certified and groups no rows), per-transition clipping or DP-SGD with the whole batch one unit."""
    method = spec.spec
    learner_cls = LEARNERS[method.learner]
    learner_config = config.learner_config(*ctx.bounds, reset_every=every)
    if method.paper:
        return _paper_mechanism(config, spec, ctx, ledger, every)
    if not method.certified:
        ledger.void("non-private reference: no privacy mechanism")
        return Mechanism(learner_cls, learner_config)
    budget = (spec.epsilon, config.delta)
    if method.units == "transition":
        z = config.noise_multiplier
        if z is None:  # calibrated for U updates (else: budget-driven stopping at the given z)
            z = gaussian_noise_multiplier(spec.epsilon, config.delta, config.updates, config.accountant)
        # The engine adds sigma_e G to the sum of B weighted clipped Jacobians: sigma_e = z B s (RewardLevelSource).
        engine_sigma = z * config.batch_size * learner_config.update_sensitivity
        dp = DPConfig(epsilon=spec.epsilon, delta=config.delta, noise_multiplier=engine_sigma,
                      max_grad_norm=config.clip_norm, accountant=config.accountant, clipping=config.clipping)
        ledger.stage("train", budget=budget, mechanism=config.accountant, unit=REWARD, analysis=SOUND_ANALYSIS)
        return Mechanism(learner_cls, learner_config, dp)
    if method.units == "whole_batch":
        dp = DPConfig(epsilon=spec.epsilon, delta=config.delta, max_grad_norm=config.max_grad_norm,
                      accountant=config.accountant)
        ledger.stage("train", budget=budget, mechanism=config.accountant, unit=REWARD,
                     analysis="DP-SGD, the whole batch one unit (sensitivity 2C), no sampling amplification")
        return Mechanism(learner_cls, config.learner_config(*ctx.bounds, sigma=0.0, reset_every=every), dp)
    n_rewards = config.samples if config.dataset is None else dataset_of(config).n_transitions
    # N Gaussian releases of sensitivity 1 and std s are exactly one of sensitivity sqrt(N): multiplier s/sqrt(N).
    std = gaussian_noise_multiplier(spec.epsilon, config.delta, 1, config.accountant) * math.sqrt(n_rewards)
    ledger.stage("rewards", budget=budget, mechanism=config.accountant, unit=REWARD, analysis=INPUT_ANALYSIS)
    ledger.record("rewards", PoissonGaussianEvent(std / math.sqrt(n_rewards), 1.0))
    return Mechanism(learner_cls, learner_config, reward_transform=GaussianRewardNoise(std, root.noise("reward_noise"),
                                                                                       n_rewards),
                     privacy={"reward_noise_std": std, "n_rewards": n_rewards, "unit": "reward",
                              "analysis": INPUT_ANALYSIS})


def _paper_mechanism(config: FNQPipelineConfig, spec: RunSpec, ctx: RunContext, ledger: PrivacyLedger,
                     every: int) -> Mechanism:
    """The paper's Algorithm 1: uncalibrated (a sweep of path scales), or with Theorem 5's sigma (its figure a paper
    claim); either way the run has NO guarantee."""
    if spec.epsilon is None:  # the paper's uncalibrated sweep
        ledger.void("the paper's Algorithm 1 with an uncalibrated path scale: no analysis covers it")
        return Mechanism(FunctionalNoiseQLearning, config.learner_config(*ctx.bounds, sigma=spec.sigma,
                                                                          beta=paper_beta(config), reset_every=every))
    if ctx.obs_dim != 1:
        raise ValidationError("epsilons", "Theorem 5 is stated for one-dimensional states; run a sweep instead")
    calibration = theorem5_calibration(config, spec)
    calibration.paper_claim(ledger)
    ledger.void("Theorem 5 does not cover Algorithm 1's released network (dporl.audit: fnq_paper_attack)")
    return Mechanism(FunctionalNoiseQLearning,
                     config.learner_config(*ctx.bounds, sigma=calibration.sigma, beta=calibration.beta,
                                           reset_every=every), privacy=calibration.to_dict())


def unit_source(method: RewardLevelMethod, source: Any, learner_config: FNQConfig) -> Any:
    """The batches of ``source`` grouped into units as ``method`` declares: one transition per unit (per-transition
    clipping), the whole batch one unit (DP-SGD), or as they are (no private step)."""
    if method.units == "transition":
        return RewardLevelSource(source, learner_config.update_sensitivity)
    if method.units == "whole_batch":
        return WholeBatchUnitSource(source)
    return source


def trained_privacy(config: FNQPipelineConfig, method: RewardLevelMethod, mech: Mechanism, result) -> Optional[dict]:
    """What a run reports of its privacy after training (the noise its private steps used, as the method states it)."""
    if method.units == "transition":
        sensitivity = mech.learner_config.update_sensitivity
        z = result.noise_multiplier / (config.batch_size * sensitivity)
        return {"noise_multiplier": z, "engine_noise_multiplier": result.noise_multiplier,
                "clip_norm": config.clip_norm, "update_sensitivity": config.clip_norm * sensitivity,
                "noise_std_mean_update": z * config.clip_norm * sensitivity,
                "updates": result.budget_steps, "unit": "reward", "analysis": SOUND_ANALYSIS}
    if method.units == "whole_batch":
        return {"noise_multiplier": result.noise_multiplier / 2, "unit": "reward",
                "analysis": f"DP-SGD, whole batch one unit, {config.accountant}"}
    return mech.privacy


def train_one(config: FNQPipelineConfig, spec: RunSpec, seed: int, ctx: RunContext) -> dict:
    """One run of ``spec`` with public seed ``seed`` (network initialisation, evaluation), through the Trainer."""
    method = spec.spec
    if method.data_free:
        return _data_free(config, spec, seed, ctx)
    run_dir = Path(config.run_dir) / spec.label / f"seed{seed}"
    root = ctx.root.child(f"{spec.label}/seed{seed}/root")  # this run's secret root (a stream of the invocation's)
    ledger = PrivacyLedger()
    every, windows = reset_every(config, spec.reset_factor)
    mech = mechanism(config, spec, ctx, root, ledger, every)
    torch.manual_seed(seed)  # network initialisation: public
    algorithm = mech.learner_cls(ctx.obs_dim, ctx.n_actions, mech.learner_config, root.noise("paths"))
    clamp = RewardClamp(check_reward_range(config.reward_range))
    source = unit_source(method, _source(config, ctx, algorithm, root, clamp, mech.reward_transform),
                         mech.learner_config)
    evaluators, eval_env = _evaluator(config, 10_000 + seed)
    updates = config.updates
    trainer_config = TrainerConfig(
        max_steps=updates, seed=seed, log_every=max(1, updates // 20),
        eval_every=max(1, updates // max(config.evaluations, 1)), checkpoint_every=updates, progress=False,
        optimizer=config.optimizer,
    )
    run_config = {**to_dict(config), "run": {"label": spec.label, "method": spec.method, "seed": seed}}
    result = Trainer(
        algorithm, source, config=trainer_config, dp=mech.dp, ledger=ledger, run_dir=run_dir, pipeline=PIPELINE_NAME,
        pipeline_config=run_config, stage="train", evaluators=evaluators, secret_root=root,
    ).fit()
    _write_reward_clamp(run_dir, config, clamp)
    if eval_env is not None:
        eval_env.close()
    released = algorithm.release(root.noise("release_paths"))
    save_noisy_q(run_dir / "release" / "released.pt", released, {"label": spec.label, "privacy": result.privacy})
    curve = [(step * config.steps_per_update, m[RETURN_KEY]) for step, m in result.eval_history if RETURN_KEY in m]
    curve_q = [(step * config.steps_per_update, m[RETURN_Q_KEY]) for step, m in result.eval_history if RETURN_Q_KEY in m]
    learner = mech.learner_config
    return _record(spec, seed, curve, curve_q, sigma=learner.sigma, beta=learner.beta, every=every, windows=windows,
                   privacy=trained_privacy(config, method, mech, result), ledger=result.privacy, steps=result.steps,
                   run_dir=str(run_dir))


_DATASETS: dict[str, Any] = {}


def dataset_of(config: FNQPipelineConfig):
    from dporl.data.dataset import TrajectoryDataset

    if config.dataset not in _DATASETS:
        _DATASETS[config.dataset] = TrajectoryDataset.load(config.dataset)
    return _DATASETS[config.dataset]
