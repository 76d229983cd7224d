"""Stable-prefix release throughput (expert-state evaluations per second) vs the bare batched matmuls it contains.

Setup: m stacked MLP experts (CartPole-sized: 4 -> hidden -> 2 actions, tanh), p_min-softened by argmax, that mostly
agree, so prefixes run long; 2 logged trajectories of 200 steps each; T runs. The release is timed end to end
(trajectory choice, padding, log-prob queries in expert chunks, logsumexp, Laplace noise, comparisons, building
D_stable / D_unstable). The baseline replays exactly the same sequence of query shapes ([n states] x m experts per
call) through the policy's raw forward pass (einsum + baddbmm), with nothing else, in the same process.

    python benchmarks/bench_stable_prefix.py            # m = 3000 experts (the paper), hidden 64 x 64, T = 25
    python benchmarks/bench_stable_prefix.py --quick    # smoke test (seconds)
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np
import torch

from dporl.algos.stable_prefix import StablePrefixConfig, release_stable_prefixes
from dporl.data.dataset import DatasetMetadata, TrajectoryDataset
from dporl.experts.expert_set import ExpertSet
from dporl.experts.policies import StackedMLPPolicy
from dporl.privacy.noise import NoiseSource
from dporl.privacy.sparse_vector import stable_prefix_budget

OBS_DIM, N_ACTIONS, P_MIN, LENGTH = 4, 2, 0.01, 200


def make_world(m: int, hidden: list[int], seed: int) -> tuple[ExpertSet, TrajectoryDataset]:
    """Experts = one random MLP + small per-expert perturbations; each logs 2 episodes of its own best actions."""
    g = torch.Generator().manual_seed(seed)
    policy = StackedMLPPolicy(m, OBS_DIM, N_ACTIONS, hidden)
    with torch.no_grad():
        for param in policy.parameters():
            shared = torch.randn(param.shape[1:], generator=g) / max(1, param.shape[1]) ** 0.5
            param.copy_(shared + 0.05 * torch.randn(param.shape, generator=g) / max(1, param.shape[1]) ** 0.5)
    experts = ExpertSet(policy, P_MIN, "argmax")
    per_expert = 2
    obs = torch.randn(m, per_expert * (LENGTH + 1), OBS_DIM, generator=g)
    actions = experts.log_probs_paired(obs).argmax(-1).view(m, per_expert, LENGTH + 1)[:, :, :LENGTH]
    n_episodes = m * per_expert
    metadata = DatasetMetadata(
        env_id="bench", n_actions=N_ACTIONS, n_experts=m, obs_shape=(OBS_DIM,), p_min=P_MIN,
        expert_set=experts.reference(),
    )
    terminations = np.zeros(n_episodes * LENGTH, dtype=bool)
    terminations[LENGTH - 1 :: LENGTH] = True
    dataset = TrajectoryDataset(
        observations=obs.reshape(-1, OBS_DIM).numpy(),
        actions=actions.reshape(-1).numpy(),
        rewards=np.ones(n_episodes * LENGTH, dtype=np.float32),
        terminations=terminations,
        truncations=np.zeros(n_episodes * LENGTH, dtype=bool),
        episode_lengths=np.full(n_episodes, LENGTH),
        expert_ids=np.repeat(np.arange(m), per_expert),
        metadata=metadata,
    )
    return experts, dataset


class ShapeRecorder(ExpertSet):
    """The same experts, recording the number of states of every query (to replay them in the baseline)."""

    def __init__(self, experts: ExpertSet):
        super().__init__(experts.policy, experts.p_min, experts.softening)
        self.calls: list[tuple[int, slice]] = []

    def log_prob_of(self, states, actions, experts=None):
        self.calls.append((int(states.shape[0]), experts))
        return super().log_prob_of(states, actions, experts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--experts", type=int, default=None)
    parser.add_argument("--hidden", type=int, nargs="+", default=[64, 64])
    parser.add_argument("--trajectories", type=int, default=None)
    parser.add_argument("--epsilon", type=float, default=10.0)
    parser.add_argument("--expert-chunk", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--repeats", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    m = args.experts or (1000 if args.quick else 3000)
    runs = args.trajectories or (10 if args.quick else 25)
    repeats = args.repeats or (2 if args.quick else 5)
    experts, dataset = make_world(m, args.hidden, seed=0)
    recorder = ShapeRecorder(experts)
    config = StablePrefixConfig(trajectories=runs, expert_chunk=args.expert_chunk, check_expert_set_hash=False)

    def release():
        recorder.calls.clear()
        return release_stable_prefixes(
            dataset, recorder, epsilon=args.epsilon, delta=1e-5, config=config, noise=NoiseSource(1),
            generator=torch.Generator().manual_seed(1),
        )

    release_times, out = [], None
    for _ in range(repeats + 1):  # first call warms up (and is discarded)
        start = time.perf_counter()
        out = release()
        release_times.append(time.perf_counter() - start)
    calls = list(recorder.calls)
    states = torch.randn(max(n for n, _ in calls), OBS_DIM)

    def baseline():
        for n, chunk in calls:
            experts.policy.forward_all(states[:n], experts=chunk)

    baseline_times = []
    for _ in range(repeats + 1):
        start = time.perf_counter()
        with torch.no_grad():
            baseline()
        baseline_times.append(time.perf_counter() - start)
    t_release, t_base = statistics.median(release_times[1:]), statistics.median(baseline_times[1:])
    start = time.perf_counter()  # the (eps', threshold) search inside every release: a fixed cost, not per state
    stable_prefix_budget(args.epsilon, 1e-5, runs, P_MIN, m)
    t_budget = time.perf_counter() - start
    evaluations = out.states_evaluated * m
    print(f"m={m} experts, hidden={args.hidden}, T={runs} runs, eps1={args.epsilon}, threads={args.threads}")
    print(f"threshold G={out.budget.threshold:.1f}, mean released prefix {out.prefix_lengths.mean():.1f} of {LENGTH}, "
          f"{out.states_evaluated} states shown in {len(calls)} expert-set calls")
    print(f"release : {t_release * 1e3:9.1f} ms  {evaluations / t_release:12.4g} expert-state evaluations/s "
          f"(of which {t_budget * 1e3:.0f} ms budget search)")
    print(f"baseline: {t_base * 1e3:9.1f} ms  {evaluations / t_base:12.4g} expert-state evaluations/s (forward only)")
    print(f"ratio release / bare batched matmul: {t_release / t_base:.2f}x "
          f"({(t_release - t_budget) / t_base:.2f}x without the budget search)")


if __name__ == "__main__":
    main()
