"""What an off-policy evaluation problem is: logged trajectories, public features, a target policy, and the truth.

``OPEProblem`` is the protocol every evaluation in dporl runs on (the chain, Mountain Car, HIV, or a user's own
logged data):

- ``sample(n, generator) -> TrajectoryDataset``: n logged trajectories of the behaviour policy, in the project's
  one dataset format (behaviour log-probabilities logged where the target differs from the behaviour). The privacy
  unit of every private estimator is one trajectory (one episode of the dataset).
- ``features``: the public feature map phi (obs [..., d] -> [..., n], with ``n_features``); V(s) = theta . phi(s).
- ``target_policy``: obs [..., d] -> action probabilities [..., n_actions], or None for on-policy evaluation.
- ``gamma``: the discount.
- ``metrics(theta) -> dict``: accuracy of a released theta against the truth the problem knows (exact statistics of
  a finite MDP, or a large public held-out sample); ``metric_labels`` says what each key is, the first being the
  headline, and ``weightings`` which MSPBE weightings the metrics use (a reference LSTD is fit with each).

``FiniteStateProblem`` adds what the finite-state output-perturbation methods (DP-LSW / DP-LSL) need: the state
count, the feature matrix, public regression weights and the public reward bound. ``LoggedProblem`` is the smallest
implementation: a fixed dataset with no simulator (truth only from public held-out data, if any).

Per-trajectory vs per-transition weighting (``dporl.algos.lstd``): GPOPE's stochastic gradients are unbiased for the
statistics that average each trajectory's transitions first; classic LSTD and a pooled held-out MSPBE weight every
transition equally. With function approximation and trajectories of different lengths the two objectives have
different minimisers, so a continuous problem reports its MSPBE under both, labelled.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping, Optional, Protocol, runtime_checkable

import torch

from dporl.algos.lstd import FeatureMap, LinearTDStatistics, TargetPolicy, Weighting, sample_td_statistics
from dporl.data.dataset import TrajectoryDataset
from dporl.eval.ope_metrics import mspbe
from dporl.utils.validation import ValidationError, check_probability

WEIGHTING_LABELS = {
    "trajectory": "per-trajectory weighting (GPOPE's objective)",
    "transition": "per-transition weighting (pooled, classic LSTD's)",
}


@runtime_checkable
class OPEProblem(Protocol):
    features: FeatureMap
    target_policy: Optional[TargetPolicy]
    gamma: float
    metric_labels: Mapping[str, str]
    weightings: tuple[Weighting, ...]

    def sample(self, n: int, generator: torch.Generator) -> TrajectoryDataset: ...

    def metrics(self, theta: torch.Tensor) -> dict[str, float]: ...


@runtime_checkable
class FiniteStateProblem(OPEProblem, Protocol):
    n_states: int
    feature_matrix: torch.Tensor  # [n_states, n_features], public
    lsw_weights: torch.Tensor  # [n_states] public DP-LSW regression weights (0 where no trajectory can go)
    reward_max: float  # public bound on one reward


def padded_data(dataset: TrajectoryDataset) -> dict[str, torch.Tensor]:
    """The padded tensors every OPE estimator consumes (rows = trajectories = privacy units)."""
    return dataset.padded().to_dict()


@dataclass
class HeldoutMSPBE:
    """Sample MSPBE of theta on held-out trajectories, under each weighting (statistics computed once)."""

    features: Any
    target_policy: Optional[TargetPolicy]
    gamma: float
    data: Mapping[str, torch.Tensor]
    weightings: tuple[Weighting, ...] = ("trajectory", "transition")
    stats: dict[str, LinearTDStatistics] = field(init=False)

    def __post_init__(self) -> None:
        self.stats = {
            w: sample_td_statistics(self.features, self.data, self.gamma, target_policy=self.target_policy, weighting=w)
            for w in self.weightings
        }

    def __call__(self, theta: torch.Tensor) -> dict[str, float]:
        out = {}
        for i, weighting in enumerate(self.weightings):
            out["mspbe" if i == 0 else f"mspbe_{weighting}"] = float(mspbe(theta, self.stats[weighting]))
        return out

    def labels(self, prefix: str) -> dict[str, str]:
        return {
            ("mspbe" if i == 0 else f"mspbe_{w}"): f"{prefix} MSPBE, {WEIGHTING_LABELS[w]}"
            for i, w in enumerate(self.weightings)
        }


class SimulatedProblem:
    """Mixin of the simulated problems: the truth is the MSPBE on a public held-out sample of the behaviour's data,
    drawn once (``heldout_count`` trajectories, seed + 7) under every weighting in ``weightings``."""

    weightings: tuple[Weighting, ...] = ("trajectory", "transition")
    metric_prefix = "held-out"

    def _draw_heldout(self, count: int, seed: int) -> None:
        heldout = padded_data(self.sample(count, torch.Generator().manual_seed(seed + 7)))
        self._heldout = HeldoutMSPBE(self.features, self.target_policy, self.gamma, heldout, self.weightings)
        self.metric_labels = self._heldout.labels(self.metric_prefix)

    def metrics(self, theta: torch.Tensor) -> dict[str, float]:
        return self._heldout(theta)


@dataclass
class LoggedProblem:
    """A user's own logged trajectories: no simulator and no truth, only the data (see the module docstring).

    ``sample(n)`` draws n of the logged trajectories without replacement (all of them when n equals the count), so
    private estimators run on the logged data itself. ``public_heldout``, if given, must be public data of the same
    process: metrics computed on private held-out data would be released without privacy.
    """

    dataset: TrajectoryDataset
    features: Any
    target_policy: Optional[TargetPolicy]
    gamma: float
    public_heldout: Optional[TrajectoryDataset] = None
    weightings: tuple[Weighting, ...] = ("trajectory", "transition")

    def __post_init__(self) -> None:
        check_probability("gamma", self.gamma)
        if self.target_policy is not None and self.dataset.behavior_log_probs is None:
            raise ValidationError("dataset.behavior_log_probs", "off-policy evaluation needs the logged propensities")
        self._heldout = None if self.public_heldout is None else HeldoutMSPBE(
            self.features, self.target_policy, self.gamma, padded_data(self.public_heldout), self.weightings
        )
        self.metric_labels = {} if self._heldout is None else self._heldout.labels("public held-out")

    def sample(self, n: int, generator: torch.Generator) -> TrajectoryDataset:
        if not 1 <= n <= self.dataset.n_episodes:
            raise ValidationError("n", f"need 1 <= n <= {self.dataset.n_episodes} logged trajectories, got {n}")
        if n == self.dataset.n_episodes:
            return self.dataset
        chosen = torch.randperm(self.dataset.n_episodes, generator=generator)[:n].sort().values
        return self.dataset.subset(chosen.numpy())

    def metrics(self, theta: torch.Tensor) -> dict[str, float]:
        return {} if self._heldout is None else self._heldout(theta)
