"""Private evaluation of a target policy on logged data, at the level of the dataset's privacy unit.

One import for the estimators and their parts, each in its own module:

- ``dporl.eval.ope_importance``: ``dp_importance_sampling`` (DP-WIS, DP-PDIS, DP-DR's estimate);
- ``dporl.eval.ope_fqe``: ``dp_fqe`` (DP fitted-Q evaluation over folds of units), ``FQETraining``;
- ``dporl.eval.ope_dr``: ``dp_doubly_robust``;
- ``dporl.eval.ope_release``: the clipped unit sums and their Gaussian release;
- ``dporl.eval.ope_interval``: the interval of a released ratio (Fieller-type, with the noisy variance's margin);
- ``dporl.eval.ope_scales``: public scales derived from declared facts (``OPEScales``);
- ``dporl.eval.ope_feasibility``: the noise predicted before spending, and the refusal;
- ``dporl.eval.ope_calibration``: which configurations the benchmark suite measured calibrated;
- ``dporl.eval.ope_result``: ``OPEResult`` and the rules every result obeys (clamped, NaN when failed);
- ``dporl.eval.ope_policies``: the target policy's probabilities on logged states.
"""

from dporl.algos.fqe import FQEConfig
from dporl.eval.ope_dr import dp_doubly_robust
from dporl.eval.ope_feasibility import Feasibility, InfeasibleEvaluation, predict_fqe, predict_ratio
from dporl.eval.ope_fqe import FQETraining, fit_dp_fqe, fqe_normaliser, dp_fqe
from dporl.eval.ope_importance import dp_importance_sampling, episode_terms
from dporl.eval.ope_interval import ratio_interval
from dporl.eval.ope_policies import (
    action_probabilities,
    declare_deterministic,
    logged_action_probabilities,
    target_is_deterministic,
)
from dporl.eval.ope_release import (
    dpsgd_mechanism,
    gaussian_noise_multiplier,
    moment_rows,
    per_unit,
    release_ratio,
    unit_pairs,
)
from dporl.eval.ope_result import OPEResult
from dporl.eval.ope_scales import OPEScales

__all__ = [
    "FQEConfig", "FQETraining", "Feasibility", "InfeasibleEvaluation", "OPEResult", "OPEScales",
    "action_probabilities", "declare_deterministic", "dp_doubly_robust", "dp_fqe", "dp_importance_sampling",
    "dpsgd_mechanism", "episode_terms", "fit_dp_fqe", "fqe_normaliser", "gaussian_noise_multiplier",
    "logged_action_probabilities", "moment_rows", "per_unit", "predict_fqe", "predict_ratio", "ratio_interval",
    "release_ratio", "target_is_deterministic", "unit_pairs",
]
