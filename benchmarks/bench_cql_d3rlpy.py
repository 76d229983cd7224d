"""Non-private discrete CQL updates per second: dporl against d3rlpy 2.x on the same setup, in one run.

Same problem on both sides: a 2 x 256 ReLU Q-network (d3rlpy: ``VectorEncoderFactory([256, 256])`` plus its
linear head), CartPole-sized transitions (4 observations, 2 actions; 100 000 random ones, identical on both sides),
batch 256, Adam at lr 1e-3, double-DQN target with a hard copy every 500 steps, Huber TD loss, alpha = 1, gamma
0.99, one torch thread. dporl runs its trainer's step (``build_optimizer``: fused Adam) in this process; d3rlpy runs
in a subprocess of another interpreter (d3rlpy pins gymnasium 1.0, so it is never a dependency of dporl:
install it in its own environment, e.g. ``python3 -m venv /work/venv-d3rlpy && /work/venv-d3rlpy/bin/pip install
torch d3rlpy``). Rounds alternate between the two sides so that machine load affects both, and each side
reports the CPU time of its own process (on a shared machine wall time also counts the neighbours' work).

Two measures per side:
- ``update``: one gradient update from a batch already in the library's own format (dporl ``Batch``; d3rlpy
  ``TransitionMiniBatch``, which its ``update`` converts to tensors as it does in training);
- ``sample + update``: drawing the batch from the library's own store first (dporl ``UniformBatchSource``;
  d3rlpy's ``ReplayBuffer.sample_transition_batch``), which is what a training loop does.

    python benchmarks/bench_cql_d3rlpy.py --d3rlpy-python /work/venv-d3rlpy/bin/python
    python benchmarks/bench_cql_d3rlpy.py --quick      # dporl side only when d3rlpy is not available
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time

OBS_DIM, N_ACTIONS, N_TRANSITIONS = 4, 2, 100_000
HIDDEN, BATCH, LR, GAMMA, ALPHA, TARGET_EVERY = [256, 256], 256, 1e-3, 0.99, 1.0, 500


def make_transitions():
    """The same random transitions on both sides (numpy, seed 0), float32 like d3rlpy's buffers."""
    import numpy as np

    rng = np.random.default_rng(0)
    obs = rng.standard_normal((N_TRANSITIONS + 1, OBS_DIM)).astype(np.float32)
    actions = rng.integers(0, N_ACTIONS, N_TRANSITIONS)
    rewards = rng.standard_normal(N_TRANSITIONS).astype(np.float32)
    terminals = np.zeros(N_TRANSITIONS, dtype=np.float32)
    terminals[999::1000] = 1.0  # episodes of 1000 steps
    return obs, actions, rewards, terminals


# ------------------------------------------------------------------------------------------------ d3rlpy side
def d3rlpy_worker() -> None:
    """Reads 'update N' / 'sample N' lines, runs N steps, answers seconds per step (JSON), until EOF."""
    channel = sys.stdout
    sys.stdout = sys.stderr  # d3rlpy's own log lines must not mix with the answers
    import torch

    import d3rlpy

    torch.set_num_threads(1)
    obs, actions, rewards, terminals = make_transitions()
    dataset = d3rlpy.dataset.MDPDataset(
        observations=obs[:-1], actions=actions.reshape(-1, 1), rewards=rewards.reshape(-1, 1), terminals=terminals,
    )
    config = d3rlpy.algos.DiscreteCQLConfig(
        batch_size=BATCH, learning_rate=LR, gamma=GAMMA, alpha=ALPHA, target_update_interval=TARGET_EVERY,
        encoder_factory=d3rlpy.models.VectorEncoderFactory(hidden_units=HIDDEN),
    )
    algo = config.create(device="cpu:0")
    algo.build_with_dataset(dataset)
    fixed = dataset.sample_transition_batch(BATCH)
    print(json.dumps({"ready": d3rlpy.__version__, "torch": torch.__version__}), file=channel, flush=True)
    for line in sys.stdin:
        kind, steps = line.split()
        start = time.process_time()
        for _ in range(int(steps)):
            algo.update(dataset.sample_transition_batch(BATCH) if kind == "sample" else fixed)
        print(json.dumps({"seconds": (time.process_time() - start) / int(steps)}), file=channel, flush=True)


