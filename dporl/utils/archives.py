"""Zip archives (npz datasets, torch files) read with their sizes bounded before anything is inflated or allocated.

A zip's central directory states each member's compressed and uncompressed size, and an ``.npy`` member's header
states its dtype and shape. Both are read (a few hundred bytes per member) and checked before any array is read:

- the compression ratio of a member is at most ``MAX_COMPRESSION_RATIO`` unless its inflated size is below
  ``SMALL_MEMBER_BYTES`` (dporl writes uncompressed archives; legitimately compressed data stay far below the cap,
  a zip bomb does not);
- the inflated sizes together fit ``load_budget_bytes()`` (half the machine's memory);
- an ``.npy`` header's ``shape x itemsize`` plus its header length equals the member's stated inflated size, so the
  array numpy allocates is exactly the one the directory describes (a truncated or lying member is refused before
  the allocation, not after), and object dtypes (pickles) are refused.

Callers then compare the declared shapes with what the file's metadata says (``dporl.data.dataset``) before reading
an array. Every refusal is a ``ValidationError`` naming the caller's field.
"""

from __future__ import annotations

import math
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import numpy as np

from dporl.utils.validation import ValidationError

MAX_COMPRESSION_RATIO = 200
SMALL_MEMBER_BYTES = 16 << 20


def load_budget_bytes() -> int:
    """The most a single file may inflate to: half the machine's physical memory."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // 2
    except (ValueError, OSError, AttributeError):  # pragma: no cover - non-POSIX
        return 8 << 30


def _open_zip(path: Path, field: str) -> zipfile.ZipFile:
    try:
        return zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, ValueError, EOFError, NotImplementedError) as exc:  # e.g. a foreign zip version
        raise ValidationError(field, f"{path} is not a readable zip archive ({type(exc).__name__}: {exc})") from None


def _check_members(path: Path, field: str, infos: list[zipfile.ZipInfo]) -> int:
    """Refuse duplicate names, absurd compression ratios and a total beyond the load budget; the total size."""
    names = [info.filename for info in infos]
    if len(set(names)) != len(names):
        raise ValidationError(field, f"{path} names a member twice")
    total = 0
    for info in infos:
        size, packed = info.file_size, info.compress_size
        if info.compress_type != zipfile.ZIP_STORED and size > SMALL_MEMBER_BYTES and size > MAX_COMPRESSION_RATIO * max(packed, 1):
            raise ValidationError(
                field, f"member {info.filename!r} of {path} inflates {packed} bytes to {size} (ratio "
                f"{size / max(packed, 1):.0f}:1, at most {MAX_COMPRESSION_RATIO}:1 above {SMALL_MEMBER_BYTES >> 20} MiB): "
                "refused before inflating (a zip bomb or a corrupt file)")
        total += size
    budget = load_budget_bytes()
    if total > budget:
        raise ValidationError(field, f"{path} would inflate to {total} bytes, more than the {budget} this machine "
                              "may load (half its memory)")
    return total


def check_zip(path: str | os.PathLike, field: str) -> None:
    """Bound a zip-based file (a torch file) before a library reads it: ratios and total size (module docstring)."""
    path = Path(path)
    with _open_zip(path, field) as archive:
        _check_members(path, field, archive.infolist())


@dataclass(frozen=True)
class NpyMember:
    """What an npz member's header declares (read without reading the array)."""

    name: str  # the array's key (the member name without ".npy")
    dtype: np.dtype
    shape: tuple[int, ...]
    fortran_order: bool

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


