"""Planning a stable-prefix release: its configuration, the public simulator it needs, every refusal (checked before
anything is spent) and its privacy events in the ledger (see ``dporl.algos.stable_prefix``)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal, Optional

import gymnasium as gym
import numpy as np

from dporl.data.dataset import DatasetMetadata, TrajectoryDataset
from dporl.envs.registry import is_registered
from dporl.envs.simulator import PublicSimulator
from dporl.experts.expert_set import ExpertSet
from dporl.privacy.count import WHOLE, Units
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.relations import ADD_REMOVE
from dporl.privacy.sparse_vector import StablePrefixBudget, check_stability_precondition, stable_prefix_budget
from dporl.privacy.units import EXPERT, Relation
from dporl.utils.validation import ValidationError, check_positive, check_probability

RELEASE_STAGE = "release"
ReleaseSource = Literal["fresh", "logged"]
# Secret streams of the release (one per mechanism component, all from the run's SecretRoot).
STREAMS = ("release/expert_choice", "release/env", "release/actions", "release/laplace")
# Relative tolerance when comparing the p_min recorded by the data generator with the expert set's.
_P_MIN_RTOL = 1e-9
FRESH_ANALYSIS = (
    "sparse-vector stable-prefix release of fresh rollouts in the public simulator, (2 eps', beta) per run "
    "(Sharma et al. 2024, Lemma 5.1 and Algorithms 1-2; spec threshold G = G0 / p_min + t_beta)"
)
REPLACE_ONE_ANALYSIS = (
    "; for replace-one neighbours by group privacy over one removal and one addition: (4 eps', (1 + e^{2 eps'}) "
    "beta) per run"
)
LOGGED_NO_GUARANTEE = (
    "the paper's mechanism: NO guarantee (release.source = logged publishes LOGGED prefixes; Lemma 5.1 covers fresh "
    "rollouts only, and on fixed data a logged prefix can carry states only its expert produced: the fixed-data "
    "audit refutes it)"
)


@dataclass
class StablePrefixConfig:
    """How the release runs; its budget (eps1, delta1) is given separately (the pipeline splits the total)."""

    trajectories: int = 25  # T: runs of Algorithm 1 (the paper: CartPole 25 / 20 at eps 10 / 7.5)
    # "fresh" (sound, default): rollouts in the public simulator. "logged": the paper's walk over logged episodes,
    # kept for reproduction only: a run using it prints NO guarantee.
    source: ReleaseSource = "fresh"
    horizon: Optional[int] = None  # H; None: the logging episode limit recorded in the dataset's metadata
    expert_chunk: int = 1024  # experts evaluated per call (memory bound for thousands of experts)
    monotone: bool = True  # q_k is monotone in the expert set: Lap(2/eps'); False uses Lap(4/eps')
    check_expert_set_hash: bool = True  # refuse an expert set that is not, by sha256, the one that logged the data

    def __post_init__(self) -> None:
        if self.trajectories < 1:
            raise ValidationError("release.trajectories", f"must be >= 1, got {self.trajectories}")
        if self.source not in ("fresh", "logged"):
            raise ValidationError("release.source", f"must be 'fresh' or 'logged', got {self.source!r}")
        if self.horizon is not None and self.horizon < 1:
            raise ValidationError("release.horizon", f"must be >= 1, got {self.horizon}")
        if self.expert_chunk < 1:
            raise ValidationError("release.expert_chunk", f"must be >= 1, got {self.expert_chunk}")


def public_simulator(metadata: DatasetMetadata, config: StablePrefixConfig, expert_set: ExpertSet) -> PublicSimulator:
    """The simulator the fresh release rolls out in, built once and checked against the data and the experts.

    Refuses (``ValidationError`` naming the field) a dataset without a makeable Gymnasium env id, a horizon that is
    neither configured nor recorded, and spaces that do not match the experts.
    """
    env_id = metadata.env_id
    if not is_registered("dataset.metadata.env_id", env_id):
        raise ValidationError(
            "dataset.metadata.env_id",
            f"the fresh stable-prefix release needs a public simulator of the logging environment, and {env_id!r} is "
            "not a registered Gymnasium environment; register it, or use method=dp_sgd (no simulator needed)",
        )
    extra = metadata.extra
    horizon = config.horizon if config.horizon is not None else extra.get("max_episode_steps")
    if not isinstance(horizon, int) or isinstance(horizon, bool) or horizon < 1:
        raise ValidationError(
            "release.horizon", f"the dataset records no logging episode limit (max_episode_steps={horizon!r}): set it"
        )
    env_kwargs = extra.get("env_kwargs") or {}
    if not isinstance(env_kwargs, dict):
        raise ValidationError("dataset.metadata.extra.env_kwargs", f"expected a mapping, got {env_kwargs!r}")
    simulator = PublicSimulator(env_id, dict(metadata.env_params), dict(env_kwargs), int(horizon))
    try:
        env = simulator.make(1)
    except ValidationError:
        raise
    except Exception as exc:  # a registered id whose constructor fails with these parameters
        raise ValidationError(
            "dataset.metadata.env_id", f"cannot make the simulator {env_id!r} with {simulator.env_params} "
            f"{simulator.env_kwargs} ({type(exc).__name__}: {exc})"
        ) from None
    try:
        space = env.single_action_space
        if not isinstance(space, gym.spaces.Discrete) or int(space.n) != expert_set.n_actions:
            raise ValidationError("dataset.metadata.env_id", f"{env_id} has action space {space}; the experts have "
                                  f"{expert_set.n_actions} discrete actions")
        shape = tuple(env.single_observation_space.shape or ())
        if int(np.prod(shape)) != expert_set.obs_dim:
            raise ValidationError("dataset.metadata.env_id", f"{env_id} observations have shape {shape}; the experts "
                                  f"take {expert_set.obs_dim} features")
    finally:
        env.close()
    return simulator


# ---------------------------------------------------------------------------------------------------- planning
def check_release_preconditions(
    dataset: TrajectoryDataset, expert_set: Optional[ExpertSet], config: StablePrefixConfig
) -> float:
    """Refuse a release whose analysis would not hold; returns the p_min the analysis uses."""
    if expert_set is None:
        raise ValidationError(
            "data.expert_set", "the stable-prefix release needs the queryable expert set that logged the data"
        )
    meta = dataset.metadata
    m = expert_set.n_experts
    if meta.n_units != m:  # the counts themselves are private: the refusal does not print them
        raise ValidationError("dataset.metadata.n_units", "the data and the expert set hold different numbers of "
                              "experts: not the expert set that logged these data")
    if meta.n_actions != expert_set.n_actions:
        raise ValidationError(
            "dataset.metadata.n_actions", f"{meta.n_actions} actions in the data, {expert_set.n_actions} in the expert set"
        )
    if tuple(meta.obs_shape) != (expert_set.obs_dim,):
        raise ValidationError("dataset.metadata.obs_shape", f"{meta.obs_shape} vs expert set obs_dim {expert_set.obs_dim}")
    if expert_set.p_min is None:
        raise ValidationError("expert_set.p_min", "the stable-prefix analysis needs every expert to satisfy a p_min")
    # The threshold G0 / p_min is only valid if the experts that LOGGED the data put >= p_min on every action; the
    # expert set's own p_min only covers the states it is queried on. Both must state the same p_min.
    if meta.p_min is None:
        raise ValidationError(
            "dataset.metadata.p_min", "the data do not record the p_min their experts satisfied; the release needs it"
        )
    if abs(meta.p_min - expert_set.p_min) > _P_MIN_RTOL * expert_set.p_min:
        raise ValidationError(
            "expert_set.p_min",
            f"the data were logged with p_min={meta.p_min} but the expert set states p_min={expert_set.p_min}",
        )
    if config.check_expert_set_hash:
        # Expert i of the release must be the expert whose trajectories carry id i, or the two stages would protect
        # different people and not compose into one expert-level guarantee.
        recorded = (meta.expert_set or {}).get("sha256")
        if recorded is None:
            raise ValidationError(
                "dataset.metadata.expert_set", "the data do not record which expert set logged them (no sha256); "
                "the release cannot check that its experts are the loggers (release.check_expert_set_hash=false "
                "asserts it on your responsibility)",
            )
        if recorded != expert_set.fingerprint():
            raise ValidationError(
                "expert_set", "its sha256 differs from the expert set recorded in the dataset metadata (not the loggers)"
            )
    return float(expert_set.p_min)


@dataclass(frozen=True)
class ReleasePlan:
    """Everything a release is checked against before anything is spent: source, budget, p_min, simulator."""

    source: ReleaseSource
    epsilon: float  # the stage budget (epsilon, delta) the T runs compose into
    delta: float
    budget: StablePrefixBudget
    p_min: float
    trajectories: int
    expert_chunk: int
    simulator: Optional[PublicSimulator]  # None for the logged variant


def plan_release(
    dataset: TrajectoryDataset,
    expert_set: Optional[ExpertSet],
    *,
    epsilon: float,
    delta: float,
    config: StablePrefixConfig,
    units: Optional[Units] = None,
    defer_precondition: bool = False,
    relation: Relation | str = ADD_REMOVE,
) -> ReleasePlan:
    """Every refusal of the release, in order, before any query is answered or any budget recorded.

    The precondition m p_min >= G0 is checked on ``units`` (``stability_floor``: a released count's lower bound
    less one under add/remove, the public count under replace-one); ``units=None`` checks it on the expert set's
    size (callers to whom that size is public: audits, tests), ``defer_precondition`` not at all (a run planning
    before its count; it calls ``check_precondition`` once the count is released)."""
    check_positive("release.epsilon", epsilon)
    check_probability("release.delta", delta, allow_zero=False, allow_one=False)
    p_min = check_release_preconditions(dataset, expert_set, config)
    simulator = public_simulator(dataset.metadata, config, expert_set) if config.source == "fresh" else None
    plan = dataclasses.replace(accounting_plan(epsilon=epsilon, delta=delta, config=config, p_min=p_min,
                                               n_experts=None, relation=relation), simulator=simulator)
    if not defer_precondition:
        check_precondition(plan, units if units is not None else Units.public({WHOLE: expert_set.n_experts}))
    return plan


def stability_floor(units: Units) -> float:
    """The number of experts the precondition is checked on: with a released count, its lower bound less one (the
    bound fails with probability ``units.failure``, charged by the count; less one: the neighbour compared with may
    have one expert fewer, see ``dporl.privacy.count``); with a public count, the count."""
    return units.lower - 1 if units.released else units.total


def check_precondition(plan: ReleasePlan, units: Units) -> None:
    """Refuse a release whose experts cannot make the first action stable (m p_min < G0), m = ``stability_floor``."""
    what = (f"the lower confidence bound of the released count, less one ({units.describe()}; it holds except with "
            f"probability {units.failure:g})" if units.released else units.describe())
    # Where the count is released, its lower bound (not the experts) may be what fails: a larger share tightens it.
    remedy = (f"; or a larger count_fraction (the count's share of epsilon, here {units.epsilon:g}: a larger share "
              "tightens its lower bound)" if units.released else "")
    check_stability_precondition(plan.budget, plan.p_min, stability_floor(units), what, remedy)


def accounting_plan(*, epsilon: float, delta: float, config: StablePrefixConfig, p_min: float,
                    n_experts: Optional[float], relation: Relation | str = ADD_REMOVE) -> ReleasePlan:
    """The release's privacy events from public quantities alone (no data, no simulator): what ``account`` records
    for a release of ``n_experts`` experts at ``p_min`` (None: the precondition is not checked here). Only for
    accounting (e.g. an audit planning the training stage a run would calibrate against it); ``plan_release`` adds
    the checks and the simulator a release needs."""
    check_positive("release.epsilon", epsilon)
    check_probability("release.delta", delta, allow_zero=False, allow_one=False)
    # Refuses m * p_min < G0 (not even the first action would be stable) when m is given.
    budget = stable_prefix_budget(epsilon, delta, config.trajectories, p_min, n_experts, monotone=config.monotone,
                                  relation=relation)
    return ReleasePlan(
        config.source, float(epsilon), float(delta), budget, p_min, config.trajectories, config.expert_chunk, None
    )


def account(plan: ReleasePlan, ledger: PrivacyLedger) -> None:
    """Record the release in the ledger BEFORE it runs: T (2 eps', beta) events (fresh), or no guarantee (logged)."""
    budget = plan.budget
    if plan.source == "logged":
        ledger.void(LOGGED_NO_GUARANTEE)
        ledger.paper_claim(
            f"stable-prefix release of {plan.trajectories} LOGGED prefixes", budget.composed_epsilon, budget.delta,
            "Sharma et al. 2024, Algorithms 1-2 composed by PLD; Lemma 5.1 bounds fresh rollouts, not logged records",
        )
        return
    if RELEASE_STAGE not in ledger.stages:
        replace_one = ledger.relation == Relation.REPLACE_ONE
        ledger.stage(RELEASE_STAGE, budget=(plan.epsilon, plan.delta), mechanism="pld", unit=EXPERT,
                     analysis=FRESH_ANALYSIS + (REPLACE_ONE_ANALYSIS if replace_one else ""))
    ledger.record(RELEASE_STAGE, budget.event, plan.trajectories)


def with_budget(plan: ReleasePlan, **changes: float) -> ReleasePlan:
    """The same plan with budget fields changed (audits' deliberately broken variants: threshold removed, ...)."""
    return dataclasses.replace(plan, budget=dataclasses.replace(plan.budget, **changes))
