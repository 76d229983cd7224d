"""The public simulator of a logging environment: its Gymnasium id, physics and make arguments, and horizon H, as a
dataset's metadata records them; what the stable-prefix release rolls its fresh trajectories out in
(``dporl.algos.stable_prefix``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gymnasium.vector import VectorEnv

from dporl.envs.process_env import make_vector_env
from dporl.envs.variants import effective_physics


@dataclass(frozen=True)
class PublicSimulator:
    """The public simulator of the logging environment: env id, physics and make arguments, horizon H."""

    env_id: str
    env_params: dict[str, Any]
    env_kwargs: dict[str, Any]
    horizon: int

    def make(self, num_envs: int) -> VectorEnv:
        """A vector env of ``num_envs`` copies (next-step autoreset), TimeLimit H."""
        physics = effective_physics(self.env_id, self.env_params)
        return make_vector_env(self.env_id, num_envs, self.horizon, [physics] * num_envs if physics else None,
                               self.env_kwargs)
