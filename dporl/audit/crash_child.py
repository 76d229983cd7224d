"""The child process of the crash-and-resume audit (``dporl.audit.crash_resume``): ``dporl`` run in-process with a
fault armed (a SIGKILL at a chosen write, step or delay) and every training step and release it begins recorded
durably in a log the parent reads. Started by the parent as ``python -m dporl.audit.crash_child``, never imported by
it."""

from __future__ import annotations

import hashlib
import os
import signal
import sys
import time
from collections import Counter
from pathlib import Path


def child(argv: list[str]) -> int:
    """``python -m dporl.audit.crash_child FAULT LOG -- dporl-args...``: run ``dporl`` with the fault armed and
    every step / release recorded in LOG."""
    fault, log_path, rest = argv[0], argv[1], argv[3:]
    kind, _, where = fault.partition(":")
    target, _, index = where.rpartition(":") if kind in ("before", "after") else ("", "", where)
    log = open(log_path, "a")

    def record(line: str) -> None:
        log.write(line + "\n")
        log.flush()
        os.fsync(log.fileno())

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    record(f"start {time.time()}")

    counts: Counter = Counter()
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        name = Path(dst).name
        counts[name] += 1
        armed = name == target and str(counts[name]) == index
        if armed and kind == "before":
            die()
        real_replace(src, dst, *args, **kwargs)
        if armed and kind == "after":
            die()

    os.replace = replace

    # dporl is imported only now, after 'start' is recorded: a delay fault may land inside its imports.
    from dporl.pipelines.train import release as train_release
    from dporl.train.trainer import Trainer

    real_step, real_release = Trainer._step, train_release.release_stable_prefixes

    def step(self, *args, **kwargs):
        number = self.current_step
        record(f"begin {number}")
        out = real_step(self, *args, **kwargs)
        if kind == "step" and str(number) == index:
            die()
        digest = hashlib.sha256()
        for tensor in self.algorithm.state_dict().values():
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
        record(f"end {number} {digest.hexdigest()}")
        return out

    def release(*args, **kwargs):
        record(f"release {time.time()}")
        return real_release(*args, **kwargs)

    Trainer._step = step
    train_release.release_stable_prefixes = release
    from dporl.cli import main

    return main(rest)


if __name__ == "__main__":
    sys.exit(child(sys.argv[1:]))
