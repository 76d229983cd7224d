"""Atomic file writes (readers never see a half-written file, and a crash leaves the old file intact) and safe reads.

Every file dporl writes goes through ``atomic_path``: a temporary file beside the target, fsynced and renamed onto
it, and removed on every other way out (an exception, a full disk, Ctrl-C). A full disk or quota (ENOSPC, EDQUOT,
also when torch reports it as a failed zip write) is a ``DiskFullError`` naming the file, never a traceback.

Reading never runs code from a file and bounds what it allocates: torch files are read with ``weights_only=True``
(tensors and plain Python containers only; a pickled object is refused) after their zip directory was checked
(``dporl.utils.archives``), JSON with ``json`` after a nesting-depth check (``parse_json``); npz archives are read
member by member with ``allow_pickle=False`` after their headers were checked. ``load_weights`` is the one torch
reader and names the field a bad file belongs to.
``curator_note`` is where a description of private data goes: stderr, labelled, never stdout.

JSON is strict both ways (RFC 8259): every JSON text dporl writes goes through ``dump_json``, which writes a
non-finite number (NaN, an infinity: an estimate that failed, a bound that does not exist) as ``null`` and never the
``NaN`` / ``Infinity`` tokens Python's ``json`` emits by default and other readers refuse; every JSON text dporl reads
goes through ``parse_json``, which refuses those tokens by name.
"""

from __future__ import annotations

import contextlib
import csv
import errno
import io
import json
import os
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Callable, Iterable, Iterator, Mapping, Optional, Sequence

from dporl.utils.validation import ValidationError

# JSON nesting deeper than this is refused before parsing (dporl's own files nest fewer than 10 levels; Python's
# parser would otherwise recurse until RecursionError).
MAX_JSON_DEPTH = 64
# JSON files dporl reads (policy.json, provenance, journals, summaries, dataset metadata) are small.
MAX_JSON_BYTES = 64 << 20
_DISK_FULL = {errno.ENOSPC, errno.EDQUOT}


class DiskFullError(ValidationError):
    """The file system refused a write (no space or quota left); the half-written temporary file was removed."""


def disk_full_cause(exc: BaseException) -> Optional[OSError]:
    """The ENOSPC / EDQUOT ``OSError`` in ``exc``'s chain (torch wraps the file object's error in a RuntimeError)."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _DISK_FULL:
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def disk_full_error(path: str | os.PathLike, cause: OSError) -> DiskFullError:
    return DiskFullError(
        "disk", f"{os.strerror(cause.errno)} while writing {path} (errno {errno.errorcode.get(cause.errno, cause.errno)}): "
        f"nothing was written there; free space, then rerun (--resume continues a run)")


CURATOR_LABEL = "curator-only (covered by no guarantee; never share)"


def curator_note(text: str) -> None:
    """Tell the curator something about the private data: on stderr, labelled, never on the stdout that ends with a
    run's guarantee (what a run prints there is public: functions of the config and of accounted releases)."""
    print(f"{CURATOR_LABEL}: {text}", file=sys.stderr)


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, suffix: str = "") -> Iterator[Path]:
    """Yield a temporary path beside ``path``; on success it is fsynced and renamed onto ``path``.

    The temporary file lives in the same directory so that ``os.replace`` is an atomic rename on POSIX.
    ``suffix`` lets writers that insist on an extension (``np.savez`` appends ``.npz``) keep it. The temporary file
    is removed on every way out but success; a full disk raises ``DiskFullError``.
    """
    target = Path(path)
    tmp: Optional[Path] = None
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=f".tmp{suffix}", dir=target.parent)
        os.close(fd)
        tmp = Path(tmp_name)
        yield tmp
        with open(tmp, "rb+") as handle:
            os.fsync(handle.fileno())
        os.replace(tmp, target)
        tmp = None
    except Exception as exc:
        cause = disk_full_cause(exc)
        if cause is None:
            raise
        raise disk_full_error(target, cause) from None
    finally:
        if tmp is not None:
            with contextlib.suppress(FileNotFoundError):
                tmp.unlink()


def atomic_write(path: str | os.PathLike, write: Callable[[Path], Any], suffix: str = "") -> Path:
    """Call ``write(tmp_path)`` and atomically move the result to ``path``."""
    with atomic_path(path, suffix=suffix) as tmp:
        write(tmp)
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text))


def atomic_write_csv(path: str | os.PathLike, fieldnames: Sequence[str], rows: Iterable[Mapping[str, Any]],
                     **writer_options: Any) -> Path:
    """``rows`` as a CSV with a header, fields quoted where they need it (``csv.DictWriter``), written atomically."""
    buffer = io.StringIO()
    writer = csv.DictWriter(buffer, fieldnames=list(fieldnames), **writer_options)
    writer.writeheader()
    writer.writerows(rows)
    return atomic_write_text(path, buffer.getvalue())


def atomic_write_json(path: str | os.PathLike, payload: Any) -> Path:
    return atomic_write_text(path, dump_json(payload, indent=2, sort_keys=True) + "\n")


def json_ready(value: Any, default: Optional[Callable[[Any], Any]] = None) -> Any:
    """``value`` as plain JSON data: dicts (string keys), lists, strings, booleans, None, ints and finite floats.

    A non-finite float (NaN, +-inf; numpy's too) becomes None, numpy scalars and arrays plain numbers and lists, a
    ``Path`` its text; any other object goes through ``default`` (e.g. ``str``), else is a TypeError.
    """
    import math

    import numpy as np

    if value is None or isinstance(value, (str, bool)):
        return value
    if isinstance(value, (int, np.integer)) and not isinstance(value, np.bool_):
        return int(value)
    if isinstance(value, (float, np.floating)):
        return float(value) if math.isfinite(value) else None
    if isinstance(value, np.bool_):
        return bool(value)
    if isinstance(value, dict):
        return {(k if isinstance(k, str) else json.dumps(json_ready(k, default))): json_ready(v, default)
                for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_ready(v, default) for v in value]
    if isinstance(value, np.ndarray):
        return json_ready(value.tolist(), default)
    if isinstance(value, Path):
        return str(value)
    if default is not None:
        return json_ready(default(value))
    raise TypeError(f"cannot serialise {type(value).__name__} to JSON")


