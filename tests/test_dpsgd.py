import gc
import os
import weakref

import pytest
import torch
from torch import nn

from dporl.privacy.dpsgd import DPSGDEngine
from dporl.privacy.noise import NoiseSource
from dporl.utils.validation import ValidationError

MODES = ["bookkeeping", "ghost", "opacus", "naive"]


class QNet(nn.Module):
    def __init__(self, bias=True):
        super().__init__()
        self.q = nn.Sequential(nn.Linear(5, 16, bias=bias), nn.ReLU(), nn.Linear(16, 3, bias=bias))
        self.target = nn.Sequential(nn.Linear(5, 16), nn.ReLU(), nn.Linear(16, 3))
        self.target.requires_grad_(False)

    def row_losses(self, obs, actions, next_obs, rewards):
        q_all = self.q(obs)
        q_taken = q_all.gather(1, actions[:, None]).squeeze(1)
        with torch.no_grad():
            # the online net at s' under no_grad (double DQN) must not count as a second call
            best = self.q(next_obs).argmax(1, keepdim=True)
            y = rewards + 0.9 * self.target(next_obs).gather(1, best).squeeze(1)
        return (q_taken - y) ** 2 + torch.logsumexp(q_all, 1) - q_taken


def _batch(rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(rows, 5, generator=g), torch.randint(0, 3, (rows,), generator=g),
            torch.randn(rows, 5, generator=g), torch.randn(rows, generator=g))


