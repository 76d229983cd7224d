"""TrajectoryDataset views and persistence against per-episode Python loops, measured in one run.

Data at the expert-level paper's shape: m experts x 20 CartPole trajectories (obs 4, 2 actions, lengths 1..200).
For each view the vectorised method is timed against the obvious loop over episodes that builds the same arrays
(checked equal), and save+load (with full validation) against a bare ``np.savez`` / ``np.load`` of the same
arrays. Prints the best of 3 runs in seconds and the speed-up (loop time / method time; > 1 means the method is faster).

    python benchmarks/bench_dataset.py            # 3000 experts (the paper's pool), about 60k episodes
    python benchmarks/bench_dataset.py --quick    # 100 experts, seconds
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from dporl.data import DatasetMetadata, TrajectoryDataset


def make_dataset(n_units: int, per_expert: int, rng: np.random.Generator) -> TrajectoryDataset:
    n_episodes = n_units * per_expert
    lengths = rng.integers(1, 201, n_episodes)
    n_transitions = int(lengths.sum())
    last = np.cumsum(lengths) - 1
    terminations = np.zeros(n_transitions, dtype=bool)
    terminations[last] = lengths < 200  # CartPole: a pole that fell terminates, length 200 is a time-limit cut
    truncations = np.zeros(n_transitions, dtype=bool)
    truncations[last] = lengths == 200
    return TrajectoryDataset(
        observations=rng.normal(size=(n_transitions + n_episodes, 4)).astype(np.float32),
        actions=rng.integers(0, 2, n_transitions),
        rewards=np.ones(n_transitions, dtype=np.float32),
        terminations=terminations,
        truncations=truncations,
        episode_lengths=lengths,
        unit_ids=np.repeat(np.arange(n_units), per_expert),
        behavior_log_probs=np.log(rng.uniform(0.05, 0.95, n_transitions)).astype(np.float32),
        metadata=DatasetMetadata("CartPole-v1", 2, n_units, (4,), p_min=0.05),
    )


def loop_transitions(data: TrajectoryDataset) -> dict[str, np.ndarray]:
    obs, next_obs, timesteps = [], [], []
    for e in range(data.n_episodes):
        episode_obs, _ = data.episode_observations_actions(e)
        obs.append(episode_obs[:-1])
        next_obs.append(episode_obs[1:])
        timesteps.append(np.arange(len(episode_obs) - 1))
    return {"obs": np.concatenate(obs), "next_obs": np.concatenate(next_obs), "timesteps": np.concatenate(timesteps)}


def loop_padded(data: TrajectoryDataset) -> torch.Tensor:
    width = int(data.episode_lengths.max())
    out = torch.zeros(data.n_episodes, width + 1, 4)
    for e in range(data.n_episodes):
        episode_obs, _ = data.episode_observations_actions(e)
        out[e, : len(episode_obs)] = torch.from_numpy(episode_obs)
    return out


def loop_prefixes(data: TrajectoryDataset, ids: np.ndarray, ends: np.ndarray) -> TrajectoryDataset:
    episodes = []
    for e, end in zip(ids, ends):
        episode = data.episode(int(e))
        cut = end < len(episode["actions"])
        episodes.append({
            **episode,
            "observations": episode["observations"][: end + 1],
            "actions": episode["actions"][:end],
            "rewards": episode["rewards"][:end],
            "behavior_log_probs": episode["behavior_log_probs"][:end],
            "terminated": episode["terminated"] and not cut,
            "truncated": episode["truncated"] or cut,
        })
    return TrajectoryDataset.from_episodes(episodes, data.metadata)


def loop_expert_index(data: TrajectoryDataset) -> list[list[int]]:
    groups: list[list[int]] = [[] for _ in range(data.metadata.n_units)]
    for e, expert in enumerate(data.unit_ids.tolist()):
        groups[expert].append(e)
    return groups


REPEATS = 3


def timed(fn):
    """Best of REPEATS runs (the machine is shared: the minimum is the least disturbed measurement)."""
    best = float("inf")
    for _ in range(REPEATS):
        start = time.perf_counter()
        result = fn()
        best = min(best, time.perf_counter() - start)
    return best, result


def report(name: str, method_s: float, baseline_s: float, baseline: str) -> None:
    print(f"{name:<22} {method_s:9.4f} s   {baseline:<26} {baseline_s:9.4f} s   speed-up {baseline_s / method_s:7.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--experts", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    n_units = args.experts or (100 if args.quick else 3000)
    rng = np.random.default_rng(0)
    data = make_dataset(n_units, 20, rng)
    print(f"{data}: {data.observations.nbytes / 2**20:.0f} MiB of observations")

    t_method, transitions = timed(data.transitions)
    t_loop, looped = timed(lambda: loop_transitions(data))
    assert all(np.array_equal(getattr(transitions, k), v) for k, v in looped.items())
    report("transitions()", t_method, t_loop, "per-episode loop")

    subset = rng.choice(data.n_episodes, size=min(data.n_episodes, 2048), replace=False)
    t_method, padded = timed(lambda: data.padded(subset))
    t_loop, looped_pad = timed(lambda: loop_padded(data.subset(subset)))
    assert torch.equal(padded.observations, looped_pad[:, : padded.observations.shape[1]])
    report(f"padded({len(subset)})", t_method, t_loop, "per-episode loop")

    ends = np.maximum(1, data.episode_lengths // 2)
    ids = np.arange(data.n_episodes)
    t_method, prefixes = timed(lambda: data.fragments(ids, np.zeros_like(ends), ends))
    t_loop, looped_prefixes = timed(lambda: loop_prefixes(data, ids, ends))
    assert np.array_equal(prefixes.truncations, looped_prefixes.truncations)
    assert np.array_equal(prefixes.observations, looped_prefixes.observations)
    report("fragments(prefixes)", t_method, t_loop, "per-episode from_episodes")

    t_method, (order, offsets) = timed(data.unit_episode_index)
    t_loop, groups = timed(lambda: loop_expert_index(data))
    assert order[offsets[7] : offsets[8]].tolist() == groups[7]
    report("unit_episode_index()", t_method, t_loop, "dict-of-lists loop")

    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "d.npz"
        t_method, loaded = timed(lambda: TrajectoryDataset.load(data.save(path)))
        assert np.array_equal(loaded.observations, data.observations)
        raw = Path(tmp) / "raw.npz"
        arrays = {k: getattr(data, k) for k in ("observations", "actions", "rewards", "terminations", "truncations",
                                               "episode_lengths", "unit_ids", "start_steps", "behavior_log_probs")}

        def bare_round_trip():
            np.savez(raw, **arrays)
            with np.load(raw) as archive:
                return {k: archive[k] for k in archive.files}

        t_loop, _ = timed(bare_round_trip)
        size = path.stat().st_size / 2**20
        print(f"{'save+load (validated)':<22} {t_method:9.4f} s   {'bare np.savez/np.load':<26} {t_loop:9.4f} s   "
              f"overhead {t_method / t_loop:5.2f}x   ({size:.0f} MiB, {size / t_method:.0f} MiB/s)")


if __name__ == "__main__":
    main()
