"""A private search over the methods with the stable-prefix release (``mixed``, ``stable_only``): the release runs
once before the trials as its own stage of the search's ledger, every trial reads it as a public input, and ONE
guarantee composes the count, the release and the selection of the trials."""

from __future__ import annotations

import contextlib
import io
import json

import pytest

import dporl
from dporl.algos.stable_prefix import StablePrefixConfig, accounting_plan
from dporl.data.dataset import TrajectoryDataset
from dporl.privacy.accountants import epsilon_for
from dporl.privacy.count import LOWER_BOUND_FAILURE, CountPlan
from dporl.privacy.events import MixtureEvent, SelectionEvent, event_from_dict
from dporl.privacy.selection import trial_rdp
from dporl.train.run_dir import read_journal
from dporl.tuning.planning import TrialPrivacy
from dporl.utils.validation import ValidationError
from test_expert_cql import P_MIN, log_lqr_experts

EPSILON, DELTA, COUNT_FRACTION, RELEASE_FRACTION, RUNS = 10.0, 1e-5, 0.05, 0.5, 5


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    return log_lqr_experts(tmp_path_factory.mktemp("logged"), {"data.npz": 0})


def base(logged, method: str = "mixed") -> dict:
    return {
        "pipeline": "train", "method": method, "run_dir": "unused", "epsilon": EPSILON, "delta": DELTA,
        "batch_size": 16, "count_fraction": COUNT_FRACTION, "release_fraction": RELEASE_FRACTION,
        "data": {"dataset": str(logged / "data.npz"), "expert_set": str(logged / "experts.pt")},
        "release": {"trajectories": RUNS},
        "dp": {"p_dp": 0.5, "accountant": "rdp"},
        "algorithm": {"name": "cql", "hidden_sizes": [16]},
        "trainer": {"max_steps": 20, "eval_every": 20, "log_every": 20, "checkpoint_every": 20, "progress": False},
        "eval": {"episodes": 2, "num_envs": 2, "max_episode_steps": 50},
    }


def space(run_dir, **settings) -> dict:
    return {"run_dir": str(run_dir), "noise_seed": 5, "progress": False,
            "trials": {"distribution": "poisson", "mean": 2},
            "space": {"trainer.optimizer.lr": {"loguniform": [1e-3, 1e-2]}, "algorithm.alpha": {"uniform": [0.1, 2.0]}},
            **settings}


def tune(config, settings, **kwargs):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = dporl.tune(config, settings, **kwargs)
    return result, out.getvalue()


