"""A stable-prefix release end to end: plan, account, run, and D_stable with its public summary and curator-only
diagnostics (see ``dporl.algos.stable_prefix``)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

from dporl.algos.stable_prefix.plan import (
    LOGGED_NO_GUARANTEE,
    ReleasePlan,
    ReleaseSource,
    StablePrefixConfig,
    account,
    plan_release,
)
from dporl.algos.stable_prefix.rollout import ReleaseRuns, execute_release
from dporl.data.dataset import DatasetMetadata, TrajectoryDataset
from dporl.experts.expert_set import ExpertSet
from dporl.privacy.count import Units
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.randomness import SecretRoot
from dporl.privacy.relations import ADD_REMOVE
from dporl.privacy.sparse_vector import StablePrefixBudget
from dporl.utils import io as io_utils


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
        self.stable.save(Path(release_dir) / "d_stable.npz")
        io_utils.atomic_write_json(Path(release_dir) / "release.json", self.summary())
        io_utils.atomic_write_json(Path(curator_dir) / "release_runs.json", self.curator())


def release_stable_prefixes(
    dataset: TrajectoryDataset,
    expert_set: Optional[ExpertSet],
    *,
    epsilon: float,
    delta: float,
    config: StablePrefixConfig,
    root: SecretRoot,
    ledger: Optional[PrivacyLedger] = None,
    progress: bool = False,
    units: Optional[Units] = None,
) -> StablePrefixRelease:
    """Algorithms 1-2 with stage budget (epsilon, delta) over ``config.trajectories`` runs; see the package docstring.

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
        n_units=1,
        obs_shape=tuple(meta.obs_shape),
        env_params=dict(meta.env_params),
        p_min=None,
        seed=None,
        expert_set=None,
        extra=extra,
    )
