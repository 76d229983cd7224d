"""Atomic file writes: readers never see a half-written file, and a crash leaves the old file intact."""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is fsynced and renamed onto ``path``.

    The temporary file lives in the same directory so that ``os.replace`` is an atomic rename on POSIX.
    ``suffix`` lets writers that insist on an extension (``np.savez`` appends ``.npz``) keep it.
    """
    target = Path(path)
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=f".tmp{suffix}", dir=target.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        yield tmp
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, target)
    finally:
        if tmp.exists():
            tmp.unlink()


def atomic_write(path: str | os.PathLike, write: Callable[[Path], Any], suffix: str = "") -> Path:
    """Call ``write(tmp_path)`` and atomically move the result to ``path``."""
    with atomic_path(path, suffix=suffix) as tmp:
        write(tmp)
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text))


def atomic_write_json(path: str | os.PathLike, payload: Any) -> Path:
    return atomic_write_text(path, json.dumps(payload, indent=2, sort_keys=True, default=_json_default) + "\n")


def atomic_torch_save(path: str | os.PathLike, obj: Any) -> Path:
    import torch

    return atomic_write(path, lambda tmp: torch.save(obj, tmp))


def _json_default(value: Any) -> Any:
    import numpy as np

    if isinstance(value, (np.integer,)):
        return int(value)
    if isinstance(value, (np.floating,)):
        return float(value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, Path):
        return str(value)
    raise TypeError(f"cannot serialise {type(value).__name__} to JSON")
