"""trainer.device end to end: the device name is checked before anything runs; on CUDA (tests skip without it) the
engine, the trainer and the evaluation run on the GPU while every secret draw stays on its CPU generator (the
release's CUDA test is in test_stable_prefix.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dporl.privacy.dpsgd import DPSGDEngine
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.noise import NoiseSource
from dporl.privacy.randomness import SecretRoot
from dporl.privacy.samplers import PoissonUnitSource
from dporl.train.config import DPConfig, TrainerConfig
from dporl.train.trainer import Trainer
from dporl.utils.device import resolve_device
from dporl.utils.validation import ValidationError

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_device_names_are_checked_with_a_named_error():
    assert resolve_device("cpu") == torch.device("cpu")
    for bad in ["gpu", "cuda:x", "tpu"]:
        with pytest.raises(ValidationError) as info:
            resolve_device(bad, "trainer.device")
        assert info.value.field == "trainer.device"
    if not torch.cuda.is_available():  # a CPU build or machine: refused before anything is written
        with pytest.raises(ValidationError, match="CUDA is not available"):
            resolve_device("cuda", "trainer.device")


def test_trainer_refuses_an_unavailable_device_before_writing(tmp_path):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    with pytest.raises(ValidationError) as info:
        _trainer(tmp_path / "run", "cuda")
    assert info.value.field == "trainer.device"
    assert not (tmp_path / "run").exists()


class _QNet(nn.Module):
    privacy_unit = "expert"

    def __init__(self):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(4, 32), nn.ReLU(), nn.Linear(32, 2))

    def row_losses(self, batch):
        q = self.net(batch.data["obs"])
        return (q.gather(1, batch.data["actions"].unsqueeze(1)).squeeze(1) - batch.data["rewards"]) ** 2


def _source(n_units=64, rows=4):
    g = torch.Generator().manual_seed(0)
    data = {"obs": torch.randn(n_units * rows, 4, generator=g), "actions": torch.randint(0, 2, (n_units * rows,), generator=g),
            "rewards": torch.randn(n_units * rows, generator=g)}
    return PoissonUnitSource(data, torch.arange(n_units).repeat_interleave(rows), n_units, 0.25, rows_per_unit=2)


def _trainer(run_dir, device):
    torch.manual_seed(0)  # the same initial weights for every device
    return Trainer(
        _QNet(), _source(), config=TrainerConfig(max_steps=20, device=device, log_every=5, eval_every=10,
                                                 checkpoint_every=10, progress=False),
        dp=DPConfig(epsilon=5.0, delta=1e-5, noise_multiplier=4.0, noise_seed=7), ledger=PrivacyLedger(),
        run_dir=run_dir, pipeline="toy", pipeline_config={"toy": 1},
        evaluators={"norm": lambda module: {"weight_norm": float(module.net[0].weight.norm())}},
    )


@cuda
@pytest.mark.parametrize("mode", ["bookkeeping", "ghost", "opacus", "naive"])
def test_engine_on_cuda_matches_the_cpu_engine_without_noise(mode):
    torch.manual_seed(0)
    cpu_model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3))
    gpu_model = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3))
    gpu_model.load_state_dict(cpu_model.state_dict())
    gpu_model.cuda()
    x, unit_index = torch.randn(12, 5), torch.arange(6).repeat(2)
    grads = []
    for model, inputs in [(cpu_model, x), (gpu_model, x.cuda())]:
        with DPSGDEngine(model, max_grad_norm=0.5, noise_multiplier=0.0, expected_batch_size=6.0,
                         noise=NoiseSource(0), mode=mode) as engine:
            engine.private_backward(model(inputs).pow(2).sum(1), unit_index, 6)
        grads.append([p.grad.cpu() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)  # float32 on two devices: rounding only


@cuda
def test_noise_for_cuda_parameters_comes_from_the_cpu_stream_and_lands_on_the_gpu():
    params = [torch.empty(300, 200, device="cuda"), torch.empty(200, device="cuda")]
    noise = SecretRoot(5).noise("train/noise")
    draws = noise.gaussian_like(params, 2.0)
    assert [d.device.type for d in draws] == ["cuda", "cuda"] and [d.shape for d in draws] == [p.shape for p in params]
    flat = torch.cat([d.flatten() for d in draws]).double().cpu()
    # Sample std of 60200 normal draws: standard error 2 / sqrt(2 * 60200) ~ 0.006; 5 standard errors.
    assert abs(float(flat.std()) - 2.0) < 0.03
    again = SecretRoot(5).noise("train/noise").gaussian_like(params, 2.0)  # a fixed seed reproduces exactly
    assert all(torch.equal(a, b) for a, b in zip(draws, again))


@cuda
def test_private_training_runs_on_cuda_end_to_end(tmp_path):
    trainer = _trainer(tmp_path / "run", "cuda")
    result = trainer.fit()
    assert result.steps == 20 and next(trainer.algorithm.parameters()).device.type == "cuda"
    assert all(torch.isfinite(p).all() for p in trainer.algorithm.parameters())
    assert result.eval_history and result.privacy["guarantee"]["epsilon"] <= 5.0
    # The engine was closed: no hook is left on the module after fit.
    assert sum(len(m._forward_hooks) for m in trainer.algorithm.modules()) == 0


@cuda
def test_cuda_run_reproduces_the_cpu_run_up_to_float_rounding(tmp_path):
    """Same secret streams (CPU generators) on both devices: the same batches and the same noise."""
    results = []
    for device in ["cpu", "cuda"]:
        trainer = _trainer(tmp_path / device, device)
        trainer.fit()
        results.append([p.detach().cpu() for p in trainer.algorithm.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-3, atol=1e-4)


@cuda
def test_evaluation_runs_a_cuda_policy():
    """(The release on CUDA: tests/test_stable_prefix.py::test_fresh_release_with_experts_on_cuda.)"""
    import gymnasium as gym

    from dporl.algos.cql import CQLConfig, DiscreteCQL
    from dporl.eval.returns import evaluate_returns

    module = DiscreteCQL(4, 2, CQLConfig(hidden_sizes=[16])).cuda()
    env = gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync")
    try:
        stats = evaluate_returns(module.act, env, episodes=2, seed=0)
    finally:
        env.close()
    assert stats.n == 2 and stats.mean > 0
