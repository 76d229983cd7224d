"""cql.reward_scale (used by configs/expert_cql_hiv.yaml): dividing rewards by a public constant inside the TD target
is the same as training on rewards already divided by it, and bad scales are refused."""

import pytest
import torch

from dporl.algos.cql import CQLConfig, DiscreteCQLModule
from dporl.privacy.samplers import Batch
from dporl.utils.validation import ValidationError


def _batch(rewards: torch.Tensor) -> Batch:
    gen = torch.Generator().manual_seed(1)
    n = rewards.shape[0]
    data = {
        "obs": torch.randn(n, 6, generator=gen),
        "actions": torch.randint(0, 4, (n,), generator=gen),
        "rewards": rewards,
        "next_obs": torch.randn(n, 6, generator=gen),
        "terminated": torch.zeros(n, dtype=torch.bool),
    }
    return Batch(data, torch.arange(n), n, private=False)


def _losses(scale: float, rewards: torch.Tensor) -> torch.Tensor:
    torch.manual_seed(0)  # same initial weights for both modules
    module = DiscreteCQLModule(6, 4, CQLConfig(hidden_sizes=[16], reward_scale=scale), privacy_unit="expert")
    return module.row_losses(_batch(rewards)).detach()


def test_scaled_rewards_equal_prescaled_rewards():
    rewards = torch.full((32,), 1e5) * torch.rand(32, generator=torch.Generator().manual_seed(2))
    scaled = _losses(1e5, rewards)
    torch.testing.assert_close(scaled, _losses(1.0, rewards / 1e5))
    # Unscaled, the TD errors are ~1e5 and the losses differ by orders of magnitude: the option really acts.
    assert _losses(1.0, rewards).mean() > 100 * scaled.mean()


@pytest.mark.parametrize("scale", [0.0, -1.0])
def test_nonpositive_scale_refused(scale):
    with pytest.raises(ValidationError, match="cql.reward_scale"):
        CQLConfig(reward_scale=scale)
