#!/usr/bin/env python
"""Evaluate a released policy in its public simulator, from ``RUN/release/`` alone (the same as ``dporl evaluate``).

    python evaluate.py --run RUN [--episodes 100] [--seed 12345] [--env ENV_ID] [--json]
    python evaluate.py --policy RUN/release/policy
    python evaluate.py --checkpoint RUN/curator/checkpoints/last.pt     (the curator's tool)

Reads only the policy directory (weights-only, sizes and hashes checked; see ``dporl.train.export``) and writes the
returns to ``<policy>/../evaluations/eval_seed<S>_episodes<N>.json`` (``--out`` to change). Public-simulator returns
of a released policy are post-processing: they cost no privacy.
"""

from __future__ import annotations

import sys

from dporl.cli import evaluate_main


def main(argv: list[str] | None = None) -> int:
    return evaluate_main(argv, prog="evaluate.py")


if __name__ == "__main__":
    sys.exit(main())