def _reference(model, batch, unit_index, n_units, clip):
    """Independent reference: each unit's gradient by its own autograd pass on its mean loss."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    for u in range(n_units):
        mask = unit_index == u
        if not mask.any():
            continue
        loss = model.row_losses(*(t[mask] for t in batch)).mean()
        grads = torch.autograd.grad(loss, params)
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        factor = min(1.0, clip / (float(norm) + 1e-6))
        for t, g in zip(total, grads):
            t += factor * g
    return total


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows_per_unit", [1, 3])
@pytest.mark.parametrize("bias", [True, False])
def test_modes_match_per_unit_reference(mode, rows_per_unit, bias):
    torch.manual_seed(0)
    model = QNet(bias)
    n_units, clip, expected = 7, 0.5, 10.0
    batch = _batch(n_units * rows_per_unit)
    # interleave units so that a bug mixing neighbouring rows cannot pass
    unit_index = torch.arange(n_units).repeat(rows_per_unit)[torch.randperm(n_units * rows_per_unit)]
    want = _reference(model, batch, unit_index, n_units, clip)
    engine = DPSGDEngine(model, max_grad_norm=clip, noise_multiplier=0.0, expected_batch_size=expected,
                         noise=NoiseSource(0), mode=mode)
    stats = engine.private_backward(model.row_losses(*batch), unit_index, n_units)
    got = [p.grad * expected for p in model.parameters() if p.requires_grad]
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    assert stats.n_units == n_units and 0.0 <= stats.clip_fraction <= 1.0


@pytest.mark.parametrize("mode", MODES)
def test_uneven_units_and_units_without_rows(mode):
    torch.manual_seed(1)
    model = QNet()
    unit_index = torch.tensor([0, 0, 0, 2, 4, 4, 2, 0])  # units 1 and 3 were sampled but own no rows
    batch = _batch(len(unit_index), seed=3)
    want = _reference(model, batch, unit_index, 5, 0.3)
    engine = DPSGDEngine(model, max_grad_norm=0.3, noise_multiplier=0.0, expected_batch_size=1.0,
                         noise=NoiseSource(0), mode=mode)
    engine.private_backward(model.row_losses(*batch), unit_index, 5)
    for w, p in zip(want, [p for p in model.parameters() if p.requires_grad]):
        torch.testing.assert_close(p.grad, w, rtol=1e-4, atol=1e-5)


def test_each_unit_contribution_is_bounded_by_clip_norm():
    """A unit with a huge loss moves the summed gradient by at most C (the sensitivity the analysis assumes)."""
    torch.manual_seed(2)
    model = QNet()
    obs, actions, next_obs, rewards = _batch(6)
    engine = DPSGDEngine(model, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=1.0,
                         noise=NoiseSource(0))
    unit_index = torch.arange(6)
    engine.private_backward(model.row_losses(obs, actions, next_obs, rewards), unit_index, 6)
    with_all = torch.cat([p.grad.flatten() for p in engine.params])
    engine.private_backward(model.row_losses(obs[:5], actions[:5], next_obs[:5], rewards[:5]), unit_index[:5], 5)
    without = torch.cat([p.grad.flatten() for p in engine.params])
    rewards = rewards.clone()
    rewards[5] = 1e6
    engine.private_backward(model.row_losses(obs, actions, next_obs, rewards), unit_index, 6)
    with_outlier = torch.cat([p.grad.flatten() for p in engine.params])
    assert float((with_all - without).norm()) <= 1.0 + 1e-4
    assert float((with_outlier - without).norm()) <= 1.0 + 1e-4
    assert float((with_outlier - without).norm()) > 0.99  # the outlier is clipped to exactly C


def test_noise_has_the_calibrated_scale_and_empty_batches_are_pure_noise():
    model = nn.Sequential(nn.Linear(50, 40))
    engine = DPSGDEngine(model, max_grad_norm=2.0, noise_multiplier=3.0, expected_batch_size=4.0,
                         noise=NoiseSource(0))
    stats = engine.private_backward(torch.zeros(0), torch.zeros(0, dtype=torch.long), 0)
    flat = torch.cat([p.grad.flatten() for p in model.parameters()])
    # std should be sigma * C / B = 1.5; the sample std of n normal draws has standard error std / sqrt(2n).
    standard_error = 1.5 / (2 * len(flat)) ** 0.5
    assert abs(float(flat.std()) - 1.5) < 4 * standard_error
    assert abs(float(flat.mean())) < 4 * 1.5 / len(flat) ** 0.5
    assert stats.n_units == 0 and stats.noise_std == 6.0


def test_private_direction_and_write_gradients():
    model = nn.Linear(3, 2)
    engine = DPSGDEngine(model, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=2.0,
                         noise=NoiseSource(0))
    vectors = torch.tensor([[3.0, 4.0] + [0.0] * 6, [0.3, 0.4] + [0.0] * 6])
    direction = engine.private_direction(vectors)
    torch.testing.assert_close(direction[:2], torch.tensor([(0.6 + 0.3) / 2, (0.8 + 0.4) / 2]))
    assert engine.last_stats.clip_fraction == 0.5
    engine.write_gradients(direction)
    assert model.weight.grad.flatten()[:2].tolist() == pytest.approx(direction[:2].tolist())
    with pytest.raises(ValidationError):
        engine.write_gradients(torch.zeros(3))


def test_bookkeeping_refuses_non_linear_parameters_and_double_calls():
    class Raw(nn.Module):
        def __init__(self):
            super().__init__()
            self.theta = nn.Parameter(torch.zeros(3))

    with pytest.raises(ValidationError, match="opacus"):
        DPSGDEngine(Raw(), max_grad_norm=1, noise_multiplier=1, expected_batch_size=1, noise=NoiseSource(0))
    layer = nn.Linear(2, 1)
    engine = DPSGDEngine(layer, max_grad_norm=1, noise_multiplier=1, expected_batch_size=1, noise=NoiseSource(0))
    x = torch.randn(4, 2)
    losses = layer(x).squeeze(1) + layer(x).squeeze(1)
    with pytest.raises(ValidationError, match="2 times"):
        engine.private_backward(losses, torch.arange(4), 4)


def test_sequence_inputs_match_reference():
    torch.manual_seed(4)
    layer = nn.Linear(4, 3)
    x = torch.randn(6, 5, 4)  # rows with a time axis
    unit_index = torch.tensor([0, 1, 1, 2, 2, 2])

    def losses():
        return layer(x).pow(2).sum((1, 2))

    params = list(layer.parameters())
    want = [torch.zeros_like(p) for p in params]
    for u in range(3):
        grads = torch.autograd.grad(losses()[unit_index == u].mean(), params)
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        for w, g in zip(want, grads):
            w += min(1.0, 0.7 / float(norm)) * g
    for mode in ["bookkeeping", "ghost"]:
        engine = DPSGDEngine(layer, max_grad_norm=0.7, noise_multiplier=0.0, expected_batch_size=1.0,
                             noise=NoiseSource(0), mode=mode)
        engine.private_backward(losses(), unit_index, 3)
        for w, p in zip(want, params):
            torch.testing.assert_close(p.grad, w, rtol=1e-4, atol=1e-5)


def test_bad_arguments_name_their_field():
    layer = nn.Linear(2, 1)
    for kwargs, field in [({"max_grad_norm": 0}, "dp.max_grad_norm"), ({"noise_multiplier": -1}, "dp.noise_multiplier"),
                          ({"expected_batch_size": 0}, "expected_batch_size"), ({"mode": "fast"}, "dp.clipping")]:
        base = dict(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=1.0, noise=NoiseSource(0))
        base.update(kwargs)
        with pytest.raises(ValidationError) as info:
            DPSGDEngine(layer, **base)
        assert info.value.field == field
    engine = DPSGDEngine(layer, max_grad_norm=1, noise_multiplier=1, expected_batch_size=1, noise=NoiseSource(0))
    with pytest.raises(ValidationError) as info:
        engine.private_backward(layer(torch.randn(3, 2)).squeeze(1), torch.tensor([0, 1, 5]), 3)
    assert info.value.field == "unit_index"


@pytest.mark.parametrize("mode", ["bookkeeping", "ghost"])
def test_contiguous_blocks_with_empty_units_match_reference(mode):
    """The sampler's layout: equal contiguous blocks per unit, some sampled units owning no rows."""
    torch.manual_seed(5)
    model = QNet()
    unit_index = torch.tensor([0, 0, 2, 2, 3, 3, 6, 6])
    batch = _batch(len(unit_index), seed=8)
    want = _reference(model, batch, unit_index, 7, 0.4)
    engine = DPSGDEngine(model, max_grad_norm=0.4, noise_multiplier=0.0, expected_batch_size=1.0,
                         noise=NoiseSource(0), mode=mode)
    engine.private_backward(model.row_losses(*batch), unit_index, 7)
    for w, p in zip(want, [p for p in model.parameters() if p.requires_grad]):
        torch.testing.assert_close(p.grad, w, rtol=1e-4, atol=1e-5)


