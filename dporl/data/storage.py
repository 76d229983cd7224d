"""How a dataset's arrays are held: typed read-only columns, zero-copy tensors and per-batch observation gathers,
and the aligned uncompressed ``.npz`` members that ``TrajectoryDataset.load(path, mmap=True)`` maps from the file.

Large arrays are walked in chunks of ``_CHUNK_BYTES`` (validation, hashing): no full-size temporaries.
"""

from __future__ import annotations

import math
import struct
import warnings
import zipfile
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional

import numpy as np
import torch

from dporl.utils.archives import NpzArchive
from dporl.utils.validation import ValidationError, check_finite

_ARRAY_DTYPES = {
    "observations": np.float32,
    "actions": np.int64,
    "rewards": np.float32,
    "terminations": np.bool_,
    "truncations": np.bool_,
    "episode_lengths": np.int64,
    "unit_ids": np.int64,
    "start_steps": np.int64,
    "behavior_log_probs": np.float32,
}
_OPTIONAL_ARRAYS = {"behavior_log_probs"}

_CHUNK_BYTES = 1 << 24  # validation and hashing walk large arrays in pieces this size: no full-size temporaries


def chunks(array: np.ndarray) -> Iterator[np.ndarray]:
    """The flattened ``array`` in consecutive pieces of at most ``_CHUNK_BYTES`` (views, no copies)."""
    flat = array.reshape(-1)
    step = max(1, _CHUNK_BYTES // max(flat.itemsize, 1))
    for start in range(0, len(flat), step):
        yield flat[start : start + step]


def _check_finite_chunked(field_name: str, array: np.ndarray) -> None:
    """``check_finite`` over row chunks, so a large (or memory-mapped) array needs no full-size boolean mask."""
    bad = 0
    for chunk in chunks(array):
        bad += len(chunk) - int(np.count_nonzero(np.isfinite(chunk)))
    if bad:
        raise ValidationError(field_name, f"contains {bad} non-finite value(s) (NaN or inf)")


def _as_typed(field_name: str, value: Any, dtype: type, kinds: str) -> np.ndarray:
    """``value`` as a numpy array of ``dtype``; only arrays whose dtype kind is in ``kinds`` are converted."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    array = np.asarray(value)
    if array.dtype.kind not in kinds:
        raise ValidationError(field_name, f"expected dtype {np.dtype(dtype).name}, got {array.dtype}")
    if array.dtype.kind in "iu" and dtype is np.float32:
        return array.astype(dtype)
    if array.dtype.kind == "f" and dtype is np.float32 and array.dtype != np.float32:
        check_finite(field_name, array)  # before narrowing, so the error names NaN rather than an overflow
    with np.errstate(over="ignore"):  # values beyond float32 become inf, which validation then reports
        return np.ascontiguousarray(array, dtype=dtype)



def shared_tensor(array: np.ndarray) -> torch.Tensor:
    """A tensor sharing ``array``'s memory, also when the array is read-only (a dataset's stored arrays, a memory
    map). The tensor must never be written: it exists to be indexed (``index_select``) by batch sources."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        return torch.from_numpy(array)


class FlatEpisodes:
    """A dataset's flat observations with its episode ends: what ``EpisodeObservations`` columns gather from.

    Transition t of episode e has observation ``t + e`` (next observation ``t + e + 1``). The episode of each row
    is found by a binary search over the episode ends; the last lookup is kept, so the ``obs`` and ``next_obs``
    columns of one batch (gathered with the same row tensor) search once. ``to(device)`` is memoised, so both
    columns moved to a device still share one copy of the observations.
    """

    def __init__(self, observations: torch.Tensor, episode_ends: torch.Tensor):
        self.observations = observations
        self.episode_ends = episode_ends  # int64 [n_episodes]: cumulative episode lengths
        self.n_transitions = int(episode_ends[-1]) if len(episode_ends) else 0
        self._moved: dict[torch.device, FlatEpisodes] = {}
        self._last: Optional[tuple[torch.Tensor, int, torch.Tensor]] = None

    def observation_index(self, rows: torch.Tensor) -> torch.Tensor:
        """Index of each transition's observation in the flat array (``rows`` + its episode index)."""
        last = self._last
        if last is not None and last[0] is rows and last[1] == rows._version:
            return last[2]
        index = rows + torch.searchsorted(self.episode_ends, rows, right=True)
        self._last = (rows, rows._version, index)
        return index

    def to(self, device: torch.device | str) -> "FlatEpisodes":
        device = torch.device(device)
        if device == self.observations.device:
            return self
        if device not in self._moved:
            self._moved[device] = FlatEpisodes(self.observations.to(device), self.episode_ends.to(device))
        return self._moved[device]


