"""Empirical privacy auditing: distinguishing experiments on neighbouring inputs, certified lower bounds on eps.

``run_audit(experiment, trials)`` runs a mechanism many times on D and D' and returns an ``AuditResult`` whose
``epsilon_lower_bound`` holds with the stated confidence; a bound above the claimed epsilon refutes the claim.
Built-in experiments for every mechanism dporl ships are listed in ``dporl.audit.registry.AUDITS``;
``python -m dporl.audit`` runs them, or the audit of a user's configuration.
"""

from dporl.audit.bounds import EpsilonLowerBound, clopper_pearson_lower, clopper_pearson_upper, epsilon_lower_bound
from dporl.audit.experiment import AuditResult, Experiment, run_audit

__all__ = [
    "AuditResult",
    "EpsilonLowerBound",
    "Experiment",
    "clopper_pearson_lower",
    "clopper_pearson_upper",
    "epsilon_lower_bound",
    "run_audit",
]
