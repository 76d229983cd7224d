"""Refusing hostile files and unaffordable analyses: time and allocation against the inflate-first baseline.

1. An npz zip bomb: a valid small dataset whose ``observations`` member is 512 MiB of deflated zeros (a file of
   about 0.5 MB). Candidate: ``TrajectoryDataset.load`` (sizes from the zip directory and the ``.npy`` header,
   refused before inflating). Baseline: what a reader that inflates first does, ``np.load(path)["observations"]``
   (numpy allocates the declared array and inflates it; a shape check can only follow).
2. A PLD analysis whose grid explodes: 60 Poisson-Gaussian steps at noise multiplier 0.05 (q = 0.25), a ~9M-point
   composed grid on the 1e-3 grid. Candidate: ``epsilon_for(..., "pld")`` (sized first: a loss this wide, ~400 nats
   per step, has no PLD here, and the RDP bound answers). Baseline:
   dp_accounting's PLD built and composed directly (what the accountant did; at 0.001 it asks for 3.8 GiB).

Baseline and candidate are interleaved, each repeated; medians of wall time (untraced) and of peak traced
allocation (``tracemalloc``, a second call) are printed with the ratios baseline / candidate. The candidate's
cached results are cleared before every call (``functools.lru_cache``), so each call pays its full cost.

    python benchmarks/bench_bounded_reads.py          # 512 MiB bomb, 3 repetitions
    python benchmarks/bench_bounded_reads.py --quick  # 64 MiB bomb, 1 repetition
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np

MIB = 1 << 20


def _call(call) -> None:
    try:
        call()
    except Exception:  # noqa: BLE001 - the candidate refuses; the time and allocation are what is measured
        pass


def measure(call) -> tuple[float, int]:
    """(wall seconds of an untraced call, peak traced allocation of a second, traced call): tracing slows
    allocation-heavy code several times, so the time is taken without it."""
    start = time.perf_counter()
    _call(call)
    elapsed = time.perf_counter() - start
    tracemalloc.start()
    _call(call)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return elapsed, peak


def write_bomb(path: Path, inflated: int) -> None:
    import io

    from dporl.data.dataset import DatasetMetadata, TrajectoryDataset

    meta = DatasetMetadata(env_id="CartPole-v1", n_actions=2, n_units=1, obs_shape=(4,))
    small = TrajectoryDataset(observations=np.zeros((3, 4), np.float32), actions=[0, 1], rewards=[1.0, 1.0],
                              terminations=[False, True], truncations=[False, False], episode_lengths=[2],
                              unit_ids=[0], metadata=meta)
    small.save(path.with_suffix(".small.npz"))
    rows = inflated // 16
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (rows, 4)})
    with np.load(path.with_suffix(".small.npz")) as source, \
            zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as archive:
        for key in source.files:
            if key != "observations":
                with archive.open(f"{key}.npy", "w") as member:
                    np.lib.format.write_array(member, source[key])
        with archive.open("observations.npy", "w", force_zip64=True) as member:
            member.write(header.getvalue())
            chunk = bytes(8 * MIB)
            for _ in range(rows * 16 // len(chunk)):
                member.write(chunk)


def pld_baseline(sigma: float, q: float, steps: int, delta: float) -> float:
    from dp_accounting.pld import privacy_loss_distribution as plds

    pld = plds.from_gaussian_mechanism(sigma, sampling_prob=q, value_discretization_interval=1e-3)
    return pld.self_compose(steps).get_epsilon_for_delta(delta)


def uncached_epsilon(sigma: float, q: float, steps: int) -> float:
    from dporl.privacy import accountants, pld

    pld.clear_caches()
    accountants.rdp_curve.cache_clear()
    return accountants.epsilon_for([(accountants.PoissonGaussianEvent(sigma, q), steps)], 1e-5, "pld")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    inflated, repeats = (64 * MIB, 1) if args.quick else (512 * MIB, 3)

    from dporl.data.dataset import TrajectoryDataset
    from dporl.privacy.accountants import epsilon_for
    from dporl.privacy.events import PoissonGaussianEvent

    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores")
    with tempfile.TemporaryDirectory() as tmp:
        bomb = Path(tmp) / "bomb.npz"
        write_bomb(bomb, inflated)
        print(f"npz bomb: {bomb.stat().st_size / MIB:.2f} MiB on disk, {inflated / MIB:.0f} MiB inflated")

        def inflate_first():
            with np.load(bomb, allow_pickle=False) as archive:
                archive["observations"]

        rows = {"bomb: inflate first (baseline)": [], "bomb: TrajectoryDataset.load (candidate)": [],
                "pld sigma 0.05: dp_accounting (baseline)": [], "pld sigma 0.05: epsilon_for (candidate)": []}
        for mechanism in ("pld", "rdp"):  # imports outside the measurement
            epsilon_for([(PoissonGaussianEvent(1.0, 0.25), 2)], 1e-5, mechanism)
        for _ in range(repeats):
            rows["bomb: inflate first (baseline)"].append(measure(inflate_first))
            rows["bomb: TrajectoryDataset.load (candidate)"].append(measure(lambda: TrajectoryDataset.load(bomb)))
            rows["pld sigma 0.05: dp_accounting (baseline)"].append(measure(lambda: pld_baseline(0.05, 0.25, 60, 1e-5)))
            rows["pld sigma 0.05: epsilon_for (candidate)"].append(measure(lambda: uncached_epsilon(0.05, 0.25, 60)))
    medians = {name: (statistics.median(t for t, _ in values), statistics.median(p for _, p in values))
               for name, values in rows.items()}
    for name, (seconds, peak) in medians.items():
        print(f"{name:45s} {seconds:8.3f} s  peak {peak / MIB:8.1f} MiB")
    names = list(medians)
    for baseline, candidate in (names[0:2], names[2:4]):
        (t0, p0), (t1, p1) = medians[baseline], medians[candidate]
        print(f"ratio baseline / candidate ({baseline.split(':')[0]}): time {t0 / t1:.0f}x, peak allocation "
              f"{p0 / max(p1, 1):.0f}x")


if __name__ == "__main__":
    main()
