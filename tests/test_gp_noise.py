import io
import math

import pytest
import torch

from dporl.privacy.gp_noise import (
    FunctionalNoise,
    LaplaceKernelPath,
    OrnsteinUhlenbeckPath,
    dense_conditional,
    laplace_kernel,
)
from dporl.privacy.noise import NoiseSource
from dporl.utils.validation import ValidationError


def _stored_1d(path: OrnsteinUhlenbeckPath) -> tuple[torch.Tensor, torch.Tensor]:
    state = path.state_dict()
    return state["x"].unsqueeze(1), state["g"]


@pytest.mark.parametrize("beta", [0.7, 5.0, 40.0])
def test_markov_conditioning_equals_dense_gp_conditioning(beta):
    path = OrnsteinUhlenbeckPath(sigma=1.3, beta=beta, noise=NoiseSource(0))
    path(torch.tensor([0.12, 0.5, 0.31, 0.77, 0.9]))
    xs, gs = _stored_1d(path)
    # Left of all points, between neighbours (near each side and mid-gap), right of all points.
    queries = torch.tensor([-0.2, 0.0, 0.13, 0.2, 0.3, 0.45, 0.6, 0.899, 1.0, 1.7], dtype=torch.float64)
    mean, var = dense_conditional(xs, gs, queries.unsqueeze(1), 1.3, beta)
    for q, m, v in zip(queries.tolist(), mean.tolist(), var.tolist()):
        got_mean, got_var = path.conditional(q)
        assert got_mean == pytest.approx(m, abs=1e-9)
        assert got_var == pytest.approx(v, abs=1e-9)


def test_seed_appendix_weights_would_fail_the_dense_check():
    # The seed's appendix swaps the two weights; at an asymmetric point the swap changes the mean, so the dense
    # comparison above really distinguishes the corrected formula from the printed one.
    path = OrnsteinUhlenbeckPath(sigma=1.0, beta=3.0, noise=NoiseSource(1))
    path(torch.tensor([0.0, 1.0]))
    xs, gs = _stored_1d(path)
    s = 0.2
    a, b = math.exp(-3.0 * s), math.exp(-3.0 * (1 - s))
    swapped = (b * (1 - a * a) * gs[0] + a * (1 - b * b) * gs[1]) / (1 - a * a * b * b)
    dense_mean, _ = dense_conditional(xs, gs, torch.tensor([[s]], dtype=torch.float64), 1.0, 3.0)
    assert path.conditional(s)[0] == pytest.approx(float(dense_mean), abs=1e-12)
    assert abs(float(swapped) - float(dense_mean)) > 1e-3


def test_multidimensional_conditioning_equals_dense_gp_conditioning():
    path = LaplaceKernelPath(dim=3, sigma=0.8, beta=2.0, noise=NoiseSource(2), capacity=2)  # forces growth
    generator = torch.Generator().manual_seed(0)
    path(torch.rand(9, 3, generator=generator))
    state = path.state_dict()
    queries = torch.rand(6, 3, generator=generator, dtype=torch.float64)
    mean, var = dense_conditional(state["x"], state["g"], queries, 0.8, 2.0)
    for q, m, v in zip(queries, mean.tolist(), var.tolist()):
        got_mean, got_var = path.conditional(q)
        assert got_mean == pytest.approx(m, abs=1e-9)
        assert got_var == pytest.approx(v, abs=1e-9)


def _empirical_covariance_check(make, points_first, points_second, kernel, n_paths):
    values = []
    for i in range(n_paths):
        path = make(NoiseSource(1000 + i))
        first = path(points_first)
        second = path(points_second)  # a later batch, conditioned on the first
        values.append(torch.cat([first, second]).to(torch.float64))
    samples = torch.stack(values)  # [n_paths, n_points]
    empirical = samples.T @ samples / n_paths  # the mean is known to be 0
    # Var of the estimator of Cov(X_i, X_j) with known zero mean is (K_ii K_jj + K_ij^2) / n; allow 5 standard errors.
    tolerance = 5 * torch.sqrt((torch.outer(kernel.diag(), kernel.diag()) + kernel**2) / n_paths)
    assert ((empirical - kernel).abs() <= tolerance).all(), (empirical - kernel).abs() / tolerance


def test_sampled_paths_have_the_kernel_covariance_one_dimension():
    first = torch.tensor([0.7, 0.1, 0.45], dtype=torch.float64)
    second = torch.tensor([0.3, 0.95, 0.12, 0.3], dtype=torch.float64)  # a repeat inside the batch
    every = torch.cat([first, second]).unsqueeze(1)
    kernel = laplace_kernel(every, every, 1.5, 3.0)
    _empirical_covariance_check(lambda n: OrnsteinUhlenbeckPath(1.5, 3.0, n), first, second, kernel, 3000)


