"""Public seeds: generators for public randomness (network initialisation, non-private sampling, evaluation).

Secret randomness (privacy noise, private sampling, the release's choices) never comes from here: it comes from
``dporl.privacy.randomness.SecretRoot``. The library draws from explicit generators, never from Python's, numpy's
or torch's global RNG; the one place torch insists on its global generator, parameter initialisation, is confined
by ``seeded(seed)`` to a forked global state, so a run's result does not depend on what ran before it and a
checkpoint needs no global RNG state.
"""

from __future__ import annotations

import contextlib
import hashlib
from typing import Iterator

import numpy as np
import torch


def make_generator(seed: int) -> torch.Generator:
    """A CPU generator seeded with ``seed`` (public randomness only: torch keeps 32 bits of a CPU seed)."""
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def public_generator(seed: int, name: str) -> torch.Generator:
    """A public stream named ``name`` of seed ``seed`` (SeedSequence-derived: two names never share a stream)."""
    digest = hashlib.sha256(name.encode("utf-8")).digest()
    key = tuple(int.from_bytes(digest[i : i + 4], "little") for i in range(0, 32, 4))
    state = np.random.SeedSequence(int(seed) % 2**128, spawn_key=key).generate_state(2, np.uint64)
    return make_generator(int(state[0]) >> 1)


@contextlib.contextmanager
def seeded(seed: int) -> Iterator[None]:
    """Run the block with torch's global CPU generator seeded by ``seed``, restoring its state afterwards.

    For module construction: ``with seeded(cfg.trainer.seed): model = DiscreteCQLModule(...)`` initialises the same
    weights whatever ran before, and leaves the global generator as it found it.
    """
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        yield
