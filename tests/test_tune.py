"""Private hyperparameter search end to end at tiny scale (``dporl.tune`` / ``dporl tune``): one guarantee over the
count, every trial and the selection; nothing about losing trials or K released; the plan equals what trials
record; resume without re-running or re-charging; Ray gives the same result."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

import dporl
from dporl.privacy.events import SelectionEvent, event_from_dict
from dporl.privacy.selection import trial_rdp
from dporl.train.run_dir import read_journal
from dporl.tuning.planning import TrialPrivacy
from dporl.utils.config import apply_overrides, load_yaml
from dporl.utils.validation import PrivacyBudgetError, ValidationError

ROOT = Path(__file__).resolve().parents[1]
TINY = ["data.example.units=1500", "count_fraction=0.1", "trainer.max_steps=30", "trainer.eval_every=30",
        "trainer.checkpoint_every=30", "trainer.log_every=30", "eval.offline.fqe.steps=40", "algorithm.hidden_sizes=[16]",
        "dp.accountant=rdp",
        "eval.offline.tolerance=1e6"]  # 1500 clinicians: the pre-spend noise check would refuse every trial's evaluation


def tiny_base() -> dict:
    return apply_overrides(load_yaml(ROOT / "configs" / "table_quickstart.yaml"), TINY)


def tiny_space(run_dir: Path, **settings) -> dict:
    return {"run_dir": str(run_dir), "noise_seed": 11, "trials": {"distribution": "poisson", "mean": 3},
            "progress": False,
            "space": {"batch_size": {"choices": [32, 64]}, "algorithm.alpha": {"uniform": [0.1, 2.0]},
                      "trainer.optimizer.lr": {"loguniform": [1e-3, 1e-2]}}, **settings}


def _tune(base, space, **kwargs) -> tuple[dict, str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = dporl.tune(base, space, **kwargs)
    return result, out.getvalue()


@pytest.fixture(scope="module")
def search(tmp_path_factory):
    run_dir = tmp_path_factory.mktemp("tune") / "search"
    result, stdout = _tune(tiny_base(), tiny_space(run_dir))
    curator = json.loads((run_dir / "curator" / "summary.json").read_text())
    return run_dir, result, stdout, curator


def test_one_guarantee_covers_the_count_the_trials_and_the_selection(search):
    run_dir, result, stdout, curator = search
    privacy = result["privacy"]
    assert privacy["void"] is None
    assert 0.98 <= privacy["guarantee"]["epsilon"] <= 1.0 and privacy["guarantee"]["delta"] == 1e-5  # calibrated
    stages = {s["name"]: s for s in privacy["stages"]}
    assert set(stages) == {"unit_count", "selection"}
    [(event, count)] = stages["selection"]["events"]
    assert count == 1 and event["type"] == "SelectionEvent" and event["distribution"] == "poisson"
    assert stdout.count("GUARANTEE:") == 1
    assert result["trial_budget"]["epsilon"] < privacy["guarantee"]["epsilon"]  # selection costs something


def test_the_plan_is_what_every_trial_recorded(search):
    """Each trial's ledger recorded exactly events the search planned and charged (parts of its SelectionEvent)."""
    run_dir, result, _, curator = search
    [(payload, _)] = [s for s in result["privacy"]["stages"] if s["name"] == "selection"][0]["events"]
    event = event_from_dict(payload)
    assert isinstance(event, SelectionEvent)
    planned = set(event.trial)
    for row in curator["results"]:
        report = json.loads((run_dir / "curator" / "trials" / f"trial_{row['trial']:04d}" / "release" /
                             "privacy_report.json").read_text())
        realised = TrialPrivacy.from_report(report).parts()
        assert set(realised) <= planned
        assert all(trial_rdp(realised) <= trial_rdp(event.trial) + 1e-12)
        assert "unit_count" not in {s["name"] for s in report["stages"]}  # the search's count, paid once


