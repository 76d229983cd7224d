"""End-to-end neighbour audit: the real pipeline on a FIXED add/remove (or replace-one, reward-level) pair, scored on
everything it releases.

1. Deterministic diff. Both sides run with the same noise seed; every released field that differs is looked up in
   the registry of accounted outputs (``dporl.audit.accounted``). An unaccounted difference is a distinguisher no
   accounted mechanism covers: the audit reports eps_lb = inf and names the field (the printed guarantee does not
   hold for this release).
2. Statistical bounds on the accounted scalar fields. Each side runs ``trials`` more times with fresh independent
   noise seeds (one run of the whole pipeline per trial); for each accounted numeric field that differed in step 1
   (at most ``max_fields``, the first ones found) the trials' values are the scores of a threshold test and
   ``dporl.audit.bounds.epsilon_lower_bound`` certifies a lower bound (Clopper-Pearson on held-out trials;
   Bonferroni over the fields, so the largest bound holds with the stated confidence). It is compared with the
   guarantee the run printed. With N trials per side no bound exceeds about log(N / 8): this part finds gross
   failures of an accounted mechanism, the diff finds everything unaccounted.

The power variant (``leak=True``): the same pipeline with one more printed line, the exact number of units it
read; the audit must name that line.
"""

from __future__ import annotations

import math
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from dporl.audit.accounted import ENTRIES, Accounted, Classified, classify
from dporl.audit.bounds import EpsilonLowerBound, epsilon_lower_bound
from dporl.audit.neighbour_runs import SIDES, NeighbourPair, SideRun, prepare, run_side
from dporl.audit.release_snapshot import MISSING, Difference, Snapshot, compare
from dporl.utils.validation import ValidationError


def pipeline_keys(config: dict[str, Any]) -> tuple[str, ...]:
    """The registry keys ("pipeline/method") of a pipeline config."""
    pipeline = config.get("pipeline")
    if pipeline == "train":
        keys = (f"train/{config.get('method', 'mixed')}",)
        evaluation = config.get("eval") or {}
        if (config.get("data") or {}).get("format", "npz") != "npz" or evaluation.get("enabled") is False:
            # No simulator (or none used): the learned policy is evaluated privately on logged data.
            estimator = (evaluation.get("offline") or {}).get("estimator") or "auto"
            keys += (f"offline/{'fqe' if estimator == 'auto' else estimator}",)
        return keys
    if pipeline == "fnq":
        return tuple(f"fnq/{method}" for method in config.get("methods", ["fnq"]))
    if pipeline == "ope":
        return ("ope/gpope",)
    raise ValidationError("pipeline", f"no registry keys for pipeline {pipeline!r}")


@dataclass
class PairCheck:
    """Both sides of a pair at one noise seed, their differences and which of them the registry accounts for."""

    pair: NeighbourPair
    sides: dict[str, SideRun]
    differences: list[Difference]
    classified: Classified

    @property
    def unaccounted(self) -> list[Difference]:
        return self.classified.unaccounted

    def describe(self, limit: int = 40) -> str:
        return self.classified.describe(limit)


def check_pair(pair: NeighbourPair, base: str | Path, noise_seed: int = 0, *, entries: Iterable[Accounted] = ENTRIES,
               dirs: Optional[dict[str, Path]] = None, run_dir: str = "run", leak: bool = False) -> PairCheck:
    """Run both sides of ``pair`` with ``noise_seed`` and classify every released difference."""
    dirs = dirs or prepare(pair, base)
    sides = {side: _run(pair, dirs[side], side, noise_seed, run_dir, leak) for side in SIDES}
    snap_d, snap_dp = sides["D"].snapshot, sides["D'"].snapshot
    differences = compare(snap_d, snap_dp)
    return PairCheck(pair, sides, differences, classify(differences, pair_keys(pair), snap_d, snap_dp, entries))


def pair_keys(pair: NeighbourPair) -> tuple[str, ...]:
    """The registry keys of a pair's runs (the Python API runs the train pipeline with method dp_sgd)."""
    if pair.via == "api":
        estimator = (pair.api.get("evaluation") or {}).get("estimator", "auto")
        return ("train/dp_sgd", f"offline/{'fqe' if estimator == 'auto' else estimator}")
    return pipeline_keys(pair.config)


def _run(pair: NeighbourPair, directory: Path, side: str, noise_seed: int, run_dir: str, leak: bool) -> SideRun:
    result = run_side(pair, directory, side, noise_seed, run_dir)
    if leak:  # the power variant: the run also prints the exact number of units it read
        lines = result.snapshot["stdout"]["lines"]
        result.snapshot["stdout"]["lines"] = [*lines, f"units in the data: {exact_units(pair, directory)}"]
    return result


