"""The provenance of a run's configuration: its canonical JSON (keys that do not change what a run computes removed),
its sha256, and the dotted keys at which two configurations differ (``dporl.train.run_dir`` refuses to resume or
reuse a run directory of another configuration, naming them)."""

from __future__ import annotations

import hashlib
import math
from typing import Any, Mapping

from dporl.utils.io import dump_json, json_ready

# Config keys (at any depth) that do not change what a run computes: where it is written, progress display.
IGNORED_KEYS = frozenset({"run_dir", "out_dir", "progress", "resume"})


def canonical_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` as plain JSON data with the ``IGNORED_KEYS`` removed at every depth."""

    def strip(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {str(k): strip(v) for k, v in value.items() if str(k) not in IGNORED_KEYS}
        if isinstance(value, (list, tuple)):
            return [strip(v) for v in value]
        return value

    return json_ready(strip(dict(config)), default=str)


def canonical_json(value: Any) -> str:
    return dump_json(value, sort_keys=True, separators=(",", ":"))


def config_sha256(config: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of ``config`` (ignored keys removed, keys sorted)."""
    return hashlib.sha256(canonical_json(canonical_config(config)).encode()).hexdigest()


def config_differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted keys at which two canonical configs differ (``"dp.noise_multiplier: 3.0 -> 1.0"``)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new)):
            name = f"{prefix}.{key}" if prefix else key
            if key not in old:
                out.append(f"{name}: (absent) -> {new[key]!r}")
            elif key not in new:
                out.append(f"{name}: {old[key]!r} -> (absent)")
            else:
                out.extend(config_differences(old[key], new[key], name))
        return out
    same = old == new or (isinstance(old, float) and isinstance(new, float) and math.isnan(old) and math.isnan(new))
    return [] if same else [f"{prefix or '(config)'}: {old!r} -> {new!r}"]
