"""Pipeline "train" with CQL: methods end to end on a tiny CartPole expert pool, budgets, accounting, refusals."""

from __future__ import annotations

import dataclasses
import json

import pytest

from dporl.data.dataset import TrajectoryDataset
from dporl.experts.analytic import cartpole_lqr_experts
from dporl.experts.collect import collect
from dporl.experts.expert_set import ExpertSet
from dporl.pipelines import get_pipeline
from dporl.pipelines.train import TRAIN_STAGE, TrainPipelineConfig, run
from dporl.privacy.calibration import calibrate_noise_multiplier
from dporl.privacy.events import MixtureEvent, PoissonGaussianEvent
from dporl.utils.config import from_dict, to_dict
from dporl.utils.validation import PrivacyBudgetError, ValidationError

M, PER_EXPERT, P_MIN = 600, 1, 0.1


def log_lqr_experts(root, datasets: dict[str, int]):
    """600 LQR experts (3 physics settings) in ``root/experts.pt``, and per (file name, logging seed) in
    ``datasets`` one dataset of 1 episode each of at most 60 steps, in default CartPole."""
    settings = [{"gravity": g, "force_mag": 10.0, "masscart": 1.0} for g in (9.0, 9.8, 10.5)]
    policy, _ = cartpole_lqr_experts(settings, M // len(settings), seed=0)
    experts = ExpertSet(policy, P_MIN, "argmax")
    experts.save(root / "experts.pt")
    for name, seed in datasets.items():
        collect(experts, "CartPole-v1", PER_EXPERT, max_episode_steps=60, seed=seed, progress=False).save(root / name)
    return root


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    return log_lqr_experts(tmp_path_factory.mktemp("logged"), {"data.npz": 0})


def config(logged, tmp_path, **overrides) -> TrainPipelineConfig:
    base = {
        "pipeline": "train",
        "run_dir": str(tmp_path / "run"),
        "epsilon": 10.0,
        "delta": 1e-5,
        "batch_size": 16,
        # The count's lower bound is m~ - O(log(1/delta) / eps_count): 600 experts need a larger share than 1%
        "count_fraction": 0.05,
        "noise_seed": 1,
        "data": {"dataset": str(logged / "data.npz"), "expert_set": str(logged / "experts.pt")},
        "release": {"trajectories": 5},
        "dp": {"noise_multiplier": 1.0, "p_dp": 0.5},
        "algorithm": {"name": "cql", "hidden_sizes": [16]},
        "trainer": {"max_steps": 30, "eval_every": 15, "log_every": 10, "checkpoint_every": 15, "progress": False},
        "eval": {"episodes": 2, "num_envs": 2, "max_episode_steps": 50},
    }
    return from_dict(TrainPipelineConfig, with_overrides(base, overrides))


def with_metadata(data: TrajectoryDataset, **changes) -> TrajectoryDataset:
    return TrajectoryDataset(**{k: getattr(data, k) for k in (
        "observations", "actions", "rewards", "terminations", "truncations", "episode_lengths", "unit_ids",
        "behavior_log_probs")}, metadata=dataclasses.replace(data.metadata, **changes))


def with_overrides(base: dict, overrides: dict) -> dict:
    """``base`` with ``{"key": v}`` and ``{"section.key": v}`` overrides applied (one level of sections)."""
    for key, value in overrides.items():
        section, _, name = key.partition(".")
        if name:
            base[section] = {**base[section], name: value}
        else:
            base[key] = value
    return base


def test_mixed_runs_end_to_end_with_sound_mixture_accounting(logged, tmp_path, capsys):
    cfg = config(logged, tmp_path)
    summary = run(cfg)
    stages = {s["name"]: s for s in summary["privacy"]["stages"]}
    # The count first (5% of eps; delta: its lower bound's charged failure, 2 x 0.005 delta), then the paper's split
    # of the rest: eps1 = eps2, delta1 = delta2.
    assert list(stages) == ["unit_count", "release", TRAIN_STAGE]
    assert stages["unit_count"]["budget"] == [0.5, pytest.approx(1e-7)]
    rest = (1e-5 - 1e-7) / 2
    assert stages["release"]["budget"] == [4.75, pytest.approx(rest)]
    assert stages[TRAIN_STAGE]["budget"] == [4.75, pytest.approx(rest)]
    count = stages["unit_count"]["released"]
    assert count == summary["unit_count"] and count["cells"] is None and count["epsilon"] == 0.5
    m_tilde = count["count"]
    assert abs(m_tilde - M) < 60  # P[|Z| >= 60] = 2 e^{-30} / (1 + e^{-0.5}) at eps 0.5
    (release_event, release_count), = stages["release"]["events"]
    assert release_count == 5 and release_event["type"] == "ApproxDPEvent"
    assert release_event["epsilon"] == pytest.approx(2 * summary["release"]["epsilon_prime"])
    # One mixture event per training step (p_dp = 0.5 around a rate-B/m~ Poisson Gaussian), whatever branch ran.
    (train_event, train_count), = stages[TRAIN_STAGE]["events"]
    assert train_count == summary["steps"] == 30
    assert train_event == {"type": "MixtureEvent", "probability": 0.5, "event": {
        "type": "PoissonGaussianEvent", "noise_multiplier": 1.0, "sample_rate": 16 / m_tilde}}
    guarantee = summary["privacy"]["guarantee"]
    assert guarantee["unit"] == "expert" and guarantee["epsilon"] <= 10.0 + 1e-9
    assert guarantee["delta"] == pytest.approx(1e-5, rel=1e-12)
    # The paper's figure (rate p_dp * q, no mixture) is a paper claim, smaller than the sound training-stage epsilon.
    (claim,) = summary["privacy"]["paper_figures_NOT_guarantees"]
    assert claim["name"].startswith("Algorithm 3") and claim["epsilon"] < stages[TRAIN_STAGE]["epsilon"]
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert any(line.startswith("GUARANTEE: (") for line in lines)
    assert any(line.startswith("the paper's figure, NOT a guarantee: Algorithm 3") for line in lines)
    assert (tmp_path / "run" / "release" / "d_stable.npz").exists()
    assert (tmp_path / "run" / "curator" / "release_runs.json").exists()
    assert not list((tmp_path / "run").rglob("d_unstable.npz"))  # D_unstable is the logged data: never copied
    assert "eval/return_mean" in summary["final_metrics"]
    saved = json.loads((tmp_path / "run" / "release" / "summary.json").read_text())
    assert saved == json.loads(json.dumps(summary)) and saved["steps"] == 30
    assert "config" not in saved and json.loads((tmp_path / "run" / "curator" / "summary.json").read_text())["config"]
    # Nothing public counts the private logged data: no unstable count, and its size appears nowhere.
    data = TrajectoryDataset.load(logged / "data.npz")
    release_files = " ".join(p.read_text() for p in (tmp_path / "run" / "release").glob("*.json"))
    assert "unstable" not in out and "unstable" not in release_files
    for text in (out, release_files):
        assert str(data.n_transitions) not in text


def test_dp_sgd_trains_until_the_budget_is_spent(logged, tmp_path):
    # sigma = 1 at rate 16/600: eps = 2 (RDP) allows tens of steps, far below the 10^6 step cap.
    cfg = config(logged, tmp_path, method="dp_sgd", epsilon=2.0, **{"dp.noise_multiplier": 1.0,
                                                                      "trainer.max_steps": 1_000_000})
    summary = run(cfg)
    count, stage = summary["privacy"]["stages"]
    assert count["name"] == "unit_count" and count["budget"] == [0.1, 0.0]  # no lower bound relied on: pure
    assert stage["name"] == TRAIN_STAGE and stage["budget"] == [1.9, 1e-5]
    assert 0 < summary["steps"] < 1_000 and stage["epsilon"] <= 2.0
    # Single stage, unchanged: the largest step count, so within one step of the budget (epsilon grows about like
    # sqrt(steps) here: one step of ~56 moves it by ~1 / 112 < 1%).
    assert summary["privacy"]["guarantee"]["epsilon"] >= 0.99 * 2.0
    assert summary["release"] is None


def count_noise(monkeypatch, z: int) -> None:
    """Every count's discrete Laplace draw is ``z`` (the released estimate injected where the mechanism draws it)."""
    import dporl.privacy.count as count_module

    monkeypatch.setattr(count_module, "sample_discrete_laplace", lambda scale, rng: z)


def test_mixed_training_is_calibrated_to_the_whole_run_budget(logged, tmp_path, capsys, monkeypatch):
    """Algorithm 3's training stage takes what the count and the release leave under the joint PLD of every stage:
    the printed guarantee meets the run budget (within 1%, never above), with less noise than a fixed split."""
    count_noise(monkeypatch, 0)  # m~ = m: the config audit below plans at the true m, as for a run that drew 0
    cfg = config(logged, tmp_path, epsilon=2.0, **{"dp.noise_multiplier": None})
    summary = run(cfg)
    guarantee = summary["privacy"]["guarantee"]
    # sigma is calibrated to a relative 1e-3 (epsilon moves at most ~2x as fast); 1e-12: the ledger's round-off.
    assert 0.99 * 2.0 <= guarantee["epsilon"] <= 2.0 * (1 + 1e-12) and guarantee["delta"] == pytest.approx(1e-5)
    assert "joint PLD" in guarantee["analysis"] and summary["steps"] == 30
    stages = {s["name"]: s for s in summary["privacy"]["stages"]}
    assert stages[TRAIN_STAGE]["shares_run_budget"] and not stages["release"]["shares_run_budget"]
    nominal = stages[TRAIN_STAGE]["budget"]  # the nominal share, past which the stage may spend
    assert nominal == [0.95, pytest.approx((1e-5 - 1e-7) / 2)]
    assert summary["unit_count"]["count"] == M
    rate = 16 / M
    fixed = calibrate_noise_multiplier(
        nominal[0], nominal[1], 30, make_event=lambda sigma: MixtureEvent(0.5, PoissonGaussianEvent(sigma, rate)))
    assert summary["noise_multiplier"] < 0.9 * fixed
    assert f"GUARANTEE: ({guarantee['epsilon']:.4g}, 1e-05)-DP" in capsys.readouterr().out

    # The config audit attacks the noise the run added, not the fixed split's: with the data on disk (planned on
    # them) and from public quantities alone (m, p_min: the release's events depend on nothing else).
    from dporl.audit.config_audit import train_audits

    settings = to_dict(cfg)
    on_disk = train_audits(settings)[0]
    settings["data"] = {**settings["data"], "dataset": str(tmp_path / "absent.npz")}
    from_public = train_audits(settings, n_experts=M, p_min=P_MIN)[0]
    for audit in (on_disk, from_public):
        assert audit.name == "mixture"
        assert audit.settings["noise_multiplier"] == pytest.approx(summary["noise_multiplier"], rel=1e-12)


def test_a_release_that_leaves_no_training_step_is_refused_before_the_release(logged, tmp_path):
    # f = 0.99: the release's T = 5 runs compose to ~9.4 of the 9.5 the count leaves even at the total delta (few
    # (eps, delta) pairs compose almost additively), and one sigma = 1 step at rate 16 / m costs more than the rest.
    # Replace-one: m is public, so the refusal comes before anything is written.
    with pytest.raises(PrivacyBudgetError) as info:
        run(config(logged, tmp_path / "r1", release_fraction=0.99, relation="replace_one"))
    assert info.value.field == "dp.epsilon" and "beside the run's other stages" in str(info.value)
    assert not (tmp_path / "r1" / "run").exists()
    # Add/remove: the rate depends on the released count, so the refusal follows the count (its only spend) and
    # comes before the release.
    with pytest.raises(PrivacyBudgetError) as info:
        run(config(logged, tmp_path / "ar", release_fraction=0.99))
    assert info.value.field == "dp.epsilon" and "beside the run's other stages" in str(info.value)
    journal = json.loads((tmp_path / "ar" / "run" / "curator" / "journal.json").read_text())
    assert [s["name"] for s in journal["ledger"]["stages"]] == ["unit_count"]
    assert list(journal["completed"]) == ["unit_count"]
    assert not (tmp_path / "ar" / "run" / "release" / "d_stable.npz").exists()


def test_stable_only_and_non_private(logged, tmp_path):
    stable = run(config(logged, tmp_path / "s", method="stable_only"))
    count, stage = stable["privacy"]["stages"]
    assert count["name"] == "unit_count" and count["budget"] == [0.5, pytest.approx(1e-7)]
    assert stage["name"] == "release" and stage["budget"] == [9.5, pytest.approx(1e-5 - 1e-7)]
    # The release has what the count leaves; its per-run eps' is the largest that fits (to a relative 1e-4).
    assert 0.99 * 10.0 <= stable["privacy"]["guarantee"]["epsilon"] <= 10.0 * (1 + 1e-12)
    assert stable["stable_transitions"] > 0
    plain = run(config(logged, tmp_path / "n", method="non_private"))
    assert plain["privacy"]["stages"] == [] and plain["privacy"]["guarantee"] is None


def test_stable_only_output_does_not_depend_on_the_logged_records(logged, tmp_path, capsys):
    """stable_only trains on D_stable alone, and the fresh release reads only the data's public metadata: the same
    noise seed on two datasets with different logged records prints and publishes exactly the same run."""
    data = TrajectoryDataset.load(logged / "data.npz")
    experts = ExpertSet.load(logged / "experts.pt")
    other = collect(experts, "CartPole-v1", 2, max_episode_steps=40, seed=7, progress=False)
    with_metadata(other, **{f.name: getattr(data.metadata, f.name) for f in dataclasses.fields(data.metadata)}).save(
        tmp_path / "other.npz")
    outputs = []
    for name, path in (("a", logged / "data.npz"), ("b", tmp_path / "other.npz")):
        capsys.readouterr()
        summary = run(config(logged, tmp_path / name, method="stable_only", data={
            "dataset": str(path), "expert_set": str(logged / "experts.pt")}))
        printed = capsys.readouterr().out.replace(str(tmp_path / name), "RUN")
        outputs.append((printed, summary))
    assert outputs[0] == outputs[1]


def test_logged_variant_prints_no_guarantee(logged, tmp_path, capsys):
    summary = run(config(logged, tmp_path, **{"release.source": "logged"}))
    out = capsys.readouterr().out
    assert "the paper's mechanism: NO guarantee" in out
    assert not any(line.startswith("GUARANTEE") for line in out.splitlines())
    assert summary["privacy"]["guarantee"] is None and summary["privacy"]["void"]
    names = [claim["name"] for claim in summary["privacy"]["paper_figures_NOT_guarantees"]]
    assert names[0] == "stable-prefix release of 5 LOGGED prefixes" and names[1].startswith("Algorithm 3")
    stable_only = run(config(logged, tmp_path / "s", method="stable_only", **{"release.source": "logged"}))
    assert "NO GUARANTEE: the paper's mechanism" in capsys.readouterr().out
    assert stable_only["privacy"]["guarantee"] is None


def test_dp_sgd_needs_no_simulator_or_experts_and_the_release_refuses_without_them(logged, tmp_path):
    data = TrajectoryDataset.load(logged / "data.npz")
    orphan = with_metadata(data, env_id="nowhere/Unknown-v0",
                           expert_set={**data.metadata.expert_set, "path": str(tmp_path / "missing.pt")})
    orphan.save(tmp_path / "orphan.npz")
    cfg = {"data": {"dataset": str(tmp_path / "orphan.npz")}, "eval.env_id": "CartPole-v1"}
    summary = run(config(logged, tmp_path / "dp", method="dp_sgd", **cfg))
    assert summary["privacy"]["guarantee"]["epsilon"] <= 10.0
    for method in ("stable_only", "mixed"):
        with pytest.raises(ValidationError) as info:
            run(config(logged, tmp_path / method, method=method, **cfg))
        assert info.value.field == "expert_set.path"  # the recorded expert set is not there
        assert not (tmp_path / method / "run").exists()  # refused before anything was spent or written
    with pytest.raises(ValidationError) as info:  # with the experts given, the missing simulator is named
        run(config(logged, tmp_path / "sim", method="mixed",
                   data={"dataset": str(tmp_path / "orphan.npz"), "expert_set": str(logged / "experts.pt")}))
    assert info.value.field == "dataset.metadata.env_id"
    assert not (tmp_path / "sim" / "run").exists()


def test_resume_reuses_the_paid_release(logged, tmp_path):
    cfg = config(logged, tmp_path, **{"trainer.checkpoint_every": 10})
    first = run(cfg)
    release_file = tmp_path / "run" / "release" / "d_stable.npz"
    stamp = release_file.stat().st_mtime_ns
    with pytest.raises(ValidationError) as info:  # an existing run directory is refused unless asked for
        run(cfg)
    assert info.value.field == "run_dir" and "--resume" in str(info.value)
    assert run(cfg, mode="resume") == first  # a finished run is read back, not repeated
    (tmp_path / "run" / "curator" / "summary.json").unlink()  # as if killed after its last checkpoint
    second = run(cfg, mode="resume")  # resumes from the checkpoint, release not repeated
    assert release_file.stat().st_mtime_ns == stamp
    assert second["privacy"]["guarantee"] == first["privacy"]["guarantee"]


def test_evaluate_py_from_the_release_alone(logged, tmp_path, capsys):
    import importlib.util
    import shutil
    from pathlib import Path

    run(config(logged, tmp_path, method="non_private"))
    shared = tmp_path / "handed_out"
    shutil.copytree(tmp_path / "run" / "release", shared / "release")  # no curator/ anywhere near it
    spec = importlib.util.spec_from_file_location("dporl_evaluate_cli", Path(__file__).resolve().parents[1] / "evaluate.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    capsys.readouterr()
    assert module.main(["--run", str(shared), "--episodes", "3", "--seed", "5"]) == 0
    human = capsys.readouterr().out.splitlines()  # short: the headline, then the guarantee (none: non_private)
    assert human[0].startswith("return (3 episodes, 95% interval): ") and human[-1] == "NO PRIVACY GUARANTEE"
    assert module.main(["--run", str(shared), "--episodes", "3", "--seed", "5", "--json", "--no-progress"]) == 0
    metrics = json.loads(capsys.readouterr().out)
    assert metrics["episodes"] == 3 and metrics["env_id"] == "CartPole-v1"
    assert (shared / "release" / "evaluations" / "eval_seed5_episodes3.json").exists()


def test_registered_and_refusals(logged, tmp_path):
    assert get_pipeline("train").config_cls is TrainPipelineConfig
    with pytest.raises(ValidationError) as info:
        config(logged, tmp_path, data={"dataset": None})
    assert info.value.field == "data"
    with pytest.raises(ValidationError) as info:  # refused on the released estimate, which it names
        run(config(logged, tmp_path / "b", batch_size=M + 100, method="dp_sgd"))
    assert info.value.field == "batch_size" and "the released estimate of the number of units" in str(info.value)
    assert str(M) not in str(info.value).replace("m~ = ", "")  # (m~ itself is within 60 of M, not equal to it)
    with pytest.raises(ValidationError) as info:
        config(logged, tmp_path, **{"dp.p_dp": 0.0})
    assert info.value.field == "dp.p_dp"
    with pytest.raises(PrivacyBudgetError) as info:  # m p_min = 60 < G0 at eps1 = 0.005 over 5 runs
        run(config(logged, tmp_path / "p", epsilon=0.01))
    assert info.value.field in ("p_min", "release.epsilon")


def test_sweep_writes_table_and_plot_and_records_refusals(logged, tmp_path):
    import yaml

    from dporl.pipelines.sweep import SweepConfig, run as run_sweep

    base = tmp_path / "base.yaml"
    base.write_text(yaml.safe_dump(to_dict(config(logged, tmp_path, **{"trainer.max_steps": 10}))))
    sweep = from_dict(SweepConfig, {
        "base": str(base), "epsilons": [10.0, 0.01], "methods": ["non_private", "dp_sgd", "mixed"], "seeds": [0],
        "out_dir": str(tmp_path / "sweep"), "progress": False,
    })
    summary = run_sweep(sweep)
    # non_private once; dp_sgd and mixed at both budgets; at eps = 0.01 neither a DP-SGD step nor a release fits.
    assert summary["runs"] == 5 and summary["failed"] == 2
    cells = {(e["method"], e["epsilon"]): e for e in summary["table"]}
    assert cells[("mixed", 10.0)]["seeds"] == 1 and cells[("mixed", 0.01)]["seeds"] == 0
    assert "p_min" in cells[("mixed", 0.01)]["note"] and "dp.epsilon" in cells[("dp_sgd", 0.01)]["note"]
    assert cells[("mixed", 10.0)]["guarantee_epsilon"] <= 10.0
    # non_private has no budget: the same seeds fill every epsilon column.
    assert cells[("non_private", 10.0)]["return_mean"] == cells[("non_private", 0.01)]["return_mean"]
    for name in ("runs.csv", "results.md", "return_vs_epsilon.png"):
        assert (tmp_path / "sweep" / name).stat().st_size > 0
    assert (tmp_path / "sweep" / "results.md").read_text().count("| non_private |") == 1
    assert run_sweep(sweep)["table"] == summary["table"]  # finished runs are read back, not repeated
    changed = from_dict(SweepConfig, {**to_dict(sweep), "overrides": ["dp.p_dp=0.9"], "methods": ["mixed"]})
    assert "another configuration" in run_sweep(changed)["table"][0]["note"]  # never mislabels a stale run


def test_shipped_configs_parse():
    from pathlib import Path

    from dporl.pipelines.dataset import DatasetConfig
    from dporl.pipelines.sweep import SweepConfig
    from dporl.utils.config import load_yaml

    root = Path(__file__).resolve().parent.parent / "configs"
    configs = sorted(root.glob("expert_cql_*.yaml"))
    assert len(configs) >= 9
    for path in configs:
        parsed = from_dict(TrainPipelineConfig, load_yaml(path))
        if parsed.data.generate is not None:
            from_dict(DatasetConfig, {"pipeline": "dataset", **parsed.data.generate})
    for path in sorted(root.glob("sweep_*.yaml")):
        sweep = from_dict(SweepConfig, load_yaml(path))
        from_dict(TrainPipelineConfig, load_yaml(root / sweep.base))
