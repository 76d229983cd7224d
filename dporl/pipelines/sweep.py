"""Pipeline "sweep": a "train" config over budgets x methods x seeds -> a table (CSV + markdown) and a PNG of return
vs eps.

    dporl sweep --config configs/sweep_cartpole.yaml [key=value ...]     (or dporl train --config ...)
    dporl sweep --config configs/sweep_cartpole.yaml --from-runs A/runs.csv

Every run is an ordinary "train" run in ``out_dir/<method>/eps_<eps>/seed_<seed>``. An existing run directory is
resumed only if its provenance (config and input hashes) equals the run's: a finished one is read back, not
repeated, an interrupted one continues, and one of another configuration is recorded as an error (never reused). ``non_private`` ignores the budget, so it runs once
per seed and appears as a flat line. A run refused by its configuration (e.g. a release that no threshold makes
private at a small eps, the paper's reason to fall back to DP-SGD there) is recorded with its reason, not retried.
Each cell of the table is the mean over seeds of the run's ``metric`` (``return``: ``return_mean_last_evals``, the
returns in the simulator; ``offline_value``: the policy value the run's private offline evaluation released, for
data without a simulator) with a Student-t interval
(``dporl.eval.returns.confidence_interval``) and the largest guaranteed epsilon among its seeds.

``--from-runs A/runs.csv --from-runs B/runs.csv`` runs nothing: it tabulates and plots the rows of earlier sweeps' ``runs.csv``
into ``out_dir``, a later file's row replacing an earlier one of the same (method, eps, seed) (e.g. one method re-run
on a newer main), keeping only the config's methods and budgets.
"""

from __future__ import annotations

import argparse
import csv
import io
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

from dporl.eval.returns import confidence_interval
from dporl.logging import plot_lines
from dporl.methods.unit_level import METHODS, unit_level_method
from dporl.pipelines import Pipeline, read_config, run_cli
from dporl.pipelines.train import PIPELINE_NAME as TRAIN, TrainPipelineConfig, generate_dataset
from dporl.pipelines.train import run as run_train
from dporl.train.run_dir import RunMode
from dporl.utils.config import apply_overrides, from_dict, load_yaml
from dporl.utils.io import atomic_write_csv, atomic_write_text
from dporl.utils.validation import ValidationError

NAME = "sweep"


@dataclass
class EpsilonOverrides:
    epsilon: float
    overrides: list[str] = field(default_factory=list)  # dotted key=value, e.g. release.trajectories=25


@dataclass
class SweepConfig:
    pipeline: str = NAME
    base: str = "configs/expert_cql_cartpole.yaml"  # a "train" config; in a sweep file, relative to the file
    overrides: list[str] = field(default_factory=list)  # applied to the base config of every run
    epsilons: list[float] = field(default_factory=lambda: [10.0, 7.5, 5.0, 2.0, 1.0])
    methods: list[str] = field(default_factory=lambda: list(METHODS))  # dporl.methods.unit_level
    seeds: list[int] = field(default_factory=lambda: [0, 1, 2])
    method_overrides: dict[str, list[str]] = field(default_factory=dict)
    epsilon_overrides: list[EpsilonOverrides] = field(default_factory=list)
    out_dir: str = "runs/sweep_cartpole"
    threads: int = 1  # torch threads per run (runs are sequential)
    metric: Literal["return", "offline_value"] = "return"  # what the "return" column of a row holds (module doc)
    progress: bool = True

    def __post_init__(self) -> None:
        if self.pipeline != NAME:
            raise ValidationError("pipeline", f"expected {NAME!r}, got {self.pipeline!r}")
        for name in ("epsilons", "methods", "seeds"):
            if not getattr(self, name):
                raise ValidationError(name, "must not be empty")
        if any(e <= 0 for e in self.epsilons):
            raise ValidationError("epsilons", f"must be > 0, got {self.epsilons}")
        for i, method in enumerate(self.methods):
            unit_level_method(method, f"methods[{i}]")
        for method in self.method_overrides:
            unit_level_method(method, f"method_overrides.{method}")
        if self.threads < 1:
            raise ValidationError("threads", f"must be >= 1, got {self.threads}")