def test_sampled_paths_have_the_kernel_covariance_two_dimensions():
    first = torch.tensor([[0.1, 0.2], [0.8, 0.4]], dtype=torch.float64)
    second = torch.tensor([[0.15, 0.25], [0.5, 0.5], [0.9, 0.1]], dtype=torch.float64)
    every = torch.cat([first, second])
    kernel = laplace_kernel(every, every, 1.0, 2.0)
    _empirical_covariance_check(lambda n: LaplaceKernelPath(2, 1.0, 2.0, n), first, second, kernel, 2000)


@pytest.mark.parametrize("dim", [1, 2])
def test_queries_are_consistent_and_order_free(dim):
    generator = torch.Generator().manual_seed(3)
    points = torch.rand(20, dim, generator=generator)
    make = (lambda n: OrnsteinUhlenbeckPath(1.0, 4.0, n)) if dim == 1 else (lambda n: LaplaceKernelPath(dim, 1.0, 4.0, n))
    path, permuted_path = make(NoiseSource(5)), make(NoiseSource(5))
    values = path(points)
    permutation = torch.randperm(20, generator=generator)
    assert torch.equal(permuted_path(points[permutation]), values[permutation])  # batch order does not matter
    assert torch.equal(path(points), values)  # repeated queries return stored values
    doubled = path(torch.cat([points[:5], points[:5]]))
    assert torch.equal(doubled[:5], doubled[5:])
    assert path.n_points == 20
    path.reset()
    assert path.n_points == 0
    assert not torch.equal(path(points), values)


def test_functional_noise_answers_identically_after_save_and_load():
    module = FunctionalNoise(2, [-1.0, 0.0], [1.0, 4.0], sigma=0.5, beta=3.0, noise=NoiseSource(11))
    generator = torch.Generator().manual_seed(4)
    seen = torch.rand(30, 2, generator=generator)
    before = module(seen)
    buffer = io.BytesIO()
    torch.save(module.state_dict(), buffer)
    buffer.seek(0)
    clone = FunctionalNoise(2, [-1.0, 0.0], [1.0, 4.0], sigma=0.5, beta=3.0, noise=NoiseSource(99))
    clone.load_state_dict(torch.load(buffer, weights_only=False))
    fresh = torch.rand(10, 2, generator=generator)
    assert torch.equal(clone(seen), before)
    assert torch.equal(clone(fresh), module(fresh))  # new points too: the generator state travels with the paths
    assert before.shape == (30, 2)


def test_one_dimensional_module_accepts_flat_or_column_states_and_zero_sigma():
    module = FunctionalNoise(3, [0.0], [2.0], sigma=1.0, beta=1.0, noise=NoiseSource(0))
    flat = module(torch.tensor([0.5, 1.5]))
    assert torch.equal(module(torch.tensor([[0.5], [1.5]])), flat)
    assert flat.shape == (2, 3)
    silent = FunctionalNoise(2, [0.0], [1.0], sigma=0.0, beta=1.0, noise=NoiseSource(0))
    assert torch.equal(silent(torch.rand(4, 1)), torch.zeros(4, 2))
    assert silent.n_points == 0


def test_bad_inputs_name_their_field():
    with pytest.raises(ValidationError, match="gp_noise.beta"):
        OrnsteinUhlenbeckPath(1.0, 0.0, NoiseSource(0))
    with pytest.raises(ValidationError, match="points"):
        LaplaceKernelPath(3, 1.0, 1.0, NoiseSource(0))(torch.zeros(4, 2))
    with pytest.raises(ValidationError, match="state_high"):
        FunctionalNoise(2, [0.0, 1.0], [1.0, 1.0], sigma=1.0, beta=1.0)
    with pytest.raises(ValidationError, match="points"):
        OrnsteinUhlenbeckPath(1.0, 1.0, NoiseSource(0))(torch.tensor([0.1, float("nan")]))


def test_block_update_equals_one_point_at_a_time_and_tolerates_near_duplicates():
    generator = torch.Generator().manual_seed(6)
    points = torch.rand(15, 2, generator=generator, dtype=torch.float64)
    ordered = torch.tensor(sorted(points.tolist()), dtype=torch.float64)  # the path's (lexicographic) order
    batch, single = LaplaceKernelPath(2, 1.0, 3.0, NoiseSource(8)), LaplaceKernelPath(2, 1.0, 3.0, NoiseSource(8))
    values = batch(ordered)
    one_by_one = torch.stack([single(p.unsqueeze(0))[0] for p in ordered])
    assert torch.allclose(values, one_by_one, atol=1e-10)
    # Points 1e-14 apart are determined by each other: answered by the conditional mean, stored once.
    twins = torch.tensor([[0.3, 0.3], [0.3, 0.3 + 1e-14]], dtype=torch.float64)
    out = batch(twins)
    assert abs(float(out[0] - out[1])) < 1e-6 and batch.n_points == 16
