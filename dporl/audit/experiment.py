"""A distinguishing experiment: run a mechanism many times on neighbours D and D', bound epsilon from below.

An ``Experiment`` bundles what a claim is about (the mechanism's claimed epsilon at delta, from the same
analysis dporl prints, its privacy unit and the neighbouring pair) with a vectorised ``scores`` function that runs
``n`` independent trials of the mechanism on D or on D' and reduces each output to a scalar test statistic
(larger = "looks like D"; -inf for outputs that carry no information, e.g. a noiseless step of a mixture).
``run_audit`` draws the trials in chunks (tqdm progress), then ``dporl.audit.bounds.epsilon_lower_bound``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import numpy as np

from dporl.audit.bounds import EpsilonLowerBound, epsilon_lower_bound
from dporl.utils.validation import ValidationError

# scores(n_trials, on_d, seed) -> float64 [n_trials]; trials independent given the seed, fresh seed per call.
ScoreFunction = Callable[[int, bool, int], np.ndarray]


@dataclass
class Experiment:
    name: str
    claimed_epsilon: float
    delta: float
    privacy_unit: str  # "expert" / "trajectory" / "transition" / "reward" / "record"
    analysis: str  # where the claimed epsilon comes from
    neighbours: str  # how D and D' differ (the worst case used)
    scores: ScoreFunction
    chunk_trials: int = 20_000  # trials per call of ``scores`` (bounds memory; one progress tick each)
    # Other figures to compare with the bound (e.g. the paper's epsilon for the mixture): NOT guarantees.
    references: dict[str, float] = field(default_factory=dict)
    settings: dict[str, Any] = field(default_factory=dict)  # the mechanism's parameters, for the report
    # The most trials this audit runs per neighbour (it caps the caller's count), for audits whose every trial is a
    # whole training run of a real pipeline; None: as many as asked.
    max_trials: Optional[int] = None


@dataclass
class AuditResult:
    name: str
    claimed_epsilon: float
    bound: EpsilonLowerBound
    privacy_unit: str
    analysis: str
    neighbours: str
    references: dict[str, float]
    settings: dict[str, Any]
    seconds: float

    @property
    def epsilon_lower_bound(self) -> float:
        return self.bound.epsilon

    @property
    def violated(self) -> bool:
        """The claim is refuted (at the bound's confidence): eps_lb > claimed eps."""
        return self.bound.epsilon > self.claimed_epsilon

    def exceeded_references(self) -> list[str]:
        return [name for name, value in self.references.items() if self.bound.epsilon > value]

    def to_dict(self) -> dict[str, Any]:
        return {
            "mechanism": self.name,
            "claimed_epsilon": self.claimed_epsilon,
            "delta": self.bound.delta,
            "epsilon_lower_bound": self.bound.epsilon,
            "confidence": self.bound.confidence,
            "violated": self.violated,
            "trials_per_neighbour": self.bound.trials,
            "privacy_unit": self.privacy_unit,
            "analysis": self.analysis,
            "neighbours": self.neighbours,
            "test": self.bound.to_dict()["test"],
            "held_out_rates": {"first_lower": self.bound.first_rate_lower, "second_upper": self.bound.second_rate_upper},
            "references": self.references,
            "references_exceeded": self.exceeded_references(),
            "settings": self.settings,
            "seconds": self.seconds,
        }

    def describe(self) -> str:
        verdict = "VIOLATED" if self.violated else "consistent"
        lines = [
            f"{self.name}: eps_lb = {self.bound.epsilon:.3f} ({self.bound.confidence:.0%} confidence, "
            f"{self.bound.trials} trials per neighbour) vs claimed eps = {self.claimed_epsilon:.3f} "
            f"at delta = {self.bound.delta:g}: {verdict}",
            f"  unit: {self.privacy_unit}; neighbours: {self.neighbours}",
            f"  claimed by: {self.analysis}",
        ]
        for name, value in self.references.items():
            mark = "exceeded by the audit" if self.bound.epsilon > value else "not exceeded"
            lines.append(f"  reference (not a guarantee) {name}: eps = {value:.3f}, {mark}")
        return "\n".join(lines)


def run_audit(
    experiment: Experiment, trials: int, *, seed: int = 0, confidence: float = 0.95, progress: bool = False
) -> AuditResult:
    """Run ``trials`` independent trials on each neighbour and certify a lower bound on epsilon."""
    from tqdm.auto import tqdm

    if trials < 8:
        raise ValidationError("trials", f"need at least 8 trials per neighbour, got {trials}")
    if experiment.max_trials is not None:
        trials = min(trials, max(8, experiment.max_trials))
    start = time.perf_counter()
    chunks = [min(experiment.chunk_trials, trials - done) for done in range(0, trials, experiment.chunk_trials)]
    scores = {True: [], False: []}
    with tqdm(total=2 * trials, disable=not progress, desc=f"audit {experiment.name}", unit="trial") as bar:
        for index, size in enumerate(chunks):
            for on_d in (True, False):
                # Distinct seeds for every (chunk, neighbour): the two samples are independent.
                chunk_seed = (seed * 1_000_003 + 2 * index + int(on_d)) % 2**62
                values = np.asarray(experiment.scores(size, on_d, chunk_seed), dtype=np.float64).ravel()
                if values.shape != (size,):
                    raise ValidationError("scores", f"{experiment.name} returned {values.shape} scores for {size} trials")
                scores[on_d].append(values)
                bar.update(size)
    bound = epsilon_lower_bound(
        np.concatenate(scores[True]), np.concatenate(scores[False]), experiment.delta, confidence
    )
    return AuditResult(
        name=experiment.name,
        claimed_epsilon=float(experiment.claimed_epsilon),
        bound=bound,
        privacy_unit=experiment.privacy_unit,
        analysis=experiment.analysis,
        neighbours=experiment.neighbours,
        references=dict(experiment.references),
        settings=dict(experiment.settings),
        seconds=time.perf_counter() - start,
    )
