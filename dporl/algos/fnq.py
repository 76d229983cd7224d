"""Reward-level private Q-learning (privacy unit "reward": neighbouring reward functions with sup |r - r'| <= 1).

Two learners share a Q-network Q_theta and one Gaussian-process sample path g_a per action (``FunctionalNoise``),
and train through the shared Trainer:

* ``RewardPrivateQLearning``: dporl's sound mechanism, public-iterate Gaussian updates. Every update releases a
  noisy mean gradient; the iterates are post-processing of those releases, so they are public. Actions (greedy on
  Q_theta + g, the paths now only exploration), TD targets (a target network = a past released iterate) and
  minibatches (offline: uniform over logged transitions) depend only on released iterates and on reward-independent
  randomness, so the only reward dependence of update j is y_t through r_t. Each transition is its own unit of the
  DP-SGD engine: its row "loss" is Q_theta(s_t, a_t), clipped to norm G (J_t = grad_theta Q clipped), and its row
  weight is the clipped TD error w_t = clamp(Q(s_t, a_t) - y_t, -kappa, kappa) (a 1-Lipschitz loss derivative:
  Huber with threshold kappa <= 1), applied after clipping. The update is
      grad_j = 1/B sum_t w_t clip_G(J_t) + N(0, (z G s)^2 I),   s = min(1 / c, 2 kappa),
  with c the public reward scale (rewards enter the target as r / c). Neighbours move each TD error by at most
  sup|r - r'| / c <= 1 / c, so each |w_t - w'_t| <= min(1 / c, 2 kappa) = s and ||grad_j - grad'_j|| <= G s,
  whatever the network: U updates are a Gaussian mechanism (sensitivity G s, noise multiplier z) composed U times,
  with no subsampling amplification (every reward may differ). ``RewardLevelSource`` states that event.
* ``FunctionalNoiseQLearning``: the paper's Algorithm 1 (Wang & Hegde 2019, seeds/004), kept to reproduce it:
  paths in the prediction and the target, plain SGD, no gradient noise. Theorem 5 is the paper's figure, NOT a
  guarantee: the rewards reach the parameters additively through the TD targets, and an attack on the released
  network refutes it (``dporl.audit.functional_audits.paper_attack_audit``).

The released object is ``NoisyQFunction``: the Q-network together with its current paths, queryable at any state
and saved / reloaded (weights-only) with identical answers. For the sound learner the paths are exploration: their
law does not depend on the rewards, and where they were evaluated (the visited states) is a function of released
iterates, of the paths themselves and of the environment's reward-independent dynamics, so releasing them is free
(the guarantee holds for every value they take); they come from their own secret stream anyway.

Data: ``EnvInteractionSource`` is the online loop (``env_steps_per_update`` new transitions per update, acting
greedily on Q + g, optionally through a replay buffer); ``dataset_source`` is the offline variant (uniform minibatches
of logged transitions). Rewards outside a declared public range are clamped into it, never refused (``RewardClamp``:
a refusal would turn a neighbour's out-of-range reward into an error where the other dataset gets a release).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch
from torch import nn

from dporl.algos.base import LossForm, PrivateAlgorithm
from dporl.algos.networks import mlp
from dporl.privacy.events import PoissonGaussianEvent
from dporl.privacy.gp_noise import FunctionalNoise
from dporl.privacy.noise import NoiseSource
from dporl.privacy.samplers import Batch, RowLayout, UniformBatchSource
from dporl.privacy.units import REWARD
from dporl.utils.io import atomic_torch_save, load_weights
from dporl.utils.validation import ValidationError, check_positive, check_probability

TRANSITION_KEYS = ("obs", "actions", "rewards", "next_obs", "terminated")


@dataclass
class FNQConfig:
    hidden_sizes: list[int] = field(default_factory=lambda: [16, 16])  # the authors' 1-16-16-2; [] = linear Q
    gamma: float = 0.99
    sigma: float = 0.0  # scale of every GP path (paper: the privacy noise; sound learner: exploration; 0: none)
    beta: float = 1.0  # kernel exp(-beta ||x - y||_1) on states scaled to [0, 1]^d
    reset_every: int = 1  # updates between path resets, T / (J B)
    state_low: list[float] = field(default_factory=lambda: [0.0])  # public bounds that scale states to [0, 1]
    state_high: list[float] = field(default_factory=lambda: [1.0])
    # RewardPrivateQLearning only (public constants; see the module docstring):
    td_clip: float = 1.0  # kappa: TD errors clipped to [-kappa, kappa] (Huber threshold), 0 < kappa <= 1
    reward_scale: float = 1.0  # c: rewards enter the TD target as r / c
    target_update_every: int = 0  # 0: targets from the current iterate; k: from a copy refreshed every k updates

    def __post_init__(self) -> None:
        check_probability("fnq.gamma", self.gamma)
        check_positive("fnq.sigma", self.sigma, allow_zero=True)
        check_positive("fnq.beta", self.beta)
        if any(int(h) != h or h < 1 for h in self.hidden_sizes):
            raise ValidationError("fnq.hidden_sizes", f"need positive layer sizes, got {self.hidden_sizes}")
        if self.reset_every < 1:
            raise ValidationError("fnq.reset_every", f"must be >= 1, got {self.reset_every}")
        if len(self.state_low) != len(self.state_high) or not self.state_low:
            raise ValidationError("fnq.state_high", "state_low and state_high need one entry per state dimension")
        check_positive("fnq.td_clip", self.td_clip)
        if self.td_clip > 1:
            raise ValidationError("fnq.td_clip", f"must be <= 1 (weights scale clipped gradients), got {self.td_clip}")
        check_positive("fnq.reward_scale", self.reward_scale)
        if int(self.target_update_every) != self.target_update_every or self.target_update_every < 0:
            raise ValidationError("fnq.target_update_every", f"must be an integer >= 0, got {self.target_update_every}")

    @property
    def update_sensitivity(self) -> float:
        """s = min(1 / c, 2 kappa): the mean update's L2 sensitivity in units of the clip norm G."""
        return min(1.0 / self.reward_scale, 2.0 * self.td_clip)


