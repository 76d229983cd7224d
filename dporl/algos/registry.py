"""The one registry of the algorithms that learn a policy from logged data (d3rlpy's ``register_learnable``, Opacus'
accountant registry): everything that lists algorithms reads it.

    @register_algorithm
    @dataclass
    class BCConfig(AlgorithmConfig):
        name: str = "bc"
        ...
        algorithm: ClassVar[type] = DiscreteBCModule  # a PrivateAlgorithm (dporl.algos.base): the torch module
        api_name: ClassVar[str] = "DiscreteBCConfig"  # dporl.DiscreteBCConfig(...).create(data) -> a dporl.DiscreteBC
        summary: ClassVar[str] = "behaviour cloning: cross-entropy on the logged actions"

A registered config is the ``algorithm:`` section of a ``train`` pipeline config (``algorithm: {name: bc, ...}``,
or ``algorithm: bc`` for the defaults) and builds its algorithm for a dataset's shapes and privacy unit
(``config.build(obs_dim, n_actions, unit)``). The registry feeds the ``train`` pipeline (which algorithm a config
names), the ``dporl`` command (``dporl list``), the Python API (``dporl.<api_name>``, the object its ``create`` returns,
``dporl.<learner_name>``: the API name without "Config", as d3rlpy names them, ``dporl.<config class>``,
``dporl.<algorithm class>``: the torch module), the config audit and the policy kinds ``dporl.train.export`` loads.

Registration checks the algorithm against the contract (``dporl.algos.base.check_contract``): a class missing a
declaration is refused there, by name. Algorithms register when their module is imported; ``discover()`` imports
every module of ``dporl.algos`` once (on the first lookup), so no list of algorithms is kept by hand and
``import dporl`` imports none of them.
"""

from __future__ import annotations

import dataclasses
import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any, ClassVar, Mapping, Optional

from dporl.algos.base import ContractError, Declaration, PrivateAlgorithm, check_contract
from dporl.privacy.units import PrivacyUnit
from dporl.utils.config import from_dict
from dporl.utils.validation import ValidationError


@dataclass
class AlgorithmConfig:
    """Base of a registered algorithm's hyper-parameters (a dataclass; ``name`` is the registered name).

    Class-level declarations (read by the registry): ``algorithm`` (the ``PrivateAlgorithm`` class it builds, whose
    constructor takes ``(obs_dim, n_actions, config, privacy_unit)``), ``api_name`` (the Python API's config class),
    ``summary`` (one line for ``dporl list``) and ``api_defaults`` (defaults of the Python API's config where they
    differ from this class's, e.g. smaller networks for a table)."""

    name: str = ""

    algorithm: ClassVar[type]
    api_name: ClassVar[str]
    summary: ClassVar[str]
    api_defaults: ClassVar[Mapping[str, Any]] = {}

    def build(self, obs_dim: int, n_actions: int, privacy_unit: PrivacyUnit, field: str = "algorithm"
              ) -> PrivateAlgorithm:
        """The algorithm for observations of size ``obs_dim``, ``n_actions`` declared actions and the data's unit
        (a refusal of its sizes names ``field``, the config section)."""
        try:
            return type(self).algorithm(obs_dim, n_actions, self, privacy_unit=privacy_unit)
        except ValidationError as exc:
            raise rerooted(exc, self.name, field) from None

    def discount(self) -> Optional[float]:
        """The discount the algorithm optimises (a policy's value is evaluated with it), or None if it has none."""
        return None


@dataclass(frozen=True)
class AlgorithmEntry:
    """One registered algorithm (``register_algorithm``)."""

    name: str
    config_cls: type
    algorithm_cls: type
    declaration: Declaration
    api_name: str
    summary: str

    @property
    def policy_kind(self) -> str:
        return str(self.declaration.policy_kind)

    @property
    def learner_name(self) -> str:
        """The Python API class its API config creates: ``DiscreteCQL`` for ``DiscreteCQLConfig``."""
        return self.api_name.removesuffix("Config")

    def describe(self) -> str:
        d = self.declaration
        return (f"{self.name}: {self.summary} ({self.algorithm_cls.__name__}; loss {d.loss_form.name.lower()}; reads "
                f"{', '.join(d.batch_keys)}; releases policy kind {d.policy_kind!r}; Python API dporl.{self.api_name}, "
                f"creating a dporl.{self.learner_name})")


_REGISTRY: dict[str, AlgorithmEntry] = {}
_DISCOVERED = False