def test_only_the_winner_is_released_and_nothing_counts_the_trials(search):
    run_dir, result, stdout, curator = search
    rows = curator["results"]
    trials = curator["trials_run"]
    assert trials == len(rows) >= 2
    scored = [r for r in rows if r["score"] is not None and math.isfinite(r["score"])]
    winner = max(scored, key=lambda r: r["score"])
    assert winner["selected"] and sum(r["selected"] for r in rows) == 1
    assert result["selected"]["hyperparameters"] == {k: winner[k] for k in result["space"]}
    release = run_dir / "release"
    names = sorted(str(p.relative_to(release)) for p in release.rglob("*") if p.is_file())
    assert "selected.json" in names and "policy/weights.pt" in names and not any("tensorboard" in n for n in names)
    text = "".join((release / n).read_text() for n in names if n.endswith(".json"))
    assert "trials_run" not in text and "trial_0" not in text and "results" not in json.loads(
        (release / "summary.json").read_text())
    for row in rows:  # no losing trial's score on stdout
        if not row["selected"] and row["score"] is not None and math.isfinite(row["score"]) and row["score"] != 0:
            assert f"{row['score']:.4g}" not in stdout
    policy = dporl.load_policy(release / "policy")
    assert policy.spec["privacy"]["guarantee"] == result["privacy"]["guarantee"]
    report = json.loads((release / "privacy_report.json").read_text())
    assert report["guarantee"] == result["privacy"]["guarantee"]
    assert (run_dir / "curator" / "results.csv").read_text().count("\n") == trials + 1
    assert (run_dir / "curator" / "results.png").stat().st_size > 0
    seeds = [json.loads((run_dir / "curator" / "trials" / f"trial_{i:04d}" / "curator" / "provenance.json")
                        .read_text())["config"]["noise_seed"] for i in range(trials)]
    assert len(set(seeds)) == trials and all(s.bit_length() > 128 for s in seeds)


def test_resume_reuses_finished_trials_and_charges_once(search, tmp_path, monkeypatch):
    """A search interrupted inside its second trial (after its training, during its evaluation), resumed: the first
    trial is not run again, the second starts again from scratch with its seed, the search event is charged once,
    and the result equals the uninterrupted search's (the same noise seed)."""
    import dporl.eval.ope_fqe as ope_fqe
    import dporl.tuning.trials as trials_module

    _, reference, _, curator = search
    real_release, releases = ope_fqe.release_sums, []

    def interrupting(*args, **kwargs):  # a trial releases one value per DP-FQE fold (three)
        releases.append(1)
        if len(releases) == 4:  # the second trial, its evaluation's first fold trained (and charged)
            raise KeyboardInterrupt
        return real_release(*args, **kwargs)

    monkeypatch.setattr(ope_fqe, "release_sums", interrupting)
    run_dir = tmp_path / "search"
    with pytest.raises(KeyboardInterrupt):
        _tune(tiny_base(), tiny_space(run_dir))
    ledger = read_journal(run_dir / "curator" / "journal.json")
    assert len(ledger.stages["selection"].accountant.history) == 1  # charged before any trial ran
    assert (run_dir / "curator" / "trials" / "trial_0001" / "curator" / "journal.json").is_file()  # a partial trial
    partial = read_journal(run_dir / "curator" / "trials" / "trial_0001" / "curator" / "journal.json")
    assert "evaluate0/train" in partial.stages  # resuming that run in place would be refused (a paid evaluation)
    monkeypatch.setattr(ope_fqe, "release_sums", real_release)
    real, calls = trials_module.run_trial, []
    monkeypatch.setattr(trials_module, "run_trial", lambda spec: calls.append(spec["index"]) or real(spec))
    with pytest.raises(ValidationError, match="already holds files"):
        _tune(tiny_base(), tiny_space(run_dir))
    resumed, _ = _tune(tiny_base(), tiny_space(run_dir), mode="resume")
    assert calls == list(range(1, curator["trials_run"]))  # trial 0 was finished: reused
    ledger = read_journal(run_dir / "curator" / "journal.json")
    assert ledger.stages["selection"].accountant.history[0][1] == 1 and len(ledger.stages["selection"].accountant) == 1
    assert resumed["selected"] == reference["selected"]
    assert resumed["privacy"]["guarantee"] == reference["privacy"]["guarantee"]
    calls.clear()
    again, _ = _tune(tiny_base(), tiny_space(run_dir), mode="resume")  # finished: read back
    assert calls == [] and again == resumed


def test_a_trial_spending_more_than_planned_voids_the_search(tmp_path, monkeypatch):
    """The check after each trial: a plan that under-states what a trial records (here: planned at half the trial
    budget) leaves the search with NO guarantee rather than a false one."""
    from dporl.tuning import planning

    real = planning.TrainTrials.planner

    def under_planned(self, data, dataset):
        at = real(self, data, dataset)
        return lambda trial_epsilon: at(trial_epsilon / 2)

    monkeypatch.setattr(planning.TrainTrials, "planner", under_planned)
    space = tiny_space(tmp_path / "search", trial_epsilon=0.5,
                       trials={"distribution": "negative_binomial", "mean": 1.0})  # exactly one trial
    result, stdout = _tune(tiny_base(), space)
    assert result["privacy"]["guarantee"] is None and "more than the search planned" in result["privacy"]["void"]
    assert "NO GUARANTEE" in stdout and "GUARANTEE: (" not in stdout


