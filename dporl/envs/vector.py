"""Vector envs of the public simulators, built in this process: time limits, physics per sub-env, and the physics
record of a logging environment.

``make_local_vector_env`` is what every rollout steps (expert training, data collection, the stable-prefix
release's fresh rollouts); ``dporl.envs.process_env.make_vector_env`` adds worker processes on top of it.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import gymnasium as gym
import numpy as np
from gymnasium.vector import AutoresetMode

from dporl.envs.registry import check_env_id, make_vec
from dporl.envs.variants import HIV_ID, VARIANT_SPECS, make_variant, make_vector_variant, physics_of
from dporl.utils.validation import ValidationError


def time_limit_kwargs(env_id: str, max_episode_steps: int) -> dict[str, int]:
    """Make arguments that cut episodes at ``max_episode_steps`` (the HIV simulator's limit is its ``horizon``)."""
    return {"horizon": max_episode_steps} if env_id == HIV_ID else {"max_episode_steps": max_episode_steps}


def make_local_vector_env(
    env_id: str,
    num_envs: int,
    max_episode_steps: int,
    params: Sequence[Mapping[str, Any]] | None = None,
    env_kwargs: Mapping[str, Any] | None = None,
) -> gym.vector.VectorEnv:
    """Vector env of ``num_envs`` copies of ``env_id`` in next-step autoreset mode.

    ``params``: one physics dict per sub-env (None = default physics everywhere). Built by
    ``dporl.envs.variants.make_vector_variant``, which uses the numpy-batched vector envs where they exist (CartPole,
    Acrobot, HIV: physics as arrays over sub-envs) and a ``SyncVectorEnv`` otherwise. ``env_kwargs`` go to every make
    call (e.g. the HIV treatment interval). All sub-envs step in this process
    (``dporl.envs.process_env.make_vector_env`` spreads them over worker processes).
    """
    check_env_id("env_id", env_id)  # a name, never a module to import (dporl.envs.registry)
    kwargs = {**time_limit_kwargs(env_id, max_episode_steps), **dict(env_kwargs or {})}
    if params is None or not any(params):
        if env_id in VARIANT_SPECS:
            vector_env = make_vector_variant(env_id, {}, num_envs, **kwargs)
        else:
            vector_env = make_vec("env_id", env_id, num_envs=num_envs, **kwargs)
    else:
        if len(params) != num_envs:
            raise ValidationError("params", f"need one setting per sub-env ({num_envs}), got {len(params)}")
        keys = set(params[0])
        if any(set(p) != keys for p in params):
            raise ValidationError("params", "every sub-env setting must name the same physics parameters")
        columns = {}
        for key in sorted(keys):
            values = [p[key] for p in params]
            # One value for all sub-envs stays a scalar (make_vector_variant takes booleans only as scalars).
            columns[key] = values[0] if all(v == values[0] for v in values) else np.asarray(values)
        vector_env = make_vector_variant(env_id, columns, num_envs, **kwargs)
    if vector_env.metadata.get("autoreset_mode", AutoresetMode.NEXT_STEP) != AutoresetMode.NEXT_STEP:
        vector_env.close()
        raise ValidationError("env_id", f"{env_id}: vector env must use next-step autoreset (final obs is returned)")
    return vector_env


def logging_physics(env_id: str, env_params: Mapping[str, Any], env_kwargs: Mapping[str, Any]) -> dict[str, Any]:
    """Every physics parameter of the logging env (defaults filled in), for ``DatasetMetadata.env_params``."""
    if env_id not in VARIANT_SPECS:
        return dict(env_params)
    env = make_variant(env_id, env_params, **dict(env_kwargs))
    try:
        return physics_of(env, env_id)
    finally:
        env.close()
