"""Numpy-batched CartPole and Acrobot whose sub-environments each own a random stream.

Gymnasium's ``CartPoleVectorEnv`` draws every sub-environment's initial state from ONE generator, so what sub-env i
sees depends on how many sub-envs share the vector env and when the others end their episodes. Here sub-env i owns a
generator seeded exactly like Gymnasium's scalar env (``np.random.default_rng(seed_i)`` through
``gymnasium.utils.seeding.np_random``) and draws its resets from it, as ``reset(seed=...)`` of a ``SyncVectorEnv``
of scalar envs does:

- ``reset(seed=s)`` (an int) seeds sub-env i with ``s + i`` (the ``SyncVectorEnv`` convention);
- ``reset(seed=[s_0, ..., s_{n-1}])`` seeds each sub-env with its own seed;
- later resets (next-step autoreset) continue each sub-env's stream.

So one big vector env made of blocks behaves, block by block, like the blocks run as separate vector envs (the batched
PPO trainer relies on this: an expert trained among thousands equals the same expert trained alone), and sub-env i
follows the trajectory of ``gym.make(env_id)`` reset with seed ``s_i`` under the same actions (dynamics equal up to
float rounding of vectorised vs scalar maths).

Physics attributes may be scalars or arrays with one value per sub-environment (``dporl.envs.variants`` sets them).

- ``CartPoleVectorEnv``: Gymnasium's batched CartPole dynamics (subclass), per-sub-env reset streams.
- ``AcrobotVectorEnv``: Gymnasium's Acrobot-v1 (book dynamics, one RK4 step of dt = 0.2 per action, angle
  wrapping, velocity bounds, ``-cos(th1) - cos(th1 + th2) > 1`` terminal) over arrays; Gymnasium has no batched one.
  Its torque noise (``torque_noise_max``, 0 in Acrobot-v1) is not supported.
"""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np
from gymnasium import spaces
from gymnasium.envs.classic_control import utils as classic_utils
from gymnasium.envs.classic_control.acrobot import AcrobotEnv
from gymnasium.envs.classic_control.cartpole import CartPoleVectorEnv as _GymCartPoleVectorEnv
from gymnasium.utils import seeding
from gymnasium.vector import AutoresetMode, VectorEnv
from gymnasium.vector.utils import batch_space

from dporl.utils.validation import ValidationError


class SubEnvStreams:
    """One numpy Generator per sub-environment, seeded as Gymnasium seeds a scalar env."""

    def __init__(self, num_envs: int, seed: int | Sequence[int] | None = None):
        self.generators = [seeding.np_random(s)[0] for s in sub_env_seeds(seed, num_envs)]

    def uniform(self, index: np.ndarray, low: float, high: float, size: int) -> np.ndarray:
        """``[len(index), size]`` draws, row k from sub-env ``index[k]``'s stream (``Generator.uniform``)."""
        if len(index) == 0:
            return np.zeros((0, size))
        return np.stack([self.generators[i].uniform(low=low, high=high, size=(size,)) for i in index])


def sub_env_seeds(seed: int | Sequence[int] | None, num_envs: int) -> list[int | None]:
    """Per-sub-env seeds: None (fresh entropy each), an int s (s + i) or one non-negative int per sub-env."""
    if seed is None:
        return [None] * num_envs
    if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool):
        return [int(seed) + i for i in range(num_envs)]
    seeds = list(seed)
    if len(seeds) != num_envs:
        raise ValidationError("seed", f"need one seed per sub-environment ({num_envs}), got {len(seeds)}")
    if any(isinstance(s, bool) or not isinstance(s, (int, np.integer)) or s < 0 for s in seeds):
        raise ValidationError("seed", "per-sub-environment seeds must be non-negative integers")
    return [int(s) for s in seeds]


def _vector_reset_seed(seed: int | Sequence[int] | None) -> int | None:
    """What the base VectorEnv (its own ``np_random``, unused for resets here) may be seeded with."""
    return int(seed) if isinstance(seed, (int, np.integer)) and not isinstance(seed, bool) else None


