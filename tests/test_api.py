"""The public surface: ``import dporl`` (lazy, registers the environments), the README's 5-line API as a doctest,
and the d3rlpy-like config (shapes and the privacy unit from the data)."""

from __future__ import annotations

import doctest
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import dporl
from dporl.utils.validation import ValidationError

ROOT = Path(__file__).resolve().parents[1]
torch.set_num_threads(1)


def test_every_public_name_resolves_and_is_listed():
    assert set(dporl.__all__) >= {
        "TrajectoryDataset", "read_table", "read_minari", "to_frame", "grouped_by", "dataset_unit", "UnitPartition",
        "CQLConfig", "DiscreteCQLConfig", "Trainer", "PrivacyLedger", "dp_importance_sampling", "dp_fqe",
        "dp_doubly_robust", "OPEResult", "load_policy", "save_policy", "GreedyPolicy",
    }
    for name in dporl.__all__:
        assert getattr(dporl, name) is not None, name
    with pytest.raises(AttributeError):
        dporl.no_such_name  # noqa: B018
    from dporl.data.table import read_table

    assert dporl.read_table is read_table  # the same objects, not copies


def test_a_config_creates_the_algorithm_named_without_config_and_the_torch_module_is_named_module(tmp_path):
    """d3rlpy's shape: ``DiscreteCQLConfig().create(data)`` is a ``DiscreteCQL`` (the algorithm, with ``fit``); the
    network it trains is a ``DiscreteCQLModule``. The same for behaviour cloning."""
    from dporl.algos.bc import DiscreteBCModule
    from dporl.algos.cql import DiscreteCQLModule
    from dporl.api import PrivateLearner

    from dporl.pipelines.inputs import ExampleTable, example_columns
    from dporl.utils.config import to_dict

    ExampleTable(units=20, episodes_per_unit=2, seed=1).frame().to_csv(tmp_path / "stays.csv", index=False)
    data = dporl.read_table(tmp_path / "stays.csv", **to_dict(example_columns()), progress=False)
    for config, algorithm, module in ((dporl.DiscreteCQLConfig, dporl.DiscreteCQL, DiscreteCQLModule),
                                      (dporl.DiscreteBCConfig, dporl.DiscreteBC, DiscreteBCModule)):
        created = config(hidden_sizes=[8], steps=2, progress=False).create(data)
        assert type(created) is algorithm and isinstance(created, PrivateLearner)
        assert algorithm.__name__ == config.__name__.removesuffix("Config") and algorithm.__module__ == "dporl.api"
        assert isinstance(created.module, module) and getattr(dporl, module.__name__) is module
        assert created.predict(data.initial_observations()[:2]).shape == (2,)
    with pytest.raises(ValidationError, match="config.*DiscreteBCConfig"):  # an API class trains its own algorithm
        dporl.DiscreteCQL(dporl.DiscreteBCConfig(hidden_sizes=[8]), data)


def test_import_is_light_and_registers_the_environments_as_a_gymnasium_plugin():
    """``import dporl`` does not import torch (the CLI starts fast) and registers dporl/* ids; Gymnasium's
    ``module:id`` syntax imports dporl by itself (how Gymnasium plugin packages are used)."""
    code = (
        "import sys, dporl, gymnasium as gym\n"
        "assert 'torch' not in sys.modules, 'torch imported eagerly'\n"
        "assert 'dporl/Chain-v0' in gym.registry and 'dporl/HIVTreatment-v0' in gym.registry\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)
    plugin = "import gymnasium as gym\nenv = gym.make('dporl:dporl/Chain-v0')\nenv.reset(seed=0)\nenv.close()\n"
    subprocess.run([sys.executable, "-c", plugin], check=True, cwd=ROOT, timeout=120)


def readme_examples() -> str:
    """The README's doctest blocks (```python fenced blocks whose lines start with >>>)."""
    text = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    examples = [block for block in blocks if block.lstrip().startswith(">>>")]
    assert examples, "the README has no doctest block"
    return "\n".join(examples)


def test_readme_api_runs_as_written(tmp_path, monkeypatch):
    """The README's Python path (at most 5 lines of user code to a private policy from a CSV) runs as a doctest,
    after the README's own command that writes the example CSV."""
    from dporl.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["data", "example", "treatment_chain", "stays.csv"]) == 0
    source = readme_examples()
    user_lines = [line for line in source.splitlines() if line.startswith(">>> ")]
    assert len(user_lines) <= 5, user_lines
    parser = doctest.DocTestParser()
    test = parser.get_doctest(source, {}, "README.md", str(ROOT / "README.md"), 0)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    runner.run(test)
    outcome = runner.summarize(verbose=False)
    assert outcome.failed == 0 and outcome.attempted == len(user_lines)
    assert (tmp_path / "runs" / "stays" / "release" / "policy" / "policy.json").is_file()


