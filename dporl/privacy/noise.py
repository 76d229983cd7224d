"""Noise sources: the only place dporl draws privacy noise.

Threat note. If the seed of the noise generator is known (printed in a config, committed to a repository), anyone
can regenerate the noise and subtract it from a released model: the guarantee is void. ``NoiseSource(seed=None)``,
the default for real runs, therefore draws its seed from the operating system's CSPRNG and never reveals it. A fixed
seed is for tests and exact reproductions; the guarantee then holds only while the seed, and every checkpoint
(which stores the generator state), are kept secret like the data. ``dporl.privacy.secure_noise`` offers samplers
that also resist floating-point attacks on the sampled values.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from dporl.privacy.randomness import SecretRoot
from dporl.utils.validation import check_positive


def secret_generator(seed: int | None = None) -> torch.Generator:
    """A generator for private sampling decisions (which units a Poisson step includes, which branch a mixture step
    takes). Amplification by subsampling assumes nobody knows these draws, so the seed comes from the OS CSPRNG
    unless one is given for an exact reproduction; a given seed must then be kept secret like a noise seed.
    The whole generator state is derived from the seed (``dporl.privacy.randomness``), never its low 32 bits.
    """
    return SecretRoot(seed).torch_generator("sampler")


class NoiseSource:
    """Gaussian and Laplace draws from one torch generator (CPU, so results do not depend on the device)."""

    def __init__(
        self, seed: int | None = None, *, generator: torch.Generator | None = None, reproducible: bool | None = None
    ):
        if generator is not None:
            if seed is not None:
                raise ValueError("give a seed or a generator, not both")
            self._generator = generator
            self.reproducible = bool(reproducible)
        else:
            self._generator = SecretRoot(seed).torch_generator("noise")
            self.reproducible = seed is not None

    def gaussian(self, shape: Sequence[int] | int, std: float, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        std = check_positive("noise.std", std, allow_zero=True)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        # Drawn directly in the target precision, as Opacus does: float64 draws cost 5x more per DP-SGD step.
        return torch.normal(0.0, std, shape, generator=self._generator, dtype=dtype)

    def gaussian_like(self, tensors: Sequence[torch.Tensor], std: float) -> list[torch.Tensor]:
        """Fresh N(0, std^2) tensors shaped, typed and placed like ``tensors`` (e.g. one per parameter).

        One draw of the total size, split into views (no concatenation, no copy on the CPU; one transfer to an
        accelerator), so the values are the same whatever device the tensors live on, and a subclass that
        overrides ``gaussian`` (e.g. exact discrete noise) is drawn through it.
        """
        if not tensors:
            return []
        sizes = [t.numel() for t in tensors]
        flat = self.gaussian(sum(sizes), std, dtype=tensors[0].dtype)
        if tensors[0].device.type != "cpu":
            flat = flat.to(tensors[0].device, non_blocking=True)
        return [chunk.view(t.shape).to(t.dtype) for chunk, t in zip(flat.split(sizes), tensors)]

    def laplace(self, shape: Sequence[int] | int, scale: float, dtype: torch.dtype = torch.float64) -> torch.Tensor:
        scale = check_positive("noise.scale", scale)
        shape = (shape,) if isinstance(shape, int) else tuple(shape)
        # Difference of two Exp(1) variables is Laplace(1); avoids log(0) at the ends of the uniform's support.
        first = torch.empty(shape, dtype=torch.float64).exponential_(generator=self._generator)
        second = torch.empty(shape, dtype=torch.float64).exponential_(generator=self._generator)
        return ((first - second) * scale).to(dtype)

    def state_dict(self) -> dict[str, Any]:
        return {"generator": self._generator.get_state(), "reproducible": self.reproducible}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._generator.set_state(state["generator"])
        self.reproducible = bool(state["reproducible"])

