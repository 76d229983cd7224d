"""Stable-prefix release (expert-level paper, Algorithms 1-2): sparse-vector filtering of trajectory prefixes.

Privacy unit: one expert (add/remove an expert with its policy and all its trajectories). For each of T runs:

1. an expert is chosen uniformly at random and one of its logged trajectories that no earlier run used is taken,
   uniformly among those (the analysis treats it as a fresh rollout of that expert);
2. the threshold is perturbed once per run: G_hat = G + Lap(b), b = 2 / eps' (monotone queries; 4 / eps' otherwise);
3. prefix queries q_k = sum_i prod_{t<=k} pi_i(a_t | s_t) are answered, fresh Lap(b) each, while
   q_k + Lap(b) >= G_hat;
4. the longest passing prefix (possibly empty) goes to D_stable; its tail and every unprocessed trajectory go to
   D_unstable (computed from the content of D_stable, see ``unstable_remainder``, so that private training on it
   composes with the release).

Each run is (2 eps', beta)-DP with G = G0 / p_min + t_beta (``dporl.privacy.sparse_vector.stable_prefix_budget``);
the T runs are recorded as T such events in the ledger stage ``"release"`` and composed there (PLD).

Noise and comparison live in linear space (the sensitivity-1 statement is about q_k itself, not log q_k), but q_k is
accumulated in log space: log q_k = logsumexp_i sum_{t<=k} log pi_i(a_t | s_t), in float64, exponentiated only for the
comparison. Values far below the threshold underflow to 0, which does not change any comparison's outcome beyond
float64 resolution of the Laplace draw.

Laziness. The T runs are independent given their trajectories, so they advance in lockstep: step k evaluates, for
every run still alive, the single state s_k, over all experts (in expert chunks to bound memory). A state is shown
to the experts only if every earlier query of its run passed, so nothing past a run's first failed query is ever
evaluated, and a release costs (sum of reached prefix lengths) x m expert evaluations in about max_k calls.

Released output. D_stable holds the prefixes only: expert ids are all 0 (a one-expert pool), behaviour
log-probabilities are dropped, and its metadata carries no reference to the expert set (its hash is a function of
every expert). Which episode each run used and how many states were evaluated are curator-side diagnostics.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from dporl.data.dataset import DatasetMetadata, TrajectoryDataset
from dporl.experts.expert_set import ExpertSet
from dporl.privacy.noise import NoiseSource
from dporl.privacy.sparse_vector import StablePrefixBudget, stable_prefix_budget
from dporl.utils.io import atomic_write_json
from dporl.utils.validation import ValidationError, check_positive, check_probability

if TYPE_CHECKING:
    from dporl.privacy.ledger import PrivacyLedger

RELEASE_STAGE = "release"
# Relative tolerance when comparing the p_min recorded by the data generator with the expert set's.
_P_MIN_RTOL = 1e-9


@dataclass
class StablePrefixConfig:
    """How the release runs; its budget (eps1, delta1) is given separately (the pipeline splits the total)."""

    trajectories: int = 25  # T: runs of Algorithm 1 (the paper: CartPole 25 / 20 at eps 10 / 7.5)
    expert_chunk: int = 1024  # experts evaluated per call (memory bound for thousands of experts)
    monotone: bool = True  # q_k is monotone in the expert set: Lap(2/eps'); False uses Lap(4/eps')
    check_expert_set_hash: bool = True  # refuse an expert set whose sha256 differs from the one that logged the data

    def __post_init__(self) -> None:
        if self.trajectories < 1:
            raise ValidationError("release.trajectories", f"must be >= 1, got {self.trajectories}")
        if self.expert_chunk < 1:
            raise ValidationError("release.expert_chunk", f"must be >= 1, got {self.expert_chunk}")


@dataclass
class StablePrefixRelease:
    stable: TrajectoryDataset  # released prefixes (no expert ids, no behaviour probabilities)
    unstable: TrajectoryDataset  # logged data minus released prefixes, with expert ids: private training only
    budget: StablePrefixBudget
    # Curator-side diagnostics (not released): the input episode of each run (-1: its expert had none left),
    # the released length of each run, and the number of states shown to the experts (x m evaluations).
    processed_episodes: np.ndarray
    prefix_lengths: np.ndarray
    states_evaluated: int

    def summary(self) -> dict:
        return {
            "trajectories_processed": int(len(self.prefix_lengths)),
            "stable_episodes": int(self.stable.n_episodes),
            "stable_transitions": int(self.stable.n_transitions),
            "unstable_transitions": int(self.unstable.n_transitions),
            "mean_prefix_length": float(self.prefix_lengths.mean()) if len(self.prefix_lengths) else 0.0,
            "epsilon_prime": float(self.budget.epsilon_prime),
            "beta": float(self.budget.beta),
            "threshold": float(self.budget.threshold),
            "noise_scale": float(self.budget.noise_scale),
            "curator_states_evaluated": int(self.states_evaluated),
        }

    def save(self, directory: str | Path) -> Path:
        """d_stable.npz (releasable), d_unstable.npz and release.json (curator-only: they identify experts)."""
        directory = Path(directory)
        self.stable.save(directory / "d_stable.npz")
        self.unstable.save(directory / "d_unstable.npz")
        atomic_write_json(
            directory / "release.json",
            {
                **self.summary(),
                "curator_processed_episodes": self.processed_episodes.tolist(),
                "curator_prefix_lengths": self.prefix_lengths.tolist(),
            },
        )
        return directory


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
    m = expert_set.n_experts
    step = torch.cat(
        [
            expert_set.log_prob_of(observations, actions, experts=slice(start, min(start + expert_chunk, m)))
            for start in range(0, m, expert_chunk)
        ]
    )
    advanced = log_mass + step.to(torch.float64)
    return torch.logsumexp(advanced, dim=0), advanced


def check_release_preconditions(
    dataset: TrajectoryDataset, expert_set: ExpertSet, config: StablePrefixConfig
) -> float:
    """Refuse a release whose analysis would not hold; returns the p_min the analysis uses."""
    meta = dataset.metadata
    m = expert_set.n_experts
    if meta.n_experts != m:
        raise ValidationError("dataset.metadata.n_experts", f"{meta.n_experts} experts in the data, {m} in the expert set")
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
    recorded = (meta.expert_set or {}).get("sha256")
    if config.check_expert_set_hash and recorded is not None and recorded != expert_set.fingerprint():
        raise ValidationError(
            "expert_set", "its sha256 differs from the expert set recorded in the dataset metadata (not the loggers)"
        )
    return float(expert_set.p_min)


def release_stable_prefixes(
    dataset: TrajectoryDataset,
    expert_set: ExpertSet,
    *,
    epsilon: float,
    delta: float,
    config: StablePrefixConfig,
    noise: NoiseSource,
    generator: torch.Generator,
    ledger: Optional["PrivacyLedger"] = None,
) -> StablePrefixRelease:
    """Algorithm 2 with budget (epsilon, delta) over ``config.trajectories`` runs; see the module docstring.

    With a ledger, the stage ``"release"`` (unit expert, PLD composition) receives T events (2 eps', beta) before any
    query is answered: the budget is spent whether or not a run finds a stable prefix.
    """
    check_positive("release.epsilon", epsilon)
    check_probability("release.delta", delta, allow_zero=False, allow_one=False)
    p_min = check_release_preconditions(dataset, expert_set, config)
    m, runs = expert_set.n_experts, config.trajectories
    # Refuses m * p_min < G0 (not even the first action would be stable) before any query is answered.
    budget = stable_prefix_budget(epsilon, delta, runs, p_min, m, monotone=config.monotone)
    if ledger is not None:
        if RELEASE_STAGE not in ledger.stages:
            ledger.stage(
                RELEASE_STAGE, budget=(epsilon, delta), mechanism="pld", unit="expert",
                analysis="sparse-vector stable-prefix release, (2 eps', beta) per run (Sharma et al. 2024, spec threshold)",
            )
        ledger.record(RELEASE_STAGE, budget.event, runs)

    episodes = _choose_trajectories(dataset, m, runs, generator)
    processed = episodes >= 0
    lengths = np.zeros(runs, dtype=np.int64)
    # One threshold draw per run (exhausted runs too, so the noise stream does not depend on the data).
    noisy_threshold = budget.threshold + noise.laplace((runs,), budget.noise_scale)
    states_evaluated = 0
    if processed.any():
        lengths[processed], states_evaluated = stable_prefix_lengths(
            dataset, expert_set, episodes[processed], noisy_threshold[torch.as_tensor(processed)], budget, noise, config
        )

    released = processed & (lengths > 0)
    stable = dataset.fragments(episodes[released], np.zeros(int(released.sum()), dtype=np.int64), lengths[released])
    stable = stable.with_identities_removed(_public_metadata(dataset.metadata, budget))
    return StablePrefixRelease(
        stable, unstable_remainder(dataset, episodes[released], lengths[released]), budget, episodes, lengths,
        states_evaluated,
    )


def unstable_remainder(dataset: TrajectoryDataset, sources: np.ndarray, prefix_lengths: np.ndarray) -> TrajectoryDataset:
    """D_unstable: every logged episode minus the longest released prefix it starts with.

    Why "every episode that starts with a released prefix", not just the episode each prefix was cut from: which
    episode a run used is the release's secret randomness, not its output. Training on D_unstable composes
    sequentially with the release only if D_unstable is a function of (D, D_stable) that treats each episode on
    its own; then neighbouring datasets give D_unstable sets that differ in one expert's episodes, and
    expert-level DP-SGD on it keeps its sensitivity. Cutting by content is that function; it equals cutting the
    source episode alone unless another episode starts with the very same states and actions.
    """
    cut = np.zeros(dataset.n_episodes, dtype=np.int64)
    lengths = dataset.episode_lengths
    transition_starts = np.cumsum(lengths) - lengths
    observation_starts = transition_starts + np.arange(dataset.n_episodes)
    for source, k in zip(sources.tolist(), prefix_lengths.tolist()):
        candidates = np.flatnonzero(lengths >= k)
        for t in range(k):  # keep the episodes whose step t equals the source's (states and action)
            same_obs = dataset.observations[observation_starts[candidates] + t] == dataset.observations[
                observation_starts[source] + t
            ]
            same_action = dataset.actions[transition_starts[candidates] + t] == dataset.actions[transition_starts[source] + t]
            candidates = candidates[same_obs.reshape(len(candidates), -1).all(axis=1) & same_action]
        cut[candidates] = np.maximum(cut[candidates], k)
    remaining = np.flatnonzero(cut < lengths)
    return dataset.fragments(remaining, cut[remaining], lengths[remaining])


def _choose_trajectories(dataset: TrajectoryDataset, m: int, runs: int, generator: torch.Generator) -> np.ndarray:
    """Episode index of each run: expert uniform over all m; then that expert's next unused episode in a random order.

    Returns -1 for a run whose expert has no unused episode left (the run releases nothing; its budget is spent).
    """
    experts = torch.randint(0, m, (runs,), generator=generator).numpy()
    keys = torch.rand(dataset.n_episodes, generator=generator, dtype=torch.float64).numpy()
    shuffled = np.lexsort((keys, dataset.expert_ids))  # episodes grouped by expert, random order within
    counts = np.bincount(dataset.expert_ids, minlength=m)
    offsets = np.concatenate([[0], np.cumsum(counts)])
    # occurrence[r]: how many earlier runs chose the same expert (rank of r within its expert, in run order).
    by_expert = np.argsort(experts, kind="stable")
    occurrence = np.empty(runs, dtype=np.int64)
    occurrence[by_expert] = np.arange(runs) - np.searchsorted(experts[by_expert], experts[by_expert], side="left")
    available = occurrence < counts[experts]
    episodes = np.full(runs, -1, dtype=np.int64)
    episodes[available] = shuffled[offsets[experts[available]] + occurrence[available]]
    return episodes


def stable_prefix_lengths(
    dataset: TrajectoryDataset,
    expert_set: ExpertSet,
    episodes: np.ndarray,
    noisy_threshold: torch.Tensor,
    budget: StablePrefixBudget,
    noise: NoiseSource,
    config: StablePrefixConfig,
) -> tuple[np.ndarray, int]:
    """Released prefix length of each run, all runs advancing one step at a time (see "Laziness")."""
    padded = dataset.padded(episodes)
    device = next(expert_set.parameters()).device
    observations = padded.observations.to(device)
    actions = padded.actions.to(device)
    episode_lengths = padded.lengths.to(device)
    log_mass = torch.zeros(expert_set.n_experts, len(episodes), dtype=torch.float64, device=device)
    passed = torch.zeros(len(episodes), dtype=torch.long, device=device)
    alive = episode_lengths > 0
    noisy_threshold = noisy_threshold.to(device)
    states_evaluated = 0
    for k in range(int(episode_lengths.max())):
        runs = torch.nonzero(alive & (k < episode_lengths)).squeeze(1)
        if runs.numel() == 0:
            break
        log_q, log_mass[:, runs] = stability_log_queries(
            expert_set, observations[runs, k], actions[runs, k], log_mass[:, runs], config.expert_chunk
        )
        states_evaluated += int(runs.numel())
        noisy_q = log_q.exp() + noise.laplace((int(runs.numel()),), budget.noise_scale).to(device)
        ok = noisy_q >= noisy_threshold[runs]
        passed[runs[ok]] = k + 1
        alive[runs[~ok]] = False
    return passed.cpu().numpy(), states_evaluated


def _public_metadata(meta: DatasetMetadata, budget: StablePrefixBudget) -> DatasetMetadata:
    """Metadata of D_stable: the public environment and the release parameters, nothing about the experts."""
    return DatasetMetadata(
        env_id=meta.env_id,
        n_actions=meta.n_actions,
        n_experts=1,
        obs_shape=tuple(meta.obs_shape),
        env_params=dict(meta.env_params),
        p_min=None,
        seed=None,
        expert_set=None,
        extra={
            "released_by": "stable_prefix",
            "privacy_unit": "expert",
            "epsilon_prime": float(budget.epsilon_prime),
            "beta": float(budget.beta),
            "threshold": float(budget.threshold),
        },
    )
