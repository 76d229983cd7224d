"""Fault injection: training killed at random points (an exception from a hook, or SIGKILL of a subprocess) and
resumed. Properties: the ledger never counts fewer private steps than were run (the write-ahead journal),
checkpoints always load (atomic writes), the resumed run ends exactly at its budget, and no paid step is lost (the
steps charged but not checkpointed are replayed from the last checkpoint, which precedes every journal block).
"""

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from dporl.train.checkpoint import load_checkpoint
from dporl.train.run_dir import read_journal

# The toy run, shared by the in-process tests and the subprocess (so both train exactly the same thing).
TOY = textwrap.dedent(
    """
    import os, torch
    from torch import nn
    from dporl.algos.base import LossForm, PrivateAlgorithm
    from dporl.privacy.ledger import PrivacyLedger
    from dporl.privacy.samplers import PoissonUnitSource
    from dporl.train.config import DPConfig, TrainerConfig
    from dporl.train.trainer import Trainer

    torch.set_num_threads(1)

    class Toy(PrivateAlgorithm):
        privacy_unit = "transition"
        loss_form = LossForm.ROW_LOSSES
        batch_keys = ("x", "y")
        policy_kind = None

        def __init__(self, step_log=None, crash_at=None):
            super().__init__()
            self.linear = nn.Linear(3, 1)
            self.step_log, self.crash_at = step_log, crash_at
            self.private_steps = 0

        def row_losses(self, batch):
            self.private_steps += 1
            if self.step_log is not None:  # one line per private step started, durable before the step runs on
                with open(self.step_log, "a") as f:
                    f.write("s\\n")
                    f.flush()
                    os.fsync(f.fileno())
            return (self.linear(batch.data["x"]).squeeze(1) - batch.data["y"]).pow(2)

        def on_step_end(self, step):
            if self.crash_at is not None and step == self.crash_at:
                raise RuntimeError(f"injected fault after step {step}")

    def make_trainer(run_dir, algorithm, max_steps):
        g = torch.Generator().manual_seed(0)
        x = torch.randn(200, 3, generator=g)
        data = {"x": x, "y": x @ torch.tensor([1.0, -2.0, 0.5])}
        source = PoissonUnitSource(data, torch.arange(200), 200, sample_rate=0.05)
        config = TrainerConfig(max_steps=max_steps, seed=0, log_every=5, eval_every=1000, checkpoint_every=7,
                               journal_every=5, progress=False)
        dp = DPConfig(epsilon=50.0, delta=1e-5, noise_multiplier=1.0, noise_seed=0)
        return Trainer(algorithm, source, config=config, dp=dp, ledger=PrivacyLedger(), run_dir=run_dir,
                       pipeline="robustness", pipeline_config={"toy": 1})
    """
)
namespace: dict = {}
exec(compile(TOY, "toy_run", "exec"), namespace)
Toy, make_trainer = namespace["Toy"], namespace["make_trainer"]


def _ledger_steps(trainer) -> int:
    return len(trainer.ledger.stages["train"].accountant)


def _authorised(run_dir: Path) -> int:
    """Private steps the write-ahead journal has authorised (charged whether or not they ran)."""
    return len(read_journal(run_dir / "curator" / "journal.json").stages["train"].accountant)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_exception_at_a_random_step_then_resume_never_undercounts(tmp_path, seed):
    total = 40
    crash_at = int(np.random.default_rng(seed).integers(1, total))
    first = Toy(crash_at=crash_at)
    with pytest.raises(RuntimeError, match="injected fault"):
        make_trainer(tmp_path, first, total).fit()
    # The journal authorised every step that ran before the fault (a block of journal_every at a time).
    assert _authorised(tmp_path) >= first.private_steps == crash_at
    checkpoint = tmp_path / "curator" / "checkpoints" / "last.pt"
    # Checkpoints before every journal block (journal_every=5) and every checkpoint_every=7 steps.
    saved = max(k for k in range(crash_at) if k % 5 == 0 or k % 7 == 0)
    assert load_checkpoint(checkpoint)["step"] == saved
    assert _authorised(tmp_path) - saved <= 5  # at most one block charged beyond the checkpoint

    second = Toy()
    trainer = make_trainer(tmp_path, second, total)
    result = trainer.fit()
    assert result.budget_steps == result.steps == total  # every charged step trained: none lost
    # The resumed run replays the charged steps after the checkpoint (with their recorded randomness), then the rest.
    assert _ledger_steps(trainer) == total == second.private_steps + saved
    assert load_checkpoint(checkpoint)["budget_steps"] == total


def test_a_finished_run_refuses_to_spend_more(tmp_path):
    trainer = make_trainer(tmp_path, Toy(), 10)
    trainer.fit()
    again = make_trainer(tmp_path, Toy(), 10)
    result = again.fit()
    assert result.budget_steps == 10 and _ledger_steps(again) == 10  # resumed at the end: nothing more ran


def _run_and_kill(run_dir: Path, step_log: Path, kill_after: int, total: int) -> None:
    code = TOY + textwrap.dedent(
        f"""
        make_trainer({str(run_dir)!r}, Toy(step_log={str(step_log)!r}), {total}).fit()
        """
    )
    process = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 120
    try:
        while time.monotonic() < deadline and process.poll() is None:
            if step_log.exists() and len(step_log.read_text()) // 2 >= kill_after:
                break
            time.sleep(0.005)
        assert process.poll() is None, process.stderr.read().decode()[-2000:]
        os.kill(process.pid, signal.SIGKILL)
    finally:
        process.wait(timeout=30)
        process.stderr.close()


@pytest.mark.parametrize("seed", [3])
def test_sigkill_at_a_random_point_then_resume(tmp_path, seed):
    total = 120
    kill_after = int(np.random.default_rng(seed).integers(10, 100))
    step_log = tmp_path / "steps.log"
    run_dir = tmp_path / "run"
    _run_and_kill(run_dir, step_log, kill_after, total)
    started = len(step_log.read_text()) // 2  # steps that began before the kill (the last may be half done)
    assert started >= kill_after
    authorised = _authorised(run_dir)
    assert authorised >= started  # the write-ahead journal covers every step that could have leaked
    checkpoint = run_dir / "curator" / "checkpoints" / "last.pt"
    # Atomic: whatever the kill interrupted, the file on disk is a whole checkpoint, at most one block behind.
    saved = load_checkpoint(checkpoint)["step"]
    assert saved <= started and authorised - saved <= 5

    resumed = Toy()
    trainer = make_trainer(run_dir, resumed, total)
    result = trainer.fit()
    assert result.budget_steps == result.steps == total and _ledger_steps(trainer) == total
    assert saved + resumed.private_steps == total  # the charged steps after the checkpoint ran again, once
    assert torch.isfinite(trainer.algorithm.linear.weight).all()
