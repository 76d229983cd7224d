"""Running a search's trials: one after another in this process, or in parallel on Ray (local, or a cluster).

A trial is a whole private run of a pipeline (``get_pipeline(name).run(config, mode=...)``) into its own run
directory under the search's ``curator/trials/``. Everything it prints goes to a curator log beside its run
directory (a losing trial's numbers must never reach the search's stdout); its torch thread count is fixed
(``threads``), so that a trial computes the same numbers in this process or in a Ray worker. Its outcome is read
back from its run directory's released files by the caller.

Ray is optional (``pip install dporl[ray]``): ``workers > 1`` or an ``address`` runs the trials as Ray tasks, each
taking ``threads`` CPUs; the result is the same whatever the parallelism, since trial i's config (its secret seed and
candidate) depends on i alone. On a cluster the run directory must be on storage every node sees.
"""

from __future__ import annotations

import contextlib
import sys
import time
import traceback
from pathlib import Path
from typing import Any, Callable, Iterable, Optional

from dporl.utils.validation import ValidationError


def run_trial(spec: dict[str, Any]) -> dict[str, Any]:
    """Run one trial (``spec``: pipeline, config (a plain mapping), mode, threads, log); returns its status
    ("done" or "failed" with the error) and seconds. Exceptions of the pipeline are the trial's output (a failed
    trial ranks last), never the search's: only interruptions propagate."""
    import torch

    from dporl.pipelines import get_pipeline
    from dporl.utils.config import from_dict

    threads = torch.get_num_threads()
    torch.set_num_threads(int(spec["threads"]))
    start = time.perf_counter()
    Path(spec["log"]).parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(spec["log"], "a") as log, contextlib.redirect_stdout(log):
            try:
                pipeline = get_pipeline(spec["pipeline"])
                pipeline.run(from_dict(pipeline.config_cls, spec["config"]), mode=spec["mode"])
            except Exception as exc:  # the trial's outcome: logged for the curator
                traceback.print_exc(file=log)
                return {"status": "failed", "error": f"{type(exc).__name__}: {exc}",
                        "seconds": time.perf_counter() - start}
        return {"status": "done", "error": None, "seconds": time.perf_counter() - start}
    finally:
        torch.set_num_threads(threads)


def run_trials(specs: Iterable[dict[str, Any]], on_done: Callable[[dict[str, Any], dict[str, Any]], None], *,
               workers: int = 1, address: Optional[str] = None, threads: int = 1) -> None:
    """Run every spec, calling ``on_done(spec, outcome)`` in this process as each finishes (in index order when
    sequential, in finishing order on Ray)."""
    specs = list(specs)
    if workers <= 1 and address is None:
        for spec in specs:
            on_done(spec, run_trial(spec))
        return
    try:
        import ray
    except ImportError:
        raise ValidationError("workers", "parallel trials run on Ray, which is not installed (pip install "
                              "'dporl[ray]'); or use workers: 1") from None
    started = not ray.is_initialized()
    if started:
        kwargs: dict[str, Any] = {"address": address} if address else {"num_cpus": workers * threads}
        # Worker output stays in Ray's session logs on the curator's machine, never on the search's stdout.
        ray.init(log_to_driver=False, include_dashboard=False, configure_logging=False, **kwargs)
    try:
        task = ray.remote(num_cpus=threads)(run_trial)
        queue, pending = list(specs), {}
        while queue or pending:
            while queue and len(pending) < workers:
                spec = queue.pop(0)
                pending[task.remote(spec)] = spec
            done, _ = ray.wait(list(pending), num_returns=1)
            for ref in done:
                on_done(pending.pop(ref), ray.get(ref))
    finally:
        if started:
            ray.shutdown()


def progress_bar(total: int, enabled: bool):
    """Per-trial progress on stderr (curator-only: it counts the trials, whose number is private)."""
    from tqdm.auto import tqdm

    return tqdm(total=total, disable=not enabled, file=sys.stderr, unit="trial",
                desc="search trials (curator-only: never share)")


__all__ = ["progress_bar", "run_trial", "run_trials"]
