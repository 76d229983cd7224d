"""Cost of one reward-level private update (``RewardPrivateQLearning`` through the DP-SGD engine: per-transition
Jacobians clipped, TD-error row weights, Gaussian noise) relative to the same learner's non-private update (the same
semi-gradient, unclipped, no noise), on the same network and batch, in one run. Goal: <= 1.5x.

Both updates are timed whole (targets, forward, backward, the Trainer's optimizer step) on two copies of one learner
(the engine's hooks sit on the private copy only), interleaved in rounds so that machine load hits both alike; medians
over rounds. The private update gets the batch's ``RowLayout`` as the Trainer passes it.

    python benchmarks/bench_fnq_update.py            # full measurement
    python benchmarks/bench_fnq_update.py --quick    # smoke test (seconds)
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time

import torch

from dporl.algos.fnq import FNQConfig, RewardPrivateQLearning
from dporl.privacy.dpsgd import DPSGDEngine
from dporl.privacy.noise import NoiseSource
from dporl.privacy.samplers import Batch, RowLayout
from dporl.train.config import OptimizerConfig
from dporl.train.trainer import build_optimizer


def make_batch(rows: int, obs_dim: int, n_actions: int, generator: torch.Generator) -> Batch:
    data = {
        "obs": torch.rand(rows, obs_dim, generator=generator),
        "actions": torch.randint(0, n_actions, (rows,), generator=generator),
        "rewards": torch.rand(rows, generator=generator),
        "next_obs": torch.rand(rows, obs_dim, generator=generator),
        "terminated": torch.rand(rows, generator=generator) < 0.02,
    }
    # One transition per unit, as RewardLevelSource emits it (with the layout the Trainer hands to the engine).
    return Batch(data, torch.arange(rows), rows, private=True, layout=RowLayout(rows_per_unit=1))


def steps(learner: RewardPrivateQLearning, batch: Batch, engine: DPSGDEngine | None):
    optimizer = build_optimizer(list(learner.parameters()), OptimizerConfig(name="adam", lr=1e-3))  # the Trainer's

    def step() -> None:
        optimizer.zero_grad(set_to_none=True)
        losses, weights = learner.weighted_row_losses(batch)
        if engine is None:
            (losses * weights).mean().backward()
        else:
            engine.private_backward(losses, batch.unit_index, batch.n_units, layout=batch.layout, row_weights=weights)
        optimizer.step()

    return step


def block(step, n: int) -> float:
    start = time.perf_counter()
    for _ in range(n):
        step()
    return (time.perf_counter() - start) / n


def measure(obs_dim: int, hidden: list[int], rows: int, mode: str, rounds: int, per_round: int) -> tuple[float, float]:
    torch.manual_seed(0)
    public = RewardPrivateQLearning(obs_dim, 2, FNQConfig(hidden_sizes=hidden, state_low=[0.0] * obs_dim,
                                                          state_high=[1.0] * obs_dim))
    private = copy.deepcopy(public)
    engine = DPSGDEngine(private, max_grad_norm=1.0, noise_multiplier=30.0 * rows, expected_batch_size=rows,
                         noise=NoiseSource(0), mode=mode)
    batch = make_batch(rows, obs_dim, 2, torch.Generator().manual_seed(1))
    baseline, candidate = steps(public, batch, None), steps(private, batch, engine)
    block(baseline, per_round), block(candidate, per_round)  # warm-up
    base_times, private_times = [], []
    for _ in range(rounds):
        base_times.append(block(baseline, per_round))
        private_times.append(block(candidate, per_round))
    return statistics.median(base_times), statistics.median(private_times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    rounds, per_round = (3, 5) if args.quick else (30, 20)
    cases = [
        ("line 1-16-16-2 (authors')", 1, [16, 16], 64, "bookkeeping"),
        ("line 1-16-16-2 (authors')", 1, [16, 16], 64, "ghost"),
        ("CartPole 4-64-64-2", 4, [64, 64], 64, "bookkeeping"),
        ("CartPole 4-64-64-2", 4, [64, 64], 256, "bookkeeping"),
        ("4-256-256-2", 4, [256, 256], 256, "bookkeeping"),
    ]
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, Adam, {rounds} interleaved rounds x "
          f"{per_round} updates, medians")
    print(f"{'network':28s} {'batch':>5s} {'mode':>11s} {'non-private ms':>15s} {'private ms':>11s} {'ratio':>7s}")
    for name, obs_dim, hidden, rows, mode in cases:
        base, private = measure(obs_dim, hidden, rows, mode, rounds, per_round)
        print(f"{name:28s} {rows:5d} {mode:>11s} {base * 1e3:15.3f} {private * 1e3:11.3f} {private / base:6.2f}x")


if __name__ == "__main__":
    main()
