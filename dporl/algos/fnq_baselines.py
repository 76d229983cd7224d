"""Baselines of the functional-noise paper (seeds/004, section 4), all with privacy unit "reward".

* Input perturbation (Venkitasubramaniam 2013): Gaussian noise on every observed reward, once, when it is
  observed; the learner is then an ordinary (non-private) Q-learner. Calibration: n rewards that may each change by
  1 form one Gaussian mechanism of L2 sensitivity sqrt(n) (``reward_perturbation_std``).
* DP-SGD on the Q-network (Abadi et al. 2016): neighbouring reward functions may change every reward, so every
  row of a batch may change. The whole batch is therefore ONE privacy unit: its mean-loss gradient is clipped to C
  and noised with std sigma C. Two neighbours move the clipped gradient by at most 2C, so each step is a Gaussian
  mechanism with noise multiplier sigma / 2 and no subsampling amplification (the reward function is in every
  batch). Per-example clipping would be worse here: B rows changing at once move a clipped sum by 2BC.
* Non-private DQN: ``FunctionalNoiseQLearning`` with sigma = 0 and no gradient noise.
"""

from __future__ import annotations

import torch

from dporl.privacy.events import PoissonGaussianEvent
from dporl.privacy.noise import NoiseSource
from dporl.privacy.samplers import Batch
from dporl.utils.validation import check_positive


class GaussianRewardNoise:
    """r -> r + N(0, std^2) per reward, drawn from a ``NoiseSource`` (apply once per observed reward)."""

    def __init__(self, std: float, noise: NoiseSource):
        self.std = check_positive("input_perturbation.std", std)
        self.noise = noise
        self.rewards_perturbed = 0

    def __call__(self, rewards: torch.Tensor) -> torch.Tensor:
        self.rewards_perturbed += rewards.numel()
        return rewards + self.noise.gaussian(rewards.shape, self.std, dtype=rewards.dtype)


class WholeBatchUnitSource:
    """Wraps a batch source so that each batch is one privacy unit of a private DP-SGD step (see module doc)."""

    def __init__(self, inner):
        self.inner = inner

    @property
    def expected_batch_size(self) -> float:
        return 1.0  # one unit per step: the engine's noisy sum is the noisy clipped mean gradient

    def sample(self, generator: torch.Generator) -> Batch:
        batch = self.inner.sample(generator)
        return Batch(batch.data, torch.zeros(batch.n_rows, dtype=torch.long), 1, private=True)

    def step_event(self, noise_multiplier: float) -> PoissonGaussianEvent:
        # Replacing the reward function moves the clipped unit gradient by up to 2C; the engine's noise is sigma C.
        return PoissonGaussianEvent(noise_multiplier / 2, 1.0)