class RewardClamp:
    """Rewards mapped into the declared public ``reward_range`` [low, high] by clamping, never refused.

    A refusal on an out-of-range reward is a deterministic distinguisher: a neighbour whose rewards leave the range
    gets an error where the other dataset gets a release. Clamping is 1-Lipschitz, so two reward functions with
    sup |r - r'| <= 1 are still neighbours after it and every analysis downstream holds unchanged. ``clamped``
    counts the rewards moved: a function of the private rewards, so it is CURATOR-ONLY (the pipeline writes it under
    ``curator/``; never into ``release/`` or the stdout that ends with the guarantee).

    Non-finite rewards are refused, and that refusal distinguishes no neighbours: the reward-level relation relates
    real-valued reward functions (|NaN - x| <= 1 and |inf - x| <= 1 hold for no x), so a reward function with a NaN
    or infinite value has no neighbour at all, and two neighbours are both finite. There is also no nearest point of
    the range to clamp a NaN to. Without a declared range only finiteness is checked.
    """

    def __init__(self, reward_range: Optional[tuple[float, float]] = None):
        self.reward_range = check_reward_range(None if reward_range is None else list(reward_range))
        self.clamped = 0  # curator-only

    def __call__(self, rewards: torch.Tensor) -> torch.Tensor:
        if not bool(torch.isfinite(rewards).all()):
            raise ValidationError("rewards", "non-finite reward (NaN or inf): the reward-level relation (sup |r - r'| "
                                  "<= 1) is between real-valued reward functions")
        if self.reward_range is None:
            return rewards
        low, high = self.reward_range
        clamped = rewards.clamp(low, high)
        self.clamped += int((clamped != rewards).sum())
        return clamped


def _reward_clamp(reward_range: Optional["tuple[float, float] | RewardClamp"]) -> RewardClamp:
    return reward_range if isinstance(reward_range, RewardClamp) else RewardClamp(reward_range)


def check_reward_range(reward_range: Optional[list[float]]) -> Optional[tuple[float, float]]:
    if reward_range is None:
        return None
    if len(reward_range) != 2 or not all(np.isfinite(reward_range)) or not reward_range[0] < reward_range[1]:
        raise ValidationError("reward_range", f"need [low, high] with finite low < high, got {reward_range}")
    return float(reward_range[0]), float(reward_range[1])