# ---------------------------------------------------------------------------------------------- engine hygiene
def _forward_hooks(module):
    return sum(len(m._forward_hooks) + len(m._backward_hooks) for m in module.modules())


def _dp_step(engine, model, x):
    out = model(x)  # the last Linear's output: what a tape records
    engine.private_backward(out.pow(2).sum(1), torch.arange(len(x)), len(x))
    return weakref.ref(out)


@pytest.mark.parametrize("mode", MODES)
def test_close_removes_every_hook_and_a_new_engine_works(mode):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    before = _forward_hooks(model)
    for _ in range(5):  # repeated engines on one module, each closed by its context manager
        with DPSGDEngine(model, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=4.0,
                         noise=NoiseSource(0), mode=mode) as engine:
            assert _forward_hooks(model) > before or mode == "naive"  # naive needs no hooks
            _dp_step(engine, model, torch.randn(4, 4))
        assert _forward_hooks(model) == before
    assert not any(hasattr(p, "grad_sample") for p in model.parameters())  # Opacus' attributes left with it
    assert not any(hasattr(m, "activations") for m in model.modules())
    with pytest.raises(ValidationError, match="closed"):
        engine.private_backward(model(torch.randn(2, 4)).sum(1), torch.arange(2), 2)
    engine.close()  # idempotent


