"""The cost of a checkpoint before every journal block (what makes a resume lose no paid step), in one run.

The Trainer writes a checkpoint (weights, Adam state, generator states; about 1.6 MB for the quickstart's 2 x 256
network) before each block of ``journal_every`` steps, beside the journal record and its chain head. This times
``Trainer.fit`` of 1000 private steps (DP-SGD, Poisson rate 0.256 over 1000 units, a 2 x 256 MLP of the quickstart's
size, blocks of 50) as it runs (21 checkpoints) against the same loop with the per-block checkpoints left out (only
the last one written; the journal writes unchanged), interleaved, in fresh run directories, and prints the ratio.

    python benchmarks/bench_checkpoint_cadence.py [--steps 1000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

import torch
from torch import nn

from dporl.algos.base import LossForm, PrivateAlgorithm
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.samplers import PoissonUnitSource
from dporl.train.config import DPConfig, TrainerConfig
from dporl.train.trainer import Trainer

UNITS, RATE = 1000, 0.256


class Regression(PrivateAlgorithm):
    privacy_unit = "transition"
    loss_form = LossForm.ROW_LOSSES
    batch_keys = ("x", "y")
    policy_kind = None

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(8, 256), nn.ReLU(), nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 1))

    def row_losses(self, batch):
        return (self.net(batch.data["x"]).squeeze(1) - batch.data["y"]).pow(2)


def fit(run_dir: Path, steps: int, journal_every: int, every_block: bool) -> float:
    torch.manual_seed(0)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(UNITS, 8, generator=g)
    source = PoissonUnitSource({"x": x, "y": x.sum(1)}, torch.arange(UNITS), UNITS, sample_rate=RATE)
    config = TrainerConfig(max_steps=steps, log_every=100, eval_every=10 * steps, checkpoint_every=10 * steps,
                           journal_every=journal_every, progress=False)
    trainer = Trainer(Regression(), source, config=config,
                      dp=DPConfig(epsilon=1e6, delta=1e-5, noise_multiplier=1.0, noise_seed=0),
                      ledger=PrivacyLedger(), run_dir=run_dir, pipeline="bench", pipeline_config={"bench": 1})
    if not every_block:  # the baseline: the final checkpoint only
        save = trainer._save
        trainer._save = lambda run, sha, step, *rest: save(run, sha, step, *rest) if step == steps else None
    start = time.perf_counter()
    trainer.fit()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    torch.set_num_threads(1)
    times = {True: [], False: []}
    with tempfile.TemporaryDirectory() as work:
        for round_ in range(args.rounds):
            for every_block in times:  # interleaved
                times[every_block].append(fit(Path(work) / f"r{round_}_{every_block}", args.steps, 50, every_block))
    every, last = min(times[True]), min(times[False])
    print(f"load average (1 min) at the end: {os.getloadavg()[0]:.2f}")
    print(f"{args.steps} private steps, blocks of 50, a checkpoint before every block: best of {args.rounds} "
          f"{every:.2f} s")
    print(f"{args.steps} private steps, blocks of 50, the last checkpoint only:        best of {args.rounds} "
          f"{last:.2f} s")
    print(f"ratio (every block / last only): {every / last:.3f}")


if __name__ == "__main__":
    main()