def register_algorithm(config_cls: type) -> type:
    """Register ``config_cls`` (an ``AlgorithmConfig`` dataclass; module docstring): its name, its algorithm class
    (checked against the contract), its API name and summary. Returns the class (a decorator)."""
    where = getattr(config_cls, "__name__", repr(config_cls))
    if not (isinstance(config_cls, type) and issubclass(config_cls, AlgorithmConfig)
            and dataclasses.is_dataclass(config_cls)):
        raise ContractError(where, "a registered algorithm config is a dataclass subclassing "
                            "dporl.algos.registry.AlgorithmConfig")
    defaults = {f.name: f.default for f in dataclasses.fields(config_cls)}
    name = defaults.get("name")
    if not isinstance(name, str) or not name.isidentifier() or name != name.lower():
        raise ContractError(f"{where}.name", f"declare the registered name as the default of field 'name' (a "
                            f"lower-case identifier), got {name!r}")
    for declared in ("algorithm", "api_name", "summary"):
        if declared not in {k for c in config_cls.__mro__ if c is not AlgorithmConfig for k in vars(c)}:
            raise ContractError(f"{where}.{declared}", "not declared (module docstring of dporl.algos.registry)")
    algorithm_cls = config_cls.algorithm
    declaration = check_contract(algorithm_cls)
    if declaration.policy_kind is None:
        raise ContractError(f"{algorithm_cls.__name__}.policy_kind", "a registered algorithm releases a policy: "
                            "declare its kind")
    api_name = config_cls.api_name
    if not isinstance(api_name, str) or not api_name.isidentifier() or not api_name.endswith("Config") \
            or api_name == "Config":
        raise ContractError(f"{where}.api_name", f"must be a Python identifier ending in 'Config' (its create() "
                            f"returns the class named without it), got {api_name!r}")
    learner_name = api_name.removesuffix("Config")
    if learner_name in (where, algorithm_cls.__name__):
        raise ContractError(f"{where}.api_name", f"{learner_name!r} (what {api_name}.create() returns) is the name of "
                            f"the {'config' if learner_name == where else 'algorithm'} class too: rename that class")
    unknown = sorted(set(config_cls.api_defaults) - set(defaults) - {"name"})
    if unknown:
        raise ContractError(f"{where}.api_defaults", f"{unknown} are not fields of {where}")
    entry = AlgorithmEntry(name, config_cls, algorithm_cls, declaration, api_name, str(config_cls.summary))
    existing = _REGISTRY.get(name)
    if existing is not None and existing.config_cls.__qualname__ != config_cls.__qualname__:
        raise ContractError(f"{where}.name", f"{name!r} is registered already (by {existing.config_cls.__name__})")
    taken = {exported: e.name for e in _REGISTRY.values() if e.name != name
             for exported in (e.api_name, e.learner_name)}
    if api_name in taken or learner_name in taken:
        raise ContractError(f"{where}.api_name", f"{api_name!r} is the API name of {taken[api_name]!r} already")
    _REGISTRY[name] = entry
    return config_cls


def discover() -> None:
    """Import every module of ``dporl.algos`` once (each registers its algorithms)."""
    global _DISCOVERED
    if _DISCOVERED:
        return
    import dporl.algos as package

    for module in pkgutil.iter_modules(package.__path__):
        importlib.import_module(f"{package.__name__}.{module.name}")
    _DISCOVERED = True


def entries() -> list[AlgorithmEntry]:
    """Every registered algorithm, by name."""
    discover()
    return [_REGISTRY[name] for name in sorted(_REGISTRY)]


def names() -> list[str]:
    return [entry.name for entry in entries()]


def get(name: Any, field: str = "algorithm") -> AlgorithmEntry:
    """The registered algorithm ``name``, or a ValidationError naming ``field`` and listing the known ones."""
    discover()
    if not isinstance(name, str) or name not in _REGISTRY:
        raise ValidationError(field, f"unknown algorithm {name!r} (known: {', '.join(sorted(_REGISTRY))})")
    return _REGISTRY[name]


def algorithm_config(value: Any, field: str = "algorithm") -> AlgorithmConfig:
    """A registered algorithm's config from a config file's ``algorithm`` value: a name (``bc``: the defaults), a
    mapping with ``name`` and the hyper-parameters, or a config object already built."""
    if isinstance(value, AlgorithmConfig):
        if get(value.name, f"{field}.name").config_cls is not type(value):
            raise ValidationError(f"{field}.name", f"{type(value).__name__} is not the config of {value.name!r}")
        return value
    if isinstance(value, str):
        entry, value = get(value, field), {}
    elif not isinstance(value, Mapping):
        raise ValidationError(field, f"expected an algorithm name or a mapping with 'name', got {value!r}")
    elif "name" not in value:
        raise ValidationError(f"{field}.name", f"missing: which algorithm (known: {', '.join(names())})")
    else:
        entry = get(value["name"], f"{field}.name")
    try:
        return from_dict(entry.config_cls, value, field)
    except ValidationError as exc:
        raise rerooted(exc, entry.name, field) from None


def rerooted(exc: ValidationError, name: str, field: str) -> ValidationError:
    """``exc`` naming its field as a config file writes it: an algorithm's own checks name "<name>.x" (e.g.
    "cql.gamma"); in a config that is "<field>.x" ("algorithm.gamma")."""
    if exc.field.startswith(f"{name}."):
        return type(exc)(field + exc.field[len(name):], str(exc).split(": ", 1)[-1])
    return exc


def policy_kinds() -> dict[str, AlgorithmEntry]:
    """Policy kind -> the algorithm that releases it (``dporl.train.export`` loads these)."""
    return {entry.policy_kind: entry for entry in entries()}


def exported_names() -> dict[str, tuple[str, str]]:
    """Python API names the registry provides: name -> (kind, algorithm) with kind "api" (``dporl.<api_name>``, in
    ``dporl.api``), "learner" (what the API config creates, in ``dporl.api``), "config" (the config class) or
    "algorithm" (the algorithm class: the torch module)."""
    out: dict[str, tuple[str, str]] = {}
    for entry in entries():
        out[entry.api_name] = ("api", entry.name)
        out[entry.learner_name] = ("learner", entry.name)
        out[entry.config_cls.__name__] = ("config", entry.name)
        out[entry.algorithm_cls.__name__] = ("algorithm", entry.name)
    return out
