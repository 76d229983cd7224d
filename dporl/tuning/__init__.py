"""Private hyperparameter selection: ``dporl tune --config C --space S`` and ``dporl.tune(config, space, ...)``.

One guarantee covers the whole search: a private count of the units (paid once), K private runs of the pipeline with
hyperparameters drawn at random from the space (K itself random and never released), and the release of the best
run only (Papernot & Steinke 2022, "Hyperparameter tuning with Renyi differential privacy"; Liu & Talwar 2019,
"Private selection from private candidates"). See ``dporl.tuning.search`` for the steps and the run directory,
``dporl.tuning.config`` for the space file, ``dporl.privacy.selection`` for the analysis.

    import dporl
    result = dporl.tune("configs/table_quickstart.yaml", "configs/tune_table_quickstart_space.yaml")
    result["selected"]["hyperparameters"], result["privacy"]["guarantee"]
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Mapping, Sequence

from dporl.utils.validation import ValidationError

TUNE_PREFIX = "tune."  # command-line overrides of the space file's settings: tune.trials.mean=3


def tune(config: str | Path | Mapping[str, Any], space: str | Path | Mapping[str, Any], *, mode: str = "new",
         overrides: Sequence[str] = (), dataset: Any = None, **settings: Any) -> dict:
    """Run a private search over the pipeline config ``config`` (a YAML path or a mapping) with the space file
    ``space`` (a YAML path or a mapping: ``dporl.tuning.config.TuneConfig``); returns the search's public summary.

    ``overrides``: ``key=value`` overrides of the pipeline config, or of the space file's settings when prefixed
    ``tune.``; ``settings``: the space file's settings as keyword arguments (``workers=2``, ``run_dir=...``);
    ``mode``: "new", "resume" (continue the search found in its run directory: finished trials are reused, nothing
    is charged twice) or "overwrite"; ``dataset``: a ``TrajectoryDataset`` for ``data: {format: memory}``.
    """
    from dporl.tuning.config import TuneConfig
    from dporl.tuning.search import run_search
    from dporl.utils.config import apply_overrides, from_dict, load_yaml

    base = load_yaml(config) if isinstance(config, (str, Path)) else dict(config)
    tuning = load_yaml(space) if isinstance(space, (str, Path)) else dict(space)
    base_overrides = [o for o in overrides if not o.startswith(TUNE_PREFIX)]
    tune_overrides = [o[len(TUNE_PREFIX):] for o in overrides if o.startswith(TUNE_PREFIX)]
    base = apply_overrides(base, base_overrides)
    tuning = {**apply_overrides(tuning, tune_overrides), **settings}
    if mode not in ("new", "resume", "overwrite"):
        raise ValidationError("mode", f"expected new, resume or overwrite, got {mode!r}")
    return run_search(base, from_dict(TuneConfig, tuning), mode=mode, dataset=dataset)


__all__ = ["tune"]
