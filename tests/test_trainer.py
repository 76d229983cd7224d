"""The shared training loop on a toy logistic regression: budget stopping, crash + resume, logging, configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

from dporl.algos.base import LossForm, PrivateAlgorithm
from dporl.privacy.calibration import max_steps
from dporl.privacy.events import MixtureEvent
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.samplers import MixtureSource, PoissonUnitSource, UniformBatchSource
from dporl.train.checkpoint import load_checkpoint
from dporl.train.run_dir import read_journal
from dporl.train.config import DPConfig, TrainerConfig
from dporl.train.trainer import Trainer
from dporl.utils.config import from_dict
from dporl.utils.validation import ValidationError

torch.set_num_threads(1)
N_ROWS, DELTA = 200, 1e-5


class LogisticRegression(PrivateAlgorithm):
    privacy_unit = "transition"
    loss_form = LossForm.ROW_LOSSES
    batch_keys = ("x", "y")
    policy_kind = None

    def __init__(self, crash_at: int | None = None):
        super().__init__()
        self.linear = nn.Linear(3, 1)
        self.crash_at = crash_at
        self.private_steps = 0  # private batches actually processed (to check the journal)

    def row_losses(self, batch):
        self.private_steps += int(batch.private)
        logits = self.linear(batch.data["x"]).squeeze(1)
        return nn.functional.binary_cross_entropy_with_logits(logits, batch.data["y"], reduction="none")

    def on_step_end(self, step: int) -> None:
        if self.crash_at is not None and step == self.crash_at:
            raise RuntimeError(f"simulated crash after step {step}")


def _data():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(N_ROWS, 3, generator=g)
    return {"x": x, "y": (x @ torch.tensor([1.0, -1.0, 0.5]) > 0).float()}


def _poisson_source():
    return PoissonUnitSource(_data(), torch.arange(N_ROWS), N_ROWS, sample_rate=0.05)


def _trainer(run_dir: Path, algorithm, *, source=None, cap=None, sigma=1.5, epsilon=1.5, ledger=None, **config):
    defaults = dict(max_steps=cap, seed=0, log_every=5, eval_every=10, checkpoint_every=10, journal_every=4,
                    progress=False)
    return Trainer(
        algorithm,
        source or _poisson_source(),
        config=TrainerConfig(**{**defaults, **config}),
        dp=DPConfig(epsilon=epsilon, delta=DELTA, noise_multiplier=sigma, noise_seed=0),
        ledger=ledger or PrivacyLedger(),
        run_dir=run_dir,
        pipeline="toy",
        pipeline_config={"toy": 1},
        evaluators={"fit": lambda module: {"weight_norm": float(module.linear.weight.norm())}},
    )


def test_budget_driven_stopping_takes_exactly_max_steps(tmp_path):
    source = _poisson_source()
    allowed = max_steps(source.step_event(1.5), 1.5, DELTA, mechanism="rdp")
    assert 10 < allowed < 200
    trainer = _trainer(tmp_path, LogisticRegression(), source=source)
    result = trainer.fit()
    assert result.steps == result.budget_steps == allowed
    stage = trainer.ledger.stages["train"]
    assert len(stage.accountant) == allowed and stage.unit.name == "transition"
    assert trainer.ledger.spent("train") <= 1.5
    guarantee = result.privacy["guarantee"]
    assert guarantee["unit"] == "transition" and "RDP" in guarantee["analysis"] and guarantee["epsilon"] <= 1.5
    assert "privacy unit: transition" in result.privacy["text"]
    assert list((tmp_path / "release" / "tensorboard").glob("events.out.tfevents.*"))
    assert not (tmp_path / "curator" / "tensorboard").exists()  # curator diagnostics are off by default
    assert (tmp_path / "release" / "privacy_report.json").exists() and (tmp_path / "curator" / "train_summary.json").exists()
    assert result.eval_history[-1][1]["privacy/epsilon"] == pytest.approx(trainer.ledger.spent("train"))


def test_calibrated_run_fills_its_step_cap(tmp_path):
    trainer = _trainer(tmp_path, LogisticRegression(), cap=30, sigma=None, epsilon=2.0)
    result = trainer.fit()
    assert result.steps == 30 and result.noise_multiplier is not None
    assert trainer.ledger.spent("train") <= 2.0


def test_mixture_steps_are_accounted_as_mixtures(tmp_path):
    data = _data()
    source = MixtureSource(0.5, _poisson_source(), UniformBatchSource(data, 16))
    trainer = _trainer(tmp_path, LogisticRegression(), source=source, cap=40, epsilon=5.0)
    trainer.fit()
    ((event, count),) = trainer.ledger.stages["train"].accountant.history
    assert isinstance(event, MixtureEvent) and count == 40  # every step pays, whichever branch it drew


def test_crash_then_resume_trains_exactly_the_uninterrupted_run(tmp_path):
    start = LogisticRegression().state_dict()  # both runs start from the same weights
    first = LogisticRegression()
    first.load_state_dict(start)
    reference = _trainer(tmp_path / "reference", first)
    reference_result = reference.fit()

    crashing = LogisticRegression(crash_at=17)
    crashing.load_state_dict(start)
    run_dir = tmp_path / "crashed"
    with pytest.raises(RuntimeError, match="simulated crash"):
        _trainer(run_dir, crashing).fit()
    # The journal authorised at least every private step that ran (never under-counts).
    assert len(read_journal(run_dir / "curator" / "journal.json").stages["train"].accountant) >= crashing.private_steps == 17
    # A checkpoint before every journal block (journal_every=4): the one before the block holding step 17, intact.
    checkpoint = load_checkpoint(run_dir / "curator" / "checkpoints" / "last.pt")
    assert checkpoint["step"] == 16
    assert not [p for p in (run_dir / "curator" / "checkpoints").iterdir() if p.name != "last.pt"]  # no temp files

    resumed = _trainer(run_dir, LogisticRegression())  # fresh process state: a new module and a new ledger
    result = resumed.fit()
    assert result.budget_steps == reference_result.budget_steps  # stops at the same budget, never past it
    assert resumed.ledger.spent("train") == reference.ledger.spent("train")
    assert len(resumed.ledger.stages["train"].accountant) == reference_result.budget_steps
    # No paid step is lost: step 17 (charged, trained, lost in the crash) is replayed from the step-16 checkpoint with
    # the same generator states, so the resumed run ends with exactly the uninterrupted run's model.
    assert result.steps == reference_result.steps == result.budget_steps
    assert resumed.algorithm.private_steps == reference_result.steps - 16
    for mine, theirs in zip(resumed.algorithm.parameters(), reference.algorithm.parameters()):
        assert torch.equal(mine, theirs)


def test_resume_refused_for_a_different_configuration(tmp_path):
    _trainer(tmp_path, LogisticRegression(), cap=5).fit()
    other = _trainer(tmp_path, LogisticRegression(), cap=5)
    other.pipeline_config = {"toy": 2}
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    with pytest.raises(ValidationError, match="another configuration.*pipeline_config.toy: 1 -> 2"):
        other.fit()
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()} == before  # nothing written


def test_privacy_unit_and_stage_checks(tmp_path):
    anonymous = LogisticRegression()
    anonymous.privacy_unit = None
    with pytest.raises(ValidationError, match="privacy_unit"):
        _trainer(tmp_path / "a", anonymous, cap=5).fit()
    ledger = PrivacyLedger()
    ledger.stage("train", budget=(1.5, DELTA), mechanism="rdp", unit="expert")
    with pytest.raises(ValidationError, match="ledger.stage"):
        _trainer(tmp_path / "b", LogisticRegression(), cap=5, ledger=ledger).fit()


def test_configs_reject_unknown_keys_and_bad_values():
    with pytest.raises(ValidationError, match="max_step"):
        from_dict(TrainerConfig, {"max_step": 5})
    with pytest.raises(ValidationError, match="nois_multiplier"):
        from_dict(DPConfig, {"epsilon": 1.0, "nois_multiplier": 2.0})
    with pytest.raises(ValidationError, match="dp.epsilon"):
        DPConfig(epsilon=None)
    with pytest.raises(ValidationError, match="optimizer.lr"):
        from_dict(TrainerConfig, {"optimizer": {"lr": -1.0}})


class _RecordingSource:
    """Wraps a Poisson source and remembers which rows each step sampled."""

    def __init__(self, source):
        self.source, self.sampled = source, []

    def __getattr__(self, name):
        return getattr(self.source, name)

    def sample(self, generator):
        batch = self.source.sample(generator)
        self.sampled.append(batch.data["x"].sum().item())
        return batch


def test_private_sampling_is_secret_unless_a_noise_seed_asks_for_a_reproduction(tmp_path):
    """Amplification by subsampling needs the sampled units to be unknown: the public trainer seed must not fix them."""

    def sampled(run_dir, noise_seed):
        source = _RecordingSource(_poisson_source())
        trainer = _trainer(run_dir, LogisticRegression(), source=source, cap=5)
        trainer.dp.noise_seed = noise_seed
        trainer.fit()
        return source.sampled

    assert sampled(tmp_path / "a", None) != sampled(tmp_path / "b", None)  # same trainer.seed, fresh secret draws
    assert sampled(tmp_path / "c", 7) == sampled(tmp_path / "d", 7)
