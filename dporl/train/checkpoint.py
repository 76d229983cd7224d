"""Atomic, weights-only checkpoints (curator-only: they hold the secret generators' states).

A checkpoint is one torch file of tensors and plain containers (numbers, strings, lists, dicts), read back with
``torch.load(weights_only=True)``: a file carrying a pickled object is refused, never executed. Generator states
are the uint8 tensors torch exposes; no global RNG state is stored (dporl draws only from explicit generators).
It records the provenance of the run that wrote it (the trainer's config hash and the input data's hashes) and is
loaded only by that run.

The privacy spend is not in the checkpoint: the run's write-ahead journal (``dporl.train.run_dir``) holds every
authorised event, and recovery charges them as recorded. The checkpoint records what the journal charged when it
was written (``RunDirectory.journal_witness``), so a journal that charges less than a checkpoint saw is refused.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from dporl.utils.io import atomic_torch_save, load_weights
from dporl.utils.validation import ValidationError

CHECKPOINT_FORMAT = 3  # 3: records the journal's chain head and charges at the time it was written
_REQUIRED_KEYS = {
    "format": int,
    "pipeline": str,
    "config_sha256": str,
    "step": int,
    "budget_steps": int,
    "algorithm": dict,
    "optimizer": dict,
    "scheduler": dict,
    "eval_history": list,
    "rng": dict,
    "journal": dict,
}


def save_checkpoint(path: str | Path, payload: dict[str, Any]) -> Path:
    payload = {"format": CHECKPOINT_FORMAT, **payload}
    missing = [k for k in _REQUIRED_KEYS if k not in payload]
    if missing:
        raise ValueError(f"checkpoint payload lacks {missing}")
    return atomic_torch_save(path, payload)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    """A checkpoint's payload, weights-only; anything else (corrupt, truncated, foreign, pickled code) is refused."""
    path = Path(path)
    payload = load_weights(path, "checkpoint")
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        raise ValidationError("checkpoint", f"{path} is not a dporl checkpoint (format {CHECKPOINT_FORMAT})")
    for key, kind in _REQUIRED_KEYS.items():
        if key not in payload:
            raise ValidationError("checkpoint", f"{path} lacks {key!r}")
        if not isinstance(payload[key], kind) or (kind is int and isinstance(payload[key], bool)):
            raise ValidationError(f"checkpoint.{key}", f"expected {kind.__name__}, got {type(payload[key]).__name__}")
    if not 0 <= payload["step"] <= payload["budget_steps"]:
        raise ValidationError("checkpoint", f"{path} holds inconsistent step counts")
    if not isinstance(payload["rng"].get("sampler"), torch.Tensor):
        raise ValidationError("checkpoint.rng", f"{path} holds no sampler generator state")
    return payload
