"""The algorithm contract, the one algorithm registry and what it feeds (the train pipeline, the command line, the
Python API, the config audit, the policy kinds), the one pipeline registry, and the methods' one spelling.

Every registry test looks algorithms up by name from the registry: none lists them by hand."""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from dataclasses import dataclass
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from torch import nn

import dporl
from dporl.algos import registry
from dporl.algos.base import ContractError, LossForm, PrivateAlgorithm, check_contract
from dporl.algos.registry import AlgorithmConfig, register_algorithm
from dporl.pipelines import PIPELINES, get_pipeline
from dporl.privacy.units import TRANSITION
from dporl.utils.config import apply_overrides, from_dict, load_yaml
from dporl.utils.validation import ValidationError

ROOT = Path(__file__).resolve().parents[1]
torch.set_num_threads(1)


# ---------------------------------------------------------------------------------------------------- the contract
def _algorithm(**declarations):
    """A PrivateAlgorithm subclass with the given class attributes (a linear model with row losses)."""

    def __init__(self, obs_dim=3, n_actions=2, config=None, privacy_unit=TRANSITION):
        PrivateAlgorithm.__init__(self, privacy_unit)
        self.net = nn.Linear(obs_dim, n_actions)

    namespace = {"__init__": __init__,
                 "row_losses": lambda self, batch: self.net(batch.data["obs"]).sum(1),
                 "policy_network": lambda self: self.net, **declarations}
    return type("Toy", (PrivateAlgorithm,), namespace)


FULL = dict(loss_form=LossForm.ROW_LOSSES, batch_keys=("obs",), policy_kind="toy_kind")


@pytest.mark.parametrize("missing, field", [
    ("loss_form", "Toy.loss_form"), ("batch_keys", "Toy.batch_keys"), ("policy_kind", "Toy.policy_kind")])
def test_the_contract_refuses_an_algorithm_missing_a_declaration_by_name(missing, field):
    cls = _algorithm(**{k: v for k, v in FULL.items() if k != missing})
    with pytest.raises(ContractError) as info:
        check_contract(cls)
    assert info.value.field == field


def test_the_contract_refuses_a_loss_form_without_its_method_and_a_policy_without_its_network():
    no_directions = _algorithm(**{**FULL, "loss_form": LossForm.UNIT_DIRECTIONS})
    with pytest.raises(ContractError) as info:
        check_contract(no_directions)
    assert info.value.field == "Toy.unit_directions"
    no_network = _algorithm(**FULL, policy_network=PrivateAlgorithm.policy_network)
    with pytest.raises(ContractError) as info:
        check_contract(no_network)
    assert info.value.field == "Toy.policy_network"
    assert check_contract(_algorithm(**FULL)).loss_form is LossForm.ROW_LOSSES


def test_registration_refuses_what_the_contract_refuses_and_an_undeclared_name():
    incomplete = _algorithm(loss_form=LossForm.ROW_LOSSES, policy_kind="toy_kind")  # no batch keys

    @dataclass
    class IncompleteConfig(AlgorithmConfig):
        name: str = "toy_incomplete"
        algorithm: ClassVar[type] = incomplete
        api_name: ClassVar[str] = "ToyIncompleteConfig"
        summary: ClassVar[str] = "a toy"

    with pytest.raises(ContractError) as info:
        register_algorithm(IncompleteConfig)
    assert info.value.field == "Toy.batch_keys"
    assert "toy_incomplete" not in registry.names()

    @dataclass
    class Unnamed(AlgorithmConfig):
        algorithm: ClassVar[type] = _algorithm(**FULL)
        api_name: ClassVar[str] = "UnnamedConfig"
        summary: ClassVar[str] = "a toy"

    with pytest.raises(ContractError) as info:
        register_algorithm(Unnamed)
    assert info.value.field == "Unnamed.name"

    @dataclass
    class NoSummary(AlgorithmConfig):
        name: str = "toy_no_summary"
        algorithm: ClassVar[type] = _algorithm(**FULL)
        api_name: ClassVar[str] = "NoSummaryConfig"

    with pytest.raises(ContractError) as info:
        register_algorithm(NoSummary)
    assert info.value.field == "NoSummary.summary"


