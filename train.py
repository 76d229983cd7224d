#!/usr/bin/env python
"""Run a dporl pipeline: ``python train.py --config configs/X.yaml [key=value ...]``.

Overrides use dotted keys (``dp.epsilon=5 trainer.max_steps=2000``); values are parsed as YAML; unknown keys fail.
"""

from __future__ import annotations

import argparse
import json
import sys

from dporl.pipelines import get_pipeline, known_pipelines
from dporl.utils.config import apply_overrides, from_dict, load_yaml
from dporl.utils.validation import ValidationError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML file naming a pipeline: " + ", ".join(known_pipelines()))
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    args = parser.parse_args(argv)
    try:
        data = apply_overrides(load_yaml(args.config), args.overrides)
        pipeline = get_pipeline(data.get("pipeline"))
        config = from_dict(pipeline.config_cls, data)
        summary = pipeline.run(config)
    except ValidationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(json.dumps(summary, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
