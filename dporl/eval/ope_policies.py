"""The target policy of a private evaluation: its action probabilities on logged states, and whether it declares
itself deterministic.

The target is public: a callable obs [B, d] -> action probabilities [B, A], or a dporl policy (a module with
``action_probabilities(obs)`` or a greedy ``act(obs)``, one-hot probabilities). It is only ever called on states a
dataset logged: never on the padding of a padded batch nor on the placeholder after a terminal step
(``logged_action_probabilities``), so a policy that checks its inputs sees real states only.

Whether a result is ``calibrated`` depends on a DECLARED property of the target, whether it is deterministic
(``target_is_deterministic``), never on the probabilities it gives the logged states: read off the logged states,
the flag of a target deterministic in some states only would tell which states were logged.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from dporl.utils.validation import ValidationError

Policy = Callable[[torch.Tensor], torch.Tensor]


def action_probabilities(policy: Any, obs: torch.Tensor, n_actions: int, what: str = "states") -> torch.Tensor:
    """pi(. | s) [B, n_actions] (float64) from a callable or a dporl policy module; validated (``what`` names the
    states in the error)."""
    if obs.shape[0] == 0:
        return torch.zeros(0, n_actions, dtype=torch.float64)
    with torch.no_grad():
        if hasattr(policy, "action_probabilities"):
            probs = policy.action_probabilities(obs)
        elif hasattr(policy, "act") and isinstance(policy, torch.nn.Module):
            probs = torch.nn.functional.one_hot(policy.act(obs).long().cpu(), n_actions)
        elif callable(policy):
            probs = policy(obs)
        else:
            raise ValidationError("policy", f"expected a callable obs -> probabilities or a dporl policy, got {policy!r}")
    probs = torch.as_tensor(probs).detach().cpu().double()
    if probs.shape != (obs.shape[0], n_actions):
        raise ValidationError("policy", f"expected probabilities of shape {(obs.shape[0], n_actions)} on {what}, got "
                              f"{tuple(probs.shape)}")
    if not torch.isfinite(probs).all() or (probs < 0).any() or (probs.sum(1) - 1).abs().max() > 1e-4:
        raise ValidationError("policy", f"the target policy's action probabilities on {what} must be finite, >= 0 "
                              "and sum to 1 in every state")
    return probs


def logged_action_probabilities(policy: Any, obs: torch.Tensor, logged: torch.Tensor, n_actions: int,
                                what: str = "logged states") -> torch.Tensor:
    """pi(. | s) [N, n_actions] where ``logged`` [N] (bool) marks real states; the policy is called on those rows
    only, and the others (padding, terminal placeholders) get uniform probabilities that nothing reads."""
    logged = torch.as_tensor(logged, dtype=torch.bool)
    out = torch.full((obs.shape[0], n_actions), 1.0 / n_actions, dtype=torch.float64)
    rows = torch.nonzero(logged).squeeze(1)
    if len(rows):
        out[rows] = action_probabilities(policy, obs.index_select(0, rows), n_actions, what)
    return out


def target_is_deterministic(policy: Any) -> Optional[bool]:
    """Whether ``policy`` is deterministic, as it declares itself (public): a ``deterministic`` attribute (True /
    False), else True for a dporl module acting greedily (``act`` and no ``action_probabilities``), else None
    (undeclared). Never computed from the states a dataset logged (module docstring)."""
    declared = getattr(policy, "deterministic", None)
    if isinstance(declared, bool):
        return declared
    if declared is not None:
        raise ValidationError("policy.deterministic", f"expected True or False, got {declared!r}")
    if isinstance(policy, torch.nn.Module) and hasattr(policy, "act") and not hasattr(policy, "action_probabilities"):
        return True
    return None


def declare_deterministic(policy: Policy, deterministic: bool) -> Policy:
    """``policy`` (a callable) marked as deterministic or not, for ``target_is_deterministic``; returns it."""
    if not isinstance(deterministic, bool):
        raise ValidationError("deterministic", f"expected True or False, got {deterministic!r}")
    policy.deterministic = deterministic  # type: ignore[attr-defined]
    return policy
