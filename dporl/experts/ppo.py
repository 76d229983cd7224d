"""Compact discrete-action PPO (Schulman et al. 2017) for ONE expert: the reference for the batched trainer.

Clipped surrogate objective, GAE(lambda) advantages (normalised per minibatch), clipped value loss, entropy bonus,
global gradient-norm clipping, linear learning-rate annealing, separate actor and critic MLPs with orthogonal
initialisation (the CleanRL recipe). The ``n_envs`` copies run in one vector env in next-step autoreset mode: the
pseudo-step that resets a finished sub-env is masked out of the loss; an episode cut off by its time limit is
bootstrapped with the critic's value of its true final observation (truncation is not termination).

``dporl.experts.batched_ppo`` trains thousands of experts as one stacked model and must give, expert by expert, what
``train_ppo`` gives (tested). That fixes a randomness protocol both follow, a function of the expert's seed only:

- a ``torch.Generator`` seeded with ``seed`` draws the actor's and then the critic's initial weights;
- sub-env j of the expert's ``n_envs`` is reset with seed ``expert_env_seeds(seed, n_envs)[j]`` (each sub-env owns
  its stream: ``dporl.envs.classic_vector``, Gymnasium's Sync/Async vector envs);
- every update draws ONE block of uniforms from the generator (``update_uniforms``): ``n_steps * n_envs`` for the
  rollout's actions (inverse-CDF sampling), then ``update_epochs * n_steps * n_envs`` sort keys that order the
  rollout's rows into minibatches (``minibatch_bounds``), epoch by epoch;
- minibatches are fixed slices of that order over ALL rows; the reset pseudo-steps are masked (a minibatch with fewer
  than two valid rows is skipped: no optimiser step).

Training runs single-threaded, so a (setting, seed) pair gives the same actor in-process, in a Ray worker or inside a
batch. The actor is an ``nn.Sequential(Linear, act, ..., Linear)`` of logits, ready for
``StackedMLPPolicy.from_single``. This path (one process per expert) is the benchmark's baseline.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from dporl.envs.process_env import make_vector_env
from dporl.experts.expert_set import sample_with_uniforms
from dporl.utils.validation import ValidationError, check_positive, check_probability


@dataclass
class PPOConfig:
    """Defaults: CleanRL's classic-control PPO with (64, 64) networks. The paper's actors are (512, 256, 64); HIV
    (512,): set ``actor_hidden_sizes`` / ``critic_hidden_sizes`` for them."""

    actor_hidden_sizes: list[int] = field(default_factory=lambda: [64, 64])
    critic_hidden_sizes: list[int] = field(default_factory=lambda: [64, 64])
    activation: Literal["tanh", "relu"] = "tanh"
    total_timesteps: int = 100_000
    n_envs: int = 4
    n_steps: int = 128  # rollout length per env per update
    learning_rate: float = 2.5e-4
    anneal_lr: bool = True
    gamma: float = 0.99
    gae_lambda: float = 0.95
    clip_coef: float = 0.2
    update_epochs: int = 4
    n_minibatches: int = 4
    entropy_coef: float = 0.01
    value_coef: float = 0.5
    max_grad_norm: float = 0.5
    reward_scale: float = 1.0  # rewards are multiplied by this for learning (HIV's are ~1e5 per step)

    def __post_init__(self) -> None:
        for name in ("actor_hidden_sizes", "critic_hidden_sizes"):
            sizes = getattr(self, name)
            if not sizes or any(h < 1 for h in sizes):
                raise ValidationError(f"ppo.{name}", f"need positive layer sizes, got {sizes}")
        for name in ("total_timesteps", "n_envs", "n_steps", "update_epochs", "n_minibatches"):
            if getattr(self, name) < 1:
                raise ValidationError(f"ppo.{name}", f"must be >= 1, got {getattr(self, name)}")
        check_positive("ppo.learning_rate", self.learning_rate)
        check_probability("ppo.gamma", self.gamma)
        check_probability("ppo.gae_lambda", self.gae_lambda)
        check_positive("ppo.clip_coef", self.clip_coef)
        for name in ("entropy_coef", "value_coef", "max_grad_norm"):
            check_positive(f"ppo.{name}", getattr(self, name), allow_zero=True)
        check_positive("ppo.reward_scale", self.reward_scale)

    @property
    def batch_size(self) -> int:
        return self.n_envs * self.n_steps


_ACTIVATIONS = {"tanh": nn.Tanh, "relu": nn.ReLU}


def build_mlp(in_dim: int, hidden_sizes: list[int], out_dim: int, activation: str, last_gain: float,
              generator: torch.Generator) -> nn.Sequential:
    """Orthogonally initialised MLP (gain sqrt(2) hidden, ``last_gain`` output, zero biases).

    Not ``dporl.algos.cql.mlp``: experts sit below algos in the layering, and PPO needs tanh and the
    orthogonal initialisation drawn from an explicit generator.
    """
    layers: list[nn.Module] = []
    sizes = [in_dim, *hidden_sizes, out_dim]
    for index, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        linear = nn.Linear(fan_in, fan_out)
        last = index == len(sizes) - 2
        nn.init.orthogonal_(linear.weight, gain=last_gain if last else np.sqrt(2), generator=generator)
        nn.init.zeros_(linear.bias)
        layers.append(linear)
        if not last:
            layers.append(_ACTIVATIONS[activation]())
    return nn.Sequential(*layers)


@dataclass
class PPOResult:
    actor: nn.Sequential
    critic: nn.Sequential
    episode_returns: list[float]  # training episodes' returns, in completion order
    timesteps: int


def expert_env_seeds(seed: int, n_envs: int) -> list[int]:
    """The reset seeds of an expert's ``n_envs`` sub-environments (a function of its seed only)."""
    return [int(s) for s in np.random.SeedSequence([int(seed), 0x5EED]).generate_state(n_envs)]


