"""TensorBoard logging and PNG plots.

Two writers per run (``dporl.train.run_dir``): ``RUN/release/tensorboard`` receives public scalars only (returns of
the released iterates in the public simulator, privacy spent, the learning rate schedule) and is the one to share;
``RUN/curator/tensorboard`` receives curator diagnostics (tags under ``curator/``: training losses, clip
fractions, gradient norms of private batches, step timings), which are computed from raw private data without
noise, are NOT covered by the run's (epsilon, delta), and are written only with ``trainer.curator_diagnostics``.

An event file carries more than its scalars: TensorBoard's own writer names it
``events.out.tfevents.<time>.<host name>.<process id>...`` and stamps every event with the wall-clock time, which
gives away how long each step took (step timing depends on realised batch sizes: curator-only) and where the run
ran. ``RunLogger`` therefore writes the event records itself (TFRecord framing of ``Event`` protos, readable by
TensorBoard and ``EventAccumulator``): files named ``events.out.tfevents.<index>.dporl`` (the index counts the
writers of that directory: a public function of the run's code path), and every event's ``wall_time`` set to its
step unless the writer is the curator's (``wall_clock=True``).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any, Mapping, Sequence

CURATOR_PREFIX = "curator/"
EVENT_FILE_PREFIX = "events.out.tfevents."
EVENT_FILE_SUFFIX = ".dporl"


class _EventFile:
    """One TensorBoard event file with a neutral name; ``wall_clock`` False: every event's wall time is its step."""

    def __init__(self, log_dir: Path, wall_clock: bool):
        from tensorboard.compat.proto import event_pb2
        from tensorboard.summary.writer.record_writer import RecordWriter

        self._event_pb2, self.wall_clock = event_pb2, wall_clock
        log_dir.mkdir(parents=True, exist_ok=True)
        index = sum(1 for name in os.listdir(log_dir) if name.startswith(EVENT_FILE_PREFIX))
        while True:  # exclusive create: two writers of one directory never share (or truncate) a file
            self.path = log_dir / f"{EVENT_FILE_PREFIX}{index:06d}{EVENT_FILE_SUFFIX}"
            try:
                handle = open(self.path, "xb")
                break
            except FileExistsError:
                index += 1
        self._records = RecordWriter(handle)
        self.add(event_pb2.Event(file_version="brain.Event:2"), step=0)

    def add(self, event: Any, step: int) -> None:
        event.step = int(step)
        event.wall_time = time.time() if self.wall_clock else float(step)
        self._records.write(event.SerializeToString())

    def summary(self, summary: Any, step: int) -> None:
        self.add(self._event_pb2.Event(summary=summary), step)

    def flush(self) -> None:
        self._records.flush()

    def close(self) -> None:
        if not self._records.closed:
            self._records.close()


class RunLogger:
    """TensorBoard scalars and text for one directory; skips non-finite values and closes cleanly.

    ``wall_clock``: stamp events with the real time (the curator's writer only); by default every event's wall
    time is its step, and the file name carries neither a time, a host name nor a process id (module docstring).
    """

    def __init__(self, log_dir: str | Path, enabled: bool = True, wall_clock: bool = False):
        self.log_dir = Path(log_dir)
        self._file = _EventFile(self.log_dir, wall_clock) if enabled else None

    def scalars(self, values: Mapping[str, float], step: int) -> None:
        if self._file is None:
            return
        from torch.utils.tensorboard.summary import scalar

        for tag, value in values.items():
            value = float(value)
            if math.isfinite(value):
                self._file.summary(scalar(tag, value), step)

    def text(self, tag: str, text: str, step: int = 0) -> None:
        if self._file is not None:
            from torch.utils.tensorboard.summary import text as text_summary

            self._file.summary(text_summary(tag, text), step)

    def hparams(self, hparams: Mapping[str, Any], metrics: Mapping[str, float], step: int = 0) -> None:
        if self._file is None:
            return
        from torch.utils.tensorboard.summary import hparams as hparams_summaries, scalar

        flat = {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in _flatten(hparams).items()}
        finite = {f"hparam/{k}": float(v) for k, v in metrics.items() if math.isfinite(float(v))}
        for summary in hparams_summaries(flat, finite):
            self._file.summary(summary, step)
        for tag, value in finite.items():
            self._file.summary(scalar(tag, value), step)

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


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