def run_configs(config: SweepConfig, data: dict[str, Any]
                ) -> list[tuple[str, Optional[float], int, TrainPipelineConfig]]:
    """(method, epsilon or None for non_private, seed, run config) for every run of the sweep.

    ``data``: the base config with ``config.overrides`` already applied (and its generation, if any, already
    replaced by the generated files): they are not applied again, so an override of ``data.generate.*`` shapes the
    one generation instead of bringing the generate block back beside the generated dataset.
    """
    by_eps = {entry.epsilon: entry.overrides for entry in config.epsilon_overrides}
    runs = []
    for method in config.methods:
        budgets: list[Optional[float]] = list(config.epsilons) if METHODS[method].private else [None]
        for eps in budgets:
            for seed in config.seeds:
                name = f"{method}/{'all' if eps is None else f'eps_{eps:g}'}/seed_{seed}"
                overrides = [
                    *config.method_overrides.get(method, []),
                    *(by_eps.get(eps, []) if eps is not None else []),
                    f"method={method}",
                    f"trainer.seed={seed}",
                    f"run_dir={Path(config.out_dir) / name}",
                    "trainer.progress=false",
                ]
                if eps is not None:
                    overrides.append(f"epsilon={eps}")
                runs.append((method, eps, seed, from_dict(TrainPipelineConfig, apply_overrides(data, overrides))))
    return runs


def _generate_once(config: SweepConfig, data: dict[str, Any]) -> dict[str, Any]:
    """Run the base config's dataset generation once and point every run at its outputs."""
    generate = (data.get("data") or {}).get("generate")
    if generate is None:
        return data
    dataset_path, expert_path = generate_dataset(generate)
    return {**data, "data": {"dataset": dataset_path, "expert_set": expert_path}}


def run(config: SweepConfig, mode: RunMode = "new") -> dict:
    """Every run of the sweep (``mode`` "new" or "resume": a run directory of the same provenance is read back or
    continued; "overwrite": every run is replaced), then the table and the plot."""
    import torch
    from tqdm.auto import tqdm

    torch.set_num_threads(config.threads)
    data = apply_overrides(load_yaml(config.base), config.overrides)
    if data.get("pipeline", TRAIN) != TRAIN:
        raise ValidationError("base", f"{config.base} is not a {TRAIN!r} config")
    runs = run_configs(config, _generate_once(config, data))
    rows = []
    for method, eps, seed, run_config in tqdm(runs, desc="sweep", unit="run", disable=not config.progress):
        rows.append(_run_one(method, eps, seed, run_config, overwrite=mode == "overwrite", metric=config.metric))
    return _report(rows, config)


def _report(rows: list[dict[str, Any]], config: SweepConfig) -> dict:
    out_dir = Path(config.out_dir)
    table = summarise(rows, config)
    _write_outputs(out_dir, rows, table, config)
    return {"runs": len(rows), "failed": sum(r["error"] is not None for r in rows), "table": table,
            "outputs": [str(out_dir / name) for name in ("runs.csv", "results.md", "return_vs_epsilon.png")]}


_METRIC_LABELS = {"return": "return", "offline_value": "released policy value"}
_MAX_RUNS_CSV_BYTES = 64 << 20
_CSV_FIELDS = ("method", "epsilon", "seed", "return", "final_return", "guarantee_epsilon", "guarantee_delta", "steps",
               "stable_transitions", "error")


