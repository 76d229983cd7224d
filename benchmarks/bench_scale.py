"""Data at scale: building the training path against ``np.load``, its peak memory, and the Poisson sampler.

Three measurements, each a ratio taken in one run with the two sides interleaved (the machine is shared):

1. **Build time** (fresh child processes, rounds alternate): the expert source (``TrajectoryDataset.load`` + the
   per-step sampler over the CQL columns) and the views (``transitions()``, ``unit_episode_index()``) against a
   bare ``np.load`` that reads every member of the same file. Data: CartPole-shaped episodes (obs 4, 2 actions,
   lengths 1..200, 20 episodes per expert) with behaviour log-probs.
2. **Peak memory** of the training path in a fresh process: peak RSS (``VmHWM``, the per-process ``ru_maxrss``)
   after load + expert source + 20 sampled steps, minus the peak after importing torch and dporl in that process,
   over the bytes of the raw arrays.
   With ``--mmap`` the same path on a memory-mapped load (pages of the file count in RSS but are the page cache's:
   ``RssAnon`` is the process's own memory).
3. **Sampler** ms per step at 1e5 and 1e6 units (expected batch 256, one row per unit): the Bernoulli mask over all
   units (``rand(m) < q``: what the sampler did before geometric gaps) against ``PoissonUnitSource.sample``.

    python benchmarks/bench_scale.py                       # 1e6 and 1e7 transitions, sampler at 1e5 / 1e6 units
    python benchmarks/bench_scale.py --sizes 1e6 --rounds 1 # quick
    python benchmarks/bench_scale.py --against /work/main  # also before/after against another checkout
    python benchmarks/bench_scale.py --sizes 1e8 --mapped-only --skip-sampler --dir DIR   # 3.4 GB on disk, mapped
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ARRAYS = ("observations", "actions", "rewards", "terminations", "truncations", "episode_lengths", "unit_ids",
          "start_steps", "behavior_log_probs")
PER_EXPERT, MEAN_LENGTH, BATCH, ROWS_PER_EXPERT = 20, 100.5, 256, 2


# ------------------------------------------------------------------------------------------ data on disk
def write_dataset(path: Path, n_transitions: float, seed: int = 0) -> dict:
    """A CartPole-shaped dataset of about ``n_transitions`` transitions, written chunk by chunk (never whole in RAM)
    through ``dporl.data.dataset.write_npz_members`` (or ``np.savez`` on older trees)."""
    rng = np.random.default_rng(seed)
    n_units = max(1, int(round(n_transitions / (PER_EXPERT * MEAN_LENGTH))))
    n_episodes = n_units * PER_EXPERT
    lengths = rng.integers(1, 201, n_episodes)
    n = int(lengths.sum())
    work = path.parent / (path.name + ".parts")
    work.mkdir(exist_ok=True)

    def column(name, shape, dtype):
        return np.lib.format.open_memmap(work / f"{name}.npy", mode="w+", dtype=dtype, shape=shape)

    obs = column("observations", (n + n_episodes, 4), np.float32)
    actions = column("actions", (n,), np.int64)
    rewards = column("rewards", (n,), np.float32)
    terminations = column("terminations", (n,), np.bool_)
    truncations = column("truncations", (n,), np.bool_)
    log_probs = column("behavior_log_probs", (n,), np.float32)
    chunk = 1 << 22
    for lo in range(0, n + n_episodes, chunk):
        hi = min(lo + chunk, n + n_episodes)
        obs[lo:hi] = rng.standard_normal((hi - lo, 4), dtype=np.float32)
    for lo in range(0, n, chunk):
        hi = min(lo + chunk, n)
        actions[lo:hi] = rng.integers(0, 2, hi - lo)
        rewards[lo:hi] = 1.0
        log_probs[lo:hi] = np.log(rng.uniform(0.05, 0.95, hi - lo))
    terminations[:] = False
    truncations[:] = False
    last = np.cumsum(lengths) - 1
    terminations[last] = lengths < 200
    truncations[last] = lengths == 200
    meta = {"env_id": "CartPole-v1", "n_actions": 2, "n_units": n_units, "obs_shape": [4], "env_params": {},
            "p_min": 0.05, "seed": None, "expert_set": None, "extra": {}, "unit_column": None, "unit_keys": None}
    members = {
        "format_version": np.array(2, dtype=np.int64),
        "metadata": np.array(json.dumps(meta, sort_keys=True)),
        "observations": obs, "actions": actions, "rewards": rewards, "terminations": terminations,
        "truncations": truncations, "episode_lengths": lengths.astype(np.int64),
        "unit_ids": np.repeat(np.arange(n_units, dtype=np.int64), PER_EXPERT),
        "start_steps": np.zeros(n_episodes, dtype=np.int64), "behavior_log_probs": log_probs,
    }
    try:
        from dporl.data.dataset import write_npz_members
    except ImportError:  # a tree without the aligned writer
        with open(path, "wb") as handle:
            np.savez(handle, **members)
    else:
        with open(path, "wb") as handle:
            write_npz_members(handle, members)
    raw = sum(int(members[k].nbytes) for k in ARRAYS)
    del obs, actions, rewards, terminations, truncations, log_probs, members
    for part in work.iterdir():
        part.unlink()
    work.rmdir()
    return {"n_transitions": n, "n_episodes": n_episodes, "n_units": n_units, "raw_bytes": raw}


# ------------------------------------------------------------------------------------------ child processes
def _maxrss() -> int:
    """This process image's peak RSS (``VmHWM``: unlike ``ru_maxrss`` it does not inherit the forking parent's)."""
    return _status("VmHWM") or resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _status(key: str) -> int:
    with open("/proc/self/status") as handle:
        for line in handle:
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    return 0


def child(kind: str, path: str, mmap: bool) -> dict:
    import torch

    torch.set_num_threads(1)
    from dporl.algos.expert_sources import expert_source
    from dporl.privacy.count import WHOLE, Units
    from dporl.data import TrajectoryDataset

    baseline = _maxrss()
    out: dict = {"baseline_rss": baseline, "baseline_anon": _status("RssAnon")}
    start = time.perf_counter()
    if kind == "np_load":
        with np.load(path, allow_pickle=False) as archive:
            arrays = {k: archive[k] for k in archive.files}
        out["seconds"] = time.perf_counter() - start
        out["raw_bytes"] = sum(int(arrays[k].nbytes) for k in ARRAYS)
    elif kind == "train":
        dataset = TrajectoryDataset.load(path, mmap=True) if mmap else TrajectoryDataset.load(path)
        out["load"] = time.perf_counter() - start
        start = time.perf_counter()
        m = dataset.metadata.n_units
        source = expert_source(dataset, min(BATCH, m / 2), ROWS_PER_EXPERT, Units.public({WHOLE: m}))
        out["source"] = time.perf_counter() - start
        generator = torch.Generator().manual_seed(0)
        start = time.perf_counter()
        rows = 0
        for _ in range(20):
            rows += source.sample(generator).n_rows
        out["sample_ms"] = (time.perf_counter() - start) / 20 * 1e3
        out["rows"] = rows
        out["held_rss"] = _status("VmRSS")
        out["held_anon"] = _status("RssAnon")
    elif kind == "views":
        dataset = TrajectoryDataset.load(path)
        start = time.perf_counter()
        dataset.transitions()
        out["transitions"] = time.perf_counter() - start
        start = time.perf_counter()
        dataset.unit_episode_index()
        out["episode_index"] = time.perf_counter() - start
    out["peak_rss"] = _maxrss()
    return out


def run_child(kind: str, path: Path, mmap: bool = False, tree: str | None = None) -> dict:
    """``child(kind, path)`` in a fresh interpreter; ``tree``: import dporl from that checkout instead."""
    command = [sys.executable, __file__, "--child", kind, str(path)] + (["--mmap"] if mmap else [])
    env = dict(os.environ, PYTHONPATH=tree) if tree else None
    result = subprocess.run(command, capture_output=True, text=True, check=False, env=env)
    if result.returncode:
        raise RuntimeError(f"child {kind} failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])


def bench_against_tree(path: Path, info: dict, rounds: int, tree: str) -> None:
    """The same children with dporl imported from ``tree`` (e.g. the main branch) and from this checkout,
    interleaved: the before/after ratios of one run."""
    raw = info["raw_bytes"]
    print(f"\n{info['n_transitions']:.3g} transitions: this checkout ('new') against {tree} ('old'), interleaved")
    ratios = []
    for r in range(rounds):
        bare = run_child("np_load", path)
        old, new = run_child("train", path, tree=tree), run_child("train", path)
        old_views, new_views = (run_child("views", path, tree=tree), run_child("views", path)) \
            if info["n_transitions"] <= 2e7 else (None, None)
        t0 = bare["seconds"]

        def build(t):
            return (t["load"] + t["source"]) / t0

        def peak(t):
            return (t["peak_rss"] - t["baseline_rss"]) / raw

        line = (f"  round {r}: np.load {t0:.3f} s | load + expert source: old {build(old):.2f}x, new {build(new):.2f}x"
                f" np.load (expert source alone: old {old['source']:.3f} s, new {new['source']:.4f} s) | peak RSS: "
                f"old {peak(old):.2f}x, new {peak(new):.2f}x raw | step: old {old['sample_ms']:.3f} ms, new "
                f"{new['sample_ms']:.3f} ms")
        if old_views:
            line += (f"\n           transitions(): old {old_views['transitions'] / t0:.2f}x, new "
                     f"{new_views['transitions'] / t0:.2f}x np.load | unit_episode_index(): old "
                     f"{old_views['episode_index'] * 1e3:.2f} ms, new {new_views['episode_index'] * 1e3:.2f} ms")
        print(line, flush=True)
        ratios.append((build(old), build(new), peak(old), peak(new)))
    med = np.median(np.array(ratios), axis=0)
    print(f"  median: load + expert source old {med[0]:.2f}x -> new {med[1]:.2f}x np.load; peak RSS old "
          f"{med[2]:.2f}x -> new {med[3]:.2f}x raw")


def bench_build(path: Path, info: dict, rounds: int, mmap: bool) -> None:
    raw = info["raw_bytes"]
    print(f"\n{info['n_transitions']:.3g} transitions, {info['n_episodes']} episodes, {info['n_units']} units; "
          f"raw arrays {raw / 2**20:.0f} MiB; file {path.stat().st_size / 2**20:.0f} MiB (times in s; x = / np.load)")
    rows = []
    for r in range(rounds):
        bare = run_child("np_load", path)
        train = run_child("train", path)
        # transitions() copies every column (~2.5x the raw bytes): measured up to 2e7 transitions only.
        views = run_child("views", path) if info["n_transitions"] <= 2e7 else None
        mapped = run_child("train", path, mmap=True) if mmap else None
        rows.append((bare, train, views, mapped))
        t0 = bare["seconds"]
        line = (f"  round {r}: np.load {t0:.3f} | load+validate {train['load']:.3f} ({train['load'] / t0:.2f}x) | "
                f"expert source {train['source']:.4f} ({train['source'] / t0:.3f}x) | peak RSS "
                f"{(train['peak_rss'] - train['baseline_rss']) / raw:.2f}x raw, held "
                f"{(train['held_rss'] - train['baseline_rss']) / raw:.2f}x | step {train['sample_ms']:.3f} ms")
        if views:
            line += (f"\n           transitions() {views['transitions']:.3f} ({views['transitions'] / t0:.2f}x) | "
                     f"unit_episode_index() {views['episode_index'] * 1e3:.2f} ms")
        if mapped:
            line += (f"\n           mapped: load+validate {mapped['load']:.3f} ({mapped['load'] / t0:.2f}x) | "
                     f"expert source {mapped['source']:.4f} | own memory (RssAnon) held "
                     f"{(mapped['held_anon'] - mapped['baseline_anon']) / 2**20:.0f} MiB | step "
                     f"{mapped['sample_ms']:.3f} ms")
        print(line, flush=True)
    def med(ratio) -> float:
        return float(np.median([ratio(*row) for row in rows]))

    summary = (f"  median over rounds: load + expert source "
               f"{med(lambda b, t, v, m: (t['load'] + t['source']) / b['seconds']):.2f}x np.load (expert source "
               f"alone {med(lambda b, t, v, m: t['source'] / b['seconds']):.3f}x); peak RSS "
               f"{med(lambda b, t, v, m: (t['peak_rss'] - t['baseline_rss']) / raw):.2f}x raw")
    if rows[0][2]:
        summary += f"; transitions() {med(lambda b, t, v, m: v['transitions'] / b['seconds']):.2f}x np.load"
    if mmap:
        summary += f"; mapped load + source {med(lambda b, t, v, m: (m['load'] + m['source']) / b['seconds']):.2f}x"
    print(summary)


def bench_mapped_only(path: Path, info: dict) -> None:
    print(f"\n{info['n_transitions']:.3g} transitions on disk ({path.stat().st_size / 2**30:.2f} GiB), mapped only")
    mapped = run_child("train", path, mmap=True)
    print(f"  load+validate {mapped['load']:.1f} s | expert source {mapped['source']:.3f} s | own memory (RssAnon) "
          f"held {(mapped['held_anon'] - mapped['baseline_anon']) / 2**20:.0f} MiB | step {mapped['sample_ms']:.3f} ms "
          f"| rows sampled in 20 steps {mapped['rows']}")


# ------------------------------------------------------------------------------------------ sampler
class BernoulliMaskSampler:
    """The sampler before geometric gaps (reference baseline): a float32 uniform per unit compared with q, rows
    grouped by a stable argsort of every row's unit, float32 row draws."""

    def __init__(self, data, unit_of_row, n_units, rate, rows_per_unit):
        import torch

        self.data, self.n_units, self.rate, self.rows_per_unit = data, n_units, rate, rows_per_unit
        self.order = torch.argsort(unit_of_row, stable=True)
        self.counts = torch.bincount(unit_of_row, minlength=n_units)
        self.offsets = torch.cumsum(self.counts, 0) - self.counts

    def sample_units(self, generator):
        import torch

        return torch.nonzero(torch.rand(self.n_units, generator=generator) < self.rate).squeeze(1)

    def sample(self, generator):
        import torch

        units = self.sample_units(generator)
        counts = self.counts[units]
        position = torch.nonzero(counts > 0).squeeze(1).repeat_interleave(self.rows_per_unit)
        draws = torch.rand(len(position), generator=generator)
        within = (draws * counts[position]).long().clamp_max(counts[position] - 1)
        rows = self.order[self.offsets[units[position]] + within]
        return {k: v.index_select(0, rows) for k, v in self.data.items()}, position