def test_a_plain_pip_install_ships_every_package_and_the_dporl_command():
    """``pip install .`` (not editable) installs what setuptools' ``find:`` finds: a folder without __init__.py was
    silently left out (dporl/eval was), and the ``dporl`` console script must point at the CLI."""
    import configparser

    from setuptools import find_packages

    found = set(find_packages(str(ROOT), include=["dporl", "dporl.*"]))
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "dporl").rglob("*.py")}
    assert folders <= found, sorted(folders - found)
    setup = configparser.ConfigParser()
    setup.read(ROOT / "setup.cfg")
    scripts = [line.strip() for line in setup["options.entry_points"]["console_scripts"].splitlines() if line.strip()]
    assert scripts == ["dporl = dporl.cli:main"]
    from dporl.cli import main

    assert callable(main)


def test_dporl_data_inspect_says_it_is_curator_only(tmp_path, capsys):
    from dporl.cli import main

    path = tmp_path / "t.csv"
    assert main(["data", "example", "treatment_chain", str(path), "--units", "30"]) == 0
    capsys.readouterr()
    assert main(["data", "inspect", str(path), "--episode", "episode", "--unit", "clinician", "--observations", "obs_",
                 "--action", "action", "--reward", "reward"]) == 0
    out = capsys.readouterr().out
    assert "units: 30 (column clinician)" in out and "episodes: 120" in out and "observation shape: (6,)" in out
    assert out.rstrip().splitlines()[-1].startswith("CURATOR-ONLY")
    # The one place dporl infers an action set: said to be inferred, and not to be used for a private run.
    assert "actions: 2 (counts" in out and "INFERRED from the logged rows" in out
    mapping = ["--episode", "episode", "--unit", "clinician", "--observations", "obs_", "--action", "action",
               "--reward", "reward"]
    assert main(["data", "inspect", str(path), *mapping, "--actions", "3", "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    assert (summary["actions"], summary["actions_inferred"], summary["action_counts"][2]) == (3, False, 0)
    frame = pd.read_csv(path)
    frame["action"] = np.where(frame["action"] == 1, "treat", "wait")
    frame.to_csv(tmp_path / "labels.csv", index=False)
    assert main(["data", "inspect", str(tmp_path / "labels.csv"), *mapping, "--json"]) == 0
    inferred = json.loads(capsys.readouterr().out)
    assert inferred["action_labels"] == ["treat", "wait"] and inferred["actions_inferred"]  # sorted logged values
    assert main(["data", "inspect", str(tmp_path / "labels.csv"), *mapping, "--actions", "wait,treat", "--json"]) == 0
    declared = json.loads(capsys.readouterr().out)
    assert declared["action_labels"] == ["wait", "treat"] and declared["import"]["dropped_out_of_set_episodes"] == 0
    assert main(["data", "inspect", str(path), "--episode", "episode"]) == 2  # the mapping is incomplete
    assert "error: --unit" in capsys.readouterr().err
    assert main(["audit", "--list"]) == 0 and "dpsgd_step" in capsys.readouterr().out


def test_dporl_imports_and_trains_without_the_minari_extra(tmp_path):
    """Minari is an extra: without it the package, the trainer and the table reader import, and only reading a
    Minari dataset asks for the extra (by name)."""
    script = """
import importlib.abc, sys
class NoMinari(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name == "minari" or name.startswith("minari."):
            raise ImportError("minari is not installed")
sys.meta_path.insert(0, NoMinari())
import dporl, dporl.data, dporl.train.trainer, dporl.cli
try:
    dporl.read_minari("some-dataset", unit="clinician")
except ImportError as error:
    print("asked for:", error)
"""
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=tmp_path,
                            env={**os.environ, "PYTHONPATH": str(ROOT)}, timeout=120)
    assert result.returncode == 0, result.stderr
    assert "pip install 'dporl[minari]'" in result.stdout