class D3rlpySide:
    def __init__(self, python: str):
        self.process = subprocess.Popen(
            [python, __file__, "--worker"], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            text=True,
        )
        hello = self.process.stdout.readline()
        if not hello:
            raise RuntimeError(f"the d3rlpy worker under {python} did not start (is d3rlpy installed there?)")
        self.versions = json.loads(hello)

    def run(self, kind: str, steps: int) -> float:
        self.process.stdin.write(f"{kind} {steps}\n")
        self.process.stdin.flush()
        return json.loads(self.process.stdout.readline())["seconds"]

    def close(self) -> None:
        self.process.stdin.close()
        self.process.wait(timeout=60)


# ------------------------------------------------------------------------------------------------ dporl side
class DporlSide:
    def __init__(self):
        import torch

        from dporl.algos.cql import CQLConfig, DiscreteCQLModule
        from dporl.privacy.samplers import UniformBatchSource
        from dporl.train.config import OptimizerConfig
        from dporl.train.trainer import build_optimizer

        torch.set_num_threads(1)
        obs, actions, rewards, terminals = make_transitions()
        data = {
            "obs": torch.from_numpy(obs[:-1]), "actions": torch.from_numpy(actions),
            "rewards": torch.from_numpy(rewards), "next_obs": torch.from_numpy(obs[1:]),
            "terminated": torch.from_numpy(terminals).bool(),
        }
        self.source = UniformBatchSource(data, BATCH)
        self.generator = torch.Generator().manual_seed(0)
        self.model = DiscreteCQLModule(OBS_DIM, N_ACTIONS, CQLConfig(
            hidden_sizes=HIDDEN, gamma=GAMMA, alpha=ALPHA, td_loss="huber", target="double_dqn",
            target_update_every=TARGET_EVERY))
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = build_optimizer(params, OptimizerConfig(name="adam", lr=LR))
        self.fixed = self.source.sample(self.generator)
        self.step_count = 0

    def step(self, batch) -> None:
        """What ``Trainer._step`` does for a non-private batch (without its logging)."""
        self.optimizer.zero_grad(set_to_none=True)
        self.model.row_losses(batch).mean().backward()
        self.optimizer.step()
        self.step_count += 1
        self.model.on_step_end(self.step_count)

    def run(self, kind: str, steps: int) -> float:
        start = time.process_time()
        for _ in range(steps):
            self.step(self.source.sample(self.generator) if kind == "sample" else self.fixed)
        return (time.process_time() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--d3rlpy-python", default=None, help="interpreter with d3rlpy installed")
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--steps", type=int, default=None, help="updates per side per round")
    args = parser.parse_args()
    if args.worker:
        d3rlpy_worker()
        return
    rounds = args.rounds or (3 if args.quick else 15)
    steps = args.steps or (20 if args.quick else 200)
    import torch

    dporl_side = DporlSide()
    other = None
    if args.d3rlpy_python:
        other = D3rlpySide(args.d3rlpy_python)
    else:
        print("d3rlpy: no --d3rlpy-python given; timing the dporl side only (no ratio)")
    kinds = ("update", "sample")
    for kind in kinds:  # warm-up
        dporl_side.run(kind, 10)
        if other:
            other.run(kind, 10)
    times = {(side, kind): [] for side in ("dporl", "d3rlpy") for kind in kinds}
    for r in range(rounds):
        for kind in kinds:
            order = [("dporl", dporl_side), ("d3rlpy", other)] if r % 2 == 0 else [("d3rlpy", other), ("dporl", dporl_side)]
            for name, side in order:
                if side is not None:
                    times[(name, kind)].append(side.run(kind, steps))
    if other:
        other.close()
        print(f"d3rlpy {other.versions['ready']} (torch {other.versions['torch']}) vs dporl (torch {torch.__version__}); "
              f"2x256 MLP, batch {BATCH}, 1 thread, {rounds} alternating rounds of {steps} updates")
    print(f"{'measure':18s} {'dporl updates/s':>16s} {'d3rlpy updates/s':>17s} {'dporl / d3rlpy (median, min-max)':>36s}")
    for kind, label in zip(kinds, ("update", "sample + update")):
        ours = times[("dporl", kind)]
        line = f"{label:18s} {1 / statistics.median(ours):16.0f}"
        if other:
            theirs = times[("d3rlpy", kind)]
            ratios = [t / o for o, t in zip(ours, theirs)]
            line += (f" {1 / statistics.median(theirs):17.0f} {statistics.median(ratios):20.2f}x "
                     f"({min(ratios):.2f}-{max(ratios):.2f})")
        print(line)


if __name__ == "__main__":
    main()
