"""Typed dataclass configs: build from YAML/dicts with type checks, apply ``key=value`` CLI overrides.

Unknown keys are errors (a typo in a privacy budget must not silently fall back to a default), and every
error names the dotted field path.
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from pathlib import Path
from typing import Any, Mapping, Sequence, TypeVar

import yaml

from dporl.utils.validation import ValidationError

T = TypeVar("T")


def from_dict(cls: type[T], data: Mapping[str, Any] | None, path: str = "") -> T:
    """Instantiate dataclass ``cls`` from ``data``; nested dataclasses are built recursively."""
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    data = {} if data is None else data
    if not isinstance(data, Mapping):
        raise ValidationError(path or "<root>", f"expected a mapping, got {type(data).__name__}")
    hints = typing.get_type_hints(cls)
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        where = f"{path}." if path else ""
        raise ValidationError(
            f"{where}{unknown[0]}", f"unknown key (valid keys: {', '.join(sorted(fields))})"
        )
    kwargs = {}
    for name, value in data.items():
        kwargs[name] = _coerce(hints[name], value, f"{path}.{name}" if path else name)
    try:
        return cls(**kwargs)
    except ValidationError:
        raise
    except TypeError as exc:  # a required field is missing
        raise ValidationError(path or "<root>", str(exc)) from None


def to_dict(config: Any) -> dict[str, Any]:
    """Plain, YAML-safe dict of a config dataclass (tuples become lists)."""
    return _plain(dataclasses.asdict(config))


def _plain(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _coerce(tp: Any, value: Any, path: str) -> Any:
    origin = typing.get_origin(tp)
    args = typing.get_args(tp)
    if tp is Any:
        return value
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        errors: list[ValidationError] = []
        options = [option for option in args if option is not type(None)]
        for option in options:
            try:
                return _coerce(option, value, path)
            except ValidationError as exc:
                errors.append(exc)
        if len(errors) == 1:  # Optional[X]: X's own error names the field and says what is wrong
            raise errors[0]
        reasons = "; ".join(f"as {_type_name(option)}: {str(exc)}" for option, exc in zip(options, errors))
        raise ValidationError(path, f"{value!r} fits none of {' | '.join(map(_type_name, options))} ({reasons})")
    if origin is typing.Literal:
        if value not in args:
            raise ValidationError(path, f"must be one of {list(args)}, got {value!r}")
        return value
    if dataclasses.is_dataclass(tp):
        if dataclasses.is_dataclass(value) and isinstance(value, tp):
            return value
        return from_dict(tp, value, path)
    if origin in (list, Sequence, typing.Sequence) or tp is list:
        if not isinstance(value, (list, tuple)):
            raise ValidationError(path, f"expected a list, got {value!r}")
        item = args[0] if args else Any
        return [_coerce(item, v, f"{path}[{i}]") for i, v in enumerate(value)]
    if origin is tuple:
        if not isinstance(value, (list, tuple)):
            raise ValidationError(path, f"expected a list, got {value!r}")
        if len(args) == 2 and args[1] is Ellipsis:
            return tuple(_coerce(args[0], v, f"{path}[{i}]") for i, v in enumerate(value))
        if len(args) != len(value):
            raise ValidationError(path, f"expected {len(args)} items, got {len(value)}")
        return tuple(_coerce(a, v, f"{path}[{i}]") for i, (a, v) in enumerate(zip(args, value)))
    if origin is dict or tp is dict:
        if not isinstance(value, Mapping):
            raise ValidationError(path, f"expected a mapping, got {value!r}")
        key_tp, val_tp = args if args else (Any, Any)
        return {_coerce(key_tp, k, path): _coerce(val_tp, v, f"{path}.{k}") for k, v in value.items()}
    if tp is bool:
        if isinstance(value, bool):
            return value
        raise ValidationError(path, f"expected true/false, got {value!r}")
    if tp is int:
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or int(value) != value:
            raise ValidationError(path, f"expected an integer, got {value!r}")
        return int(value)
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads ``1e-4`` (no dot) as a string
            try:
                value = float(value)
            except ValueError:
                raise ValidationError(path, f"expected a number, got {value!r}") from None
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ValidationError(path, f"expected a number, got {value!r}")
        return float(value)
    if tp is str:
        if not isinstance(value, str):
            raise ValidationError(path, f"expected a string, got {value!r}")
        return value
    if tp is Path:
        return Path(value)
    raise TypeError(f"{path}: unsupported config type {tp!r}")


def _type_name(tp: Any) -> str:
    return getattr(tp, "__name__", None) or str(tp).replace("typing.", "")


def parse_override(text: str) -> tuple[list[str], Any]:
    """``'a.b=3'`` -> (['a', 'b'], 3). The value is parsed as YAML, so ``x=[1,2]`` and ``y=null`` work."""
    if "=" not in text:
        raise ValidationError(text, "override must look like key=value")
    key, raw = text.split("=", 1)
    key = key.strip()
    if not key or any(not part for part in key.split(".")):
        raise ValidationError(text, "override key is empty")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except RecursionError:
        raise ValidationError(key, f"value nests too deeply ({len(raw)} characters)") from None
    except yaml.YAMLError as exc:
        raise ValidationError(key, f"cannot parse value {raw!r}: {exc}") from None
    return key.split("."), value


def apply_overrides(data: dict[str, Any], overrides: Sequence[str]) -> dict[str, Any]:
    """Return a copy of ``data`` with dotted ``key=value`` overrides applied (nested dicts are created)."""
    import copy

    result = copy.deepcopy(data)
    for text in overrides:
        keys, value = parse_override(text)
        set_dotted(result, keys, value)
    return result


def set_dotted(data: dict[str, Any], keys: Sequence[str], value: Any) -> dict[str, Any]:
    """Set ``data[k0][k1]...`` = ``value`` in place (missing sections are created); returns ``data``."""
    node = data
    for depth, key in enumerate(keys[:-1]):
        child = node.get(key)
        if child is None:
            child = node[key] = {}
        if not isinstance(child, dict):
            raise ValidationError(".".join(keys[: depth + 1]), "is not a section; cannot set a sub-key")
        node = child
    node[keys[-1]] = value
    return data


def load_yaml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    if not path.is_file():
        raise ValidationError("config", f"file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        raise ValidationError("config", f"{path} is not valid YAML: {exc}") from None
    except RecursionError:
        raise ValidationError("config", f"{path} nests too deeply to be a configuration") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ValidationError("config", f"{path} must hold a mapping at top level")
    return data


def load_config(cls: type[T], path: str | Path | None = None, overrides: Sequence[str] = ()) -> T:
    data = load_yaml(path) if path is not None else {}
    return from_dict(cls, apply_overrides(data, overrides))


def dump_config(config: Any) -> str:
    return yaml.safe_dump(to_dict(config), sort_keys=False)
