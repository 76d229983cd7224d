"""Gymnasium environments the papers use that Gymnasium does not ship, physics variants, and feature maps.

Importing this package registers ``dporl/HIVTreatment-v0`` (with a vector entry point: ``gym.make_vec(...,
vectorization_mode="vector_entry_point")`` gives ``HIVVectorEnv``), ``dporl/Chain-v0`` and ``dporl/Line1D-v0``.
Registration is idempotent, so importing twice (or reloading) is safe.
"""

from __future__ import annotations

from gymnasium.envs.registration import register, registry

_ENVIRONMENTS = {
    "dporl/HIVTreatment-v0": dict(
        entry_point="dporl.envs.hiv:HIVTreatmentEnv", vector_entry_point="dporl.envs.hiv:HIVVectorEnv"
    ),
    "dporl/Chain-v0": dict(entry_point="dporl.envs.chain:ChainEnv"),
    "dporl/Line1D-v0": dict(entry_point="dporl.envs.line:LineEnv"),
}

for _env_id, _kwargs in _ENVIRONMENTS.items():
    if _env_id not in registry:
        register(id=_env_id, **_kwargs)

ENV_IDS = tuple(_ENVIRONMENTS)
