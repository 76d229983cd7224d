"""Results of the "ope" pipeline: per-run rows -> per-(method, m) means with 95% intervals, tables, plots, JSON.

Intervals are Student-t intervals of the mean over trials (``dporl.eval.returns.confidence_interval``). Every
private method's epsilon is shown for the budget's neighbouring relation (the comparison) and, labelled, for the
other one where it is defined (a replace-one guarantee says nothing about add/remove neighbours: n/a).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping

from dporl.eval.returns import confidence_interval
from dporl.logging import plot_lines
from dporl.pipelines.ope.config import OPEConfig
from dporl.privacy.accountants import analysis_name
from dporl.privacy.relations import CONVERSION
from dporl.utils.config import to_dict
from dporl.utils.io import atomic_write_csv, atomic_write_json, atomic_write_text

EPSILON_KEYS = ("epsilon_replace_one", "epsilon_add_remove")
RELATION_WORDS = {"replace_one": "replace one trajectory", "add_remove": "add/remove one trajectory"}


def aggregate(rows: list[dict[str, Any]], metric_keys: list[str]) -> list[dict[str, Any]]:
    table = []
    for method in dict.fromkeys(r["method"] for r in rows):
        for m in sorted({r["m"] for r in rows if r["method"] == method}):
            group = [r for r in rows if r["method"] == method and r["m"] == m]
            entry: dict[str, Any] = {"method": method, "m": m, "trials": len(group)}
            for key in metric_keys:
                values = [r[key] for r in group if key in r and math.isfinite(r[key])]
                if not values:
                    continue
                stats = confidence_interval(values)
                entry.update({f"{key}_mean": stats.mean, f"{key}_lo": stats.ci_low, f"{key}_high": stats.ci_high,
                              f"{key}_std": stats.std})
            for key in ("epsilon", *EPSILON_KEYS, "paper_lemma1_epsilon", "noise_multiplier", "steps", "batch"):
                values = [r[key] for r in group if key in r and r[key] is not None]
                if values:
                    entry[key] = max(values)
            table.append(entry)
    return table


def _epsilon(value: Any) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return "not private" if math.isinf(value) else f"{value:.4g}"


def setting_name(config: OPEConfig) -> str:
    if config.experiment == "chain":
        return f"Chain ({config.chain.n_states} states, p={config.chain.stay_probability}, gamma={config.gamma})"
    if config.experiment == "mountain_car":
        policy = "off-policy, target uniform" if config.mountain_car.off_policy else "on-policy"
        return f"MountainCar-v0 ({policy}, Fourier order {config.mountain_car.fourier_order}, gamma={config.gamma})"
    hiv = config.hiv
    return (f"HIV treatment (off-policy: target greedy fitted-Q, behaviour softmax T={hiv.behaviour_temperature}; "
            f"{hiv.horizon} x {hiv.treatment_interval:g} days, Fourier order {hiv.fourier_order} on log10 state "
            f"coordinates {hiv.coordinates}, gamma={config.gamma}; relative MSPBE, reward scale {hiv.reward_scale:g})")


def gpope_analysis(config: OPEConfig) -> str:
    gp = config.gpope
    if gp.mode == "paper":
        return (f"{analysis_name('rdp')}, sampling without replacement (Wang, Balle, Kasiviswanathan 2019), "
                "replace one trajectory")
    text = f"{analysis_name(gp.accountant)}, Poisson sampling, add/remove one trajectory"
    if gp.relation == "replace_one":
        text += f"; replace-one epsilon: {CONVERSION}; sigma calibrated for the replace-one budget"
    return text


def write_results(
    config: OPEConfig, run_dir: Path, rows: list[dict[str, Any]], tuned: Mapping[int, Mapping[str, Any]],
    metric_labels: Mapping[str, str], timings: Mapping[str, float],
) -> dict[str, Any]:
    keys = list(metric_labels)
    table = aggregate(rows, keys)
    relation = config.gpope.relation
    other = "add_remove" if relation == "replace_one" else "replace_one"
    columns = ["method", "m", "trials"] + [f"{k}_{s}" for k in keys for s in ("mean", "lo", "high")] + [
        "epsilon", f"epsilon_{other}"]
    atomic_write_csv(run_dir / "results.csv", columns,  # quoted where a field needs it: method labels hold commas
                     ({c: entry.get(c, "") for c in columns} for entry in table), lineterminator="\n")

    headline = keys[0]
    lines = [
        f"# {setting_name(config)}: {metric_labels[headline]} vs m, privacy unit: one trajectory",
        "",
        f"Budget: epsilon={config.epsilon}, delta={config.delta} for every private method, for neighbouring datasets "
        f"that {RELATION_WORDS[relation]} (the comparison). Mean over trials with a 95% t-interval of the mean.",
        "",
        f"GPOPE: {gpope_analysis(config)}; averaging: {config.gpope.averaging}.",
    ]
    if any(r["method"] in ("dp_lsw", "dp_lsl") for r in rows):
        lines.append("DP-LSW / DP-LSL: smooth-sensitivity Gaussian output perturbation (Balle et al. 2016), replace "
                     "one trajectory; DP-LSW weights 0 on states no trajectory can visit.")
    header = ["method", "m", "trials"] + [metric_labels[k] for k in keys] + [
        f"eps ({RELATION_WORDS[relation]})", f"eps ({RELATION_WORDS[other]}, for reference)"]
    lines += ["", "| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for e in table:
        cells = [str(e["method"]), str(e["m"]), str(e["trials"])]
        for k in keys:
            cells.append(f"{e[k + '_mean']:.3g} [{e[k + '_lo']:.3g}, {e[k + '_high']:.3g}]" if f"{k}_mean" in e
                         else "n/a")
        cells += [_epsilon(e.get("epsilon")), _epsilon(e.get(f"epsilon_{other}"))]
        lines.append("| " + " | ".join(cells) + " |")
    paper = [e for e in table if "paper_lemma1_epsilon" in e]
    if paper:
        figures = ", ".join(f"m={e['m']} ({e['method']}): eps={e['paper_lemma1_epsilon']:.4g}" for e in paper)
        lines += ["", "The paper's Lemma 1 moments bound for the same runs (the paper's figure, NOT dporl's "
                  "guarantee): " + figures]
    lines += ["", "Tuned on public data: " + "; ".join(
        f"m={m}: step size {v['step_size']:g} per trajectory, clip norm {v['clip_norm']:.3g}"
        + (f" (public gradient-norm quantile {v['clip_quantile']:g})" if v.get("clip_quantile") is not None else "")
        + f", {v['epochs']:g} passes (batch {v['batch']:g}, {v['steps']} updates, sigma {v['noise_multiplier']:.4g})"
        + (f", DP-LSL lambda scale {v['lsl_lambda_scale']:g}" if v.get("lsl_lambda_scale") else "")
        for m, v in tuned.items())]
    lines += ["", "Wall time (m=... data: simulating and padding the public and the trials' datasets, included in the "
              "tuning and trials times): " + ", ".join(f"{k} {v:.1f} s" for k, v in timings.items())]
    atomic_write_text(run_dir / "results.md", "\n".join(lines) + "\n")

    for key in keys:
        series = {}
        for method in dict.fromkeys(e["method"] for e in table):
            picked = [e for e in table if e["method"] == method and f"{key}_mean" in e and e[f"{key}_mean"] > 0]
            if picked:
                series[method] = ([e["m"] for e in picked], [e[f"{key}_mean"] for e in picked],
                                  [e[f"{key}_high"] - e[f"{key}_mean"] for e in picked])
        if series:
            plot_lines(run_dir / f"{key}_vs_m.png", series, xlabel="trajectories m", ylabel=metric_labels[key],
                       logx=True, logy=True,
                       title=f"{config.experiment}, eps={config.epsilon} ({RELATION_WORDS[relation]}), "
                             f"delta={config.delta}")
    plot_step_size_sensitivity(run_dir / "step_size_sensitivity.png", tuned, metric_labels[headline], config)
    summary = {"config": to_dict(config), "table": table, "tuned": {str(k): dict(v) for k, v in tuned.items()},
               "metric_labels": dict(metric_labels), "privacy_unit": "trajectory", "relation": relation,
               "gpope_analysis": gpope_analysis(config), "timings_seconds": dict(timings)}
    atomic_write_json(run_dir / "summary.json", summary)
    return {"run_dir": str(run_dir), "table": table, "tuned": summary["tuned"]}


def plot_step_size_sensitivity(path: Path, tuned: Mapping[int, Mapping[str, Any]], label: str, config: OPEConfig):
    """Public-data score vs step size at each m's tuned clip quantile and passes (Xie et al.'s Figure 1(b))."""
    series = {}
    for m, values in tuned.items():
        points = sorted((p["step_size"], p["score"]) for p in values.get("tuning_scores", [])
                        if p["clip_quantile"] == values.get("clip_quantile") and p["epochs"] == values["epochs"]
                        and math.isfinite(p["score"]) and p["score"] > 0)
        if len(points) > 1:
            series[f"m={m} ({values['epochs']:g} passes)"] = ([p[0] for p in points], [p[1] for p in points], None)
    if series:
        plot_lines(path, series, xlabel="step size per trajectory (public tuning runs)", ylabel=label, logx=True,
                   logy=True, title=f"{config.experiment}: sensitivity to the step size, eps={config.epsilon}")
