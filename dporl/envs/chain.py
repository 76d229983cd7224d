"""The N-state chain of the policy-evaluation papers (Xie et al. 2019; Balle et al. 2016), with exact values.

States 0..N-1, one action. From s < N-1 stay with probability p, else move to s+1. State N-1 is absorbing: entering
it pays reward 1 and ends the episode. Episodes start uniformly over the non-absorbing states.

Observations are ``Box`` of shape (1,) holding the state index as a float, so chain data has the same
``[d]``-vector layout as every other dporl dataset; ``TabularFeatures(n_states)`` one-hot encodes it.
"""

from __future__ import annotations

from typing import Any

import gymnasium as gym
import numpy as np
from gymnasium import spaces

from dporl.utils.validation import ValidationError, check_probability


def _check_chain(n_states: int, p: float) -> tuple[int, float]:
    if int(n_states) != n_states or n_states < 2:
        raise ValidationError("n_states", f"must be an integer >= 2, got {n_states!r}")
    return int(n_states), check_probability("p", p, allow_one=False)


def chain_transition_matrix(n_states: int = 40, p: float = 0.5) -> np.ndarray:
    """``P[s, s']`` of the (only) policy; the absorbing state loops on itself with reward 0, so its value is 0."""
    n_states, p = _check_chain(n_states, p)
    P = np.zeros((n_states, n_states))
    states = np.arange(n_states - 1)
    P[states, states] = p
    P[states, states + 1] = 1.0 - p
    P[-1, -1] = 1.0
    return P


def chain_expected_rewards(n_states: int = 40, p: float = 0.5) -> np.ndarray:
    """``r[s]`` = expected immediate reward from s: 1 - p from the state next to the absorbing one, else 0."""
    n_states, p = _check_chain(n_states, p)
    r = np.zeros(n_states)
    r[-2] = 1.0 - p
    return r


def chain_true_values(n_states: int = 40, p: float = 0.5, gamma: float = 0.99) -> np.ndarray:
    """Closed form V(s) = [q / (1 - gamma p)] [q gamma / (1 - gamma p)]^(N-2-s), q = 1 - p; V(N-1) = 0.

    It equals (I - gamma P)^-1 r with ``chain_transition_matrix`` and ``chain_expected_rewards`` (tested).
    """
    n_states, p = _check_chain(n_states, p)
    gamma = check_probability("gamma", gamma)
    q = 1.0 - p
    steps_to_go = np.arange(n_states - 2, -1, -1)  # N-2-s for s = 0..N-2
    values = np.zeros(n_states)
    values[:-1] = q / (1.0 - gamma * p) * (q * gamma / (1.0 - gamma * p)) ** steps_to_go
    return values


class ChainEnv(gym.Env):
    """``dporl/Chain-v0``: the N-state chain with a single action (``Discrete(1)``)."""

    metadata = {"render_modes": []}

    def __init__(self, n_states: int = 40, p: float = 0.5, render_mode: str | None = None):
        self.n_states, self.p = _check_chain(n_states, p)
        self.observation_space = spaces.Box(0.0, float(self.n_states - 1), shape=(1,), dtype=np.float32)
        self.action_space = spaces.Discrete(1)
        self.render_mode = render_mode
        self._state = 0

    def _observation(self) -> np.ndarray:
        return np.array([self._state], dtype=np.float32)

    def reset(self, *, seed: int | None = None, options: dict[str, Any] | None = None):
        super().reset(seed=seed)
        self._state = int(self.np_random.integers(0, self.n_states - 1))
        return self._observation(), {}

    def step(self, action):
        if not self.action_space.contains(action):
            raise ValidationError("action", f"the chain has one action (0), got {action!r}")
        if self.np_random.random() >= self.p:
            self._state += 1
        absorbed = self._state == self.n_states - 1
        return self._observation(), float(absorbed), absorbed, False, {}
