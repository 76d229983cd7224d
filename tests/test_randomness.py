"""Secret randomness: full-entropy streams, one per mechanism name, reproducible from a given root."""

import numpy as np
import pytest
import torch

from dporl.privacy.noise import NoiseSource, secret_generator
from dporl.privacy.randomness import SecretRoot, _name_key, torch_generator_from_words
from dporl.utils.validation import ValidationError


def _draw(generator: torch.Generator) -> torch.Tensor:
    return torch.rand(64, generator=generator)


def test_torch_manual_seed_keeps_only_32_bits_but_dporl_streams_keep_every_bit():
    # The failure the streams fix: torch's CPU generator truncates seeds to their low 32 bits.
    seeded = [torch.Generator().manual_seed(s) for s in (5, 5 + 2**32)]
    assert torch.equal(_draw(seeded[0]), _draw(seeded[1]))
    assert not torch.equal(_draw(secret_generator(5)), _draw(secret_generator(5 + 2**32)))
    assert not torch.equal(NoiseSource(5).gaussian(64, 1.0), NoiseSource(5 + 2**32).gaussian(64, 1.0))
    high = [SecretRoot(s).torch_generator("x") for s in (2**100, 2**100 + 2**64)]
    assert not torch.equal(_draw(high[0]), _draw(high[1]))


def test_the_whole_mersenne_state_is_written():
    words = np.random.SeedSequence(7).generate_state(624, np.uint32)
    generator = torch_generator_from_words(words)
    assert generator.initial_seed() == 0  # nothing about the secret is reported as a seed
    stored = np.frombuffer(generator.get_state().numpy().tobytes(), np.uint64, 624, 24)
    np.testing.assert_array_equal(stored.astype(np.uint32), words)
    flipped = words.copy()
    flipped[1] ^= 1  # the first output depends on words 0, 1 and 397 (only the top bit of word 0 is ever used)
    assert not torch.equal(_draw(generator), _draw(torch_generator_from_words(flipped)))


def test_streams_are_reproducible_from_a_given_root_and_distinct_by_name():
    first, second = SecretRoot(123), SecretRoot(123)
    assert torch.equal(_draw(first.torch_generator("train/noise")), _draw(second.torch_generator("train/noise")))
    assert not torch.equal(_draw(first.torch_generator("train/sampler")), _draw(second.torch_generator("release/env")))
    assert first.integer("env") == second.integer("env") and 0 <= first.integer("env2") < 2**128
    assert np.array_equal(first.numpy_generator("np").random(8), second.numpy_generator("np").random(8))


def test_a_name_is_handed_out_once_per_root():
    root = SecretRoot(1)
    root.torch_generator("train/noise")
    with pytest.raises(ValidationError, match="already handed out"):
        root.noise("train/noise")


def test_secret_roots_differ_and_do_not_print_their_secret():
    a, b = SecretRoot(), SecretRoot()
    assert not a.reproducible
    assert not torch.equal(_draw(a.torch_generator("s")), _draw(b.torch_generator("s")))
    assert "reproducible=False" in repr(a) and str(a._entropy) not in repr(a)


@pytest.mark.parametrize("bad", [-1, 1.5, "3", True])
def test_bad_seeds_are_refused(bad):
    with pytest.raises(ValidationError, match="noise_seed"):
        SecretRoot(bad)


def test_stream_statistics_are_those_of_the_samplers():
    # 1e6 draws: the mean's standard error is 1e-3 (normal) and 2.9e-4 (uniform); 5 standard errors of slack.
    generator = SecretRoot(99).torch_generator("stats")
    normal = torch.randn(1_000_000, generator=generator, dtype=torch.float64)
    uniform = torch.rand(1_000_000, generator=generator, dtype=torch.float64)
    assert abs(float(normal.mean())) < 5e-3 and abs(float(normal.std()) - 1) < 5e-3
    assert abs(float(uniform.mean()) - 0.5) < 1.5e-3


def test_child_roots_are_streams_of_their_parent():
    # A child root (one Trainer run among many) is reproducible exactly when its parent is, children of different
    # names draw different numbers, and a child's name is a stream of the parent: it is handed out once.
    def draws(parent_seed, name):
        return SecretRoot(parent_seed).child(name).torch_generator("train/noise").get_state()

    assert torch.equal(draws(3, "gpope/a"), draws(3, "gpope/a"))
    assert not torch.equal(draws(3, "gpope/a"), draws(3, "gpope/b"))
    assert not torch.equal(draws(3, "gpope/a"), draws(4, "gpope/a"))
    parent = SecretRoot(3)
    assert parent.child("x").reproducible and not SecretRoot().child("x").reproducible
    with pytest.raises(ValidationError, match="already handed out"):
        parent.child("x")


def test_a_noise_stream_keeps_its_cpu_numbers_and_adds_an_independent_device_key():
    """root.noise(name) draws on the CPU exactly what torch_generator(name) gives (its first 624 words); the 256-bit
    device key is the stream's next 8 words, so it says nothing about the MT19937 state and vice versa."""
    noise = SecretRoot(2**70 + 3).noise("train/noise")
    generator = SecretRoot(2**70 + 3).torch_generator("train/noise")
    assert torch.equal(noise.gaussian(50, 1.0), torch.normal(0.0, 1.0, (50,), generator=generator))
    words = np.random.SeedSequence(2**70 + 3, spawn_key=_name_key("train/noise")).generate_state(632, np.uint32)
    assert noise._device_key == words[624:].astype("<u4").tobytes()
    assert SecretRoot(2**70 + 3 + 2**64).noise("train/noise")._device_key != noise._device_key
