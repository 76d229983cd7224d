"""Cost of one DP-SGD step relative to a non-private step, for every clipping mode, measured in one run.

Setup (the issue's target): discrete CQL on a 2 x 256 ReLU Q-network, CartPole-sized inputs (4 -> 2 actions),
256 privacy units per step, Adam. Prints the median step time of each mode and its ratio to the non-private step.

    python benchmarks/bench_dpsgd.py            # full measurement
    python benchmarks/bench_dpsgd.py --quick    # smoke test (seconds)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dporl.algos.cql import CQLConfig, DiscreteCQL
from dporl.privacy.dpsgd import DPSGDEngine
from dporl.privacy.noise import NoiseSource
from dporl.privacy.samplers import Batch


def make_batch(units: int, rows_per_unit: int, obs_dim: int, n_actions: int, generator: torch.Generator) -> Batch:
    rows = units * rows_per_unit
    data = {
        "obs": torch.randn(rows, obs_dim, generator=generator),
        "actions": torch.randint(0, n_actions, (rows,), generator=generator),
        "rewards": torch.randn(rows, generator=generator),
        "next_obs": torch.randn(rows, obs_dim, generator=generator),
        "terminated": torch.zeros(rows, dtype=torch.bool),
    }
    return Batch(data, torch.arange(units).repeat_interleave(rows_per_unit), units, private=True)


def time_steps(step, repeats: int, warmup: int) -> float:
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    repeats, warmup = (5, 2) if args.quick else (200, 20)
    generator = torch.Generator().manual_seed(0)
    model = DiscreteCQL(4, 2, CQLConfig(hidden_sizes=[256, 256]))
    optimizer = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-3)
    batches = {k: make_batch(args.batch, k, 4, 2, generator) for k in (1, 4)}

    def non_private_on(batch):
        def step():
            optimizer.zero_grad(set_to_none=True)
            model.row_losses(batch).mean().backward()
            optimizer.step()

        return step

    # A unit with k rows costs a forward/backward over k rows, so each mode is compared with a non-private step
    # over the same rows.
    baselines = {k: time_steps(non_private_on(b), repeats, warmup) for k, b in batches.items()}
    results = {f"non-private ({args.batch * k} rows)": (baselines[k], k) for k in batches}
    modes = [("bookkeeping", 1), ("bookkeeping", 4), ("ghost", 1), ("opacus", 1), ("naive", 1)]
    for mode, k in modes:
        engine = DPSGDEngine(model, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=args.batch,
                             noise=NoiseSource(0), mode=mode)
        batch = batches[k]

        def private():
            optimizer.zero_grad(set_to_none=True)
            engine.private_backward(model.row_losses(batch), batch.unit_index, batch.n_units)
            optimizer.step()

        reps = max(3, repeats // 20) if mode == "naive" else repeats
        seconds = time_steps(private, reps, min(warmup, 2) if mode == "naive" else warmup)
        results[f"{mode} (rows/unit={k})"] = (seconds, k)
        if engine._grad_sample_module is not None:
            engine._grad_sample_module._close()
    print(f"torch {torch.__version__}, threads={torch.get_num_threads()}, batch={args.batch} units, 2x256 MLP, CQL loss")
    print(f"{'mode':28s} {'ms/step':>9s} {'ratio vs non-private on the same rows':>38s}")
    for name, (seconds, k) in results.items():
        print(f"{name:28s} {seconds * 1e3:9.3f} {seconds / baselines[k]:37.2f}x")


if __name__ == "__main__":
    main()