class NoisyQFunction(nn.Module):
    """Q_theta(s, a) + g_a(s): the released function, queryable at any state."""

    def __init__(self, q_network: nn.Module, noise: FunctionalNoise):
        super().__init__()
        self.q_network = q_network
        self.noise = noise

    def forward(self, obs: torch.Tensor) -> torch.Tensor:
        """[B, n_actions] noisy Q-values for observations [B, obs_dim] (extends the paths at new states)."""
        q = self.q_network(obs)
        return q if self.noise.sigma == 0 else q + self.noise(obs).to(obs.dtype)

    @torch.no_grad()
    def act(self, obs: torch.Tensor) -> torch.Tensor:
        obs = obs.to(next(self.q_network.parameters()).device, torch.float32)
        return self.forward(obs).argmax(dim=-1)


class _PathQLearner(PrivateAlgorithm):
    """A Q-network with one GP path per action, reset every ``reset_every`` updates; unit "reward".

    ``q_network`` (optional) is any torch module mapping observations [B, obs_dim] to Q-values [B, n_actions]
    (default: an MLP with ``config.hidden_sizes``). The engine's bookkeeping / ghost modes need nn.Linear
    parameters only; use clipping mode "opacus" for other layers.
    """

    privacy_unit = REWARD
    batch_keys = TRANSITION_KEYS
    policy_kind = None  # releases a noisy Q-function with its paths (``release``), not a greedy MLP policy

    def __init__(
        self,
        obs_dim: int,
        n_actions: int,
        config: FNQConfig,
        noise: Optional[NoiseSource] = None,
        q_network: Optional[nn.Module] = None,
    ):
        super().__init__()
        if obs_dim != len(config.state_low):
            raise ValidationError("fnq.state_low", f"{len(config.state_low)} bounds for a {obs_dim}-dimensional state")
        if n_actions < 2:
            raise ValidationError("n_actions", f"need at least 2 actions, got {n_actions}")
        self.config = config
        self.obs_dim = obs_dim
        self.n_actions = n_actions
        paths = FunctionalNoise(n_actions, config.state_low, config.state_high, config.sigma, config.beta, noise)
        network = mlp(obs_dim, config.hidden_sizes, n_actions) if q_network is None else q_network
        self.function = NoisyQFunction(network, paths)

    @property
    def q_network(self) -> nn.Module:
        return self.function.q_network

    @property
    def noise(self) -> FunctionalNoise:
        return self.function.noise

    def act(self, obs: torch.Tensor) -> torch.Tensor:
        return self.function.act(obs)

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


class FunctionalNoiseQLearning(_PathQLearner):
    """The paper's Algorithm 1 (reproduction only: Theorem 5 does not cover what it releases).

        act      a_t = argmax_a Q(s_t, a) + g_a(s_t)
        target   y_t = r_t + gamma (1 - terminated) max_a [Q(s_{t+1}, a) + g_a(s_{t+1})]
        loss     l_t = 1/2 (Q(s_t, a_t) + g_{a_t}(s_t) - y_t)^2,   one SGD step on the mean over B transitions,

    with the paths reset every ``reset_every`` = T / (J B) updates (``td_clip``, ``reward_scale`` and
    ``target_update_every`` do not apply).
    """

    loss_form = LossForm.ROW_LOSSES

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


