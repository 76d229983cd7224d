"""Experts: batched behaviour policies (ExpertSet), their generation (analytic controllers, PPO over physics
variants, optionally on Ray) and rollouts into logged datasets.

Only the light modules are imported here; ``generate``, ``ppo`` and ``collect`` pull in Gymnasium (and Ray when
asked) and are imported on use.
"""

from dporl.experts.expert_set import ExpertSet, sample_from_log_probs
from dporl.experts.policies import FAMILIES, StackedLinearPolicy, StackedMLPPolicy, StackedPolicy

__all__ = [
    "ExpertSet",
    "FAMILIES",
    "StackedLinearPolicy",
    "StackedMLPPolicy",
    "StackedPolicy",
    "sample_from_log_probs",
]
