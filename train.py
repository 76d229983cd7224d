#!/usr/bin/env python
"""Run a dporl pipeline: ``python train.py --config configs/X.yaml [--resume | --overwrite] [--json] [key=value ...]``.

The same as ``dporl train`` (``dporl.cli``): overrides use dotted keys (``dp.epsilon=5 trainer.max_steps=2000``),
values are parsed as YAML, unknown keys fail. ``--resume`` continues the run in the config's run directory if its
provenance (config and input hashes) is unchanged; ``--overwrite`` replaces it after the new config and inputs were
validated. Every refusal exits with status 2 and writes nothing. Share ``RUN/release/``; never ``RUN/curator/``.
"""

from __future__ import annotations

import sys

from dporl.cli import train_main


def main(argv: list[str] | None = None) -> int:
    return train_main(argv, prog="train.py")


if __name__ == "__main__":
    sys.exit(main())
