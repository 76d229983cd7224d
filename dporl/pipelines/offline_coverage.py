"""Coverage of a whole table run's private evaluation, where the truth is exact.

Each of ``--runs`` independent runs generates its own logged table of the treatment chain (``data.example`` with
seed i: clinicians as units), and runs the ``train`` pipeline on it exactly as ``dporl train --config`` does:
import, unit-level DP-SGD CQL on the "train" cell, private evaluation of the learned greedy policy on the held-out
cells. The released interval is checked against the learned policy's exact value (``TreatmentChain.true_value``),
so what is measured is the coverage of the number a user reads at the end of a run, policy learning included.

    python -m dporl.pipelines.offline_coverage --runs 100 [--config configs/table_quickstart.yaml] [key=value ...]

Writes ``coverage.json`` and ``coverage.png`` (intervals against the truth) to ``--out``.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import tempfile
import time
from pathlib import Path
from typing import Optional

import numpy as np


def run(config_path: str, overrides: list[str], runs: int, out: Path, progress: bool = True) -> dict:
    import torch
    from tqdm.auto import tqdm

    from dporl.eval.ope_coverage import TreatmentChain, clopper_pearson, state_policy_probabilities
    from dporl.pipelines.train import TrainPipelineConfig
    from dporl.pipelines.train import run as run_pipeline
    from dporl.train.export import load_policy
    from dporl.utils.config import apply_overrides, from_dict, load_yaml
    from dporl.utils.io import atomic_write_json

    torch.set_num_threads(1)
    chain = TreatmentChain()
    base = apply_overrides(load_yaml(config_path), overrides)
    rows = []
    start = time.perf_counter()
    for i in tqdm(range(runs), desc="table runs", unit="run", disable=not progress):
        data = apply_overrides(base, [f"data.example.seed={i}", f"noise_seed={1_000_003 * (i + 1)}",
                                      "trainer.progress=false"])
        with tempfile.TemporaryDirectory() as tmp:
            data["run_dir"] = str(Path(tmp) / "run")
            config = from_dict(TrainPipelineConfig, data)
            with contextlib.redirect_stdout(io.StringIO()):
                summary = run_pipeline(config)
            treat = state_policy_probabilities(load_policy(Path(tmp) / "run" / "release" / "policy"), chain.n_states)
        evaluation = summary["evaluation"]
        rows.append({"truth": chain.true_value(treat), "value": evaluation["value"], "low": evaluation["ci_low"],
                     "high": evaluation["ci_high"], "policy": treat.tolist(),
                     "guarantee": summary["privacy"]["guarantee"]["epsilon"]})
    truth = np.array([r["truth"] for r in rows])
    value, low, high = (np.array([r[k] for r in rows]) for k in ("value", "low", "high"))
    covered = int(np.sum((low <= truth) & (truth <= high)))
    result = {
        "runs": runs, "covered": covered, "coverage": covered / runs, "coverage_ci95": clopper_pearson(covered, runs),
        "bias": float(np.mean(value - truth)), "rmse": float(np.sqrt(np.mean((value - truth) ** 2))),
        "mean_width": float(np.mean(high - low)), "distinct_policies": len({tuple(r["policy"]) for r in rows}),
        "max_guarantee": max(r["guarantee"] for r in rows), "seconds": time.perf_counter() - start,
        "config": config_path, "overrides": overrides, "rows": rows,
    }
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_json(out / "coverage.json", result)
    _plot(rows, out / "coverage.png")
    return result


def _plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dporl.utils.io import atomic_write

    truth = np.array([r["truth"] for r in rows])
    low, high, value = (np.array([r[k] for r in rows]) for k in ("low", "high", "value"))
    hit = (low <= truth) & (truth <= high)
    x = np.arange(len(rows))
    fig, ax = plt.subplots(figsize=(8, 3.6))
    ax.vlines(x[hit], low[hit], high[hit], color="tab:blue", lw=1, label="interval covers")
    ax.vlines(x[~hit], low[~hit], high[~hit], color="tab:red", lw=1, label="interval misses")
    ax.plot(x, value, ".", color="k", ms=3, label="released value")
    ax.plot(x, truth, "_", color="tab:green", ms=8, label="true value of the learned policy")
    ax.set_xlabel("independent run (own logged table, own noise)")
    ax.set_ylabel("policy value")
    ax.set_title(f"table pipeline, private evaluation: {hit.mean():.0%} of {len(rows)} intervals cover")
    ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=110), suffix=".png")
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=100)
    parser.add_argument("--config", default="configs/table_quickstart.yaml")
    parser.add_argument("--out", default="runs/offline_coverage")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    args = parser.parse_args(argv)
    result = run(args.config, args.overrides, args.runs, Path(args.out))
    print(json.dumps({k: v for k, v in result.items() if k != "rows"}, indent=1, default=str))


if __name__ == "__main__":
    main()
