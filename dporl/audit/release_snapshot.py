"""Everything a run released, as flat fields, and the fields in which two runs' releases differ.

A guarantee covers every artifact that leaves the curator: the files under each ``release/`` directory of a run
(not those inside ``curator/``), the list of those files, what the run printed on stdout, and whether it ended in
a refusal (with its message). ``snapshot`` reads all of it into ``{location: {field: value}}``:

- JSON: one field per leaf, named by its path (``privacy.stages[1].events[0][0].sample_rate``); lists of notes
  as sets (``notes{TEXT}``);
- npz: one field per array (``allow_pickle=False``);
- ``.pt`` files: ``torch.load(weights_only=True)``, flattened like JSON (tensors as arrays); TorchScript archives
  (``*.torchscript.pt``) by their ``state_dict``;
- TensorBoard event files: per directory, the k-th event file (by name) is location ``DIR/events[k]``, with
  fields ``file name``, ``wall_time[i]`` of every event, ``scalar TAG @ STEP`` and ``text TAG @ STEP`` values and
  the sequence of (kind, tag, step) records;
- text files (``.md``, ``.txt``, ``.csv``, ``.yaml``): one field per line; anything else by its bytes (sha256);
- ``files``: one field per released file (its presence); ``stdout``: lines, aligned between the two runs by
  ``difflib``; ``outcome``: ``ok`` or the refusal's type and message.

Nothing is normalised: two runs that differ anywhere give a ``Difference`` there (``compare``).
"""

from __future__ import annotations

import difflib
import hashlib
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Mapping, Optional

import numpy as np

from dporl.utils.io import parse_json

MISSING = "<absent>"
RELEASE_DIR, CURATOR_DIR = "release", "curator"
TEXT_SUFFIXES = (".md", ".txt", ".csv", ".yaml", ".yml")
TORCHSCRIPT_SUFFIX = ".torchscript.pt"
EVENT_PREFIX = "events.out.tfevents."
FILES, STDOUT, OUTCOME = "files", "stdout", "outcome"