class RewardPrivateQLearning(_PathQLearner):
    """Public-iterate Q-learning with clipped-TD semi-gradients (the sound mechanism; module docstring).

    ``weighted_row_losses`` returns (Q(s_t, a_t), w_t): the Trainer's DP-SGD engine clips each row's gradient of
    Q(s_t, a_t) to G, multiplies it by w_t and adds the noise; without the engine (non-private reference) the same
    semi-gradient mean_t w_t grad Q(s_t, a_t) is taken unclipped. Targets use a past iterate (the current one with
    ``target_update_every = 0``) and never the exploration paths.
    """

    loss_form = LossForm.WEIGHTED_ROW_LOSSES

    def __init__(
        self,
        obs_dim: int,
        n_actions: int,
        config: FNQConfig,
        noise: Optional[NoiseSource] = None,
        q_network: Optional[nn.Module] = None,
    ):
        super().__init__(obs_dim, n_actions, config, noise, q_network)
        self.target_network: Optional[nn.Module] = None
        if config.target_update_every:
            self.target_network = copy.deepcopy(self.q_network).requires_grad_(False)

    def td_weights(self, q_taken: torch.Tensor, batch: Batch) -> torch.Tensor:
        """w_t = clamp(Q(s_t, a_t) - y_t, -kappa, kappa), y_t = r_t / c + gamma (1 - done) max_a Q_target(s', a)."""
        data, config = batch.data, self.config
        with torch.no_grad():
            target_net = self.q_network if self.target_network is None else self.target_network
            next_value = target_net(data["next_obs"].float()).max(dim=1).values
            not_done = 1.0 - data["terminated"].float()
            target = data["rewards"].float() / config.reward_scale + config.gamma * not_done * next_value
            return (q_taken.detach() - target).clamp(-config.td_clip, config.td_clip)

    def weighted_row_losses(self, batch: Batch) -> tuple[torch.Tensor, torch.Tensor]:
        obs, actions = batch.data["obs"].float(), batch.data["actions"].long()
        q_taken = self.q_network(obs).gather(1, actions.unsqueeze(1)).squeeze(1)
        return q_taken, self.td_weights(q_taken, batch)

    def on_step_end(self, step: int) -> None:
        super().on_step_end(step)
        every = self.config.target_update_every
        if every and step % every == 0:
            self.target_network.load_state_dict(self.q_network.state_dict())


class RewardLevelSource:
    """Batches of ``inner`` (fixed size B) as private steps with one transition per unit, and their event.

    The engine clips each transition's gradient to G, weights it and adds noise of std sigma G to the sum, then
    divides by B: noise sigma G / B on a mean whose sensitivity is G s (``FNQConfig.update_sensitivity``). The
    per-update event is therefore the Gaussian mechanism with noise multiplier sigma / (B s), without sampling
    amplification (``PoissonGaussianEvent(sigma / (B s), 1.0)``): every reward may differ between neighbours.
    """

    unit = REWARD  # every batch protects the reward function (the Trainer checks the algorithm agrees)

    def __init__(self, inner, sensitivity: float):
        self.inner = inner
        self.batch_size = int(inner.batch_size)
        self.sensitivity = check_positive("fnq.update_sensitivity", sensitivity)

    @property
    def expected_batch_size(self) -> float:
        return float(self.batch_size)  # fixed, public: the engine divides the noisy sum by it

    def sample(self, generator: torch.Generator) -> Batch:
        batch = self.inner.sample(generator)
        if batch.n_rows != self.batch_size:
            raise ValidationError("batch_size", f"a reward-level update needs exactly {self.batch_size} rows, got {batch.n_rows}")
        # One transition per unit, in order: the engine needs no id checks (RowLayout).
        return Batch(batch.data, torch.arange(self.batch_size), self.batch_size, private=True,
                     layout=RowLayout(rows_per_unit=1))

    def step_event(self, noise_multiplier: float) -> PoissonGaussianEvent:
        return PoissonGaussianEvent(noise_multiplier / (self.batch_size * self.sensitivity), 1.0)


def save_noisy_q(path: str | Path, function: NoisyQFunction, metadata: dict[str, Any]) -> Path:
    """Atomic save of a released function with what is needed to rebuild it (``metadata`` is JSON-safe)."""
    noise = function.noise
    hidden = [m.out_features for m in function.q_network.modules() if isinstance(m, nn.Linear)][:-1]
    expected = mlp(noise.dim, hidden, noise.n_actions).state_dict()
    actual = function.q_network.state_dict()
    if list(expected) != list(actual) or any(expected[k].shape != actual[k].shape for k in expected):
        raise ValidationError("q_network", "save_noisy_q saves dporl's MLP Q-networks; save a custom network yourself")
    spec = {
        "obs_dim": noise.dim,
        "n_actions": noise.n_actions,
        "hidden_sizes": hidden,
        "sigma": noise.sigma,
        "beta": noise.beta,
        "state_low": noise.state_low.tolist(),
        "state_high": (noise.state_low + noise.state_scale).tolist(),
    }
    return atomic_torch_save(path, {"spec": spec, "state_dict": function.state_dict(), "metadata": metadata})