def bench_sampler(rounds: int) -> None:
    import torch

    from dporl.privacy.samplers import PoissonUnitSource

    torch.set_num_threads(1)
    print("\nPoisson sampler: expected batch 256 units, 1 row per unit, 4 rows per unit; ms per step, interleaved "
          "(median of rounds)")
    for m, layout in ((100_000, "contiguous"), (1_000_000, "contiguous"), (1_000_000, "interleaved")):
        q = BATCH / m
        unit_of_row = torch.arange(m).repeat_interleave(4)
        if layout == "interleaved":  # rows of a unit scattered: the index's binary-search path
            unit_of_row = unit_of_row[torch.randperm(len(unit_of_row), generator=torch.Generator().manual_seed(0))]
        data = {"x": torch.zeros(len(unit_of_row), 4)}
        new = PoissonUnitSource(data, unit_of_row, m, q, rows_per_unit=1)
        old = BernoulliMaskSampler(data, unit_of_row, m, q, 1)
        g_old, g_new = torch.Generator().manual_seed(0), torch.Generator().manual_seed(0)

        def timed(fn, n=200):
            start = time.perf_counter()
            for _ in range(n):
                fn()
            return (time.perf_counter() - start) / n * 1e3

        times = {k: [] for k in ("old_units", "new_units", "old_step", "new_step")}
        for _ in range(rounds):
            times["old_units"].append(timed(lambda: old.sample_units(g_old)))
            times["new_units"].append(timed(lambda: new.sample_units(g_new)))
            times["old_step"].append(timed(lambda: old.sample(g_old)))
            times["new_step"].append(timed(lambda: new.sample(g_new)))
        t = {k: float(np.median(v)) for k, v in times.items()}
        print(f"  m = {m:>9,} ({layout:>11}): units: Bernoulli mask {t['old_units']:.3f} ms, geometric gaps "
              f"{t['new_units']:.4f} ms ({t['old_units'] / t['new_units']:.0f}x) | whole step with row gather: "
              f"{t['old_step']:.3f} ms vs {t['new_step']:.4f} ms ({t['old_step'] / t['new_step']:.0f}x)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", nargs="*", type=float, default=[1e6, 1e7])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--mmap", action="store_true", help="also time the memory-mapped load")
    parser.add_argument("--mapped-only", action="store_true", help="only the mapped path (data larger than RAM)")
    parser.add_argument("--skip-sampler", action="store_true")
    parser.add_argument("--dir", default=None, help="where to write the datasets (default: a temporary directory)")
    parser.add_argument("--against", default=None, metavar="TREE",
                        help="also run the build children with dporl from TREE (e.g. /work/main), interleaved")
    parser.add_argument("--child", nargs=2, metavar=("KIND", "PATH"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(args.child[0], args.child[1], args.mmap)))
        return
    print(f"load average at start: {os.getloadavg()}")
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        for size in args.sizes:
            path = Path(tmp) / f"scale_{size:.0e}.npz"
            start = time.perf_counter()
            info = write_dataset(path, size)
            print(f"(wrote {path.name} in {time.perf_counter() - start:.1f} s)")
            if args.mapped_only:
                bench_mapped_only(path, info)
            else:
                bench_build(path, info, args.rounds, args.mmap)
            if args.against:
                bench_against_tree(path, info, args.rounds, args.against)
            path.unlink()
    if not args.skip_sampler:
        bench_sampler(args.rounds)
    print(f"load average at end: {os.getloadavg()}")


if __name__ == "__main__":
    main()
