"""The methods of reward-level private Q-learning (the ``fnq`` pipeline; privacy unit "reward": neighbouring reward
functions with sup |r - r'| <= 1), after Wang & Hegde 2019, "Privacy-preserving Q-learning with functional noise in
continuous spaces", and its baselines.

======================  ==================================================================================
``fnq``                 public-iterate Gaussian updates (``dporl.algos.fnq.RewardPrivateQLearning``): GUARANTEE
``input_perturbation``  Gaussian noise on every reward once, then the same learner without noise: GUARANTEE
``dp_sgd``              DP-SGD with the whole batch one unit (sensitivity 2C, no amplification): GUARANTEE
``fnq_paper``           the paper's Algorithm 1 with Theorem 5's sigma: the paper's figure, NOT a guarantee
``non_private``         the sound learner without clipping or noise (the reference; NO guarantee)
``random_policy``       the uniform random policy: uses no data
``untrained``           greedy on the initial network: uses no data
======================  ==================================================================================

Each is a ``RewardLevelMethod``: whether it prints a guarantee (``certified``), whether it uses data at all
(``data_free``), whether it runs at each epsilon of a comparison (``per_epsilon``) or once, which learner it trains
(``learner``: "reward_private" is ``RewardPrivateQLearning``, "functional_noise" ``FunctionalNoiseQLearning``), how
its batches are grouped into units (``units``: "transition" for per-transition clipping, "whole_batch" for DP-SGD's
one unit per batch, None for no private step), and its label. ``METHODS`` maps each name (the one spelling) to its
method; ``reward_level_method`` looks a name up with a named error for any other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional

from dporl.methods.base import method_named


@dataclass(frozen=True)
class RewardLevelMethod:
    """One method of the ``fnq`` pipeline (module docstring)."""

    name: str
    label: str
    certified: bool  # prints a guarantee (its mechanism is accounted)
    data_free: bool = False  # uses no data: its row needs no privacy
    paper: bool = False  # the paper's mechanism: its figure is printed as a paper claim, NOT a guarantee
    learner: Optional[str] = None  # "reward_private" or "functional_noise"; None: no learner trains
    units: Optional[str] = None  # "transition" or "whole_batch": how a private step groups its rows; None: no step

    @property
    def per_epsilon(self) -> bool:
        """Whether a comparison runs it at each epsilon (certified methods and the paper's), else once."""
        return self.certified or self.paper


FNQ = RewardLevelMethod("fnq", "public-iterate Gaussian updates (sound)", certified=True, learner="reward_private",
                        units="transition")
INPUT_PERTURBATION = RewardLevelMethod("input_perturbation", "Gaussian noise on every reward once (sound)",
                                       certified=True, learner="reward_private")
DP_SGD = RewardLevelMethod("dp_sgd", "DP-SGD, the whole batch one unit (sound)", certified=True,
                           learner="functional_noise", units="whole_batch")
FNQ_PAPER = RewardLevelMethod("fnq_paper", "the paper's Algorithm 1 (the paper's figure, NOT a guarantee)",
                              certified=False, paper=True, learner="functional_noise")
NON_PRIVATE = RewardLevelMethod("non_private", "the sound learner without clipping or noise (NO guarantee)",
                                certified=False, learner="reward_private")
RANDOM_POLICY = RewardLevelMethod("random_policy", "the uniform random policy (uses no data)", certified=False,
                                  data_free=True)
UNTRAINED = RewardLevelMethod("untrained", "greedy on the untrained network (uses no data)", certified=False,
                              data_free=True)
METHODS: dict[str, RewardLevelMethod] = {m.name: m for m in (FNQ, INPUT_PERTURBATION, DP_SGD, FNQ_PAPER,
                                                            NON_PRIVATE, RANDOM_POLICY, UNTRAINED)}


def reward_level_method(name: Any, field: str = "methods") -> RewardLevelMethod:
    """The method ``name`` of the ``fnq`` pipeline, or a ValidationError naming ``field`` (``method_named``)."""
    return method_named(METHODS, name, field, "fnq pipeline")
