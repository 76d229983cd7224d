"""Pipeline "ope": private policy evaluation experiments (GPOPE vs DP-LSW / DP-LSL, with non-private references).

For every number of trajectories m and trial, the problem (``dporl.eval.ope_problems``: the 40-state chain, Mountain
Car, HIV) logs m trajectories, each private method releases a value estimate at (epsilon, delta) for the configured
neighbouring relation, and the estimate is scored against the problem's truth. GPOPE's step size, clip norm and
number of passes are tuned on an independent public dataset of the same size (Xie et al.'s protocol: a choice made
on the private data would leak), then GPOPE also runs at the configured step-size multiples (0.1x, 10x) to check
robustness; DP-LSL's lambda is tuned the same way. Each trial also reports the non-private LSTD / WIS-LSTD solution
under every weighting the problem scores, and theta = 0 (the data-free estimate).

Outputs in ``run_dir/curator`` (the tables hold non-private references computed on the private data): results.csv,
results.md, one PNG per metric (vs m, 95% bands), the step-size sensitivity PNG, summary.json; and a Trainer run
directory (release/ privacy report, curator/ checkpoint) per GPOPE run under ``run_dir/m<m>/``. ``config`` holds the
typed configuration, ``runners`` one release of each method and the public tuning, ``report`` the tables and plots.
"""

from __future__ import annotations

import math
import time
from pathlib import Path
from typing import Any

import torch

from dporl.algos.lstd import lstd
from dporl.eval.ope_problems import FiniteStateProblem, WEIGHTING_LABELS, padded_data
from dporl.pipelines import Pipeline
from dporl.pipelines.ope.config import GPOPESettings, OPEConfig, OutputPerturbationSettings, build_problem
from dporl.pipelines.ope.report import write_results
from dporl.pipelines.ope.runners import (
    GPOPEHyper,
    make_plan,
    run_gpope,
    run_output_perturbation,
    tune_gpope,
    tune_lsl_lambda,
    tuning_runs,
)
from dporl.privacy.randomness import SecretRoot
from dporl.train.run_dir import RunDirectory, RunMode
from dporl.utils.config import to_dict
from dporl.utils.io import atomic_write_json
from dporl.utils.validation import ValidationError


PUBLIC_DRAW = -1  # the draw key of each m's public tuning dataset (trials draw keys 0, 1, ...)


def data_generator(seed: int, m: int, key: int) -> torch.Generator:
    """The generator of one data draw (the problem's sampling: an ordinary seeded generator). Draw ``PUBLIC_DRAW``
    is each m's public tuning dataset, the others the private datasets of the trials."""
    return torch.Generator().manual_seed(hash((seed, m, key)) % 2**62)


def reference_methods(problem) -> list[tuple[str, str]]:
    """(row name, weighting) of the non-private reference: LSTD on-policy, WIS-LSTD off-policy, per weighting."""
    name = "lstd" if problem.target_policy is None else "wis-lstd"
    if len(problem.weightings) == 1:
        return [(f"{name} (non-private)", problem.weightings[0])]
    return [(f"{name} (non-private, {WEIGHTING_LABELS[w].split(' (')[0]})", w) for w in problem.weightings]


def run(config: OPEConfig, mode: RunMode = "new", problem=None) -> dict[str, Any]:
    """Every (m, trial) of ``config``; ``problem`` replaces ``build_problem(config)`` (e.g. an audit's problem whose
    private draws are a neighbour's); tables and plots go to curator/, each GPOPE release to its own run directory."""
    started = time.perf_counter()
    with RunDirectory(config.run_dir, pipeline="ope", config=to_dict(config), mode=mode) as directory:
        return _run(config, directory, started, problem)