def test_repeated_engines_on_one_module_retain_no_step_graphs():
    """Issue: a second engine on the same module kept every step's graph (+1 GB per 1000 steps).

    A forgotten engine (never closed, still referenced) must hold at most one step's activations; closed or
    dropped engines none. Counted as live layer outputs (weak references), which is what held the graphs.
    """
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 16), nn.ReLU(), nn.Linear(16, 2))
    kwargs = dict(max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=8.0, noise=NoiseSource(0))
    forgotten = DPSGDEngine(model, **kwargs)  # noqa: F841  (kept alive on purpose)
    outputs = []
    for _ in range(10):  # ten more engines in turn: dropped without close, 3 steps each
        engine = DPSGDEngine(model, **kwargs)
        outputs += [_dp_step(engine, model, torch.randn(8, 4)) for _ in range(3)]
    del engine
    gc.collect()
    live = sum(ref() is not None for ref in outputs)
    assert live <= 1, f"{live} of {len(outputs)} step graphs are still held"
    # Dropped engines removed their hooks: only the forgotten engine's remain (one per Linear).
    assert _forward_hooks(model) == 2
    forgotten.close()
    gc.collect()
    assert sum(ref() is not None for ref in outputs) == 0 and _forward_hooks(model) == 0


def test_trusted_layout_skips_no_check_it_can_do_on_the_host():
    """A library sampler's layout is trusted for the ids, but block sizes are checked (Python ints, no sync)."""
    from dporl.privacy.samplers import RowLayout

    layer = nn.Linear(3, 1)
    engine = DPSGDEngine(layer, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=1.0,
                         noise=NoiseSource(0))
    with pytest.raises(ValidationError) as info:
        engine.private_backward(layer(torch.randn(5, 3)).squeeze(1), torch.arange(5) // 2, 3, layout=RowLayout(2))
    assert info.value.field == "layout"
    with pytest.raises(ValidationError) as info:
        engine.private_backward(layer(torch.randn(4, 3)).squeeze(1), torch.arange(4), 3, layout=RowLayout(1))
    assert info.value.field == "layout"  # 4 one-row units cannot come from 3 sampled units

def _weighted_reference(model, batch, unit_index, n_units, clip, unit_weights):
    """Reference for row weights: each unit's own autograd gradient, clipped to ``clip``, THEN times its weight."""
    params = [p for p in model.parameters() if p.requires_grad]
    total, norms = [torch.zeros_like(p) for p in params], []
    for u in range(n_units):
        mask = unit_index == u
        if not mask.any():
            continue
        grads = torch.autograd.grad(model.row_losses(*(t[mask] for t in batch)).mean(), params)
        norm = torch.sqrt(sum(g.pow(2).sum() for g in grads))
        norms.append(float(norm))
        factor = min(1.0, clip / (float(norm) + 1e-6)) * float(unit_weights[u])
        for t, g in zip(total, grads):
            t += factor * g
    return total, max(norms)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("rows_per_unit", [1, 3])
def test_row_weights_scale_each_units_clipped_gradient_in_every_mode(mode, rows_per_unit):
    torch.manual_seed(2)
    model = QNet()
    n_units, clip = 6, 0.4
    batch = _batch(n_units * rows_per_unit, seed=5)
    unit_index = torch.arange(n_units).repeat(rows_per_unit)[torch.randperm(n_units * rows_per_unit)]
    unit_weights = torch.tensor([1.0, -1.0, 0.25, 0.0, -0.6, 0.9])
    want, max_norm = _weighted_reference(model, batch, unit_index, n_units, clip, unit_weights)
    engine = DPSGDEngine(model, max_grad_norm=clip, noise_multiplier=0.0, expected_batch_size=1.0,
                         noise=NoiseSource(0), mode=mode)
    stats = engine.private_backward(model.row_losses(*batch), unit_index, n_units, row_weights=unit_weights[unit_index])
    got = [p.grad for p in model.parameters() if p.requires_grad]
    for w, g in zip(want, got):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-5)
    assert stats.max_norm == pytest.approx(max_norm, rel=1e-4)  # statistics: the unweighted norms that were clipped


