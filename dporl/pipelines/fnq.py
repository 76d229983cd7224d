"""Pipeline "fnq": Q-learning with functional noise (seeds/004) and its baselines, privacy unit "reward".

Two kinds of experiment, both over ``seeds``:

* Sweep (``epsilons`` empty): method ``fnq`` for every path scale in ``sigmas`` and reset factor J in
  ``reset_factors`` (paths reset every U / J updates). These sigmas are NOT calibrated: no epsilon is printed for
  them (Theorem 5 needs far larger sigma, see ``dporl.privacy.functional_calibration``). Non-private = sigma 0.
* Comparison (``epsilons`` given): for each epsilon at total ``delta``, every method in ``methods``:
  ``fnq`` (sigma and k from Theorem 5, one J = ``reset_factors[0]``), ``input_perturbation`` (Gaussian rewards,
  exact Gaussian-mechanism calibration over all observed rewards), ``dpsgd`` (whole batch = one unit, see
  ``dporl.algos.fnq_baselines``); ``nonprivate`` runs once as the reference.

Data: online (Algorithm 1 on ``env_id``: ``samples`` environment steps, ``env_steps_per_update`` new transitions
per update) or offline (``dataset``: ``samples / batch_size`` updates on logged transitions). Every run goes
through the shared Trainer; each evaluation plays ``eval_episodes`` episodes greedily on the released function
Q + g, and on Q_theta alone (what Algorithm 1 returns), in the environment. Under reward-level privacy these
returns are computed from the protected reward function itself: they are the experimenter's utility measurement,
NOT covered by the guarantee and not to be published as part of a release. Outputs under ``run_dir``: per-run trainer directories with
``released.pt`` (the noisy Q-function), ``results.json``, ``table.md`` and PNG learning curves.

Theorem 5 is proven for S = [0, 1]; for multi-dimensional states (CartPole) the pipeline runs the L1-kernel
paths but refuses to print an epsilon (the path's uniform bound behind the constant 8.68 is one-dimensional).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from dporl.algos.fnq import FNQConfig, FunctionalNoiseQLearning, EnvInteractionSource, dataset_source, save_noisy_q
from dporl.algos.fnq_baselines import GaussianRewardNoise, WholeBatchUnitSource
from dporl.logging import plot_lines
from dporl.pipelines import Pipeline, register
from dporl.privacy.events import PoissonGaussianEvent
from dporl.privacy.functional_calibration import (
    calibrate_functional_noise,
    reward_perturbation_std,
    smallest_tail_parameter,
    theorem5_terms,
)
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.noise import NoiseSource
from dporl.train.config import DPConfig, OptimizerConfig, TrainerConfig
from dporl.train.run_dir import RunDirectory, RunMode
from dporl.train.trainer import Trainer
from dporl.utils.config import from_dict, to_dict
from dporl.utils.io import atomic_write_json, atomic_write_text
from dporl.utils.validation import PrivacyBudgetError, ValidationError, check_positive, check_probability

METHODS = ("fnq", "input_perturbation", "dpsgd", "nonprivate")
RETURN_KEY = "return/return_mean"  # greedy on the released Q + g
RETURN_Q_KEY = "return_q/return_mean"  # greedy on Q_theta alone (what Algorithm 1 returns)


@dataclass
class TheoremConfig:
    """Theorem 5 inputs besides T, B and alpha (taken from the run)."""

    lipschitz: float = 4.0  # L (the paper's L^2 = 16); assumed, not enforced
    tail_k: Optional[int] = None  # None: the smallest k that certifies the budget
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
    sigmas: list[float] = field(default_factory=lambda: [0.0, 0.2, 0.4, 0.6, 0.8, 1.0])
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
    hidden_sizes: list[int] = field(default_factory=lambda: [16, 16])
    beta: Optional[float] = None  # kernel parameter for sweeps (None: Theorem 5's 1/v at theorem.tail_k)
    theorem: TheoremConfig = field(default_factory=TheoremConfig)
    exploration: float = 0.0
    eval_episodes: int = 10
    evaluations: int = 10  # evaluation points along each run
    max_grad_norm: float = 1.0  # dpsgd clip C
    accountant: str = "rdp"  # dpsgd analysis
    noise_seed: Optional[int] = None  # None: secret per run; an int makes runs reproducible (experiments only)
    progress: bool = True

    def __post_init__(self) -> None:
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
        check_probability("delta", self.delta, allow_zero=False, allow_one=False)
        if self.samples < 1 or self.batch_size < 1 or self.evaluations < 1 or self.eval_episodes < 1:
            raise ValidationError("samples", "samples, batch_size, evaluations and eval_episodes must be >= 1")

    @property
    def steps_per_update(self) -> int:
        if self.dataset is not None:
            return self.batch_size
        return self.batch_size if self.env_steps_per_update is None else self.env_steps_per_update

    @property
    def updates(self) -> int:
        return self.samples // self.steps_per_update


@dataclass
class RunSpec:
    label: str
    method: str
    sigma: float = 0.0
    reset_factor: int = 1
    epsilon: Optional[float] = None


def _make_env(config: FNQPipelineConfig, **kwargs):
    import gymnasium as gym

    import dporl.envs  # noqa: F401  (registers dporl/* environments)

    return gym.make(config.env_id, **kwargs)


def _state_bounds(config: FNQPipelineConfig) -> tuple[list[float], list[float]]:
    if config.state_low is not None and config.state_high is not None:
        return list(config.state_low), list(config.state_high)
    space = _make_env(config).observation_space
    low, high = np.asarray(space.low, dtype=float).ravel(), np.asarray(space.high, dtype=float).ravel()
    if not (np.isfinite(low).all() and np.isfinite(high).all()):
        raise ValidationError("state_low", f"{config.env_id} has unbounded observations; give state_low/state_high")
    return low.tolist(), high.tolist()


def _plan(config: FNQPipelineConfig) -> list[RunSpec]:
    if not config.epsilons:
        if config.methods != ["fnq"]:
            raise ValidationError("methods", "a sweep (no epsilons) runs method fnq only; baselines need epsilons")
        return [
            RunSpec(f"fnq_sigma{sigma:g}_J{j}", "fnq", sigma=sigma, reset_factor=j)
            for j in config.reset_factors
            for sigma in config.sigmas
        ]
    plan = [RunSpec("nonprivate", "nonprivate")] if "nonprivate" in config.methods else []
    for eps in config.epsilons:
        for method in config.methods:
            if method != "nonprivate":
                plan.append(RunSpec(f"{method}_eps{eps:g}", method, reset_factor=config.reset_factors[0], epsilon=eps))
    return plan


def _reset_every(config: FNQPipelineConfig, reset_factor: int) -> tuple[int, int]:
    """(updates between resets, number of noise windows actually used) for J = ``reset_factor``."""
    every = max(1, math.ceil(config.updates / reset_factor))
    return every, math.ceil(config.updates / every)


def _calibrate(config: FNQPipelineConfig, spec: RunSpec):
    opt = config.optimizer
    if opt.name != "sgd" or opt.momentum or opt.weight_decay or opt.schedule != "constant":
        raise ValidationError("optimizer", "Theorem 5's sensitivity is for plain SGD with a constant step: use sgd")
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


def _sweep_beta(config: FNQPipelineConfig) -> float:
    if config.beta is not None:
        return check_positive("beta", config.beta)
    if config.theorem.tail_k is None:
        raise ValidationError("beta", "a sweep needs beta, or theorem.tail_k to take Theorem 5's beta = 1/v")
    return theorem5_terms(config.optimizer.lr, config.theorem.tail_k, config.batch_size, config.theorem.lipschitz)[1]


def _evaluator(config: FNQPipelineConfig, seed: int):
    import gymnasium as gym

    import dporl.envs  # noqa: F401
    from dporl.eval.returns import evaluate_returns

    env = gym.make_vec(config.env_id, num_envs=config.eval_episodes, vectorization_mode="sync")

    def evaluate(module: FunctionalNoiseQLearning) -> dict[str, float]:
        return evaluate_returns(module.act, env, config.eval_episodes, seed).to_dict()

    def evaluate_network(module: FunctionalNoiseQLearning) -> dict[str, float]:
        return evaluate_returns(lambda obs: module.q_network(obs).argmax(-1), env, config.eval_episodes, seed).to_dict()

    return {"return": evaluate, "return_q": evaluate_network}, env


def _run_one(config: FNQPipelineConfig, spec: RunSpec, seed: int, bounds, obs_dim: int, n_actions: int) -> dict:
    run_dir = Path(config.run_dir) / spec.label / f"seed{seed}"
    noise = NoiseSource(None if config.noise_seed is None else config.noise_seed * 1_000_003 + seed)
    ledger = PrivacyLedger()
    sigma, beta, reset_factor, privacy, dp = spec.sigma, None, spec.reset_factor, None, None
    reward_transform = None
    if spec.method == "fnq" and spec.epsilon is not None:
        if obs_dim != 1:
            raise ValidationError("epsilons", "Theorem 5 is proven for one-dimensional states; run a sweep instead")
        calibration = _calibrate(config, spec)
        sigma, beta = calibration.sigma, calibration.beta
        ledger.stage("fnq", mechanism="pld", unit="reward", delta=calibration.delta_total,
                     analysis="functional noise, Wang & Hegde 2019 Theorem 5, CONDITIONAL on the Q-network's "
                     "Lipschitz bound L, which training does not enforce (dporl.audit.functional_audits."
                     "update_shift_norms finds it violated on the line configs)")
        ledger.record("fnq", calibration.event())
        privacy = calibration.to_dict()
    elif spec.method == "input_perturbation":
        n_rewards = config.samples if config.dataset is None else _dataset(config).n_transitions
        std = reward_perturbation_std(spec.epsilon, config.delta, n_rewards)
        reward_transform = GaussianRewardNoise(std, noise)
        ledger.stage("rewards", mechanism="pld", unit="reward", delta=config.delta,
                     analysis="Gaussian input perturbation of every reward")
        # n Gaussian releases of sensitivity 1 and std s are exactly one of sensitivity sqrt(n): multiplier s/sqrt(n).
        ledger.record("rewards", PoissonGaussianEvent(std / math.sqrt(n_rewards), 1.0))
        privacy = {"reward_noise_std": std, "n_rewards": n_rewards, "unit": "reward",
                   "analysis": "exact Gaussian mechanism over all observed rewards (Balle & Wang 2018)"}
    elif spec.method == "dpsgd":
        dp = DPConfig(epsilon=spec.epsilon, delta=config.delta, max_grad_norm=config.max_grad_norm,
                      accountant=config.accountant, noise_seed=None if config.noise_seed is None else seed)
        ledger.stage("train", budget=(spec.epsilon, config.delta), mechanism=config.accountant, unit="reward")
    if beta is None:
        beta = _sweep_beta(config) if spec.method == "fnq" else 1.0
    every, windows = _reset_every(config, reset_factor)
    fnq_config = FNQConfig(
        hidden_sizes=list(config.hidden_sizes), gamma=config.gamma, sigma=sigma, beta=beta, reset_every=every,
        state_low=bounds[0], state_high=bounds[1],
    )
    torch.manual_seed(seed)  # network initialisation
    algorithm = FunctionalNoiseQLearning(obs_dim, n_actions, fnq_config, noise)
    if config.dataset is None:
        source = EnvInteractionSource(
            _make_env(config), algorithm.act, config.batch_size, env_steps_per_update=config.env_steps_per_update,
            replay_capacity=config.replay_capacity, exploration=config.exploration, reward_transform=reward_transform,
        )
    else:
        source = dataset_source(_dataset(config), config.batch_size, reward_transform)
    if spec.method == "dpsgd":
        source = WholeBatchUnitSource(source)
    evaluators, eval_env = _evaluator(config, 10_000 + seed)
    updates = config.updates
    trainer_config = TrainerConfig(
        max_steps=updates, seed=seed, log_every=max(1, updates // 20), eval_every=max(1, updates // config.evaluations),
        checkpoint_every=updates, progress=False, optimizer=config.optimizer,
    )
    run_config = {**to_dict(config), "run": {"label": spec.label, "method": spec.method, "seed": seed}}
    trainer = Trainer(
        algorithm, source, config=trainer_config, dp=dp, ledger=ledger, run_dir=run_dir, pipeline="fnq",
        pipeline_config=run_config, stage="train", evaluators=evaluators,
    )
    result = trainer.fit()
    eval_env.close()
    released = algorithm.release(None if config.noise_seed is None else NoiseSource(seed + 7))
    save_noisy_q(run_dir / "release" / "released.pt", released, {"label": spec.label, "privacy": result.privacy})
    curve = [(step * config.steps_per_update, metrics[RETURN_KEY]) for step, metrics in result.eval_history]
    curve_q = [(step * config.steps_per_update, metrics[RETURN_Q_KEY]) for step, metrics in result.eval_history]
    if privacy is None and dp is not None:
        privacy = {"noise_multiplier": result.noise_multiplier, "unit": "reward",
                   "analysis": f"DP-SGD, whole batch one unit, {config.accountant}"}
    return {
        "label": spec.label, "method": spec.method, "seed": seed, "sigma": sigma, "beta": beta,
        "reset_every": every, "windows": windows, "epsilon": spec.epsilon, "curve": curve, "curve_q": curve_q,
        "final_return": curve[-1][1] if curve else math.nan,
        "final_return_q": curve_q[-1][1] if curve_q else math.nan, "privacy": privacy, "ledger": result.privacy,
        "steps": result.steps,
    }


_DATASETS: dict[str, Any] = {}


def _dataset(config: FNQPipelineConfig):
    from dporl.data.dataset import TrajectoryDataset

    if config.dataset not in _DATASETS:
        _DATASETS[config.dataset] = TrajectoryDataset.load(config.dataset)
    return _DATASETS[config.dataset]


def _summarise(runs: list[dict]) -> list[dict]:
    rows = []
    for label in dict.fromkeys(r["label"] for r in runs):
        group = [r for r in runs if r["label"] == label]
        finals = np.array([r["final_return"] for r in group])
        finals_q = np.array([r["final_return_q"] for r in group])
        xs = [x for x, _ in group[0]["curve"]]
        ys = np.array([[y for _, y in r["curve"]] for r in group])
        first = group[0]
        guarantee = None
        if first["privacy"] is not None and first["method"] == "fnq":
            guarantee = f"({first['epsilon']:g}, {first['privacy']['delta_total']:.2g})"
        elif first["epsilon"] is not None:
            guarantee = f"({first['epsilon']:g}, {group[0]['ledger'].get('stages', [{}])[0].get('delta', math.nan):.2g})"
        rows.append({
            "label": label, "method": first["method"], "sigma": first["sigma"], "reset_every": first["reset_every"],
            "windows": first["windows"], "guarantee": guarantee, "seeds": len(group),
            "final_mean": float(finals.mean()), "final_std": float(finals.std(ddof=1)) if len(group) > 1 else 0.0,
            "final_q_mean": float(finals_q.mean()),
            "final_q_std": float(finals_q.std(ddof=1)) if len(group) > 1 else 0.0,
            "curve_x": xs, "curve_mean": ys.mean(0).tolist(), "curve_std": ys.std(0).tolist(),
            "curve_q_mean": np.array([[y for _, y in r["curve_q"]] for r in group]).mean(0).tolist(),
        })
    return rows


def _table(rows: list[dict]) -> str:
    lines = [
        "| run | method | sigma | resets every (windows) | guarantee (unit reward) | final return, greedy on Q + g "
        "(mean +- std over seeds) | final return, greedy on Q_theta |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        guarantee = row["guarantee"] or "none (not calibrated)"
        lines.append(
            f"| {row['label']} | {row['method']} | {row['sigma']:.4g} | {row['reset_every']} ({row['windows']}) | "
            f"{guarantee} | {row['final_mean']:.2f} +- {row['final_std']:.2f} (n={row['seeds']}) | "
            f"{row['final_q_mean']:.2f} +- {row['final_q_std']:.2f} |"
        )
    return "\n".join(lines) + "\n"


def _plots(config: FNQPipelineConfig, rows: list[dict], out_dir: Path) -> list[str]:
    out, groups = [], {}
    for row in rows:
        if config.epsilons:
            key = "reference" if row["method"] == "nonprivate" else row["label"].rsplit("_eps", 1)[1]
        else:
            key = f"J{row['label'].rsplit('_J', 1)[1]}"
        groups.setdefault(key, []).append(row)
    reference = groups.pop("reference", [])
    for key, group in groups.items():
        series = {r["label"]: (r["curve_x"], r["curve_mean"], r["curve_std"]) for r in reference + group}
        # Q_theta alone differs from Q + g only where there are paths.
        series.update({f"{r['label']} (Q_theta)": (r["curve_x"], r["curve_q_mean"], None)
                       for r in reference + group if r["sigma"] > 0})
        title = f"{config.env_id}: " + (f"eps = {key}, delta = {config.delta:g}" if config.epsilons else key)
        path = out_dir / f"curves_{'eps' if config.epsilons else ''}{key}.png"
        plot_lines(path, series, xlabel="samples", ylabel="return (mean +- 1 std over seeds)", title=title)
        out.append(str(path))
    return out


def run(config: FNQPipelineConfig, mode: RunMode = "new") -> dict:
    from tqdm.auto import tqdm

    torch.set_num_threads(1)
    directory = RunDirectory(config.run_dir, pipeline="fnq", config=to_dict(config), mode=mode)
    bounds = _state_bounds(config)
    probe = _make_env(config)
    obs_dim, n_actions = int(np.prod(probe.observation_space.shape)), int(probe.action_space.n)
    probe.close()
    plan = _plan(config)
    for spec in plan:  # calibrations (and their refusals) before the first write
        if spec.method == "fnq" and spec.epsilon is not None:
            if obs_dim != 1:
                raise ValidationError("epsilons", "Theorem 5 is proven for one-dimensional states; run a sweep instead")
            _calibrate(config, spec)
    directory.begin()  # each (method, seed) below is a Trainer run directory of its own under run_dir
    runs = []
    for spec, seed in tqdm([(s, k) for s in plan for k in config.seeds], desc="fnq runs", disable=not config.progress):
        runs.append(_run_one(config, spec, seed, bounds, obs_dim, n_actions))
    rows = _summarise(runs)
    # Under reward-level privacy the returns are computed from the protected rewards: curator-only.
    run_dir = directory.curator
    table = _table(rows)
    atomic_write_text(run_dir / "table.md", table)
    plots = _plots(config, rows, run_dir)
    atomic_write_json(run_dir / "results.json", {"config": to_dict(config), "rows": rows, "runs": runs})
    return {"table": table, "plots": plots, "rows": [{k: v for k, v in r.items() if not k.startswith("curve")}
                                                       for r in rows]}


def evaluate(payload: dict, *, episodes: int, seed: int, out_dir: str | Path) -> dict:
    """evaluate.py: play the run's released function (``released.pt`` beside its checkpoints) greedily."""
    import gymnasium as gym

    import dporl.envs  # noqa: F401
    from dporl.algos.fnq import load_noisy_q
    from dporl.eval.returns import evaluate_returns

    config = from_dict(FNQPipelineConfig, {k: v for k, v in payload["config"].items() if k != "run"})
    released = Path(out_dir) / "release" / "released.pt"
    if not released.exists():
        raise ValidationError("checkpoint", f"no released function at {released}")
    function, metadata = load_noisy_q(released)
    env = gym.make_vec(config.env_id, num_envs=min(episodes, 16), vectorization_mode="sync")
    stats = evaluate_returns(function.act, env, episodes, seed)
    env.close()
    metrics = {**stats.to_dict(), "label": metadata.get("label"), "privacy": metadata.get("privacy")}
    atomic_write_json(Path(out_dir) / "eval.json", metrics)
    return metrics


register(Pipeline("fnq", FNQPipelineConfig, run, evaluate))