def read_runs(paths: list[str | Path], config: SweepConfig) -> list[dict[str, Any]]:
    """The rows of earlier sweeps' ``runs.csv`` files (as ``_write_outputs`` wrote them) for ``config``'s grid; a later
    file's (method, epsilon, seed) row replaces an earlier file's."""
    merged: dict[tuple, dict[str, Any]] = {}
    for path in paths:
        try:
            if Path(path).stat().st_size > _MAX_RUNS_CSV_BYTES:
                raise ValidationError("from_runs", f"{path} is larger than a sweep's runs.csv can be")
            text = Path(path).read_text()
            reader = csv.DictReader(io.StringIO(text))
            fieldnames, rows = reader.fieldnames, list(reader)
        except (OSError, UnicodeDecodeError, csv.Error) as exc:  # csv.Error: e.g. a cell over the field limit
            raise ValidationError("from_runs", f"cannot read {path}: {exc}") from None
        missing = sorted(set(_CSV_FIELDS) - set(fieldnames or ()))
        if missing:
            raise ValidationError("from_runs", f"{path} is not a sweep runs.csv (missing columns {missing})")
        for line, raw in enumerate(rows, start=2):
            try:
                row = _parse_row(raw)
            except ValueError as exc:
                raise ValidationError("from_runs", f"{path}:{line}: {exc}") from None
            if row["method"] not in config.methods:
                continue
            if row["epsilon"] is not None and row["epsilon"] not in config.epsilons:
                continue
            if row["seed"] in config.seeds:
                merged[(row["method"], row["epsilon"], row["seed"])] = row
    if not merged:
        raise ValidationError("from_runs", f"no row of {[str(p) for p in paths]} is in the sweep's grid")
    return list(merged.values())


def _parse_row(raw: dict[str, str]) -> dict[str, Any]:
    if raw["method"] not in METHODS:
        raise ValueError(f"unknown method {raw['method']!r} (known: {list(METHODS)})")
    epsilon = None if raw["epsilon"] == "" else float(raw["epsilon"])
    if (epsilon is None) != (not METHODS[raw["method"]].private):
        raise ValueError(f"method {raw['method']!r} with epsilon {raw['epsilon']!r}")
    return {
        "method": raw["method"], "epsilon": epsilon, "seed": int(raw["seed"]),
        **{name: float(raw[name]) for name in ("return", "final_return", "guarantee_epsilon", "guarantee_delta")},
        "steps": int(raw["steps"]),
        "stable_transitions": None if raw["stable_transitions"] == "" else int(raw["stable_transitions"]),
        "error": raw["error"] or None,
    }


def tabulate(config: SweepConfig, paths: list[str | Path]) -> dict:
    """The table, CSV and PNG of ``run`` from earlier sweeps' ``runs.csv`` files, running nothing."""
    return _report(read_runs(paths, config), config)


def _run_one(method: str, eps: Optional[float], seed: int, run_config: TrainPipelineConfig,
             overwrite: bool = False, metric: str = "return") -> dict[str, Any]:
    row = {"method": method, "epsilon": eps, "seed": seed, "return": math.nan, "final_return": math.nan,
           "guarantee_epsilon": math.nan, "guarantee_delta": math.nan, "steps": 0, "stable_transitions": None,
           "error": None}
    try:
        mode = "overwrite" if overwrite else "resume" if Path(run_config.run_dir).exists() else "new"
        summary = run_train(run_config, mode=mode)
    except ValidationError as exc:  # includes PrivacyBudgetError: the configuration admits no private run
        row["error"] = str(exc)
        return row
    guarantee = summary["privacy"]["guarantee"] or {}
    if metric == "offline_value":  # released by the run's private evaluation (NaN when it released none)
        value = summary["evaluation"].get("value", math.nan)
        value = math.nan if value is None else float(value)
        measured = {"return": value, "final_return": value}
    else:
        measured = {"return": summary["return_mean_last_evals"],  # null in a summary read back: none measured
                    "final_return": summary["final_metrics"].get("eval/return_mean", math.nan)}
        measured = {key: math.nan if value is None else value for key, value in measured.items()}
    row.update(
        {
            **measured,
            "guarantee_epsilon": guarantee.get("epsilon", math.nan),
            "guarantee_delta": guarantee.get("delta", math.nan),
            "steps": summary["steps"],
            "stable_transitions": summary["stable_transitions"],
        }
    )
    return row


