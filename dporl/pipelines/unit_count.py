"""The number of units a pipeline run may use: a private count paid once (add/remove), or the public count
(replace-one), and the checks that depend on it.

Under add/remove neighbours a run's first spend is the count stage (``dporl.privacy.count``): it is journaled like
every stage, and ``count_once`` releases it once per run directory: a resumed run reuses the value a completed
manifest holds, and an attempt that charged the count but never recorded its value is refused rather than drawn
again uncharged (the same rule as the stable-prefix release). Everything count-dependent (sampling rates, noise,
step counts, the stable-prefix precondition, DP-FQE's normalisers, refusals) is computed from the returned
``Units`` afterwards, and says so when it refuses.
"""

from __future__ import annotations

from typing import Any, Optional

from dporl.data.dataset import TrajectoryDataset
from dporl.privacy.count import COUNT_STAGE, CountPlan, ReleasedCount, Units, exact_counts, release_count
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.partition import UnitPartition
from dporl.privacy.randomness import SecretRoot
from dporl.privacy.units import dataset_unit
from dporl.train.run_dir import RunDirectory
from dporl.utils.validation import PrivacyBudgetError, ValidationError


def count_once(run: RunDirectory, ledger: PrivacyLedger, root: SecretRoot, plan: CountPlan,
               dataset: TrajectoryDataset, partition: Optional[UnitPartition]) -> ReleasedCount:
    """The run's released count of ``dataset``'s units (per cell of ``partition``), drawn and charged once."""
    manifest = run.completed(COUNT_STAGE)
    if manifest is not None:
        return ReleasedCount.from_dict(manifest.get("released"), plan)
    if COUNT_STAGE in ledger.stages and len(ledger.stages[COUNT_STAGE].accountant):
        raise PrivacyBudgetError(
            "count", f"an earlier attempt of this run charged the private count of the units (stage {COUNT_STAGE!r} "
            f"in {run.journal_path}) but did not record its value; drawing it again would not be charged. Start a "
            "new run_dir (or --overwrite: the interrupted attempt's spend is then not part of the new guarantee)"
        )
    exact = exact_counts(dataset.metadata.unit_key_strings(), partition)
    released = release_count(plan, exact, ledger=ledger, root=root, unit=dataset_unit(dataset))
    run.complete(COUNT_STAGE, {"released": released.to_dict()})
    return released


def public_units(dataset: TrajectoryDataset, partition: Optional[UnitPartition]) -> Units:
    """The exact counts, for a run whose relation makes them public (replace-one)."""
    return Units.public(exact_counts(dataset.metadata.unit_key_strings(), partition))


def check_delta_below_one_over_n(delta: float, units: Units) -> None:
    """Refuse delta >= 1/n by name: at that delta a mechanism may publish one unit's data outright."""
    n = units.total
    if n <= 0 or delta * n >= 1:
        raise ValidationError(
            "delta", f"delta={delta:g} is not below 1/n for n = {units.describe()}: a guarantee at such a delta "
            "allows releasing a whole unit's data; lower delta (well below 1/n)"
        )


def describe_count(released: ReleasedCount) -> str:
    """The line a run prints about its count (released values only)."""
    cells = "" if released.to_dict()["cells"] is None else " (" + ", ".join(
        f"{name}: {value}" for name, value in released.counts.items()) + ")"
    return (f"private count of the units (stage {COUNT_STAGE!r}, discrete Laplace at eps={released.epsilon:g}): "
            f"m~ = {released.total}{cells}")


def with_released_count(privacy: dict[str, Any], released: Optional[ReleasedCount]) -> dict[str, Any]:
    """The privacy report with the count's released value as its stage's ``released`` output."""
    if released is None:
        return privacy
    for stage in privacy.get("stages", []):
        if stage.get("name") == COUNT_STAGE:
            stage["released"] = released.to_dict()
    return privacy
