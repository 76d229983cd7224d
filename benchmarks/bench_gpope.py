"""GPOPE iterations per second: the O(tau n) primal-dual gradient vs forming A_i and C_i (O(tau n^2)), one run.

One iteration = the paper's Algorithm 1 step on one sampled trajectory of length tau: B_i(theta, w), clip to h,
add h N(0, sigma^2 I) through the DP engine, SGD update of [theta; w]. Trajectories come from a pool whose
features (dense random Fourier-style features of an 8-d observation) are computed once, so the timing isolates
what the two implementations do differently. Prints iterations/second of each and the speed-up, at n = 64, 256,
1024 (trajectory length 100 by default).

    python benchmarks/bench_gpope.py            # full measurement
    python benchmarks/bench_gpope.py --quick    # smoke test (seconds)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dporl.algos.gpope import dense_primal_dual_gradients, primal_dual_gradients
from dporl.algos.lstd import TDTerms
from dporl.privacy.dpsgd import DPSGDEngine
from dporl.privacy.noise import NoiseSource


class _Params(torch.nn.Module):
    def __init__(self, n: int):
        super().__init__()
        self.theta = torch.nn.Parameter(torch.zeros(n))
        self.w = torch.nn.Parameter(torch.zeros(n))


def trajectory_pool(pool: int, tau: int, n: int, generator: torch.Generator) -> list[TDTerms]:
    """``pool`` single-trajectory TDTerms with dense features cos(W s + b) of random 8-d states."""
    weight = torch.randn(8, n, generator=generator)
    offset = torch.rand(n, generator=generator) * 6.283
    out = []
    for _ in range(pool):
        states = torch.randn(1, tau + 1, 8, generator=generator)
        phi_all = torch.cos(states @ weight + offset) / n**0.5
        mask = torch.ones(1, tau)
        out.append(TDTerms(phi_all[:, :-1], phi_all[:, 1:], mask.clone(), torch.rand(1, tau, generator=generator),
                           mask, torch.full((1,), float(tau))))
    return out


def iterations_per_second(gradient, pool, n: int, repeats: int, warmup: int) -> float:
    model = _Params(n)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    times = []
    with DPSGDEngine(model, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=1.0, noise=NoiseSource(0),
                     mode="naive") as engine:
        for i in range(warmup + repeats):
            terms = pool[i % len(pool)]
            start = time.perf_counter()
            with torch.no_grad():
                directions = gradient(terms, model.theta, model.w, 0.99)
            engine.write_gradients(engine.private_direction(directions))
            optimizer.step()
            if i >= warmup:
                times.append(time.perf_counter() - start)
    return 1.0 / statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tau", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    generator = torch.Generator().manual_seed(0)
    print(f"GPOPE iteration (one trajectory, tau={args.tau}, clip + noise + SGD), threads={args.threads}")
    print(f"{'n':>6} {'O(tau n) it/s':>14} {'dense A_i it/s':>15} {'speed-up':>9}")
    for n in (64, 256, 1024):
        repeats = 5 if args.quick else (200 if n < 1024 else 30)
        pool = trajectory_pool(8, args.tau, n, generator)
        fast = iterations_per_second(primal_dual_gradients, pool, n, repeats, warmup=2)
        dense = iterations_per_second(dense_primal_dual_gradients, pool, n, repeats, warmup=2)
        print(f"{n:>6} {fast:>14.1f} {dense:>15.1f} {fast / dense:>8.1f}x")


if __name__ == "__main__":
    main()
