"""read_table on a large numeric Parquet file against the bare read of the same file, measured in one run.

The table: N rows of logged decisions (episode, unit, step, 4 observation columns, action, reward, terminated,
propensity), episodes of 1..200 rows, 1 in 5 ending truncated (their last step is dropped: no next-state columns),
units owning several episodes. Baseline: ``pyarrow.parquet.read_table(path).to_pandas()``, the bare read of every
column into a DataFrame. Candidate: ``dporl.data.table.read_table(path, ...)`` (read, validate, build the dataset).
Baseline and candidate are interleaved, each repeated; medians are reported with the ratio candidate / baseline
(the target: <= 2).

    python benchmarks/bench_table.py            # 10M rows
    python benchmarks/bench_table.py --quick    # 200k rows, seconds
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import numpy as np
import torch


def write_table(path: Path, n_rows: int, rng: np.random.Generator) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    lengths = rng.integers(1, 201, n_rows // 100 + 2)
    lengths = lengths[: np.searchsorted(np.cumsum(lengths), n_rows) + 1]
    lengths[-1] -= int(lengths.sum()) - n_rows
    lengths = lengths[lengths > 0]
    n_episodes = len(lengths)
    episode = np.repeat(np.arange(n_episodes, dtype=np.int64), lengths)
    starts = np.cumsum(lengths) - lengths
    step = np.arange(n_rows, dtype=np.int64) - np.repeat(starts, lengths)
    truncated_episode = (rng.random(n_episodes) < 0.2) & (lengths > 1)
    last = np.cumsum(lengths) - 1
    terminated = np.zeros(n_rows, dtype=bool)
    terminated[last[~truncated_episode]] = True
    columns = {
        "episode": episode,
        "unit": np.repeat(np.arange(n_episodes, dtype=np.int64) // 5, lengths),
        "step": step,
        **{f"obs_{j}": rng.normal(size=n_rows).astype(np.float32) for j in range(4)},
        "action": rng.integers(0, 3, n_rows),
        "reward": rng.normal(size=n_rows).astype(np.float32),
        "terminated": terminated,
        "propensity": rng.uniform(0.05, 1.0, n_rows).astype(np.float32),
    }
    pq.write_table(pa.table(columns), path)


def baseline(path: Path):
    import pyarrow.parquet as pq

    return pq.read_table(path).to_pandas()


def candidate(path: Path):
    from dporl.data.table import read_table

    return read_table(path, episode="episode", unit="unit", observations="obs_", action="action", actions=3,
                      reward="reward", step="step", terminated="terminated", propensity="propensity")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=10_000_000)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="200k rows, 3 repeats")
    args = parser.parse_args()
    if args.quick:
        args.rows, args.repeats = 200_000, 3
    torch.set_num_threads(1)
    import pyarrow

    pyarrow.set_cpu_count(1)  # the same single thread for both sides
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "log.parquet"
        write_table(path, args.rows, np.random.default_rng(0))
        dataset = candidate(path)  # warm-up (imports) and a correctness check
        frame = baseline(path)
        assert dataset.n_transitions + dataset.metadata.extra["import"]["dropped_truncated_steps"] == len(frame)
        times = {"baseline": [], "candidate": []}
        for _ in range(args.repeats):
            for name, fn in (("baseline", baseline), ("candidate", candidate)):
                start = time.perf_counter()
                result = fn(path)
                times[name].append(time.perf_counter() - start)
                del result
    base, cand = statistics.median(times["baseline"]), statistics.median(times["candidate"])
    size = f"{args.rows / 1e6:g}M rows ({dataset.n_episodes} episodes, {dataset.n_units} units)"
    print(f"{size}: bare pyarrow read {base:.3f} s, read_table {cand:.3f} s (medians of {args.repeats}, interleaved)")
    print(f"ratio read_table / bare read: {cand / base:.2f} (target <= 2)")


if __name__ == "__main__":
    main()
