"""Secret randomness: every private draw of a run comes from one root secret, one named stream per mechanism.

A differential-privacy guarantee assumes the mechanism's randomness is unknown to the attacker: the Gaussian noise of
DP-SGD, the Poisson inclusions and mixture branches of the samplers (amplification by subsampling), the Laplace
noise and expert choice of the stable-prefix release, the environment and action randomness of its fresh rollouts.

``SecretRoot`` holds one root secret of at least 128 bits (256 from the OS CSPRNG by default, or a user's
``noise_seed`` for an exact reproduction, which must then be kept like the data). ``root.torch_generator(name)`` /
``root.numpy_generator(name)`` / ``root.noise(name)`` derive an independent stream per *name* through numpy's
``SeedSequence`` (a hash of the root and the name): two names never share a stream, and asking a root for the same
name twice is refused, so two mechanisms can never draw the same numbers by accident.

Why not ``torch.Generator.manual_seed``: torch's CPU generator (MT19937) keeps only the low 32 bits of a seed, so
seeds s and s + 2**32 give identical streams and a seeded stream has 32 bits of secret. ``torch_generator_from_words``
instead writes all 624 words of the MT19937 state (19968 bits, filled from the SeedSequence), keeping torch's fast
samplers with a secret state of the root's full entropy. MT19937 is not a cryptographic generator; for releases
that must also resist attacks on the sampled values themselves use ``dporl.privacy.secure_noise``.
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


class SecretRoot:
    """The root secret of one run; derives one independent stream per mechanism name (see the module docstring).

    ``seed=None`` (the default for real runs) draws 256 bits from the OS CSPRNG and never reveals them. A given
    ``seed`` (any non-negative integer; use at least 128 bits of it for a real release) reproduces every stream.
    """

    def __init__(self, seed: Optional[int] = None):
        if seed is None:
            seed = secrets.randbits(ROOT_BITS)
            self.reproducible = False
        else:
            if isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0:
                raise ValidationError("noise_seed", f"must be a non-negative integer, got {seed!r}")
            self.reproducible = True
        self._entropy = int(seed)
        self._used: set[str] = set()

    def __repr__(self) -> str:  # never print the secret
        return f"SecretRoot(reproducible={self.reproducible}, streams={sorted(self._used)})"

    def sequence(self, name: str) -> np.random.SeedSequence:
        """The SeedSequence of stream ``name``; each name may be taken once per root."""
        if not isinstance(name, str) or not name:
            raise ValidationError("stream", f"a stream needs a non-empty name, got {name!r}")
        if name in self._used:
            raise ValidationError("stream", f"stream {name!r} was already handed out: two mechanisms would share it")
        self._used.add(name)
        return np.random.SeedSequence(self._entropy, spawn_key=_name_key(name))

    def torch_generator(self, name: str) -> torch.Generator:
        return torch_generator_from_words(self.sequence(name).generate_state(_MT_WORDS, np.uint32))

    def numpy_generator(self, name: str) -> np.random.Generator:
        return np.random.Generator(np.random.PCG64DXSM(self.sequence(name)))

    def integer(self, name: str, bits: int = 128) -> int:
        """A secret integer (e.g. a Gymnasium reset seed, which Gymnasium expands through its own SeedSequence)."""
        words = self.sequence(name).generate_state((bits + 31) // 32, np.uint32)
        return int.from_bytes(words.astype("<u4").tobytes(), "little") % (1 << bits)

    def noise(self, name: str):
        """A ``NoiseSource`` drawing from stream ``name``: the MT19937 state is the stream's first 624 words (the
        same as ``torch_generator(name)``'s), the 256-bit key of its device draws the next 8 words."""
        from dporl.privacy.noise import NoiseSource

        words = self.sequence(name).generate_state(_MT_WORDS + DEVICE_KEY_BYTES // 4, np.uint32)
        return NoiseSource(generator=torch_generator_from_words(words[:_MT_WORDS]), reproducible=self.reproducible,
                           device_key=words[_MT_WORDS:].astype("<u4").tobytes())

    def child(self, name: str) -> "SecretRoot":
        """The root of one sub-run (a Trainer run among many of one pipeline invocation, whose streams are named by
        stage alone): 256 bits from stream ``name`` of this root, reproducible exactly when this root is."""
        child = SecretRoot(self.integer(name, bits=ROOT_BITS))
        child.reproducible = self.reproducible
        return child
