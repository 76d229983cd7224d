"""What a search writes: the selected trial's release copied under the search's guarantee, and the curator's table.

``copy_release``: every file of the winning trial's ``release/`` except its TensorBoard event files (their wall-clock
times would say when the winner ran among the trials, which bounds the private number of trials), written afresh
(new modification times), with the search's privacy report in place of the trial's own, in ``privacy_report.json``
and in the policy's ``policy.json``: what covers the released policy is the search's guarantee, not one trial's.

``write_results``: ``curator/results.csv`` (one row per trial: status, score, hyperparameters, seconds) and
``curator/results.png`` (score against each hyperparameter, the selected trial marked). Curator-only: the losing
trials' scores are released by no mechanism.
"""

from __future__ import annotations

import math
import shutil
from pathlib import Path
from typing import Any, Mapping, Optional

from dporl.utils.io import atomic_write, atomic_write_csv, atomic_write_json, read_json

SKIPPED = ("tensorboard",)


def copy_release(source: Path, target: Path, privacy: Mapping[str, Any]) -> None:
    """The winner's ``source`` release into the search's ``target`` (module docstring)."""
    for path in sorted(source.rglob("*")):
        relative = path.relative_to(source)
        if relative.parts[0] in SKIPPED or path.is_dir() or path.is_symlink():
            continue
        destination = target / relative
        destination.parent.mkdir(parents=True, exist_ok=True)
        if relative == Path("privacy_report.json"):
            atomic_write_json(destination, dict(privacy))
        elif path.suffix == ".json" and isinstance(content := read_json(path, "trial.release"), dict) and \
                "privacy" in content:  # the policy's spec, the training summary: the search's guarantee instead
            short = relative.name == "policy.json"
            content["privacy"] = ({"guarantee": privacy.get("guarantee"), "void": privacy.get("void"),
                                   "text": privacy.get("text")} if short else dict(privacy))
            atomic_write_json(destination, content)
        else:
            atomic_write(destination, lambda tmp, path=path: shutil.copyfile(path, tmp))


def write_results(curator: Path, records: list[Mapping[str, Any]], candidates: list[Mapping[str, Any]], space,
                  winner: Optional[int]) -> list[dict[str, Any]]:
    """The per-trial table and plot in ``curator`` (module docstring); returns the rows."""
    rows = []
    for i, (record, candidate) in enumerate(zip(records, candidates)):
        rows.append({"trial": i, "status": record.get("status"), "score": record.get("score"),
                     **{key: candidate.get(key) for key in space.keys}, "seconds": record.get("seconds"),
                     "selected": i == winner, "error": record.get("error")})
    atomic_write_csv(curator / "results.csv", ["trial", "status", "score", *space.keys, "seconds", "selected", "error"],
                     rows)
    _plot(curator / "results.png", rows, space)
    return rows


def _plot(path: Path, rows: list[dict[str, Any]], space) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dims = list(space.dimensions)
    figure, axes = plt.subplots(1, len(dims), figsize=(4 * len(dims), 3.4), squeeze=False)
    scored = [r for r in rows if r["score"] is not None and math.isfinite(r["score"])]
    for axis, dim in zip(axes[0], dims):
        categorical = dim.kind == "choices" and not all(isinstance(v, (int, float)) and not isinstance(v, bool)
                                                        for v in dim.values)
        labels = [str(v) for v in dim.values]

        def x_of(value: Any) -> Any:
            return labels.index(str(value)) if categorical else value

        axis.scatter([x_of(r[dim.key]) for r in scored], [r["score"] for r in scored], color="tab:blue",
                     label="trial")
        chosen = [r for r in scored if r["selected"]]
        if chosen:
            axis.scatter([x_of(chosen[0][dim.key])], [chosen[0]["score"]], color="tab:red", marker="*", s=160,
                         label="selected")
        if categorical:
            axis.set_xticks(range(len(labels)), labels)
        elif dim.kind == "loguniform":
            axis.set_xscale("log")
        axis.set_xlabel(dim.key)
        axis.set_ylabel("score")
        axis.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    figure.suptitle("private search: every trial's score (CURATOR-ONLY: never share)", fontsize=9)
    figure.tight_layout()
    atomic_write(path, lambda tmp: figure.savefig(tmp, dpi=110), suffix=".png")
    plt.close(figure)


__all__ = ["copy_release", "write_results"]
