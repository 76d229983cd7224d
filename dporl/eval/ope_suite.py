"""The private OPE benchmark suite: coverage and error of every private estimator on problems with a known truth.

    python -m dporl.eval.ope_suite [--datasets 100] [--epsilons 0.1 1 10] [--problems chain digits cartpole stays]
                                   [--estimators wis wis-clip pdis fqe dr] [--out runs/ope_suite] [--quick]

For each problem (``dporl.eval.ope_suite_problems``) it draws ``--datasets`` independent logged datasets and runs
every estimator on each at every epsilon (delta 1e-5), each run in its own ledger with its own noise; a dataset is
simulated once and reused by every estimator and epsilon. Estimators, all with the problem's declared public facts:

- ``wis``: DP-WIS with the unit clip at its public maximum (sqrt 2 x episodes per unit x (1 / min propensity)^horizon:
  nothing clipped, no clip bias); refused before spending where the predicted noise exceeds the value range;
- ``wis-clip``, ``pdis``: DP-WIS / DP-PDIS with the problem's practical declared clip (a clip bias is possible);
- ``fqe``: DP-FQE with its defaults (3 folds; the problem's public observation scale);
- ``dr``: DP-DR (a DP-FQE model on half the units, the estimate on the other half, the practical clip).

The digits problem also reports the non-private IPW, SNIPW and DR beside them. Coverage is the share of 95%
intervals containing the truth, with its Clopper-Pearson 95% interval, over the datasets where the estimate was not
refused (a failed estimate reports the value range as its interval); bias and RMSE over finite estimates. Writes
``suite.json`` (every result), ``suite.md`` (the table) and ``suite.png`` (coverage and RMSE against epsilon) to
``--out``; ``--merge RUN [RUN ...]`` writes them for several runs' ``suite.json`` together (e.g. estimators run at
different numbers of datasets) without running anything. ``--quick`` runs the machinery on small problems (2
datasets, epsilon 1, short DP-FQE): a smoke test, not a coverage measurement.
"""

from __future__ import annotations

import argparse
import hashlib
import math
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from dporl.eval.ope_coverage import clopper_pearson

ESTIMATORS = ("wis", "wis-clip", "pdis", "fqe", "dr")
DELTA = 1e-5


def _seed(*parts: Any) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


def run_estimator(problem, dataset, name: str, epsilon: float, seed: int, training) -> dict[str, Any]:
    """One private estimate (value, interval, flags), or its refusal."""
    from dporl.eval.ope_dr import dp_doubly_robust
    from dporl.eval.ope_feasibility import InfeasibleEvaluation
    from dporl.eval.ope_fqe import dp_fqe
    from dporl.eval.ope_importance import dp_importance_sampling
    from dporl.privacy.ledger import PrivacyLedger
    from dporl.privacy.randomness import SecretRoot

    ledger, root = PrivacyLedger(), SecretRoot(seed)
    common = dict(epsilon=epsilon, delta=DELTA, ledger=ledger, root=root, **problem.declared)
    start = time.perf_counter()
    try:
        with tempfile.TemporaryDirectory() as tmp:
            if name in ("wis", "wis-clip", "pdis"):
                kind = "pdis" if name == "pdis" else "wis"
                result = dp_importance_sampling(dataset, problem.target, kind=kind, gamma=problem.gamma,
                                                unit_clip=None if name == "wis" else problem.clip,
                                                units=dataset.n_units, **common)
            elif name == "fqe":
                common.pop("min_propensity", None)
                result = dp_fqe(dataset, problem.target, gamma=problem.gamma, training=training, run_dir=tmp,
                                **common)
            elif name == "dr":
                result, _ = dp_doubly_robust(dataset, problem.target, gamma=problem.gamma, training=training,
                                             run_dir=tmp, unit_clip=problem.clip, **common)
            else:
                raise ValueError(f"unknown estimator {name!r}")
    except InfeasibleEvaluation as refusal:
        return {"refused": str(refusal), "seconds": time.perf_counter() - start}
    return {"value": result.value, "low": result.ci_low, "high": result.ci_high, "calibrated": result.calibrated,
            "status": result.status, "seconds": time.perf_counter() - start,
            "guarantee": ledger.report().guarantee[0]}


