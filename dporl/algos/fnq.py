"""Differentially private Q-learning with functional noise (Wang & Hegde 2019, seeds/004, Algorithm 1).

Protected: the reward function (unit "reward", sup |r - r'| <= 1). The learner sees rewards only through the
temporal-difference loss, and every Q-value it uses carries a Gaussian-process sample path per action:

    act      a_t = argmax_a Q(s_t, a) + g_a(s_t)
    target   y_t = r_t + gamma (1 - terminated) max_a [Q(s_{t+1}, a) + g_a(s_{t+1})]
    loss     l_t = 1/2 (Q(s_t, a_t) + g_{a_t}(s_t) - y_t)^2,   one SGD step on the mean over B transitions,

with the paths reset every ``reset_every`` = T / (J B) updates. The paths are the mechanism (Theorem 5), so this
module draws them, through ``dporl.privacy.gp_noise`` and a ``NoiseSource``; the trainer runs with dp=None.

The released object is ``NoisyQFunction``: the Q-network together with its current noise paths, queryable at
any state and saved / reloaded with identical answers (paths, stored values and generator state travel in its
state_dict). Theorem 5 covers Q_theta itself, so the independent path added at release is post-processing.

Data: ``EnvInteractionSource`` is Algorithm 1's online loop (B fresh transitions per update from a Gymnasium env,
acting greedily on Q + g); the offline variant draws B logged transitions per update from a ``TrajectoryDataset``
(``dataset_source``). The guarantee concerns only the rewards, so it is the same for both.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import nn

from dporl.algos.cql import mlp
from dporl.privacy.gp_noise import FunctionalNoise
from dporl.privacy.noise import NoiseSource
from dporl.privacy.samplers import Batch, UniformBatchSource
from dporl.privacy.units import REWARD
from dporl.utils.io import atomic_torch_save, load_weights
from dporl.utils.validation import ValidationError, check_positive, check_probability

TRANSITION_KEYS = ("obs", "actions", "rewards", "next_obs", "terminated")


@dataclass
class FNQConfig:
    hidden_sizes: list[int] = field(default_factory=lambda: [16, 16])  # the authors' 1-16-16-2 network
    gamma: float = 0.99
    sigma: float = 0.0  # scale of every noise path (0: non-private DQN)
    beta: float = 1.0  # kernel exp(-beta ||x - y||_1) on states scaled to [0, 1]^d
    reset_every: int = 1  # updates between path resets, T / (J B)
    state_low: list[float] = field(default_factory=lambda: [0.0])  # public bounds that scale states to [0, 1]
    state_high: list[float] = field(default_factory=lambda: [1.0])

    def __post_init__(self) -> None:
        check_probability("fnq.gamma", self.gamma)
        check_positive("fnq.sigma", self.sigma, allow_zero=True)
        check_positive("fnq.beta", self.beta)
        if not self.hidden_sizes or any(h < 1 for h in self.hidden_sizes):
            raise ValidationError("fnq.hidden_sizes", f"need positive layer sizes, got {self.hidden_sizes}")
        if self.reset_every < 1:
            raise ValidationError("fnq.reset_every", f"must be >= 1, got {self.reset_every}")
        if len(self.state_low) != len(self.state_high) or not self.state_low:
            raise ValidationError("fnq.state_high", "state_low and state_high need one entry per state dimension")


class NoisyQFunction(nn.Module):
    """Q_theta(s, a) + g_a(s): the released function, queryable at any state."""

    def __init__(self, q_network: nn.Module, noise: FunctionalNoise):
        super().__init__()
        self.q_network = q_network
        self.noise = noise

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        """[B, n_actions] noisy Q-values for observations [B, obs_dim] (extends the paths at new states)."""
        return self.q_network(obs) + self.noise(obs).to(obs.dtype)

    @torch.no_grad()
    def act(self, obs: torch.Tensor) -> torch.Tensor:
        obs = obs.to(next(self.q_network.parameters()).device, torch.float32)
        return self.forward(obs).argmax(dim=-1)


class FunctionalNoiseQLearning(nn.Module):
    """Algorithm 1's learner: ``row_losses`` on transitions, path resets in ``on_step_end``."""

    privacy_unit = REWARD

    def __init__(self, obs_dim: int, n_actions: int, config: FNQConfig, noise: Optional[NoiseSource] = None):
        super().__init__()
        if obs_dim != len(config.state_low):
            raise ValidationError("fnq.state_low", f"{len(config.state_low)} bounds for a {obs_dim}-dimensional state")
        if n_actions < 2:
            raise ValidationError("n_actions", f"need at least 2 actions, got {n_actions}")
        self.config = config
        self.obs_dim = obs_dim
        self.n_actions = n_actions
        paths = FunctionalNoise(n_actions, config.state_low, config.state_high, config.sigma, config.beta, noise)
        self.function = NoisyQFunction(mlp(obs_dim, config.hidden_sizes, n_actions), paths)

    @property
    def q_network(self) -> nn.Module:
        return self.function.q_network

    @property
    def noise(self) -> FunctionalNoise:
        return self.function.noise

    def act(self, obs: torch.Tensor) -> torch.Tensor:
        return self.function.act(obs)

    def row_losses(self, batch: Batch) -> torch.Tensor:
        data = batch.data
        obs, actions = data["obs"].float(), data["actions"].long()
        noisy_q = self.q_network(obs) + self.noise(obs).to(obs.dtype)  # the path is a constant: no gradient
        taken = noisy_q.gather(1, actions.unsqueeze(1)).squeeze(1)
        with torch.no_grad():
            next_obs = data["next_obs"].float()
            next_value = self.function(next_obs).max(dim=1).values
            not_done = 1.0 - data["terminated"].float()
            target = data["rewards"].float() + self.config.gamma * not_done * next_value
        return 0.5 * (taken - target) ** 2

    def on_step_end(self, step: int) -> None:
        if step % self.config.reset_every == 0:
            self.noise.reset()

    def release(self, noise: Optional[NoiseSource] = None) -> NoisyQFunction:
        """A copy of the noisy Q-function whose future path draws come from ``noise`` (default: a secret seed).

        Reseeding keeps the paths of earlier noise windows, which are not released, out of reach of anyone who
        reads the published generator state.
        """
        released = copy.deepcopy(self.function)
        released.noise.reseed(noise if noise is not None else NoiseSource())
        return released