@dataclass(frozen=True)
class Difference:
    """One released field whose value differs between the run on D and the run on D'."""

    location: str  # a released file (path under the run directory), an event-file slot, "files", "stdout", "outcome"
    field: str
    value_d: Any
    value_dp: Any

    def describe(self, width: int = 80) -> str:
        a, b = self.value_d, self.value_dp
        if isinstance(a, str) and isinstance(b, str) and max(len(a), len(b)) > width:
            # Long texts: show where they first differ.
            start = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            start = max(0, start - width // 4)
            a, b = ("..." if start else "") + a[start:], ("..." if start else "") + b[start:]
        return f"{self.location} :: {self.field}: {short(a, width)} vs {short(b, width)}"

    def to_dict(self) -> dict[str, Any]:
        return {"location": self.location, "field": self.field, "value_d": _plain(self.value_d),
                "value_dp": _plain(self.value_dp)}


Snapshot = dict[str, dict[str, Any]]


def released_files(root: str | Path) -> list[Path]:
    """Every file of ``root`` below a ``release`` directory that no ``curator`` directory encloses, sorted."""
    root = Path(root)
    out = []
    for path in sorted(p for p in root.rglob("*") if p.is_file()):
        parts = path.relative_to(root).parts[:-1]
        if RELEASE_DIR in parts and CURATOR_DIR not in parts[: parts.index(RELEASE_DIR)]:
            out.append(path)
    return out


def snapshot(root: str | Path, stdout: str = "", outcome: str = "ok") -> Snapshot:
    """What a run in ``root`` released (module docstring); ``stdout`` as printed, ``outcome`` "ok" or the refusal."""
    root = Path(root)
    snap: Snapshot = {FILES: {}, STDOUT: {"lines": stdout.splitlines()}, OUTCOME: {"status": outcome}}
    event_slots: dict[Path, int] = {}
    for path in released_files(root) if root.exists() else []:
        relative = path.relative_to(root)
        if path.name.startswith(EVENT_PREFIX):
            slot = event_slots.get(relative.parent, 0)
            event_slots[relative.parent] = slot + 1
            location = f"{relative.parent.as_posix()}/events[{slot}]"
            snap[location] = {"file name": path.name, **read_events(path)}
        else:
            location = relative.as_posix()
            snap[location] = read_fields(path)
        snap[FILES][location] = "present"
    return snap


def snapshot_of(released: Mapping[str, Any], location: str = "result", stdout: str = "") -> Snapshot:
    """The snapshot of a mechanism called as a library: what it returned (``released``, flattened) at ``location``."""
    return {FILES: {location: "present"}, STDOUT: {"lines": stdout.splitlines()}, OUTCOME: {"status": "ok"},
            location: flatten(dict(released))}


def read_fields(path: Path) -> dict[str, Any]:
    """The fields of one released file (by its kind: module docstring)."""
    name = path.name
    try:
        if name.endswith(".json"):
            return flatten(parse_json(path.read_text(), "released file", str(path)))
        if name.endswith(".npz"):
            with np.load(path, allow_pickle=False) as archive:
                return {key: archive[key] for key in archive.files}
        if name.endswith(TORCHSCRIPT_SUFFIX):
            import torch

            import warnings

            # The run's own output (the harness wrote it a moment ago), loaded to read its parameters only.
            with warnings.catch_warnings():  # torch 2.13 deprecates torch.jit; the archive is still what it wrote
                warnings.simplefilter("ignore", DeprecationWarning)
                module = torch.jit.load(str(path), map_location="cpu")
            return {f"state_dict.{k}": v.detach().numpy() for k, v in module.state_dict().items()}
        if name.endswith(".pt"):
            import torch

            return flatten(torch.load(path, map_location="cpu", weights_only=True))
        if name.endswith(TEXT_SUFFIXES):
            return {f"line[{i}]": line for i, line in enumerate(path.read_text().splitlines())}
    except Exception as exc:  # an unreadable release is itself a released fact: compare it by bytes below
        return {"unreadable": f"{type(exc).__name__}", "sha256": hashlib.sha256(path.read_bytes()).hexdigest()}
    data = path.read_bytes()
    return {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def read_events(path: Path) -> dict[str, Any]:
    """A TensorBoard event file's records: wall times, scalar and text values by (tag, step), their order."""
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader

    fields: dict[str, Any] = {}
    order = []
    for i, event in enumerate(EventFileLoader(str(path)).Load()):
        fields[f"wall_time[{i}]"] = float(event.wall_time)
        if event.HasField("file_version"):
            fields[f"file_version[{i}]"] = event.file_version
            order.append(("file_version", "", event.step))
            continue
        for value in event.summary.value:
            plugin = value.metadata.plugin_data.plugin_name
            if value.HasField("simple_value"):
                kind, content = "scalar", float(value.simple_value)
            elif value.HasField("tensor"):
                tensor = value.tensor
                if tensor.string_val:
                    kind, content = plugin or "text", [s.decode("utf-8", "replace") for s in tensor.string_val]
                    content = content[0] if len(content) == 1 else content
                elif tensor.float_val or tensor.double_val:
                    kind, content = "scalar", [float(x) for x in (tensor.float_val or tensor.double_val)]
                    content = content[0] if len(content) == 1 else content
                else:
                    kind = plugin or "tensor"
                    content = hashlib.sha256(tensor.SerializeToString()).hexdigest()
            else:
                kind = plugin or "other"
                content = hashlib.sha256(value.SerializeToString()).hexdigest()
            if value.metadata.plugin_data.content:
                fields[f"{kind} {value.tag} @ {event.step} metadata"] = hashlib.sha256(
                    value.metadata.plugin_data.content).hexdigest()
            fields[f"{kind} {value.tag} @ {event.step}"] = content
            order.append((kind, value.tag, event.step))
    fields["records"] = order
    return fields


def flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    """Leaves of nested dicts / lists / tuples, by path (``a.b[2].c``); tensors become numpy arrays. A list of
    strings named ``notes`` is a set: one field per note, ``notes{TEXT}`` (a note present on one side only differs,
    whatever its position)."""
    if prefix.rsplit(".", 1)[-1] == "notes" and isinstance(value, (list, tuple)) and value \
            and all(isinstance(item, str) for item in value):
        return {f"{prefix}{{{item}}}": "present" for item in value}
    if isinstance(value, Mapping):
        if not value:
            return {prefix: {}}
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(flatten(item, f"{prefix}.{key}" if prefix else str(key)))
        return out
    if isinstance(value, (list, tuple)):
        if not value:
            return {prefix: []}
        out = {}
        for i, item in enumerate(value):
            out.update(flatten(item, f"{prefix}[{i}]"))
        return out
    if hasattr(value, "detach") and hasattr(value, "numpy"):  # a torch tensor
        return {prefix: value.detach().cpu().numpy()}
    return {prefix: value}


def equal(a: Any, b: Any) -> bool:
    """Exact equality of two field values (arrays: same shape, dtype and elements, NaN equal to NaN)."""
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        if not (isinstance(a, np.ndarray) and isinstance(b, np.ndarray)):
            return False
        if a.shape != b.shape or a.dtype != b.dtype:
            return False
        if a.dtype.kind in "fc":
            return bool(np.array_equal(a, b, equal_nan=True))
        return bool(np.array_equal(a, b))
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return type(a) is type(b) and a == b


def compare(snap_d: Snapshot, snap_dp: Snapshot) -> list[Difference]:
    """Every field that differs between two snapshots (a field present in one only differs from ``MISSING``)."""
    differences = []
    for location in sorted(set(snap_d) | set(snap_dp), key=_location_order):
        if location == STDOUT:
            differences += compare_lines(snap_d[STDOUT]["lines"], snap_dp[STDOUT]["lines"])
            continue
        left, right = snap_d.get(location, {}), snap_dp.get(location, {})
        for name in sorted(set(left) | set(right), key=_natural):
            a, b = left.get(name, MISSING), right.get(name, MISSING)
            if not equal(a, b):
                differences.append(Difference(location, name, a, b))
    return differences


def compare_lines(lines_d: list[str], lines_dp: list[str], location: str = STDOUT) -> list[Difference]:
    """Differing lines of two printouts, aligned by ``difflib`` (a line missing on one side pairs with MISSING)."""
    out = []
    matcher = difflib.SequenceMatcher(a=lines_d, b=lines_dp, autojunk=False)
    for tag, i1, i2, j1, j2 in matcher.get_opcodes():
        if tag == "equal":
            continue
        for k in range(max(i2 - i1, j2 - j1)):
            a = lines_d[i1 + k] if i1 + k < i2 else MISSING
            b = lines_dp[j1 + k] if j1 + k < j2 else MISSING
            line = i1 + k if i1 + k < i2 else j1 + k
            out.append(Difference(location, f"line[{line}]", a, b))
    return out


def _plain(value: Any, width: int = 200) -> Any:
    """A JSON value for reports: numbers and short strings as they are, anything else described by ``short``."""
    if value is None or isinstance(value, (bool, int, float)):
        return value
    if isinstance(value, str) and len(value) <= width:
        return value
    return short(value, width)


def short(value: Any, width: int = 80) -> str:
    """A one-line description of a field value (arrays by shape, a few elements and a hash)."""
    if isinstance(value, np.ndarray):
        if value.size <= 4 and value.dtype.kind in "biuf":
            text = f"array{value.tolist()}"
        else:
            digest = hashlib.sha256(np.ascontiguousarray(value).tobytes()).hexdigest()[:10]
            text = f"array(shape={list(value.shape)}, dtype={value.dtype}, sha256={digest})"
    else:
        text = repr(value)
    return text if len(text) <= width else text[: width - 3] + "..."


def _natural(name: str) -> tuple:
    return tuple(int(part) if part.isdigit() else part for part in re.split(r"(\d+)", name))


def _location_order(location: str) -> tuple:
    special = {OUTCOME: 0, FILES: 1, STDOUT: 2}
    return (special.get(location, 3), _natural(location))


def differences_table(differences: Iterable[Difference], width: int = 60) -> str:
    """A plain-text table of differences, one per line."""
    return "\n".join(d.describe(width) for d in differences)


def describe_outcome(error: Optional[BaseException]) -> str:
    """The outcome field of a run: "ok", or the refusal as printed (its type and message)."""
    return "ok" if error is None else f"error: {type(error).__name__}: {error}"
