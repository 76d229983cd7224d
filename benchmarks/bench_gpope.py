"""GPOPE's costs, each against a baseline measured in the same run (interleaved, medians):

1. One iteration (the paper's Algorithm 1 step on one sampled trajectory of length tau: B_i(theta, w), clip to h,
   add h N(0, sigma^2 I) through the DP engine, SGD update): the O(tau n) primal-dual gradient vs forming A_i and C_i
   (O(tau n^2)), at n = 64, 256, 1024, with dense random Fourier-style features of an 8-d observation computed once.
2. One-hot (tabular) features, the chain's: the O(tau) gather / scatter-add path vs the O(tau n) dense path on the
   same padded batch of chain trajectories (n = 40), at 1 and 400 trajectories per update.
3. Paper-mode accounting: the sampling-without-replacement RDP curve at every order up to 1024 for a new sigma
   (what each step of a calibration needs), vectorised vs dp_accounting's ``RdpAccountant`` on the same orders.

    python benchmarks/bench_gpope.py            # full measurement
    python benchmarks/bench_gpope.py --quick    # smoke test (seconds)
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from dporl.algos.gpope import dense_primal_dual_gradients, primal_dual_gradients, tabular_primal_dual_gradients
from dporl.algos.lstd import TDTerms, td_terms
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


def _median_seconds(run, repeats: int, warmup: int) -> float:
    times = []
    for i in range(warmup + repeats):
        start = time.perf_counter()
        run(i)
        if i >= warmup:
            times.append(time.perf_counter() - start)
    return statistics.median(times)


def iteration_seconds(gradient, pool, n: int, repeats: int, warmup: int) -> float:
    model = _Params(n)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    with DPSGDEngine(model, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=1.0, noise=NoiseSource(0),
                     mode="naive") as engine:

        def run(i: int) -> None:
            with torch.no_grad():
                directions = gradient(pool[i % len(pool)], model.theta, model.w, 0.99)
            engine.write_gradients(engine.private_direction(directions))
            optimizer.step()

        return _median_seconds(run, repeats, warmup)


def dense_vs_fast(args) -> None:
    generator = torch.Generator().manual_seed(0)
    print(f"1. GPOPE iteration (one trajectory, tau={args.tau}, clip + noise + SGD), threads={args.threads}")
    print(f"{'n':>6} {'O(tau n) it/s':>14} {'dense A_i it/s':>15} {'speed-up':>9}")
    for n in (64, 256, 1024):
        repeats = 5 if args.quick else (200 if n < 1024 else 30)
        pool = trajectory_pool(8, args.tau, n, generator)
        fast, dense = [], []
        for _ in range(1 if args.quick else 3):  # interleaved rounds
            fast.append(iteration_seconds(primal_dual_gradients, pool, n, repeats, warmup=2))
            dense.append(iteration_seconds(dense_primal_dual_gradients, pool, n, repeats, warmup=2))
        f, d = statistics.median(fast), statistics.median(dense)
        print(f"{n:>6} {1 / f:>14.1f} {1 / d:>15.1f} {d / f:>8.1f}x")


def tabular_vs_dense(args) -> None:
    from dporl.eval.ope_problems import ChainSettings, chain_problem, padded_data

    problem = chain_problem(ChainSettings(), 0.99)
    data = padded_data(problem.sample(4000, torch.Generator().manual_seed(1)))
    theta, w = torch.randn(40), torch.randn(40)
    print("2. Tabular features (chain, n = 40): B_i of a batch, gather/scatter-add vs dense one-hot products")
    print(f"{'batch':>6} {'O(tau) ms':>10} {'O(tau n) ms':>12} {'speed-up':>9}")
    for batch in (1, 400):
        rows = [{k: v[i * batch:(i + 1) * batch] for k, v in data.items()} for i in range(4000 // batch)]
        cut = []
        for r in rows:  # each batch cut to its longest trajectory, as GPOPE.unit_directions does
            width = int(r["mask"].sum(1).max())
            cut.append({**r, "observations": r["observations"][:, :width + 1],
                        **{k: r[k][:, :width] for k in ("actions", "rewards", "mask")}})
        repeats = 5 if args.quick else 200 // max(1, batch // 20)

        def fast(i):
            tabular_primal_dual_gradients(problem.features, cut[i % len(cut)], None, theta, w, 0.99)

        def dense(i):
            primal_dual_gradients(td_terms(problem.features, cut[i % len(cut)]), theta, w, 0.99)

        f, d = [], []
        for _ in range(1 if args.quick else 3):
            f.append(_median_seconds(fast, repeats, 2))
            d.append(_median_seconds(dense, repeats, 2))
        fm, dm = statistics.median(f), statistics.median(d)
        print(f"{batch:>6} {fm * 1e3:>10.3f} {dm * 1e3:>12.3f} {dm / fm:>8.1f}x")


def swor_curve(args) -> None:
    import dp_accounting
    from dp_accounting.rdp import RdpAccountant

    from dporl.privacy import accountants

    sigmas = iter(1.0 + 0.01 * k for k in range(1000))  # a new sigma each time: nothing cached

    def ours(_):
        accountants.swor_gaussian_rdp(1e-3, next(sigmas))

    def reference(_):
        accountant = RdpAccountant(orders=list(accountants.RDP_ORDERS),
                                   neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE)
        accountant.compose(dp_accounting.SampledWithoutReplacementDpEvent(
            1000, 1, dp_accounting.GaussianDpEvent(next(sigmas))))

    repeats = 1 if args.quick else 3
    o, r = [], []
    for _ in range(1 if args.quick else 3):
        o.append(_median_seconds(ours, 5 * repeats, 1))
        r.append(_median_seconds(reference, repeats, 0))
    om, rm = statistics.median(o), statistics.median(r)
    print(f"3. Sampling-without-replacement RDP curve, {len(accountants.RDP_ORDERS)} orders up to 1024, new sigma:")
    print(f"   vectorised {om * 1e3:.1f} ms, dp_accounting {rm * 1e3:.0f} ms: {rm / om:.0f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--tau", type=int, default=100)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    dense_vs_fast(args)
    tabular_vs_dense(args)
    swor_curve(args)


if __name__ == "__main__":
    main()