def test_weighted_contributions_differ_by_at_most_the_weight_difference_times_clip():
    # The sensitivity argument of reward-level Q-learning: same rows, weights w vs w' -> the clipped sums differ by
    # at most sum_u |w_u - w'_u| C (equality when every unit is clipped and all clipped gradients are parallel).
    torch.manual_seed(3)
    model = QNet()
    batch = _batch(8, seed=7)
    unit_index = torch.arange(8)
    w = torch.linspace(-1, 1, 8)
    w_prime = (w - 0.7).clamp(-1, 1)
    sums = []
    engine = DPSGDEngine(model, max_grad_norm=0.05, noise_multiplier=0.0, expected_batch_size=1.0, noise=NoiseSource(0))
    for weights in (w, w_prime):
        engine.private_backward(model.row_losses(*batch), unit_index, 8, row_weights=weights)
        sums.append(torch.cat([p.grad.reshape(-1) for p in model.parameters() if p.requires_grad]))
    assert float((sums[0] - sums[1]).norm()) <= float((w - w_prime).abs().sum()) * 0.05 * (1 + 1e-5)


def test_bad_row_weights_name_their_field():
    model = QNet()
    batch = _batch(4)
    engine = DPSGDEngine(model, max_grad_norm=1.0, noise_multiplier=0.0, expected_batch_size=1.0, noise=NoiseSource(0))
    for weights, match in [
        (torch.tensor([0.5, 1.5, 0.0, 0.0]), "row_weights"),  # |w| > 1 would scale past the clip norm
        (torch.tensor([0.5, float("nan"), 0.0, 0.0]), "row_weights"),
        (torch.ones(3), "row_weights"),
        (torch.tensor([0.5, 0.2, 0.0, 0.0]), "row_weights"),  # rows 0 and 1 form one unit with two weights
    ]:
        with pytest.raises(ValidationError, match=match):
            engine.private_backward(model.row_losses(*batch), torch.tensor([0, 0, 1, 2]), 3, row_weights=weights)


@pytest.mark.parametrize("mode", ["bookkeeping", "ghost"])
def test_row_weights_with_a_samplers_row_layout_match_checked_ids(mode):
    # A library source's RowLayout (contiguous blocks of rows_per_unit rows) skips the id checks; the weights must
    # still scale each block's clipped gradient exactly as with explicit, checked unit ids.
    import copy

    from dporl.privacy.samplers import RowLayout

    torch.manual_seed(4)
    model = QNet()
    batch = _batch(12, seed=9)
    unit_index = torch.arange(6).repeat_interleave(2)
    weights = torch.tensor([0.3, -1.0, 0.7, 0.0, 1.0, -0.2]).repeat_interleave(2)
    grads = []
    for layout in (None, RowLayout(rows_per_unit=2)):
        copy_ = copy.deepcopy(model)
        engine = DPSGDEngine(copy_, max_grad_norm=0.3, noise_multiplier=0.0, expected_batch_size=6.0,
                             noise=NoiseSource(0), mode=mode)
        engine.private_backward(copy_.row_losses(*batch), unit_index, 6, layout=layout, row_weights=weights)
        grads.append(torch.cat([p.grad.reshape(-1) for p in copy_.parameters() if p.requires_grad]))
    torch.testing.assert_close(grads[0], grads[1])
    with pytest.raises(ValidationError, match="share one weight"):
        DPSGDEngine(copy.deepcopy(model), max_grad_norm=0.3, noise_multiplier=0.0, expected_batch_size=6.0,
                    noise=NoiseSource(0), mode=mode).private_backward(
            model.row_losses(*batch), unit_index, 6, layout=RowLayout(rows_per_unit=2), row_weights=torch.linspace(-1, 1, 12))


