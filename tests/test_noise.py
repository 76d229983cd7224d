import math

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
    flat = SecretRoot(11).noise("train/noise").gaussian(sum(p.numel() for p in params), 0.5)
    torch.testing.assert_close(torch.cat([d.flatten() for d in draws]), flat, rtol=0, atol=0)  # same stream, in order
    assert len({d.untyped_storage().data_ptr() for d in draws}) == 1  # views of one buffer: nothing copied
