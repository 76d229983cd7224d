"""The short Python path: a d3rlpy-like config creates the algorithm, shapes and the privacy unit come from the data.

    import dporl
    data = dporl.read_table("stays.csv", episode="stay", unit="clinician", observations="obs_",
                            action="action", actions=2, reward="reward", propensity="propensity")
    cql = dporl.DiscreteCQLConfig(epsilon=1.0).create(data)   # obs dim, declared actions, unit: from the data
    result = cql.fit(run_dir="runs/stays")                      # private CQL + private evaluation, one ledger
    policy = dporl.load_policy(result.policy_dir)               # policy.act(obs); policy.save(dir)

Every registered algorithm (``dporl.algos.registry``) has an API config named by its registration
(``dporl.DiscreteCQLConfig``, ``dporl.DiscreteBCConfig``, ...): the private-training settings of ``FitSettings``
followed by the algorithm's own hyper-parameters (its config class's fields, with the registration's
``api_defaults``). ``create(dataset)`` builds the algorithm for the dataset, as d3rlpy's configs do: an instance of
the API class named without "Config" (``dporl.DiscreteCQL``, ``dporl.DiscreteBC``; a ``PrivateLearner``) holding
the registered torch module (``DiscreteCQLModule``, ``DiscreteBCModule``); ``fit`` runs the ``train`` pipeline (the
code path behind ``dporl train --config``) on the dataset in memory, with method ``dp_sgd`` (``non_private`` when
``private=False``): unit-level DP-SGD over the dataset's unit (the column named in ``read_table``), then the policy's
evaluation: in the simulator when the dataset's env id is a registered Gymnasium environment, else privately on
held-out units (``evaluation``, a ``dporl.pipelines.offline_eval.OfflineEvalConfig``), composed in parallel so the
run's guarantee is ``epsilon``, not the sum. The run directory keeps ``release/`` (the policy, the privacy report,
the public summary) apart from ``curator/`` (the imported data, the journal, checkpoints). ``pipeline_config(run_dir)``
gives the equivalent YAML config (``dporl.utils.config.dump_config``).
"""

from __future__ import annotations

import copy
import dataclasses
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import torch

from dporl.algos import registry
from dporl.algos.base import PrivateAlgorithm
from dporl.algos.registry import AlgorithmConfig
from dporl.data.dataset import TrajectoryDataset
from dporl.pipelines.inputs import DataConfig
from dporl.pipelines.offline_eval import OfflineEvalConfig
from dporl.pipelines.train import EvalConfig, PrivateTrainingConfig, TrainPipelineConfig
from dporl.pipelines.train import run as run_pipeline
from dporl.privacy.units import PrivacyUnit, dataset_unit
from dporl.train.config import OptimizerConfig, TrainerConfig
from dporl.train.export import GreedyPolicy, load_policy
from dporl.train.run_dir import RunMode
from dporl.utils.seeding import seeded
from dporl.utils.validation import ValidationError, check_positive


