"""Named secret streams: the derivation shared by ``SecretRoot`` (``dporl.privacy.randomness``) and the noise
sources (``dporl.privacy.noise``), kept below both so that neither imports the other to draw.

A root secret (an integer of at least 128 bits) and a stream *name* give one ``numpy.random.SeedSequence`` (a hash of
the root and the name): ``stream_sequence``. ``torch_generator_from_words`` writes all 624 words of torch's CPU
MT19937 state from such a stream (``manual_seed`` keeps only 32 bits of a seed); ``noise_stream`` gives a noise
source's generator and the 256-bit key of its device draws from the same stream.
"""

from __future__ import annotations

import hashlib
import secrets
from typing import Optional

import numpy as np
import torch

from dporl.utils.validation import ValidationError

ROOT_BITS = 256  # entropy of a root drawn from the OS CSPRNG
_MT_WORDS = 624  # MT19937 state words
DEVICE_KEY_BYTES = 32  # the key of a noise stream's device draws (dporl.privacy.noise)
# Layout of torch's CPU generator state (CPUGeneratorImplState): the_initial_seed u64, left i32, seeded i32, next u64,
# state u64[624], normal_x/y/rho f64, normal_is_valid i32 (+pad), next_float_normal_sample f32, its valid flag (+pad).
_STATE_BYTES = 5056
_WORDS_OFFSET = 24
_LEFT, _SEEDED, _NEXT = slice(8, 12), slice(12, 16), slice(16, 24)
_NORMAL_VALID, _FLOAT_NORMAL_VALID = slice(5040, 5044), 5052


def torch_generator_from_words(words: np.ndarray) -> torch.Generator:
    """A CPU ``torch.Generator`` whose whole MT19937 state is ``words`` (624 uint32 values)."""
    words = np.asarray(words, dtype=np.uint32)
    if words.shape != (_MT_WORDS,):
        raise ValidationError("words", f"expected {_MT_WORDS} uint32 words, got shape {words.shape}")
    generator = torch.Generator()
    raw = generator.get_state().numpy().copy()
    if raw.shape != (_STATE_BYTES,):  # a torch whose generator layout differs: refuse rather than seed weakly
        raise RuntimeError(f"unexpected torch CPU generator state of {raw.shape} bytes; cannot set a full state")
    raw[:8] = 0  # the_initial_seed: nothing about the secret
    raw[_LEFT] = np.frombuffer(np.int32(1).tobytes(), np.uint8)  # regenerate the block on the first draw
    raw[_SEEDED] = np.frombuffer(np.int32(1).tobytes(), np.uint8)
    raw[_NEXT] = 0
    raw[_WORDS_OFFSET : _WORDS_OFFSET + 8 * _MT_WORDS] = np.frombuffer(words.astype(np.uint64).tobytes(), np.uint8)
    raw[_NORMAL_VALID] = 0  # no cached normal sample from before
    raw[_FLOAT_NORMAL_VALID] = 0
    generator.set_state(torch.from_numpy(raw))
    written = np.frombuffer(generator.get_state().numpy().tobytes(), np.uint64, _MT_WORDS, _WORDS_OFFSET)
    if not np.array_equal(written.astype(np.uint32), words):
        raise RuntimeError("torch did not keep the generator state dporl wrote; refusing a weakly seeded stream")
    return generator


def _name_key(name: str) -> tuple[int, ...]:
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    return tuple(int.from_bytes(digest[i : i + 4], "little") for i in range(0, 32, 4))


def root_entropy(seed: Optional[int]) -> tuple[int, bool]:
    """(root secret, reproducible): ``seed`` itself (a non-negative integer, kept secret like the data), or
    ``ROOT_BITS`` bits from the OS CSPRNG when ``seed`` is None."""
    if seed is None:
        return secrets.randbits(ROOT_BITS), False
    if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
        raise ValidationError("noise_seed", f"must be a non-negative integer, got {seed!r}")
    return int(seed), True


def stream_sequence(entropy: int, name: str) -> np.random.SeedSequence:
    """The SeedSequence of stream ``name`` under the root secret ``entropy``."""
    return np.random.SeedSequence(entropy, spawn_key=_name_key(name))


def torch_stream(sequence: np.random.SeedSequence) -> torch.Generator:
    """A CPU ``torch.Generator`` whose whole MT19937 state is the first 624 words of ``sequence``."""
    return torch_generator_from_words(sequence.generate_state(_MT_WORDS, np.uint32))


def noise_stream(sequence: np.random.SeedSequence) -> tuple[torch.Generator, bytes]:
    """(CPU generator, device key) of a noise source drawing from ``sequence``: the MT19937 state is the stream's
    first 624 words (the same as ``torch_generator_from_words`` of its first 624 words), the 256-bit key of its
    device draws the next 8 words."""
    words = sequence.generate_state(_MT_WORDS + DEVICE_KEY_BYTES // 4, np.uint32)
    return torch_generator_from_words(words[:_MT_WORDS]), words[_MT_WORDS:].astype("<u4").tobytes()