def load_noisy_q(path: str | Path) -> tuple[NoisyQFunction, dict[str, Any]]:
    """A released function saved by ``save_noisy_q`` (weights-only load: no code in the file can run)."""
    payload = load_weights(path, "released")  # weights-only: a released file can never run code
    if not isinstance(payload, dict) or not {"spec", "state_dict", "metadata"} <= set(payload):
        raise ValidationError("released", f"{path} is not a released noisy Q-function")
    try:
        spec = payload["spec"]
        if not all(isinstance(spec[k], int) for k in ("obs_dim", "n_actions")) or not 1 <= spec["obs_dim"] <= 10_000:
            raise ValueError(f"bad dimensions in {spec!r}")
        if not 2 <= spec["n_actions"] <= 10_000 or not all(1 <= int(h) <= 1_000_000 for h in spec["hidden_sizes"]):
            raise ValueError(f"bad sizes in {spec!r}")
        paths = FunctionalNoise(
            spec["n_actions"], spec["state_low"], spec["state_high"], spec["sigma"], spec["beta"], NoiseSource(0)
        )
        function = NoisyQFunction(mlp(spec["obs_dim"], list(spec["hidden_sizes"]), spec["n_actions"]), paths)
        function.load_state_dict(payload["state_dict"])  # restores the paths and the generator state too
    except ValidationError:
        raise
    except Exception as exc:  # missing keys, absurd sizes, shape mismatches: all a bad file
        raise ValidationError("released", f"{path} is not a released function saved by dporl: {exc}") from None
    return function, payload["metadata"]


class EnvInteractionSource:
    """Online batches: each ``sample`` plays ``env_steps_per_update`` steps greedily on Q + g (``act``).

    Without replay (Algorithm 1) the batch is exactly the new transitions. With ``replay_capacity`` > 0 the new
    transitions enter a ring buffer and the batch is ``batch_size`` draws from it (the authors' DQN code), drawn
    with the trainer's generator. ``reward_transform`` sees each observed reward once, when it is stored (input
    perturbation hooks in here: a replayed transition keeps its one noisy reward). ``exploration`` is the
    probability of a uniformly random action. Episode seeds and exploration coins come from ``env_generator`` (a
    stream of the run's root; default: the trainer's generator). Every observed reward is clamped into ``reward_range``
    (a public (low, high), or a ``RewardClamp`` whose count the caller reads) before it is stored or transformed.
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
        env_generator: Optional[torch.Generator] = None,
        reward_range: Optional["tuple[float, float] | RewardClamp"] = None,
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
        self.env_generator = env_generator
        self.reward_clamp = _reward_clamp(reward_range)
        self.n_actions = int(env.action_space.n)
        self._obs: Optional[np.ndarray] = None
        self._buffer: dict[str, torch.Tensor] = {}
        self._stored = 0
        self.env_steps = 0

    @property
    def expected_batch_size(self) -> float:
        return float(self.batch_size)

    def step_event(self, noise_multiplier: float) -> None:
        return None  # a plain source: RewardLevelSource / WholeBatchUnitSource make its batches private steps

    def _collect(self, generator: torch.Generator) -> dict[str, torch.Tensor]:
        generator = generator if self.env_generator is None else self.env_generator
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
        new["rewards"] = self.reward_clamp(new["rewards"])
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


def dataset_source(
    dataset,
    batch_size: int,
    reward_transform: Optional[Callable] = None,
    reward_range: Optional["tuple[float, float] | RewardClamp"] = None,
) -> UniformBatchSource:
    """The offline variant: ``batch_size`` logged transitions per update, uniformly with replacement.

    The transitions' states and actions are public under the reward-level guarantee; only rewards are protected,
    so every logged reward is clamped into ``reward_range`` (``RewardClamp``) and then ``reward_transform`` (input
    perturbation) is applied to it once, before any batch is drawn.
    The minibatch choice does not depend on the rewards (no amplification is claimed from it).
    """
    transitions = dataset.transitions().to_torch()
    data = {key: transitions[key] for key in TRANSITION_KEYS}
    data["obs"], data["next_obs"] = data["obs"].float(), data["next_obs"].float()
    data["rewards"] = _reward_clamp(reward_range)(data["rewards"])
    if reward_transform is not None:
        data["rewards"] = reward_transform(data["rewards"].float())
    return UniformBatchSource(data, batch_size)