def exact_units(pair: NeighbourPair, directory: Path) -> int:
    """The number of units in a side's prepared data (what the power variant leaks)."""
    from dporl.audit.neighbour_runs import DATA_DIR, table_columns

    data = pair.config.get("data") or {}
    if pair.pipeline != "train":
        raise ValidationError("leak", "the power variant is built for train configs")
    if data.get("format") == "table" or pair.via == "api":
        import pandas as pd

        frame = pd.read_csv(directory / DATA_DIR / "table.csv")
        return int(frame[table_columns(data)["unit"]].nunique())
    from dporl.data.dataset import TrajectoryDataset

    return TrajectoryDataset.load(directory / DATA_DIR / "data.npz").n_units


# ---------------------------------------------------------------------------------------------------- audit
@dataclass
class FieldBound:
    location: str
    field: str
    bound: EpsilonLowerBound

    def to_dict(self) -> dict[str, Any]:
        return {"location": self.location, "field": self.field, "epsilon_lower_bound": self.bound.epsilon,
                "test": self.bound.to_dict()["test"], "held_out_rates": {
                    "first_lower": self.bound.first_rate_lower, "second_upper": self.bound.second_rate_upper}}


@dataclass
class NeighbourAuditResult:
    name: str
    keys: tuple[str, ...]
    relation: str
    claimed_epsilon: float
    delta: float
    unaccounted: list[Difference]
    accounted: list[tuple[Difference, Accounted]]
    bounds: list[FieldBound]
    trials: int
    confidence: float
    seconds: float
    outcomes: dict[str, str] = field(default_factory=dict)

    @property
    def epsilon_lower_bound(self) -> float:
        if self.unaccounted:
            return math.inf
        return max((b.bound.epsilon for b in self.bounds), default=0.0)

    @property
    def violated(self) -> bool:
        return self.epsilon_lower_bound > self.claimed_epsilon

    def describe(self, limit: int = 20) -> str:
        verdict = "VIOLATED" if self.violated else "consistent"
        lines = [f"{self.name}: eps_lb = {self.epsilon_lower_bound:.3f} vs claimed eps = {self.claimed_epsilon:.4g} "
                 f"at delta = {self.delta:g}: {verdict}",
                 f"  neighbours: {self.relation}; registry keys: {', '.join(self.keys)}; outcomes: {self.outcomes}"]
        if self.unaccounted:
            lines.append(f"  {len(self.unaccounted)} released field(s) differ at a fixed noise seed and no accounted "
                         "mechanism lists them (each a distinguisher: eps_lb = inf):")
            lines += [f"    {d.describe(60)}" for d in self.unaccounted[:limit]]
            if len(self.unaccounted) > limit:
                lines.append(f"    ... and {len(self.unaccounted) - limit} more")
        lines.append(f"  {len(self.accounted)} differing field(s) accounted for by the registry")
        if self.bounds:
            lines.append(f"  accounted scalar fields, {self.trials} trials per neighbour with fresh noise seeds "
                         f"({self.confidence:.0%} confidence over all fields):")
            lines += [f"    eps_lb = {b.bound.epsilon:.3f}  {b.location} :: {b.field}" for b in self.bounds]
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "audit": self.name, "keys": list(self.keys), "neighbours": self.relation,
            "claimed_epsilon": self.claimed_epsilon, "delta": self.delta,
            "epsilon_lower_bound": self.epsilon_lower_bound, "violated": self.violated,
            "unaccounted": [d.to_dict() for d in self.unaccounted],
            "accounted": [{**d.to_dict(), "mechanism": e.mechanism} for d, e in self.accounted],
            "field_bounds": [b.to_dict() for b in self.bounds], "trials_per_neighbour": self.trials,
            "confidence": self.confidence, "outcomes": self.outcomes, "seconds": self.seconds,
        }


def relation_text(pair: NeighbourPair) -> str:
    if pair.relation == "remove":
        return f"D' = D minus unit {pair.unit_key if pair.unit_key is not None else pair.unit} with all its data"
    if pair.relation == "replace":
        return f"D' = D with unit {pair.unit}'s data replaced by a copy of unit {pair.donor}'s"
    if pair.pipeline == "fnq" and pair.config.get("dataset") is None:
        return f"D' = the environment's rewards shifted by {pair.change:g} on every transition"
    return f"D' = D with reward {pair.unit} changed by {pair.change:g}"


