"""The methods of the ``train`` pipeline: how a policy is trained privately over units (Sharma et al. 2024,
"Private and robust offline RL with expert-level privacy", Algorithms 1-4, over any privacy unit).

==============  ============================================================================================
``non_private`` the algorithm on all logged transitions, no noise (the upper bound; NO guarantee)
``dp_sgd``      DP-SGD over units (Algorithm 4): Poisson over the m units at rate q = B / m, ``rows_per_unit``
                transitions per sampled unit averaged into one clipped per-unit gradient, Gaussian noise; the
                whole budget; needs neither the experts nor a simulator (unit-level DP-SGD over any unit column)
``stable_only`` the stable-prefix release (Algorithms 1-2) with the whole budget, then noiseless training on
                D_stable; needs the experts that logged the data and a public simulator
``mixed``       Algorithm 3: the release with (f eps, delta / 2), then each step is, with probability p_dp, a
                DP-SGD step over units on the logged data, else a noiseless step on D_stable (delta / 2)
==============  ============================================================================================

Each is a ``UnitLevelMethod``: its stages and their budgets (``stage_budgets``), its batch source (``source``), what
it needs (``release``: the expert set and a simulator), whether its training stage may take what the earlier
stages leave of the run budget (``shares_run_budget``), whether a run without a simulator evaluates it privately
on logged data, and its label. ``METHODS`` maps each name (the one spelling) to its method; ``unit_level_method``
looks a name up with a named error for any other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from dporl.algos.expert_sources import expert_source, stable_source
from dporl.algos.stable_prefix import RELEASE_STAGE
from dporl.data.dataset import TrajectoryDataset
from dporl.methods.base import method_named
from dporl.privacy.count import LOWER_BOUND_FAILURE, Units
from dporl.privacy.samplers import MixtureSource
from dporl.utils.validation import ValidationError

TRAIN_STAGE = "train"
Budget = tuple[float, float]


@dataclass(frozen=True)
class UnitLevelMethod:
    """One method of the ``train`` pipeline (module docstring)."""

    name: str
    label: str
    private: bool  # False: no guarantee (the non-private baseline)
    release: bool  # runs the stable-prefix release: needs the experts that logged the data and a public simulator
    private_training: bool  # a DP-SGD training stage over the units
    trains_on: str  # "logged" (all logged transitions), "stable" (D_stable) or "mixture" (Algorithm 3)

    def stage_budgets(self, epsilon: float, delta: float, release_fraction: float) -> dict[str, Budget]:
        """(epsilon, delta) of each private stage, from what the run may spend after its count."""
        if not self.private:
            return {}
        if self.release and self.private_training:  # Algorithm 3: the paper's split, delta halved between stages
            eps1 = release_fraction * epsilon
            return {RELEASE_STAGE: (eps1, delta / 2), TRAIN_STAGE: (epsilon - eps1, delta / 2)}
        return {RELEASE_STAGE if self.release else TRAIN_STAGE: (epsilon, delta)}

    def count_budget(self, epsilon: float, delta: float, count_fraction: float) -> Optional[Budget]:
        """(epsilon, delta) of the private count of the units under add/remove neighbours (None for a run without
        a guarantee). Its delta is the charged failure of the lower bound the stable-prefix precondition is checked
        on: 0 without a release."""
        if not self.private:
            return None
        failure = LOWER_BOUND_FAILURE * delta if self.release else 0.0
        return count_fraction * epsilon, 2 * failure

    def shares_run_budget(self, fresh_release: bool, counted: bool) -> bool:
        """Whether the training stage takes what the earlier stages (a fresh release, a count) leave of the run
        budget under the run's joint PLD instead of a fixed share (the pipeline adds its own conditions: no
        private evaluation after it, no cells)."""
        return self.private_training and ((self.release and fresh_release) or counted)

    @property
    def evaluates_offline(self) -> bool:
        """Whether a run without a simulator evaluates the policy privately on logged data (the release methods
        evaluate only in their simulator)."""
        return not self.release

    def source(self, logged: TrajectoryDataset, stable: Optional[TrajectoryDataset], *, batch_size: float,
               units: Optional[Units] = None, cell: Optional[str] = None, rows_per_unit: int = 1,
               p_dp: float = 0.5, keys: Sequence[str]) -> Any:
        """The batch source this method trains on, carrying the columns ``keys`` (the algorithm's batch keys).
        The private ones sample at rate ``batch_size`` / ``units.of(cell)`` (``units`` required for them)."""
        if self.trains_on == "logged" and not self.private_training:
            return stable_source(logged, batch_size, "the dataset", keys)
        if self.trains_on in ("stable", "mixture") and stable is None:
            raise ValidationError("method", f"{self.name} trains on D_stable: run the release first")
        if self.trains_on == "stable":
            return stable_source(stable, batch_size, keys=keys)
        if units is None:
            raise ValidationError("units", f"{self.name} samples at rate B / m: give the number of units it may use")
        private = expert_source(logged, batch_size, rows_per_unit, units, cell, keys)
        if self.trains_on == "mixture":
            return MixtureSource(p_dp, private, stable_source(stable, batch_size, keys=keys))
        return private

    def step_source(self, private: Any, p_dp: float) -> Any:
        """A source with this method's per-step event over the private source ``private`` (the noiseless branch
        of a mixture is event-free): what the calibration and the audits analyse."""
        return MixtureSource(p_dp, private, None) if self.trains_on == "mixture" else private


NON_PRIVATE = UnitLevelMethod("non_private", "non-private (no guarantee)", private=False, release=False,
                              private_training=False, trains_on="logged")
DP_SGD = UnitLevelMethod("dp_sgd", "DP-SGD over units (Algorithm 4)", private=True, release=False,
                         private_training=True, trains_on="logged")
STABLE_ONLY = UnitLevelMethod("stable_only", "stable-prefix release, then noiseless training (Algorithms 1-2)",
                              private=True, release=True, private_training=False, trains_on="stable")
MIXED = UnitLevelMethod("mixed", "release + mixed DP-SGD / stable steps (Algorithm 3)", private=True, release=True,
                        private_training=True, trains_on="mixture")
METHODS: dict[str, UnitLevelMethod] = {m.name: m for m in (NON_PRIVATE, DP_SGD, STABLE_ONLY, MIXED)}


def unit_level_method(name: Any, field: str = "method") -> UnitLevelMethod:
    """The method ``name`` of the ``train`` pipeline, or a ValidationError naming ``field`` (``method_named``)."""
    return method_named(METHODS, name, field, "train pipeline")
