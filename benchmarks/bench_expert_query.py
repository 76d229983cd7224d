#!/usr/bin/env python
"""Expert-query throughput: ExpertSet.log_probs (all experts x a batch of states, p_min-softened log-probs) against a
plain batched matmul of the same layer sizes (einsum for the shared-state first layer, baddbmm + activation for the
rest, raw logits, no softening) measured in the same run.

    python benchmarks/bench_expert_query.py [--quick] [--threads 1]

Prints (states x experts) per second for both and the ratio ExpertSet / plain (1.0 = no overhead).
"""

from __future__ import annotations

import argparse
import time

import torch

from dporl.experts import ExpertSet, StackedLinearPolicy, StackedMLPPolicy

# (name, family, hidden sizes, obs_dim, n_actions, n_experts, batch); quick runs shrink n_experts and batch.
CASES = [
    ("analytic linear, CartPole", "linear", [], 4, 2, 3000, 1024),
    ("PPO MLP 64x64, CartPole", "mlp", [64, 64], 4, 2, 3000, 256),
    ("paper MLP 512-256-64, LunarLander", "mlp", [512, 256, 64], 8, 4, 1000, 64),
]


def _policy(family: str, hidden: list[int], obs_dim: int, n_actions: int, n_experts: int):
    generator = torch.Generator().manual_seed(0)
    policy = (StackedLinearPolicy(n_experts, obs_dim, n_actions) if family == "linear"
              else StackedMLPPolicy(n_experts, obs_dim, n_actions, hidden, "relu"))
    with torch.no_grad():
        for parameter in policy.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)
    return policy


def _plain(policy, states: torch.Tensor) -> torch.Tensor:
    """The same arithmetic written directly: what any batched implementation has to pay."""
    if isinstance(policy, StackedLinearPolicy):
        return torch.einsum("bd,mda->mba", states, policy.weight) + policy.bias.unsqueeze(1)
    hidden = torch.einsum("bd,mdh->mbh", states, policy.weights[0]) + policy.biases[0].unsqueeze(1)
    for weight, bias in zip(list(policy.weights)[1:], list(policy.biases)[1:]):
        hidden = torch.baddbmm(bias.unsqueeze(1), torch.relu(hidden), weight)
    return hidden


def _time(fn, repeats: int) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small sizes, few repeats (seconds)")
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    repeats = 3 if args.quick else 7
    print(f"{'case':36s} {'experts':>7s} {'states':>6s} {'ExpertSet/s':>12s} {'plain/s':>12s} {'ratio':>6s}")
    for name, family, hidden, obs_dim, n_actions, n_experts, batch in CASES:
        if args.quick:
            n_experts, batch = n_experts // 10, max(batch // 4, 16)
        policy = _policy(family, hidden, obs_dim, n_actions, n_experts)
        experts = ExpertSet(policy, p_min=0.5 / n_actions / 2)
        states = torch.randn(batch, obs_dim, generator=torch.Generator().manual_seed(1))
        with torch.no_grad():
            expert_time = _time(lambda: experts.log_probs(states), repeats)
            plain_time = _time(lambda: _plain(policy, states), repeats)
        queries = n_experts * batch
        print(f"{name:36s} {n_experts:7d} {batch:6d} {queries / expert_time:12.3e} {queries / plain_time:12.3e} "
              f"{plain_time / expert_time:6.2f}")
    print("ratio = ExpertSet throughput / plain batched matmul throughput (same shapes, same run; best of "
          f"{repeats}, {args.threads} thread(s))")


if __name__ == "__main__":
    main()
