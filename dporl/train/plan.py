"""What a training run is set up with before its first step: its optimizer and learning-rate schedule, and its
privacy plan (noise multiplier, per-step event, steps allowed) for ``dporl.train.trainer.Trainer`` and the pipelines
that plan a stage before anything is written."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Optional, Sequence

import torch
from torch import nn

from dporl.privacy.calibration import calibrate_noise_multiplier, max_steps
from dporl.privacy.events import PrivacyEvent
from dporl.privacy.ledger import PrivacyLedger
from dporl.train.config import DPConfig, OptimizerConfig
from dporl.utils.validation import PrivacyBudgetError, ValidationError

_OPTIMIZERS = {"adam": torch.optim.Adam, "rmsprop": torch.optim.RMSprop, "sgd": torch.optim.SGD}


def build_optimizer(params: Sequence[nn.Parameter], config: OptimizerConfig) -> torch.optim.Optimizer:
    """The configured optimizer with torch's fused kernel where it has one (Adam, SGD), else its foreach kernels.

    One kernel over all parameters instead of a Python loop per parameter: a 2 x 256 CQL step takes 0.88x the time
    with fused Adam. Private and non-private runs use the same construction, so their costs compare honestly.
    """
    params = list(params)
    kind = _OPTIMIZERS[config.name]
    kwargs: dict[str, Any] = {"lr": config.lr, "weight_decay": config.weight_decay}
    if config.name != "adam":
        kwargs["momentum"] = config.momentum
    if "fused" in inspect.signature(kind).parameters:
        try:
            return kind(params, fused=True, **kwargs)
        except RuntimeError:  # no fused kernel for these parameters' device or dtype
            pass
    return kind(params, foreach=True, **kwargs)


def lr_factor(config: OptimizerConfig) -> Callable[[int], float]:
    if config.schedule == "constant":
        return lambda step: 1.0
    # LambdaLR passes the number of completed steps; step i (1-based) uses lr / (i + offset).
    return lambda step: 1.0 / (step + 1 + config.time_offset)


def plan_privacy(
    dp: Optional[DPConfig],
    cap: Optional[int],
    step_event: Callable[[float], Optional[PrivacyEvent]],
    *,
    ledger: Optional[PrivacyLedger] = None,
    stage: str = "train",
) -> tuple[Optional[float], Optional[PrivacyEvent], int]:
    """(noise multiplier, per-step event, steps allowed) of a training stage whose source states ``step_event``.

    With ``dp.share_run_budget`` the stage ``stage`` of ``ledger`` (the run's, or a scratch ledger holding the
    earlier stages' events as they will be recorded) is planned against the run budget: its steps composed with
    every other stage's events by one PLD fit the run's epsilon at the total delta (``PrivacyLedger.shared_budget``).
    Pure: pipelines call it before their first write, so an impossible budget is refused with nothing written.
    """
    if dp is None or not dp.enabled:
        if cap is None:
            raise ValidationError("trainer.max_steps", "a non-private run needs a step cap")
        return None, None, cap
    epsilon, delta, mechanism, prior = dp.epsilon, dp.delta, dp.accountant, ()
    if dp.share_run_budget:
        if ledger is None:
            raise ValidationError("dp.share_run_budget",
                                  "a stage sharing the run budget is planned in the run's ledger")
        target = ledger.shared_budget(stage, dp.delta)
        epsilon, delta, prior, mechanism = target.epsilon, target.delta, target.prior, target.mechanism
    sigma = dp.noise_multiplier
    if sigma is None:
        if cap is None:
            raise ValidationError(
                "dp.noise_multiplier", "give a noise multiplier, or trainer.max_steps to calibrate one for"
            )
        sigma = calibrate_noise_multiplier(epsilon, delta, cap, make_event=step_event, mechanism=mechanism, prior=prior)
    event = step_event(sigma)
    if event is None:
        raise ValidationError("dp.enabled", "the batch source has no private branch; disable dp for it")
    allowed = max_steps(event, epsilon, delta, mechanism=mechanism, limit=cap, prior=prior)
    if allowed == 0:
        raise PrivacyBudgetError(
            "dp.epsilon", f"not even one step fits epsilon={epsilon} at delta={delta} with sigma={sigma:g}"
            + (" beside the run's other stages" if prior else "")
        )
    return sigma, event, allowed