def test_refusals_name_the_field_and_write_nothing(tmp_path):
    base = tiny_base()
    cases = [
        ({"space": {"epsilon": {"choices": [1, 2]}}}, "space.epsilon"),
        ({"space": {"eval.offline.holdout": {"choices": [0.3, 0.5]}}}, "space.eval.offline.holdout"),
        ({"space": {"batch_size": {"int": [32, 64]}}}, "space.batch_size"),
        ({"space": {"algorithm.alfa": {"choices": [1.0]}}}, "space.algorithm.alfa"),
        ({"space": {"algorithm.alpha": {"loguniform": [0.0, 1.0]}}}, "space.algorithm.alpha.loguniform"),
        ({"trials": {"distribution": "negative_binomial", "mean": 0.5}}, "trials.mean"),
        ({"workers": 0}, "workers"),
    ]
    for settings, field in cases:
        space = {**tiny_space(tmp_path / "x"), **settings}
        with pytest.raises(ValidationError) as info:
            _tune(base, space)
        assert info.value.field == field, (settings, info.value)
    with pytest.raises(ValidationError, match="stable-prefix release") as info:  # table data: no experts to query
        _tune({**base, "method": "mixed"}, tiny_space(tmp_path / "x"))
    assert info.value.field == "method"
    with pytest.raises(ValidationError) as info:
        _tune({**base, "method": "non_private"}, tiny_space(tmp_path / "x"))
    assert info.value.field == "method"
    with pytest.raises(ValidationError) as info:
        _tune({**base, "pipeline": "fnq"}, tiny_space(tmp_path / "x"))
    assert info.value.field == "pipeline"
    with pytest.raises(ValidationError) as info:
        _tune({**base, "relation": "replace_one"}, tiny_space(tmp_path / "x"))
    assert info.value.field == "relation"
    assert not (tmp_path / "x").exists()
    with pytest.raises(PrivacyBudgetError) as info:  # trials too expensive for the search's budget
        _tune(base, tiny_space(tmp_path / "y", trial_epsilon=0.99))
    assert info.value.field == "trial_epsilon"


def test_trials_their_own_run_would_refuse_are_refused_before_the_selection_is_charged(tmp_path):
    """At the trial budget every trial's private evaluation is refused by its run's pre-spend noise check (1500
    clinicians, the default tolerance): the search refuses with that field before charging its selection (only the
    count, released before the trials, is in the journal), instead of paying for a selection of trials that can
    never produce a score."""
    from dporl.eval.ope_feasibility import InfeasibleEvaluation

    base = apply_overrides(load_yaml(ROOT / "configs" / "table_quickstart.yaml"),
                           [o for o in TINY if not o.startswith("eval.offline.tolerance")])
    run_dir = tmp_path / "search"
    with pytest.raises(InfeasibleEvaluation) as info:
        _tune(base, tiny_space(run_dir))
    assert info.value.field.startswith("eval.offline")
    print(info.value)
    assert "every trial of this search would be refused" in str(info.value)
    assert "charged nothing for its trials" in str(info.value)
    journal = read_journal(run_dir / "curator" / "journal.json")
    assert list(journal.stages) == ["unit_count"]
    assert not (run_dir / "curator" / "trials").exists() or not any((run_dir / "curator" / "trials").iterdir())
    assert not (run_dir / "release" / "selected.json").exists()


def test_a_search_whose_every_trial_failed_says_so_to_the_curator_only(tmp_path, monkeypatch, capsys):
    """Trials that fail for a reason the search could not predict (here: the pre-spend check is bypassed, so every
    trial's run refuses its evaluation): the search is charged (its trials ran), releases no policy, and tells the
    curator on stderr and in curator/summary.json why, while what it releases says only that nothing was selected."""
    from dporl.tuning import planning

    monkeypatch.setattr(planning.TrainTrials, "check_trial", lambda self, data, loaded: None)
    base = apply_overrides(load_yaml(ROOT / "configs" / "table_quickstart.yaml"),
                           [o for o in TINY if not o.startswith("eval.offline.tolerance")])
    run_dir = tmp_path / "search"
    result, stdout = _tune(base, tiny_space(run_dir))
    err = capsys.readouterr().err
    assert result["selected"] is None and "no policy is released" in result["headline"]["selected"]
    assert "no trial produced a score" in err and "InfeasibleEvaluation" in err
    assert "InfeasibleEvaluation" not in stdout and "failed" not in stdout
    curator = json.loads((run_dir / "curator" / "summary.json").read_text())
    assert sum(curator["failures"].values()) == curator["trials_run"] > 0
    assert "failures" not in json.loads((run_dir / "release" / "summary.json").read_text())


