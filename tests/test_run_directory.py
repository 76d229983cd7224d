"""Run directories (modes, provenance), the journaled ledger with a run budget, and released policies."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dporl.privacy.calibration import max_steps
from dporl.privacy.events import ApproxDPEvent, PoissonGaussianEvent
from dporl.privacy.ledger import PrivacyLedger
from dporl.train.export import GreedyPolicy, load_policy, save_policy
from dporl.train.run_dir import RunDirectory, config_differences, config_sha256, read_journal
from dporl.utils.validation import PrivacyBudgetError, ValidationError

CONFIG = {"run_dir": "x", "epsilon": 1.0, "dp": {"noise_multiplier": 2.0, "progress": True}, "data": {"dataset": "a"}}
EVENT = PoissonGaussianEvent(1.0, 0.05)


def _files(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------------------ modes
def test_new_refuses_a_non_empty_directory_and_writes_only_at_begin(tmp_path):
    run = RunDirectory(tmp_path / "run", pipeline="p", config=CONFIG)
    assert not (tmp_path / "run").exists()  # construction checks, never writes
    run.check_inputs(dataset="abc")
    run.begin()
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["curator", "release"]
    recorded = json.loads(run.provenance_path.read_text())
    assert recorded["config_sha256"] == config_sha256(CONFIG) and recorded["inputs"] == {"dataset": "abc"}
    with pytest.raises(ValidationError, match="--resume.*--overwrite") as info:
        RunDirectory(tmp_path / "run", pipeline="p", config=CONFIG)
    assert info.value.field == "run_dir"
    RunDirectory(tmp_path / "empty", pipeline="p", config=CONFIG)  # an empty or absent directory is new
    (tmp_path / "file").write_text("x")
    with pytest.raises(ValidationError, match="not a directory"):
        RunDirectory(tmp_path / "file", pipeline="p", config=CONFIG, mode="resume")


def test_resume_names_what_differs_and_writes_nothing_when_unchanged(tmp_path):
    RunDirectory(tmp_path, pipeline="p", config=CONFIG).begin().check_inputs(dataset="abc")
    before = _files(tmp_path)
    # Where the run is written and progress bars are not part of what it computes.
    same = RunDirectory(tmp_path, pipeline="p", config={**CONFIG, "run_dir": "y", "dp": {"noise_multiplier": 2.0}},
                        mode="resume")
    same.check_inputs(dataset="abc")
    same.begin()
    assert _files(tmp_path) == before
    with pytest.raises(ValidationError, match=r"dp.noise_multiplier: 2.0 -> 3.0; epsilon: 1.0 -> \(absent\)"):
        changed = {k: v for k, v in CONFIG.items() if k != "epsilon"}
        RunDirectory(tmp_path, pipeline="p", config={**changed, "dp": {"noise_multiplier": 3.0}}, mode="resume")
    with pytest.raises(ValidationError, match="holds a 'p' run, not 'q'"):
        RunDirectory(tmp_path, pipeline="q", config=CONFIG, mode="resume")
    again = RunDirectory(tmp_path, pipeline="p", config=CONFIG, mode="resume")
    with pytest.raises(ValidationError) as info:
        again.check_inputs(dataset="abd")
    assert info.value.field == "inputs.dataset"
    assert _files(tmp_path) == before
    assert config_differences({"a": [1, 2]}, {"a": [1, 3]}) == ["a: [1, 2] -> [1, 3]"]


def test_overwrite_removes_only_dporl_run_directories_and_only_at_begin(tmp_path):
    foreign = tmp_path / "home"
    foreign.mkdir()
    (foreign / "thesis.tex").write_text("precious")
    for mode in ("resume", "overwrite"):
        with pytest.raises(ValidationError, match="not a dporl run directory"):
            RunDirectory(foreign, pipeline="p", config=CONFIG, mode=mode)
    assert (foreign / "thesis.tex").read_text() == "precious"

    run = RunDirectory(tmp_path / "run", pipeline="p", config=CONFIG).begin()
    (run.curator / "old.txt").write_text("old")
    replacing = RunDirectory(tmp_path / "run", pipeline="p", config={**CONFIG, "epsilon": 2.0}, mode="overwrite")
    assert (run.curator / "old.txt").exists()  # still there until the new run begins
    replacing.begin()
    assert not (run.curator / "old.txt").exists()
    assert json.loads(replacing.provenance_path.read_text())["config"]["epsilon"] == 2.0


# ------------------------------------------------------------------------------------------------ ledger
def test_a_run_budget_bounds_every_stage_and_every_restored_state():
    ledger = PrivacyLedger(budget=(10.0, 1e-5))
    ledger.stage("release", budget=(5.0, 5e-6), mechanism="pld", unit="expert")
    with pytest.raises(PrivacyBudgetError, match="more than the run's budget"):
        ledger.stage("train", budget=(5.5, 5e-6), unit="expert")
    with pytest.raises(PrivacyBudgetError, match="every stage needs a budget"):
        ledger.stage("free", delta=1e-6, unit="expert")
    ledger.stage("train", budget=(5.0, 5e-6), unit="expert")  # exactly the rest fits (float round-off allowed)
    ledger.record("release", ApproxDPEvent(0.2, 1e-7), 5)

    # A state from a run with a bigger budget, or one whose events exceed a stage budget, is refused on load.
    other = PrivacyLedger(budget=(100.0, 1e-5))
    other.stage("release", budget=(50.0, 5e-6), mechanism="pld", unit="expert")
    with pytest.raises(PrivacyBudgetError, match="run budget"):
        PrivacyLedger(budget=(10.0, 1e-5)).load_state_dict(other.state_dict())
    forged = ledger.state_dict()
    forged["stages"][0]["accountant"]["history"] = [[{"type": "ApproxDPEvent", "epsilon": 3.0, "delta": 1e-7}, 5]]
    with pytest.raises(PrivacyBudgetError, match="over the stage budget"):
        PrivacyLedger(budget=(10.0, 1e-5)).load_state_dict(forged)
    restored = PrivacyLedger(budget=(10.0, 1e-5))
    restored.load_state_dict(ledger.state_dict())
    assert restored.report().guarantee[0] == pytest.approx(ledger.report().guarantee[0])


def test_the_journal_is_written_before_a_charge_returns_and_authorisations_are_consumed():
    writes = []
    ledger = PrivacyLedger()
    ledger.attach_journal(lambda state: writes.append(json.loads(json.dumps(state))))
    ledger.stage("train", budget=(2.0, 1e-5), unit="transition")
    assert len(writes) == 2  # attach, stage
    ledger.authorise("train", EVENT, 4)
    assert writes[-1]["stages"][0]["accountant"]["history"] == [[{"type": "PoissonGaussianEvent",
                                                                  "noise_multiplier": 1.0, "sample_rate": 0.05}, 4]]
    for _ in range(4):
        ledger.record("train", EVENT)  # consumes the authorisation: no write, no second charge
    assert len(writes) == 3 and len(ledger.stages["train"].accountant) == 4
    ledger.record("train", EVENT)  # beyond the authorisation: charged and written
    assert len(writes) == 4 and len(ledger.stages["train"].accountant) == 5

    def failing(state):
        raise OSError("disk full")

    broken = PrivacyLedger()
    broken.stage("train", budget=(2.0, 1e-5), unit="transition")
    broken._journal = failing  # noqa: SLF001 (a journal that cannot be written)
    with pytest.raises(OSError):
        broken.record("train", EVENT, 3)
    assert len(broken.stages["train"].accountant) == 0  # not durable, so not charged: the step must not run


def test_recovery_charges_the_journal_as_recorded_plus_what_this_process_recorded():
    journal = PrivacyLedger()
    journal.stage("train", budget=(5.0, 1e-5), unit="transition")
    journal.record("train", PoissonGaussianEvent(3.0, 0.05), 245)  # an earlier attempt, at sigma 3
    current = PrivacyLedger()
    current.stage("train", budget=(5.0, 1e-5), unit="transition")
    current.record("train", PoissonGaussianEvent(1.0, 0.05), 2)
    current.attach_journal(lambda state: None, recovered=journal.state_dict())
    assert current.stages["train"].accountant.history == [(PoissonGaussianEvent(3.0, 0.05), 245),
                                                          (PoissonGaussianEvent(1.0, 0.05), 2)]
    # remaining() fits the rest around the recorded events: one more step than it returns would not fit.
    left = current.remaining("train", EVENT, 10**6)
    assert left > 0
    extra = current.stages["train"].accountant.epsilon_with([(EVENT, left)], 1e-5)
    over = current.stages["train"].accountant.epsilon_with([(EVENT, left + 1)], 1e-5)
    assert extra <= 5.0 < over
    fresh = PrivacyLedger()
    fresh.stage("train", budget=(5.0, 1e-5), unit="transition")
    assert fresh.remaining("train", EVENT, 10**6) == max_steps(EVENT, 5.0, 1e-5)
    mismatched = PrivacyLedger()
    mismatched.stage("train", budget=(4.0, 1e-5), unit="transition")
    with pytest.raises(ValidationError, match="journal"):
        mismatched.attach_journal(lambda state: None, recovered=journal.state_dict())


def test_trainer_resume_charges_an_earlier_event_as_recorded(tmp_path):
    """The journal, not the resumed run's plan, says what was spent: steps authorised at one sampling rate stay
    charged at that rate when a resumed run samples at another (the source is not part of the config hash)."""
    from test_trainer import LogisticRegression, _data, _trainer

    from dporl.privacy.samplers import PoissonUnitSource

    first = _trainer(tmp_path, LogisticRegression(crash_at=6), cap=40, epsilon=3.0)
    with pytest.raises(RuntimeError, match="simulated crash"):
        first.fit()
    old = PoissonGaussianEvent(1.5, 0.05)
    assert read_journal(tmp_path / "curator" / "journal.json").stages["train"].accountant.history == [(old, 8)]
    source = PoissonUnitSource(_data(), torch.arange(200), 200, sample_rate=0.1)
    resumed = _trainer(tmp_path, LogisticRegression(), source=source, cap=40, epsilon=3.0)
    result = resumed.fit()
    history = resumed.ledger.stages["train"].accountant.history
    assert history[0] == (old, 8) and history[1][0] == PoissonGaussianEvent(1.5, 0.1)
    assert resumed.ledger.spent("train") <= 3.0
    assert result.budget_steps == 8 + history[1][1]


def test_curator_diagnostics_stay_in_curator_and_are_off_by_default(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from test_trainer import LogisticRegression, _trainer

    def tags(directory: Path) -> set[str]:
        accumulator = EventAccumulator(str(directory))
        accumulator.Reload()
        return set(accumulator.Tags()["scalars"])

    _trainer(tmp_path / "off", LogisticRegression(), cap=10).fit()
    assert not (tmp_path / "off" / "curator" / "tensorboard").exists()
    public = tags(tmp_path / "off" / "release" / "tensorboard")
    # "fit" is not a public evaluator: curator-only. The privacy scalars: the run's guarantee and each stage's.
    assert public == {"train/lr", "privacy/epsilon", "privacy/stage/train"}
    _trainer(tmp_path / "on", LogisticRegression(), cap=10, curator_diagnostics=True).fit()
    assert tags(tmp_path / "on" / "release" / "tensorboard") == public
    curator = tags(tmp_path / "on" / "curator" / "tensorboard")
    assert {"curator/private_loss", "curator/clip_fraction", "curator/steps_per_second", "fit/weight_norm"} <= curator


# ------------------------------------------------------------------------------------------------ policies
def test_a_saved_policy_loads_from_its_directory_alone_and_as_torchscript(tmp_path):
    import gymnasium as gym

    torch.manual_seed(0)
    policy = GreedyPolicy(4, [8, 8], 2)
    env = gym.make("CartPole-v1")
    save_policy(policy, tmp_path / "policy", env_id="CartPole-v1", observation_space=env.observation_space,
                action_space=env.action_space, privacy={"guarantee": {"epsilon": 1.0}})
    loaded = load_policy(tmp_path / "policy")
    obs = torch.randn(64, 4)
    assert torch.equal(loaded.act(obs), policy.act(obs)) and loaded.spec["env_id"] == "CartPole-v1"
    assert loaded.spec["action_space"] == {"type": "Discrete", "n": 2}
    with pytest.warns(DeprecationWarning):  # torch 2.13 deprecates torch.jit; the file still loads (and in libtorch)
        scripted = torch.jit.load(str(tmp_path / "policy" / "policy.torchscript.pt"))
    assert torch.equal(scripted(obs), policy.act(obs))
    assert torch.allclose(scripted.scores(obs), policy(obs))
    weights = torch.load(tmp_path / "policy" / "weights.pt", weights_only=True)
    assert set(weights) == set(policy.network.state_dict())


@pytest.mark.parametrize("edit,field", [
    (lambda spec: spec["architecture"].update(n_actions=10**12), "policy.architecture.n_actions"),
    (lambda spec: spec["architecture"].update(hidden_sizes=[65536] * 64), "policy.architecture.hidden_sizes"),
    (lambda spec: spec.update(kind="transformer"), "policy.kind"),
    (lambda spec: spec["architecture"].update(hidden_sizes=[9, 8]), "policy.weights"),
    (lambda spec: spec["sha256"].update({"weights.pt": "0" * 64}), "policy.weights"),
])
def test_a_hostile_policy_description_is_refused_before_allocating(tmp_path, edit, field):
    save_policy(GreedyPolicy(4, [8, 8], 2), tmp_path)
    spec = json.loads((tmp_path / "policy.json").read_text())
    edit(spec)
    (tmp_path / "policy.json").write_text(json.dumps(spec))
    with pytest.raises(ValidationError) as info:
        load_policy(tmp_path)
    assert info.value.field == field


def test_a_checkpoint_from_a_run_on_other_data_is_refused(tmp_path):
    """Checkpoints carry the input hashes: one copied in from a run on another dataset is never resumed from."""
    import shutil

    from test_trainer import LogisticRegression, _trainer

    def trainer(name: str, dataset: str, mode: str):
        run = RunDirectory(tmp_path / name, pipeline="toy", config={"toy": 1}, mode=mode)
        run.check_inputs(dataset=dataset)
        run.begin()
        return _trainer(run, LogisticRegression(), cap=10)

    trainer("a", "sha-of-a", "new").fit()
    trainer("b", "sha-of-b", "new")  # a run directory for other data, not trained yet
    (tmp_path / "b" / "curator" / "checkpoints").mkdir()
    shutil.copy(tmp_path / "a" / "curator" / "checkpoints" / "last.pt", tmp_path / "b" / "curator" / "checkpoints")
    with pytest.raises(ValidationError) as info:
        trainer("b", "sha-of-b", "resume").fit()
    assert info.value.field == "inputs.dataset"
