"""Output perturbation with data-dependent (smooth-sensitivity) Gaussian noise.

Lemma 1 of Balle, Gomrokchi, Precup (2016), after Nissim, Raskhodnikova, Smith (2007/2011): releasing
N(mu_X, sigma_X^2 I_d) is (epsilon, delta)-DP if for all neighbours X ~ X'
(a) sigma_X >= alpha ||mu_X - mu_X'||_2 and (b) |ln sigma_X^2 - ln sigma_X'^2| <= beta, where
alpha = 5 sqrt(2 ln(2/delta)) / epsilon and beta = epsilon / (4 d + 4 ln(2/delta)).
The algorithm supplies mu_X and a sigma_X meeting (a) and (b) (a beta-smooth upper bound of its local
sensitivity); this module owns the constants and the one noise draw.
"""

from __future__ import annotations

import math

import torch

from dporl.privacy.noise import NoiseSource
from dporl.utils.validation import ValidationError, check_positive, check_probability


def smooth_sensitivity_constants(epsilon: float, delta: float, dim: int) -> tuple[float, float]:
    """(alpha, beta) of Lemma 1 for a d-dimensional release at (epsilon, delta)."""
    check_positive("epsilon", epsilon)
    check_probability("delta", delta, allow_zero=False, allow_one=False)
    if dim < 1:
        raise ValidationError("dim", f"must be >= 1, got {dim}")
    log_term = math.log(2.0 / delta)
    return 5.0 * math.sqrt(2.0 * log_term) / epsilon, epsilon / (4.0 * (dim + log_term))


def gaussian_output_perturbation(value: torch.Tensor, sigma: float, noise: NoiseSource) -> torch.Tensor:
    """value + N(0, sigma^2 I), drawn from ``noise`` in value's precision."""
    if not isinstance(noise, NoiseSource):
        raise ValidationError("noise", "privacy noise must come from dporl.privacy.noise.NoiseSource")
    check_positive("sigma", sigma)
    return value + noise.gaussian(value.shape, sigma, dtype=value.dtype)
