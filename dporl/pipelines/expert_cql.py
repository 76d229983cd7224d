"""Pipeline "expert_cql": expert-level private offline RL with discrete CQL (spec/expert_level.md).

Methods (``method``):

- ``non_private``: CQL on all logged transitions (the upper bound; no guarantee).
- ``dp_sgd``: expert-level DP-SGD (Algorithm 4) on all data: Poisson over the m experts at rate q = B / m, k
  transitions per sampled expert averaged into one per-expert gradient, clipped, Gaussian noise. Whole budget.
- ``stable_only``: the stable-prefix release (Algorithms 1-2) with the whole budget, then noiseless CQL on D_stable.
- ``mixed``: Algorithm 3. Release with (eps1, delta1) = (f eps, delta / 2), then each step is, with probability p_dp,
  an expert-level DP-SGD step on D_unstable, else a noiseless step on D_stable; training budget (eps - eps1, delta/2).

Privacy unit: one expert (its policy and every trajectory it logged). Accounting: the release stage composes T
(2 eps', beta)-DP runs by PLD; the training stage records one event per step as the sampler states it (a
``MixtureEvent`` for Algorithm 3: the branch taken is observable, so the paper's rate-(p_dp q) figure is printed
beside the guarantee, labelled as not one). Training runs for as many steps as the stage budget allows
(``trainer.max_steps`` caps it). The guarantee printed at the end is the ledger's (the smaller of basic
composition and one joint PLD over both stages).

Evaluation (returns of the greedy Q-policy in the public environment) is post-processing and costs nothing.
"""

from __future__ import annotations

import math
import secrets
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import torch

from dporl.algos.cql import CQLConfig, DiscreteCQL
from dporl.algos.stable_prefix import (
    RELEASE_STAGE,
    StablePrefixConfig,
    StablePrefixRelease,
    release_stable_prefixes,
)
from dporl.data.dataset import TrajectoryDataset
from dporl.eval.returns import evaluate_returns
from dporl.experts.expert_set import ExpertSet
from dporl.logging import RunLogger
from dporl.pipelines import Pipeline, get_pipeline, register
from dporl.privacy.accountants import paper_mixture_epsilon
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.noise import NoiseSource
from dporl.privacy.samplers import MixtureSource, PoissonUnitSource, UniformBatchSource
from dporl.train.config import DPConfig, TrainerConfig
from dporl.train.trainer import Trainer
from dporl.utils.config import from_dict, to_dict
from dporl.utils.io import atomic_torch_save, atomic_write_json
from dporl.utils.seeding import make_generator
from dporl.utils.validation import ValidationError, check_positive, check_probability

Method = Literal["non_private", "dp_sgd", "stable_only", "mixed"]
TRAIN_STAGE = "train"
# Columns CQL reads; the sources must not carry expert ids or behaviour probabilities into the batches.
_CQL_KEYS = ("obs", "actions", "rewards", "next_obs", "terminated")


@dataclass
class DataConfig:
    """Either a saved dataset (+ the expert set that logged it) or a "dataset" pipeline config to run first."""

    dataset: Optional[str] = None  # TrajectoryDataset .npz
    expert_set: Optional[str] = None  # ExpertSet file; default: the path recorded in the dataset's metadata
    generate: Optional[dict[str, Any]] = None  # a "dataset" pipeline config (pipeline key optional)

    def __post_init__(self) -> None:
        if (self.dataset is None) == (self.generate is None):
            raise ValidationError("data", "give exactly one of data.dataset (a saved dataset) or data.generate")


@dataclass
class PrivateTrainingConfig:
    """Expert-level DP-SGD steps (Algorithm 4) and their mixing with stable steps (Algorithm 3)."""

    noise_multiplier: Optional[float] = None  # None: the smallest that fits trainer.max_steps in the budget
    max_grad_norm: float = 1.0  # C, per-expert gradient clip
    rows_per_expert: int = 1  # k transitions per sampled expert (1: the paper; >1: user-level DP-SGD, same privacy)
    p_dp: float = 0.5  # "mixed": probability of a DP-SGD step (the paper's grid: 0.1, 0.2, 0.5, 1)
    accountant: Literal["rdp", "prv", "pld"] = "rdp"
    clipping: Literal["bookkeeping", "ghost", "opacus", "naive"] = "bookkeeping"

    def __post_init__(self) -> None:
        if self.noise_multiplier is not None:
            check_positive("dp.noise_multiplier", self.noise_multiplier)
        check_positive("dp.max_grad_norm", self.max_grad_norm)
        if self.rows_per_expert < 1:
            raise ValidationError("dp.rows_per_expert", f"must be >= 1, got {self.rows_per_expert}")
        check_probability("dp.p_dp", self.p_dp, allow_zero=False)


