"""The "fnq" pipeline's results: one row per run label over seeds (final return with a 95% Student-t interval, mean
curves, the guarantee), the smallest epsilon reaching 90% of the non-private return, the table and the plots. The
returns are computed from the protected reward function: curator-only."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Optional

import numpy as np

from dporl.eval.returns import confidence_interval
from dporl.logging import plot_lines
from dporl.methods.reward_level import METHODS, NON_PRIVATE
from dporl.pipelines.fnq.config import FNQPipelineConfig


def _guarantee(run: dict) -> str:
    ledger = run.get("ledger")
    if METHODS[run["method"]].data_free:
        return "data-free (eps = 0)"
    guarantee = (ledger or {}).get("guarantee")
    if guarantee is not None:
        return f"({guarantee['epsilon']:.3g}, {guarantee['delta']:.2g})"
    claims = (ledger or {}).get("paper_figures_NOT_guarantees") or []
    if claims:
        return f"NO GUARANTEE; the paper's figure, NOT a guarantee: ({claims[0]['epsilon']:g}, {claims[0]['delta']:.2g})"
    return "NO GUARANTEE"


def summarise(runs: list[dict]) -> list[dict]:
    """One row per label: final return over seeds with a 95% Student-t interval, mean curves, the guarantee."""
    rows = []
    for label in dict.fromkeys(r["label"] for r in runs):
        group = [r for r in runs if r["label"] == label]
        finals = [r["final_return"] for r in group]
        stats = confidence_interval(finals) if not any(math.isnan(f) for f in finals) else None
        finals_q = [r["final_return_q"] for r in group]
        first = group[0]
        curves = [[y for _, y in r["curve"]] for r in group]
        rows.append({
            "label": label, "method": first["method"], "epsilon": first["epsilon"], "sigma": first["sigma"],
            "reset_every": first["every"], "windows": first["windows"], "guarantee": _guarantee(first),
            "seeds": len(group), "finals": finals,
            "final_mean": stats.mean if stats else math.nan, "final_ci": [stats.ci_low, stats.ci_high] if stats else None,
            "final_std": stats.std if stats else math.nan,
            "final_q_mean": float(np.mean(finals_q)) if finals_q else math.nan,
            "curve_x": [x for x, _ in first["curve"]],
            "curve_mean": np.mean(curves, axis=0).tolist() if curves and curves[0] else [],
            "curve_std": np.std(curves, axis=0).tolist() if curves and curves[0] else [],
            "curve_q_mean": np.mean([[y for _, y in r["curve_q"]] for r in group], axis=0).tolist()
            if first["curve_q"] else [],
        })
    return rows


def epsilon_to_reach(rows: list[dict], fraction: float = 0.9) -> dict[str, dict[str, Optional[float]]]:
    """Per certified method: the smallest epsilon of the grid whose mean return reaches ``fraction`` of the
    non-private mean ("return"), and ``fraction`` of the non-private gain over the best data-free row ("gain")."""
    reference = next((r["final_mean"] for r in rows if r["method"] == NON_PRIVATE.name), None)
    if reference is None:
        return {}
    floor = max((r["final_mean"] for r in rows if METHODS[r["method"]].data_free), default=None)
    out = {}
    for method in dict.fromkeys(r["method"] for r in rows if METHODS[r["method"]].certified):
        grid = sorted((r["epsilon"], r["final_mean"]) for r in rows if r["method"] == method)
        reach = next((eps for eps, value in grid if value >= fraction * reference), None)
        gain = None
        if floor is not None and reference > floor:
            gain = next((eps for eps, value in grid if value - floor >= fraction * (reference - floor)), None)
        out[method] = {"return": reach, "gain": gain, "largest_epsilon_run": grid[-1][0] if grid else None}
    return out


def table(rows: list[dict]) -> str:
    lines = [
        "| run | method | eps | guarantee (unit reward) | final return, mean [95% CI] over seeds | greedy on Q_theta |",
        "|---|---|---|---|---|---|",
    ]
    for row in rows:
        ci = row["final_ci"]
        interval = f"{row['final_mean']:.2f} [{ci[0]:.2f}, {ci[1]:.2f}] (n={row['seeds']})" if ci else "n/a"
        eps = "-" if row["epsilon"] is None else f"{row['epsilon']:g}"
        lines.append(
            f"| {row['label']} | {row['method']} | {eps} | {row['guarantee']} | {interval} | {row['final_q_mean']:.2f} |"
        )
    reach = epsilon_to_reach(rows)
    if reach:
        lines += ["", "| method | smallest eps reaching 90% of non-private return | 90% of its gain over data-free |",
                  "|---|---|---|"]
        for method, values in reach.items():
            def show(value):
                return f"{value:g}" if value is not None else f"not reached (up to {values['largest_epsilon_run']:g})"

            lines.append(f"| {method} | {show(values['return'])} | {show(values['gain'])} |")
    return "\n".join(lines) + "\n"


def plots(config: FNQPipelineConfig, rows: list[dict], out_dir: Path) -> list[str]:
    out, groups = [], {}
    for row in rows:
        if not row["curve_x"]:
            continue
        if config.epsilons:
            key = "reference" if row["epsilon"] is None else f"{row['epsilon']:g}"
        else:
            key = f"J{row['label'].rsplit('_J', 1)[1]}"
        groups.setdefault(key, []).append(row)
    reference = groups.pop("reference", [])
    for key, group in groups.items():
        series = {r["label"]: (r["curve_x"], r["curve_mean"], r["curve_std"]) for r in reference + group}
        series.update({f"{r['label']} (Q_theta)": (r["curve_x"], r["curve_q_mean"], None)
                       for r in reference + group if r["sigma"] > 0})
        title = f"{config.env_id}: " + (f"eps = {key}, delta = {config.delta:g}" if config.epsilons else key)
        path = out_dir / f"curves_{'eps' if config.epsilons else ''}{key}.png"
        plot_lines(path, series, xlabel="samples", ylabel="return (curator-only; mean +- 1 std over seeds)", title=title)
        out.append(str(path))
    certified = [r for r in rows if METHODS[r["method"]].per_epsilon and r["epsilon"] is not None]
    if config.epsilons and len(config.epsilons) > 1 and certified:
        eps_grid = sorted(config.epsilons)
        series = {}
        for method in dict.fromkeys(r["method"] for r in certified):
            by_eps = {r["epsilon"]: r for r in certified if r["method"] == method}
            xs = [e for e in eps_grid if e in by_eps]
            label = method + (" (the paper's figure, NOT a guarantee)" if METHODS[method].paper else "")
            series[label] = (xs, [by_eps[e]["final_mean"] for e in xs],
                             [by_eps[e]["final_mean"] - by_eps[e]["final_ci"][0] for e in xs])
        for row in rows:
            if row["epsilon"] is None and row["final_ci"]:
                series[row["label"]] = (eps_grid, [row["final_mean"]] * len(eps_grid), None)
        path = out_dir / "return_vs_epsilon.png"
        plot_lines(path, series, xlabel="epsilon (delta = %g)" % config.delta,
                   ylabel="final return (mean, 95% CI over seeds)", title=f"{config.env_id}: return vs epsilon", logx=True)
        out.append(str(path))
    return out