def update_uniforms(generator: torch.Generator, config: PPOConfig) -> tuple[torch.Tensor, torch.Tensor]:
    """One update's uniforms: action draws [n_steps, n_envs] and minibatch sort keys [update_epochs, rows]."""
    rows = config.batch_size
    block = torch.rand(rows * (1 + config.update_epochs), generator=generator)
    return block[:rows].view(config.n_steps, config.n_envs), block[rows:].view(config.update_epochs, rows)


def minibatch_bounds(rows: int, n_minibatches: int) -> list[tuple[int, int]]:
    """[start, stop) of each minibatch in a row order (``torch.tensor_split`` sizes: the first ones one larger)."""
    sizes = [len(chunk) for chunk in torch.arange(rows).tensor_split(n_minibatches)]
    stops = np.cumsum(sizes).tolist()
    return [(stop - size, stop) for size, stop in zip(sizes, stops) if size > 0]


def train_ppo(
    env_id: str,
    setting: Mapping[str, Any],
    config: PPOConfig,
    seed: int,
    *,
    max_episode_steps: int,
    env_kwargs: Mapping[str, Any] | None = None,
) -> PPOResult:
    """Train one actor on ``config.n_envs`` copies of physics ``setting`` ({} = default); deterministic given seed."""
    generator = torch.Generator().manual_seed(int(seed))
    envs = make_vector_env(env_id, config.n_envs, max_episode_steps, [dict(setting)] * config.n_envs, env_kwargs)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core per expert; also makes results independent of the host's thread count
    try:
        return _train(envs, config, seed, generator)
    finally:
        torch.set_num_threads(threads)
        envs.close()


def reset_seeded(envs: gym.vector.VectorEnv, seeds: list[int]) -> np.ndarray:
    """Reset with one seed per sub-env where the vector env keeps per-sub-env streams, else with one derived seed
    (the HIV simulator: one stream, used only by its efficacy noise)."""
    base = envs.unwrapped
    if isinstance(base, (gym.vector.SyncVectorEnv, gym.vector.AsyncVectorEnv)) or getattr(base, "per_sub_env_seeds",
                                                                                           False):
        obs, _ = envs.reset(seed=seeds)
    else:
        obs, _ = envs.reset(seed=int(np.random.SeedSequence(seeds).generate_state(1)[0]))
    return np.asarray(obs)