def test_a_run_given_a_released_count_releases_none(tmp_path):
    """The pipeline side: with released_count the run opens no count stage and derives its rate from the given
    count; a count for other cells is refused before anything is written."""
    from dporl.pipelines import get_pipeline
    from dporl.utils.config import from_dict

    pipeline = get_pipeline("train")
    data = {**tiny_base(), "run_dir": str(tmp_path / "run"),
            "released_count": {"count": 1500, "cells": {"train": 800, "evaluate0": 230, "evaluate1": 230,
                                                        "evaluate2": 240}, "epsilon": 0.1}}
    config = from_dict(pipeline.config_cls, data)
    assert config.count_budget() is None and "unit_count" not in config.stage_budgets()
    with pytest.raises(ValidationError) as info:
        from_dict(pipeline.config_cls, {**data, "method": "mixed"})
    assert info.value.field == "released_count"
    bad = from_dict(pipeline.config_cls, {**data, "released_count": {"count": 1500, "cells": None, "epsilon": 0.1}})
    with pytest.raises(ValidationError) as info:
        with contextlib.redirect_stdout(io.StringIO()):
            pipeline.run(bad)
    assert info.value.field == "count" and not (tmp_path / "run").exists()


def test_command_line(tmp_path):
    config = tmp_path / "base.yaml"
    space = tmp_path / "space.yaml"
    import yaml

    config.write_text(yaml.safe_dump(tiny_base()))
    space.write_text(yaml.safe_dump({**tiny_space(tmp_path / "cli"), "trials": {"mean": 2}, "trial_epsilon": 0.5,
                                     "space": {"algorithm.alpha": {"choices": [0.5, 1.0]}}}))
    command = [sys.executable, "-m", "dporl", "tune", "--config", str(config), "--space", str(space)]
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", "")}
    first = subprocess.run(command + ["tune.noise_seed=12", "trainer.max_steps=20", "tune.progress=true"],
                           capture_output=True, text=True,
                           env=env, cwd=tmp_path, timeout=600)
    assert first.returncode == 0, first.stderr
    last = first.stdout.strip().splitlines()[-1]
    assert last.startswith("GUARANTEE: (") and "privacy unit: clinician" in last
    assert "curator-only" in first.stderr  # progress goes to stderr, labelled
    again = subprocess.run(command + ["tune.noise_seed=12", "trainer.max_steps=20"], capture_output=True, text=True,
                           env=env, cwd=tmp_path, timeout=600)
    assert again.returncode == 2 and "already holds files" in again.stderr
    resumed = subprocess.run(command + ["--resume", "tune.noise_seed=12", "trainer.max_steps=20"], capture_output=True,
                             text=True, env=env, cwd=tmp_path, timeout=600)
    assert resumed.returncode == 0 and resumed.stdout.strip().splitlines()[-1] == last


@pytest.mark.slow  # starting Ray dominates (~15-50 s)
def test_ray_gives_the_same_search(search, tmp_path):
    pytest.importorskip("ray")
    import ray

    _, reference, _, curator = search
    parallel, _ = _tune(tiny_base(), tiny_space(tmp_path / "search", workers=2))
    assert not ray.is_initialized()
    assert parallel["selected"] == reference["selected"]
    rows = json.loads((tmp_path / "search" / "curator" / "summary.json").read_text())["results"]
    assert [r["score"] for r in rows] == [r["score"] for r in curator["results"]]


def test_the_shipped_cartpole_ppo_space_is_accepted_for_dp_sgd_and_plans_one_class_per_batch_size():
    """configs/tune_cartpole_ppo_space.yaml against configs/expert_cql_cartpole_ppo.yaml with method=dp_sgd: the space
    passes the search's checks, and its privacy classes are the batch sizes (the rate B / m~ changes the privacy; the
    learning rate, alpha and clip do not), writing nothing."""
    from pathlib import Path

    from dporl.tuning.config import TuneConfig
    from dporl.tuning.planning import trial_kind
    from dporl.utils.config import apply_overrides, from_dict, load_yaml

    root = Path(__file__).resolve().parents[1]
    base = apply_overrides(load_yaml(root / "configs" / "expert_cql_cartpole_ppo.yaml"), ["method=dp_sgd"])
    settings = from_dict(TuneConfig, load_yaml(root / "configs" / "tune_cartpole_ppo_space.yaml"))
    kind = trial_kind(base["pipeline"])
    kind.check_base(kind.config(base))
    kind.check_space(settings.search_space, base)
    assert sorted(c["batch_size"] for c in kind.privacy_classes(settings.search_space)) == [128, 256, 512]
