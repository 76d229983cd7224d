"""A dataset on disk: ONE uncompressed ``.npz`` archive of ``.npy`` members, written atomically and read with every
member's declared size checked before anything is inflated or allocated (format in ``dporl.data.dataset``).
"""

from __future__ import annotations

import os
import zipfile
from pathlib import Path
from typing import Any, Mapping

import numpy as np

from dporl.data.metadata import DatasetMetadata
from dporl.data.storage import _ARRAY_DTYPES, _OPTIONAL_ARRAYS, _map_members, write_npz_members
from dporl.utils.archives import NpyMember, NpzArchive, check_declared
from dporl.utils.io import MAX_JSON_BYTES, atomic_write, dump_json, parse_json
from dporl.utils.validation import ValidationError

FORMAT_VERSION = 3
# 2 added metadata.unit_column / unit_keys; 3 named the unit fields unit_ids / n_units (1 and 2: expert_ids /
# n_experts). Every readable version loads to the same dataset.
READABLE_VERSIONS = (1, 2, 3)


def _member_names(version: int) -> dict[str, str]:
    """Array field -> its member name in a file of format ``version``."""
    return {name: "expert_ids" if name == "unit_ids" and version < 3 else name for name in _ARRAY_DTYPES}


def save_archive(path: str | os.PathLike, metadata: DatasetMetadata, arrays: Mapping[str, Any]) -> Path:
    """Write ``metadata`` and the dataset's ``arrays`` (``behavior_log_probs`` may be None) as one ``.npz``,
    atomically (``TrajectoryDataset.save``)."""
    arrays = dict(arrays)
    if arrays["behavior_log_probs"] is None:
        del arrays["behavior_log_probs"]
    payload = {
        "format_version": np.array(FORMAT_VERSION, dtype=np.int64),
        "metadata": np.array(dump_json(metadata.to_dict(), sort_keys=True)),
        **arrays,
    }

    def write(tmp: Path) -> None:
        with open(tmp, "wb") as handle:
            write_npz_members(handle, payload)

    return atomic_write(path, write, suffix=".npz")


def read_archive(path: str | os.PathLike, *, mmap: bool = False) -> tuple[DatasetMetadata, dict[str, np.ndarray]]:
    """(metadata, arrays by constructor field) of a dataset file, sizes checked against the metadata before any
    array is read; ``mmap=True`` maps what can be mapped (``TrajectoryDataset.load`` validates the values)."""
    path = Path(path)
    if not path.is_file():
        raise ValidationError("path", f"no dataset file at {path}")
    if not zipfile.is_zipfile(path):
        raise ValidationError("path", f"{path} is not a readable dporl dataset (not a zip archive of .npy arrays)")
    with NpzArchive(path, "path") as archive:
        keys = set(archive.members)
        if "format_version" not in keys:  # name the first member missing from this version's archive
            first = sorted({"format_version", "metadata", *_ARRAY_DTYPES} - _OPTIONAL_ARRAYS - keys)[0]
            raise ValidationError(first, f"missing from {path} (truncated or not a dporl dataset)")
        version_header = archive.members["format_version"]
        if version_header.shape != () or version_header.dtype.kind not in "iu":
            raise ValidationError("format_version", f"expected an integer scalar, got {version_header.dtype} "
                                  f"{version_header.shape}")
        version = archive.read("format_version")
        if int(version) not in READABLE_VERSIONS:
            raise ValidationError(
                "format_version", f"file has version {int(version)}, this dporl reads versions {READABLE_VERSIONS}"
            )
        version = int(version)
        stored = _member_names(version)  # field -> member name
        archive_keys = {"format_version", "metadata", *stored.values()}
        unexpected = sorted(keys - archive_keys)
        if unexpected:
            raise ValidationError(unexpected[0], f"unexpected member in {path} (is this a dporl dataset of format "
                                  f"version {version}?)")
        missing = sorted(archive_keys - {stored[name] for name in _OPTIONAL_ARRAYS} - keys)
        if missing:
            raise ValidationError(missing[0], f"missing from {path} (truncated or not a dporl dataset)")
        meta_header = archive.members["metadata"]
        if meta_header.shape != () or meta_header.dtype.kind != "U":
            raise ValidationError("metadata", f"expected a JSON string scalar, got {meta_header.dtype} "
                                  f"{meta_header.shape}")
        if meta_header.nbytes > 4 * MAX_JSON_BYTES:
            raise ValidationError("metadata", f"declares {meta_header.nbytes} bytes of metadata, more than a "
                                  "dataset's metadata may hold")
        metadata = DatasetMetadata.from_dict(parse_json(str(archive.read("metadata")), "metadata"), version)
        members = {name: archive.members[member] for name, member in stored.items() if member in keys}
        _check_declared_sizes(members, metadata)
        names = sorted(members)
        mapped = _map_members(path, archive, [stored[name] for name in names]) if mmap else {}
        contents = {name: mapped[stored[name]] if stored[name] in mapped else archive.read(stored[name])
                    for name in names}
    return metadata, contents


def _check_declared_sizes(members: Mapping[str, NpyMember], metadata: DatasetMetadata) -> None:
    """Every array member's declared dtype, and shape against the metadata and the other members, before reading."""
    for name in _ARRAY_DTYPES:
        member = members.get(name)
        if member is not None and member.dtype != np.dtype(_ARRAY_DTYPES[name]):
            raise ValidationError(name, f"expected dtype {np.dtype(_ARRAY_DTYPES[name]).name}, got {member.dtype}")
    for name in ("episode_lengths", "actions"):
        if len(members[name].shape) != 1:
            raise ValidationError(name, f"expected a 1-d array, got shape {members[name].shape}")
    n_episodes, n_transitions = members["episode_lengths"].shape[0], members["actions"].shape[0]
    expected = {"observations": (n_transitions + n_episodes, *metadata.obs_shape)}
    expected.update({name: (n_transitions,) for name in ("rewards", "terminations", "truncations",
                                                         "behavior_log_probs")})
    expected.update({name: (n_episodes,) for name in ("unit_ids", "start_steps")})
    for name, shape in expected.items():
        check_declared(name, members.get(name), None, shape)
