#!/usr/bin/env python
"""Run a dporl pipeline: ``python train.py --config configs/X.yaml [--resume | --overwrite] [key=value ...]``.

Overrides use dotted keys (``dp.epsilon=5 trainer.max_steps=2000``); values are parsed as YAML; unknown keys fail.

The run directory (the config's ``run_dir`` / ``out_dir``) must be new or empty. ``--resume`` continues the run
found there if its provenance (config and input hashes) equals this one's, and names what differs otherwise;
``--overwrite`` replaces it, deleting the old directory only after the new config and inputs were validated.
Every refusal exits with status 2 and writes nothing. Share ``RUN/release/``; never share ``RUN/curator/``.
"""

from __future__ import annotations

import argparse
import sys

from dporl.pipelines import get_pipeline, known_pipelines, run_cli
from dporl.utils.config import apply_overrides, from_dict, load_yaml


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True, help="YAML file naming a pipeline: " + ", ".join(known_pipelines()))
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--resume", action="store_const", const="resume", dest="mode",
                      help="continue the run in the run directory (same config and inputs only)")
    mode.add_argument("--overwrite", action="store_const", const="overwrite", dest="mode",
                      help="replace the run in the run directory (removed after the new config validated)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides of the config")
    args = parser.parse_args(argv)

    def train() -> dict:
        data = apply_overrides(load_yaml(args.config), args.overrides)
        pipeline = get_pipeline(data.get("pipeline"))
        return pipeline.run(from_dict(pipeline.config_cls, data), mode=args.mode or "new")

    return run_cli(train)


if __name__ == "__main__":
    sys.exit(main())
