"""Device names from configs: checked once, with a named error, before anything is allocated or written."""

from __future__ import annotations

import torch

from dporl.utils.validation import ValidationError


def resolve_device(name: str | torch.device, field: str = "device") -> torch.device:
    """``torch.device(name)``, refusing a name torch does not know and an accelerator this build or machine lacks."""
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as exc:
        raise ValidationError(field, f"unknown device {name!r}: {exc}") from None
    if device.type == "cuda":
        if not torch.cuda.is_available():
            raise ValidationError(field, f"{name!r} requested but CUDA is not available (torch {torch.__version__})")
        if device.index is not None and device.index >= torch.cuda.device_count():
            raise ValidationError(field, f"{name!r}: only {torch.cuda.device_count()} CUDA device(s)")
    elif device.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValidationError(field, f"{name!r} requested but MPS is not available")
    elif device.type != "cpu":
        raise ValidationError(field, f"unsupported device {name!r}; use 'cpu' or 'cuda[:i]'")
    return device
