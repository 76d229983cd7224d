"""trainer.device end to end: the device name is checked before anything runs; on CUDA (tests skip without it) the
engine, the trainer and the evaluation run on the GPU; the DP-SGD noise of CUDA parameters is drawn on the device
(Philox re-keyed per draw from the stream's device key, see dporl.privacy.noise), every other secret draw stays on
its CPU generator (the release's CUDA test is in test_stable_prefix.py)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dporl.algos.base import LossForm, PrivateAlgorithm
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


class _QNet(PrivateAlgorithm):
    privacy_unit = "expert"
    loss_form = LossForm.ROW_LOSSES
    batch_keys = ("obs", "actions", "rewards")
    policy_kind = None

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
def test_noise_for_cuda_parameters_is_drawn_on_the_device_reproducibly_and_fresh_per_draw():
    params = [torch.empty(300, 200, device="cuda"), torch.empty(200, device="cuda")]
    noise = SecretRoot(5).noise("train/noise")
    draws = noise.gaussian_like(params, 2.0)
    assert [d.device.type for d in draws] == ["cuda", "cuda"] and [d.shape for d in draws] == [p.shape for p in params]
    flat = torch.cat([d.flatten() for d in draws]).double()
    # Sample std of 60200 normal draws: standard error 2 / sqrt(2 * 60200) ~ 0.006; 5 standard errors.
    assert abs(float(flat.std()) - 2.0) < 0.03
    again = SecretRoot(5).noise("train/noise").gaussian_like(params, 2.0)  # a fixed seed reproduces exactly
    assert all(torch.equal(a, b) for a, b in zip(draws, again))
    following = torch.cat([d.flatten() for d in noise.gaussian_like(params, 2.0)]).double()
    assert abs(float(torch.corrcoef(torch.stack([flat, following]))[0, 1])) < 5 / len(flat) ** 0.5
    assert noise.state_dict()["device_draws"] == 2
    cpu = SecretRoot(5).noise("train/noise")
    cpu.device_draws = False  # the CPU stream copied: the numbers a CPU run draws
    copied = cpu.gaussian_like(params, 2.0)
    assert copied[0].device.type == "cuda" and not torch.equal(copied[0], draws[0])
    expected = SecretRoot(5).noise("train/noise").gaussian(60200, 2.0)
    assert torch.equal(torch.cat([c.flatten() for c in copied]).cpu(), expected)


@cuda
def test_torch_keys_each_device_draw_by_the_whole_seed_and_offset():
    """The key space the noise module claims: the 64-bit seed (top bit included) and the offset's high bits each
    change the draw; the same (seed, offset) gives the same numbers."""
    from dporl.privacy.noise import _device_normal

    generator, device = torch.Generator(device="cuda"), torch.device("cuda", torch.cuda.current_device())
    seed, offset = 2**63 + 12345, 2**62 + 4 * 999

    def draw(s, o):
        return _device_normal((1 << 16,), 1.0, torch.float32, device, generator, s, o)

    base = draw(seed, offset)
    assert torch.equal(base, draw(seed, offset))
    for other in [draw(seed ^ 2**63, offset), draw(seed ^ 1, offset), draw(seed, offset ^ 2**62), draw(seed, offset + 4 * 2**40)]:
        assert not torch.equal(other, base)
        assert abs(float(torch.corrcoef(torch.stack([other, base]).double())[0, 1])) < 5 / 2**8


@cuda
def test_device_noise_passes_ks_and_moments_at_1e7_draws():
    import math

    from scipy import stats

    n = 10**7
    params = [torch.empty(n // 2, device="cuda"), torch.empty(n - n // 2, device="cuda")]
    x = torch.cat([d.flatten() for d in SecretRoot(2024).noise("n").gaussian_like(params, 1.0)])
    cdf = torch.special.ndtr(torch.sort(x).values.double())
    ranks = torch.arange(1, n + 1, dtype=torch.float64, device="cuda") / n
    statistic = max(float((ranks - cdf).max()), float((cdf - (ranks - 1 / n)).max()))
    assert stats.kstwo.sf(statistic, n) > 1e-3, statistic
    x = x.double()
    mean, var = float(x.mean()), float(x.var())
    z = (x - mean) / math.sqrt(var)
    assert abs(mean) < 5 / math.sqrt(n) and abs(var - 1) < 5 * math.sqrt(2 / n)
    assert abs(float(z.pow(3).mean())) < 5 * math.sqrt(6 / n)
    assert abs(float(z.pow(4).mean()) - 3) < 5 * math.sqrt(24 / n)


@cuda
def test_noise_for_cuda_parameters_is_never_drawn_ahead_on_the_cpu():
    model = nn.Linear(4, 3).cuda()
    engine = DPSGDEngine(model, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=2.0,
                         noise=SecretRoot(1).noise("n"))
    assert not engine.prefetch_noise
    assert not engine.noise.prefetch_like(list(model.parameters()), 1.0)
    engine.close()


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
def test_cuda_runs_with_a_fixed_noise_seed_reproduce_each_other(tmp_path):
    """Same secret streams: the same batches (CPU sampler) and the same device noise on one device type."""
    results = []
    for name in ["first", "second"]:
        trainer = _trainer(tmp_path / name, "cuda")
        trainer.fit()
        results.append([p.detach().cpu() for p in trainer.algorithm.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@cuda
def test_evaluation_runs_a_cuda_policy():
    """(The release on CUDA: tests/test_stable_prefix.py::test_fresh_release_with_experts_on_cuda.)"""
    import gymnasium as gym

    from dporl.algos.cql import CQLConfig, DiscreteCQLModule
    from dporl.eval.returns import evaluate_returns

    module = DiscreteCQLModule(4, 2, CQLConfig(hidden_sizes=[16])).cuda()
    env = gym.make_vec("CartPole-v1", num_envs=2, vectorization_mode="sync")
    try:
        stats = evaluate_returns(module.act, env, episodes=2, seed=0)
    finally:
        env.close()
    assert stats.n == 2 and stats.mean > 0
