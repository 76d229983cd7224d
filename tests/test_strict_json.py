"""Strict JSON both ways: dporl writes a non-finite number as ``null`` (never the ``NaN`` / ``Infinity`` tokens other
readers refuse) and refuses those tokens in every JSON file it reads."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import dporl
from dporl.eval.ope_coverage import TreatmentChain
from dporl.pipelines.offline_eval import OfflineEvalConfig
from dporl.train.export import GreedyPolicy, load_policy, save_policy
from dporl.utils.io import atomic_write_json, dump_json, json_ready, parse_json, read_json
from dporl.utils.validation import ValidationError

torch.set_num_threads(1)


def strict_loads(text: str):
    def refuse(token):
        raise AssertionError(f"non-standard JSON token {token}")

    return json.loads(text, parse_constant=refuse)


def test_non_finite_numbers_are_written_as_null():
    value = {"nan": math.nan, "inf": math.inf, "ninf": -math.inf, "np": np.float32("nan"), "ok": np.float64(0.5),
             "nested": [(1, math.inf), {"a": np.array([1.0, np.nan, -np.inf])}], "i": np.int64(3), "b": np.bool_(True),
             4: "int key"}
    text = dump_json(value, sort_keys=True)
    assert strict_loads(text) == {"nan": None, "inf": None, "ninf": None, "np": None, "ok": 0.5,
                                  "nested": [[1, None], {"a": [1.0, None, None]}], "i": 3, "b": True, "4": "int key"}
    assert json_ready([np.float64(2.0)]) == [2.0] and type(json_ready([np.float64(2.0)])[0]) is float
    # Finite data print exactly as json.dumps prints them (hashes of metadata and configs are unchanged).
    finite = {"b": [1, 2.5, "x"], "a": {"c": None, "d": True}}
    assert dump_json(finite, sort_keys=True) == json.dumps(finite, sort_keys=True)


@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity"])
def test_readers_refuse_nan_and_infinity_tokens(tmp_path, token):
    with pytest.raises(ValidationError) as info:
        parse_json(f'{{"value": {token}}}', "summary")
    assert info.value.field == "summary" and token in str(info.value)
    path = tmp_path / "x.json"
    path.write_text(f'[1, {token}]')
    with pytest.raises(ValidationError) as info:
        read_json(path, "x")
    assert info.value.field == "x"
    # A policy file is one such reader: a hand-edited NaN in policy.json is refused, not read as a float.
    save_policy(GreedyPolicy(2, [3], 2), tmp_path / "p")
    spec_path = tmp_path / "p" / "policy.json"
    spec_path.write_text(spec_path.read_text().replace('"privacy": null', f'"privacy": {{"epsilon": {token}}}'))
    with pytest.raises(ValidationError) as info:
        load_policy(tmp_path / "p")
    assert info.value.field == "policy"


def test_atomic_write_json_writes_null(tmp_path):
    atomic_write_json(tmp_path / "s.json", {"value": math.nan, "interval": [-math.inf, math.inf]})
    assert strict_loads((tmp_path / "s.json").read_text()) == {"value": None, "interval": [None, None]}


def test_every_json_file_of_a_run_without_a_simulator_is_strict(tmp_path, capsys):
    frame = dporl.to_frame(TreatmentChain().simulate(60, 2, (0.2, 0.8), np.random.default_rng(1)), unit="clinician")
    data = dporl.read_table(frame, episode="episode", unit="clinician", observations="obs_", action="action",
                            actions=2, reward="reward", terminated="terminated", truncated="truncated")
    cql = dporl.DiscreteCQLConfig(epsilon=1.0, gamma=0.95, steps=10, hidden_sizes=[8], batch_size=32, progress=False,
                                  noise_seed=3, evaluation=OfflineEvalConfig(estimator="none")).create(data)
    result = cql.fit(run_dir=tmp_path / "run")
    assert math.isnan(result.summary["return_mean_last_evals"])  # no simulator: no return was measured
    files = sorted((tmp_path / "run").rglob("*.json"))
    assert any(p.name == "summary.json" for p in files)
    for path in files:
        strict_loads(path.read_text())  # no NaN / Infinity token anywhere, release/ and curator/ alike
    released = strict_loads((tmp_path / "run" / "release" / "summary.json").read_text())
    assert released["return_mean_last_evals"] is None
