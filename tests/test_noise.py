import math

import numpy as np
import pytest
import torch

from dporl.privacy.noise import NoiseSource


def test_seeded_sources_reproduce_and_resume_exactly():
    a, b = NoiseSource(7), NoiseSource(7)
    assert torch.equal(a.gaussian(5, 1.0), b.gaussian(5, 1.0))
    state = a.state_dict()
    first = a.laplace(4, 2.0)
    a.load_state_dict(state)
    assert torch.equal(a.laplace(4, 2.0), first)
    assert a.reproducible


def test_default_seed_is_secret_and_differs_between_sources():
    a, b = NoiseSource(), NoiseSource()
    assert not a.reproducible
    assert not torch.equal(a.gaussian(8, 1.0), b.gaussian(8, 1.0))


def test_moments_match_the_distributions():
    n = 200_000
    source = NoiseSource(0)
    g = source.gaussian(n, 3.0, dtype=torch.float64)
    lap = source.laplace(n, 2.0)
    # Gaussian(0, 9): sample std has standard error 3 / sqrt(2n). Laplace(b=2): variance 2 b^2 = 8, E|X| = b.
    assert abs(float(g.std()) - 3.0) < 4 * 3.0 / math.sqrt(2 * n)
    assert abs(float(lap.abs().mean()) - 2.0) < 4 * 2.0 / math.sqrt(n)
    assert abs(float(lap.mean())) < 4 * math.sqrt(8.0 / n)
    # Laplace tail: P(|X| > t) = exp(-t / b)
    tail = float((lap.abs() > 4.0).double().mean())
    assert abs(tail - math.exp(-2.0)) < 4 * math.sqrt(math.exp(-2.0) / n)


def test_gaussian_like_draws_one_stream_in_parameter_order_without_copies():
    from dporl.privacy.randomness import SecretRoot

    shapes = [(300, 4), (300,), (2, 300), (2,)]
    params = [torch.empty(shape) for shape in shapes]
    draws = SecretRoot(11).noise("train/noise").gaussian_like(params, 0.5)
    assert [d.shape for d in draws] == [p.shape for p in params]
    total = sum(p.numel() for p in params)  # 2102: drawn as 2112 (whole blocks of 16), the last 10 dropped
    flat = SecretRoot(11).noise("train/noise").gaussian(2112, 0.5)[:total]
    torch.testing.assert_close(torch.cat([d.flatten() for d in draws]), flat, rtol=0, atol=0)  # same stream, in order
    assert len({d.untyped_storage().data_ptr() for d in draws}) == 1  # views of one buffer: nothing copied


# ------------------------------------------------------------------ the Gaussian's law, determinism, independence
def _params(*shapes):
    return [torch.empty(shape) for shape in shapes]


