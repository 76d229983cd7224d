"""The built-in audits by name, their power variants, and audits derived from a user's pipeline config."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Mapping

from dporl.audit.dpsgd_audits import dpsgd_step_audit, gpope_audit, gpope_paper_audit, mixture_audit
from dporl.audit.experiment import Experiment
from dporl.audit.functional_audits import functional_noise_audit, gaussian_update_audit, paper_attack_audit
from dporl.audit.ope_audits import private_ope_audit
from dporl.audit.noise_audits import gaussian_audit, laplace_audit, secure_gaussian_audit, secure_laplace_audit
from dporl.audit.release_audits import output_perturbation_audit, reward_perturbation_audit
from dporl.audit.selection_audit import selection_audit
from dporl.audit.stable_prefix_audit import stable_prefix_audit
from dporl.utils.validation import ValidationError


def _dp_lsw(**kwargs) -> Experiment:
    return output_perturbation_audit(method="lsw", **kwargs)


def _dp_lsl(**kwargs) -> Experiment:
    return output_perturbation_audit(method="lsl", **kwargs)


def _stable_prefix_logged(**kwargs) -> Experiment:
    return stable_prefix_audit(source="logged", **kwargs)


AUDITS: dict[str, Callable[..., Experiment]] = {
    "gaussian": gaussian_audit,
    "laplace": laplace_audit,
    "secure_gaussian": secure_gaussian_audit,
    "secure_laplace": secure_laplace_audit,
    "dpsgd_step": dpsgd_step_audit,
    "mixture": mixture_audit,
    "gpope": gpope_audit,
    "gpope_paper": gpope_paper_audit,
    "dp_lsw": _dp_lsw,
    "dp_lsl": _dp_lsl,
    "reward_perturbation": reward_perturbation_audit,
    "stable_prefix": stable_prefix_audit,
    "stable_prefix_logged": _stable_prefix_logged,
    "functional_noise": functional_noise_audit,
    "private_ope": private_ope_audit,
    "fnq_paper_attack": paper_attack_audit,
    "fnq_gaussian": gaussian_update_audit,
    "selection": selection_audit,
}

# Settings that break each mechanism on purpose (the power check): the audit must then exceed the claim.
POWER_SETTINGS: dict[str, dict[str, Any]] = {
    "gaussian": {"noise_factor": 0.1},
    "laplace": {"noise_factor": 0.1},
    "secure_gaussian": {"noise_factor": 0.1},
    "secure_laplace": {"noise_factor": 0.1},
    "dpsgd_step": {"noise_factor": 0.1},
    "mixture": {"noise_factor": 0.1},
    "gpope": {"noise_factor": 0.1},
    "gpope_paper": {"noise_factor": 0.1},
    "dp_lsw": {"noise_factor": 0.01},  # smooth sensitivity over-covers by alpha ~ 25
    "dp_lsl": {"noise_factor": 0.01},
    "reward_perturbation": {"noise_factor": 0.1},
    # Threshold removed (noise / 1000): whole fresh rollouts are released.
    "stable_prefix": {"threshold_factor": 0.0, "noise_factor": 1e-3},
    "stable_prefix_logged": {"threshold_factor": 0.0, "noise_factor": 1e-3},
    "functional_noise": {"noise_factor": 0.1},
    "private_ope": {"noise_factor": 0.1},
    "fnq_paper_attack": {},  # refutes the paper's figure as it stands: it objects without any change
    "fnq_gaussian": {"noise_factor": 0.1},
    "selection": {"fixed_trials": 10},  # the best of 10 trials released under one trial's epsilon
}


def build_audit(name: str, settings: Mapping[str, Any] | None = None, power: bool = False) -> Experiment:
    """The named audit with ``settings`` (keyword arguments of its builder; unknown names are errors)."""
    if name not in AUDITS:
        raise ValidationError("mechanism", f"unknown audit {name!r} (known: {', '.join(sorted(AUDITS))})")
    builder = AUDITS[name]
    kwargs = {**(POWER_SETTINGS[name] if power else {}), **dict(settings or {})}
    target = {"dp_lsw": output_perturbation_audit, "dp_lsl": output_perturbation_audit,
              "stable_prefix_logged": stable_prefix_audit}.get(name, builder)
    # Fixed by the name, or objects a command line cannot give.
    valid = set(inspect.signature(target).parameters) - {"method", "source", "neighbours"}
    unknown = sorted(set(kwargs) - valid)
    if unknown:
        raise ValidationError(unknown[0], f"not a setting of the {name} audit (valid: {', '.join(sorted(valid))})")
    return builder(**kwargs)
