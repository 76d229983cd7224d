"""``python -m dporl.audit``: built-in and config audits, JSON output, exit codes, clear errors."""

import json

import pytest

from dporl.audit.__main__ import main
from dporl.audit.registry import AUDITS, POWER_SETTINGS, build_audit
from dporl.utils.validation import ValidationError


def test_every_audit_has_a_power_setting_and_unknown_settings_are_refused():
    assert set(POWER_SETTINGS) == set(AUDITS)
    with pytest.raises(ValidationError, match="bogus"):
        build_audit("gaussian", {"bogus": 1})
    with pytest.raises(ValidationError, match="mechanism"):
        build_audit("nope")


def test_mechanism_audit_writes_json_and_exits_by_verdict(tmp_path, capsys):
    out = tmp_path / "audit.json"
    assert main(["--mechanism", "laplace", "--trials", "20000", "--no-progress", "--out", str(out), "noise_multiplier=2"]) == 0
    payload = json.loads(out.read_text())
    (result,) = payload["results"]
    assert result["mechanism"] == "laplace" and not result["violated"]
    assert result["claimed_epsilon"] == pytest.approx(0.5, rel=1e-3)
    assert 0 < result["epsilon_lower_bound"] <= result["claimed_epsilon"]
    assert [p.name for p in tmp_path.iterdir()] == ["audit.json"]  # atomic: no temporary left behind
    # The power variant refutes the claim: exit status 1.
    assert main(["--mechanism", "laplace", "--trials", "20000", "--no-progress", "--power"]) == 1
    assert "VIOLATED" in capsys.readouterr().out


def test_bad_requests_exit_2_with_the_field_named(tmp_path, capsys):
    assert main(["--mechanism", "gaussian", "--trials", "100", "sigma=3"]) == 2
    assert "sigma" in capsys.readouterr().err
    assert main(["--mechanism", "gaussian", "--trials", "2"]) == 2
    assert "trials" in capsys.readouterr().err
    config = tmp_path / "fnq.yaml"
    config.write_text("pipeline: fnq\n")
    assert main(["--config", str(config), "--trials", "100"]) == 2
    assert "pipeline" in capsys.readouterr().err
    assert not (tmp_path / "audit.json").exists()


def test_config_audit_of_a_train_run(tmp_path, capsys):
    pytest.importorskip("dporl.privacy.sparse_vector")
    config = tmp_path / "run.yaml"
    config.write_text(
        "pipeline: train\nmethod: mixed\nepsilon: 10.0\ndelta: 1.0e-5\nbatch_size: 20\n"
        "release: {trajectories: 2}\ndp: {noise_multiplier: 1.0, p_dp: 0.5}\ntrainer: {max_steps: 100}\n"
    )
    out = tmp_path / "audit.json"
    code = main(["--config", str(config), "--trials", "2000", "--no-progress", "--n-experts", "40", "--p-min", "0.2",
                 "--out", str(out)])
    assert code == 0, capsys.readouterr()
    names = [r["mechanism"] for r in json.loads(out.read_text())["results"]]
    assert names == ["mixture", "stable_prefix"]


def test_config_audit_of_an_ope_run(tmp_path):
    config = tmp_path / "ope.yaml"
    config.write_text("pipeline: ope\nm_values: [100, 1000]\nepsilon: 1.0\ngpope: {expected_batch_size: 10}\n")
    out = tmp_path / "audit.json"
    assert main(["--config", str(config), "--trials", "2000", "--no-progress", "--out", str(out)]) == 0
    results = json.loads(out.read_text())["results"]
    assert [r["mechanism"] for r in results] == ["gpope", "dp_lsw", "dp_lsl"]
    # GPOPE's claim is the calibrated per-step one: q = 10 / 100 and the sigma that fits 10 steps in eps = 1.
    assert results[0]["settings"]["sample_rate"] == 0.1
    assert 0 < results[0]["claimed_epsilon"] < 1.0
    assert all(r["privacy_unit"] == "trajectory" for r in results)


def test_config_audit_of_a_paper_mode_ope_run(tmp_path):
    config = tmp_path / "ope.yaml"
    config.write_text("pipeline: ope\nm_values: [50]\nepsilon: 2.0\ngpope: {mode: paper, noise_multiplier: 3.0}\n"
                      "output_perturbation: {methods: []}\n")
    out = tmp_path / "audit.json"
    assert main(["--config", str(config), "--trials", "2000", "--no-progress", "--out", str(out)]) == 0
    (result,) = json.loads(out.read_text())["results"]
    assert result["mechanism"] == "gpope_paper" and result["settings"]["n_trajectories"] == 50
    assert "SampledWithoutReplacementGaussianEvent(noise_multiplier=1.5, sample_size=1, population=50)" in result["analysis"]


def test_config_audit_attacks_the_configs_own_fixed_data(tmp_path):
    """With the config's dataset and expert set on disk, the release audit runs on D = that data and D' = D minus
    expert --target, for the configured release.source (logged: dporl claims nothing, the paper's figure is a
    reference)."""
    from dporl.experts.analytic import cartpole_lqr_experts
    from dporl.experts.collect import collect
    from dporl.experts.expert_set import ExpertSet

    policy, _ = cartpole_lqr_experts([{"gravity": 9.8}], 120, seed=0)
    experts = ExpertSet(policy, 0.1, "argmax")
    experts.save(tmp_path / "experts.pt")
    collect(experts, "CartPole-v1", 2, max_episode_steps=30, seed=0, progress=False).save(tmp_path / "data.npz")
    for source in ("fresh", "logged"):
        config = tmp_path / f"{source}.yaml"
        config.write_text(
            f"pipeline: train\nmethod: stable_only\nepsilon: 2.0\ndelta: 1.0e-5\n"
            f"data: {{dataset: {tmp_path / 'data.npz'}, expert_set: {tmp_path / 'experts.pt'}}}\n"
            f"release: {{trajectories: 2, source: {source}}}\n"
        )
        out = tmp_path / f"{source}.json"
        assert main(["--config", str(config), "--trials", "2000", "--no-progress", "--target", "3",
                     "--out", str(out)]) == 0
        (result,) = json.loads(out.read_text())["results"]
        assert "the dataset's 120 experts" in result["neighbours"] and "expert 3" in result["neighbours"]
        assert result["mechanism"] == ("stable_prefix" if source == "fresh" else "stable_prefix_logged")
        assert (result["claimed_epsilon"] == float("inf")) == (source == "logged")