def summarise(rows: list[dict], truth: float) -> dict[str, Any]:
    """Coverage (Clopper-Pearson), bias, RMSE, width over one cell's results."""
    answered = [r for r in rows if "refused" not in r]
    finite = [r for r in answered if math.isfinite(r["value"])]
    covered = sum(r["low"] <= truth <= r["high"] for r in answered)
    out: dict[str, Any] = {"datasets": len(rows), "refused": len(rows) - len(answered),
                           "failed": len(answered) - len(finite), "covered": covered,
                           "calibrated": sorted({bool(r["calibrated"]) for r in answered}),
                           "seconds": float(np.mean([r["seconds"] for r in rows])) if rows else math.nan}
    if answered:
        out["coverage"] = covered / len(answered)
        out["coverage_ci95"] = list(clopper_pearson(covered, len(answered)))
        out["mean_width"] = float(np.mean([r["high"] - r["low"] for r in answered]))
    if finite:
        errors = np.array([r["value"] - truth for r in finite])
        out["bias"], out["rmse"] = float(errors.mean()), float(np.sqrt(np.mean(errors**2)))
    refusals = [r["refused"] for r in rows if "refused" in r]
    if refusals:
        out["refusal"] = refusals[0]
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from tqdm.auto import tqdm

    from dporl.algos.fqe import FQEConfig
    from dporl.eval.ope_fqe import FQETraining
    from dporl.eval.ope_suite_problems import problems as make_problems
    from dporl.utils.io import atomic_write_json

    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    suite = make_problems(args.problems, quick=args.quick, cache=Path(args.cache) if args.cache else out)
    summary: dict[str, Any] = {"settings": {k: v for k, v in vars(args).items()}, "problems": {}}
    start = time.perf_counter()
    for p_index, problem in enumerate(suite):
        base = FQETraining(steps=args.fqe_steps, fqe=FQEConfig(obs_scale=problem.obs_scale)) if args.fqe_steps else (
            FQETraining(fqe=FQEConfig(obs_scale=problem.obs_scale)))
        results = {f"{name}@{eps:g}": [] for name in args.estimators for eps in args.epsilons}
        baselines: dict[str, list[float]] = {}
        p_start = time.perf_counter()
        for i in tqdm(range(args.datasets), desc=problem.name, unit="dataset", disable=not args.progress):
            dataset = problem.sample(np.random.default_rng([args.seed, p_index, i]))
            if problem.baselines is not None:
                for key, value in problem.baselines(dataset).items():
                    baselines.setdefault(key, []).append(value)
            for e_index, eps in enumerate(args.epsilons):
                for name in args.estimators:
                    seed = _seed(args.seed, problem.name, i, e_index, name)
                    training = replace(base, seed=seed % 1000)
                    results[f"{name}@{eps:g}"].append(run_estimator(problem, dataset, name, eps, seed, training))
        cells = {key: summarise(rows, problem.truth) for key, rows in results.items()}
        baseline_stats = {key: {"bias": float(np.mean(v) - problem.truth),
                                "rmse": float(np.sqrt(np.mean((np.asarray(v) - problem.truth) ** 2)))}
                          for key, v in baselines.items()}
        summary["problems"][problem.name] = {
            "title": problem.title, "truth": problem.truth, "truth_stderr": problem.truth_stderr,
            "declared": {k: list(v) if isinstance(v, tuple) else v for k, v in problem.declared.items()},
            "clip": problem.clip, "obs_scale": problem.obs_scale, "notes": problem.notes, "cells": cells,
            "baselines": baseline_stats, "seconds": time.perf_counter() - p_start, "results": results,
        }
        atomic_write_json(out / "suite.json", summary)  # each problem as it finishes
    summary["seconds"] = time.perf_counter() - start
    atomic_write_json(out / "suite.json", summary)
    (out / "suite.md").write_text(table(summary))
    plot(summary, out / "suite.png")
    return summary


