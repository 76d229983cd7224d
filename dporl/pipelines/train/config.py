"""Typed configuration of the "train" pipeline (YAML via ``dporl.utils.config``; dotted ``key=value`` overrides).

``algorithm`` names a registered algorithm (``dporl.algos.registry``) and holds its hyper-parameters
(``algorithm: {name: cql, hidden_sizes: [256, 256]}``, or ``algorithm: bc`` for its defaults); ``method`` names a
method of ``dporl.methods.unit_level`` (how the privacy mechanisms and the algorithm combine); the rest is the run:
its budget and neighbouring relation, its data, the release, the DP-SGD steps, the loop and the evaluation.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from dporl.algos.registry import AlgorithmConfig, algorithm_config
from dporl.algos.stable_prefix import RELEASE_STAGE, StablePrefixConfig
from dporl.envs.registry import check_no_module
from dporl.methods.unit_level import TRAIN_STAGE, UnitLevelMethod, unit_level_method
from dporl.pipelines.inputs import DataConfig
from dporl.pipelines.offline_eval import EvaluationPlan, OfflineEvalConfig
from dporl.privacy.accountants import check_delta
from dporl.privacy.count import COUNT_STAGE, CountPlan
from dporl.privacy.units import Relation
from dporl.train.config import TrainerConfig
from dporl.utils.validation import ValidationError, check_positive, check_probability

PIPELINE_NAME = "train"
Budget = tuple[float, float]


@dataclass
class PrivateTrainingConfig:
    """DP-SGD steps over units (Algorithm 4) and their mixing with stable steps (Algorithm 3)."""

    noise_multiplier: Optional[float] = None  # None: the smallest that fits trainer.max_steps in the budget
    max_grad_norm: float = 1.0  # C, per-unit gradient clip
    rows_per_unit: int = 1  # k transitions per sampled unit (1: the paper; >1: user-level DP-SGD, same privacy)
    p_dp: float = 0.5  # "mixed": probability of a DP-SGD step (the paper's grid: 0.1, 0.2, 0.5, 1)
    # The training stage's analysis. PLD, the analysis of the run's joint guarantee: a private run composes the count
    # (and the release) with training, and the report's joint PLD is tighter than RDP or PRV, so a stage calibrated
    # by either of those would leave part of the budget unused (measured: 0.91 of 1.0 on the table quickstart).
    accountant: Literal["rdp", "prv", "pld"] = "pld"
    # How per-unit gradients are clipped (the same clipped sum, different memory and speed; naive: one backward pass
    # per unit, the reference).
    clipping: Literal["bookkeeping", "ghost", "opacus", "naive"] = "bookkeeping"

    def __post_init__(self) -> None:
        if self.noise_multiplier is not None:
            check_positive("dp.noise_multiplier", self.noise_multiplier)
        check_positive("dp.max_grad_norm", self.max_grad_norm)
        if self.rows_per_unit < 1:
            raise ValidationError("dp.rows_per_unit", f"must be >= 1, got {self.rows_per_unit}")
        check_probability("dp.p_dp", self.p_dp, allow_zero=False)


@dataclass
class EvalConfig:
    """How the learned policy is evaluated: returns in a public simulator when there is one (no privacy cost), else a
    private estimate of its value on logged data (``offline``: paid from the run's budget)."""

    # False: no evaluation at all (no simulator returns, no private estimate, none of the budget spent on one).
    enabled: bool = True
    # Evaluate in a simulator: env_id, or the dataset's environment (default physics, where the data were logged)
    # when its id is a registered Gymnasium environment. False, or no simulator: private evaluation on logged data.
    simulator: bool = True
    env_id: Optional[str] = None  # the simulator's Gymnasium id (default: the dataset's, when it is registered)
    episodes: int = 10  # simulator episodes per evaluation
    num_envs: int = 4  # simulator copies stepped together
    max_episode_steps: Optional[int] = None  # the paper evaluates CartPole with 1000
    seed: int = 12345  # public seed of the simulator's episodes
    last_evals: int = 10  # the summary also reports the mean of the last this-many evaluations (the paper's protocol)
    offline: OfflineEvalConfig = field(default_factory=OfflineEvalConfig)  # without a simulator
    # The discount of the policy value the offline evaluation releases; None: the algorithm's own (CQL's gamma).
    # An algorithm without a discount (behaviour cloning) needs it for an offline evaluation.
    gamma: Optional[float] = None

    def __post_init__(self) -> None:
        if not self.enabled and self.offline.estimator not in ("auto", "none"):
            raise ValidationError("eval.enabled", f"false turns every evaluation off, yet eval.offline.estimator asks "
                                  f"for {self.offline.estimator!r}: to evaluate privately on logged data instead of in "
                                  "a simulator, set eval.simulator: false (and leave eval.enabled true)")
        if self.env_id is not None:
            check_no_module("eval.env_id", self.env_id)  # refused even with evaluation off: never a module
        for name in ("episodes", "num_envs", "last_evals"):
            if getattr(self, name) < 1:
                raise ValidationError(f"eval.{name}", f"must be >= 1, got {getattr(self, name)}")
        if self.max_episode_steps is not None and self.max_episode_steps < 1:
            raise ValidationError("eval.max_episode_steps", f"must be >= 1, got {self.max_episode_steps}")
        if self.gamma is not None:
            check_probability("eval.gamma", self.gamma)


@dataclass
class TrainPipelineConfig:
    """A private training run: budget, neighbouring relation, data, release, DP-SGD, training loop and evaluation."""

    pipeline: str = PIPELINE_NAME
    algorithm: Any = "cql"  # a registered algorithm: its name, or {name: ..., <hyper-parameters>}
    method: str = "mixed"  # dporl.methods.unit_level: non_private, dp_sgd, stable_only, mixed
    run_dir: str = "runs/train"  # the run directory (release/ to share, curator/ never)
    epsilon: float = 10.0  # total budget of the run for one unit (count + release + training + evaluation)
    delta: float = 1e-5  # total delta; "mixed" gives half to each stage (the paper)
    release_fraction: float = 0.5  # "mixed": eps1 = release_fraction * (epsilon less the count's share)
    batch_size: int = 256  # B: expected units per DP-SGD step (rate B / m~) and transitions per noiseless step
    # add_remove: one unit added or removed (the number of units is private: released by a count, m~); replace_one:
    # one unit's data replaced (the number of units is public), every mechanism analysed for replace-one.
    relation: Literal["add_remove", "replace_one"] = "add_remove"
    count_fraction: float = 0.01  # add_remove: the count's share of epsilon (its delta: 0, or its lower bound's)
    # add_remove: a count released before this run by a search over many runs (dporl.tuning), as the count stage
    # releases it ({count, cells, epsilon}). The run then releases none and derives everything count-dependent from
    # it; the search's ledger accounts that count once for all its runs, this run's ledger does not.
    released_count: Optional[dict[str, Any]] = None
    # add/remove, methods with the release: a stable-prefix release run before this run by a search over many runs
    # (dporl.tuning), as that search released it ({path, fingerprint, public}: D_stable's file, its sha256 and the
    # release's public summary). The run then runs no release (it trains on that D_stable, a public input to it) and
    # its ledger does not account it: the search's ledger accounts it once for all its runs. Needs released_count.
    released_stable: Optional[dict[str, Any]] = None
    # Secret by default: a known noise seed lets anyone subtract the noise (see dporl.privacy.noise).
    noise_seed: Optional[int] = None
    data: DataConfig = field(default_factory=lambda: DataConfig(dataset="data/cartpole.npz"))
    release: StablePrefixConfig = field(default_factory=StablePrefixConfig)
    dp: PrivateTrainingConfig = field(default_factory=PrivateTrainingConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)

    def __post_init__(self) -> None:
        if self.pipeline != PIPELINE_NAME:
            raise ValidationError("pipeline", f"expected {PIPELINE_NAME!r}, got {self.pipeline!r}")
        self.algorithm: AlgorithmConfig = algorithm_config(self.algorithm, "algorithm")
        unit_level_method(self.method, "method")
        check_positive("epsilon", self.epsilon)
        check_delta(self.delta)
        check_probability("release_fraction", self.release_fraction, allow_zero=False, allow_one=False)
        check_probability("count_fraction", self.count_fraction, allow_zero=False, allow_one=False)
        if self.relation not in ("add_remove", "replace_one"):
            raise ValidationError("relation", f"expected 'add_remove' or 'replace_one', got {self.relation!r}")
        if self.batch_size < 1:
            raise ValidationError("batch_size", f"must be >= 1, got {self.batch_size}")
        method = self.method_spec
        if self.released_stable is not None:
            check_released_stable(self.released_stable)
            if not method.release or self.relation != "add_remove" or self.release.source != "fresh":
                raise ValidationError("released_stable", "a stable-prefix release run before this run serves add/remove "
                                      "runs of a method with the (fresh) release: stable_only or mixed")
            if self.released_count is None:
                raise ValidationError("released_stable", "a release run before this run comes with the released count "
                                      "its precondition was checked on: give released_count too")
        if self.released_count is not None and (self.relation != "add_remove" or not method.private
                                                or (method.release and self.released_stable is None)):
            raise ValidationError("released_count", "a count released before the run serves add/remove private runs "
                                  "without a release of their own (a release checks a lower bound of its own count)")

    @property
    def method_spec(self) -> UnitLevelMethod:
        """The method object ``method`` names."""
        return unit_level_method(self.method, "method")

    @property
    def neighbours(self) -> Relation:
        return Relation.ADD_REMOVE if self.relation == "add_remove" else Relation.REPLACE_ONE

    def count_budget(self) -> Optional[Budget]:
        """(epsilon, delta) of the private count of the units: add/remove runs with a guarantee that release no count
        given before the run (``released_count``) only."""
        if self.relation != "add_remove" or self.released_count is not None:
            return None
        return self.method_spec.count_budget(self.epsilon, self.delta, self.count_fraction)

    def spendable(self) -> Budget:
        """The run budget less the count's share: what the release, training and evaluation divide."""
        count = self.count_budget() or (0.0, 0.0)
        return self.epsilon - count[0], self.delta - count[1]

    def stage_budgets(self) -> dict[str, Budget]:
        """(epsilon, delta) of each private stage this method runs (the count first, when there is one)."""
        count = self.count_budget()
        budgets = {} if count is None else {COUNT_STAGE: count}
        stages = self.method_spec.stage_budgets(*self.spendable(), self.release_fraction)
        if self.released_stable is not None:  # released (and accounted) before the run: training takes it all
            stages = {TRAIN_STAGE: self.spendable()} if TRAIN_STAGE in stages else {}
        return {**budgets, **stages}

    def count_plan(self, plan: Optional[EvaluationPlan]) -> Optional[CountPlan]:
        """The count this run releases (None without one): one per cell of the evaluation's partition."""
        count = self.count_budget()
        if count is None:
            return None
        cells = None if plan is None or plan.partition is None else plan.partition.names
        return CountPlan(count[0], cells, count[1] / 2)

    def discount(self) -> Optional[float]:
        """The discount of the released policy value: ``eval.gamma``, else the algorithm's own."""
        return self.eval.gamma if self.eval.gamma is not None else self.algorithm.discount()


RELEASED_STABLE_KEYS = ("path", "fingerprint", "public")


def check_released_stable(value: Any) -> None:
    """``released_stable``: {path (D_stable's npz file), fingerprint (its sha256), public (the release's summary)}."""
    if not isinstance(value, dict) or set(value) != set(RELEASED_STABLE_KEYS):
        raise ValidationError("released_stable", f"expected {{{', '.join(RELEASED_STABLE_KEYS)}}}, got {value!r}")
    for key in ("path", "fingerprint"):
        if not isinstance(value[key], str) or not value[key]:
            raise ValidationError(f"released_stable.{key}", f"expected a non-empty string, got {value[key]!r}")
    if not isinstance(value["public"], dict):
        raise ValidationError("released_stable.public", f"expected the release's public summary, got "
                              f"{value['public']!r}")


__all__ = ["Budget", "EvalConfig", "PIPELINE_NAME", "PrivateTrainingConfig", "RELEASE_STAGE", "TRAIN_STAGE",
           "TrainPipelineConfig"]
