"""Batched PPO equals per-expert PPO (same seeds, same updates); its per-expert optimiser pieces match torch's."""

import numpy as np
import pytest
import torch
from torch import nn

from dporl.experts.batched_ppo import BatchedAdam, clip_grad_norm_per_expert_, train_ppo_batched
from dporl.experts.policies import StackedMLPPolicy
from dporl.experts.ppo import PPOConfig, train_ppo
from dporl.utils.validation import ValidationError

SETTINGS = [{"gravity": 8.75, "force_mag": 9.0, "masscart": 0.8}, {"gravity": 9.8, "force_mag": 10.0, "masscart": 1.0},
            {"gravity": 11.0, "force_mag": 11.25, "masscart": 1.25}]


def assert_same_networks(stacked: StackedMLPPolicy, singles: list[nn.Sequential], atol: float) -> None:
    reference = StackedMLPPolicy.from_single(singles)
    for name, tensor in reference.state_dict().items():
        torch.testing.assert_close(stacked.state_dict()[name], tensor, rtol=0, atol=atol, msg=name)


# Two regimes: (a) the tiny case of the brief, episodes cut by a 20-step limit (value bootstrapping on truncation);
# (b) minibatches of 2 rows and 6-step episodes, so some experts' minibatches hold fewer than two valid rows and are
# skipped while the others step: per-expert Adam step counts diverge.
CASES = {
    "tiny": dict(config=PPOConfig(actor_hidden_sizes=[16, 16], critic_hidden_sizes=[16], n_envs=2, n_steps=32,
                                  total_timesteps=3 * 64, update_epochs=2, n_minibatches=2), max_episode_steps=20),
    "skips": dict(config=PPOConfig(actor_hidden_sizes=[8], critic_hidden_sizes=[8], n_envs=2, n_steps=8,
                                   total_timesteps=4 * 16, update_epochs=2, n_minibatches=8, learning_rate=1e-2),
                  max_episode_steps=6),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_batched_ppo_equals_per_expert_ppo(case):
    config, steps = CASES[case]["config"], CASES[case]["max_episode_steps"]
    seeds = [101, 202, 303]
    batched = train_ppo_batched("CartPole-v1", SETTINGS, config, seeds, max_episode_steps=steps)
    singles = [train_ppo("CartPole-v1", s, config, seed, max_episode_steps=steps) for s, seed in zip(SETTINGS, seeds)]
    # Float tolerance: batched and single matmuls and reductions round differently (~1e-7 relative per op); Adam
    # turns a relative gradient error r into a parameter error of at most ~r * lr per step (its step is ~lr * m/sqrt(v)),
    # so a few dozen steps leave differences far below 1e-5, while any real difference (one more or fewer step,
    # another minibatch, a shared statistic) moves parameters by ~lr = 2.5e-4 .. 1e-2 at once.
    assert_same_networks(batched.actor, [r.actor for r in singles], atol=1e-5)
    assert_same_networks(batched.critic, [r.critic for r in singles], atol=1e-5)
    assert batched.timesteps == singles[0].timesteps == config.total_timesteps // config.batch_size * config.batch_size
    assert batched.episodes.tolist() == [len(r.episode_returns) for r in singles]
    full = config.total_timesteps // config.batch_size * config.update_epochs * config.n_minibatches
    if case == "tiny":
        assert batched.optimizer_steps.tolist() == [full] * 3
    else:  # the skip path ran, differently per expert
        assert batched.optimizer_steps.max() < full and len(set(batched.optimizer_steps.tolist())) > 1


def test_batched_ppo_moves_parameters_and_a_batch_does_not_depend_on_its_neighbours():
    config = CASES["tiny"]["config"]
    three = train_ppo_batched("CartPole-v1", SETTINGS, config, [1, 2, 3], max_episode_steps=20)
    alone = train_ppo_batched("CartPole-v1", SETTINGS[1:2], config, [2], max_episode_steps=20)
    for name, tensor in alone.actor.state_dict().items():
        torch.testing.assert_close(three.actor.state_dict()[name][1:2], tensor, rtol=0, atol=1e-5)
    untrained = train_ppo_batched("CartPole-v1", SETTINGS, PPOConfig(**{**config.__dict__, "learning_rate": 1e-12}),
                                  [1, 2, 3], max_episode_steps=20)
    moved = max((three.actor.state_dict()[k] - v).abs().max().item() for k, v in untrained.actor.state_dict().items())
    assert moved > 1e-3  # ~lr per Adam step over 6 steps


def test_batched_adam_equals_torch_adam_per_expert_with_skips():
    torch.manual_seed(0)
    start = torch.randn(3, 4, 5)
    stacked = start.clone().requires_grad_(True)
    singles = [start[e].clone().requires_grad_(True) for e in range(3)]
    optimizers = [torch.optim.Adam([p], lr=lr, eps=1e-5) for p, lr in zip(singles, (1e-3, 1e-2, 5e-2))]
    adam = BatchedAdam([stacked], eps=1e-5)
    lr = torch.tensor([1e-3, 1e-2, 5e-2], dtype=torch.float64)
    for step in range(6):
        grads = torch.randn(3, 4, 5)
        active = torch.tensor([True, step % 2 == 0, step != 3])
        stacked.grad = grads.clone()
        adam.step(lr, active)
        for e in range(3):
            if active[e]:
                singles[e].grad = grads[e].clone()
                optimizers[e].step()
    # float32 Adam with float64 vs float32 bias-correction scalars: ~1e-7 relative of a step of size lr.
    torch.testing.assert_close(stacked.detach(), torch.stack([p.detach() for p in singles]), rtol=1e-6, atol=1e-7)
    assert adam.steps.tolist() == [6, 3, 5]


def test_per_expert_clipping_equals_torch_clipping():
    torch.manual_seed(1)
    weights, biases = torch.randn(3, 4, 2), torch.randn(3, 2)
    for p in (weights, biases):
        p.grad = torch.randn_like(p) * torch.tensor([0.1, 1.0, 10.0]).view(-1, *[1] * (p.dim() - 1))
    expected = []
    for e in range(3):
        w, b = weights[e].clone(), biases[e].clone()
        w.grad, b.grad = weights.grad[e].clone(), biases.grad[e].clone()
        nn.utils.clip_grad_norm_([w, b], 0.5)
        expected.append((w.grad, b.grad))
    norms = clip_grad_norm_per_expert_([weights, biases], 0.5)
    assert norms[0] < 0.5 < norms[1]  # one expert under the limit (unchanged), two clipped
    for e in range(3):
        torch.testing.assert_close(weights.grad[e], expected[e][0])
        torch.testing.assert_close(biases.grad[e], expected[e][1])


def test_batched_ppo_validates_inputs():
    with pytest.raises(ValidationError, match="settings"):
        train_ppo_batched("CartPole-v1", SETTINGS, PPOConfig(), [1, 2], max_episode_steps=10)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_batched_ppo_on_cuda_matches_cpu():
    config = CASES["tiny"]["config"]
    cpu = train_ppo_batched("CartPole-v1", SETTINGS, config, [1, 2, 3], max_episode_steps=20)
    gpu = train_ppo_batched("CartPole-v1", SETTINGS, config, [1, 2, 3], max_episode_steps=20, device="cuda")
    for name, tensor in cpu.actor.state_dict().items():
        torch.testing.assert_close(gpu.actor.state_dict()[name], tensor, rtol=0, atol=1e-4)
