"""Stable-prefix release (fresh rollouts) vs the bare batched expert forward passes over the same states.

Setup: m stacked MLP experts (CartPole-sized: 4 -> hidden -> 2 actions, tanh) built to balance the pole: each
carries one of the analytic LQR controllers (``cartpole_lqr_experts``, varied gains) along a near-linear path
through its hidden layers, plus random hidden units of small output weight, so the experts mostly agree and
prefixes run long; p_min = 0.01 (argmax softening). The release is ``release_stable_prefixes`` end to end with T
runs in the public CartPole simulator: budget search, expert choice, one vector env of T copies, per step one
batched query of all m experts (in chunks) on the states of the runs still alive, action sampling from each run's
own expert, the stability queries, Laplace noise, comparisons, env steps, building D_stable. The baseline replays
exactly the states the release showed the experts, in the same chunks, through the policy's raw forward pass
(einsum + baddbmm) with nothing else. Rounds are interleaved (release r, then baseline on release r's states),
``torch.set_num_threads(1)``, medians over rounds; the first round warms up and is discarded.

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
from dporl.experts.analytic import cartpole_lqr_experts
from dporl.experts.expert_set import ExpertSet
from dporl.experts.policies import StackedMLPPolicy
from dporl.privacy.randomness import SecretRoot

OBS_DIM, N_ACTIONS, P_MIN, HORIZON = 4, 2, 0.01, 200
PATH_SCALE = 0.05  # the LQR signal rides through tanh at this scale (near-linear, sign preserved)


def make_experts(m: int, hidden: list[int], seed: int) -> ExpertSet:
    """MLP experts whose hidden unit 0 of every layer carries the LQR control signal u = -K s (see the module)."""
    g = torch.Generator().manual_seed(seed)
    settings = [{"gravity": float(x)} for x in np.linspace(8.75, 11.0, 10)]
    lqr, _ = cartpole_lqr_experts(settings, -(-m // len(settings)), seed=seed)
    gains = lqr.weight[:m, :, 1]  # [m, 4]: u = gains . s (logits u * [-1, +1])
    policy = StackedMLPPolicy(m, OBS_DIM, N_ACTIONS, hidden)
    sizes = [OBS_DIM, *hidden, N_ACTIONS]
    with torch.no_grad():
        for layer, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
            weight = torch.randn(m, fan_in, fan_out, generator=g) / fan_in**0.5
            if layer > 0:
                weight[:, 0, :] = 0.0  # the signal unit feeds only the next signal unit (or the logits)
            if layer == 0:
                weight[:, :, 0] = PATH_SCALE * gains
            elif layer < len(hidden):
                weight[:, :, 0] = 0.0
                weight[:, 0, 0] = 1.0
            else:
                weight *= 1e-3  # other hidden units barely move the logits
                weight[:, 0, :] = torch.tensor([-1.0, 1.0])
            policy.weights[layer].copy_(weight)
            policy.biases[layer].zero_()
    return ExpertSet(policy, P_MIN, "argmax")


def metadata_only_dataset(experts: ExpertSet) -> TrajectoryDataset:
    """The fresh release reads only the logged data's public metadata; one placeholder episode carries it."""
    metadata = DatasetMetadata(
        env_id="CartPole-v1", n_actions=N_ACTIONS, n_units=experts.n_experts, obs_shape=(OBS_DIM,), p_min=P_MIN,
        expert_set=experts.reference(), extra={"max_episode_steps": HORIZON},
    )
    return TrajectoryDataset(
        observations=np.zeros((2, OBS_DIM), dtype=np.float32), actions=np.zeros(1, dtype=np.int64),
        rewards=np.ones(1, dtype=np.float32), terminations=np.ones(1, dtype=bool), truncations=np.zeros(1, dtype=bool),
        episode_lengths=np.ones(1, dtype=np.int64), unit_ids=np.zeros(1, dtype=np.int64), metadata=metadata,
    )


class StateRecorder(ExpertSet):
    """The same experts, recording the states and expert chunk of every query (to replay them in the baseline)."""

    def __init__(self, experts: ExpertSet):
        super().__init__(experts.policy, experts.p_min, experts.softening)
        self.calls: list[tuple[torch.Tensor, object]] = []

    def log_probs(self, states, experts=None):
        self.calls.append((torch.as_tensor(states), experts))
        return super().log_probs(states, experts)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--experts", type=int, default=None)
    parser.add_argument("--hidden", type=int, nargs="+", default=[64, 64])
    parser.add_argument("--trajectories", type=int, default=None)
    parser.add_argument("--epsilon", type=float, default=10.0)
    parser.add_argument("--expert-chunk", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=None)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    m = args.experts or (1000 if args.quick else 3000)
    runs = args.trajectories or (10 if args.quick else 25)
    rounds = args.rounds or (2 if args.quick else 7)
    experts = make_experts(m, args.hidden, seed=0)
    recorder = StateRecorder(experts)
    dataset = metadata_only_dataset(experts)
    config = StablePrefixConfig(trajectories=runs, expert_chunk=args.expert_chunk)

    release_times, baseline_times, states_shown, lengths = [], [], [], []
    for round_ in range(rounds + 1):  # round 0 warms up (imports, the accountant's first PLD) and is discarded
        recorder.calls.clear()
        start = time.perf_counter()
        out = release_stable_prefixes(dataset, recorder, epsilon=args.epsilon, delta=1e-5, config=config,
                                      root=SecretRoot(round_))
        release_time = time.perf_counter() - start
        calls = list(recorder.calls)
        start = time.perf_counter()
        with torch.no_grad():
            for states, chunk in calls:
                experts.policy.forward_all(states, experts=chunk)
        baseline_time = time.perf_counter() - start
        if round_ > 0:
            release_times.append(release_time)
            baseline_times.append(baseline_time)
            states_shown.append(out.runs.states_evaluated)
            lengths.append(float(out.runs.lengths.mean()))
    t_release, t_base = statistics.median(release_times), statistics.median(baseline_times)
    ratios = [r / b for r, b in zip(release_times, baseline_times)]
    evaluations = statistics.median(states_shown) * m
    print(f"m={m} experts, hidden={args.hidden}, T={runs} runs in CartPole-v1 (H={HORIZON}), eps1={args.epsilon}, "
          f"p_min={P_MIN}, threads={args.threads}, {rounds} interleaved rounds")
    print(f"threshold G={out.budget.threshold:.1f}; per round: median {statistics.median(states_shown):.0f} states "
          f"shown to all experts, mean prefix length {statistics.median(lengths):.1f} of {HORIZON}")
    print(f"release : {t_release * 1e3:9.1f} ms  {evaluations / t_release:12.4g} expert-state evaluations/s (median)")
    print(f"baseline: {t_base * 1e3:9.1f} ms  {evaluations / t_base:12.4g} expert-state evaluations/s (forward only)")
    print(f"ratio release / bare batched forward passes: {t_release / t_base:.2f}x "
          f"(median of per-round ratios {statistics.median(ratios):.2f}x; target <= 1.5x)")


if __name__ == "__main__":
    main()
