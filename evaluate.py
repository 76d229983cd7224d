#!/usr/bin/env python
"""Evaluate a trained checkpoint: ``python evaluate.py --checkpoint RUN/checkpoints/last.pt --episodes 100``.

Writes the metrics (mean and confidence interval of returns, or the estimator's error for policy evaluation) to
TensorBoard under RUN/eval and to a JSON summary beside the checkpoint's run directory.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dporl.pipelines import get_pipeline, run_cli
from dporl.train.checkpoint import load_checkpoint
from dporl.utils.validation import ValidationError


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True)
    parser.add_argument("--episodes", type=int, default=100)
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--out", default=None, help="directory for eval outputs (default: the run directory)")
    args = parser.parse_args(argv)

    def evaluate() -> dict:
        payload = load_checkpoint(args.checkpoint)
        pipeline = get_pipeline(payload["pipeline"])
        if pipeline.evaluate is None:
            raise ValidationError("checkpoint", f"pipeline {pipeline.name!r} has no evaluator")
        out_dir = Path(args.out) if args.out else Path(args.checkpoint).resolve().parent.parent
        return pipeline.evaluate(payload, episodes=args.episodes, seed=args.seed, out_dir=out_dir)

    return run_cli(evaluate)


if __name__ == "__main__":
    sys.exit(main())
