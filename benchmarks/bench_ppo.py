"""PPO experts per minute: one batched model (dporl.experts.batched_ppo) vs one process per expert (ppo.train_ppo).

Two measurements, each on this machine (2 cores, shared: the load average is printed before and after):

1. Throughput, same PPO settings on both sides (the CartPole dataset config's network and hyper-parameters, a short
   ``--timesteps`` budget so one round takes seconds; both paths are linear in it). Rounds interleave the two paths so
   load hits both; medians over rounds.
   - per core: ``train_ppo`` one expert after another in this process vs ``train_ppo_batched`` on E experts, both
     with one torch thread; the ratio is the speed-up per core;
   - on ``--cores`` cores: the old path's layout (one single-threaded process per expert, ``--cores`` of them in
     parallel, as its Ray tasks ran) vs ``--cores`` single-threaded processes each training a share of the batch
     as one model (generate's Ray chunks; threads that wait for each other at every matmul lose on a shared machine).
   The first experts of each batched round are checked equal to their per-expert runs (same seeds, same updates):
   both sides produce the same experts.
2. Time to 3000 CartPole experts: the full ``configs/dataset_cartpole_ppo.yaml`` expert generation (1000 physics
   settings x 4 candidates, best 3 kept by greedy return on the setting) with chunks of 500 candidates on a local
   Ray instance of ``--cores`` CPUs (one single-threaded chunk per core), wall clock and load.

    python benchmarks/bench_ppo.py                 # both (about 30 min on two idle cores)
    python benchmarks/bench_ppo.py --skip-3000     # throughput only (a few minutes)
    python benchmarks/bench_ppo.py --only-3000     # the time to 3000 experts only
    python benchmarks/bench_ppo.py --quick         # smoke test (a minute)
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import statistics
import time
from pathlib import Path

import numpy as np
import torch

from dporl.envs.variants import physics_grid
from dporl.experts.batched_ppo import train_ppo_batched
from dporl.experts.generate import GenerationConfig, RayConfig, candidate_seeds, generate_experts
from dporl.experts.policies import StackedMLPPolicy
from dporl.experts.ppo import PPOConfig, train_ppo
from dporl.utils.config import from_dict, load_yaml

CONFIG = Path(__file__).resolve().parents[1] / "configs" / "dataset_cartpole_ppo.yaml"


def load_generation(quick: bool) -> GenerationConfig:
    experts = dict(load_yaml(CONFIG)["experts"])
    if quick:  # 27 settings, 2k timesteps per candidate
        experts.update(points_per_axis=3, n_settings=None, ppo={**experts["ppo"], "total_timesteps": 2048})
    return from_dict(GenerationConfig, experts)


def _job(args: tuple) -> float:
    """One single-threaded worker-process job: one expert alone (``train_ppo``) or a batched model; its wall time."""
    batched, env_id, settings, config, seeds, max_steps = args
    torch.set_num_threads(1)
    start = time.perf_counter()
    if batched:
        train_ppo_batched(env_id, settings, config, seeds, max_episode_steps=max_steps)
    else:
        train_ppo(env_id, settings, config, seeds, max_episode_steps=max_steps)
    return time.perf_counter() - start


def throughput(generation: GenerationConfig, timesteps: int, batch: int, singles: int, rounds: int, cores: int) -> None:
    config = PPOConfig(**{**generation.ppo.__dict__, "total_timesteps": timesteps})
    grid = physics_grid(generation.env_id)
    settings = [grid[i % len(grid)] for i in range(batch)]
    seeds = candidate_seeds(generation, len(grid))[:batch]
    steps = generation.max_episode_steps
    print(f"PPO settings: actor {config.actor_hidden_sizes}, critic {config.critic_hidden_sizes}, {config.n_envs} envs x "
          f"{config.n_steps} steps, {config.update_epochs} epochs x {config.n_minibatches} minibatches, "
          f"{timesteps} timesteps per expert ({max(1, timesteps // config.batch_size)} updates); {generation.env_id}")
    per_core = {"per-expert": [], "batched": []}
    parallel = {"per-expert": [], "batched": []}
    context = multiprocessing.get_context("spawn")
    with context.Pool(cores) as pool:
        pool.map(_job, [(False, generation.env_id, settings[0], config, seeds[0], steps)] * cores)  # warm up
        for round_index in range(rounds):
            torch.set_num_threads(1)
            start = time.perf_counter()
            alone = [train_ppo(generation.env_id, settings[i], config, seeds[i], max_episode_steps=steps)
                     for i in range(singles)]
            per_core["per-expert"].append((time.perf_counter() - start) / singles)
            start = time.perf_counter()
            batched = train_ppo_batched(generation.env_id, settings, config, seeds, max_episode_steps=steps)
            per_core["batched"].append((time.perf_counter() - start) / batch)
            reference = StackedMLPPolicy.from_single([result.actor for result in alone])
            worst = max((batched.actor.state_dict()[k][:singles] - v).abs().max().item()
                        for k, v in reference.state_dict().items())
            assert worst < 1e-5, f"batched experts differ from per-expert ones by {worst}"

            jobs = [(False, generation.env_id, settings[i], config, seeds[i], steps) for i in range(singles * cores)]
            start = time.perf_counter()
            pool.map(_job, jobs, chunksize=1)
            parallel["per-expert"].append((time.perf_counter() - start) / len(jobs))
            share = -(-batch // cores)  # one single-threaded batched model per core, as generate's Ray chunks run
            jobs = [(True, generation.env_id, settings[i:i + share], config, seeds[i:i + share], steps)
                    for i in range(0, batch, share)]
            start = time.perf_counter()
            pool.map(_job, jobs, chunksize=1)
            parallel["batched"].append((time.perf_counter() - start) / batch)
            print(f"  round {round_index + 1}/{rounds}: per core {per_core['per-expert'][-1] * 1e3:.0f} vs "
                  f"{per_core['batched'][-1] * 1e3:.1f} ms per expert; on {cores} cores "
                  f"{parallel['per-expert'][-1] * 1e3:.0f} vs {parallel['batched'][-1] * 1e3:.1f} ms per expert "
                  f"(max parameter difference {worst:.1e})", flush=True)
    torch.set_num_threads(1)
    for name, table in (("1 core", per_core), (f"{cores} cores", parallel)):
        old, new = statistics.median(table["per-expert"]), statistics.median(table["batched"])
        print(f"{name:<8} one process per expert {60 / old:9.1f} experts/min   batched ({batch} experts) "
              f"{60 / new:9.1f} experts/min   speed-up {old / new:6.1f}x   (medians of {rounds} rounds, "
              f"{timesteps} timesteps per expert)")
    scale = generation.ppo.total_timesteps / timesteps
    print(f"at the dataset config's {generation.ppo.total_timesteps} timesteps per expert (scaled linearly): "
          f"{60 / (statistics.median(parallel['per-expert']) * scale):.1f} vs "
          f"{60 / (statistics.median(parallel['batched']) * scale):.1f} experts/min on {cores} cores")


def time_to_3000(generation: GenerationConfig, cores: int) -> None:
    generation.torch_threads = 1
    generation.batch_experts = min(generation.batch_experts, 500)
    generation.ray = RayConfig(enabled=cores > 1, num_cpus=cores)
    kept = len(physics_grid(generation.env_id, generation.points_per_axis)) * generation.keep_best
    print(f"\ngenerating {kept} CartPole experts: {generation.candidates_per_setting} candidates per setting, best "
          f"{generation.keep_best} kept, {generation.ppo.total_timesteps} timesteps each, actor "
          f"{generation.ppo.actor_hidden_sizes}, chunks of {generation.batch_experts} on {cores} cores")
    load_before = os.getloadavg()
    cpu_before = time.process_time()
    start = time.perf_counter()
    generated = generate_experts(generation, progress=True)
    wall = time.perf_counter() - start
    cpu = time.process_time() - cpu_before
    load_after = os.getloadavg()
    returns = generated.eval_returns
    print(f"time to {generated.policy.n_experts} experts: {wall / 60:.1f} min wall (goal < 30 min on 2 cores; "
          f"{cpu / 60:.1f} min CPU in this process, Ray workers not counted); load average before {load_before[0]:.2f}, after "
          f"{load_after[0]:.2f} (1 min), {load_after[2]:.2f} (15 min)")
    print(f"kept experts' greedy return on their setting: quantiles 0/10/25/50/75/90/100 % = "
          f"{np.percentile(returns, [0, 10, 25, 50, 75, 90, 100]).round(1).tolist()}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    which = parser.add_mutually_exclusive_group()
    which.add_argument("--skip-3000", action="store_true")
    which.add_argument("--only-3000", action="store_true", help="the time to 3000 experts alone, no throughput rounds")
    parser.add_argument("--timesteps", type=int, default=None, help="per expert in the throughput rounds")
    parser.add_argument("--batch", type=int, default=None, help="experts in one batched model")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--cores", type=int, default=2)
    args = parser.parse_args()
    generation = load_generation(args.quick)
    print(f"load average at start: {os.getloadavg()[0]:.2f} (1 min) on {os.cpu_count()} cores")
    if not args.only_3000:
        throughput(generation, args.timesteps or (1024 if args.quick else 2048), args.batch or (64 if args.quick else 500),
                   singles=2 if args.quick else 4, rounds=args.rounds or (2 if args.quick else 3), cores=args.cores)
    if not args.skip_3000:
        time_to_3000(generation, args.cores)


if __name__ == "__main__":
    main()