def test_the_trainer_refuses_a_module_that_is_not_an_algorithm_before_writing(tmp_path):
    from dporl.privacy.ledger import PrivacyLedger
    from dporl.privacy.samplers import PoissonUnitSource
    from dporl.train.config import TrainerConfig
    from dporl.train.trainer import Trainer

    class Duck(nn.Module):  # has the methods, declares nothing
        privacy_unit = TRANSITION

        def row_losses(self, batch):
            return batch.data["obs"].sum(1)

    source = PoissonUnitSource({"obs": torch.zeros(4, 3)}, torch.arange(4), 4, 0.5)
    with pytest.raises(ContractError) as info:
        Trainer(Duck(), source, config=TrainerConfig(max_steps=2, progress=False), dp=None, ledger=PrivacyLedger(),
                run_dir=tmp_path / "run", pipeline="toy", pipeline_config={})
    assert info.value.field == "algorithm" and not (tmp_path / "run").exists()


def test_every_algorithm_the_trainer_runs_meets_the_contract():
    """The registered ones and the evaluators (GPOPE, the reward-level learners) all declare what they are."""
    from dporl.algos.fnq import FunctionalNoiseQLearning, RewardPrivateQLearning
    from dporl.algos.gpope import GPOPE

    forms = {cls: check_contract(cls).loss_form for cls in (GPOPE, FunctionalNoiseQLearning, RewardPrivateQLearning)}
    assert forms == {GPOPE: LossForm.UNIT_DIRECTIONS, FunctionalNoiseQLearning: LossForm.ROW_LOSSES,
                     RewardPrivateQLearning: LossForm.WEIGHTED_ROW_LOSSES}
    for entry in registry.entries():
        assert check_contract(entry.algorithm_cls) == entry.declaration and entry.declaration.policy_kind


# ---------------------------------------------------------------------------------------------------- the registry
def test_the_registry_feeds_the_command_line(capsys):
    from dporl.cli import main

    assert main(["list"]) == 0
    listed = capsys.readouterr().out
    for entry in registry.entries():
        assert f"  {entry.name} " in listed and f"dporl.{entry.api_name}" in listed
        assert entry.declaration.policy_kind in listed
    for name in PIPELINES:
        assert f"  {name} " in listed


def test_the_registry_feeds_the_python_api_and_the_train_config():
    names = set(dporl.__all__)
    for entry in registry.entries():
        assert {entry.api_name, entry.learner_name, entry.config_cls.__name__, entry.algorithm_cls.__name__} <= names
        assert len({entry.api_name, entry.learner_name, entry.config_cls.__name__, entry.algorithm_cls.__name__}) == 4
        api = getattr(dporl, entry.api_name)
        assert getattr(dporl, entry.config_cls.__name__) is entry.config_cls
        assert getattr(dporl, entry.algorithm_cls.__name__) is entry.algorithm_cls
        settings = api(epsilon=2.0)
        assert isinstance(settings.algorithm_config(), entry.config_cls)
        for field, value in entry.config_cls.api_defaults.items():
            assert getattr(settings, field) == value
        config = settings.pipeline_config("run")
        assert config.pipeline == "train" and config.algorithm.name == entry.name
        parsed = from_dict(get_pipeline("train").config_cls, {"algorithm": entry.name})
        assert isinstance(parsed.algorithm, entry.config_cls)


def test_an_unknown_algorithm_and_its_wrong_keys_are_named():
    config_cls = get_pipeline("train").config_cls
    with pytest.raises(ValidationError) as info:
        from_dict(config_cls, {"algorithm": "sac"})
    assert info.value.field == "algorithm" and all(name in str(info.value) for name in registry.names())
    with pytest.raises(ValidationError) as info:
        from_dict(config_cls, {"algorithm": {"name": registry.names()[0], "no_such_key": 1}})
    assert info.value.field == "algorithm.no_such_key"


def test_the_registry_feeds_the_policy_kinds_the_export_loads(tmp_path):
    from dporl.train.export import load_policy, save_policy

    for entry in registry.entries():
        algorithm = entry.config_cls(**{k: v for k, v in entry.config_cls.api_defaults.items()}).build(
            3, 2, TRANSITION)
        save_policy(algorithm, tmp_path / entry.name)
        loaded = load_policy(tmp_path / entry.name)
        obs = torch.randn(16, 3)
        assert loaded.kind == entry.policy_kind and torch.equal(loaded.act(obs), algorithm.act(obs))


