"""Atomic checkpoints and the write-ahead privacy journal.

The journal records how many privacy-costing steps have been *authorised* before they run. A run killed between
two checkpoints may have released information from steps after the last checkpoint (TensorBoard scalars,
evaluations of its iterates); on resume those steps are counted again as spent, so the ledger never under-counts.
"""

from __future__ import annotations

import json
import pickle
import zipfile
from pathlib import Path
from typing import Any

import torch

from dporl.utils.io import atomic_torch_save, atomic_write_json
from dporl.utils.validation import ValidationError

CHECKPOINT_FORMAT = 1
_REQUIRED_KEYS = ("format", "pipeline", "config", "step", "budget_steps", "algorithm", "optimizer", "ledger", "rng")


def save_checkpoint(path: str | Path, payload: dict[str, Any]) -> Path:
    payload = {"format": CHECKPOINT_FORMAT, **payload}
    missing = [k for k in _REQUIRED_KEYS if k not in payload]
    if missing:
        raise ValueError(f"checkpoint payload lacks {missing}")
    return atomic_torch_save(path, payload)


def load_checkpoint(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ValidationError("checkpoint", f"file not found: {path}")
    try:
        # Checkpoints hold RNG states (numpy / python tuples), hence weights_only=False: load only your own files.
        payload = torch.load(path, map_location="cpu", weights_only=False)
    except (RuntimeError, EOFError, pickle.UnpicklingError, zipfile.BadZipFile, OSError, ValueError) as exc:
        raise ValidationError("checkpoint", f"{path} is corrupt or truncated: {exc}") from None
    if not isinstance(payload, dict) or payload.get("format") != CHECKPOINT_FORMAT:
        raise ValidationError("checkpoint", f"{path} is not a dporl checkpoint (format {CHECKPOINT_FORMAT})")
    missing = [k for k in _REQUIRED_KEYS if k not in payload]
    if missing:
        raise ValidationError("checkpoint", f"{path} lacks {missing}")
    return payload


def read_journal(path: str | Path) -> int:
    """Steps authorised so far (0 when there is no journal)."""
    path = Path(path)
    if not path.exists():
        return 0
    try:
        authorised = json.loads(path.read_text())["authorised_steps"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValidationError("journal", f"{path} is corrupt ({exc}); refusing to guess how much budget was spent")
    if not isinstance(authorised, int) or authorised < 0:
        raise ValidationError("journal", f"{path} holds an invalid step count {authorised!r}")
    return authorised


def write_journal(path: str | Path, authorised_steps: int) -> None:
    atomic_write_json(path, {"authorised_steps": int(authorised_steps)})