def test_gaussian_passes_ks_and_moments_at_1e7_draws():
    """The DP-SGD code path (gaussian_like: one draw split into views) against N(0, 1): KS at 1e7 draws, and the
    first four moments within 5 standard errors (mean 1/sqrt(n), variance sqrt(2/n), skewness sqrt(6/n), excess
    kurtosis sqrt(24/n))."""
    from scipy import stats

    n = 10**7
    params = _params((n // 2 - 5, 1), (5,), (n // 2,))
    x = torch.cat([d.flatten() for d in NoiseSource(2024).gaussian_like(params, 1.0)])
    assert len(x) == n
    # Kolmogorov-Smirnov: D = sup |F_n - Phi|, attained at a sample point; p-value from D's exact law at n.
    cdf = torch.special.ndtr(torch.sort(x).values.double())
    ranks = torch.arange(1, n + 1, dtype=torch.float64) / n
    statistic = max(float((ranks - cdf).max()), float((cdf - (ranks - 1 / n)).max()))
    assert stats.kstwo.sf(statistic, n) > 1e-3, statistic  # the 1e-3 critical value is about 1.95 / sqrt(n)
    x = x.double()
    mean, var = float(x.mean()), float(x.var())
    z = (x - mean).div_(math.sqrt(var))
    assert abs(mean) < 5 / math.sqrt(n)
    assert abs(var - 1) < 5 * math.sqrt(2 / n)
    assert abs(float(z.pow(3).mean())) < 5 * math.sqrt(6 / n)
    assert abs(float(z.pow(4).mean()) - 3) < 5 * math.sqrt(24 / n)


def test_no_correlation_across_steps_or_parameters():
    """64 steps of noise for two equal parameters: every pair of steps, the two parameters within a step, and
    neighbouring coordinates are uncorrelated (|r| < 5 / sqrt(n), n = 20000 coordinates per vector)."""
    source = NoiseSource(5)
    params = _params((100, 100), (100, 100))
    steps = [source.gaussian_like(params, 1.0) for _ in range(64)]
    flat = torch.stack([torch.cat([a.flatten(), b.flatten()]) for a, b in steps]).double()  # [steps, 20000]
    bound = 5 / math.sqrt(flat.shape[1])
    corr = torch.corrcoef(flat)
    off_diagonal = corr[~torch.eye(64, dtype=torch.bool)]
    assert float(off_diagonal.abs().max()) < bound  # across steps (2016 pairs)
    halves = flat.view(64, 2, 10_000)
    z = (halves - halves.mean(2, keepdim=True)) / halves.std(2, unbiased=False, keepdim=True)
    within = (z[:, 0] * z[:, 1]).mean(1)
    assert float(within.abs().max()) < 5 / math.sqrt(10_000)  # the two parameters of one step
    rows = (flat - flat.mean(1, keepdim=True)) / flat.std(1, unbiased=False, keepdim=True)
    lag = (rows[:, :-1] * rows[:, 1:]).mean(1)
    assert float(lag.abs().max()) < bound  # neighbouring coordinates within a draw


def test_same_seed_same_noise_and_every_step_fresh_noise():
    params = _params((30, 20), (20,))
    first, second = NoiseSource(77), NoiseSource(77)
    a = [torch.cat([d.flatten() for d in first.gaussian_like(params, 0.3)]) for _ in range(5)]
    b = [torch.cat([d.flatten() for d in second.gaussian_like(params, 0.3)]) for _ in range(5)]
    assert all(torch.equal(x, y) for x, y in zip(a, b))
    assert all(not torch.equal(a[i], a[j]) for i in range(5) for j in range(i))
    other = NoiseSource(78).gaussian_like(params, 0.3)
    assert not torch.equal(torch.cat([d.flatten() for d in other]), a[0])


# ------------------------------------------------------------------ device draws: keys and the per-draw re-keying
KEY = bytes(range(32))


def test_device_draw_keys_use_their_whole_space_and_are_fresh_per_draw():
    from dporl.privacy.noise import device_draw_key

    keys = [device_draw_key(KEY, t) for t in range(20_000)]
    assert keys[7] == device_draw_key(KEY, 7)  # deterministic
    seeds = np.array([s for s, _ in keys], dtype=np.uint64)
    offsets = np.array([o for _, o in keys], dtype=np.uint64)
    assert len(set(seeds.tolist())) == len(keys) and len(set(offsets.tolist())) == len(keys)
    assert (offsets % 4 == 0).all() and (offsets < 2**63).all()
    # Every one of the 64 seed bits and 61 offset bits varies and is balanced (mean 1/2, standard error 0.0035):
    # the 125 secret bits per draw the module docstring claims.
    seed_bits = (seeds[:, None] >> np.arange(64, dtype=np.uint64)) & np.uint64(1)
    offset_bits = ((offsets >> np.uint64(2))[:, None] >> np.arange(61, dtype=np.uint64)) & np.uint64(1)
    for bits in (seed_bits, offset_bits):
        assert np.abs(bits.mean(axis=0) - 0.5).max() < 5 * 0.5 / math.sqrt(len(keys))
    assert (offsets >> np.uint64(2)).max() >= 2**60  # the top offset bit is reached


def test_device_draw_keys_depend_on_every_key_bit_and_refuse_bad_input():
    from dporl.privacy.noise import device_draw_key
    from dporl.utils.validation import ValidationError

    base = device_draw_key(KEY, 3)
    for bit in range(256):
        flipped = bytearray(KEY)
        flipped[bit // 8] ^= 1 << (bit % 8)
        assert device_draw_key(bytes(flipped), 3) != base
    with pytest.raises(ValidationError, match="device_key"):
        device_draw_key(KEY[:16], 0)
    with pytest.raises(ValidationError, match="device_draws"):
        device_draw_key(KEY, -1)


class _FakeDevice:
    """Stands in for a CUDA device on a CPU-only machine: records how each draw is keyed, and draws from a CPU
    generator seeded by the (seed, offset) pair so equal keys give equal numbers."""

    def __init__(self, monkeypatch):
        import dporl.privacy.noise as noise_module

        self.calls = []
        monkeypatch.setattr(noise_module, "_device_generator", lambda device: ("generator", device))

        def normal(shape, std, dtype, device, generator, seed, offset):
            assert generator == ("generator", device)
            self.calls.append((seed, offset, shape, str(device)))
            cpu = torch.Generator().manual_seed(hash((seed, offset)) & (2**63 - 1))
            return torch.normal(0.0, std, shape, generator=cpu, dtype=dtype)

        monkeypatch.setattr(noise_module, "_device_normal", normal)


def test_cuda_draws_are_rekeyed_per_draw_from_the_device_key_and_resume_exactly(monkeypatch):
    from dporl.privacy.noise import device_draw_key
    from dporl.privacy.randomness import SecretRoot

    device = _FakeDevice(monkeypatch)
    source = SecretRoot(9).noise("train/noise")
    cpu_reference = SecretRoot(9).noise("train/noise")
    first = source.gaussian((4, 3), 1.0, device="cuda:0")
    cpu_draw = source.gaussian(6, 1.0)  # CPU draws come from the MT19937 stream, untouched by device draws
    assert torch.equal(cpu_draw, cpu_reference.gaussian(6, 1.0))
    state = source.state_dict()
    second = source.gaussian(5, 2.0, device="cuda:0")
    key = source._device_key
    assert [c[:2] for c in device.calls] == [device_draw_key(key, 0), device_draw_key(key, 1)]
    assert device.calls[0][2:] == ((4, 3), "cuda:0")
    # A checkpoint's state resumes the device stream at the same draw: the same key, the same numbers.
    resumed = SecretRoot(9).noise("train/noise")
    resumed.load_state_dict(state)
    assert torch.equal(resumed.gaussian(5, 2.0, device="cuda:0"), second)
    assert device.calls[-1][:2] == device_draw_key(key, 1)
    assert first.shape == (4, 3) and not torch.equal(first.flatten()[:5], second)


def test_device_key_comes_from_the_stream_and_sources_without_one_draw_on_the_cpu():
    from dporl.privacy.randomness import SecretRoot
    from dporl.privacy.secure_noise import SecureNoiseSource

    a, b = SecretRoot(4).noise("x"), SecretRoot(4).noise("y")
    assert len(a._device_key) == 32 and a._device_key != b._device_key
    assert a._device_key == SecretRoot(4).noise("x")._device_key  # reproducible from the root
    assert NoiseSource(4)._device_key == SecretRoot(4).noise("noise")._device_key
    cuda = torch.device("cuda", 0)
    assert a._draws_on(cuda) and not a._draws_on(torch.device("cpu"))
    assert not NoiseSource(4, device_draws=False)._draws_on(cuda)  # the CPU stream, copied: same on every device
    assert not NoiseSource(generator=torch.Generator().manual_seed(0))._draws_on(cuda)  # no device key
    assert not SecureNoiseSource()._draws_on(cuda)  # exact discrete noise is drawn by its own sampler


def test_noise_state_from_a_checkpoint_is_validated():
    from dporl.utils.validation import ValidationError

    source = NoiseSource(1)
    state = source.state_dict()
    assert state["device_key"].dtype == torch.uint8 and state["device_draws"] == 0
    for field, bad in [("device_key", torch.zeros(31, dtype=torch.uint8)), ("device_key", torch.zeros(32)),
                       ("device_key", b"x" * 32), ("device_draws", -1), ("device_draws", 2**64), ("device_draws", 1.5)]:
        with pytest.raises(ValidationError, match=field):
            source.load_state_dict({**state, field: bad})
    legacy = {k: v for k, v in state.items() if k not in ("device_key", "device_draws")}
    source.load_state_dict(legacy)  # a state without device draws: the source keeps its key, counter 0
    assert source._device_key == NoiseSource(1)._device_key


# ------------------------------------------------------------------ drawing ahead on a background thread
def _flat(draws):
    return torch.cat([d.flatten() for d in draws])


def _prefetch_threads():
    import threading

    return [t for t in threading.enumerate() if t.name == "dporl-noise-prefetch"]


def test_drawing_ahead_keeps_the_stream_whatever_is_asked_next():
    params, other = _params((40, 30), (30,)), _params((7,))
    ahead, plain = NoiseSource(21), NoiseSource(21)
    sequence = [("like", params, 0.5), ("like", params, 0.5), ("laplace",), ("like", params, 0.5),
                ("like", params, 0.25), ("like", other, 0.5), ("gaussian",), ("like", params, 0.5), ("state",),
                ("like", params, 0.5)]
    for item in sequence:
        outputs = []
        for source in (ahead, plain):
            if item[0] == "like":
                outputs.append(_flat(source.gaussian_like(item[1], item[2])))
            elif item[0] == "laplace":
                outputs.append(source.laplace(9, 1.0))
            elif item[0] == "gaussian":
                outputs.append(source.gaussian(9, 1.0))
            else:
                outputs.append(source.state_dict()["generator"])
        assert torch.equal(outputs[0], outputs[1]), item
        assert ahead.prefetch_like(params, 0.5)  # always the same guess: right, wrong, or interrupted
    ahead.close()
    assert torch.equal(ahead.state_dict()["generator"], plain.state_dict()["generator"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("padded", [16, 1808, 67600])
def test_one_call_of_k_padded_draws_is_k_calls(dtype, padded):
    """What drawing ahead in blocks rests on: torch's CPU normal kernel, given a multiple of 16 values, gives in one
    call exactly the numbers of consecutive calls (it draws the uniforms in order and recomputes no tail); a size
    that is not a multiple of 16 does not have this property (its last 16 values are redrawn)."""
    one, many = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    block = torch.normal(0.0, 0.7, (5 * padded,), generator=one, dtype=dtype)
    calls = torch.cat([torch.normal(0.0, 0.7, (padded,), generator=many, dtype=dtype) for _ in range(5)])
    assert torch.equal(block, calls) and torch.equal(one.get_state(), many.get_state())
    one, many = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    ragged = torch.normal(0.0, 0.7, (2 * (padded + 2),), generator=one, dtype=dtype)
    calls = torch.cat([torch.normal(0.0, 0.7, (padded + 2,), generator=many, dtype=dtype) for _ in range(2)])
    assert not torch.equal(ragged, calls)


def test_drawing_ahead_across_blocks_and_interruptions_keeps_the_stream(monkeypatch):
    import dporl.privacy.noise as noise_module

    monkeypatch.setattr(noise_module, "_AHEAD_STEPS", 3)  # blocks of 3 draws: many block boundaries
    params = _params((13, 7), (7,))  # 98 values: drawn as 112, the last 14 dropped
    ahead, plain = NoiseSource(4), NoiseSource(4)
    for step in range(20):
        if step in (5, 9, 10, 16):  # interruptions at, inside and just after block boundaries
            assert torch.equal(ahead.laplace(3, 1.0), plain.laplace(3, 1.0)), step
        assert torch.equal(_flat(ahead.gaussian_like(params, 0.3)), _flat(plain.gaussian_like(params, 0.3))), step
        assert ahead.prefetch_like(params, 0.3)
        assert ahead._ahead.steps == 3
    ahead.close()
    assert torch.equal(ahead.state_dict()["generator"], plain.state_dict()["generator"])


def test_a_block_is_drawn_into_again_only_when_nothing_refers_to_it(monkeypatch):
    """Draws made ahead are drawn into a block's buffer again once no view of it is alive; draws a caller keeps
    (gradients held on to, say) are never overwritten."""
    import dporl.privacy.noise as noise_module

    monkeypatch.setattr(noise_module, "_AHEAD_STEPS", 2)
    lone = torch.empty(8)
    assert noise_module._unshared(lone)
    view = lone[2:4]
    assert not noise_module._unshared(lone)
    del view
    assert noise_module._unshared(lone)

    fresh = []  # per draw or block (steps), whether it was drawn into a new buffer
    draw_block = noise_module._draw_block

    def counting(generator, steps, padded, dtype, std, out=None):
        fresh.append((steps, out is None))
        return draw_block(generator, steps, padded, dtype, std, out)

    monkeypatch.setattr(noise_module, "_draw_block", counting)
    params = _params((9, 5), (5,))  # 50 values, drawn as 64
    plain, ahead, raw = NoiseSource(17), NoiseSource(17), NoiseSource(17)
    for draw_ahead in (True, False):
        source = ahead if draw_ahead else plain
        kept = [source.gaussian_like(params, 1.0, draw_ahead=draw_ahead) for _ in range(12)]  # all kept
        for draw in kept:  # none overwritten: each is still the stream's draw (gaussian is never drawn into)
            assert torch.equal(_flat(draw), raw.gaussian(64, 1.0)[:50])
        assert all(new for _, new in fresh)
        kept.clear()
        fresh.clear()
        for _ in range(12):  # nothing kept: buffers are drawn into again, with the same numbers
            draw = source.gaussian_like(params, 1.0, draw_ahead=draw_ahead)
            assert torch.equal(_flat(draw), raw.gaussian(64, 1.0)[:50])
            del draw
        source.close()  # waits for the block in flight (drawn into a buffer drawn before, too), then rewinds
        draws = [new for steps, new in fresh if steps == (2 if draw_ahead else 1)]  # not the rewind's replay
        assert len(draws) >= 6 and not any(draws[2:]), (draw_ahead, fresh)  # after two, every buffer reused
        fresh.clear()
        raw = NoiseSource(17)


def test_drawing_ahead_resumes_from_a_state_taken_while_a_draw_is_pending():
    params = _params((50, 20))
    source = NoiseSource(8)
    source.gaussian_like(params, 1.0)
    source.prefetch_like(params, 1.0)
    state = source.state_dict()  # as if nothing had been drawn ahead
    expected = _flat(source.gaussian_like(params, 1.0))
    resumed = NoiseSource(99)
    resumed.load_state_dict(state)
    assert torch.equal(_flat(resumed.gaussian_like(params, 1.0)), expected)
    source.close()


def test_the_thread_is_joined_on_close_and_stopped_with_a_collected_source():
    import gc

    params = _params((10,))
    before = len(_prefetch_threads())
    source = NoiseSource(3)
    assert source.prefetch_like(params, 1.0)
    assert len(_prefetch_threads()) == before + 1
    source.close()
    assert len(_prefetch_threads()) == before
    assert source.prefetch_like(params, 1.0)  # usable again: a new thread
    source.gaussian_like(params, 1.0)
    del source
    gc.collect()
    assert len(_prefetch_threads()) == before
    assert not NoiseSource(3).prefetch_like([torch.empty(3, dtype=torch.float64), torch.empty(2)], 1.0)


def test_a_failed_draw_ahead_is_raised_and_leaves_the_stream_where_it_stood(monkeypatch):
    import dporl.privacy.noise as noise_module

    params = _params((6,))
    source, reference = NoiseSource(12), NoiseSource(12)

    def failing(*args):
        raise RuntimeError("draw failed")

    monkeypatch.setattr(noise_module, "_draw_block", failing)
    source.prefetch_like(params, 1.0)
    with pytest.raises(RuntimeError, match="draw failed"):
        source.gaussian_like(params, 1.0)
    monkeypatch.undo()
    assert torch.equal(_flat(source.gaussian_like(params, 1.0)), _flat(reference.gaussian_like(params, 1.0)))
    source.close()


def test_a_forked_child_draws_the_block_its_parent_was_drawing_again(monkeypatch):
    import dporl.privacy.noise as noise_module

    monkeypatch.setattr(noise_module, "_AHEAD_STEPS", 2)
    params = _params((6,))
    source, reference = NoiseSource(14), NoiseSource(14)
    for _ in range(3):  # the third call takes the second draw of the first block; the second block is in flight
        assert torch.equal(_flat(source.gaussian_like(params, 1.0, draw_ahead=True)),
                           _flat(reference.gaussian_like(params, 1.0)))
    worker = source._worker
    worker.result()  # let the parent's thread finish, then pretend to be a child process without that thread
    worker.busy, worker.pid = True, -1
    for _ in range(3):  # no waiting on a thread that does not exist: the block is drawn again here
        assert torch.equal(_flat(source.gaussian_like(params, 1.0, draw_ahead=True)),
                           _flat(reference.gaussian_like(params, 1.0)))
    assert source._worker is not worker
    source.close()
    worker.pid, worker.busy = __import__("os").getpid(), False
    worker.stop()


def test_a_forked_child_drops_the_parents_pending_draw():
    params = _params((6,))
    source, reference = NoiseSource(13), NoiseSource(13)
    source.prefetch_like(params, 1.0)
    worker = source._worker
    worker.result()  # let the parent's thread finish, then pretend to be a child process without that thread
    worker.busy = True
    worker.pid = -1
    assert torch.equal(source.laplace(4, 1.0), reference.laplace(4, 1.0))  # rewound without waiting
    assert source._worker is None
    worker.pid = __import__("os").getpid()
    worker.busy = False
    worker.stop()