def dump_json(value: Any, *, default: Optional[Callable[[Any], Any]] = None, **options: Any) -> str:
    """Strict JSON text of ``value`` (``json_ready``: non-finite numbers as ``null``); ``options`` go to
    ``json.dumps`` (indent, sort_keys, separators)."""
    return json.dumps(json_ready(value, default), allow_nan=False, **options)


def atomic_torch_save(path: str | os.PathLike, obj: Any) -> Path:
    """``torch.save`` atomically. Written through a file handle, so the archive's inner folder is torch's fixed
    "archive" rather than the random temporary name: the same object gives the same bytes (released files are
    compared byte for byte, and a file's bytes should say nothing but its content)."""
    import torch

    def write(tmp: Path) -> None:
        # Through a Python file object: a failed write then carries its OSError (ENOSPC) instead of torch's
        # "unexpected pos" from the C++ writer.
        with open(tmp, "wb") as handle:
            torch.save(obj, handle)

    return atomic_write(path, write)


def load_weights(path: str | os.PathLike, field: str, map_location: Any = "cpu") -> Any:
    """``torch.load(path, weights_only=True)``; any unreadable, truncated, oversized or code-carrying file is a
    ValidationError.

    ``weights_only`` refuses every pickled global except tensors and plain containers, so a hostile file cannot
    execute anything while it is read; the zip directory is checked first (``dporl.utils.archives.check_zip``), so a
    file cannot make it inflate or allocate more than its members' declared, bounded sizes.
    """
    import torch

    from dporl.utils.archives import check_zip

    path = Path(path)
    if not path.is_file():
        raise ValidationError(field, f"file not found: {path}")
    if not zipfile.is_zipfile(path):  # the legacy format sizes its storages from the pickle, unchecked
        raise ValidationError(field, f"{path} is not a readable weights-only torch file (not the zip format dporl "
                              "writes)")
    check_zip(path, field)
    try:
        return torch.load(path, map_location=map_location, weights_only=True)
    except Exception as exc:  # UnpicklingError (a refused global), zip/EOF errors, a foreign format
        raise ValidationError(field, f"{path} is not a readable weights-only torch file ({type(exc).__name__}: "
                              f"{str(exc).splitlines()[0] if str(exc) else ''})") from None


def json_depth(text: str) -> int:
    """The deepest nesting of arrays and objects in JSON ``text``, without parsing it (vectorised, linear time).

    A bracket counts unless it lies inside a string: between an odd and an even unescaped quote, where a quote is
    escaped when an odd number of backslashes precedes it.
    """
    import numpy as np

    codes = np.frombuffer(text.encode("utf-8", "surrogatepass"), dtype=np.uint8)
    if codes.size == 0:
        return 0
    index = np.arange(codes.size)
    backslash = codes == ord("\\")
    last_other = np.maximum.accumulate(np.where(backslash, -1, index))  # last non-backslash at or before i
    run_before = np.zeros(codes.size, dtype=np.int64)  # backslashes immediately before position i
    run_before[1:] = index[:-1] - last_other[:-1]
    quote = (codes == ord('"')) & (run_before % 2 == 0)
    inside = (np.cumsum(quote) - quote) % 2 == 1  # an odd number of quotes before i: i is inside a string
    steps = np.zeros(codes.size, dtype=np.int64)
    steps[((codes == ord("[")) | (codes == ord("{"))) & ~inside] = 1
    steps[((codes == ord("]")) | (codes == ord("}"))) & ~inside] = -1
    return int(max(np.cumsum(steps).max(), 0))


def parse_json(text: str, field: str, where: str = "", max_depth: int = MAX_JSON_DEPTH) -> Any:
    """``json.loads(text)``, refusing (``ValidationError`` naming ``field``) malformed JSON and nesting deeper than
    ``max_depth`` before the parser recurses into it."""
    where = f"{where} " if where else ""
    if not isinstance(text, str):
        raise ValidationError(field, f"{where}is not a JSON string")
    depth = json_depth(text)
    if depth > max_depth:
        raise ValidationError(field, f"{where}nests JSON {depth} levels deep (at most {max_depth} are read)")
    def refuse(token: str) -> Any:
        raise ValidationError(field, f"{where}holds {token}, which is not JSON (a missing number is null)")

    try:
        return json.loads(text, parse_constant=refuse)
    except ValidationError:
        raise
    except (ValueError, RecursionError) as exc:
        raise ValidationError(field, f"{where}is not valid JSON ({type(exc).__name__}: {exc})") from None


def read_json(path: str | os.PathLike, field: str, max_bytes: int = MAX_JSON_BYTES) -> Any:
    """The JSON value in ``path``; a missing, oversized, too deeply nested or malformed file is a ValidationError
    naming ``field``."""
    path = Path(path)
    if not path.is_file():
        raise ValidationError(field, f"file not found: {path}")
    size = path.stat().st_size
    if size > max_bytes:
        raise ValidationError(field, f"{path} holds {size} bytes, more than the {max_bytes} a JSON file may")
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise ValidationError(field, f"{path} is not readable UTF-8 text ({exc})") from None
    return parse_json(text, field, str(path))


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(chunk), b""):
            digest.update(block)
    return digest.hexdigest()


