"""A corpus of malformed configs, checkpoints, journals and experts: each gets a ValidationError naming the field,
and nothing is written (the run directory is checked afterwards). Malformed datasets are DATA's corpus
(tests/test_dataset.py)."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from dporl.train.checkpoint import load_checkpoint, save_checkpoint
from dporl.train.run_dir import read_journal
from dporl.train.config import DPConfig, TrainerConfig
from dporl.utils.config import from_dict
from dporl.utils.validation import PrivacyBudgetError, ValidationError

ROOT = Path(__file__).resolve().parents[1]


def _train_main():
    spec = importlib.util.spec_from_file_location("dporl_train_cli", ROOT / "train.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


# (name, YAML text, field the error must name). Every config names a run_dir inside the test's directory.
OPE_CONFIGS = [
    ("negative epsilon", "pipeline: ope\nepsilon: -1.0\n", "epsilon"),
    ("zero epsilon", "pipeline: ope\nepsilon: 0\n", "epsilon"),
    ("delta above one", "pipeline: ope\ndelta: 1.5\n", "delta"),
    ("string budget", "pipeline: ope\nepsilon: lots\n", "epsilon"),
    ("unknown key", "pipeline: ope\nepsilonn: 1.0\n", "epsilonn"),
    ("unknown nested key", "pipeline: ope\ngpope: {sigma: 2.0}\n", "gpope.sigma"),
    ("non-positive clip", "pipeline: ope\ngpope: {clip_norm: 0.0}\n", "gpope.clip_norm"),
    ("bad literal", "pipeline: ope\ngpope: {mode: sometimes}\n", "gpope.mode"),
    ("bad list item", "pipeline: ope\nm_values: [100, many]\n", "m_values[1]"),
    ("too small m", "pipeline: ope\nm_values: [1]\n", "m_values"),
    ("int as bool", "pipeline: ope\nprogress: 3\n", "progress"),
    ("section as scalar", "pipeline: ope\ngpope: 5\n", "gpope"),
    ("unknown pipeline", "pipeline: opee\n", "pipeline"),
    ("no pipeline", "epsilon: 1.0\n", "pipeline"),
    ("empty file", "", "pipeline"),
    ("top-level list", "- pipeline\n- ope\n", "config"),
    ("YAML syntax error", "pipeline: ope\nm_values: [100,\n", "config"),
    ("truncated mid-key", "pipeline: ope\ndel", "config"),
]


@pytest.mark.parametrize("name,text,field", OPE_CONFIGS, ids=[c[0] for c in OPE_CONFIGS])
def test_malformed_config_names_the_field_and_writes_nothing(tmp_path, capsys, name, text, field):
    config = tmp_path / "config.yaml"
    run_dir = tmp_path / "run"
    config.write_text(text + (f"run_dir: {run_dir}\n" if text.startswith("pipeline: ope") and not text.endswith("del") else ""))
    assert _train_main()(["--config", str(config)]) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"error: {field}"), error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["config.yaml"]  # no run directory, no partial output


def test_bad_overrides_and_missing_files(tmp_path, capsys):
    main = _train_main()
    assert main(["--config", str(tmp_path / "absent.yaml")]) == 2
    assert "config" in capsys.readouterr().err
    config = tmp_path / "config.yaml"
    config.write_text(f"pipeline: ope\nrun_dir: {tmp_path / 'run'}\n")
    for override, field in [("epsilon=-2", "epsilon"), ("gpope.epochs=0", "gpope.epochs"), ("noequals", "noequals"),
                            ("epsilon.x=1", "epsilon")]:
        assert main(["--config", str(config), override]) == 2
        assert field in capsys.readouterr().err
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize(
    "section,field",
    [
        ({"epsilon": -1.0}, "dp.epsilon"),
        ({"epsilon": None}, "dp.epsilon"),
        ({"epsilon": 1.0, "delta": 0.0}, "dp.delta"),
        ({"epsilon": 1.0, "delta": 1.0}, "dp.delta"),
        ({"epsilon": 1.0, "noise_multiplier": -0.5}, "dp.noise_multiplier"),
        ({"epsilon": 1.0, "max_grad_norm": 0.0}, "dp.max_grad_norm"),
        ({"epsilon": float("nan")}, "dp.epsilon"),
        ({"epsilon": float("inf")}, "dp.epsilon"),
        ({"epsilon": 1.0, "accountant": "moments"}, "accountant"),
    ],
)
def test_negative_or_absurd_budgets_are_refused(section, field):
    with pytest.raises(ValidationError) as info:
        from_dict(DPConfig, section)
    assert field in info.value.field


def test_trainer_config_refuses_nonsense():
    for section, field in [({"max_steps": -1}, "trainer.max_steps"), ({"journal_every": 0}, "trainer.journal_every"),
                           ({"optimizer": {"lr": -1.0}}, "optimizer.lr"), ({"optimizer": {"name": "lbfgs"}}, "optimizer.name")]:
        with pytest.raises(ValidationError) as info:
            from_dict(TrainerConfig, section)
        assert field in info.value.field


def _valid_checkpoint(path: Path) -> bytes:
    save_checkpoint(path, {"pipeline": "p", "config_sha256": "0" * 64, "step": 3, "budget_steps": 3,
                           "algorithm": {"w": torch.ones(50)}, "optimizer": {}, "scheduler": {}, "eval_history": [],
                           "rng": {"sampler": torch.Generator().get_state()}, "journal": {"seq": 1, "charged": {}}})
    return path.read_bytes()


CORRUPTIONS = {
    "empty": lambda good: b"",
    "truncated": lambda good: good[: len(good) // 2],
    "one byte short": lambda good: good[:-1],
    "random bytes": lambda good: bytes(range(256)) * 8,
    "json text": lambda good: json.dumps({"format": 1}).encode(),
}


@pytest.mark.parametrize("kind", sorted(CORRUPTIONS))
def test_corrupt_checkpoints_are_named_and_never_loaded(tmp_path, kind):
    good = _valid_checkpoint(tmp_path / "good.pt")
    bad = tmp_path / "bad.pt"
    bad.write_bytes(CORRUPTIONS[kind](good))
    with pytest.raises(ValidationError) as info:
        load_checkpoint(bad)
    assert info.value.field == "checkpoint"


def test_checkpoints_of_the_wrong_format(tmp_path):
    for payload in ([1, 2, 3], {"format": 99}, {"format": 2, "step": 3}):
        path = tmp_path / "x.pt"
        torch.save(payload, path)
        with pytest.raises(ValidationError, match="checkpoint"):
            load_checkpoint(path)
    with pytest.raises(ValueError, match="lacks"):
        save_checkpoint(tmp_path / "y.pt", {"step": 1})
    assert not (tmp_path / "y.pt").exists()


_LEDGER = '{"format": "dporl-privacy-journal", "version": 2, "ledger": %s}'
_STAGE = ('{"name": "train", "budget": [1.0, 1e-5], "mechanism": "rdp", "unit": "transition", '
          '"delta": 1e-5, "analysis": "RDP", "accountant": {"mechanism": "rdp", "history": %s}}')


@pytest.mark.parametrize("text", [
    "", "not json", '{"authorised_steps": 5}', _LEDGER % "[]", _LEDGER % '{"stages": 5}',
    _LEDGER % ('{"stages": [%s]}' % (_STAGE % '[[{"type": "PoissonGaussianEvent", "noise_multiplier": 1.0, '
                                       '"sample_rate": 0.1}, -3]]')),
    _LEDGER % ('{"stages": [%s]}' % (_STAGE % '[[{"type": "Rumour"}, 1]]')),
    _LEDGER % ('{"stages": [%s]}' % (_STAGE % '[[{"type": "PoissonGaussianEvent", "noise_multiplier": 0.1, '
                                       '"sample_rate": 1.0}, 1000]]')),  # spends far past the stage budget
])
def test_corrupt_journals_refuse_to_guess_the_spent_budget(tmp_path, text):
    """Failure 7 (a garbage ledger): every malformed journal is a named error, never a traceback or a guess."""
    from dporl.train.run_dir import GENESIS, _record_hash

    path = tmp_path / "journal.json"
    try:  # a journal with a valid chain link, so that what is refused is the ledger it records
        body = json.loads(text)
        if isinstance(body, dict) and "ledger" in body:
            text = json.dumps({**body, "chain": {"seq": 1, "prev": GENESIS, "hash": _record_hash(GENESIS, body)}})
    except ValueError:
        pass
    path.write_text(text)
    with pytest.raises(ValidationError) as info:
        read_journal(path)
    assert info.value.field.split(".")[0] in ("journal", "ledger", "count", "event")


def test_trainer_refuses_a_corrupt_checkpoint_without_touching_the_run(tmp_path):
    from test_robustness_faults import Toy, make_trainer

    make_trainer(tmp_path, Toy(), 10).fit()
    checkpoint = tmp_path / "curator" / "checkpoints" / "last.pt"
    checkpoint.write_bytes(checkpoint.read_bytes()[:100])
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(ValidationError, match="checkpoint"):
        make_trainer(tmp_path, Toy(), 10).fit()
    after = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    assert after == before


def test_trainer_refuses_a_budget_that_fits_no_step(tmp_path):
    from dporl.privacy.ledger import PrivacyLedger
    from dporl.privacy.samplers import PoissonUnitSource
    from dporl.train.trainer import Trainer
    from test_robustness_faults import Toy

    source = PoissonUnitSource({"x": torch.zeros(4, 3), "y": torch.zeros(4)}, torch.arange(4), 4, 1.0)
    trainer = Trainer(Toy(), source, config=TrainerConfig(max_steps=10, progress=False),
                      dp=DPConfig(epsilon=1e-3, delta=1e-5, noise_multiplier=0.5), ledger=PrivacyLedger(),
                      run_dir=tmp_path / "run", pipeline="robustness", pipeline_config={})
    with pytest.raises(PrivacyBudgetError, match="dp.epsilon"):
        trainer.fit()
    assert not (tmp_path / "run").exists()


def test_an_expert_below_p_min_is_a_configuration_error():
    from dporl.experts import ExpertSet, StackedLinearPolicy

    bias = torch.tensor([[0.0, 0.0], [5.0, -5.0]])  # the second expert puts ~5e-5 on action 1
    experts = ExpertSet(StackedLinearPolicy.from_weights(torch.zeros(2, 1, 2), bias), p_min=0.05, softening="none")
    with pytest.raises(ValidationError) as info:
        experts.log_probs(torch.zeros(3, 1))
    assert info.value.field == "expert_set.p_min"
    with pytest.raises(ValidationError, match="p_min"):
        ExpertSet(StackedLinearPolicy.from_weights(torch.zeros(2, 1, 2), bias), p_min=0.6)  # p_min >= 1 / n_actions