def merge(summaries: list[dict[str, Any]]) -> dict[str, Any]:
    """One summary from several runs' ``suite.json`` (e.g. estimators run at different numbers of datasets): every
    problem's cells and baselines together, a cell of a later run replacing an earlier one; cells ordered by
    estimator, then epsilon. The truths of one problem must agree."""
    merged: dict[str, Any] = {"settings": {"merged": [s.get("settings", {}) for s in summaries]}, "problems": {},
                              "seconds": sum(s.get("seconds", 0.0) for s in summaries)}
    for summary in summaries:
        for name, problem in summary["problems"].items():
            into = merged["problems"].setdefault(name, {**problem, "cells": {}, "baselines": {}, "results": {}})
            if into["truth"] != problem["truth"]:
                raise ValueError(f"problem {name!r}: the runs disagree on the truth ({into['truth']} vs "
                                 f"{problem['truth']}); merge runs of the same problem settings only")
            for key in ("cells", "baselines", "results"):
                into[key].update(problem.get(key, {}))

    def order(key: str) -> tuple[int, float]:
        estimator, eps = key.split("@")
        return (ESTIMATORS.index(estimator) if estimator in ESTIMATORS else len(ESTIMATORS), float(eps))

    for problem in merged["problems"].values():
        problem["cells"] = {key: problem["cells"][key] for key in sorted(problem["cells"], key=order)}
    return merged


def _cell_text(cell: dict[str, Any]) -> list[str]:
    if "coverage" not in cell:
        return ["refused", "-", "-", "-", "-"]
    low, high = cell["coverage_ci95"]
    flag = "/".join("True" if c else "False" for c in cell["calibrated"]) or "-"
    return [f"{cell['coverage']:.2f} [{low:.2f}, {high:.2f}]", flag,
            f"{cell['bias']:+.3g}" if "bias" in cell else "-", f"{cell['rmse']:.3g}" if "rmse" in cell else "-",
            f"{cell['mean_width']:.3g}"]


def table(summary: dict[str, Any]) -> str:
    """The suite's Markdown table: one row per problem, estimator and epsilon."""
    lines = ["| problem (truth) | estimator | eps | datasets (refused, failed) | coverage [95% CI] | calibrated | bias "
             "| RMSE | mean width |", "|---|---|---|---|---|---|---|---|---|"]
    for name, problem in summary["problems"].items():
        truth = f"{problem['truth']:.4g}" + (f" +- {problem['truth_stderr']:.2g}" if problem["truth_stderr"] else "")
        for key, cell in problem["cells"].items():
            estimator, eps = key.split("@")
            counts = f"{cell['datasets']} ({cell['refused']}, {cell['failed']})"
            lines.append(f"| {name} ({truth}) | DP-{estimator.upper()} | {eps} | {counts} | "
                         + " | ".join(_cell_text(cell)) + " |")
        for key, stats in problem["baselines"].items():
            lines.append(f"| {name} ({truth}) | {key.upper()} (non-private) | - | - | - | - | {stats['bias']:+.3g} | "
                         f"{stats['rmse']:.3g} | - |")
    return "\n".join(lines) + "\n"