def _train(envs: gym.vector.VectorEnv, config: PPOConfig, seed: int, generator: torch.Generator) -> PPOResult:
    space = envs.single_action_space
    if not isinstance(space, gym.spaces.Discrete):
        raise ValidationError("env_id", f"PPO here needs a discrete action space, got {space}")
    obs_dim = int(np.prod(envs.single_observation_space.shape))
    actor = build_mlp(obs_dim, config.actor_hidden_sizes, int(space.n), config.activation, 0.01, generator)
    critic = build_mlp(obs_dim, config.critic_hidden_sizes, 1, config.activation, 1.0, generator)
    params = [*actor.parameters(), *critic.parameters()]
    optimizer = torch.optim.Adam(params, lr=config.learning_rate, eps=1e-5)

    n_envs, n_steps = config.n_envs, config.n_steps
    obs_buf = torch.zeros(n_steps, n_envs, obs_dim)
    actions_buf = torch.zeros(n_steps, n_envs, dtype=torch.long)
    log_probs_buf = torch.zeros(n_steps, n_envs)
    rewards_buf = torch.zeros(n_steps, n_envs)
    dones_buf = torch.zeros(n_steps, n_envs)  # 1 where the transition ended its episode (either way)
    values_buf = torch.zeros(n_steps, n_envs)
    valid_buf = torch.zeros(n_steps, n_envs, dtype=torch.bool)

    obs = torch.as_tensor(reset_seeded(envs, expert_env_seeds(seed, n_envs)), dtype=torch.float32).reshape(n_envs, -1)
    # Next-step autoreset: the step after an episode ends only resets that sub-env (action ignored, no reward);
    # that pseudo-transition is masked out of the loss and cut off from the episode before it (done = 1 there).
    resetting = np.zeros(n_envs, dtype=bool)
    running = np.zeros(n_envs)
    finished: list[float] = []
    n_updates = max(1, config.total_timesteps // config.batch_size)
    for update in range(n_updates):
        if config.anneal_lr:
            optimizer.param_groups[0]["lr"] = config.learning_rate * (1.0 - update / n_updates)
        action_uniforms, sort_keys = update_uniforms(generator, config)
        for t in range(n_steps):
            with torch.no_grad():
                log_probs = torch.log_softmax(actor(obs), dim=-1)
                action = sample_with_uniforms(log_probs, action_uniforms[t])
                values_buf[t] = critic(obs).squeeze(-1)
            obs_buf[t], actions_buf[t] = obs, action
            log_probs_buf[t] = log_probs.gather(1, action[:, None]).squeeze(1)
            valid_buf[t] = torch.from_numpy(~resetting)
            next_obs, reward, terminated, truncated, _ = envs.step(action.numpy())
            next_obs = torch.as_tensor(np.asarray(next_obs), dtype=torch.float32).reshape(n_envs, -1)
            reward, done, cut = step_outcome(reward, terminated, truncated, resetting)
            running += reward
            scaled = reward * config.reward_scale
            if cut.any():  # a time-limit cut is not an ending: bootstrap with V(final obs), returned this step
                with torch.no_grad():
                    scaled[cut] += config.gamma * critic(next_obs[torch.from_numpy(cut)]).squeeze(-1).numpy()
            for i in np.flatnonzero(done):
                finished.append(float(running[i]))
                running[i] = 0.0
            rewards_buf[t] = torch.as_tensor(scaled, dtype=torch.float32)
            dones_buf[t] = torch.as_tensor(done, dtype=torch.float32)
            resetting = done
            obs = next_obs
        with torch.no_grad():
            advantages = gae(rewards_buf, values_buf, dones_buf, critic(obs).squeeze(-1), config.gamma,
                             config.gae_lambda)
        _update(actor, critic, optimizer, params, config, sort_keys, obs_buf.reshape(-1, obs_dim),
                actions_buf.reshape(-1), log_probs_buf.reshape(-1), advantages.reshape(-1),
                (advantages + values_buf).reshape(-1), values_buf.reshape(-1), valid_buf.reshape(-1))
    actor.requires_grad_(False)
    critic.requires_grad_(False)
    return PPOResult(actor, critic, finished, n_updates * config.batch_size)


def step_outcome(reward, terminated, truncated, resetting: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Next-step autoreset bookkeeping of one vector-env step: a sub-env that was ``resetting`` (its episode ended
    last step) gets reward 0 and ends nothing. Returns (reward float64, done, cut): ``cut`` marks time-limit cuts,
    which are not endings and get the critic's value of their final observation."""
    reward = np.where(resetting, 0.0, np.asarray(reward, dtype=np.float64))
    terminated = np.asarray(terminated) & ~resetting
    truncated = np.asarray(truncated) & ~resetting
    return reward, terminated | truncated, truncated & ~terminated


def gae(rewards: torch.Tensor, values: torch.Tensor, dones: torch.Tensor, last_value: torch.Tensor, gamma: float,
        lam: float) -> torch.Tensor:
    """GAE over [T, n_envs]; ``dones[t]`` stops bootstrapping from step t+1 (the next obs starts a new episode)."""
    advantages = torch.zeros_like(rewards)
    running = torch.zeros_like(last_value)
    next_value = last_value
    for t in reversed(range(rewards.shape[0])):
        keep = 1.0 - dones[t]
        delta = rewards[t] + gamma * next_value * keep - values[t]
        running = delta + gamma * lam * keep * running
        advantages[t] = running
        next_value = values[t]
    return advantages


def ppo_losses(config: PPOConfig, log_probs: torch.Tensor, actions: torch.Tensor, old_log_probs: torch.Tensor,
               advantages: torch.Tensor, value: torch.Tensor, returns: torch.Tensor, old_values: torch.Tensor,
               mask: torch.Tensor) -> torch.Tensor:
    """Per-expert PPO loss [E] of minibatches with a leading expert dimension: log_probs [E, b, A], the rest [E, b].

    Means (and the advantage normalisation's mean and unbiased std) run over the rows where ``mask`` is True; masked
    rows never touch the result (``torch.where``, so even a non-finite masked value cannot leak in).
    """
    count = mask.sum(dim=1).clamp(min=1)

    def mean(x: torch.Tensor) -> torch.Tensor:
        return torch.where(mask, x, 0.0).sum(dim=1) / count

    new_log_prob = log_probs.gather(2, actions.unsqueeze(2)).squeeze(2)
    ratio = (new_log_prob - old_log_probs).exp()
    centred = advantages - mean(advantages).unsqueeze(1)
    std = (torch.where(mask, centred, 0.0).square().sum(dim=1) / (count - 1).clamp(min=1)).sqrt()
    adv = centred / (std.unsqueeze(1) + 1e-8)
    policy_loss = mean(torch.max(-adv * ratio, -adv * ratio.clamp(1 - config.clip_coef, 1 + config.clip_coef)))
    clipped = old_values + (value - old_values).clamp(-config.clip_coef, config.clip_coef)
    value_loss = 0.5 * mean(torch.max((value - returns) ** 2, (clipped - returns) ** 2))
    entropy = mean(-(log_probs.exp() * log_probs).sum(-1))
    return policy_loss + config.value_coef * value_loss - config.entropy_coef * entropy


def _update(actor, critic, optimizer, params, config: PPOConfig, sort_keys, obs, actions, old_log_probs, advantages,
            returns, old_values, valid) -> None:
    for epoch in range(config.update_epochs):
        order = torch.argsort(sort_keys[epoch], stable=True)
        for start, stop in minibatch_bounds(len(order), config.n_minibatches):
            index = order[start:stop]
            index = index[valid[index]]  # the masked rows of the batched trainer, dropped
            if len(index) < 2:
                continue
            log_probs = torch.log_softmax(actor(obs[index]), dim=-1).unsqueeze(0)
            value = critic(obs[index]).squeeze(-1).unsqueeze(0)
            picked, picked_old, adv, ret, old_value = (t[index].unsqueeze(0) for t in (
                actions, old_log_probs, advantages, returns, old_values))
            loss = ppo_losses(config, log_probs, picked, picked_old, adv, value, ret, old_value,
                              torch.ones_like(picked, dtype=torch.bool))[0]
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(params, config.max_grad_norm)
            optimizer.step()
