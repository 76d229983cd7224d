"""Experiment pipelines: one config dataclass and one run function each, dispatched by ``train.py``.

A YAML config names its pipeline (``pipeline: expert_cql``); the rest of the file is that pipeline's config.
``run(config, mode="new")`` opens the config's run directory (``dporl.train.run_dir``) in ``mode`` ("new",
"resume", "overwrite": train.py's default, ``--resume``, ``--overwrite``) and checks every input before writing.
"""

from __future__ import annotations

import importlib
import json
import sys
from dataclasses import dataclass
from typing import Any, Callable, Optional

from dporl.utils.validation import ValidationError


@dataclass(frozen=True)
class Pipeline:
    name: str
    config_cls: type
    run: Callable[..., dict]  # run(config, mode="new") -> summary
    # evaluate(checkpoint_payload, episodes, seed, out_dir) -> metrics, for evaluate.py
    evaluate: Optional[Callable[..., dict]] = None


_REGISTRY: dict[str, Pipeline] = {}
# Pipelines register themselves on import; this maps each name to its module so train.py imports only what it runs.
_MODULES = {
    "dataset": "dporl.pipelines.dataset",
    "expert_cql": "dporl.pipelines.expert_cql",
    "ope": "dporl.pipelines.ope",
    "fnq": "dporl.pipelines.fnq",
}


def register(pipeline: Pipeline) -> Pipeline:
    _REGISTRY[pipeline.name] = pipeline
    return pipeline


def get_pipeline(name: Any) -> Pipeline:
    if name not in _MODULES:
        raise ValidationError("pipeline", f"unknown pipeline {name!r} (known: {', '.join(sorted(_MODULES))})")
    importlib.import_module(_MODULES[name])
    return _REGISTRY[name]


def known_pipelines() -> list[str]:
    return sorted(_MODULES)


def run_cli(work: Callable[[], Any]) -> int:
    """A command line's outcome: ``work()``'s result as JSON on stdout (exit 0), or the bad input, named by its
    field, on stderr (exit 2)."""
    try:
        result = work()
    except ValidationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(result, indent=2, default=str))
    return 0
