#!/usr/bin/env python
"""Run a dporl pipeline: ``python train.py --config configs/X.yaml [key=value ...]``.

Overrides use dotted keys (``dp.epsilon=5 trainer.max_steps=2000``); values are parsed as YAML; unknown keys fail.
"""

from __future__ import annotations

import argparse
import sys

from dporl.pipelines import get_pipeline, known_pipelines, run_cli
from dporl.utils.config import apply_overrides, from_dict, load_yaml


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML file naming a pipeline: " + ", ".join(known_pipelines()))
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    args = parser.parse_args(argv)

    def train() -> dict:
        data = apply_overrides(load_yaml(args.config), args.overrides)
        pipeline = get_pipeline(data.get("pipeline"))
        return pipeline.run(from_dict(pipeline.config_cls, data))

    return run_cli(train)


if __name__ == "__main__":
    sys.exit(main())
