"""MountainCar-v0 (Sutton & Barto; Gymnasium's ``MountainCarEnv``) stepped for many cars at once in numpy.

Gymnasium 1.x ships no vector entry point for MountainCar, and stepping 1e5 wrapped environments one Python call at
a time costs minutes per dataset. ``MountainCarBatch`` holds the (position, velocity) of n cars as float64 arrays and
applies exactly Gymnasium's update to all of them:

    v <- clip(v + (a - 1) force - cos(3 x) gravity, -0.07, 0.07);   x <- clip(x + v, -1.2, 0.6)
    v <- 0 where x hit -1.2 moving left;    terminated where x >= 0.5 and v >= goal_velocity;   reward -1

Observations are float32 like Gymnasium's; starts are uniform in [-0.6, -0.4] with velocity 0. The time limit
(200 steps for MountainCar-v0) is the caller's, as Gymnasium's ``TimeLimit`` wrapper is.
"""

from __future__ import annotations

import numpy as np

from dporl.utils.validation import ValidationError

MIN_POSITION, MAX_POSITION, MAX_SPEED = -1.2, 0.6, 0.07
GOAL_POSITION, FORCE, GRAVITY = 0.5, 0.001, 0.0025
OBSERVATION_LOW, OBSERVATION_HIGH = (-1.2, -0.07), (0.6, 0.07)
N_ACTIONS = 3


class MountainCarBatch:
    """n independent MountainCar-v0 cars advanced together (see the module docstring)."""

    def __init__(self, n: int, goal_velocity: float = 0.0):
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 1:
            raise ValidationError("n", f"need a positive number of cars, got {n!r}")
        self.n = int(n)
        self.goal_velocity = float(goal_velocity)
        self.position = np.zeros(self.n)
        self.velocity = np.zeros(self.n)

    def reset(self, rng: np.random.Generator) -> np.ndarray:
        self.position = rng.uniform(-0.6, -0.4, self.n)
        self.velocity = np.zeros(self.n)
        return self.observation()

    def set_state(self, position: np.ndarray, velocity: np.ndarray) -> None:
        self.position = np.array(position, dtype=np.float64).reshape(self.n)
        self.velocity = np.array(velocity, dtype=np.float64).reshape(self.n)

    def observation(self, cars: np.ndarray | None = None) -> np.ndarray:
        cars = slice(None) if cars is None else cars
        return np.stack([self.position[cars], self.velocity[cars]], axis=-1).astype(np.float32)

    def step(self, actions: np.ndarray, cars: np.ndarray | None = None) -> np.ndarray:
        """Advance ``cars`` (indices; default all) by ``actions`` in {0, 1, 2}; returns their ``terminated`` flags."""
        cars = np.arange(self.n) if cars is None else np.asarray(cars, dtype=np.int64)
        actions = np.asarray(actions)
        if actions.shape != cars.shape or (actions.size and (actions.min() < 0 or actions.max() >= N_ACTIONS)):
            raise ValidationError("actions", f"need one action in [0, {N_ACTIONS}) per car, got {actions.shape}")
        position, velocity = self.position[cars], self.velocity[cars]
        velocity = velocity + (actions - 1) * FORCE + np.cos(3 * position) * (-GRAVITY)
        velocity = np.clip(velocity, -MAX_SPEED, MAX_SPEED)
        position = np.clip(position + velocity, MIN_POSITION, MAX_POSITION)
        velocity = np.where((position == MIN_POSITION) & (velocity < 0), 0.0, velocity)
        self.position[cars], self.velocity[cars] = position, velocity
        return (position >= GOAL_POSITION) & (velocity >= self.goal_velocity)