class NpzArchive:
    """An ``.npz`` whose members' headers were checked (module docstring); arrays are read one at a time.

    ``members`` maps each key to its ``NpyMember``; ``read(key)`` returns the array (``allow_pickle=False``).
    Use as a context manager.
    """

    def __init__(self, path: str | os.PathLike, field: str):
        self.path, self.field = Path(path), field
        if not self.path.is_file():
            raise ValidationError(field, f"no file at {self.path}")
        self._zip = _open_zip(self.path, field)
        try:
            infos = self._zip.infolist()
            _check_members(self.path, field, infos)
            self._infos = {}
            self.members: dict[str, NpyMember] = {}
            for info in infos:
                if not info.filename.endswith(".npy"):
                    raise ValidationError(field, f"{self.path} holds {info.filename!r}, not an .npy member")
                key = info.filename[: -len(".npy")]
                self.members[key] = self._header(key, info)
                self._infos[key] = info
        except BaseException:
            self._zip.close()
            raise

    def _header(self, key: str, info: zipfile.ZipInfo) -> NpyMember:
        from numpy.lib import format as npy

        try:
            with self._zip.open(info) as stream:
                version = npy.read_magic(stream)
                if version == (1, 0):
                    shape, fortran, dtype = npy.read_array_header_1_0(stream)
                elif version == (2, 0):
                    shape, fortran, dtype = npy.read_array_header_2_0(stream)
                else:
                    raise ValueError(f"unsupported .npy format version {version}")
                header_bytes = stream.tell()
        except ValidationError:
            raise
        except Exception as exc:  # bad magic, unparsable header, CRC/EOF errors, a foreign compression method
            raise ValidationError(key, f"member of {self.path} has no readable .npy header ({type(exc).__name__}: "
                                  f"{str(exc)[:200]})") from None
        if dtype.hasobject or dtype.names is not None or dtype.subdtype is not None:
            raise ValidationError(key, f"member of {self.path} has dtype {dtype}: only plain numeric, boolean and "
                                  "string arrays are read (no pickled objects)")
        if any(d < 0 for d in shape):
            raise ValidationError(key, f"member of {self.path} declares a negative shape {shape}")
        member = NpyMember(key, dtype, tuple(int(d) for d in shape), bool(fortran))
        if header_bytes + member.nbytes != info.file_size:
            raise ValidationError(
                key, f"member of {self.path} declares shape {member.shape} of {dtype} ({member.nbytes} bytes) but "
                f"holds {info.file_size - header_bytes} bytes of data: truncated or forged, refused before reading")
        return member

    def read(self, key: str) -> np.ndarray:
        from numpy.lib import format as npy

        if key not in self.members:
            raise ValidationError(key, f"missing from {self.path}")
        try:
            with self._zip.open(self._infos[key]) as stream:
                array = npy.read_array(stream, allow_pickle=False)
        except Exception as exc:  # CRC mismatch, EOF: the member is corrupt
            raise ValidationError(key, f"member of {self.path} is corrupt or truncated ({type(exc).__name__}: "
                                  f"{str(exc)[:200]})") from None
        return array

    def keys(self) -> Iterator[str]:
        return iter(self.members)

    def zip_info(self, key: str) -> zipfile.ZipInfo:
        """The zip directory entry of member ``key`` (its offset and sizes, e.g. to map it)."""
        if key not in self._infos:
            raise ValidationError(key, f"missing from {self.path}")
        return self._infos[key]

    def close(self) -> None:
        self._zip.close()

    def __enter__(self) -> "NpzArchive":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def check_declared(field: str, member: Optional[NpyMember], dtype: Optional[type], shape: tuple) -> None:
    """``member`` (when present) has ``dtype`` and ``shape`` (``None`` entries match any size)."""
    if member is None:
        return
    if dtype is not None and member.dtype != np.dtype(dtype):
        raise ValidationError(field, f"expected dtype {np.dtype(dtype).name}, got {member.dtype}")
    ok = len(member.shape) == len(shape) and all(e is None or e == s for e, s in zip(shape, member.shape))
    if not ok:
        pretty = tuple("*" if e is None else e for e in shape)
        raise ValidationError(field, f"declares shape {member.shape}, expected {pretty} (from the file's metadata "
                              "and its other members); refused before reading")
