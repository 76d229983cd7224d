"""The contract between an algorithm and the rest of dporl: what the Trainer, the pipelines and the export read.

An algorithm is a ``PrivateAlgorithm``: a torch module that computes losses (or closed-form update directions) per
row or per unit and never adds noise itself (the privacy layer does, so every guarantee is computed in one place,
as Opacus keeps noise in its optimizer and out of the model). A subclass DECLARES, as class attributes:

- ``loss_form`` (a ``LossForm``): how the Trainer obtains the gradient of a step, and so which one method it calls:

  ``ROW_LOSSES``            ``row_losses(batch) -> Tensor[n_rows]``; autograd; the DP-SGD engine averages each
                            unit's rows and clips per unit (CQL, behaviour cloning, fitted Q evaluation);
  ``WEIGHTED_ROW_LOSSES``   ``weighted_row_losses(batch) -> (Tensor[n_rows], Tensor[n_rows])``: row losses and
                            weights |w| <= 1 that scale each unit's gradient after clipping (the clipped-TD
                            semi-gradients of reward-level Q-learning);
  ``UNIT_DIRECTIONS``       ``unit_directions(batch) -> Tensor[n_units, D]``: closed-form update directions per
                            unit (GPOPE), clipped and noised as vectors;

- ``batch_keys``: the batch columns it reads (a source built for it carries these and nothing else);
- ``policy_kind``: the name of the policy it releases (``dporl.train.export``: a network whose argmax over its outputs
  is the action; ``policy_network()`` returns it), or None for an algorithm that releases no policy (an evaluator);

and its ``privacy_unit`` (what one unit of the neighbouring relation is): given to ``__init__`` (an algorithm built
for a dataset takes the data's unit) or declared as a class attribute (a unit fixed by the algorithm, as GPOPE's
trajectory). ``on_step_end(step)`` (target networks, iterate averaging) defaults to nothing.

``check_contract(cls)`` checks the declarations (a named ``ContractError`` for the first one missing); the registry
(``dporl.algos.registry.register_algorithm``) and the Trainer call it, so an algorithm missing a declaration is
refused where it is registered or handed to the loop, never half-way through a private run.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, ClassVar, Optional

import torch
from torch import nn

from dporl.privacy.units import PrivacyUnit, as_unit
from dporl.utils.validation import ValidationError


class LossForm(str, enum.Enum):
    """How an algorithm's step gradient is formed (module docstring); the value is the method the Trainer calls."""

    ROW_LOSSES = "row_losses"
    WEIGHTED_ROW_LOSSES = "weighted_row_losses"
    UNIT_DIRECTIONS = "unit_directions"

    def __str__(self) -> str:
        return self.value


class ContractError(ValidationError):
    """An algorithm that does not declare what the contract asks for (the field names the declaration)."""


class PrivateAlgorithm(nn.Module):
    """Base of every algorithm the Trainer runs (module docstring for the declarations)."""

    loss_form: ClassVar[LossForm]
    batch_keys: ClassVar[tuple[str, ...]]
    policy_kind: ClassVar[Optional[str]]
    privacy_unit: Optional[PrivacyUnit] = None

    def __init__(self, privacy_unit: PrivacyUnit | str | None = None):
        super().__init__()
        if privacy_unit is not None:
            self.privacy_unit = as_unit(privacy_unit)
        elif isinstance(type(self).privacy_unit, str):  # a class declaring its unit by name
            self.privacy_unit = as_unit(type(self).privacy_unit)

    # ---- the step (one of these, as ``loss_form`` declares)
    def row_losses(self, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def weighted_row_losses(self, batch: Any) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError

    def unit_directions(self, batch: Any) -> torch.Tensor:
        raise NotImplementedError

    def on_step_end(self, step: int) -> None:
        """Called by the Trainer after optimizer step ``step`` (1-based): post-processing of the iterates."""

    # ---- the released policy (``policy_kind`` not None)
    def policy_network(self) -> nn.Module:
        """The network whose argmax over its outputs is the action (what ``dporl.train.export`` releases)."""
        raise NotImplementedError

    @torch.no_grad()
    def act(self, obs: torch.Tensor) -> torch.Tensor:
        """Greedy actions [B] for observations [B, obs_dim]."""
        network = self.policy_network()
        return network(obs.to(next(network.parameters()).device)).argmax(dim=-1)


_STEP_METHODS = {form: form.value for form in LossForm}


@dataclass(frozen=True)
class Declaration:
    """What an algorithm class declares (``check_contract`` returns it)."""

    loss_form: LossForm
    batch_keys: tuple[str, ...]
    policy_kind: Optional[str]


# Modules the Trainer runs that do not subclass PrivateAlgorithm, declared here by their qualified class name (no
# import): fitted Q evaluation, which trains through the Trainer inside the private offline evaluation.
DECLARED_BY_NAME: dict[str, Declaration] = {
    "dporl.algos.fqe.DiscreteFQE": Declaration(
        LossForm.ROW_LOSSES, ("obs", "actions", "rewards", "next_obs", "terminated", "next_pi"), None),
}


@lru_cache(maxsize=None)
def check_contract(cls: type) -> Declaration:
    """What ``cls`` declares, if it is a ``PrivateAlgorithm`` declaring everything the contract asks for (or a class
    of ``DECLARED_BY_NAME``), else a ``ContractError`` naming the first missing declaration
    (``<Class>.<declaration>``)."""
    name = getattr(cls, "__name__", repr(cls))
    qualified = f"{getattr(cls, '__module__', '')}.{getattr(cls, '__qualname__', name)}"
    if qualified in DECLARED_BY_NAME and isinstance(cls, type) and issubclass(cls, nn.Module):
        return DECLARED_BY_NAME[qualified]
    if not (isinstance(cls, type) and issubclass(cls, PrivateAlgorithm)):
        raise ContractError("algorithm", f"{name} is not a dporl.algos.base.PrivateAlgorithm: an algorithm declares "
                            "its loss form, batch keys, policy kind and privacy unit by subclassing it")
    form = getattr(cls, "loss_form", None)
    if not isinstance(form, LossForm):
        raise ContractError(f"{name}.loss_form", f"not declared: set it to one of "
                            f"{', '.join('LossForm.' + f.name for f in LossForm)}, got {form!r}")
    keys = getattr(cls, "batch_keys", None)
    if not isinstance(keys, tuple) or not keys or not all(isinstance(k, str) and k for k in keys):
        raise ContractError(f"{name}.batch_keys", f"not declared: a non-empty tuple of the batch columns it reads, "
                            f"got {keys!r}")
    try:
        kind = cls.policy_kind
    except AttributeError:
        raise ContractError(f"{name}.policy_kind", "not declared: the name of the policy it releases, or None for an "
                            "algorithm that releases none") from None
    if kind is not None and (not isinstance(kind, str) or not kind):
        raise ContractError(f"{name}.policy_kind", f"must be a non-empty name or None, got {kind!r}")
    method = _STEP_METHODS[form]
    if getattr(cls, method) is getattr(PrivateAlgorithm, method):
        raise ContractError(f"{name}.{method}", f"declares loss_form {form.name} but does not define {method}(batch)")
    if kind is not None and cls.policy_network is PrivateAlgorithm.policy_network:
        raise ContractError(f"{name}.policy_network", f"declares policy kind {kind!r} but does not define "
                            "policy_network()")
    return Declaration(form, keys, kind)


def declaration_of(algorithm: Any) -> Declaration:
    """What ``algorithm``'s class declares (``check_contract``); a ``ContractError`` if it declares too little."""
    return check_contract(type(algorithm))
