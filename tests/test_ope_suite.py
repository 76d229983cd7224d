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