@dataclass
class FitSettings:
    """Private training of one algorithm on a dataset (DP-SGD per unit as in Sharma et al. 2024, Algorithm 4).

    Privacy: ``epsilon`` / ``delta`` bound the whole run (training and evaluation) for one unit of the dataset.
    ``relation="add_remove"`` (the default): neighbours add or remove one unit with all its rows, so the number of
    units is private; the run first releases a noisy count of them with ``count_fraction`` of epsilon and derives
    the sampling rate (batch_size / the released count), the noise and the evaluation's normalisers from it.
    ``relation="replace_one"``: neighbours replace one unit's rows (the number of units is public), and every
    mechanism is analysed for that relation. ``batch_size`` is the expected number of units per DP-SGD step (DP-SGD
    divides by it), ``rows_per_unit`` the transitions each sampled unit contributes to its one clipped gradient.
    ``steps`` caps training; the noise is calibrated so that those steps fit the budget (``noise_multiplier`` fixes
    it instead; then training stops at the budget). ``eval_gamma``: the discount of the policy value an offline
    evaluation releases (default: the algorithm's own; required for an algorithm without one).
    """

    epsilon: float = 1.0
    delta: float = 1e-5
    private: bool = True  # False: non-private training (NO guarantee; the baseline)
    relation: Literal["add_remove", "replace_one"] = "add_remove"
    count_fraction: float = 0.01  # add_remove: the private count's share of epsilon
    batch_size: float = 64
    rows_per_unit: int = 4
    steps: int = 500
    noise_multiplier: Optional[float] = None
    max_grad_norm: float = 1.0
    learning_rate: float = 1e-3
    evaluation: OfflineEvalConfig = field(default_factory=OfflineEvalConfig)
    simulator: bool = True  # evaluate in the dataset's simulator when its env id is a registered environment
    eval_episodes: int = 10  # simulator evaluation
    eval_gamma: Optional[float] = None
    noise_seed: Optional[int] = None  # None: 256 secret bits from the OS; a fixed seed is a secret like the data
    seed: int = 0  # public: network initialisation
    progress: bool = True

    algorithm_name: typing.ClassVar[str] = ""  # the registered algorithm (set on each API config class)

    def __post_init__(self) -> None:
        check_positive("epsilon", self.epsilon)
        check_positive("batch_size", self.batch_size)
        if self.steps < 1:
            raise ValidationError("steps", f"must be >= 1, got {self.steps}")
        self.algorithm_config()  # the hyper-parameters' own checks, now

    def algorithm_config(self) -> AlgorithmConfig:
        """The registered algorithm's config from this object's hyper-parameter fields."""
        entry = registry.get(self.algorithm_name)
        names = [f.name for f in dataclasses.fields(entry.config_cls) if f.name != "name"]
        return entry.config_cls(**{name: copy.deepcopy(getattr(self, name)) for name in names})

    def pipeline_config(self, run_dir: str | Path, data: Optional[DataConfig] = None) -> TrainPipelineConfig:
        """The ``train`` config this runs (``data``: where the data come from; default: handed over in Python)."""
        return TrainPipelineConfig(
            algorithm=self.algorithm_config(),
            method="dp_sgd" if self.private else "non_private",
            run_dir=str(run_dir),
            epsilon=self.epsilon,
            delta=self.delta,
            batch_size=self.batch_size,
            relation=self.relation,
            count_fraction=self.count_fraction,
            noise_seed=self.noise_seed,
            data=data or DataConfig(format="memory"),
            dp=PrivateTrainingConfig(noise_multiplier=self.noise_multiplier, max_grad_norm=self.max_grad_norm,
                                     rows_per_unit=self.rows_per_unit),
            trainer=TrainerConfig(max_steps=self.steps, seed=self.seed, progress=self.progress,
                                  eval_every=max(1, self.steps // 5), log_every=max(1, self.steps // 20),
                                  checkpoint_every=max(1, self.steps // 5),
                                  optimizer=OptimizerConfig(name="adam", lr=self.learning_rate)),
            eval=EvalConfig(enabled=self.simulator, episodes=self.eval_episodes, offline=self.evaluation,
                            gamma=self.eval_gamma),
        )

    def create(self, dataset: TrajectoryDataset) -> "PrivateLearner":
        """The algorithm for ``dataset`` (``dporl.DiscreteCQL`` for ``dporl.DiscreteCQLConfig``, ...): observation
        size, the declared action set and the privacy unit from its metadata (an imported table declares its
        actions: ``read_table(..., actions=...)``)."""
        return api_learner(registry.get(self.algorithm_name))(self, dataset)


@dataclass(frozen=True)
class FitResult:
    """What a fit released: the guarantee, the evaluation, where the policy is (all public: from ``release/``)."""

    run_dir: Path
    summary: dict[str, Any]

    @property
    def policy_dir(self) -> Path:
        return self.run_dir / "release" / "policy"

    @property
    def guarantee(self) -> Optional[tuple[float, float]]:
        """(epsilon, delta) of the whole run, or None (non-private, or no analysis covers it)."""
        g = self.summary["privacy"]["guarantee"]
        return None if g is None else (g["epsilon"], g["delta"])

    @property
    def evaluation(self) -> dict[str, Any]:
        """How the policy was evaluated: ``mode`` simulator | offline | none, and the (private) value with its
        interval for offline evaluation."""
        return self.summary["evaluation"]

    @property
    def value(self) -> Optional[tuple[float, float, float]]:
        """(value, interval low, interval high) of the offline evaluation, or None."""
        e = self.evaluation
        return (e["value"], e["ci_low"], e["ci_high"]) if e.get("mode") == "offline" else None

    def __str__(self) -> str:
        from dporl.pipelines import outcome_text

        return outcome_text(self.summary)


class PrivateLearner:
    """A registered algorithm built for one dataset; ``fit`` trains it privately and releases its greedy policy.

    The base of every algorithm's API class (``dporl.DiscreteCQL``, ``dporl.DiscreteBC``, ...: ``api_learner``); the
    torch module it trains is ``module`` (a ``PrivateAlgorithm``)."""

    algorithm_name: typing.ClassVar[str] = ""  # the registered algorithm (set on each API class)

    def __init__(self, config: FitSettings, dataset: TrajectoryDataset):
        if not isinstance(config, FitSettings):
            raise ValidationError("config", f"expected an API config (dporl.DiscreteCQLConfig, ...), got "
                                  f"{type(config).__name__}")
        if self.algorithm_name and config.algorithm_name != self.algorithm_name:
            raise ValidationError("config", f"{type(self).__name__} trains {self.algorithm_name!r}, the config is "
                                  f"{type(config).__name__} ({config.algorithm_name!r}): use its create()")
        if not isinstance(dataset, TrajectoryDataset):
            raise ValidationError("dataset", f"expected a TrajectoryDataset (dporl.read_table, read_minari, "
                                  f"TrajectoryDataset.load), got {type(dataset).__name__}")
        meta = dataset.metadata
        algorithm = config.algorithm_config()
        if len(meta.obs_shape) != 1:
            raise ValidationError("dataset.metadata.obs_shape",
                                  f"{algorithm.name} needs flat observations, got {meta.obs_shape}")
        self.config = config
        self.dataset = dataset
        self.unit: PrivacyUnit = dataset_unit(dataset)
        self.observation_size, self.n_actions = meta.obs_shape[0], meta.n_actions
        with seeded(config.seed):  # the pipeline builds the same network under the same public seed
            self.module: PrivateAlgorithm = algorithm.build(self.observation_size, self.n_actions, self.unit)
        self.result: Optional[FitResult] = None

    def fit(self, dataset: Optional[TrajectoryDataset] = None, *, run_dir: str | Path,
            mode: RunMode = "new") -> FitResult:
        """Train privately on ``dataset`` (default: the one this was created for) and evaluate, in ``run_dir``
        (``mode`` "new" refuses an existing run; "resume" continues it; "overwrite" replaces it)."""
        dataset = self.dataset if dataset is None else dataset
        meta = dataset.metadata
        if (meta.obs_shape[0] if len(meta.obs_shape) == 1 else None, meta.n_actions) != (
                self.observation_size, self.n_actions) or dataset_unit(dataset) != self.unit:
            raise ValidationError("dataset", f"created for {self.observation_size} features, {self.n_actions} "
                                  f"actions and unit {self.unit}; this dataset differs: create() for it")
        run_dir = Path(run_dir)
        summary = run_pipeline(self.config.pipeline_config(run_dir), mode=mode, dataset=dataset)
        released = load_policy(run_dir / "release" / "policy")
        self.module.policy_network().load_state_dict(released.network.state_dict())
        self.result = FitResult(run_dir, summary)
        return self.result

    @property
    def policy(self) -> GreedyPolicy:
        """The greedy policy of the current network (``.act(obs)``, ``.save(dir)``), with the dataset's observation
        names and action labels."""
        meta = self.dataset.metadata
        return GreedyPolicy.of(self.module).describe(observation_names=meta.observation_names,
                                                     action_labels=meta.action_labels)

    def predict(self, observations: Any) -> torch.Tensor:
        """Greedy actions [B] for observations [B, observation_size] (d3rlpy's name)."""
        return self.module.act(torch.as_tensor(observations, dtype=torch.float32))

    def save_policy(self, directory: str | Path) -> Path:
        return self.policy.save(directory)


_API_CONFIGS: dict[str, type] = {}
_API_LEARNERS: dict[str, type] = {}


def api_learner(entry: registry.AlgorithmEntry) -> type:
    """The Python API class of a registered algorithm (built once, named ``entry.learner_name``: ``DiscreteCQL``
    for ``DiscreteCQLConfig``): what its API config's ``create(dataset)`` returns."""
    if entry.learner_name not in _API_LEARNERS:
        cls = type(entry.learner_name, (PrivateLearner,), {
            "algorithm_name": entry.name,
            "__doc__": f"{entry.summary}, built for one dataset by ``dporl.{entry.api_name}(...).create(dataset)``: "
                       f"``fit(run_dir=...)`` trains its {entry.algorithm_cls.__name__} privately and releases its "
                       "greedy policy (``dporl.api.PrivateLearner``).",
            "__module__": __name__,
        })
        _API_LEARNERS[entry.learner_name] = cls
    return _API_LEARNERS[entry.learner_name]


def api_config(entry: registry.AlgorithmEntry) -> type:
    """The Python API config class of a registered algorithm (built once): ``FitSettings`` followed by the
    algorithm config's fields, defaults from the config class except where the registration's ``api_defaults``
    say otherwise."""
    if entry.api_name in _API_CONFIGS:
        return _API_CONFIGS[entry.api_name]
    hints = typing.get_type_hints(entry.config_cls)
    overrides = dict(entry.config_cls.api_defaults)
    taken = {f.name for f in dataclasses.fields(FitSettings)}
    fields = []
    for f in dataclasses.fields(entry.config_cls):
        if f.name == "name":
            continue
        if f.name in taken:
            raise ValidationError(f"{entry.config_cls.__name__}.{f.name}", "is a field of the private-training "
                                  "settings (dporl.api.FitSettings) too: rename the hyper-parameter")
        if f.name in overrides:
            default = overrides[f.name]
        elif f.default is not dataclasses.MISSING:
            default = f.default
        else:
            default = f.default_factory()
        fields.append((f.name, hints[f.name], field(default_factory=lambda value=default: copy.deepcopy(value))))
    cls = dataclasses.make_dataclass(entry.api_name, fields, bases=(FitSettings,), namespace={
        "algorithm_name": entry.name,
        "__doc__": f"{entry.summary}: private training settings (``dporl.api.FitSettings``) and "
                   f"{entry.config_cls.__name__}'s hyper-parameters. ``create(dataset).fit(run_dir=...)``.",
    })
    cls.__module__ = __name__
    _API_CONFIGS[entry.api_name] = cls
    return cls


def __getattr__(name: str) -> Any:
    """The API config classes of the registered algorithms (``dporl.api.DiscreteCQLConfig``, ...) and the classes
    their ``create`` returns (``dporl.api.DiscreteCQL``, ...)."""
    for entry in registry.entries():
        if entry.api_name == name:
            return api_config(entry)
        if entry.learner_name == name:
            return api_learner(entry)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
