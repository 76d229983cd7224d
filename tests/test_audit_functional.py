"""The functional-noise (Theorem 5) audit: honest claim holds, sigma / 10 refutes it, and the audit's pieces are the
mechanism the library runs (same sampler numbers, RKHS norm of the canary = sqrt(C), exact score law)."""

import math

import numpy as np
import pytest
import torch

from dporl.audit import run_audit
from dporl.audit.functional_audits import (
    functional_noise_audit,
    lemma6_norm,
    ou_values,
    update_shift_norms,
    worst_case_shift,
)
from dporl.audit.registry import build_audit
from dporl.privacy.gp_noise import OrnsteinUhlenbeckPath
from dporl.privacy.noise import NoiseSource
from dporl.utils.validation import ValidationError


def test_calibrated_release_passes_and_the_audit_has_power():
    # Defaults: eps = 1, delta_total = 1e-5, 8 updates -> mu = eps / sqrt(2 ln(e + eps/delta)) ~ 0.20 (exact
    # eps ~ 0.77 < 1); at sigma / 10, mu ~ 2.0 and 10_000 held-out trials certify eps up to ~log(10^4 / 4) ~ 7.8,
    # well above the claim of 1 (seeded run: ~5.0).
    honest = run_audit(functional_noise_audit(), 20_000, seed=1)
    assert not honest.violated, honest.describe()
    assert honest.epsilon_lower_bound > 0.1  # the experiment sees the canary at all
    assert honest.exceeded_references() == []  # nor does it beat the exact eps of the audited mechanism
    weakened = run_audit(build_audit("functional_noise", power=True), 20_000, seed=2)
    assert weakened.violated, weakened.describe()


def test_library_sampler_end_to_end_has_power_too():
    # One OrnsteinUhlenbeckPath per trial and update: slow, so few trials; 200 held-out trials certify up to ~3.9.
    weakened = run_audit(functional_noise_audit(noise_factor=0.1, sampler="library"), 400, seed=3)
    assert weakened.violated, weakened.describe()


def test_markov_recursion_returns_the_library_paths_numbers():
    # Same standard normals in the same order -> same values: the batched recursion IS the library's sorted-batch law.
    points = torch.tensor([0.1, 0.13, 0.2, 0.55, 0.9], dtype=torch.float64)
    for seed in range(3):
        library = OrnsteinUhlenbeckPath(1.7, 6.0, NoiseSource(seed))(points)
        batched = ou_values(points, 1.7, 6.0, NoiseSource(seed).gaussian((1, 5), 1.0, dtype=torch.float64))[0]
        torch.testing.assert_close(batched, library, rtol=1e-12, atol=1e-12)


def test_worst_case_shift_has_rkhs_norm_sqrt_c_in_lemma_6_norm():
    # Lemma 6: ||f||_H^2 = (f(0)^2 + f(1)^2) / 2 + 1/(2 beta) int_0^1 f'^2 + beta^2 f^2, the RKHS of exp(-beta|x-y|).
    # lemma6_norm's quadrature on 400_001 points (finite differences smear each kink over one cell: error ~1e-5)
    # against the reproducing-property value that worst_case_shift is built on.
    beta, norm = 5.0, 0.37
    points = torch.tensor([0.3, 0.45, 0.7], dtype=torch.float64)
    at_points = worst_case_shift(points, beta, norm)
    grid = torch.linspace(0.0, 1.0, 400_001, dtype=torch.float64)
    scale = float(at_points[0] / torch.exp(-beta * (points[0] - points).abs()).sum())
    f = scale * torch.exp(-beta * (grid[:, None] - points).abs()).sum(1)
    assert float(lemma6_norm(f, grid, beta)) == pytest.approx(norm, rel=1e-4)
    # A constant c has ||c||^2 = c^2 + beta c^2 / 2 (boundary term + L2 term): an independent closed form.
    assert float(lemma6_norm(torch.full_like(grid, 2.0), grid, beta)) == pytest.approx(2 * math.sqrt(1 + beta / 2))


def test_update_shift_probe_measures_the_real_learners_step():
    # lr = 0: no step, no shift. Otherwise the shift is the learner's own: for a small step it is first order in lr
    # (doubling lr doubles both figures to within a few per cent at lr 1e-3).
    from dporl.algos.fnq import FNQConfig, FunctionalNoiseQLearning
    from dporl.privacy.samplers import Batch

    torch.manual_seed(0)
    learner = FunctionalNoiseQLearning(1, 2, FNQConfig(sigma=0.5, beta=3.0), NoiseSource(0))
    generator = torch.Generator().manual_seed(0)
    obs = torch.rand(16, 1, generator=generator)
    actions, rewards = torch.randint(0, 2, (16,), generator=generator), torch.rand(16, generator=generator)
    data = dict(obs=obs, actions=actions, rewards=rewards, next_obs=obs.flip(0), terminated=torch.zeros(16))
    batch = Batch(data, torch.arange(16), 16, True)
    zero_norm, zero_sup = update_shift_norms(learner, batch, 0.0, 3.0, grid_size=2_001)
    assert float(zero_norm.max()) == 0.0 and float(zero_sup.max()) == 0.0
    small, _ = update_shift_norms(learner, batch, 1e-3, 3.0, grid_size=2_001)
    double, _ = update_shift_norms(learner, batch, 2e-3, 3.0, grid_size=2_001)
    assert float(small.min()) > 0
    torch.testing.assert_close(double / small, torch.full_like(small, 2.0), rtol=0.05, atol=0.0)
    assert learner.noise.n_points == 0  # the probe stepped copies: the learner and its paths are untouched


def test_scores_have_the_exact_gaussian_law():
    # Score = sum_j Delta^T (sigma^2 K)^{-1} y_j ~ N(mu^2, mu^2) on D and N(0, mu^2) on D', mu = sqrt(T/B C) / sigma.
    # With n = 40_000 the standardised mean is within 5 / sqrt(n) and the std within 5 sqrt(1 / (2n)) (5 sigma).
    experiment = functional_noise_audit(updates=4, epsilon=0.5)
    settings, n = experiment.settings, 40_000
    mu = settings["mu"]
    assert mu == pytest.approx(math.sqrt(settings["updates"] * settings["C"]) / settings["sigma"], rel=1e-9)
    for on_d, mean in ((True, mu), (False, 0.0)):
        standardised = experiment.scores(n, on_d, 11 + on_d) / mu
        assert abs(standardised.mean() - mean) < 5 / math.sqrt(n)
        assert abs(standardised.std() - 1.0) < 5 * math.sqrt(1 / (2 * n))


def test_bad_settings_name_their_field():
    with pytest.raises(ValidationError, match="sampler"):
        functional_noise_audit(sampler="cholesky")
    with pytest.raises(ValidationError, match="n_points"):
        functional_noise_audit(n_points=0)
    with pytest.raises(ValidationError, match="noise_factor"):
        build_audit("functional_noise", {"noise_factor": -1.0})
    with pytest.raises(ValidationError, match="delta"):
        build_audit("functional_noise", {"delta": "abc"})  # command-line settings arrive as strings
    assert np.isfinite(functional_noise_audit(n_points=1).claimed_epsilon)