class CartPoleVectorEnv(_GymCartPoleVectorEnv):
    """Gymnasium's batched CartPole with one reset stream per sub-environment (see the module docstring)."""

    per_sub_env_seeds = True  # reset(seed=[...]) takes one seed per sub-env

    def reset(self, *, seed: int | Sequence[int] | None = None, options: dict[str, Any] | None = None):
        self._streams = SubEnvStreams(self.num_envs, seed)
        super().reset(seed=_vector_reset_seed(seed), options=options)  # sets bounds, counters; state replaced below
        self.state = self._streams.uniform(np.arange(self.num_envs), self.low, self.high, 4).T
        return self.state.T.astype(np.float32), {}

    def step(self, action):
        resetting = np.flatnonzero(self.prev_done)
        obs, reward, terminated, truncated, info = super().step(action)
        if len(resetting):  # the parent reset these from its shared generator: redraw from their own streams
            self.state[:, resetting] = self._streams.uniform(resetting, self.low, self.high, 4).T
            obs = self.state.T.astype(np.float32)
        return obs, reward, terminated, truncated, info


class AcrobotVectorEnv(VectorEnv):
    """``num_envs`` Acrobot-v1 systems advanced together (state ``[num_envs, 4]``: th1, th2, dth1, dth2)."""

    metadata = {"render_modes": [], "autoreset_mode": AutoresetMode.NEXT_STEP}
    per_sub_env_seeds = True  # reset(seed=[...]) takes one seed per sub-env

    def __init__(self, num_envs: int = 1, max_episode_steps: int = 500, render_mode: str | None = None):
        if int(num_envs) != num_envs or num_envs < 1:
            raise ValidationError("num_envs", f"must be a positive integer, got {num_envs!r}")
        if int(max_episode_steps) != max_episode_steps or max_episode_steps < 1:
            raise ValidationError("max_episode_steps", f"must be a positive integer, got {max_episode_steps!r}")
        if render_mode is not None:
            raise ValidationError("render_mode", "the batched Acrobot does not render; use gym.make('Acrobot-v1')")
        self.num_envs = int(num_envs)
        self.max_episode_steps = int(max_episode_steps)
        self.render_mode = None
        # Physics (scalars, or one value per sub-env once dporl.envs.variants sets them); Gymnasium's defaults.
        for name in ("dt", "LINK_LENGTH_1", "LINK_LENGTH_2", "LINK_MASS_1", "LINK_MASS_2", "LINK_COM_POS_1",
                     "LINK_COM_POS_2", "LINK_MOI", "MAX_VEL_1", "MAX_VEL_2"):
            setattr(self, name, getattr(AcrobotEnv, name))
        self.torques = np.asarray(AcrobotEnv.AVAIL_TORQUE, dtype=np.float64)
        high = np.array([1.0, 1.0, 1.0, 1.0, self.MAX_VEL_1, self.MAX_VEL_2], dtype=np.float32)
        self.single_observation_space = spaces.Box(low=-high, high=high, dtype=np.float32)
        self.single_action_space = spaces.Discrete(3)
        self.observation_space = batch_space(self.single_observation_space, self.num_envs)
        self.action_space = batch_space(self.single_action_space, self.num_envs)
        self.state = np.zeros((self.num_envs, 4))
        self.steps = np.zeros(self.num_envs, dtype=np.int64)
        self.prev_done = np.zeros(self.num_envs, dtype=bool)
        self.low, self.high = -0.1, 0.1
        self._streams = SubEnvStreams(self.num_envs)

    def reset(self, *, seed: int | Sequence[int] | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=_vector_reset_seed(seed))
        self._streams = SubEnvStreams(self.num_envs, seed)
        self.low, self.high = classic_utils.maybe_parse_reset_bounds(options, -0.1, 0.1)
        self.state = self._initial_states(np.arange(self.num_envs))
        self.steps[:] = 0
        self.prev_done[:] = False
        return self._observation(), {}

    def step(self, actions):
        actions = np.asarray(actions)
        if actions.shape != (self.num_envs,) or not np.all((actions >= 0) & (actions < 3)):
            raise ValidationError("actions", f"expected {self.num_envs} actions in {{0, 1, 2}}, got {actions!r}")
        state = self._integrate(self.state, self.torques[actions.astype(np.int64)])
        terminated = -np.cos(state[:, 0]) - np.cos(state[:, 1] + state[:, 0]) > 1.0
        reward = np.where(terminated, 0.0, -1.0)
        self.steps += 1
        truncated = self.steps >= self.max_episode_steps
        resetting = np.flatnonzero(self.prev_done)  # ended last step: start over, this step's action is ignored
        if len(resetting):
            state[resetting] = self._initial_states(resetting)
            self.steps[resetting] = 0
            reward[resetting] = 0.0
            terminated[resetting] = False
            truncated[resetting] = False
        self.state = state
        self.prev_done = terminated | truncated
        return self._observation(), reward, terminated, truncated, {}

    def _initial_states(self, index: np.ndarray) -> np.ndarray:
        # Gymnasium stores the initial state as float32 and integrates in float64 from there.
        return self._streams.uniform(index, self.low, self.high, 4).astype(np.float32).astype(np.float64)

    def _observation(self) -> np.ndarray:
        s = self.state
        return np.stack([np.cos(s[:, 0]), np.sin(s[:, 0]), np.cos(s[:, 1]), np.sin(s[:, 1]), s[:, 2], s[:, 3]],
                        axis=1).astype(np.float32)

    def _integrate(self, state: np.ndarray, torque: np.ndarray) -> np.ndarray:
        """Gymnasium's ``rk4`` over [0, dt] (one step, same operation order), then wrap angles, bound velocities."""
        dt = self.dt
        dt2 = dt / 2.0
        k1 = self._derivatives(state, torque)
        k2 = self._derivatives(state + dt2 * k1, torque)
        k3 = self._derivatives(state + dt2 * k2, torque)
        k4 = self._derivatives(state + dt * k3, torque)
        out = state + dt / 6.0 * (k1 + 2 * k2 + 2 * k3 + k4)
        out[:, 0] = _wrap(out[:, 0], -np.pi, np.pi)
        out[:, 1] = _wrap(out[:, 1], -np.pi, np.pi)
        out[:, 2] = np.clip(out[:, 2], -self.MAX_VEL_1, self.MAX_VEL_1)
        out[:, 3] = np.clip(out[:, 3], -self.MAX_VEL_2, self.MAX_VEL_2)
        return out

    def _derivatives(self, s: np.ndarray, a: np.ndarray) -> np.ndarray:
        """Gymnasium's ``AcrobotEnv._dsdt`` (book dynamics) over rows of ``s[n, 4]``."""
        m1, m2, l1 = self.LINK_MASS_1, self.LINK_MASS_2, self.LINK_LENGTH_1
        lc1, lc2, i1, i2, g = self.LINK_COM_POS_1, self.LINK_COM_POS_2, self.LINK_MOI, self.LINK_MOI, 9.8
        theta1, theta2, dtheta1, dtheta2 = s[:, 0], s[:, 1], s[:, 2], s[:, 3]
        d1 = m1 * lc1**2 + m2 * (l1**2 + lc2**2 + 2 * l1 * lc2 * np.cos(theta2)) + i1 + i2
        d2 = m2 * (lc2**2 + l1 * lc2 * np.cos(theta2)) + i2
        phi2 = m2 * lc2 * g * np.cos(theta1 + theta2 - np.pi / 2.0)
        phi1 = (
            -m2 * l1 * lc2 * dtheta2**2 * np.sin(theta2)
            - 2 * m2 * l1 * lc2 * dtheta2 * dtheta1 * np.sin(theta2)
            + (m1 * lc1 + m2 * l1) * g * np.cos(theta1 - np.pi / 2)
            + phi2
        )
        ddtheta2 = (a + d2 / d1 * phi1 - m2 * l1 * lc2 * dtheta1**2 * np.sin(theta2) - phi2) / (
            m2 * lc2**2 + i2 - d2**2 / d1
        )
        ddtheta1 = -(d2 * ddtheta2 + phi1) / d1
        return np.stack([dtheta1, dtheta2, ddtheta1, ddtheta2], axis=1)


def _wrap(x: np.ndarray, low: float, high: float) -> np.ndarray:
    """Gymnasium's ``wrap`` elementwise: shift by the period until inside [low, high]."""
    period = high - low
    while True:
        above, below = x > high, x < low
        if not (above.any() or below.any()):
            return x
        x = np.where(above, x - period, np.where(below, x + period, x))
