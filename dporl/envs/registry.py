"""Environment ids are names, never code: the one place dporl turns an id into a Gymnasium environment.

Gymnasium reads ``"module:Env-v0"`` as "import ``module``, then look up ``Env-v0``", so an id that arrives in a file
(a policy's ``policy.json``, a dataset's metadata, an expert set, a Minari dataset, a checkpoint's config) could
make ``gym.make`` import and run any module on the path, e.g. a ``policy_env.py`` shipped beside a shared policy.
dporl never imports code named by an id: every id is checked here, before ``gym.make`` / ``gym.make_vec`` /
``gym.spec``, to be a string with no module part that names an environment already in Gymnasium's registry
(Gymnasium's own, dporl's, registered when ``dporl.envs`` is imported, and those of packages the user imported).

``check_env_id(field, env_id)`` refuses anything else with a ``ValidationError`` naming the field; ``make`` and
``make_vec`` check and then build; ``is_registered`` answers whether an id (checked for a module part) names a
simulator.
"""

from __future__ import annotations

from typing import Any

from dporl.utils.validation import ValidationError


def check_no_module(field: str, env_id: Any) -> str:
    """``env_id`` as a string without a module part (``"module:Env-v0"`` is refused: Gymnasium would import it)."""
    if not isinstance(env_id, str) or not env_id:
        raise ValidationError(field, f"expected an environment id (a non-empty string), got {env_id!r}")
    if ":" in env_id:
        module, _, name = env_id.partition(":")
        raise ValidationError(
            field, f"{env_id!r} names a module to import ({module!r}) before the environment: dporl never imports "
            f"code named by an id; give the registered id alone (e.g. {name!r}) and import the package that registers "
            "it yourself")
    return env_id


def is_registered(field: str, env_id: Any) -> bool:
    """Whether ``env_id`` (refused if it has a module part) is in Gymnasium's registry."""
    from gymnasium.envs.registration import registry

    import dporl.envs  # noqa: F401  (registers dporl/* environments)

    return check_no_module(field, env_id) in registry


def check_env_id(field: str, env_id: Any) -> str:
    """``env_id``, if it names a registered Gymnasium environment and has no module part; else a ValidationError."""
    if not is_registered(field, env_id):
        raise ValidationError(field, f"{env_id!r} is not a registered Gymnasium environment (register it, or import "
                              "the package that does, before running dporl)")
    return env_id


def make(field: str, env_id: Any, **kwargs: Any):
    """``gym.make(env_id, **kwargs)`` after ``check_env_id``; a missing optional dependency is a ValidationError."""
    import gymnasium as gym

    check_env_id(field, env_id)
    try:
        return gym.make(env_id, **kwargs)
    except (gym.error.Error, ImportError) as exc:  # a missing extra (box2d), a bad make argument
        raise ValidationError(field, f"cannot make {env_id!r}: {type(exc).__name__}: {exc}") from None


def make_vec(field: str, env_id: Any, **kwargs: Any):
    """``gym.make_vec(env_id, **kwargs)`` after ``check_env_id``; a missing optional dependency is a
    ValidationError."""
    import gymnasium as gym

    check_env_id(field, env_id)
    try:
        return gym.make_vec(env_id, **kwargs)
    except (gym.error.Error, ImportError) as exc:
        raise ValidationError(field, f"cannot make {env_id!r}: {type(exc).__name__}: {exc}") from None
