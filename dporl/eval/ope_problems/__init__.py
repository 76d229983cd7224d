"""Off-policy evaluation problems: a logged dataset, public features, a target policy, and the truth where known.

See ``base`` for the ``OPEProblem`` protocol; ``chain``, ``mountain_car`` and ``hiv`` are the papers' problems
(Xie, Thomas, Miklau 2019; Balle, Gomrokchi, Precup 2016), ``LoggedProblem`` a user's own logged data.
"""

from dporl.eval.ope_problems.base import (
    FiniteStateProblem,
    HeldoutMSPBE,
    LoggedProblem,
    OPEProblem,
    WEIGHTING_LABELS,
    padded_data,
)
from dporl.eval.ope_problems.chain import ChainSettings, FiniteMRPProblem, chain_problem
from dporl.eval.ope_problems.hiv import HIVProblem, HIVSettings, hiv_problem
from dporl.eval.ope_problems.mountain_car import MountainCarProblem, MountainCarSettings, mountain_car_problem
from dporl.eval.ope_problems.policies import EpsilonGreedyPolicy, SoftmaxPolicy, uniform_policy

__all__ = [
    "ChainSettings",
    "EpsilonGreedyPolicy",
    "FiniteMRPProblem",
    "FiniteStateProblem",
    "HIVProblem",
    "HIVSettings",
    "HeldoutMSPBE",
    "LoggedProblem",
    "MountainCarProblem",
    "MountainCarSettings",
    "OPEProblem",
    "SoftmaxPolicy",
    "WEIGHTING_LABELS",
    "chain_problem",
    "hiv_problem",
    "mountain_car_problem",
    "padded_data",
    "uniform_policy",
]
