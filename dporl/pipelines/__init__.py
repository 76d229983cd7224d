"""Experiment pipelines: one config dataclass and one run function each, dispatched by ``dporl train``.

A YAML config names its pipeline (``pipeline: train``); the rest of the file is that pipeline's config.
``get_pipeline(name).run(config, mode="new")`` opens the config's run directory (``dporl.train.run_dir``) in
``mode`` ("new", "resume", "overwrite": ``dporl train``'s default, ``--resume``, ``--overwrite``) and checks every
input before writing.

``read_config(path, overrides)`` reads a config file: the keys a pipeline declares as file references
(``Pipeline.file_keys``, e.g. a sweep's ``base``) name files relative to the config file's own directory, so a
config runs from any working directory; a ``key=value`` override is a command-line argument and stays relative to
the working directory.

``PIPELINES`` is the one registry: each name maps to the module whose ``PIPELINE`` attribute is that pipeline, so the
command line imports only what it runs and no second list can disagree with it.
"""

from __future__ import annotations

import importlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, Sequence

from dporl.utils.io import CURATOR_LABEL, curator_note, dump_json  # noqa: F401  (re-exported for the pipelines)
from dporl.utils.validation import ValidationError


@dataclass(frozen=True)
class Pipeline:
    name: str
    config_cls: type
    run: Callable[..., dict]  # run(config, mode="new") -> summary
    # evaluate(checkpoint_payload, episodes, seed, out_dir) -> metrics, for evaluate.py
    evaluate: Optional[Callable[..., dict]] = None
    # top-level keys whose values in a config file are paths relative to that file's directory (``read_config``)
    file_keys: tuple[str, ...] = ()


# Name -> the module defining ``PIPELINE`` (imported on first use), with the one line ``dporl list`` shows.
PIPELINES: dict[str, tuple[str, str]] = {
    "dataset": ("dporl.pipelines.dataset", "generate logged expert data (experts, trajectories, p_min)"),
    "train": ("dporl.pipelines.train", "train a policy privately: a registered algorithm with a method"),
    "sweep": ("dporl.pipelines.sweep", "a train config over budgets x methods x seeds: table and plot"),
    "ope": ("dporl.pipelines.ope", "private policy evaluation experiments (GPOPE, DP-LSW, DP-LSL)"),
    "fnq": ("dporl.pipelines.fnq", "reward-level private Q-learning and its baselines"),
}


def get_pipeline(name: Any) -> Pipeline:
    """The pipeline ``name`` (its module imported now), or a ValidationError naming ``pipeline``."""
    if not isinstance(name, str) or name not in PIPELINES:
        raise ValidationError("pipeline", f"unknown pipeline {name!r} (known: {', '.join(sorted(PIPELINES))})")
    pipeline = importlib.import_module(PIPELINES[name][0]).PIPELINE
    if not isinstance(pipeline, Pipeline) or pipeline.name != name:
        raise ValidationError("pipeline", f"{PIPELINES[name][0]}.PIPELINE is not the pipeline {name!r}")
    return pipeline


def read_config(path: str | Path, overrides: Sequence[str] = (), pipeline: Optional[str] = None
                ) -> tuple[Pipeline, dict[str, Any]]:
    """(the pipeline, its config data) of the YAML file ``path`` with ``overrides`` applied: the file's relative
    paths under the pipeline's ``file_keys`` resolved against the file's directory first (an override's path stays
    relative to the working directory). ``pipeline``: the name to use when the file names none."""
    from dporl.utils.config import apply_overrides, load_yaml

    data = load_yaml(path)
    chosen = get_pipeline(data.get("pipeline", pipeline))
    for key in chosen.file_keys:
        value = data.get(key)
        if isinstance(value, str) and value and not Path(value).is_absolute():
            data[key] = str(Path(path).parent / value)
    data = apply_overrides(data, overrides)
    return get_pipeline(data.get("pipeline", pipeline)), data


def known_pipelines() -> list[str]:
    return sorted(PIPELINES)


def run_cli(work: Callable[[], Any], as_json: bool = False, resume_command: Optional[str] = None) -> int:
    """A command line's outcome: a short human summary of ``work()``'s result on stdout, ending with the headline
    metrics and the guarantee (``as_json``: the whole result as JSON, for machines), exit 0; or the bad input, named
    by its field, on stderr (exit 2); or, stopped by SIGINT / SIGTERM, where it stopped and ``resume_command`` (the
    command that continues it), on stderr, exit 130 / 143, no traceback. Full configs and summaries live in the run
    directory, not on the screen."""
    from dporl.train.interrupt import Interrupted, terminate_as_interrupt
    from dporl.utils.io import disk_full_cause, disk_full_error

    try:
        with terminate_as_interrupt():
            result = work()
    except ValidationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a full disk outside dporl's atomic writers (e.g. TensorBoard's event files)
        cause = disk_full_cause(exc)
        if cause is None:
            raise
        print(f"error: {disk_full_error(exc.filename or 'a file', cause)}", file=sys.stderr)
        return 2
    except (Interrupted, KeyboardInterrupt) as exc:
        stopped = exc if isinstance(exc, Interrupted) else Interrupted(2, "before it finished")
        hint = f"; continue with: {resume_command}" if resume_command else ""
        print(f"\ninterrupted {stopped.where}{hint}", file=sys.stderr)
        if stopped.detail:
            print(f"  ({stopped.detail})", file=sys.stderr)
        return stopped.exit_code
    print(dump_json(result, indent=2, default=str) if as_json else outcome_text(result))
    return 0


def outcome_text(result: Any) -> str:
    """What a person reads at the end of a run: a few scalar facts, the headline metrics, then the guarantee."""
    if not isinstance(result, dict):
        return str(result)
    lines = []
    headline = result.get("headline")
    if isinstance(headline, dict) and headline:
        lines += [f"{name}: {value}" for name, value in headline.items()]
    else:  # no headline: the result's scalar entries (nested tables and configs are in the run directory)
        lines += [f"{name}: {_short(value)}" for name, value in result.items()
                  if name not in ("privacy", "config") and (value is None or isinstance(value, (str, int, float)))]
    privacy = result.get("privacy")
    if isinstance(privacy, dict):
        lines.append(guarantee_line(privacy))
    return "\n".join(lines)


def guarantee_line(privacy: dict) -> str:
    """One line for a privacy report's dict (``PrivacyReport.to_dict()``): the guarantee, or why there is none."""
    guarantee = privacy.get("guarantee")
    if privacy.get("void"):
        return f"NO GUARANTEE: {privacy['void']}"
    if not guarantee:
        return "NO PRIVACY GUARANTEE" + (f": {'; '.join(privacy['notes'])}" if privacy.get("notes") else "")
    unit = guarantee.get("unit")
    column = guarantee.get("unit_column")
    return (f"GUARANTEE: ({guarantee['epsilon']:.4g}, {guarantee['delta']:g})-DP; privacy unit: {unit}"
            f"{f' (column {column!r})' if column and column != 'expert_id' else ''}; {guarantee.get('neighbouring', '')}")


def _short(value: Any) -> str:
    return f"{value:.4g}" if isinstance(value, float) else str(value)
