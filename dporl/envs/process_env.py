"""A vector env whose sub-envs step in worker processes, each worker holding a slice as its own vector env.

Gymnasium's ``AsyncVectorEnv`` runs one process per sub-env, which is right for a handful of expensive envs and
wrong for thousands of cheap Box2D landers (one per expert copy, as batched PPO needs). Here ``workers`` processes
each build ONE ordinary vector env (``dporl.envs.vector.make_local_vector_env``: a ``SyncVectorEnv`` of Gymnasium envs
for LunarLander, a numpy-batched env where one exists) over a contiguous slice of the sub-envs; ``step`` sends every
worker its slice of the actions before waiting for any, so the slices advance in parallel.

The result behaves as the single-process vector env of the same sub-envs would: next-step autoreset, per-sub-env
seeds (``reset(seed=[...])``; an int s seeds sub-env i with s + i), the same observations, rewards and flags.
Workers are forked where the platform can (Linux; they run only numpy and Box2D code, never torch, so inheriting
the parent's torch state is harmless, and a script without an ``if __name__ == "__main__"`` guard still works),
spawned elsewhere. Ray is the tool when one machine is outgrown (``dporl.experts.generate``'s ``ray`` section).

``make_vector_env`` is the one entry point: one process, or ``workers`` of them.
"""

from __future__ import annotations

import multiprocessing
from typing import Any, Mapping, Sequence

import numpy as np
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from dporl.envs.classic_vector import sub_env_seeds
from dporl.envs.registry import check_env_id
from dporl.envs.vector import make_local_vector_env
from dporl.utils.validation import ValidationError


def make_vector_env(
    env_id: str,
    num_envs: int,
    max_episode_steps: int,
    params: Sequence[Mapping[str, Any]] | None = None,
    env_kwargs: Mapping[str, Any] | None = None,
    workers: int = 1,
) -> VectorEnv:
    """Vector env of ``num_envs`` copies of ``env_id`` in next-step autoreset mode (``make_local_vector_env``:
    ``params`` one physics dict per sub-env, ``env_kwargs`` for every make call). ``workers > 1``: the sub-envs
    step in that many processes (``ProcessVectorEnv``; worth it for Box2D LunarLander, whose envs step in Python).
    """
    check_env_id("env_id", env_id)  # a name, never a module to import (dporl.envs.registry)
    if workers > 1 and num_envs > 1:
        return ProcessVectorEnv(env_id, num_envs, max_episode_steps, params, env_kwargs, workers=workers)
    return make_local_vector_env(env_id, num_envs, max_episode_steps, params, env_kwargs)


def _worker(connection, env_id: str, num_envs: int, max_episode_steps: int, params, env_kwargs) -> None:
    try:
        env = make_local_vector_env(env_id, num_envs, max_episode_steps, params, env_kwargs)
        connection.send(("ok", (env.single_observation_space, env.single_action_space)))
    except ValidationError as exc:  # bad settings: the parent raises the same ValidationError
        connection.send(("invalid", (exc.field, str(exc).removeprefix(f"{exc.field}: "))))
        return
    except Exception as exc:  # report construction errors to the parent instead of dying silently
        connection.send(("error", f"{type(exc).__name__}: {exc}"))
        return
    try:
        while True:
            command, data = connection.recv()
            if command == "reset":
                obs, _ = env.reset(seed=data)
                connection.send(("ok", np.asarray(obs)))
            elif command == "step":
                obs, reward, terminated, truncated, _ = env.step(data)
                connection.send(("ok", (np.asarray(obs), np.asarray(reward), np.asarray(terminated),
                                        np.asarray(truncated))))
            elif command == "close":
                connection.send(("ok", None))
                return
    except Exception as exc:
        connection.send(("error", f"{type(exc).__name__}: {exc}"))
    finally:
        env.close()


class ProcessVectorEnv(VectorEnv):
    """``num_envs`` sub-envs of ``env_id`` (sub-env i with physics ``params[i]``) over ``workers`` processes."""

    metadata = {"render_modes": [], "autoreset_mode": AutoresetMode.NEXT_STEP}
    per_sub_env_seeds = True

    def __init__(
        self,
        env_id: str,
        num_envs: int,
        max_episode_steps: int,
        params: Sequence[Mapping[str, Any]] | None = None,
        env_kwargs: Mapping[str, Any] | None = None,
        *,
        workers: int = 2,
    ):
        if int(num_envs) != num_envs or num_envs < 1:
            raise ValidationError("num_envs", f"must be a positive integer, got {num_envs!r}")
        if int(workers) != workers or workers < 1:
            raise ValidationError("env_workers", f"must be a positive integer, got {workers!r}")
        if params is not None and len(params) != num_envs:
            raise ValidationError("params", f"need one setting per sub-env ({num_envs}), got {len(params)}")
        self.num_envs = int(num_envs)
        self.render_mode = None
        bounds = np.linspace(0, self.num_envs, min(int(workers), self.num_envs) + 1).round().astype(int)
        self._slices = [slice(int(a), int(b)) for a, b in zip(bounds[:-1], bounds[1:])]
        methods = multiprocessing.get_all_start_methods()
        context = multiprocessing.get_context("fork" if "fork" in methods else "spawn")
        self._connections, self._processes = [], []
        try:
            for part in self._slices:
                parent, child = context.Pipe()
                process = context.Process(
                    target=_worker, daemon=True,
                    args=(child, env_id, part.stop - part.start, max_episode_steps,
                          None if params is None else [dict(p) for p in params[part]], dict(env_kwargs or {})))
                process.start()
                child.close()
                self._connections.append(parent)
                self._processes.append(process)
            spaces = [self._receive(connection) for connection in self._connections]
        except BaseException:
            self.close()
            raise
        self.single_observation_space, self.single_action_space = spaces[0]
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self.closed = False

    def reset(self, *, seed: int | Sequence[int] | None = None, options: dict[str, Any] | None = None):
        if options:
            raise ValidationError("options", "ProcessVectorEnv.reset takes no options")
        seeds = sub_env_seeds(seed, self.num_envs)
        for connection, part in zip(self._connections, self._slices):
            connection.send(("reset", seeds[part]))
        return np.concatenate([self._receive(connection) for connection in self._connections]), {}

    def step(self, actions):
        actions = np.asarray(actions)
        if actions.shape[:1] != (self.num_envs,):
            raise ValidationError("actions", f"expected {self.num_envs} actions, got shape {actions.shape}")
        for connection, part in zip(self._connections, self._slices):
            connection.send(("step", actions[part]))
        results = [self._receive(connection) for connection in self._connections]
        obs, reward, terminated, truncated = (np.concatenate(parts) for parts in zip(*results))
        return obs, reward, terminated, truncated, {}

    def close(self, **kwargs: Any) -> None:
        if not getattr(self, "_processes", None):
            return
        for connection, process in zip(self._connections, self._processes):
            try:
                if process.is_alive():
                    connection.send(("close", None))
                    connection.recv()
            except (OSError, EOFError, BrokenPipeError):
                pass
            connection.close()
        for process in self._processes:
            process.join(timeout=10)
            if process.is_alive():
                process.terminate()
        self._connections, self._processes = [], []
        self.closed = True

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    @staticmethod
    def _receive(connection):
        try:
            status, payload = connection.recv()
        except EOFError:
            raise RuntimeError("a ProcessVectorEnv worker died") from None
        if status == "invalid":
            raise ValidationError(*payload)
        if status != "ok":
            raise RuntimeError(f"ProcessVectorEnv worker failed: {payload}")
        return payload
