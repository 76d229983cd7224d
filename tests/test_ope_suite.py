"""The private OPE benchmark suite's machinery (``python -m dporl.eval.ope_suite --quick``): every problem draws
datasets with a known truth, every estimator answers or is refused before spending, and the table, the JSON and the
PNG are written. A smoke test of the machinery, not a coverage measurement (that is docs/results.md)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from dporl.eval import ope_suite
from dporl.eval.ope_suite_problems import HospitalStays, problems

torch.set_num_threads(1)


def test_the_quick_suite_writes_its_table_and_plot(tmp_path):
    pytest.importorskip("sklearn")
    summary = ope_suite.main(["--quick", "--problems", "chain", "digits", "--out", str(tmp_path), "--no-progress"])
    assert (tmp_path / "suite.png").stat().st_size > 10_000
    stored = json.loads((tmp_path / "suite.json").read_text())
    assert set(stored["problems"]) == {"chain", "digits"}
    table = (tmp_path / "suite.md").read_text()
    for name in ("DP-WIS", "DP-WIS-CLIP", "DP-PDIS", "DP-FQE", "DP-DR", "SNIPW (non-private)"):
        assert f"| {name} |" in table
    chain, digits = summary["problems"]["chain"]["cells"], summary["problems"]["digits"]["cells"]
    # Nothing-clipped WIS over 60-step episodes needs astronomically many units: refused before spending, by name.
    assert chain["wis@1"]["refused"] == 2 and "needs about" in chain["wis@1"]["refusal"]
    # On the bandit it answers, calibrated (nothing clipped, a stochastic target); nothing else is.
    assert digits["wis@1"]["refused"] == 0 and digits["wis@1"]["calibrated"] == [True]
    for key in ("wis-clip@1", "pdis@1", "fqe@1", "dr@1"):  # (answered or refused, never calibrated)
        assert True not in chain[key]["calibrated"] and True not in digits[key]["calibrated"]
    assert chain["wis-clip@1"]["calibrated"] == [False] and digits["dr@1"]["calibrated"] == [False]
    for cell in (*chain.values(), *digits.values()):
        if "coverage" in cell:
            low, high = cell["coverage_ci95"]
            assert 0 <= low <= cell["coverage"] <= high <= 1


def test_the_problems_truths_are_what_simulation_says():
    pytest.importorskip("sklearn")
    from dporl.eval.ope_importance import episode_terms

    by_name = {p.name: p for p in problems(["chain", "digits", "stays"], quick=True)}
    for name, problem in by_name.items():
        # Self-normalised IS on a large sample (non-private) agrees with the exact truth within 4 standard errors.
        terms = [episode_terms(problem.sample(np.random.default_rng([9, i])), problem.target, problem.gamma)
                 for i in range(4)]
        w = torch.cat([t["w"] for t in terms])
        g = torch.cat([t["G"] for t in terms])
        estimate = float((w * g).sum() / w.sum())
        stderr = float(torch.sqrt(((w * (g - estimate)) ** 2).sum()) / w.sum())
        assert abs(estimate - problem.truth) < 4 * stderr + 1e-9, (name, estimate, problem.truth)
    stays = HospitalStays()  # every reward negative, and the behaviour's value about -5.7 (a hospital-stays table)
    assert stays.true_value(np.full(stays.severities, 0.5)) == pytest.approx(-5.75, abs=0.05)
    assert by_name["stays"].declared["reward_range"][1] < 0 and math.isfinite(by_name["stays"].truth)


def _run(problem_cells: dict[str, dict], truth: float = 0.5, seconds: float = 1.0) -> dict:
    cell = {"datasets": 4, "refused": 0, "failed": 0, "covered": 3, "calibrated": [False], "coverage": 0.75,
            "coverage_ci95": [0.19, 0.99], "mean_width": 0.2, "bias": 0.01, "rmse": 0.02}
    return {"settings": {}, "seconds": seconds, "problems": {
        name: {"title": name, "truth": truth, "truth_stderr": 0.0, "declared": {}, "clip": 1.0, "obs_scale": 1.0,
               "notes": {}, "baselines": {}, "results": {key: [] for key in keys},
               "cells": {key: {**cell, "datasets": n} for key, n in keys.items()}}
        for name, keys in problem_cells.items()}}


def test_merge_joins_runs_cell_by_cell_in_estimator_order(tmp_path):
    importance = _run({"chain": {"wis@1": 200, "wis@10": 200, "pdis@0.1": 200}})
    fqe = _run({"chain": {"fqe@10": 100, "fqe@1": 100}, "stays": {"fqe@1": 100}})
    later = _run({"chain": {"wis@1": 1000}})
    merged = ope_suite.merge([fqe, importance, later])
    assert list(merged["problems"]) == ["chain", "stays"]
    chain = merged["problems"]["chain"]["cells"]
    assert list(chain) == ["wis@1", "wis@10", "pdis@0.1", "fqe@1", "fqe@10"]  # estimator order, then epsilon
    assert chain["wis@1"]["datasets"] == 1000 and chain["fqe@1"]["datasets"] == 100  # a later run's cell wins
    with pytest.raises(ValueError, match="disagree on the truth"):
        ope_suite.merge([importance, _run({"chain": {"fqe@1": 100}}, truth=0.6)])
    for run, summary in (("a", importance), ("b", fqe)):
        (tmp_path / run).mkdir()
        (tmp_path / run / "suite.json").write_text(json.dumps(summary))
    ope_suite.main(["--merge", str(tmp_path / "a"), str(tmp_path / "b"), "--out", str(tmp_path / "m")])
    table = (tmp_path / "m" / "suite.md").read_text()
    assert "| chain (0.5) | DP-WIS | 10 | 200 (0, 0) |" in table
    assert "| stays (0.5) | DP-FQE | 1 | 100 (0, 0) |" in table
    assert (tmp_path / "m" / "suite.png").stat().st_size > 10_000
