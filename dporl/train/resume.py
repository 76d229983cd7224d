"""Resuming a training loop (``dporl.train.trainer.Trainer``) from its checkpoint and its privacy journal.

A checkpoint is loaded only by the run that wrote it (same pipeline, same trainer configuration hash, same input
data), and its states are restored with a named error for the part that does not match. The journal decides how
many steps were charged: steps an earlier attempt authorised but the checkpoint has not trained are replayed from
it with the secret randomness they were charged for, never charged again (see the trainer's module docstring).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Mapping, Optional

import torch
from torch import nn

from dporl.privacy.calibration import STEP_SEARCH_LIMIT
from dporl.privacy.events import PrivacyEvent
from dporl.privacy.ledger import PrivacyLedger
from dporl.utils.validation import ValidationError


def resume_plan(
    ledger: PrivacyLedger, stage: str, event: PrivacyEvent, planned: int, checkpointed: int, max_steps: Optional[int]
) -> tuple[int, int, int]:
    """(steps of ``stage`` charged, charged steps the checkpoint has not trained and this run replays, steps the
    model will have trained at the end). An earlier attempt's authorisations count as spent."""
    history = ledger.stages[stage].accountant.history
    charged = sum(count for _, count in history)
    if charged < checkpointed:
        raise ValidationError(
            "journal", f"the checkpoint records {checkpointed} private steps but the journal only {charged}: "
            "refusing to under-count (was the journal removed?)"
        )
    unrun = charged - checkpointed
    if all(recorded == event for recorded, _ in history):
        return charged, unrun, max(planned, charged)
    # The journal holds other events (an earlier attempt's, charged as recorded): fit what is left around them.
    # Charged steps of another event cannot be replayed under this one: they stay charged, and are lost.
    tail_event, tail_count = history[-1]
    ahead = min(unrun, tail_count) if tail_event == event else 0
    if unrun > ahead:
        print(f"resume: stage {stage!r}: {unrun - ahead} charged steps were authorised under another "
              "per-step event and cannot be replayed under this run's: they stay charged and are lost",
              file=sys.stderr)
    cap = STEP_SEARCH_LIMIT if max_steps is None else max(max_steps - charged, 0)
    return charged, ahead, checkpointed + ahead + ledger.remaining(stage, event, cap)


def announce_resume(stage: str, step: int, charged: int, ahead: int, total: int) -> None:
    """What a resumed loop found and will do (step counts are functions of the budget and the config)."""
    replay = (f"; {ahead} charged steps are not in the checkpoint: they run first, from it, with the secret "
              "randomness they were charged for (charged once)" if ahead else "")
    print(f"resume: stage {stage!r}: {step} steps trained, {charged} "
          f"charged{replay}; {max(total - step, 0)} steps to come (of {total})", file=sys.stderr)


def check_same_run(
    state: Mapping[str, Any], *, pipeline: str, trainer_sha256: str, inputs: Mapping[str, str], checkpoint_path: Path
) -> None:
    """Refuse a checkpoint written by another pipeline, configuration or input data."""
    if state["pipeline"] != pipeline or state["config_sha256"] != trainer_sha256:
        raise ValidationError(
            "trainer.resume", f"{checkpoint_path} belongs to a different configuration; use a new run_dir"
        )
    recorded = state.get("inputs") or {}
    differing = sorted(name for name in set(recorded) & set(inputs) if recorded[name] != inputs[name])
    if differing:
        raise ValidationError(f"inputs.{differing[0]}", f"{checkpoint_path} was trained on another "
                              f"{differing[0]}; refusing to resume from it")


def restore_states(
    state: dict[str, Any], algorithm: nn.Module, optimizer: torch.optim.Optimizer, scheduler: Any,
    generator: torch.Generator, noise: Any,
) -> None:
    """Load a checkpoint's states; a mismatch is a ValidationError naming the part, before anything is written."""
    parts = [("algorithm", lambda: algorithm.load_state_dict(state["algorithm"])),
             ("optimizer", lambda: optimizer.load_state_dict(state["optimizer"])),
             ("scheduler", lambda: scheduler.load_state_dict(state["scheduler"])),
             ("rng.sampler", lambda: generator.set_state(state["rng"]["sampler"]))]
    if noise is not None:
        parts.append(("rng.noise", lambda: noise.load_state_dict(state["rng"]["noise"])))
    for name, load in parts:
        try:
            load()
        except ValidationError:
            raise
        except (RuntimeError, ValueError, KeyError, TypeError, IndexError) as exc:
            raise ValidationError(f"checkpoint.{name}", f"does not match this run: {str(exc)[:300]}") from None
    try:
        state["eval_history"][:] = [(int(s), {str(k): float(v) for k, v in m.items()})
                                    for s, m in state["eval_history"]]
    except (TypeError, ValueError, AttributeError) as exc:
        raise ValidationError("checkpoint.eval_history", f"malformed: {exc}") from None
