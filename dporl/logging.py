"""TensorBoard logging and PNG plots.

Two writers per run (``dporl.train.run_dir``): ``RUN/release/tensorboard`` receives public scalars only (returns of
the released iterates in the public simulator, privacy spent, the learning rate schedule) and is the one to share;
``RUN/curator/tensorboard`` receives curator diagnostics (tags under ``curator/``: training losses, clip
fractions, gradient norms of private batches, step timings), which are computed from raw private data without
noise, are NOT covered by the run's (epsilon, delta), and are written only with ``trainer.curator_diagnostics``.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Mapping, Sequence

CURATOR_PREFIX = "curator/"


class RunLogger:
    """Thin wrapper over ``torch.utils.tensorboard.SummaryWriter`` that skips non-finite values and closes cleanly."""

    def __init__(self, log_dir: str | Path, enabled: bool = True):
        self.log_dir = Path(log_dir)
        self._writer = None
        if enabled:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.log_dir))

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        if self._writer is None:
            return
        for tag, value in values.items():
            value = float(value)
            if math.isfinite(value):
                self._writer.add_scalar(tag, value, step)

    def text(self, tag: str, text: str, step: int = 0) -> None:
        if self._writer is not None:
            self._writer.add_text(tag, text, step)

    def hparams(self, hparams: Mapping[str, Any], metrics: Mapping[str, float]) -> None:
        if self._writer is None:
            return
        flat = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in _flatten(hparams).items()}
        finite = {f"hparam/{k}": float(v) for k, v in metrics.items() if math.isfinite(float(v))}
        self._writer.add_hparams(flat, finite, run_name=".")

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


def _flatten(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    flat: dict[str, Any] = {}
    for key, value in mapping.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            flat.update(_flatten(value, f"{name}."))
        elif value is not None:
            flat[name] = value
    return flat


def plot_lines(
    path: str | Path,
    series: Mapping[str, tuple[Sequence[float], Sequence[float], Sequence[float] | None]],
    *,
    xlabel: str,
    ylabel: str,
    title: str = "",
    logx: bool = False,
    logy: bool = False,
) -> Path:
    """One PNG with a line per series; each series is (x, y, y_err or None) and error bars are drawn as bands."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from dporl.utils.io import atomic_write

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for label, (xs, ys, errs) in series.items():
        ax.plot(xs, ys, marker="o", label=label)
        if errs is not None:
            lo = [y - e for y, e in zip(ys, errs)]
            hi = [y + e for y, e in zip(ys, errs)]
            ax.fill_between(xs, lo, hi, alpha=0.2)
    if logx:
        ax.set_xscale("log")
    if logy:
        ax.set_yscale("log")
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if title:
        ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    atomic_write(path, lambda tmp: fig.savefig(tmp, format="png", dpi=120), suffix=".png")
    plt.close(fig)
    return Path(path)
