"""Compact discrete-action PPO (Schulman et al. 2017), used to train the paper's experts on physics variants.

Clipped surrogate objective, GAE(lambda) advantages (normalised per minibatch), clipped value loss, entropy bonus,
global gradient-norm clipping, linear learning-rate annealing, separate actor and critic MLPs with orthogonal
initialisation (the CleanRL recipe). The ``n_envs`` copies run in one vector env (numpy-batched for CartPole and
HIV) in next-step autoreset mode: the pseudo-step that resets a finished sub-env is masked out; an episode cut off by
its time limit is bootstrapped with the critic's value of its true final observation (truncation is not termination).

All randomness comes from one ``torch.Generator`` and the env seeds derived from ``seed`` (no global RNG), and the
training runs single-threaded, so a (setting, seed) pair gives the same actor in-process and in a Ray worker.
The actor is an ``nn.Sequential(Linear, act, ..., Linear)`` of logits, ready for ``StackedMLPPolicy.from_single``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Mapping

import gymnasium as gym
import numpy as np
import torch
from torch import nn

from dporl.experts.collect import make_vector_env
from dporl.experts.expert_set import sample_from_log_probs
from dporl.utils.validation import ValidationError, check_positive, check_probability


@dataclass
class PPOConfig:
    """Defaults: CleanRL's classic-control PPO. The paper's actors are (512, 256, 64); HIV (512,)."""

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
    episode_returns: list[float]  # training episodes' returns, in completion order
    timesteps: int


def train_ppo(
    env_id: str,
    setting: Mapping[str, Any],
    config: PPOConfig,
    seed: int,
    *,
    max_episode_steps: int,
    env_kwargs: Mapping[str, Any] | None = None,
) -> PPOResult:
    """Train one actor on ``config.n_envs`` copies of physics ``setting`` ({} = default); deterministic given seed.

    The copies form one batched vector env where the environment has one (CartPole, HIV: numpy over sub-envs),
    a ``SyncVectorEnv`` otherwise.
    """
    generator = torch.Generator().manual_seed(seed)
    envs = make_vector_env(env_id, config.n_envs, max_episode_steps, [dict(setting)] * config.n_envs, env_kwargs)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one core per expert; also makes results independent of the host's thread count
    try:
        return _train(envs, config, seed, generator)
    finally:
        torch.set_num_threads(threads)
        envs.close()


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

    obs, _ = envs.reset(seed=seed)
    obs = torch.as_tensor(np.asarray(obs), dtype=torch.float32).reshape(n_envs, -1)
    # Next-step autoreset: the step after an episode ends only resets that sub-env (action ignored, no reward);
    # that pseudo-transition is masked out of the loss and cut off from the episode before it (done = 1 there).
    resetting = np.zeros(n_envs, dtype=bool)
    running = np.zeros(n_envs)
    finished: list[float] = []
    n_updates = max(1, config.total_timesteps // config.batch_size)
    for update in range(n_updates):
        if config.anneal_lr:
            optimizer.param_groups[0]["lr"] = config.learning_rate * (1.0 - update / n_updates)
        for t in range(n_steps):
            with torch.no_grad():
                log_probs = torch.log_softmax(actor(obs), dim=-1)
                action = sample_from_log_probs(log_probs, generator)
                values_buf[t] = critic(obs).squeeze(-1)
            obs_buf[t], actions_buf[t] = obs, action
            log_probs_buf[t] = log_probs.gather(1, action[:, None]).squeeze(1)
            valid_buf[t] = torch.from_numpy(~resetting)
            next_obs, reward, terminated, truncated, _ = envs.step(action.numpy())
            next_obs = torch.as_tensor(np.asarray(next_obs), dtype=torch.float32).reshape(n_envs, -1)
            reward = np.where(resetting, 0.0, np.asarray(reward, dtype=np.float64))
            terminated = np.asarray(terminated) & ~resetting
            truncated = np.asarray(truncated) & ~resetting
            running += reward
            cut = truncated & ~terminated
            scaled = reward * config.reward_scale
            if cut.any():  # a time-limit cut is not an ending: bootstrap with V(final obs), returned this step
                with torch.no_grad():
                    scaled[cut] += config.gamma * critic(next_obs[torch.from_numpy(cut)]).squeeze(-1).numpy()
            done = terminated | truncated
            for i in np.flatnonzero(done):
                finished.append(float(running[i]))
                running[i] = 0.0
            rewards_buf[t] = torch.as_tensor(scaled, dtype=torch.float32)
            dones_buf[t] = torch.as_tensor(done, dtype=torch.float32)
            resetting = done
            obs = next_obs
        with torch.no_grad():
            advantages = _gae(rewards_buf, values_buf, dones_buf, critic(obs).squeeze(-1), config.gamma,
                              config.gae_lambda)
        valid = valid_buf.reshape(-1)
        _update(actor, critic, optimizer, params, config, generator, obs_buf.reshape(-1, obs_dim)[valid],
                actions_buf.reshape(-1)[valid], log_probs_buf.reshape(-1)[valid], advantages.reshape(-1)[valid],
                (advantages + values_buf).reshape(-1)[valid], values_buf.reshape(-1)[valid])
    actor.requires_grad_(False)
    return PPOResult(actor, finished, n_updates * config.batch_size)


def _gae(rewards: torch.Tensor, values: torch.Tensor, dones: torch.Tensor, last_value: torch.Tensor, gamma: float,
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


def _update(actor, critic, optimizer, params, config: PPOConfig, generator, obs, actions, old_log_probs, advantages,
            returns, old_values) -> None:
    rows = len(actions)  # valid transitions of this rollout (reset steps removed)
    for _ in range(config.update_epochs):
        order = torch.randperm(rows, generator=generator)
        for index in order.tensor_split(config.n_minibatches):
            if len(index) < 2:
                continue
            log_probs = torch.log_softmax(actor(obs[index]), dim=-1)
            new_log_prob = log_probs.gather(1, actions[index, None]).squeeze(1)
            ratio = (new_log_prob - old_log_probs[index]).exp()
            adv = advantages[index]
            adv = (adv - adv.mean()) / (adv.std() + 1e-8)
            policy_loss = torch.max(-adv * ratio, -adv * ratio.clamp(1 - config.clip_coef, 1 + config.clip_coef)).mean()
            value = critic(obs[index]).squeeze(-1)
            clipped = old_values[index] + (value - old_values[index]).clamp(-config.clip_coef, config.clip_coef)
            value_loss = 0.5 * torch.max((value - returns[index]) ** 2, (clipped - returns[index]) ** 2).mean()
            entropy = -(log_probs.exp() * log_probs).sum(-1).mean()
            loss = policy_loss + config.value_coef * value_loss - config.entropy_coef * entropy
            optimizer.zero_grad()
            loss.backward()
            nn.utils.clip_grad_norm_(params, config.max_grad_norm)
            optimizer.step()
