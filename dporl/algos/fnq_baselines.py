"""Baselines for reward-level private Q-learning (seeds/004, section 4), all with privacy unit "reward".

* Input perturbation (Venkitasubramaniam 2013), dporl's second sound reward-level learner: Gaussian noise on every
  reward, ONCE, when it is observed (online) or loaded (offline); the learner is then an ordinary Q-learner on the
  noisy rewards (post-processing). A reward that many updates replay is released once: its noisy value is stored
  and reused, never redrawn. Calibration: N released rewards, each of which may change by up to 1 between
  neighbours, are N Gaussian releases of sensitivity 1, which compose exactly (also adaptively) into one Gaussian
  mechanism of L2 sensitivity sqrt(N). Offline N is the number of logged transitions (all are released, used or
  not). Online every environment step evaluates the reward function at a new (state, action), chosen adaptively
  from earlier noisy rewards; each is one more release, so N is the number of environment steps T, fixed in
  advance (``GaussianRewardNoise`` refuses the N+1-th reward). Revisiting a state does not help an attacker beyond
  sqrt(N): the bound counts every release, repeated points included. The noise std therefore grows as sqrt(N)
  (``gaussian_noise_multiplier`` with one release, times sqrt(N); ``reward_perturbation_std`` is the exact analytic
  calibration), and the learner must average many noisy rewards to see the reward function.
* DP-SGD on the Q-network (Abadi et al. 2016): neighbouring reward functions may change every reward, so every
  row of a batch may change. The whole batch is therefore ONE privacy unit: its mean-loss gradient is clipped to C
  and noised with std sigma C. Two neighbours move the clipped gradient by at most 2C, so each step is a Gaussian
  mechanism with noise multiplier sigma / 2 and no subsampling amplification (the reward function is in every
  batch). ``dporl.algos.fnq.RewardPrivateQLearning`` improves on it by clipping per transition and bounding the
  TD error's change instead (sensitivity C, not 2C, and a noise that does not grow with the loss scale).
* Non-private reference: ``RewardPrivateQLearning`` without the engine (same semi-gradient, no clipping, no noise).
"""

from __future__ import annotations

import torch

from dporl.privacy.events import PoissonGaussianEvent
from dporl.privacy.noise import NoiseSource
from dporl.privacy.samplers import Batch
from dporl.utils.validation import PrivacyBudgetError, ValidationError, check_positive


class GaussianRewardNoise:
    """r -> r + N(0, std^2) per reward, drawn from a ``NoiseSource``; at most ``n_rewards`` rewards, each once.

    ``std`` is calibrated for ``n_rewards`` releases (see the module docstring); perturbing more would spend
    beyond the accounted budget, so it is refused (``PrivacyBudgetError``, nothing drawn).
    """

    def __init__(self, std: float, noise: NoiseSource, n_rewards: int):
        self.std = check_positive("input_perturbation.std", std)
        if int(n_rewards) != n_rewards or n_rewards < 1:
            raise ValidationError("input_perturbation.n_rewards", f"must be an integer >= 1, got {n_rewards}")
        self.noise = noise
        self.n_rewards = int(n_rewards)
        self.rewards_perturbed = 0

    def __call__(self, rewards: torch.Tensor) -> torch.Tensor:
        if self.rewards_perturbed + rewards.numel() > self.n_rewards:
            raise PrivacyBudgetError(
                "input_perturbation.n_rewards",
                f"{self.rewards_perturbed} + {rewards.numel()} rewards would exceed the {self.n_rewards} the noise "
                "was calibrated for",
            )
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