def claimed_guarantee(snap: Snapshot) -> tuple[float, float]:
    """(epsilon, delta) of the release's printed guarantee: the largest over its privacy reports (inf: none)."""
    epsilons, deltas = [], []
    for location, fields in snap.items():
        if location.endswith("privacy_report.json"):
            epsilon = fields.get("guarantee.epsilon")
            epsilons.append(float(epsilon) if isinstance(epsilon, (int, float)) else math.inf)
            deltas.append(float(fields.get("guarantee.delta") or 0.0))
    if not epsilons:
        return math.inf, 0.0
    return max(epsilons), max(deltas)


EVENTS_SLOT = "/events["


def _scalar(value: Any) -> Optional[float]:
    """A field value as a score (numbers; NaN as +inf, a distinct outcome), or None if not a scalar number."""
    if isinstance(value, bool) or value is MISSING:
        return None
    if isinstance(value, (int, float, np.integer, np.floating)):
        value = float(value)
        return math.inf if math.isnan(value) else value
    if isinstance(value, np.ndarray) and value.size == 1 and value.dtype.kind in "iuf":
        return _scalar(value.item())
    return None


def scored_fields(accounted: Sequence[tuple[Difference, Accounted]], limit: int) -> list[tuple[str, str]]:
    """Up to ``limit`` accounted (location, field) pairs whose two values are numbers, one per pair of values, from
    the released files (TensorBoard's scalars repeat them in float32) and one per field name across files."""
    chosen, seen, names = [], set(), set()
    for difference, _ in accounted:
        if EVENTS_SLOT in difference.location or difference.field in names:
            continue
        a, b = _scalar(difference.value_d), _scalar(difference.value_dp)
        if a is None or b is None or (a, b) in seen:
            continue
        seen.add((a, b))
        names.add(difference.field)
        chosen.append((difference.location, difference.field))
        if len(chosen) == limit:
            break
    return chosen


def audit_pair(
    pair: NeighbourPair,
    base: str | Path,
    *,
    trials: int = 20,
    seed: int = 0,
    confidence: float = 0.95,
    max_fields: int = 8,
    entries: Iterable[Accounted] = ENTRIES,
    leak: bool = False,
    name: Optional[str] = None,
    progress: bool = False,
) -> NeighbourAuditResult:
    """The end-to-end audit of ``pair`` (module docstring); inputs and runs under ``base`` (trial runs removed)."""
    from tqdm.auto import tqdm

    if trials != 0 and trials < 4:
        raise ValidationError("trials", f"need 0 (the diff only) or at least 4 trials per neighbour, got {trials}")
    started = time.perf_counter()
    entries = tuple(entries)
    base = Path(base)
    dirs = prepare(pair, base)
    check = check_pair(pair, base, seed, entries=entries, dirs=dirs, run_dir="fixed", leak=leak)
    snap_d = check.sides["D"].snapshot
    claimed, delta = claimed_guarantee(snap_d)
    outcomes = {side: run.snapshot["outcome"]["status"] for side, run in check.sides.items()}
    fields = scored_fields(check.classified.accounted, max_fields) if trials else []
    bounds: list[FieldBound] = []
    if fields:
        scores: dict[str, list[list[float]]] = {side: [[] for _ in fields] for side in SIDES}
        rng = np.random.default_rng(seed)
        with tqdm(total=2 * trials, disable=not progress, desc=f"neighbour audit {name or ''}", unit="run") as bar:
            for trial in range(trials):
                for side in SIDES:
                    noise_seed = int(rng.integers(2**62))  # fresh and independent for every run
                    run_dir = f"trial{trial}"
                    snap = _run(pair, dirs[side], side, noise_seed, run_dir, leak).snapshot
                    for k, (location, name_) in enumerate(fields):
                        value = _scalar(snap.get(location, {}).get(name_, MISSING))
                        scores[side][k].append(-math.inf if value is None else value)
                    shutil.rmtree(dirs[side] / run_dir, ignore_errors=True)
                    bar.update(1)
        per_field = 1.0 - (1.0 - confidence) / len(fields)  # Bonferroni: all bounds hold together
        for k, (location, name_) in enumerate(fields):
            bound = epsilon_lower_bound(np.array(scores["D"][k]), np.array(scores["D'"][k]),
                                        delta if delta > 0 else 1e-12, per_field)
            bounds.append(FieldBound(location, name_, bound))
    return NeighbourAuditResult(
        name=name or f"neighbours {pair.pipeline}", keys=pair_keys(pair), relation=relation_text(pair),
        claimed_epsilon=claimed, delta=delta, unaccounted=check.unaccounted, accounted=check.classified.accounted,
        bounds=bounds, trials=trials if fields else 0, confidence=confidence,
        seconds=time.perf_counter() - started, outcomes=outcomes,
    )