def test_the_registry_feeds_the_config_audit():
    """A dp_sgd config of every registered algorithm is audited as the DP-SGD step its method runs."""
    from dporl.audit.config_audit import audits_for_config

    for entry in registry.entries():
        data = {"pipeline": "train", "algorithm": entry.name, "method": "dp_sgd", "batch_size": 10,
                "dp": {"noise_multiplier": 1.0}, "trainer": {"max_steps": 10}}
        (audit,) = audits_for_config(data, n_experts=40)
        assert audit.name.startswith("dpsgd") or "dpsgd" in audit.name, audit.name


# ---------------------------------------------------------------------------------------------------- pipelines
def test_one_pipeline_registry_knows_every_pipeline_module():
    import dporl.pipelines as package

    defined = {}
    for module in pkgutil.iter_modules(package.__path__):
        imported = importlib.import_module(f"dporl.pipelines.{module.name}")
        if hasattr(imported, "PIPELINE"):
            defined[imported.PIPELINE.name] = f"dporl.pipelines.{module.name}"
    assert defined == {name: module for name, (module, _) in PIPELINES.items()}
    for name in PIPELINES:
        assert get_pipeline(name).name == name


def test_every_shipped_config_names_a_known_pipeline_and_parses():
    """Pipeline configs parse as their pipeline's; the others are search spaces (``dporl tune --space``)."""
    from dporl.tuning.config import TuneConfig

    for path in sorted((ROOT / "configs").glob("*.yaml")):
        data = load_yaml(path)
        if "pipeline" not in data:
            from_dict(TuneConfig, data)
            continue
        pipeline = get_pipeline(data["pipeline"])
        from_dict(pipeline.config_cls, data)


def test_dporl_train_runs_the_sweep_config_from_another_directory(tmp_path, capsys, monkeypatch):
    """configs/sweep_cartpole.yaml through ``dporl train`` (and ``dporl sweep``), tiny: 64 experts, 4 steps, from a
    working directory outside the repository: the sweep's ``base`` names a file next to the sweep file."""
    import os

    from dporl.cli import main

    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    sweep_file = os.path.relpath(ROOT / "configs/sweep_cartpole.yaml")  # a relative path, as a user types it

    generation = ["data.generate.out_dir=" + str(tmp_path / "data"), "data.generate.experts.points_per_axis=4",
                  "data.generate.trajectories_per_expert=1", "data.generate.max_episode_steps=40",
                  "data.generate.progress=false"]
    inner = [*generation, "trainer.max_steps=4", "trainer.eval_every=2", "trainer.log_every=2",
             "trainer.checkpoint_every=2", "eval.episodes=1", "eval.num_envs=1", "eval.max_episode_steps=20",
             "eval.last_evals=1", "batch_size=16", "algorithm.hidden_sizes=[8]",
             "noise_seed=7"]  # one fixed draw: a secret count at eps 0.1 of 64 experts lands below 1, rarely
    overrides = [f"overrides={inner}", "epsilons=[10.0]",
                 "methods=[non_private, dp_sgd]", "seeds=[0]", f"out_dir={tmp_path / 'sweep'}", "progress=false"]
    assert main(["train", "--config", sweep_file, *overrides]) == 0, \
        capsys.readouterr().err
    import csv

    rows = list(csv.DictReader((tmp_path / "sweep" / "runs.csv").open()))
    assert [(r["method"], r["epsilon"], r["error"]) for r in rows] == [("non_private", "", ""), ("dp_sgd", "10.0", "")]
    assert float(rows[1]["guarantee_epsilon"]) <= 10.0 and int(rows[1]["steps"]) == 4
    assert main(["sweep", "--config", sweep_file, *overrides]) == 0  # read back


