"""Feature maps against hand computations."""

import math

import pytest
import torch
from torch import nn

from dporl.envs.features import FourierBasis, ModuleFeatures, StateAggregation, TabularFeatures
from dporl.utils.validation import ValidationError


def test_tabular_one_hot_any_batch_shape():
    phi = TabularFeatures(4)
    out = phi(torch.tensor([[[2.0], [0.0]], [[3.0], [1.0]]]))
    assert out.shape == (2, 2, 4) and phi.n_features == 4
    assert out.argmax(-1).tolist() == [[2, 0], [3, 1]] and out.sum(-1).eq(1).all()
    with pytest.raises(ValidationError, match="obs"):
        phi(torch.tensor([[4.0]]))
    with pytest.raises(ValidationError, match="obs"):
        phi(torch.tensor([[1.5]]))


def test_state_aggregation_cells():
    chain = StateAggregation([0.0], [40.0], 8)  # 5 chain states per group
    assert chain.n_features == 8
    assert chain(torch.tensor([[0.0], [4.0], [5.0], [39.0]])).argmax(-1).tolist() == [0, 0, 1, 7]
    grid = StateAggregation([0.0, -1.0], [1.0, 1.0], [2, 3])
    # (x, y) -> cell (floor(2x), floor(3 (y + 1) / 2)), index 3 * i + j; outside the box clamps to the edge
    obs = torch.tensor([[0.9, 0.5], [0.1, -0.9], [2.0, -5.0]])
    assert grid(obs).argmax(-1).tolist() == [3 * 1 + 2, 0, 3 * 1 + 0]


def test_fourier_basis_hand_computed():
    phi = FourierBasis(1, [0.0, 0.0], [2.0, 4.0])
    assert phi.n_features == 4
    x = torch.tensor([[1.0, 1.0]])  # scaled (0.5, 0.25); c in (0,0), (0,1), (1,0), (1,1)
    expected = [1.0, math.cos(math.pi * 0.25), math.cos(math.pi * 0.5), math.cos(math.pi * 0.75)]
    torch.testing.assert_close(phi(x)[0], torch.tensor(expected), atol=1e-6, rtol=0)


def test_fourier_mountain_car_order_five():
    phi = FourierBasis.mountain_car(5)
    assert phi.n_features == 36
    out = phi(torch.tensor([[-1.2, -0.07], [0.5, 0.07]], dtype=torch.float64))
    assert out.dtype == torch.float64 and torch.all(out[:, 0] == 1)
    torch.testing.assert_close(out[0], torch.ones(36, dtype=torch.float64))  # scaled origin: cos(0) everywhere
    c = phi.coefficients.sum(-1)  # scaled (1, 1): cos(pi (c1 + c2)) = (-1)^(c1 + c2)
    torch.testing.assert_close(out[1], (-1.0) ** c, atol=1e-9, rtol=0)
    with pytest.raises(ValidationError, match="obs"):
        phi(torch.zeros(3, 4))


def test_module_features_are_frozen_copies():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(3, 8), nn.ReLU(), nn.Linear(8, 5))
    phi = ModuleFeatures(net)
    obs = torch.randn(4, 3)
    before = phi(obs)
    assert phi.n_features == 5 and not before.requires_grad
    torch.testing.assert_close(before, net(obs).detach())
    with torch.no_grad():
        net[0].weight.add_(1.0)  # training the original must not move the features
    torch.testing.assert_close(phi(obs), before)
    with pytest.raises(ValidationError, match="n_features"):
        ModuleFeatures(nn.ReLU())
