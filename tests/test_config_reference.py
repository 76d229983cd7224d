"""The configuration reference is generated from the config dataclasses and committed up to date;
``dporl train --print-config`` prints the resolved config; ``dporl init table`` writes a config from a header alone,
with TODO placeholders the loader refuses by key."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dporl.cli import main
from dporl.config_reference import reference, rows
from dporl.pipelines.train.config import TrainPipelineConfig
from dporl.utils.config import from_dict, load_config, to_dict
from dporl.utils.validation import ValidationError

ROOT = Path(__file__).resolve().parents[1]


def test_docs_config_md_is_the_generated_reference():
    committed = (ROOT / "docs" / "config.md").read_text()
    assert committed == reference(), "docs/config.md is stale: python -m dporl.config_reference > docs/config.md"


def test_the_reference_lists_every_key_with_its_default_and_marks_public_facts():
    table = {row.key: row for row in rows(TrainPipelineConfig)}

    def keys(instance, prefix=""):
        for f in dataclasses.fields(instance):
            value = getattr(instance, f.name)
            yield prefix + f.name
            if dataclasses.is_dataclass(value):
                yield from keys(value, prefix + f.name + ".")

    # Every key of the default config (the algorithm's hyper-parameters have their own tables, by algorithm).
    expected = {key for key in keys(TrainPipelineConfig()) if not key.startswith("algorithm.")}
    assert expected <= set(table)
    assert {"data.columns.actions", "data.columns.unit", "eval.offline.value_range", "eval.offline.unit_clip"} <= \
        {key for key, row in table.items() if row.public}
    assert not table["epsilon"].public and not table["trainer.max_steps"].public
    assert table["epsilon"].default == "10.0" and table["eval.offline.folds"].default == "3"
    assert table["dp.max_grad_norm"].meaning == "C, per-unit gradient clip"  # from the comment beside the field
    assert table["eval.enabled"].meaning.startswith("False: no evaluation at all")
    text = reference()
    assert "## Pipeline `train`" in text and "## Algorithm `cql`" in text and "`algorithm.alpha`" in text


def test_print_config_prints_the_resolved_config_and_runs_nothing(tmp_path, capsys):
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump({"pipeline": "train", "run_dir": str(tmp_path / "run"), "epsilon": 2.0,
                                    "data": {"format": "table", "example": {"units": 40}}}))
    assert main(["train", "--config", str(path), "--print-config", "eval.offline.folds=4", "trainer.max_steps=7"]) == 0
    printed = yaml.safe_load(capsys.readouterr().out)
    assert printed["eval"]["offline"]["folds"] == 4 and printed["trainer"]["max_steps"] == 7
    assert printed["epsilon"] == 2.0 and printed["algorithm"]["name"] == "cql" and "gamma" in printed["algorithm"]
    assert printed["data"]["columns"] is None and printed["data"]["example"]["units"] == 40
    assert not (tmp_path / "run").exists()  # nothing ran, nothing was written
    # The printed YAML is a config: it loads back to the same resolved config.
    assert to_dict(from_dict(TrainPipelineConfig, printed)) == to_dict(load_config(
        TrainPipelineConfig, path, ["eval.offline.folds=4", "trainer.max_steps=7"]))
    assert main(["train", "--config", str(path), "--print-config", "eval.offline.fold=4"]) == 2
    assert "eval.offline.fold" in capsys.readouterr().err


def test_init_table_reads_the_header_only_and_its_todos_are_refused_by_key(tmp_path, capsys):
    table = tmp_path / "stays.csv"
    # A header, then rows no parser would accept: init must not read them (and must not copy any of them).
    table.write_bytes(b"stay_id,patient_id,hour,hr,bp,treatment,outcome,discharged\n"
                      b"\xff\xfe SECRET-ROW,not,a,row\x00\n" * 3)
    assert main(["init", "table", str(table), "--out", str(tmp_path / "c.yaml")]) == 0
    text = (tmp_path / "c.yaml").read_text()
    assert "SECRET" not in text
    config = yaml.safe_load(text)
    columns = config["data"]["columns"]
    assert (columns["episode"], columns["unit"], columns["step"], columns["action"], columns["reward"],
            columns["terminated"]) == ("stay_id", "patient_id", "hour", "treatment", "outcome", "discharged")
    assert columns["observations"] == ["hr", "bp"]
    # Every TODO is refused, naming its key, until it is filled in; then the config loads.
    fills = {"epsilon": 1.0, "data.columns.actions": ["none", "fluids"], "eval.offline.value_range": [-1.0, 0.0],
             "eval.offline.unit_clip": 4.0}
    given: list[str] = []
    for key in ("epsilon", "data.columns.actions", "eval.offline.value_range", "eval.offline.unit_clip"):
        with pytest.raises(ValidationError) as info:
            load_config(TrainPipelineConfig, tmp_path / "c.yaml", given)
        assert info.value.field == key and "placeholder" in str(info.value)
        given.append(f"{key}={fills[key]}")
    loaded = load_config(TrainPipelineConfig, tmp_path / "c.yaml", given)
    assert loaded.data.columns.actions == ["none", "fluids"] and loaded.eval.offline.unit_clip == 4.0
    assert main(["train", "--config", str(tmp_path / "c.yaml")]) == 2  # the command line refuses it the same way
    assert "epsilon: still a placeholder" in capsys.readouterr().err
    # A header without a unit-like column: the unit is a TODO too; the output file is never overwritten.
    (tmp_path / "plain.csv").write_text("a,b,c\n1,2,3\n")
    assert main(["init", "table", str(tmp_path / "plain.csv")]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["data"]["columns"]["unit"].startswith("TODO:")
    assert main(["init", "table", str(table), "--out", str(tmp_path / "c.yaml")]) == 2


def test_the_reference_module_runs_as_a_command():
    out = subprocess.run([sys.executable, "-m", "dporl.config_reference"], capture_output=True, text=True, check=True)
    assert out.stdout == reference()
