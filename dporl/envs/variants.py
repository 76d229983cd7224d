"""Physics-varied environments: the expert-level paper trains experts on varied settings, logs in the default one.

``make_variant(env_id, params)`` builds a Gymnasium env with physics from a dict. Classic-control physics are
attributes of ``env.unwrapped`` (set after ``gym.make``; CartPole's derived ``total_mass`` and ``polemass_length``
are recomputed), LunarLander's are ``gym.make`` arguments, the HIV simulator's are its reward weights and efficacy
noise. ``make_vector_variant`` gives a vector env, one setting per sub-environment if asked: CartPole, Acrobot and HIV use
numpy-batched vector envs (every physics attribute may be an array over sub-environments; CartPole's and Acrobot's
from ``dporl.envs.classic_vector``, whose sub-envs each own a random stream), others (LunarLander) a
``SyncVectorEnv``. ``PHYSICS_GRIDS`` holds the paper's grids (appendix B.1), ``physics_grid`` enumerates them.

Acrobot note: Gymnasium keeps the centres of mass (LINK_COM_POS_*) and moments of inertia fixed when lengths
change, and LINK_LENGTH_2 does not enter its dynamics; we vary exactly the attributes the paper names.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import gymnasium as gym
import numpy as np

from dporl.envs.classic_vector import AcrobotVectorEnv, CartPoleVectorEnv
from dporl.envs.registry import make, make_vec
from dporl.utils.validation import ValidationError

HIV_ID = "dporl/HIVTreatment-v0"


def _recompute_cartpole(env: Any) -> None:
    env.total_mass = env.masspole + env.masscart
    env.polemass_length = env.masspole * env.length


@dataclass(frozen=True)
class VariantSpec:
    """How one environment takes its physics parameters."""

    attributes: tuple[str, ...] = ()  # set on env.unwrapped after construction
    make_arguments: tuple[str, ...] = ()  # passed to the constructor
    recompute: Callable[[Any], None] | None = None  # refresh derived quantities after attributes change
    vector_entry_point: bool = False  # the env id's registered vector entry point: numpy-batched, per-sub-env arrays
    vector_class: Callable[..., gym.vector.VectorEnv] | None = None  # a numpy-batched VectorEnv built directly
    # name -> (low, high, closed): allowed values lie in [low, high] if closed else (low, high); None = unbounded
    bounds: dict[str, tuple[float | None, float | None, bool]] = field(default_factory=dict)

    @property
    def names(self) -> tuple[str, ...]:
        return self.attributes + self.make_arguments


VARIANT_SPECS: dict[str, VariantSpec] = {
    "CartPole-v1": VariantSpec(
        attributes=("gravity", "force_mag", "masscart", "masspole", "length"),
        recompute=_recompute_cartpole,
        vector_class=CartPoleVectorEnv,
        bounds={"masscart": (0.0, None, False), "masspole": (0.0, None, False), "length": (0.0, None, False)},
    ),
    "Acrobot-v1": VariantSpec(
        attributes=("LINK_LENGTH_1", "LINK_LENGTH_2", "LINK_MASS_1", "LINK_MASS_2"),
        vector_class=AcrobotVectorEnv,
        bounds={name: (0.0, None, False) for name in ("LINK_LENGTH_1", "LINK_LENGTH_2", "LINK_MASS_1", "LINK_MASS_2")},
    ),
    "LunarLander-v3": VariantSpec(
        make_arguments=("gravity", "enable_wind", "wind_power", "turbulence_power"),
        # Gymnasium asserts -12 < gravity < 0; negative wind or turbulence has no physical meaning.
        bounds={"gravity": (-12.0, 0.0, False), "wind_power": (0.0, None, True), "turbulence_power": (0.0, None, True)},
    ),
    HIV_ID: VariantSpec(make_arguments=("R1", "R2", "efficacy_noise"), vector_entry_point=True),
}


def _spec(env_id: str) -> VariantSpec:
    if env_id not in VARIANT_SPECS:
        raise ValidationError("env_id", f"no physics variants for {env_id!r}; known: {sorted(VARIANT_SPECS)}")
    return VARIANT_SPECS[env_id]


def _check_value(name: str, value: Any, per_env: int | None = None) -> Any:
    """A finite number (bool for enable_wind), or with ``per_env`` also one value per sub-environment."""
    if name == "enable_wind":
        if not isinstance(value, (bool, np.bool_)):
            raise ValidationError(f"params.{name}", f"expected a bool, got {value!r}")
        return bool(value)
    array = np.asarray(value)
    if array.ndim == 1 and per_env is not None and array.shape[0] == per_env:
        pass
    elif array.ndim != 0:
        expected = "a number" if per_env is None else f"a number or {per_env} values"
        raise ValidationError(f"params.{name}", f"expected {expected}, got shape {array.shape}")
    if array.dtype.kind not in "iuf" or not np.all(np.isfinite(array)):
        raise ValidationError(f"params.{name}", f"expected finite numbers, got {value!r}")
    return float(array) if array.ndim == 0 else array.astype(float)


def _check_params(env_id: str, params: Mapping[str, Any], make_kwargs: Mapping[str, Any], per_env: int | None = None):
    spec = _spec(env_id)
    if not isinstance(params, Mapping):
        raise ValidationError("params", f"expected a dict of physics parameters, got {type(params).__name__}")
    for name in params:
        if name not in spec.names:
            raise ValidationError(f"params.{name}", f"unknown parameter for {env_id}; known: {list(spec.names)}")
        if name in make_kwargs:
            raise ValidationError(f"params.{name}", "given both as a physics parameter and as a make argument")
    checked = {name: _check_value(name, value, per_env) for name, value in params.items()}
    for name, (low, high, closed) in spec.bounds.items():
        if name in checked:
            value = np.asarray(checked[name])
            below = low is not None and np.any(value < low if closed else value <= low)
            above = high is not None and np.any(value > high if closed else value >= high)
            if below or above:
                interval = f"{'[' if closed else '('}{low}, {high}{']' if closed else ')'}"
                raise ValidationError(f"params.{name}", f"must lie in {interval} for {env_id}, got {params[name]!r}")
    wind = [name for name in ("wind_power", "turbulence_power") if name in checked]
    if wind and not checked.get("enable_wind", make_kwargs.get("enable_wind", False)):
        # LunarLander silently ignores wind settings unless wind is enabled.
        raise ValidationError(f"params.{wind[0]}", "has no effect unless enable_wind=True")
    return spec, checked


def _set_attributes(env: Any, spec: VariantSpec, values: Mapping[str, Any]) -> None:
    attributes = {k: v for k, v in values.items() if k in spec.attributes}
    for name, value in attributes.items():
        setattr(env, name, value)
    if attributes and spec.recompute is not None:
        spec.recompute(env)


def make_variant(env_id: str, params: Mapping[str, Any], **make_kwargs: Any) -> gym.Env:
    """``gym.make(env_id, **make_kwargs)`` with the physics in ``params`` (unknown names are a ValidationError)."""
    spec, values = _check_params(env_id, params, make_kwargs)
    arguments = {k: v for k, v in values.items() if k in spec.make_arguments}
    env = make("env_id", env_id, **arguments, **make_kwargs)
    _set_attributes(env.unwrapped, spec, values)
    return env


def make_vector_variant(env_id: str, params: Mapping[str, Any], num_envs: int, **make_kwargs: Any) -> gym.vector.VectorEnv:
    """A vector env of ``num_envs`` copies; each parameter is one value or ``num_envs`` values (one per copy)."""
    if int(num_envs) != num_envs or num_envs < 1:
        raise ValidationError("num_envs", f"must be a positive integer, got {num_envs!r}")
    spec, values = _check_params(env_id, params, make_kwargs, per_env=int(num_envs))
    if spec.vector_class is not None:
        arguments = {k: v for k, v in values.items() if k in spec.make_arguments}
        env = spec.vector_class(num_envs=int(num_envs), **arguments, **make_kwargs)
        _set_attributes(env, spec, values)
        return env
    if spec.vector_entry_point:
        arguments = {k: v for k, v in values.items() if k in spec.make_arguments}
        env = make_vec("env_id", env_id, num_envs=num_envs, vectorization_mode="vector_entry_point", **arguments,
                       **make_kwargs)
        _set_attributes(env.unwrapped, spec, values)
        return env
    per_env = [{k: (v[i] if isinstance(v, np.ndarray) else v) for k, v in values.items()} for i in range(num_envs)]
    return gym.vector.SyncVectorEnv([lambda p=p: make_variant(env_id, p, **make_kwargs) for p in per_env])


def effective_physics(env_id: str, params: Mapping[str, Any]) -> dict[str, Any]:
    """``params`` without the settings that have no effect (LunarLander's wind and turbulence while wind is off),
    so a full record such as ``physics_of``'s (``DatasetMetadata.env_params``) can rebuild its environment."""
    params = dict(params)
    if env_id in VARIANT_SPECS and "enable_wind" in params and not params["enable_wind"]:
        params.pop("wind_power", None)
        params.pop("turbulence_power", None)
    return params


def physics_of(env: gym.Env | gym.vector.VectorEnv, env_id: str) -> dict[str, Any]:
    """The physics parameters an env runs with now (JSON-safe; for ``DatasetMetadata.env_params``)."""
    spec = _spec(env_id)
    if isinstance(env, gym.vector.SyncVectorEnv):  # one setting per sub-environment: a list per parameter
        per_env = [physics_of(sub, env_id) for sub in env.envs]
        return {name: [setting[name] for setting in per_env] for name in spec.names}
    base = env.unwrapped
    source = base.simulator if env_id == HIV_ID else base
    out = {}
    for name in spec.names:
        value = getattr(source, name)
        out[name] = value.tolist() if isinstance(value, np.ndarray) else (bool(value) if name == "enable_wind" else float(value))
    return out


@dataclass(frozen=True)
class PhysicsAxis:
    """One varied quantity: ``points`` equally spaced values in [low, high], written to every name in ``targets``."""

    name: str
    low: float
    high: float
    points: int
    targets: tuple[str, ...]

    def values(self, points: int | None = None) -> np.ndarray:
        return np.linspace(self.low, self.high, self.points if points is None else min(points, self.points))


@dataclass(frozen=True)
class PhysicsGrid:
    env_id: str
    axes: tuple[PhysicsAxis, ...]
    fixed: dict[str, Any] = field(default_factory=dict)  # set in every setting (LunarLander: wind switched on)

    def settings(self, points_per_axis: int | None = None) -> list[dict[str, Any]]:
        if points_per_axis is not None and (int(points_per_axis) != points_per_axis or points_per_axis < 1):
            raise ValidationError("points_per_axis", f"must be a positive integer, got {points_per_axis!r}")
        columns = [axis.values(points_per_axis) for axis in self.axes]
        grid = []
        for combination in itertools.product(*columns):
            setting = dict(self.fixed)
            for axis, value in zip(self.axes, combination):
                setting.update({target: float(value) for target in axis.targets})
            grid.append(setting)
        return grid

    @property
    def size(self) -> int:
        return math.prod(axis.points for axis in self.axes)


# The paper's grids (expert-level paper, appendix B.1): 10 values per axis (1000 settings) for the classic
# control envs; HIV 50 x 20 x {no noise, N(0, 0.01^2)} = 2000 settings.
PHYSICS_GRIDS: dict[str, PhysicsGrid] = {
    "CartPole-v1": PhysicsGrid(
        "CartPole-v1",
        (
            PhysicsAxis("gravity", 8.75, 11.0, 10, ("gravity",)),
            PhysicsAxis("force_mag", 9.0, 11.25, 10, ("force_mag",)),
            PhysicsAxis("masscart", 0.8, 1.25, 10, ("masscart",)),
        ),
    ),
    "Acrobot-v1": PhysicsGrid(
        "Acrobot-v1",
        (
            PhysicsAxis("link_length", 0.8, 1.2, 10, ("LINK_LENGTH_1", "LINK_LENGTH_2")),  # same for both links
            PhysicsAxis("link_mass_1", 0.9, 1.1, 10, ("LINK_MASS_1",)),
            PhysicsAxis("link_mass_2", 0.9, 1.1, 10, ("LINK_MASS_2",)),
        ),
    ),
    "LunarLander-v3": PhysicsGrid(
        "LunarLander-v3",
        (
            PhysicsAxis("gravity", -9.0, -11.0, 10, ("gravity",)),  # Gymnasium's gravity is negative
            PhysicsAxis("wind_power", 0.0, 5.0, 10, ("wind_power",)),
            PhysicsAxis("turbulence_power", 0.0, 0.5, 10, ("turbulence_power",)),
        ),
        fixed={"enable_wind": True},
    ),
    HIV_ID: PhysicsGrid(
        HIV_ID,
        (
            PhysicsAxis("R1", 18750.0, 21250.0, 50, ("R1",)),
            PhysicsAxis("R2", 1850.0, 2150.0, 20, ("R2",)),
            PhysicsAxis("efficacy_noise", 0.0, 0.01, 2, ("efficacy_noise",)),
        ),
    ),
}


def physics_grid(env_id: str, points_per_axis: int | None = None) -> list[dict[str, Any]]:
    """Every setting of the paper's grid for ``env_id`` (``points_per_axis`` caps each axis for quick runs;
    the end points are always included)."""
    if env_id not in PHYSICS_GRIDS:
        raise ValidationError("env_id", f"no physics grid for {env_id!r}; known: {sorted(PHYSICS_GRIDS)}")
    return PHYSICS_GRIDS[env_id].settings(points_per_axis)