def save_noisy_q(path: str | Path, function: NoisyQFunction, metadata: dict[str, Any]) -> Path:
    """Atomic save of a released function with what is needed to rebuild it (``metadata`` is JSON-safe)."""
    noise = function.noise
    spec = {
        "obs_dim": noise.dim,
        "n_actions": noise.n_actions,
        "hidden_sizes": [m.out_features for m in function.q_network if isinstance(m, nn.Linear)][:-1],
        "sigma": noise.sigma,
        "beta": noise.beta,
        "state_low": noise.state_low.tolist(),
        "state_high": (noise.state_low + noise.state_scale).tolist(),
    }
    return atomic_torch_save(path, {"spec": spec, "state_dict": function.state_dict(), "metadata": metadata})


def load_noisy_q(path: str | Path) -> tuple[NoisyQFunction, dict[str, Any]]:
    payload = load_weights(path, "released")  # weights-only: a released file can never run code
    if not isinstance(payload, dict) or not {"spec", "state_dict", "metadata"} <= set(payload):
        raise ValidationError("released", f"{path} is not a released noisy Q-function")
    spec = payload["spec"]
    paths = FunctionalNoise(
        spec["n_actions"], spec["state_low"], spec["state_high"], spec["sigma"], spec["beta"], NoiseSource(0)
    )
    function = NoisyQFunction(mlp(spec["obs_dim"], spec["hidden_sizes"], spec["n_actions"]), paths)
    function.load_state_dict(payload["state_dict"])  # restores the paths and the generator state too
    return function, payload["metadata"]


