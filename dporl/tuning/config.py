"""The configuration of a private hyperparameter search (``dporl tune --config C --space S``): the space file S.

    run_dir: runs/tune_table_quickstart        # the search's run directory (default: the base run_dir + "_tune")
    trials: {distribution: poisson, mean: 6}   # or {distribution: negative_binomial, mean: 6, eta: 1}
    space:
      trainer.optimizer.lr: {loguniform: [3.0e-4, 3.0e-3]}
      batch_size: {choices: [128, 256, 512]}

The search's budget is the base config's (``epsilon``, ``delta``), or ``epsilon`` / ``delta`` here: ONE guarantee
covers the count of the units (paid once, before the search), every trial and the selection. ``trial_epsilon``
fixes each trial's budget instead of calibrating it (the search then refuses if it does not fit).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from dporl.privacy.accountants import check_delta
from dporl.privacy.selection import DEFAULT_DISTRIBUTION, DEFAULT_ETA, DEFAULT_MEAN, TrialCount
from dporl.tuning.space import SearchSpace
from dporl.utils.validation import ValidationError, check_positive


@dataclass
class TrialsConfig:
    """The number of trials K: its distribution and expectation (``eta``: the negative binomial's shape; 1 geometric,
    0 logarithmic). The default, Poisson with mean 6, and why: ``dporl.privacy.selection``."""

    distribution: Literal["negative_binomial", "poisson"] = DEFAULT_DISTRIBUTION
    mean: float = DEFAULT_MEAN
    eta: float = DEFAULT_ETA

    def __post_init__(self) -> None:
        self.count()  # every refusal names its field

    def count(self) -> TrialCount:
        return TrialCount.with_mean(self.mean, self.distribution, self.eta)


@dataclass
class ScoreConfig:
    """Which released number ranks the trials: a dotted key of a trial's ``release/summary.json`` (default: the
    pipeline's headline: its private evaluation, or its return in the public simulator)."""

    key: Optional[str] = None
    maximize: bool = True


@dataclass
class TuneConfig:
    space: dict[str, Any] = field(default_factory=dict)
    run_dir: Optional[str] = None
    epsilon: Optional[float] = None  # the whole search's budget (default: the base config's)
    delta: Optional[float] = None
    trial_epsilon: Optional[float] = None  # None: the largest that fits the search's budget
    trials: TrialsConfig = field(default_factory=TrialsConfig)
    score: ScoreConfig = field(default_factory=ScoreConfig)
    # Trials at once: 1 runs them one after another in this process; more runs them on Ray (local, or the cluster
    # at ray_address). The result does not depend on it (each trial's streams depend on its index only).
    workers: int = 1
    ray_address: Optional[str] = None
    threads_per_trial: int = 1  # torch threads inside each trial (1 keeps results equal whatever the parallelism)
    noise_seed: Optional[int] = None  # the search's root secret (default: the base config's, else the OS CSPRNG)
    progress: bool = True  # per-trial progress on stderr (curator-only: it counts the trials)

    def __post_init__(self) -> None:
        SearchSpace.parse(self.space)
        if self.epsilon is not None:
            check_positive("epsilon", self.epsilon)
        if self.delta is not None:
            check_delta(self.delta)
        if self.trial_epsilon is not None:
            check_positive("trial_epsilon", self.trial_epsilon)
        if self.workers < 1:
            raise ValidationError("workers", f"must be >= 1, got {self.workers}")
        if self.threads_per_trial < 1:
            raise ValidationError("threads_per_trial", f"must be >= 1, got {self.threads_per_trial}")
        if self.noise_seed is not None and (isinstance(self.noise_seed, bool) or self.noise_seed < 0):
            raise ValidationError("noise_seed", f"must be a non-negative integer, got {self.noise_seed!r}")

    @property
    def search_space(self) -> SearchSpace:
        return SearchSpace.parse(self.space)

    @property
    def parallel(self) -> bool:
        return self.workers > 1 or self.ray_address is not None


__all__ = ["ScoreConfig", "TrialsConfig", "TuneConfig"]
