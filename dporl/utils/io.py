"""Atomic file writes (readers never see a half-written file, and a crash leaves the old file intact) and safe reads.

Reading never runs code from a file: torch files are read with ``weights_only=True`` (tensors and plain Python
containers only; a pickled object is refused), JSON with ``json``; ``np.load`` is always called with
``allow_pickle=False``. ``load_weights`` is the one torch reader and names the field a bad file belongs to.
``curator_note`` is where a description of private data goes: stderr, labelled, never stdout.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator


CURATOR_LABEL = "curator-only (covered by no guarantee; never share)"


def curator_note(text: str) -> None:
    """Tell the curator something about the private data: on stderr, labelled, never on the stdout that ends with a
    run's guarantee (what a run prints there is public: functions of the config and of accounted releases)."""
    print(f"{CURATOR_LABEL}: {text}", file=sys.stderr)


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
    """``torch.save`` atomically. Written through a file handle, so the archive's inner folder is torch's fixed
    "archive" rather than the random temporary name: the same object gives the same bytes (released files are
    compared byte for byte, and a file's bytes should say nothing but its content)."""
    import torch

    def save(tmp: Path) -> None:
        with open(tmp, "wb") as handle:
            torch.save(obj, handle)

    return atomic_write(path, save)


def load_weights(path: str | os.PathLike, field: str, map_location: Any = "cpu") -> Any:
    """``torch.load(path, weights_only=True)``; any unreadable, truncated or code-carrying file is a ValidationError.

    ``weights_only`` refuses every pickled global except tensors and plain containers, so a hostile file cannot
    execute anything while it is read.
    """
    import torch

    from dporl.utils.validation import ValidationError

    path = Path(path)
    if not path.is_file():
        raise ValidationError(field, f"file not found: {path}")
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # UnpicklingError (a refused global), zip/EOF errors, a foreign format
        raise ValidationError(field, f"{path} is not a readable weights-only torch file ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''})") from None


def read_json(path: str | os.PathLike, field: str) -> Any:
    """The JSON value in ``path``; a missing or malformed file is a ValidationError naming ``field``."""
    from dporl.utils.validation import ValidationError

    path = Path(path)
    if not path.is_file():
        raise ValidationError(field, f"file not found: {path}")
    try:
        return json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as exc:
        raise ValidationError(field, f"{path} is not valid JSON ({exc})") from None


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(chunk), b""):
            digest.update(block)
    return digest.hexdigest()


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