@pytest.fixture
def releases(monkeypatch):
    """Every stable-prefix release run (the call the pipeline's release stage makes), counted."""
    import dporl.pipelines.train.release as release_module

    calls, real = [], release_module.release_stable_prefixes
    monkeypatch.setattr(release_module, "release_stable_prefixes",
                        lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
    return calls


@pytest.fixture(scope="module")
def search(logged, tmp_path_factory):
    import dporl.pipelines.train.release as release_module

    run_dir = tmp_path_factory.mktemp("tune") / "mixed"
    calls, real = [], release_module.release_stable_prefixes
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(release_module, "release_stable_prefixes",
                      lambda *args, **kwargs: calls.append(1) or real(*args, **kwargs))
        result, stdout = tune(base(logged), space(run_dir))
    curator = json.loads((run_dir / "curator" / "summary.json").read_text())
    return run_dir, result, stdout, curator, len(calls)


def test_one_guarantee_composes_the_count_the_release_and_the_selection(search):
    """The printed guarantee is the composition of the three events, each analysed here through the accountant from
    public inputs (the count's and the release's events from their plans, the selection's curve converted)."""
    run_dir, result, stdout, curator, _ = search
    privacy = result["privacy"]
    assert privacy["void"] is None and stdout.count("GUARANTEE:") == 1
    stages = {s["name"]: s for s in privacy["stages"]}
    assert list(stages) == ["unit_count", "release", "selection"]
    # The budgets the base config gives each: the count's share, then the paper's split of the rest.
    count_delta = 2 * LOWER_BOUND_FAILURE * DELTA  # the charged failure of the lower bound the release checks
    assert stages["unit_count"]["budget"] == [pytest.approx(COUNT_FRACTION * EPSILON), pytest.approx(count_delta)]
    rest_eps, rest_delta = EPSILON * (1 - COUNT_FRACTION), DELTA - count_delta
    eps1, delta1 = RELEASE_FRACTION * rest_eps, rest_delta / 2
    assert stages["release"]["budget"] == [pytest.approx(eps1), pytest.approx(delta1)]
    assert stages["selection"]["budget"] == [pytest.approx(rest_eps - eps1), pytest.approx(rest_delta / 2)]
    # Each stage's events, recomputed from public inputs, and analysed independently.
    count = CountPlan(COUNT_FRACTION * EPSILON, None, count_delta / 2)
    assert [(event_from_dict(e), c) for e, c in stages["unit_count"]["events"]] == count.events
    release = accounting_plan(epsilon=eps1, delta=delta1, config=StablePrefixConfig(trajectories=RUNS), p_min=P_MIN,
                              n_experts=None)
    assert [(event_from_dict(e), c) for e, c in stages["release"]["events"]] == [(release.budget.event, RUNS)]
    [(payload, times)] = stages["selection"]["events"]
    assert times == 1
    selection = event_from_dict(payload)
    assert isinstance(selection, SelectionEvent) and selection.distribution == "poisson" and selection.mu == 2
    expected = (epsilon_for(count.events, count_delta, "pld")
                + epsilon_for([(release.budget.event, RUNS)], delta1, "pld")
                + epsilon_for([(selection, 1)], rest_delta / 2, "rdp"))
    guarantee = privacy["guarantee"]
    assert guarantee["epsilon"] == pytest.approx(expected, rel=1e-9) and guarantee["epsilon"] <= EPSILON
    assert guarantee["delta"] == pytest.approx(DELTA, rel=1e-12)
    [line] = [line for line in stdout.splitlines() if line.startswith("GUARANTEE:")]
    assert f"{guarantee['epsilon']:.4g}" in line


def test_the_release_runs_once_and_every_trial_reads_it(search):
    """One release for the whole search; no trial releases (or counts) again: each trial's ledger holds only its
    mixture training steps, which the search's SelectionEvent planned."""
    run_dir, result, _, curator, calls = search
    assert calls == 1
    trials = curator["trials_run"]
    assert trials >= 1
    selection = event_from_dict([s for s in result["privacy"]["stages"] if s["name"] == "selection"][0]["events"][0][0])
    stable = TrajectoryDataset.load(run_dir / "release" / "d_stable.npz")
    assert json.loads((run_dir / "release" / "release.json").read_text())["runs"] == RUNS
    assert result["release"]["runs"] == RUNS
    for i in range(trials):
        trial = run_dir / "curator" / "trials" / f"trial_{i:04d}"
        report = json.loads((trial / "release" / "privacy_report.json").read_text())
        assert [s["name"] for s in report["stages"]] == ["train"]
        realised = TrialPrivacy.from_report(report).parts()
        assert all(isinstance(e, MixtureEvent) for part in realised for e, _ in part)
        assert set(realised) <= set(selection.trial)
        assert all(trial_rdp(realised) <= trial_rdp(selection.trial) + 1e-12)
        config = json.loads((trial / "curator" / "provenance.json").read_text())["config"]
        assert config["released_stable"]["fingerprint"] == stable.fingerprint()
        assert not (trial / "release" / "d_stable.npz").exists()
    assert (run_dir / "release" / "selected.json").is_file() == (result["selected"] is not None)


def test_a_space_naming_a_release_hyperparameter_is_refused(logged, tmp_path, releases):
    for key, values in (("release.trajectories", [3, 5]), ("release_fraction", [0.3, 0.5]),
                        ("release.monotone", [True, False])):
        settings = space(tmp_path / "x", space={key: {"choices": values}})
        with pytest.raises(ValidationError, match="stable-prefix release") as info:
            tune(base(logged), settings)
        assert info.value.field == f"space.{key}"
    with pytest.raises(ValidationError) as info:  # the paper's logged variant: no guarantee to compose
        tune({**base(logged), "release": {"trajectories": RUNS, "source": "logged"}}, space(tmp_path / "x"))
    assert info.value.field == "release.source"
    assert not (tmp_path / "x").exists() and releases == []


def test_resume_reuses_the_journaled_release(logged, search, tmp_path, monkeypatch, releases):
    """A search interrupted inside its first trial, resumed: the release is read back from the journal and the
    run directory (never run again), the selection is charged once, and the result is the uninterrupted search's."""
    import dporl.tuning.trials as trials_module

    _, reference, _, _, _ = search
    real = trials_module.run_trial

    def interrupted(spec):
        raise KeyboardInterrupt

    monkeypatch.setattr(trials_module, "run_trial", interrupted)
    run_dir = tmp_path / "mixed"
    with pytest.raises(KeyboardInterrupt):
        tune(base(logged), space(run_dir))
    assert releases == [1]
    journal = read_journal(run_dir / "curator" / "journal.json")
    assert sum(c for _, c in journal.stages["release"].accountant.history) == RUNS
    fingerprint = TrajectoryDataset.load(run_dir / "release" / "d_stable.npz").fingerprint()
    monkeypatch.setattr(trials_module, "run_trial", real)
    resumed, stdout = tune(base(logged), space(run_dir), mode="resume")
    assert releases == [1]  # not released again
    journal = read_journal(run_dir / "curator" / "journal.json")
    assert sum(c for _, c in journal.stages["release"].accountant.history) == RUNS
    assert len(journal.stages["selection"].accountant) == 1
    assert TrajectoryDataset.load(run_dir / "release" / "d_stable.npz").fingerprint() == fingerprint
    assert resumed["privacy"]["guarantee"] == reference["privacy"]["guarantee"]
    assert resumed["selected"] == reference["selected"] and resumed["release"] == reference["release"]
    assert stdout.count("GUARANTEE:") == 1


def test_stable_only_trials_are_post_processing(logged, tmp_path, releases):
    """stable_only trials train without noise on the search's D_stable and are scored in the public simulator:
    they spend nothing, so the search's ledger is the count and the release alone (no selection event)."""
    result, stdout = tune(base(logged, "stable_only"), space(tmp_path / "stable", trials={"mean": 2}))
    assert releases == [1]
    stages = {s["name"]: s for s in result["privacy"]["stages"]}
    assert list(stages) == ["unit_count", "release"]
    count_delta = stages["unit_count"]["budget"][1]
    assert stages["release"]["budget"] == [pytest.approx(EPSILON * (1 - COUNT_FRACTION)),
                                           pytest.approx(DELTA - count_delta)]
    assert result["privacy"]["guarantee"]["epsilon"] <= EPSILON and stdout.count("GUARANTEE:") == 1


def test_a_run_given_a_released_stable_releases_none(logged, tmp_path, search, releases):
    """The pipeline side: with released_stable (and released_count) a mixed run opens no release stage, trains on
    the given D_stable with its whole budget, and refuses a file that is not the fingerprinted one before writing."""
    from dporl.pipelines import get_pipeline
    from dporl.utils.config import from_dict

    run_dir, reference, _, _, _ = search
    pipeline = get_pipeline("train")
    trial = json.loads((run_dir / "curator" / "trials" / "trial_0000" / "curator" / "provenance.json").read_text())
    data = {**trial["config"], "run_dir": str(tmp_path / "run")}
    config = from_dict(pipeline.config_cls, data)
    assert set(config.stage_budgets()) == {"train"} and config.stage_budgets()["train"] == (config.epsilon, config.delta)
    with pytest.raises(ValidationError) as info:
        from_dict(pipeline.config_cls, {**data, "released_count": None})
    assert info.value.field == "released_stable"
    with pytest.raises(ValidationError) as info:
        from_dict(pipeline.config_cls, {**data, "method": "dp_sgd"})
    assert info.value.field == "released_stable"
    bad = from_dict(pipeline.config_cls, {**data, "released_stable": {**data["released_stable"], "fingerprint": "0" * 64}})
    with pytest.raises(ValidationError) as info:
        with contextlib.redirect_stdout(io.StringIO()):
            pipeline.run(bad)
    assert info.value.field == "released_stable.fingerprint" and not (tmp_path / "run").exists()
    with contextlib.redirect_stdout(io.StringIO()):
        summary = pipeline.run(config)
    assert [s["name"] for s in summary["privacy"]["stages"]] == ["train"] and releases == []


def test_the_shipped_mixed_space_is_accepted_for_the_quickstart():
    """configs/tune_expert_cql_quickstart_space.yaml against its base: the method, the space and its privacy classes
    (dp.p_dp's choices) pass the search's checks, writing nothing."""
    from pathlib import Path

    from dporl.tuning.config import TuneConfig
    from dporl.tuning.planning import trial_kind
    from dporl.utils.config import from_dict, load_yaml

    root = Path(__file__).resolve().parents[1]
    quickstart = load_yaml(root / "configs" / "expert_cql_quickstart.yaml")
    settings = from_dict(TuneConfig, load_yaml(root / "configs" / "tune_expert_cql_quickstart_space.yaml"))
    kind = trial_kind(quickstart["pipeline"])
    kind.check_base(kind.config(quickstart))
    kind.check_space(settings.search_space, quickstart)
    assert [c["dp.p_dp"] for c in kind.privacy_classes(settings.search_space)] == [0.1, 0.5]
