"""Stable-prefix release (expert-level paper, Algorithms 1-2): sparse-vector filtering of FRESH rollouts.

Privacy unit: one expert (add/remove an expert with its policy and all its trajectories). Each of the T runs:

1. picks an expert i uniformly at random (secret stream ``release/expert_choice``);
2. rolls out expert i's p_min-softened policy in the PUBLIC simulator of the logging environment (the dataset's
   ``env_id`` with the physics and make arguments its metadata records), from a fresh initial state, with fresh
   environment randomness (a secret Gymnasium reset seed, ``release/env``) and fresh action sampling
   (``release/actions``), up to the horizon H;
3. draws its noisy threshold G_hat = G + Lap(b) once, b = 2 / eps' (monotone queries; 4 / eps' otherwise), and at
   step k (state s_k, action a_k sampled from expert i) answers q_k = sum_i prod_{t<=k} pi_i(a_t | s_t) with fresh
   Lap(b) noise (``release/laplace``): pass -> the simulator steps to (r_k, s_{k+1}); fail -> the run stops;
4. releases its longest passing prefix (s_1, a_1, r_1, ..., s_K, a_K, r_K, s_{K+1}) into D_stable (possibly none).
   A run also stops when the simulator terminates or truncates (the prefix keeps that flag) or at H.

This is the model of Lemma 5.1 ("a uniformly chosen expert GENERATES the prefix when interacting with the MDP"),
so each run is (2 eps', beta)-DP with G = G0 / p_min + t_beta (``dporl.privacy.sparse_vector``); the ledger stage
``"release"`` composes the T runs by PLD. The logged dataset is never read (only its public metadata): D_unstable,
what private training sees, is the whole logged dataset.

The paper's variant (``source="logged"``) walks LOGGED trajectories instead (expert uniform, then one of its unused
logged episodes). On a fixed dataset that is not private: a logged prefix carries states that exist only because
that expert logged them, so "D_stable holds one of expert j's logged rows" has probability 0 without j and about
T / m with j (``dporl.audit.stable_prefix_audit`` refutes it). It is kept to reproduce the paper's numbers; a run
that uses it has NO guarantee (``PrivacyLedger.void``) and shows the paper's figure only as a paper claim.

Laziness. The T runs advance in lockstep as one vector environment: step k shows the state s_k of every run still
alive to all m experts (in expert chunks to bound memory) in ONE batched query, samples each run's action from its
own expert's row of that query, and advances q_k from the same log-probabilities. Nothing past a run's first failed
query is evaluated: a release costs (states reached) x m expert evaluations, i.e. the bare batched forward passes
plus O(m n n_A) bookkeeping (``benchmarks/bench_stable_prefix.py``).

q_k is accumulated in log space (log q_k = logsumexp_i sum_{t<=k} log pi_i(a_t | s_t), float64) and exponentiated
only for the comparison; noise and threshold live in linear space (the sensitivity-1 statement is about q_k).

Released output. D_stable holds the prefixes only: states, actions, the simulator's rewards and end flags; every
expert id is 0 (a one-expert pool), no behaviour log-probabilities, no reference to the expert set. Which expert each
run followed is secret randomness of the mechanism and stays with the curator (``StablePrefixRelease.curator``).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, Optional

import numpy as np
import torch

from dporl.data.dataset import DatasetMetadata, TrajectoryDataset
from dporl.experts.expert_set import ExpertSet, sample_from_log_probs
from dporl.privacy.noise import NoiseSource
from dporl.privacy.randomness import SecretRoot
from dporl.privacy.count import WHOLE, Units
from dporl.privacy.relations import ADD_REMOVE
from dporl.privacy.sparse_vector import StablePrefixBudget, check_stability_precondition, stable_prefix_budget
from dporl.privacy.units import EXPERT, Relation
from dporl.utils.validation import ValidationError, check_positive, check_probability

if TYPE_CHECKING:
    from dporl.experts.collect import Rollout
    from dporl.privacy.ledger import PrivacyLedger

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


# ---------------------------------------------------------------------------------------------------- the simulator
@dataclass(frozen=True)
class PublicSimulator:
    """The public simulator of the logging environment: env id, physics and make arguments, horizon H."""

    env_id: str
    env_params: dict[str, Any]
    env_kwargs: dict[str, Any]
    horizon: int

    def make(self, num_envs: int):
        """A vector env of ``num_envs`` copies (next-step autoreset), TimeLimit H."""
        from dporl.envs.variants import effective_physics
        from dporl.experts.collect import make_vector_env

        physics = effective_physics(self.env_id, self.env_params)
        return make_vector_env(self.env_id, num_envs, self.horizon, [physics] * num_envs if physics else None,
                               self.env_kwargs)


def public_simulator(metadata: DatasetMetadata, config: StablePrefixConfig, expert_set: ExpertSet) -> PublicSimulator:
    """The simulator the fresh release rolls out in, built once and checked against the data and the experts.

    Refuses (``ValidationError`` naming the field) a dataset without a makeable Gymnasium env id, a horizon that is
    neither configured nor recorded, and spaces that do not match the experts.
    """
    import gymnasium as gym

    from dporl.envs.registry import is_registered

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
    if meta.n_experts != m:  # the counts themselves are private: the refusal does not print them
        raise ValidationError("dataset.metadata.n_experts", "the data and the expert set hold different numbers of "
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
    check_stability_precondition(plan.budget, plan.p_min, stability_floor(units), what)


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


def account(plan: ReleasePlan, ledger: "PrivacyLedger") -> None:
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


# ---------------------------------------------------------------------------------------------------- execution
@dataclass
class ReleaseRuns:
    """The outcome of ``trials`` independent releases of T runs each (run r of trial t is slot t * T + r).

    ``prefixes`` holds each run's released prefix (``lengths`` = released transitions, 0 = nothing released) in
    time-major buffers. ``experts`` (the expert each run followed) and ``episodes`` (logged: the episode each run
    walked, -1 if its expert had none left) are the mechanism's secret randomness: curator-only.
    """

    prefixes: "Rollout"
    experts: np.ndarray
    episodes: Optional[np.ndarray]
    trials: int
    runs_per_trial: int
    states_evaluated: int  # states shown to the experts (x m evaluations)
    # [m, n_runs] float64: sum over each released prefix of log pi_i(a_t | s_t) for every expert i (log q_K per
    # expert; what the release compared, without the failed query's action). Curator-only, never saved.
    log_mass: Optional[torch.Tensor] = None

    @property
    def lengths(self) -> np.ndarray:
        return self.prefixes.lengths

    def stable_dataset(self, metadata: DatasetMetadata) -> TrajectoryDataset:
        """D_stable: every released prefix (runs with >= 1 transition), identities removed."""
        from dporl.experts.collect import flatten_rollout

        kept = np.flatnonzero(self.lengths > 0)
        if len(kept) == 0:
            flat = _empty_flat(metadata.obs_shape)
        else:
            flat = flatten_rollout(self.prefixes.slots(kept))
            flat.pop("behavior_log_probs", None)
        return TrajectoryDataset(expert_ids=np.zeros(len(kept), dtype=np.int64), metadata=metadata, **flat)


def execute_release(
    plan: ReleasePlan,
    dataset: TrajectoryDataset,
    expert_set: ExpertSet,
    root: SecretRoot,
    *,
    trials: int = 1,
    progress: bool = False,
) -> ReleaseRuns:
    """Run ``trials`` independent releases of ``plan.trajectories`` runs each, all in lockstep (see the module).

    All randomness comes from ``root``'s streams ``STREAMS`` (each taken once). ``trials > 1`` is for audits: every
    trial is a release of its own (the logged variant's "no episode twice" rule applies within a trial).
    """
    if trials < 1:
        raise ValidationError("trials", f"must be >= 1, got {trials}")
    if plan.source == "fresh":
        return _fresh_runs(plan, expert_set, root, trials, progress)
    return _logged_runs(plan, dataset, expert_set, root, trials)


def _expert_log_probs(expert_set: ExpertSet, states: torch.Tensor, chunk: int) -> torch.Tensor:
    """log pi_i(. | s) of every expert on ``states`` [n, d]: [m, n, n_A], evaluated in expert chunks. A distribution
    below p_min is repaired, never refused: the release runs inside a private run (``dporl.experts.expert_set``)."""
    m = expert_set.n_experts
    if chunk >= m:
        return expert_set.log_probs(states, repair=True)
    return torch.cat([expert_set.log_probs(states, experts=slice(s, min(s + chunk, m)), repair=True)
                      for s in range(0, m, chunk)])


def _fresh_runs(plan: ReleasePlan, expert_set: ExpertSet, root: SecretRoot, trials: int, progress: bool) -> ReleaseRuns:
    from tqdm.auto import tqdm

    from dporl.experts.collect import Rollout

    budget, simulator = plan.budget, plan.simulator
    n, m, horizon = trials * plan.trajectories, expert_set.n_experts, simulator.horizon
    choice = root.torch_generator(STREAMS[0])
    env_seed = root.integer(STREAMS[1])
    action_generator = root.torch_generator(STREAMS[2])
    noise = root.noise(STREAMS[3])
    device = next(expert_set.parameters()).device

    experts = torch.randint(0, m, (n,), generator=choice)
    noisy_threshold = budget.threshold + noise.laplace((n,), budget.noise_scale)  # one draw per run
    observations = np.zeros((horizon + 1, n, expert_set.obs_dim), dtype=np.float32)
    actions = np.zeros((horizon, n), dtype=np.int64)
    rewards = np.zeros((horizon, n), dtype=np.float32)
    lengths = np.zeros(n, dtype=np.int64)
    terminated = np.zeros(n, dtype=bool)
    alive = np.ones(n, dtype=bool)
    log_mass = torch.zeros(m, n, dtype=torch.float64, device=device)  # sum_{t<k} log pi_i(a_t | s_t) per run
    chosen = experts.to(device)
    states_evaluated = 0
    env = simulator.make(n)
    try:
        first, _ = env.reset(seed=env_seed)
        observations[0] = np.asarray(first, dtype=np.float32).reshape(n, -1)
        for k in tqdm(range(horizon), desc="stable-prefix release", unit="step", disable=not progress):
            runs = np.flatnonzero(alive)
            if len(runs) == 0:
                break
            index = torch.from_numpy(runs).to(device)
            log_probs = _expert_log_probs(expert_set, torch.from_numpy(observations[k, runs]), plan.expert_chunk)
            own = log_probs[chosen[index], torch.arange(len(runs), device=device)]  # each run's own expert [n', n_A]
            sampled = sample_from_log_probs(own.cpu(), action_generator)
            taken = log_probs.gather(2, sampled.to(device).view(1, -1, 1).expand(m, -1, 1)).squeeze(2)
            mass = log_mass.index_select(1, index) + taken.to(torch.float64)
            log_q = torch.logsumexp(mass, dim=0).cpu()
            states_evaluated += len(runs)
            passed = (log_q.exp() + noise.laplace((len(runs),), budget.noise_scale) >= noisy_threshold[runs]).numpy()
            keep = torch.from_numpy(np.flatnonzero(passed)).to(device)  # a failed query's action is not released
            log_mass.index_copy_(1, index.index_select(0, keep), mass.index_select(1, keep))
            alive[runs[~passed]] = False
            moving = runs[passed]
            step_actions = np.zeros(n, dtype=np.int64)
            step_actions[moving] = sampled.numpy()[passed]
            obs, reward, term, trunc, _ = env.step(step_actions)
            obs = np.asarray(obs, dtype=np.float32).reshape(n, -1)
            actions[k, moving] = step_actions[moving]
            rewards[k, moving] = np.asarray(reward, dtype=np.float32)[moving]
            observations[k + 1, moving] = obs[moving]
            lengths[moving] += 1
            term, trunc = np.asarray(term, dtype=bool), np.asarray(trunc, dtype=bool)
            ended = moving[term[moving] | trunc[moving]]
            terminated[ended] = term[ended]
            alive[ended] = False
    finally:
        env.close()
    # A prefix ends by a failed query, a truncation or the horizon (truncated) or by a termination (terminated).
    prefixes = Rollout(observations, actions, rewards, None, lengths, terminated, ~terminated)
    return ReleaseRuns(prefixes, experts.numpy(), None, trials, plan.trajectories, states_evaluated, log_mass.cpu())


def _logged_runs(
    plan: ReleasePlan, dataset: TrajectoryDataset, expert_set: ExpertSet, root: SecretRoot, trials: int
) -> ReleaseRuns:
    """The paper's variant: each run walks one logged episode (NO guarantee on fixed data; see the module)."""
    from dporl.experts.collect import Rollout

    budget, runs_per_trial = plan.budget, plan.trajectories
    n = trials * runs_per_trial
    choice = root.torch_generator(STREAMS[0])
    noise = root.noise(STREAMS[3])
    experts, episodes = _choose_trajectories(dataset, expert_set.n_experts, trials, runs_per_trial, choice)
    processed = np.flatnonzero(episodes >= 0)
    noisy_threshold = budget.threshold + noise.laplace((n,), budget.noise_scale)
    lengths = np.zeros(n, dtype=np.int64)
    states_evaluated = 0
    width = int(dataset.episode_lengths[episodes[processed]].max()) if len(processed) else 0
    observations = np.zeros((width + 1, n, expert_set.obs_dim), dtype=np.float32)
    actions = np.zeros((width, n), dtype=np.int64)
    rewards = np.zeros((width, n), dtype=np.float32)
    terminated = np.zeros(n, dtype=bool)
    log_mass = torch.zeros(expert_set.n_experts, n, dtype=torch.float64)
    if len(processed):
        padded = dataset.padded(episodes[processed])
        lengths[processed], states_evaluated, log_mass[:, processed] = stable_prefix_lengths(
            padded, expert_set, noisy_threshold[processed], budget, noise, plan.expert_chunk
        )
        observations[:, processed] = padded.observations.transpose(0, 1).reshape(width + 1, len(processed), -1).numpy()
        actions[:, processed] = padded.actions.T.numpy()
        rewards[:, processed] = padded.rewards.T.numpy()
        terminated[processed] = padded.terminated.numpy() & (lengths[processed] == padded.lengths.numpy())
    prefixes = Rollout(observations, actions, rewards, None, lengths, terminated, ~terminated)
    return ReleaseRuns(prefixes, experts, episodes, trials, runs_per_trial, states_evaluated, log_mass)


def _choose_trajectories(
    dataset: TrajectoryDataset, m: int, trials: int, runs: int, generator: torch.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """(expert, episode) of every run of every trial: expert uniform over all m; then that expert's next unused
    episode of the trial, in a random order per trial. Episode -1: the expert had none left (nothing released)."""
    experts = torch.randint(0, m, (trials, runs), generator=generator).numpy()
    keys = torch.rand(trials, dataset.n_episodes, generator=generator, dtype=torch.float64).numpy()
    # Episodes grouped by expert, random order within (keys in [0, 1) never reorder two experts), per trial.
    shuffled = np.argsort(dataset.expert_ids[None, :] + keys, axis=1, kind="stable")
    counts = np.bincount(dataset.expert_ids, minlength=m)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    # occurrence[t, r]: how many earlier runs of trial t chose the same expert.
    flat = (np.arange(trials)[:, None] * m + experts).ravel()
    order = np.argsort(flat, kind="stable")
    occurrence = np.empty(len(flat), dtype=np.int64)
    occurrence[order] = np.arange(len(flat)) - np.searchsorted(flat[order], flat[order], side="left")
    occurrence = occurrence.reshape(trials, runs)
    available = occurrence < counts[experts]
    episodes = np.full((trials, runs), -1, dtype=np.int64)
    trial_of = np.broadcast_to(np.arange(trials)[:, None], (trials, runs))
    episodes[available] = shuffled[trial_of[available], offsets[experts[available]] + occurrence[available]]
    return experts.ravel(), episodes.ravel()


def stable_prefix_lengths(
    padded,
    expert_set: ExpertSet,
    noisy_threshold: torch.Tensor,
    budget: StablePrefixBudget,
    noise: NoiseSource,
    expert_chunk: int,
) -> tuple[np.ndarray, int, torch.Tensor]:
    """(released prefix length, states evaluated, released log-mass [m, n]) of each padded logged episode, all
    advancing one step at a time (logged variant)."""
    device = next(expert_set.parameters()).device
    observations = padded.observations.to(device)
    actions = padded.actions.to(device)
    episode_lengths = padded.lengths.to(device)
    n = len(episode_lengths)
    log_mass = torch.zeros(expert_set.n_experts, n, dtype=torch.float64, device=device)
    passed = torch.zeros(n, dtype=torch.long, device=device)
    alive = episode_lengths > 0
    noisy_threshold = torch.as_tensor(noisy_threshold, dtype=torch.float64).to(device)
    states_evaluated = 0
    for k in range(int(episode_lengths.max()) if n else 0):
        runs = torch.nonzero(alive & (k < episode_lengths)).squeeze(1)
        if runs.numel() == 0:
            break
        log_q, advanced = stability_log_queries(
            expert_set, observations[runs, k], actions[runs, k], log_mass[:, runs], expert_chunk
        )
        states_evaluated += int(runs.numel())
        noisy_q = log_q.exp() + noise.laplace((int(runs.numel()),), budget.noise_scale).to(device)
        ok = noisy_q >= noisy_threshold[runs]
        passed[runs[ok]] = k + 1
        log_mass[:, runs[ok]] = advanced[:, ok]
        alive[runs[~ok]] = False
    return passed.cpu().numpy(), states_evaluated, log_mass.cpu()


def stability_log_queries(
    expert_set: ExpertSet,
    observations: torch.Tensor,
    actions: torch.Tensor,
    log_mass: torch.Tensor,
    expert_chunk: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Advance per-expert prefix log-probabilities by one step; return (log q_k [n], advanced log_mass [m, n]).

    observations [n, d], actions [n]: step k of n runs; log_mass [m, n] float64 holds sum_{t<k} log pi_i(a_t | s_t)
    (zeros at k = 1). log q_k = logsumexp_i of the advanced masses.
    """
    log_probs = _expert_log_probs(expert_set, observations, expert_chunk)
    index = torch.as_tensor(actions, device=log_probs.device).long().view(1, -1, 1).expand(log_probs.shape[0], -1, 1)
    advanced = log_mass + log_probs.gather(2, index).squeeze(2).to(torch.float64)
    return torch.logsumexp(advanced, dim=0), advanced


# ---------------------------------------------------------------------------------------------------- the release
@dataclass
class StablePrefixRelease:
    stable: TrajectoryDataset  # released prefixes (no expert ids, no behaviour probabilities)
    budget: StablePrefixBudget
    source: ReleaseSource
    runs: ReleaseRuns  # curator-only: which expert each run followed, its length, states evaluated

    def summary(self) -> dict:
        """What may be published with the release: functions of D_stable and of the (public) configuration only."""
        return {
            "source": self.source,
            "guarantee": "covered by the run's guarantee" if self.source == "fresh" else LOGGED_NO_GUARANTEE,
            "runs": int(self.runs.runs_per_trial),
            "released_prefixes": int(self.stable.n_episodes),
            "stable_transitions": int(self.stable.n_transitions),
            "epsilon_prime": float(self.budget.epsilon_prime),
            "beta": float(self.budget.beta),
            "threshold": float(self.budget.threshold),
            "noise_scale": float(self.budget.noise_scale),
        }

    def curator(self) -> dict:
        """Curator-only diagnostics (secret randomness of the mechanism): never publish."""
        return {
            "note": "CURATOR-ONLY: the expert each run followed is secret randomness of the release",
            "run_experts": self.runs.experts.tolist(),
            "run_episodes": None if self.runs.episodes is None else self.runs.episodes.tolist(),
            "prefix_lengths": self.runs.lengths.tolist(),
            "states_evaluated": int(self.runs.states_evaluated),
        }

    def save(self, release_dir, curator_dir) -> None:
        """``release_dir``: d_stable.npz and release.json (public); ``curator_dir``: release_runs.json."""
        from pathlib import Path

        from dporl.utils.io import atomic_write_json

        self.stable.save(Path(release_dir) / "d_stable.npz")
        atomic_write_json(Path(release_dir) / "release.json", self.summary())
        atomic_write_json(Path(curator_dir) / "release_runs.json", self.curator())


def release_stable_prefixes(
    dataset: TrajectoryDataset,
    expert_set: Optional[ExpertSet],
    *,
    epsilon: float,
    delta: float,
    config: StablePrefixConfig,
    root: SecretRoot,
    ledger: Optional["PrivacyLedger"] = None,
    progress: bool = False,
    units: Optional[Units] = None,
) -> StablePrefixRelease:
    """Algorithms 1-2 with stage budget (epsilon, delta) over ``config.trajectories`` runs; see the module docstring.

    Every refusal happens before anything is spent. With a ledger, the stage ``"release"`` (unit expert, PLD
    composition) receives T events (2 eps', beta) before any query is answered (the budget is spent whether or not a
    run finds a stable prefix); the logged variant instead voids the ledger and records the paper's figure.
    """
    relation = ledger.relation if ledger is not None else ADD_REMOVE
    plan = plan_release(dataset, expert_set, epsilon=epsilon, delta=delta, config=config, units=units,
                        relation=relation)
    if ledger is not None:
        account(plan, ledger)
    runs = execute_release(plan, dataset, expert_set, root, progress=progress)
    return StablePrefixRelease(runs.stable_dataset(public_metadata(dataset.metadata, plan)), plan.budget, plan.source, runs)


def public_metadata(meta: DatasetMetadata, plan: ReleasePlan) -> DatasetMetadata:
    """Metadata of D_stable: the public environment and the release parameters, nothing about the experts."""
    budget = plan.budget
    extra: dict[str, Any] = {
        "released_by": "stable_prefix",
        "source": plan.source,
        "privacy_unit": "expert",
        "epsilon_prime": float(budget.epsilon_prime),
        "beta": float(budget.beta),
        "threshold": float(budget.threshold),
    }
    if plan.simulator is not None:
        extra.update({"max_episode_steps": plan.simulator.horizon, "env_kwargs": plan.simulator.env_kwargs})
    return DatasetMetadata(
        env_id=meta.env_id,
        n_actions=meta.n_actions,
        n_experts=1,
        obs_shape=tuple(meta.obs_shape),
        env_params=dict(meta.env_params),
        p_min=None,
        seed=None,
        expert_set=None,
        extra=extra,
    )


def _empty_flat(obs_shape: tuple[int, ...]) -> dict[str, np.ndarray]:
    return {
        "observations": np.zeros((0, *obs_shape), dtype=np.float32),
        "actions": np.zeros(0, dtype=np.int64),
        "rewards": np.zeros(0, dtype=np.float32),
        "terminations": np.zeros(0, dtype=bool),
        "truncations": np.zeros(0, dtype=bool),
        "episode_lengths": np.zeros(0, dtype=np.int64),
    }


def with_budget(plan: ReleasePlan, **changes: float) -> ReleasePlan:
    """The same plan with budget fields changed (audits' deliberately broken variants: threshold removed, ...)."""
    return dataclasses.replace(plan, budget=dataclasses.replace(plan.budget, **changes))
