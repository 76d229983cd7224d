"""Looking methods up by name: one spelling each, and a named error for any other."""

from __future__ import annotations

from typing import Any, Mapping, TypeVar

from dporl.utils.validation import ValidationError

M = TypeVar("M")


def _squashed(name: str) -> str:
    return name.replace("_", "").replace("-", "").replace(" ", "").lower()


def method_named(methods: Mapping[str, M], name: Any, field: str, what: str) -> M:
    """``methods[name]``, or a ValidationError naming ``field`` that lists the known names (``what``: which
    methods, for the message) and says the right spelling of a name that differs only in underscores or case."""
    if isinstance(name, str) and name in methods:
        return methods[name]
    known = ", ".join(methods)
    if isinstance(name, str):
        respelled = {_squashed(k): k for k in methods}.get(_squashed(name))
        if respelled is not None:
            raise ValidationError(field, f"{what} method {name!r} is spelled {respelled!r} (known: {known})")
    raise ValidationError(field, f"unknown {what} method {name!r} (known: {known})")