def summarise(rows: list[dict[str, Any]], config: SweepConfig) -> list[dict[str, Any]]:
    """One entry per (method, epsilon): mean return over successful seeds with a t interval."""
    table = []
    for method in config.methods:
        for eps in config.epsilons:
            cell = [r for r in rows if r["method"] == method and (r["epsilon"] == eps or r["epsilon"] is None)]
            ok = [r for r in cell if r["error"] is None and math.isfinite(r["return"])]
            entry = {"method": method, "epsilon": eps, "seeds": len(ok), "return_mean": math.nan,
                     "ci_low": math.nan, "ci_high": math.nan, "guarantee_epsilon": math.nan,
                     "note": next((r["error"] for r in cell if r["error"]), "")}
            if ok:
                stats = confidence_interval([r["return"] for r in ok])
                entry.update({"return_mean": stats.mean, "ci_low": stats.ci_low, "ci_high": stats.ci_high,
                              "guarantee_epsilon": max(r["guarantee_epsilon"] for r in ok)})
            table.append(entry)
    return table


def _write_outputs(out_dir: Path, rows: list[dict], table: list[dict], config: SweepConfig) -> None:
    atomic_write_csv(out_dir / "runs.csv", _CSV_FIELDS, rows)
    lines = [
        f"| method | eps (budget) | {_METRIC_LABELS[config.metric]} (mean over seeds) | 95% CI | guaranteed eps (max "
        "over seeds) | seeds | note |",
        "|---|---|---|---|---|---|---|",
    ]
    for e in table:
        if e["method"] == "non_private" and e["epsilon"] != config.epsilons[0]:
            continue  # one row: the same runs fill every epsilon column of the plot
        budget = "none" if e["method"] == "non_private" else f"{e['epsilon']:g}"
        guaranteed = "no guarantee" if e["method"] == "non_private" else f"{e['guarantee_epsilon']:.3g}"
        lines.append(
            f"| {e['method']} | {budget} | {e['return_mean']:.1f} | [{e['ci_low']:.1f}, {e['ci_high']:.1f}] | "
            f"{guaranteed} | {e['seeds']} | {e['note'][:80]} |"
        )
    atomic_write_text(out_dir / "results.md", "\n".join(lines) + "\n")
    series = {}
    for method in config.methods:
        cells = [e for e in table if e["method"] == method and e["seeds"] > 0]
        if cells:
            label = "non-private (no guarantee)" if method == "non_private" else method
            series[label] = ([e["epsilon"] for e in cells], [e["return_mean"] for e in cells],
                             [(e["ci_high"] - e["ci_low"]) / 2 for e in cells])
    if series:
        plot_lines(out_dir / "return_vs_epsilon.png", series, xlabel="expert-level epsilon (total budget)",
                   ylabel=_METRIC_LABELS[config.metric], title="private training over units", logx=True)


PIPELINE = Pipeline(NAME, SweepConfig, run, file_keys=("base",))


def main(argv: list[str] | None = None, prog: Optional[str] = None) -> int:
    parser = argparse.ArgumentParser(prog=prog, description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--from-runs", action="append", metavar="RUNS_CSV",
                        help="tabulate and plot an earlier sweep's runs.csv instead of running (repeatable; later "
                             "files' rows replace earlier ones)")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args(argv)

    def work() -> dict:
        _, data = read_config(args.config, args.overrides, pipeline=NAME)
        config = from_dict(SweepConfig, data)
        return tabulate(config, args.from_runs) if args.from_runs else run(config)

    return run_cli(work)


if __name__ == "__main__":
    sys.exit(main())