# ---------------------------------------------------------------------------------------------- cost features
@pytest.mark.parametrize("sampled", [False, True])
def test_a_frozen_bias_is_not_part_of_the_clipped_norm(sampled):
    """Per-unit clipping is exact for what is trained: a Linear whose bias is frozen contributes ||g||^2 ||a||^2
    (no bias term) to the norm, as the reference autograd per-unit computation does; with ids checked, and with a
    sampler's one-row layout (the single-row path)."""
    from dporl.privacy.samplers import RowLayout

    layout = {"layout": RowLayout(rows_per_unit=1)} if sampled else {}
    torch.manual_seed(6)
    model = QNet()
    model.q[0].bias.requires_grad_(False)
    n_units, clip = 9, 0.05  # every unit clipped: a norm that counted the frozen bias would scale them wrongly
    batch = _batch(n_units, seed=2)
    want = _reference(model, batch, torch.arange(n_units), n_units, clip)
    for mode in ["bookkeeping", "ghost"]:
        engine = DPSGDEngine(model, max_grad_norm=clip, noise_multiplier=0.0, expected_batch_size=1.0,
                             noise=NoiseSource(0), mode=mode)
        stats = engine.private_backward(model.row_losses(*batch), torch.arange(n_units), n_units, **layout)
        assert stats.clip_fraction == 1.0
        for w, p in zip(want, engine.params):
            torch.testing.assert_close(p.grad, w, rtol=1e-4, atol=1e-6)
        engine.close()


@pytest.mark.parametrize("bias", [True, False])
def test_the_single_row_path_matches_the_reference_and_the_general_path(bias, monkeypatch):
    """A sampler's one-row-per-unit batch takes the engine's single-row path; it must give the per-unit reference's
    clipped sum and the general path's numbers (forced by disabling the single-row path)."""
    from dporl.privacy.samplers import RowLayout

    torch.manual_seed(3)
    model = QNet(bias)
    n_units, clip = 11, 4.0  # some units clipped, some not (norms 1.1-8.6)
    batch = _batch(n_units, seed=4)
    want = _reference(model, batch, torch.arange(n_units), n_units, clip)
    taken = []
    single_rows = DPSGDEngine._single_rows

    def spy(self, *args):
        stats = single_rows(self, *args)
        taken.append(stats is not None)
        return stats

    monkeypatch.setattr(DPSGDEngine, "_single_rows", spy)
    results = {}
    for path in ("single-row", "general"):
        engine = DPSGDEngine(model, max_grad_norm=clip, noise_multiplier=0.0, expected_batch_size=1.0,
                             noise=NoiseSource(0))
        if path == "general":
            monkeypatch.setattr(engine, "_single_rows", lambda *args: None)
        stats = engine.private_backward(model.row_losses(*batch), torch.arange(n_units), n_units,
                                        layout=RowLayout(rows_per_unit=1))
        results[path] = ([p.grad.clone() for p in engine.params], stats.to_dict())
        engine.close()
    assert taken == [True]  # the single-row path ran (once: the general run never reached it)
    assert 0 < results["single-row"][1]["clip_fraction"] < 1
    for w, g in zip(want, results["single-row"][0]):
        torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-6)
    for a, b in zip(results["single-row"][0], results["general"][0]):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)
    assert results["single-row"][1] == pytest.approx(results["general"][1], rel=1e-6)