@dataclass
class EvalConfig:
    env_id: Optional[str] = None  # default: the dataset's environment, default physics (where the data were logged)
    episodes: int = 10
    num_envs: int = 4
    max_episode_steps: Optional[int] = None  # the paper evaluates CartPole with 1000
    seed: int = 12345
    last_evals: int = 10  # the summary also reports the mean of the last this-many evaluations (the paper's protocol)

    def __post_init__(self) -> None:
        for name in ("episodes", "num_envs", "last_evals"):
            if getattr(self, name) < 1:
                raise ValidationError(f"eval.{name}", f"must be >= 1, got {getattr(self, name)}")
        if self.max_episode_steps is not None and self.max_episode_steps < 1:
            raise ValidationError("eval.max_episode_steps", f"must be >= 1, got {self.max_episode_steps}")


@dataclass
class ExpertCQLConfig:
    pipeline: str = "expert_cql"
    method: Method = "mixed"
    run_dir: str = "runs/expert_cql"
    epsilon: float = 10.0  # total expert-level budget of the run (release + training)
    delta: float = 1e-5  # total delta; "mixed" gives half to each stage (the paper)
    release_fraction: float = 0.5  # "mixed": eps1 = release_fraction * epsilon
    batch_size: int = 256  # B: expected experts per DP-SGD step (rate B / m) and transitions per noiseless step
    # Secret by default: a known noise seed lets anyone subtract the noise (see dporl.privacy.noise).
    noise_seed: Optional[int] = None
    data: DataConfig = field(default_factory=lambda: DataConfig(dataset="data/cartpole.npz"))
    release: StablePrefixConfig = field(default_factory=StablePrefixConfig)
    dp: PrivateTrainingConfig = field(default_factory=PrivateTrainingConfig)
    cql: CQLConfig = field(default_factory=CQLConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        if self.pipeline != "expert_cql":
            raise ValidationError("pipeline", f"expected 'expert_cql', got {self.pipeline!r}")
        check_positive("epsilon", self.epsilon)
        check_probability("delta", self.delta, allow_zero=False, allow_one=False)
        check_probability("release_fraction", self.release_fraction, allow_zero=False, allow_one=False)
        if self.batch_size < 1:
            raise ValidationError("batch_size", f"must be >= 1, got {self.batch_size}")

    def stage_budgets(self) -> dict[str, tuple[float, float]]:
        """(epsilon, delta) of each private stage this method runs."""
        if self.method == "non_private":
            return {}
        if self.method == "dp_sgd":
            return {TRAIN_STAGE: (self.epsilon, self.delta)}
        if self.method == "stable_only":
            return {RELEASE_STAGE: (self.epsilon, self.delta)}
        eps1 = self.release_fraction * self.epsilon
        return {RELEASE_STAGE: (eps1, self.delta / 2), TRAIN_STAGE: (self.epsilon - eps1, self.delta / 2)}


# ---------------------------------------------------------------------------------------------------- data
def generate_dataset(generate: dict[str, Any]) -> tuple[str, str]:
    """Run the "dataset" pipeline with config ``generate``; (dataset path, expert set path)."""
    generator = get_pipeline("dataset")
    outputs = generator.run(from_dict(generator.config_cls, {"pipeline": "dataset", **generate}))
    return outputs["dataset"], outputs["expert_set"]


def load_data(config: DataConfig) -> tuple[TrajectoryDataset, Optional[ExpertSet]]:
    """The logged dataset and, when one is known, the expert set that logged it."""
    if config.generate is not None:
        dataset_path, expert_path = generate_dataset(config.generate)
        expert_path = config.expert_set or expert_path
    else:
        dataset_path, expert_path = config.dataset, config.expert_set
    dataset = TrajectoryDataset.load(dataset_path)
    if expert_path is None:
        expert_path = (dataset.metadata.expert_set or {}).get("path")
    experts = ExpertSet.load(expert_path) if expert_path is not None else None
    return dataset, experts


def cql_columns(dataset: TrajectoryDataset) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """(the columns CQL reads, the expert id of every transition)."""
    transitions = dataset.transitions().to_torch()
    return {k: transitions[k] for k in _CQL_KEYS}, transitions["expert_ids"]


def expert_source(dataset: TrajectoryDataset, n_experts: int, config: ExpertCQLConfig) -> PoissonUnitSource:
    """Algorithm 4's sampler: every one of the m experts (those without rows too) included with rate B / m."""
    if config.batch_size > n_experts:
        raise ValidationError("batch_size", f"expected batch {config.batch_size} exceeds the {n_experts} experts")
    columns, experts = cql_columns(dataset)
    return PoissonUnitSource(columns, experts, n_experts, config.batch_size / n_experts, config.dp.rows_per_expert)


def uniform_source(dataset: TrajectoryDataset, batch_size: int, what: str) -> UniformBatchSource:
    if dataset.n_transitions == 0:
        raise ValidationError("release", f"{what} is empty: nothing to train on (raise the release budget or T)")
    return UniformBatchSource(cql_columns(dataset)[0], batch_size)


# ---------------------------------------------------------------------------------------------------- release
def run_release(
    dataset: TrajectoryDataset,
    experts: Optional[ExpertSet],
    budget: tuple[float, float],
    config: ExpertCQLConfig,
    ledger: PrivacyLedger,
    out_dir: Path,
) -> StablePrefixRelease | tuple[TrajectoryDataset, TrajectoryDataset]:
    """Stable/unstable split; reused from ``out_dir`` when a previous attempt of this run already paid for it."""
    ledger_file = out_dir / "ledger.pt"
    if ledger_file.exists():  # the release happened (and was recorded) before an interruption: never redo it
        ledger.load_state_dict(torch.load(ledger_file, weights_only=False))
        return TrajectoryDataset.load(out_dir / "d_stable.npz"), TrajectoryDataset.load(out_dir / "d_unstable.npz")
    if experts is None:
        raise ValidationError("data.expert_set", "the stable-prefix release needs the expert set that logged the data")
    result = release_stable_prefixes(
        dataset,
        experts,
        epsilon=budget[0],
        delta=budget[1],
        config=config.release,
        noise=NoiseSource(config.noise_seed),
        # Which expert and trajectory each run takes is part of the mechanism's randomness (Lemma 5.1 is over the
        # uniform choice of expert): it must be as secret as the Laplace noise, so it is seeded like the noise.
        generator=make_generator(secrets.randbits(63) if config.noise_seed is None else config.noise_seed + 2),
        ledger=ledger,
    )
    result.save(out_dir)
    atomic_torch_save(ledger_file, ledger.state_dict())  # written last: marks the release as done and paid
    return result


# ---------------------------------------------------------------------------------------------------- evaluation
def make_eval_env(config: EvalConfig, dataset_env_id: str):
    import gymnasium as gym

    import dporl.envs  # noqa: F401  (registers dporl/* environments)

    kwargs = {} if config.max_episode_steps is None else {"max_episode_steps": config.max_episode_steps}
    return gym.make_vec(config.env_id or dataset_env_id, num_envs=config.num_envs, vectorization_mode="sync", **kwargs)


def returns_evaluator(config: EvalConfig, env_id: str):
    """fn(module) -> return statistics of the greedy policy; one vector env reused across evaluations."""
    env = make_eval_env(config, env_id)

    def evaluate(module: DiscreteCQL) -> dict[str, float]:
        return evaluate_returns(module.act, env, config.episodes, config.seed).to_dict()

    return evaluate, env


# ---------------------------------------------------------------------------------------------------- run
def run(config: ExpertCQLConfig) -> dict:
    run_dir = Path(config.run_dir)
    dataset, experts = load_data(config.data)
    meta = dataset.metadata
    if len(meta.obs_shape) != 1:
        raise ValidationError("dataset.metadata.obs_shape", f"CQL needs flat observations, got {meta.obs_shape}")
    budgets = config.stage_budgets()
    ledger = PrivacyLedger()

    release_summary = None
    if RELEASE_STAGE in budgets:
        released = run_release(dataset, experts, budgets[RELEASE_STAGE], config, ledger, run_dir / "release")
        if isinstance(released, StablePrefixRelease):
            release_summary = released.summary()
            stable, unstable = released.stable, released.unstable
        else:
            stable, unstable = released
        print(f"stable-prefix release: {stable.n_transitions} stable / {unstable.n_transitions} unstable transitions")
    else:
        stable, unstable = None, dataset

    m = meta.n_experts
    if config.method == "non_private":
        source, dp = uniform_source(dataset, config.batch_size, "the dataset"), None
    elif config.method == "stable_only":
        source, dp = uniform_source(stable, config.batch_size, "D_stable"), None
    else:
        private = expert_source(unstable, m, config)
        source = (
            private
            if config.method == "dp_sgd"
            else MixtureSource(config.dp.p_dp, private, uniform_source(stable, config.batch_size, "D_stable"))
        )
        eps2, delta2 = budgets[TRAIN_STAGE]
        dp = DPConfig(
            epsilon=eps2,
            delta=delta2,
            noise_multiplier=config.dp.noise_multiplier,
            max_grad_norm=config.dp.max_grad_norm,
            accountant=config.dp.accountant,
            clipping=config.dp.clipping,
            noise_seed=None if config.noise_seed is None else config.noise_seed + 1,
        )

    algorithm = DiscreteCQL(meta.obs_shape[0], meta.n_actions, config.cql, privacy_unit="expert")
    pipeline_config = {**to_dict(config), "resolved": {"env_id": config.eval.env_id or meta.env_id}}
    evaluate, env = returns_evaluator(config.eval, meta.env_id)
    try:
        result = Trainer(
            algorithm,
            source,
            config=config.trainer,
            dp=dp,
            ledger=ledger,
            run_dir=run_dir,
            pipeline="expert_cql",
            pipeline_config=pipeline_config,
            stage=TRAIN_STAGE,
            evaluators={"eval": evaluate},
        ).fit()
    finally:
        env.close()

    report = ledger.report()
    returns = [metrics["eval/return_mean"] for _, metrics in result.eval_history if "eval/return_mean" in metrics]
    last = returns[-config.eval.last_evals :]
    summary = {
        "method": config.method,
        "steps": result.steps,
        "noise_multiplier": result.noise_multiplier,
        "final_metrics": result.metrics,
        "return_mean_last_evals": sum(last) / len(last) if last else math.nan,
        "release": release_summary,
        "stable_transitions": None if stable is None else int(stable.n_transitions),
        "privacy": report.to_dict(),
        "paper_mixture_epsilon_NOT_A_GUARANTEE": _paper_figure(config, source, result),
        "run_dir": str(run_dir),
        "config": to_dict(config),
    }
    atomic_write_json(run_dir / "expert_cql_summary.json", summary)
    print(report.describe() if report.stages else "NO PRIVACY GUARANTEE: non-private baseline (method non_private)")
    if summary["paper_mixture_epsilon_NOT_A_GUARANTEE"] is not None:
        print(
            f"paper's accounting of the training stage (rate p_dp * q; NOT a guarantee: the branch is observable): "
            f"eps={summary['paper_mixture_epsilon_NOT_A_GUARANTEE']:.4g}"
        )
    return summary


def _paper_figure(config: ExpertCQLConfig, source: Any, result) -> Optional[float]:
    """The expert-level paper's epsilon for the training stage of Algorithm 3, for comparison only."""
    if not isinstance(source, MixtureSource) or result.budget_steps == 0:
        return None
    eps2, delta2 = config.stage_budgets()[TRAIN_STAGE]
    return paper_mixture_epsilon(
        source.private_probability,
        source.private_source.sample_rate,
        result.noise_multiplier,
        result.budget_steps,
        delta2,
        config.dp.accountant,
    )


def evaluate(payload: dict, *, episodes: int, seed: int, out_dir: str | Path) -> dict:
    """evaluate.py: rebuild the Q-network from a checkpoint, run ``episodes`` episodes, write JSON + TensorBoard."""
    config = from_dict(ExpertCQLConfig, {k: v for k, v in payload["config"].items() if k != "resolved"})
    eval_config = from_dict(EvalConfig, {**to_dict(config.eval), "episodes": episodes, "seed": seed})
    env = make_eval_env(eval_config, payload["config"]["resolved"]["env_id"])
    try:
        obs_dim = int(env.single_observation_space.shape[0])
        algorithm = DiscreteCQL(obs_dim, int(env.single_action_space.n), config.cql)
        algorithm.load_state_dict(payload["algorithm"])
        algorithm.eval()
        stats = evaluate_returns(algorithm.act, env, episodes, seed)
    finally:
        env.close()
    ledger = PrivacyLedger()
    ledger.load_state_dict(payload["ledger"])
    metrics = {**stats.to_dict(), "step": payload["step"], "privacy": ledger.report().to_dict()["guarantee"]}
    out_dir = Path(out_dir)
    atomic_write_json(out_dir / "eval.json", {**metrics, "returns": stats.returns})
    logger = RunLogger(out_dir / "eval")
    logger.scalars({f"eval/{k}": v for k, v in stats.to_dict().items()}, payload["step"])
    logger.close()
    return metrics


register(Pipeline("expert_cql", ExpertCQLConfig, run, evaluate))