def test_a_config_files_base_is_relative_to_the_file_and_an_overrides_to_the_working_directory(tmp_path, monkeypatch):
    from dporl.pipelines import read_config

    (tmp_path / "sweeps").mkdir()
    (tmp_path / "sweeps" / "sweep.yaml").write_text("pipeline: sweep\nbase: ../trains/train.yaml\n")
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")
    pipeline, data = read_config("../sweeps/sweep.yaml")
    assert pipeline.name == "sweep"
    assert Path(data["base"]).resolve() == (tmp_path / "trains" / "train.yaml").resolve()
    _, data = read_config("../sweeps/sweep.yaml", ["base=mine.yaml"])
    assert data["base"] == "mine.yaml"  # a command-line path: relative to where the command runs
    (tmp_path / "sweeps" / "absolute.yaml").write_text(f"pipeline: sweep\nbase: {tmp_path / 'b.yaml'}\n")
    assert read_config("../sweeps/absolute.yaml")[1]["base"] == str(tmp_path / "b.yaml")
    _, data = read_config(tmp_path / "sweeps" / "sweep.yaml")  # a train file names no file keys: unchanged
    train = tmp_path / "sweeps" / "train.yaml"
    train.write_text("pipeline: train\nrun_dir: runs/x\n")
    assert read_config(train)[1]["run_dir"] == "runs/x"


# ---------------------------------------------------------------------------------------------------- one spelling
@pytest.mark.parametrize("pipeline, key, wrong, right", [
    ("train", "method", "dpsgd", "dp_sgd"),
    ("train", "method", "nonprivate", "non_private"),
    ("train", "method", "Stable-Only", "stable_only"),
    ("fnq", "methods", ["nonprivate"], "non_private"),
    ("fnq", "methods", ["fnq", "dpsgd"], "dp_sgd"),
    ("sweep", "methods", ["dpsgd"], "dp_sgd"),
])
def test_another_spelling_of_a_method_is_a_named_error_giving_the_one_spelling(pipeline, key, wrong, right):
    with pytest.raises(ValidationError) as info:
        from_dict(get_pipeline(pipeline).config_cls, {key: wrong})
    assert info.value.field.startswith(key) and f"spelled {right!r}" in str(info.value)


@pytest.mark.parametrize("pipeline, key, value", [("train", "method", "sgd"), ("fnq", "methods", ["ppo"])])
def test_an_unknown_method_lists_the_known_ones(pipeline, key, value):
    from dporl.methods import reward_level, unit_level

    known = unit_level.METHODS if pipeline == "train" else reward_level.METHODS
    with pytest.raises(ValidationError) as info:
        from_dict(get_pipeline(pipeline).config_cls, {key: value})
    assert info.value.field.startswith(key) and all(name in str(info.value) for name in known)


def test_methods_declare_their_stages_and_needs():
    """The method objects' budgets (after the count) and needs, as the expert-level paper states them."""
    from dporl.methods.unit_level import METHODS, TRAIN_STAGE
    from dporl.algos.stable_prefix import RELEASE_STAGE

    assert METHODS["non_private"].stage_budgets(10.0, 1e-5, 0.5) == {}
    assert METHODS["dp_sgd"].stage_budgets(10.0, 1e-5, 0.5) == {TRAIN_STAGE: (10.0, 1e-5)}
    assert METHODS["stable_only"].stage_budgets(10.0, 1e-5, 0.5) == {RELEASE_STAGE: (10.0, 1e-5)}
    assert METHODS["mixed"].stage_budgets(10.0, 1e-5, 0.3) == {RELEASE_STAGE: (3.0, 5e-6), TRAIN_STAGE: (7.0, 5e-6)}
    assert [m.name for m in METHODS.values() if m.release] == ["stable_only", "mixed"]
    assert [m.name for m in METHODS.values() if not m.private] == ["non_private"]
    assert METHODS["mixed"].shares_run_budget(True, False) and not METHODS["mixed"].shares_run_budget(False, False)
    assert METHODS["dp_sgd"].shares_run_budget(False, True) and not METHODS["stable_only"].shares_run_budget(True, True)


def test_configs_and_dataclasses_use_the_one_spelling():
    """No shipped config spells a method another way (the named error above would refuse it anyway)."""
    import re

    for path in (ROOT / "configs").glob("*.yaml"):
        text = path.read_text()
        assert not re.search(r"\b(nonprivate|dpsgd|expert_cql_sweep)\b", text), path
        assert not re.search(r"^pipeline: expert_cql$", text, re.M), path
    assert dataclasses.is_dataclass(get_pipeline("train").config_cls)
    assert apply_overrides({"a": {"b": 1}}, ["a.b=2"]) == {"a": {"b": 2}}