def test_a_layer_that_did_not_run_leaves_the_single_row_path_to_the_general_one():
    from dporl.privacy.samplers import RowLayout

    class TwoHeads(nn.Module):
        def __init__(self):
            super().__init__()
            self.used, self.spare = nn.Linear(5, 3), nn.Linear(5, 3)

        def row_losses(self, obs, actions, next_obs, rewards):
            return (self.used(obs).gather(1, actions[:, None]).squeeze(1) - rewards) ** 2

    torch.manual_seed(1)
    model, n_units, clip = TwoHeads(), 6, 3.0
    batch = _batch(n_units, seed=8)
    model.spare.requires_grad_(False)
    want = _reference(model, batch, torch.arange(n_units), n_units, clip) + [torch.zeros(3, 5), torch.zeros(3)]
    model.spare.requires_grad_(True)
    engine = DPSGDEngine(model, max_grad_norm=clip, noise_multiplier=0.0, expected_batch_size=1.0, noise=NoiseSource(0))
    stats = engine.private_backward(model.row_losses(*batch), torch.arange(n_units), n_units,
                                    layout=RowLayout(rows_per_unit=1))
    assert 0 < stats.clip_fraction < 1
    for w, p in zip(want, engine.params):  # the spare head's gradient is its (zero) noise alone
        torch.testing.assert_close(p.grad, w, rtol=1e-4, atol=1e-6)
    engine.close()


def _noisy_steps(prefetch: bool, steps: int = 6):
    torch.manual_seed(0)
    model = QNet()
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.1)
    engine = DPSGDEngine(model, max_grad_norm=1.0, noise_multiplier=1.3, expected_batch_size=8.0,
                         noise=NoiseSource(31), prefetch_noise=prefetch)
    grads = []
    with engine:
        for step in range(steps):
            n_units = 8 if step != 3 else 5  # a Poisson-like change of batch size changes nothing in the noise
            batch = _batch(n_units, seed=step)
            engine.private_backward(model.row_losses(*batch), torch.arange(n_units), n_units)
            grads.append(torch.cat([p.grad.flatten() for p in engine.params]))
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            if step == 2:  # a checkpoint mid-run: the state is the one without drawing ahead
                grads.append(engine.noise.state_dict()["generator"].double())
    return grads, engine


def test_noise_drawn_ahead_gives_the_same_training_and_its_thread_is_joined():
    import threading

    plain, _ = _noisy_steps(prefetch=False)
    ahead, engine = _noisy_steps(prefetch=True)
    assert engine.prefetch_noise and all(torch.equal(a, b) for a, b in zip(plain, ahead))
    assert not [t for t in threading.enumerate() if t.name == "dporl-noise-prefetch"]  # closed by the with block


def test_an_exception_in_a_step_still_stops_the_noise_thread():
    import threading

    model = nn.Sequential(nn.Linear(3, 4))
    with pytest.raises(ValidationError):
        with DPSGDEngine(model, max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=2.0,
                         noise=NoiseSource(1), prefetch_noise=True) as engine:
            engine.private_backward(model(torch.randn(2, 3)).sum(1), torch.arange(2), 2)
            assert [t for t in threading.enumerate() if t.name == "dporl-noise-prefetch"]
            engine.private_backward(model(torch.randn(2, 3)).sum(1), torch.tensor([0, 7]), 2)  # refused
    assert not [t for t in threading.enumerate() if t.name == "dporl-noise-prefetch"]


def test_noise_is_drawn_ahead_by_default_only_where_a_core_is_left_over(monkeypatch):
    import dporl.privacy.dpsgd as dpsgd

    for spare in (True, False):
        monkeypatch.setattr(dpsgd, "_spare_core", lambda spare=spare: spare)
        engine = DPSGDEngine(nn.Linear(2, 1), max_grad_norm=1.0, noise_multiplier=1.0, expected_batch_size=1.0,
                             noise=NoiseSource(0))
        assert engine.prefetch_noise is spare
        engine.close()
    monkeypatch.undo()
    assert dpsgd._spare_core() == (len(os.sched_getaffinity(0)) > torch.get_num_threads())
