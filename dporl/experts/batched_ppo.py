"""Batched PPO: E experts trained as ONE stacked model, each on its own physics setting, in one vector env.

The expert-level paper (Sharma et al. 2024, Section 6) trains thousands of PPO agents, one per
(physics setting, seed). One process per agent pays Python and small-matmul overheads thousands of times; here every
parameter carries a leading expert axis (the ``StackedMLPPolicy`` layout that ``ExpertSet`` stores: a layer is one
``torch.baddbmm`` over experts) and one vector env holds ``E * n_envs`` sub-envs, expert e's ``n_envs`` copies carrying
its physics (numpy-batched for CartPole, Acrobot and HIV; Box2D sub-envs across worker processes for LunarLander).

Everything that is per-agent in PPO stays per-expert: minibatch order, advantage normalisation (masked mean and std
within the expert's minibatch), the loss (a sum of per-expert losses, whose gradient w.r.t. expert e's parameters is
expert e's gradient), gradient clipping (global norm over expert e's parameters), Adam moments, step counts and
bias corrections (``BatchedAdam``), and the learning-rate schedule (a per-expert tensor). Randomness follows
``dporl.experts.ppo``'s protocol, a function of each expert's seed only, so expert e trained in a batch of thousands
equals ``dporl.experts.ppo.train_ppo`` run alone with the same seed (tested, to float tolerance; HIV with efficacy
noise is the exception: its simulator draws that noise from one stream per vector env). The same holds across
chunkings: a batch of 500 and one of 4000 give the same experts.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

import gymnasium as gym
import numpy as np
import torch
from tqdm.auto import tqdm

from dporl.envs.process_env import make_vector_env
from dporl.experts.expert_set import sample_with_uniforms
from dporl.experts.policies import StackedMLPPolicy
from dporl.experts.ppo import (
    PPOConfig,
    build_mlp,
    expert_env_seeds,
    gae,
    minibatch_bounds,
    ppo_losses,
    reset_seeded,
    step_outcome,
    update_uniforms,
)
from dporl.utils.validation import ValidationError


class BatchedAdam:
    """Adam (Kingma & Ba 2015; ``torch.optim.Adam``'s update, no weight decay) over parameters [E, ...].

    Moments are elementwise, hence per expert; step counts, bias corrections and learning rates are per expert, and
    ``step(lr, active)`` leaves experts with ``active[e] = False`` untouched (moments, count and parameters).
    """

    def __init__(self, params: Sequence[torch.Tensor], betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-5):
        self.params = list(params)
        n_experts = self.params[0].shape[0]
        if any(p.shape[0] != n_experts for p in self.params):
            raise ValidationError("params", "every parameter needs the same leading expert dimension")
        self.betas, self.eps = betas, eps
        self.exp_avg = [torch.zeros_like(p) for p in self.params]
        self.exp_avg_sq = [torch.zeros_like(p) for p in self.params]
        self.steps = torch.zeros(n_experts, dtype=torch.float64, device=self.params[0].device)

    @torch.no_grad()
    def step(self, lr: torch.Tensor, active: torch.Tensor | None = None) -> None:
        beta1, beta2 = self.betas
        everyone = active is None or bool(active.all())
        self.steps += 1 if everyone else active.to(self.steps.dtype)
        steps = self.steps.clamp(min=1)  # inactive experts that never stepped: any finite value (masked below)
        step_size = (lr.to(torch.float64) / (1 - beta1**steps)).to(self.params[0].dtype)
        correction = (1 - beta2**steps).sqrt().to(self.params[0].dtype)
        for param, exp_avg, exp_avg_sq in zip(self.params, self.exp_avg, self.exp_avg_sq):
            shape = (-1,) + (1,) * (param.dim() - 1)
            grad = param.grad
            if everyone:
                exp_avg.lerp_(grad, 1 - beta1)
                exp_avg_sq.mul_(beta2).addcmul_(grad, grad, value=1 - beta2)
            else:
                keep = active.view(shape)
                exp_avg.copy_(torch.where(keep, exp_avg.lerp(grad, 1 - beta1), exp_avg))
                exp_avg_sq.copy_(torch.where(keep, exp_avg_sq * beta2 + (1 - beta2) * grad * grad, exp_avg_sq))
            denom = (exp_avg_sq.sqrt() / correction.view(shape)).add_(self.eps)
            update = exp_avg / denom * step_size.view(shape)
            param.sub_(update if everyone else torch.where(active.view(shape), update, 0.0))


def clip_grad_norm_per_expert_(params: Sequence[torch.Tensor], max_norm: float) -> torch.Tensor:
    """``nn.utils.clip_grad_norm_`` for each expert: scale expert e's gradients by min(1, max_norm / (norm_e + 1e-6))
    where norm_e is the global L2 norm over all of expert e's gradients. Returns the norms [E]."""
    squares = sum(p.grad.reshape(p.shape[0], -1).square().sum(dim=1) for p in params)
    norms = squares.sqrt()
    coef = (max_norm / (norms + 1e-6)).clamp(max=1.0)
    for p in params:
        p.grad.mul_(coef.view((-1,) + (1,) * (p.dim() - 1)))
    return norms


@dataclass
class BatchedPPOResult:
    actor: StackedMLPPolicy  # E frozen actors (logits), expert order as given
    critic: StackedMLPPolicy  # E frozen critics (one output: the value)
    recent_returns: np.ndarray  # [E] mean return of the training episodes that ended during the last update (nan: none)
    episodes: np.ndarray  # [E] training episodes completed
    optimizer_steps: np.ndarray  # [E] Adam steps taken (minibatches with fewer than two valid rows are skipped)
    timesteps: int  # per expert


def train_ppo_batched(
    env_id: str,
    settings: Sequence[Mapping[str, Any]],
    config: PPOConfig,
    seeds: Sequence[int],
    *,
    max_episode_steps: int,
    env_kwargs: Mapping[str, Any] | None = None,
    device: str | torch.device = "cpu",
    env_workers: int = 1,
    progress: bool = False,
) -> BatchedPPOResult:
    """Train expert e on physics ``settings[e]`` with seed ``seeds[e]``; expert e equals ``train_ppo(env_id,
    settings[e], config, seeds[e], ...)``. ``env_workers > 1`` steps the sub-envs in that many processes (Box2D)."""
    n_experts = len(seeds)
    if n_experts < 1 or len(settings) != n_experts:
        raise ValidationError("settings", f"need one setting per seed, got {len(settings)} settings, {n_experts} seeds")
    n_envs, n_steps = config.n_envs, config.n_steps
    device = torch.device(device)
    envs = make_vector_env(env_id, n_experts * n_envs, max_episode_steps,
                           [dict(s) for s in settings for _ in range(n_envs)], env_kwargs, env_workers)
    try:
        space = envs.single_action_space
        if not isinstance(space, gym.spaces.Discrete):
            raise ValidationError("env_id", f"PPO here needs a discrete action space, got {space}")
        obs_dim = int(np.prod(envs.single_observation_space.shape))
        generators = [torch.Generator().manual_seed(int(seed)) for seed in seeds]
        actor, critic = _stacked_networks(config, obs_dim, int(space.n), generators, device)
        trainer = _Trainer(envs, config, actor, critic, generators, n_experts, obs_dim, device)
        obs = reset_seeded(envs, [s for seed in seeds for s in expert_env_seeds(seed, n_envs)])
        trainer.run(obs, progress, f"batched PPO ({env_id}, {n_experts} experts)")
    finally:
        envs.close()
    actor.requires_grad_(False)
    critic.requires_grad_(False)
    recent = np.where(trainer.last_count > 0, trainer.last_sum / np.maximum(trainer.last_count, 1), np.nan)
    return BatchedPPOResult(actor.cpu(), critic.cpu(), recent, trainer.episodes,
                            trainer.optimizer.steps.cpu().numpy().astype(np.int64), trainer.n_updates * config.batch_size)


def _stacked_networks(config: PPOConfig, obs_dim: int, n_actions: int, generators: list[torch.Generator],
                      device: torch.device) -> tuple[StackedMLPPolicy, StackedMLPPolicy]:
    """Each expert's actor then critic drawn from its own generator, exactly as ``train_ppo`` draws them."""
    actors, critics = [], []
    for generator in generators:
        actors.append(build_mlp(obs_dim, config.actor_hidden_sizes, n_actions, config.activation, 0.01, generator))
        critics.append(build_mlp(obs_dim, config.critic_hidden_sizes, 1, config.activation, 1.0, generator))
    return (StackedMLPPolicy.from_single(actors).to(device).requires_grad_(True),
            StackedMLPPolicy.from_single(critics).to(device).requires_grad_(True))


class _Trainer:
    """The rollout / update loop of ``train_ppo`` with an expert axis in front of every tensor."""

    def __init__(self, envs, config: PPOConfig, actor: StackedMLPPolicy, critic: StackedMLPPolicy,
                 generators: list[torch.Generator], n_experts: int, obs_dim: int, device: torch.device):
        self.envs, self.config, self.actor, self.critic = envs, config, actor, critic
        self.generators, self.n_experts, self.obs_dim, self.device = generators, n_experts, obs_dim, device
        self.params = [*actor.parameters(), *critic.parameters()]
        self.optimizer = BatchedAdam(self.params, eps=1e-5)
        self.n_updates = max(1, config.total_timesteps // config.batch_size)
        self.expert_of_slot = np.repeat(np.arange(n_experts), config.n_envs)
        self.episodes = np.zeros(n_experts, dtype=np.int64)
        self.last_sum = np.zeros(n_experts)
        self.last_count = np.zeros(n_experts, dtype=np.int64)

    def run(self, first_obs: np.ndarray, progress: bool, description: str) -> None:
        config, n_slots = self.config, self.n_experts * self.config.n_envs
        obs = torch.as_tensor(first_obs, dtype=torch.float32).reshape(n_slots, -1).to(self.device)
        resetting = np.zeros(n_slots, dtype=bool)
        running = np.zeros(n_slots)
        for update in tqdm(range(self.n_updates), desc=description, unit="update", disable=not progress):
            fraction = 1.0 - update / self.n_updates if config.anneal_lr else 1.0
            lr = torch.full((self.n_experts,), config.learning_rate * fraction, dtype=torch.float64,
                            device=self.device)
            draws = [update_uniforms(generator, config) for generator in self.generators]
            action_uniforms = torch.stack([d[0] for d in draws]).to(self.device)  # [E, T, n_envs]
            sort_keys = torch.stack([d[1] for d in draws]).to(self.device)  # [E, epochs, rows]
            self.last_sum[:], self.last_count[:] = 0.0, 0
            batch, obs, resetting, running = self._rollout(obs, resetting, running, action_uniforms)
            self._update(batch, sort_keys, lr)

    def _rollout(self, obs, resetting, running, action_uniforms):
        config, E, n, T, d = self.config, self.n_experts, self.config.n_envs, self.config.n_steps, self.obs_dim
        obs_buf = torch.zeros(T, E, n, d, device=self.device)
        actions_buf = torch.zeros(T, E, n, dtype=torch.long, device=self.device)
        log_probs_buf = torch.zeros(T, E, n, device=self.device)
        rewards_buf = torch.zeros(T, E * n, device=self.device)
        dones_buf = torch.zeros(T, E * n, device=self.device)
        values_buf = torch.zeros(T, E, n, device=self.device)
        valid_buf = torch.zeros(T, E, n, dtype=torch.bool, device=self.device)
        for t in range(T):
            states = obs.view(E, n, d)
            with torch.no_grad():
                log_probs = torch.log_softmax(self.actor.forward_paired(states), dim=-1)
                action = sample_with_uniforms(log_probs, action_uniforms[:, t])
                values_buf[t] = self.critic.forward_paired(states).squeeze(-1)
            obs_buf[t], actions_buf[t] = states, action
            log_probs_buf[t] = log_probs.gather(2, action.unsqueeze(2)).squeeze(2)
            valid_buf[t] = torch.from_numpy(~resetting).view(E, n)
            next_obs, reward, terminated, truncated, _ = self.envs.step(action.reshape(-1).cpu().numpy())
            next_obs = torch.as_tensor(np.asarray(next_obs), dtype=torch.float32).reshape(E * n, -1).to(self.device)
            reward, done, cut = step_outcome(reward, terminated, truncated, resetting)
            running += reward
            scaled = reward * config.reward_scale
            if cut.any():  # time-limit cut: bootstrap with V(final obs), as train_ppo does
                with torch.no_grad():
                    final_values = self.critic.forward_paired(next_obs.view(E, n, d)).reshape(-1).cpu().numpy()
                scaled[cut] += config.gamma * final_values[cut]
            if done.any():
                ended = np.flatnonzero(done)
                experts = self.expert_of_slot[ended]
                np.add.at(self.last_sum, experts, running[ended])
                np.add.at(self.last_count, experts, 1)
                np.add.at(self.episodes, experts, 1)
                running[ended] = 0.0
            rewards_buf[t] = torch.as_tensor(scaled, dtype=torch.float32, device=self.device)
            dones_buf[t] = torch.as_tensor(done, dtype=torch.float32, device=self.device)
            resetting = done
            obs = next_obs
        with torch.no_grad():
            last_value = self.critic.forward_paired(obs.view(E, n, d)).reshape(-1)
            advantages = gae(rewards_buf, values_buf.reshape(T, E * n), dones_buf, last_value, config.gamma,
                             config.gae_lambda).view(T, E, n)

        def per_expert(x: torch.Tensor) -> torch.Tensor:  # [T, E, n, ...] -> [E, T * n, ...], rows t * n + j
            return x.transpose(0, 1).reshape(E, T * n, *x.shape[3:])

        batch = {
            "obs": per_expert(obs_buf), "actions": per_expert(actions_buf), "log_probs": per_expert(log_probs_buf),
            "advantages": per_expert(advantages), "returns": per_expert(advantages + values_buf),
            "values": per_expert(values_buf), "valid": per_expert(valid_buf),
        }
        return batch, obs, resetting, running

    def _update(self, batch: dict[str, torch.Tensor], sort_keys: torch.Tensor, lr: torch.Tensor) -> None:
        config, E = self.config, self.n_experts
        experts = torch.arange(E, device=self.device).unsqueeze(1)
        for epoch in range(config.update_epochs):
            order = torch.argsort(sort_keys[:, epoch], dim=1, stable=True)  # [E, rows]
            for start, stop in minibatch_bounds(order.shape[1], config.n_minibatches):
                index = order[:, start:stop]
                picked = {name: value[experts, index] for name, value in batch.items()}
                mask = picked["valid"]
                active = mask.sum(dim=1) >= 2  # train_ppo skips a minibatch with fewer than two valid rows
                if not bool(active.any()):
                    continue
                log_probs = torch.log_softmax(self.actor.forward_paired(picked["obs"]), dim=-1)
                value = self.critic.forward_paired(picked["obs"]).squeeze(-1)
                losses = ppo_losses(config, log_probs, picked["actions"], picked["log_probs"], picked["advantages"],
                                    value, picked["returns"], picked["values"], mask)
                for param in self.params:
                    param.grad = None
                torch.where(active, losses, 0.0).sum().backward()
                clip_grad_norm_per_expert_(self.params, config.max_grad_norm)
                self.optimizer.step(lr, None if bool(active.all()) else active)