def _run(config: OPEConfig, directory: RunDirectory, started: float, problem=None) -> dict[str, Any]:
    from tqdm.auto import tqdm

    torch.set_num_threads(1)
    run_dir = Path(config.run_dir)
    problem = build_problem(config) if problem is None else problem
    # One secret root per invocation (noise_seed, else 256 bits of the OS CSPRNG): every private draw is a named
    # stream of it (a child root per GPOPE release, one noise stream per output perturbation).
    root = SecretRoot(config.noise_seed)
    directory.begin()  # each GPOPE release below is a Trainer run directory of its own under run_dir
    timings = {"problem setup": time.perf_counter() - started}
    gp = config.gpope
    finite = isinstance(problem, FiniteStateProblem)
    op_methods = config.output_perturbation.methods if finite else []
    rows: list[dict[str, Any]] = []
    tuned: dict[int, dict[str, Any]] = {}
    n_jobs = len(config.m_values) * (tuning_runs(config) + config.trials * len(gp.step_size_multipliers))
    progress = tqdm(total=n_jobs, desc=f"ope {config.experiment}", unit="run", disable=not config.progress,
                    dynamic_ncols=True)
    def draw(m: int, key: int) -> dict:
        clock = time.perf_counter()
        data = padded_data(problem.sample(m, data_generator(config.seed, m, key)))
        timings[f"m={m} data"] = timings.get(f"m={m} data", 0.0) + time.perf_counter() - clock
        return data

    for m in config.m_values:
        clock = time.perf_counter()
        # Hyper-parameters come from an independent public dataset of the same size (never the private one).
        public = draw(m, PUBLIC_DRAW)
        hyper, scores = tune_gpope(config, problem, public, m, run_dir / f"m{m}" / "tuning", progress)
        lambda_scale = tune_lsl_lambda(config, problem, public, m) if "dp_lsl" in op_methods else 0.0
        plan = make_plan(config, m, hyper.epochs)
        tuned[m] = {"step_size": hyper.step_size, "clip_norm": hyper.clip_norm, "clip_quantile": hyper.clip_quantile,
                    "epochs": hyper.epochs, "batch": plan.batch, "steps": plan.steps, "lsl_lambda_scale": lambda_scale,
                    "tuning_scores": scores}
        timings[f"m={m} tuning"] = time.perf_counter() - clock
        clock = time.perf_counter()
        for trial in range(config.trials):
            data = draw(m, trial)
            for name, weighting in reference_methods(problem):
                theta = lstd(problem.features, data, config.gamma, target_policy=problem.target_policy,
                             weighting=weighting)
                rows.append({"method": name, "m": m, "trial": trial, **problem.metrics(theta),
                             "epsilon": math.inf, "epsilon_replace_one": math.inf, "epsilon_add_remove": math.inf})
            # The data-free estimate: a private method above this line has learnt nothing useful.
            zero = problem.metrics(torch.zeros(problem.features.n_features, dtype=torch.float64))
            rows.append({"method": "theta = 0 (no data)", "m": m, "trial": trial, **zero, "epsilon": 0.0,
                         "epsilon_replace_one": 0.0, "epsilon_add_remove": 0.0})
            for multiplier in gp.step_size_multipliers:
                scaled = GPOPEHyper(hyper.step_size * multiplier, hyper.clip_norm, hyper.epochs, hyper.clip_quantile)
                result = run_gpope(
                    config, problem, data, scaled, run_dir / f"m{m}" / f"trial{trial}" / f"gpope_x{multiplier:g}",
                    root.child(f"gpope/m{m}/trial{trial}/x{multiplier!r}"),
                    {"m": m, "trial": trial, "multiplier": multiplier},
                )
                rows.append({"method": f"gpope ({multiplier:g}x step)", "m": m, "trial": trial, **result})
                tuned[m].setdefault("noise_multiplier", result["noise_multiplier"])
                progress.update(1)
            for method in op_methods:
                result = run_output_perturbation(method, config, problem, data, lambda_scale,
                                                 root.noise(f"{method}/m{m}/trial{trial}/noise"))
                rows.append({"method": method, "m": m, "trial": trial, **result})
        timings[f"m={m} trials"] = time.perf_counter() - clock
    progress.close()
    timings["total"] = time.perf_counter() - started
    # The tables hold non-private references (LSTD on the private data): curator-only.
    return write_results(config, directory.curator, rows, tuned, problem.metric_labels, timings)


def evaluate(payload: dict[str, Any], episodes: int, seed: int, out_dir: Path) -> dict[str, Any]:
    """Metrics of the value estimate a GPOPE checkpoint released, on its problem (exact for the chain)."""
    from dporl.algos.gpope import released_theta
    from dporl.utils.config import from_dict

    stored = payload.get("config", {})
    if "ope" not in stored or "theta" not in payload.get("algorithm", {}):
        raise ValidationError("checkpoint", "not a GPOPE checkpoint of the 'ope' pipeline")
    config = from_dict(OPEConfig, stored["ope"])
    problem = build_problem(config)
    metrics = {**problem.metrics(released_theta(payload["algorithm"])), "m": stored.get("m"),
               "trial": stored.get("trial"), "steps": payload.get("step")}
    atomic_write_json(Path(out_dir) / "ope_eval.json", metrics)
    return metrics


PIPELINE = Pipeline("ope", OPEConfig, run, evaluate)

__all__ = ["GPOPESettings", "OPEConfig", "OutputPerturbationSettings", "build_problem", "evaluate", "run"]