def plot(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dporl.utils.io import atomic_write

    names = list(summary["problems"])
    fig, axes = plt.subplots(2, len(names), figsize=(3.8 * len(names), 6.6), squeeze=False, constrained_layout=True)
    for column, name in enumerate(names):
        problem = summary["problems"][name]
        by_estimator: dict[str, list] = {}
        for key, cell in problem["cells"].items():
            estimator, eps = key.split("@")
            by_estimator.setdefault(estimator, []).append((float(eps), cell))
        for estimator, points in by_estimator.items():
            offset = ESTIMATORS.index(estimator) if estimator in ESTIMATORS else 0
            style = dict(color=f"C{offset}", marker="o", ms=3, label=f"DP-{estimator.upper()}")
            points = [(e, c) for e, c in sorted(points, key=lambda x: x[0]) if "coverage" in c]
            if not points:
                continue
            eps = np.array([e for e, _ in points]) * (1.08 ** (offset - 2))  # side by side
            cov = np.array([c["coverage"] for _, c in points])
            ci = np.array([c["coverage_ci95"] for _, c in points])
            axes[0][column].errorbar(eps, cov, yerr=[cov - ci[:, 0], ci[:, 1] - cov], capsize=2, **style)
            rmse = [(e * (1.08 ** (offset - 2)), c["rmse"]) for e, c in points if "rmse" in c]
            if rmse:
                axes[1][column].plot(*zip(*rmse), **style)
        for key, stats in problem["baselines"].items():  # non-private, beside: one line each
            axes[1][column].axhline(stats["rmse"], ls=":", lw=1, color="grey")
            axes[1][column].annotate(f"{key.upper()} (non-private)", (0.02, stats["rmse"]),
                                     xycoords=("axes fraction", "data"), fontsize=6, color="grey", va="bottom")
        axes[0][column].axhline(0.95, color="k", lw=0.8, ls="--")
        axes[0][column].set_ylim(-0.02, 1.02)
        axes[0][column].set_xscale("log")
        axes[0][column].set_title(f"{name}: truth {problem['truth']:.4g}", fontsize=9)
        axes[1][column].set_xscale("log")
        axes[1][column].set_yscale("log")
        axes[1][column].set_xlabel("epsilon (per cell, delta 1e-5)")
    axes[0][0].set_ylabel("coverage of the 95% interval")
    axes[1][0].set_ylabel("RMSE")
    from matplotlib.lines import Line2D

    handles = [Line2D([], [], color=f"C{i}", marker="o", ms=3, label=f"DP-{name.upper()}")
               for i, name in enumerate(ESTIMATORS)]
    axes[0][0].legend(handles=handles, fontsize=6, loc="lower left")
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110), suffix=".png")
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", type=int, default=100)
    parser.add_argument("--epsilons", type=float, nargs="+", default=[0.1, 1.0, 10.0])
    parser.add_argument("--problems", nargs="+", default=None, help="chain digits cartpole stays (default: all)")
    parser.add_argument("--estimators", nargs="+", default=list(ESTIMATORS), choices=ESTIMATORS)
    parser.add_argument("--fqe-steps", type=int, default=None, help="DP-FQE steps (default: FQETraining's)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/ope_suite")
    parser.add_argument("--cache", default=None, help="where Monte Carlo truths are cached (default: --out)")
    parser.add_argument("--quick", action="store_true", help="a smoke test: small problems, 2 datasets, eps 1")
    parser.add_argument("--no-progress", dest="progress", action="store_false")
    parser.add_argument("--merge", nargs="+", default=None, metavar="RUN",
                        help="run nothing: merge these runs' suite.json into --out's table, JSON and PNG")
    args = parser.parse_args(argv)
    if args.merge:
        import json

        from dporl.utils.io import atomic_write_json

        summary = merge([json.loads((Path(run) / "suite.json").read_text()) for run in args.merge])
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_json(out / "suite.json", summary)
        (out / "suite.md").write_text(table(summary))
        plot(summary, out / "suite.png")
        print(table(summary))
        return summary
    if args.quick:
        args.datasets, args.epsilons, args.fqe_steps = min(args.datasets, 2), [1.0], args.fqe_steps or 30
    summary = run(args)
    print(table(summary))
    print(f"{summary['seconds']:.0f} s; results in {args.out}")
    return summary


if __name__ == "__main__":
    main()
