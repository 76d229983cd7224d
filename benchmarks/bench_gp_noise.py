"""Lazily sampled Ornstein-Uhlenbeck path: Markov bisection (O(log n) per point) vs exact dense conditioning.

    python benchmarks/bench_gp_noise.py [--quick]

Queries arrive one at a time, as in Algorithm 1 (one new state per environment step). The baseline is exact GP
conditioning on every stored point through an incrementally grown Cholesky factor (``LaplaceKernelPath`` with
d = 1, O(n^2) per point; recomputing a dense Cholesky per point would be O(n^3)). Both draw the same standard
normals in the same order, so their values must agree up to rounding: the benchmark checks that, then reports the
time per query at each size where the dense baseline still runs, the speed-up ratio, and the Markov path alone at
1e5 queries (one at a time and as one batch).
"""

from __future__ import annotations

import argparse
import time

import torch

from dporl.privacy.gp_noise import LaplaceKernelPath, OrnsteinUhlenbeckPath
from dporl.privacy.noise import NoiseSource

SIGMA, BETA = 1.0, 50.0


def _one_at_a_time(path, points: torch.Tensor) -> tuple[float, torch.Tensor]:
    start = time.perf_counter()
    values = [path(p.reshape(1, 1))[0] for p in points]
    return time.perf_counter() - start, torch.stack(values)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes (seconds)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    sizes = [250, 500] if args.quick else [500, 1000, 2000]
    n_large = 10_000 if args.quick else 100_000
    generator = torch.Generator().manual_seed(0)

    print(f"{'n points':>9} {'markov us/query':>16} {'dense us/query':>15} {'ratio':>7} {'max |diff|':>11}")
    for n in sizes:
        points = torch.rand(n, generator=generator, dtype=torch.float64)
        markov_time, markov = _one_at_a_time(OrnsteinUhlenbeckPath(SIGMA, BETA, NoiseSource(1)), points)
        dense_time, dense = _one_at_a_time(LaplaceKernelPath(1, SIGMA, BETA, NoiseSource(1)), points)
        diff = float((markov - dense).abs().max())
        print(f"{n:>9} {1e6 * markov_time / n:>16.1f} {1e6 * dense_time / n:>15.1f} "
              f"{dense_time / markov_time:>7.1f} {diff:>11.2e}")

    points = torch.rand(n_large, generator=generator, dtype=torch.float64)
    single_time, _ = _one_at_a_time(OrnsteinUhlenbeckPath(SIGMA, BETA, NoiseSource(2)), points)
    batch_path = OrnsteinUhlenbeckPath(SIGMA, BETA, NoiseSource(2))
    start = time.perf_counter()
    batch_path(points)
    batch_time = time.perf_counter() - start
    print(f"markov path, {n_large} queries: one at a time {single_time:.2f} s ({1e6 * single_time / n_large:.1f} us/query), "
          f"one batch {batch_time:.2f} s; dense conditioning at this size would need a {n_large}x{n_large} "
          f"Cholesky factor ({8 * n_large**2 / 2**30:.0f} GiB)")


if __name__ == "__main__":
    main()
