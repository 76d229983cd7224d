"""The 1-D line MDP of the functional-noise paper (Wang & Hegde 2019, appendix E.1).

S = [0, 1], s0 ~ U[0, 1], actions {0: left, 1: right}; a move is a step of U[0, 0.25] in that direction, clipped
to [0, 1]. Reward 0.5 - |s - 0.5| every step, evaluated at the state the move lands in (so the action taken
is what the reward reflects). Episodes end after 50 steps: a time limit, hence ``truncated`` (not terminated).
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from dporl.utils.validation import ValidationError, check_positive


class LineEnv(gym.Env):
    """``dporl/Line1D-v0``."""

    metadata = {"render_modes": []}

    def __init__(self, horizon: int = 50, max_move: float = 0.25, render_mode: str | None = None):
        if int(horizon) != horizon or horizon < 1:
            raise ValidationError("horizon", f"must be a positive integer, got {horizon!r}")
        self.horizon = int(horizon)
        self.max_move = check_positive("max_move", max_move)
        self.observation_space = spaces.Box(0.0, 1.0, shape=(1,), dtype=np.float32)
        self.action_space = spaces.Discrete(2)
        self.render_mode = render_mode
        self._position = 0.0
        self._t = 0

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self._position = float(self.np_random.uniform(0.0, 1.0))
        self._t = 0
        return np.array([self._position], dtype=np.float32), {}

    def step(self, action):
        if not self.action_space.contains(action):
            raise ValidationError("action", f"expected 0 (left) or 1 (right), got {action!r}")
        direction = 1.0 if int(action) == 1 else -1.0
        move = self.np_random.uniform(0.0, self.max_move)
        self._position = float(np.clip(self._position + direction * move, 0.0, 1.0))
        self._t += 1
        reward = 0.5 - abs(self._position - 0.5)
        return np.array([self._position], dtype=np.float32), reward, False, self._t >= self.horizon, {}
