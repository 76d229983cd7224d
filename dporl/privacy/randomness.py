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

from typing import Optional

import numpy as np
import torch

from dporl.privacy.noise import NoiseSource
# DEVICE_KEY_BYTES, _name_key and torch_generator_from_words are re-exported for the callers of this module.
from dporl.privacy.streams import (  # noqa: F401
    DEVICE_KEY_BYTES,
    ROOT_BITS,
    _name_key,
    noise_stream,
    root_entropy,
    stream_sequence,
    torch_generator_from_words,
    torch_stream,
)
from dporl.utils.validation import ValidationError


class SecretRoot:
    """The root secret of one run; derives one independent stream per mechanism name (see the module docstring).

    ``seed=None`` (the default for real runs) draws 256 bits from the OS CSPRNG and never reveals them. A given
    ``seed`` (any non-negative integer; use at least 128 bits of it for a real release) reproduces every stream.
    """

    def __init__(self, seed: Optional[int] = None):
        self._entropy, self.reproducible = root_entropy(seed)
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
        return stream_sequence(self._entropy, name)

    def torch_generator(self, name: str) -> torch.Generator:
        return torch_stream(self.sequence(name))

    def numpy_generator(self, name: str) -> np.random.Generator:
        return np.random.Generator(np.random.PCG64DXSM(self.sequence(name)))

    def integer(self, name: str, bits: int = 128) -> int:
        """A secret integer (e.g. a Gymnasium reset seed, which Gymnasium expands through its own SeedSequence)."""
        words = self.sequence(name).generate_state((bits + 31) // 32, np.uint32)
        return int.from_bytes(words.astype("<u4").tobytes(), "little") % (1 << bits)

    def noise(self, name: str) -> NoiseSource:
        """A ``NoiseSource`` drawing from stream ``name``: the MT19937 state is the stream's first 624 words (the
        same as ``torch_generator(name)``'s), the 256-bit key of its device draws the next 8 words."""
        generator, device_key = noise_stream(self.sequence(name))
        return NoiseSource(generator=generator, reproducible=self.reproducible, device_key=device_key)

    def child(self, name: str) -> "SecretRoot":
        """The root of one sub-run (a Trainer run among many of one pipeline invocation, whose streams are named by
        stage alone): 256 bits from stream ``name`` of this root, reproducible exactly when this root is."""
        child = SecretRoot(self.integer(name, bits=ROOT_BITS))
        child.reproducible = self.reproducible
        return child