class EpisodeObservations:
    """Per-transition observations (``shift`` 0) or next observations (``shift`` 1) of ``FlatEpisodes``,
    gathered on demand: ``index_select(0, rows)`` gathers those rows only, so a batch source over a dataset holds
    no per-transition copy of the observations (a step reads only its sampled rows: a memory-mapped dataset stays
    on disk)."""

    def __init__(self, episodes: FlatEpisodes, shift: int):
        self.episodes = episodes
        self.shift = shift
        self.shape = torch.Size((episodes.n_transitions, *episodes.observations.shape[1:]))

    @property
    def dtype(self) -> torch.dtype:
        return self.episodes.observations.dtype

    @property
    def device(self) -> torch.device:
        return self.episodes.observations.device

    def __len__(self) -> int:
        return self.shape[0]

    def index_select(self, dim: int, rows: torch.Tensor) -> torch.Tensor:
        if dim != 0:
            raise ValidationError("dim", f"observations are gathered by row (dim 0), got dim {dim}")
        index = self.episodes.observation_index(rows)
        return self.episodes.observations.index_select(0, index + self.shift if self.shift else index)

    def to(self, device: torch.device | str) -> "EpisodeObservations":
        return EpisodeObservations(self.episodes.to(device), self.shift)



_ALIGN = 64  # array data in a saved archive start on 64-byte boundaries of the file (the npy header is padded too)
_PAD_FIELD = 0xD935  # zip extra-field id of a field that only pads (the id Android's zipalign uses)


def write_npz_members(handle: Any, members: Mapping[str, np.ndarray]) -> None:
    """Write ``members`` as an uncompressed ``.npz`` to the seekable binary ``handle``, each array's data aligned.

    The file is an ordinary npz (``np.load`` reads it; members are ``.npy`` files stored without compression, no
    pickles). Each member's local zip header carries a padding extra field sized so that the member starts on a
    64-byte boundary; the ``.npy`` header pads itself to 64 bytes, so every array's data starts on a 64-byte
    boundary of the file and ``TrajectoryDataset.load(path, mmap=True)`` can map it. Arrays are written in chunks
    (a memory-mapped input is never loaded whole).
    """
    with zipfile.ZipFile(handle, mode="w", compression=zipfile.ZIP_STORED, allowZip64=True) as archive:
        for name, array in members.items():
            info = zipfile.ZipInfo(f"{name}.npy", date_time=(1980, 1, 1, 0, 0, 0))
            info.compress_type = zipfile.ZIP_STORED
            # local header: 30 fixed bytes, the name, our field (4 + pad bytes), the zip64 field (20 bytes, forced)
            header = 30 + len(info.filename.encode("ascii")) + 4 + 20
            pad = -(handle.tell() + header) % _ALIGN
            info.extra = struct.pack("<HH", _PAD_FIELD, pad) + bytes(pad)
            with archive.open(info, mode="w", force_zip64=True) as member:
                np.lib.format.write_array(member, np.asanyarray(array), allow_pickle=False)


def _map_member(path: Path, handle: Any, info: zipfile.ZipInfo) -> Optional[np.ndarray]:
    """Member ``info`` of the archive at ``path`` as a read-only memory map, or None when it cannot be mapped
    (compressed, not a version 1/2 ``.npy``, or data not aligned to its dtype). Sizes are checked against the
    member before anything is mapped; an object dtype is refused (no pickles)."""
    if info.compress_type != zipfile.ZIP_STORED:
        return None
    handle.seek(info.header_offset)
    local = handle.read(30)
    if len(local) != 30 or local[:4] != b"PK\x03\x04":
        raise ValidationError(info.filename[:-4], f"member of {path} has a corrupt zip header")
    name_length, extra_length = struct.unpack("<HH", local[26:30])
    start = info.header_offset + 30 + name_length + extra_length
    handle.seek(start)
    version = np.lib.format.read_magic(handle)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(handle)
    elif version == (2, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(handle)
    else:
        return None
    if dtype.hasobject:
        raise ValidationError(info.filename[:-4], f"member of {path} holds Python objects (pickles are refused)")
    offset = handle.tell()
    size = math.prod(shape) * dtype.itemsize
    if offset + size > start + info.file_size:
        raise ValidationError(info.filename[:-4], f"member of {path} is truncated: {shape} {dtype} needs {size} "
                              f"bytes, the member holds {start + info.file_size - offset}")
    if offset % dtype.alignment or size == 0 or not shape:
        return None
    return np.memmap(path, dtype=dtype, mode="r", offset=offset, shape=shape, order="F" if fortran else "C")



def _map_members(path: Path, archive: NpzArchive, names: list[str]) -> dict[str, np.ndarray]:
    """The members of ``names`` that can be mapped (see ``TrajectoryDataset.load``), as read-only memory maps; their
    headers were checked by ``archive`` and against the metadata already."""
    mapped: dict[str, np.ndarray] = {}
    with open(path, "rb") as handle:
        for key in names:
            try:
                array = _map_member(path, handle, archive.zip_info(key))
            except ValidationError:
                raise
            except Exception as exc:  # a bad npy header: the member is corrupt
                raise ValidationError(
                    key, f"member of {path} is corrupt or truncated ({type(exc).__name__}: {exc})"
                ) from exc
            if array is not None:
                mapped[key] = array
    return mapped
