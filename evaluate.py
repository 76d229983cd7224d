#!/usr/bin/env python
"""Evaluate a released policy in its public simulator, from ``RUN/release/`` alone.

    python evaluate.py --run RUN [--episodes 100] [--seed 12345] [--env ENV_ID]
    python evaluate.py --policy RUN/release/policy

Reads only the policy directory (weights-only, sizes and hashes checked; see ``dporl.train.export``): someone handed
``release/`` can run it without the curator's files. Writes the returns (mean and confidence interval) to
``<policy>/../evaluations/eval_seed<S>_episodes<N>.json`` (override with ``--out``). Public-simulator returns of the
released policy are post-processing: they cost no privacy.

``--checkpoint CURATOR_CHECKPOINT`` rescores a pipeline's own checkpoint with that pipeline's hook (the curator's
tool, e.g. GPOPE's exact MSPBE); checkpoints are curator-only and read weights-only.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from dporl.pipelines import get_pipeline, run_cli
from dporl.utils.validation import ValidationError


def evaluate_policy(policy_dir: Path, *, episodes: int, seed: int, env_id: str | None, num_envs: int,
                    max_episode_steps: int | None, out: Path | None) -> dict:
    import gymnasium as gym

    import dporl.envs  # noqa: F401  (registers dporl/* environments)
    from dporl.eval.returns import evaluate_returns
    from dporl.train.export import load_policy
    from dporl.utils.io import atomic_write_json

    policy = load_policy(policy_dir)
    env_id = env_id or policy.spec.get("env_id")
    if not env_id:
        raise ValidationError("env", "the policy names no environment; pass --env")
    max_episode_steps = max_episode_steps or (policy.spec.get("extra") or {}).get("max_episode_steps")
    kwargs = {} if max_episode_steps is None else {"max_episode_steps": int(max_episode_steps)}
    try:
        env = gym.make_vec(env_id, num_envs=min(num_envs, episodes), vectorization_mode="sync", **kwargs)
    except (gym.error.Error, ModuleNotFoundError, ImportError) as exc:
        raise ValidationError("env", f"cannot make environment {env_id!r}: {exc}") from None
    try:
        observation_dim = int(env.single_observation_space.shape[0])
        if observation_dim != policy.obs_dim or int(env.single_action_space.n) != policy.n_actions:
            raise ValidationError("env", f"{env_id} has {observation_dim}-dim observations and "
                                  f"{env.single_action_space.n} actions; the policy expects {policy.obs_dim} and "
                                  f"{policy.n_actions}")
        stats = evaluate_returns(policy.act, env, episodes, seed)
    finally:
        env.close()
    metrics = {**stats.to_dict(), "env_id": env_id, "seed": seed, "privacy": (policy.spec.get("privacy") or {}).get(
        "guarantee")}
    out = out or Path(policy_dir).resolve().parent / "evaluations"
    atomic_write_json(out / f"eval_seed{seed}_episodes{episodes}.json", {**metrics, "returns": stats.returns})
    return metrics


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--run", help="a run directory (its release/policy is evaluated)")
    source.add_argument("--policy", help="a policy directory (e.g. RUN/release/policy)")
    source.add_argument("--checkpoint", help="a curator checkpoint, rescored by its pipeline's hook")
    parser.add_argument("--episodes", type=int, default=100)
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--env", default=None, help="environment id (default: the one the policy names)")
    parser.add_argument("--num-envs", type=int, default=10)
    parser.add_argument("--max-episode-steps", type=int, default=None)
    parser.add_argument("--out", default=None, help="directory for eval outputs")
    args = parser.parse_args(argv)

    def evaluate() -> dict:
        if args.episodes < 1:
            raise ValidationError("episodes", f"must be >= 1, got {args.episodes}")
        out = Path(args.out) if args.out else None
        if args.checkpoint is not None:
            from dporl.train.checkpoint import load_checkpoint

            payload = load_checkpoint(args.checkpoint)
            pipeline = get_pipeline(payload["pipeline"])
            if pipeline.evaluate is None:
                raise ValidationError("checkpoint", f"pipeline {pipeline.name!r} has no checkpoint evaluator; use --run")
            run_dir = Path(args.checkpoint).resolve().parent.parent.parent  # RUN/curator/checkpoints/last.pt
            return pipeline.evaluate(payload, episodes=args.episodes, seed=args.seed, out_dir=out or run_dir)
        policy_dir = Path(args.policy) if args.policy else Path(args.run) / "release" / "policy"
        return evaluate_policy(policy_dir, episodes=args.episodes, seed=args.seed, env_id=args.env,
                               num_envs=args.num_envs, max_episode_steps=args.max_episode_steps, out=out)

    return run_cli(evaluate)


if __name__ == "__main__":
    sys.exit(main())
