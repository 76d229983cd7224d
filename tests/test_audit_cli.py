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


def test_config_audit_of_an_expert_cql_run(tmp_path, capsys):
    pytest.importorskip("dporl.privacy.sparse_vector")
    config = tmp_path / "run.yaml"
    config.write_text(
        "pipeline: expert_cql\nmethod: mixed\nepsilon: 10.0\ndelta: 1.0e-5\nbatch_size: 20\n"
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