class EnvInteractionSource:
    """Algorithm 1's batches: each ``sample`` plays ``env_steps_per_update`` steps greedily on Q + g.

    Without replay (Algorithm 1) the batch is exactly the new transitions. With ``replay_capacity`` > 0 the new
    transitions enter a ring buffer and the batch is ``batch_size`` draws from it (the authors' DQN code).
    ``reward_transform`` sees each observed reward once, when it is stored (input perturbation hooks in here).
    ``exploration`` is the probability of a uniformly random action (public randomness). Episodes are reseeded
    from the sampler's generator, so a run is reproducible from the trainer's seed.
    """

    def __init__(
        self,
        env,
        act: Callable[[torch.Tensor], torch.Tensor],
        batch_size: int,
        *,
        env_steps_per_update: Optional[int] = None,
        replay_capacity: int = 0,
        exploration: float = 0.0,
        reward_transform: Optional[Callable[[torch.Tensor], torch.Tensor]] = None,
    ):
        if batch_size < 1:
            raise ValidationError("batch_size", f"must be >= 1, got {batch_size}")
        self.env_steps_per_update = batch_size if env_steps_per_update is None else int(env_steps_per_update)
        if self.env_steps_per_update < 1:
            raise ValidationError("env_steps_per_update", f"must be >= 1, got {env_steps_per_update}")
        if replay_capacity == 0 and self.env_steps_per_update != batch_size:
            raise ValidationError("env_steps_per_update", "without replay every update uses exactly the new transitions")
        if replay_capacity < 0:
            raise ValidationError("replay_capacity", f"must be >= 0, got {replay_capacity}")
        self.env = env
        self.act = act
        self.batch_size = batch_size
        self.replay_capacity = replay_capacity
        self.exploration = check_probability("exploration", exploration)
        self.reward_transform = reward_transform
        self.n_actions = int(env.action_space.n)
        self._obs: Optional[np.ndarray] = None
        self._buffer: dict[str, torch.Tensor] = {}
        self._stored = 0
        self.env_steps = 0

    @property
    def expected_batch_size(self) -> float:
        return float(self.batch_size)

    def step_event(self, noise_multiplier: float) -> None:
        return None  # no gradient noise: the privacy is in the functional noise (or in the rewards)

    def _collect(self, generator: torch.Generator) -> dict[str, torch.Tensor]:
        rows: dict[str, list] = {k: [] for k in TRANSITION_KEYS}
        for _ in range(self.env_steps_per_update):
            if self._obs is None:
                seed = int(torch.randint(0, 2**31 - 1, (), generator=generator))
                self._obs, _ = self.env.reset(seed=seed)
            obs = torch.as_tensor(np.asarray(self._obs), dtype=torch.float32)
            if self.exploration and float(torch.rand((), generator=generator)) < self.exploration:
                action = int(torch.randint(0, self.n_actions, (), generator=generator))
            else:
                action = int(self.act(obs.unsqueeze(0))[0])
            next_obs, reward, terminated, truncated, _ = self.env.step(action)
            for key, value in zip(TRANSITION_KEYS, (obs, action, float(reward), next_obs, bool(terminated))):
                rows[key].append(value)
            self._obs = None if (terminated or truncated) else next_obs
            self.env_steps += 1
        new = {
            "obs": torch.stack(rows["obs"]),
            "actions": torch.tensor(rows["actions"], dtype=torch.long),
            "rewards": torch.tensor(rows["rewards"], dtype=torch.float32),
            "next_obs": torch.as_tensor(np.stack(rows["next_obs"]), dtype=torch.float32),
            "terminated": torch.tensor(rows["terminated"], dtype=torch.bool),
        }
        if self.reward_transform is not None:
            new["rewards"] = self.reward_transform(new["rewards"])
        return new

    def _remember(self, new: dict[str, torch.Tensor]) -> None:
        if not self._buffer:
            self._buffer = {k: torch.zeros((self.replay_capacity, *v.shape[1:]), dtype=v.dtype) for k, v in new.items()}
        n = len(new["actions"])
        slots = (torch.arange(n) + self._stored) % self.replay_capacity
        for key, value in new.items():
            self._buffer[key][slots] = value
        self._stored += n

    def sample(self, generator: torch.Generator) -> Batch:
        new = self._collect(generator)
        if self.replay_capacity:
            self._remember(new)
            rows = torch.randint(0, min(self._stored, self.replay_capacity), (self.batch_size,), generator=generator)
            new = {k: v[rows] for k, v in self._buffer.items()}
        return Batch(new, torch.arange(self.batch_size), self.batch_size, private=False)


def dataset_source(dataset, batch_size: int, reward_transform: Optional[Callable] = None) -> UniformBatchSource:
    """The offline variant: ``batch_size`` logged transitions per update, uniformly with replacement.

    The transitions' states and actions are public under the reward-level guarantee; only rewards are protected,
    so ``reward_transform`` (input perturbation) is applied once to every logged reward.
    """
    transitions = dataset.transitions().to_torch()
    data = {key: transitions[key] for key in TRANSITION_KEYS}
    data["obs"], data["next_obs"] = data["obs"].float(), data["next_obs"].float()
    if reward_transform is not None:
        data["rewards"] = reward_transform(data["rewards"].float())
    return UniformBatchSource(data, batch_size)
