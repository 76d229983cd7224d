"""dporl: differentially private offline reinforcement learning in PyTorch.

The public surface, in the order a user meets it::

    import dporl

    data = dporl.read_table("stays.csv", episode="stay", unit="clinician", observations="obs_",
                            action="action", actions=2, reward="reward", propensity="propensity")
    cql = dporl.DiscreteCQLConfig(epsilon=1.0).create(data)         # a dporl.DiscreteCQL; unit from the data
    result = cql.fit(run_dir="runs/stays")                            # private CQL + private offline evaluation
    policy = dporl.load_policy(result.policy_dir)                     # plain torch: policy.act(obs)

- datasets and readers: ``TrajectoryDataset``, ``DatasetMetadata``, ``read_table``, ``read_minari``, ``to_frame``,
  ``import_summary``;
- privacy units and splits: ``PrivacyUnit``, ``grouped_by``, ``dataset_unit``, ``UnitPartition``;
- algorithms, from the registry (``dporl.algos.registry``; ``dporl list`` shows them): per registered algorithm its
  Python API config (``DiscreteCQLConfig``, ``DiscreteBCConfig``), the algorithm its ``.create(dataset)`` returns,
  as in d3rlpy (``DiscreteCQL``, ``DiscreteBC``: a ``PrivateLearner`` with ``.fit``, ``.predict``, ``.policy``), its
  hyper-parameters (``CQLConfig``, ``BCConfig``) and its torch module (``DiscreteCQLModule``, ``DiscreteBCModule``:
  the network and its per-row losses); ``PrivateAlgorithm`` is the contract;
- private training: ``Trainer``, ``TrainerConfig``, ``DPConfig``, ``OptimizerConfig``, ``PrivacyLedger``,
  ``SecretRoot``;
- private evaluation on logged data: ``dp_importance_sampling``, ``dp_fqe``, ``dp_doubly_robust``, ``FQETraining``
  and ``FQEConfig`` (DP-FQE's settings), ``OPEScales`` (public scales from declared facts), ``OPEResult``;
- policy export and loading: ``GreedyPolicy`` (``policy.save(dir)``), ``save_policy``, ``load_policy``;
- errors: ``ValidationError`` (bad input, naming the field), ``PrivacyBudgetError``.

Importing ``dporl`` registers dporl's Gymnasium environments (``dporl/HIVTreatment-v0``, ``dporl/Chain-v0``,
``dporl/Line1D-v0``), as Gymnasium plugin packages do: ``gym.make("dporl:dporl/Chain-v0")`` works without an
explicit import. Everything else is imported on first use (``import dporl`` does not import torch), so the
command line starts quickly; the registry's names are looked up (and the algorithm modules imported) on first use
of a name this module does not list.

Layers, each importing only the ones before it (utils is used by all; docs/design.md):
data -> envs, experts -> privacy -> algos, methods -> train -> eval, logging -> pipelines -> audit, tuning -> api, cli.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

import dporl.envs  # noqa: F401  (registers dporl/* Gymnasium environments: the plugin convention)

__version__ = "0.1.0"

# Public name -> the module that defines it (imported on first attribute access, PEP 562).
_EXPORTS = {
    # datasets and readers
    "TrajectoryDataset": "dporl.data.dataset",
    "DatasetMetadata": "dporl.data.dataset",
    "read_table": "dporl.data.table",
    "read_minari": "dporl.data.table",
    "to_frame": "dporl.data.table",
    "import_summary": "dporl.data.table",
    # privacy units, partitions, ledger, secret randomness
    "PrivacyUnit": "dporl.privacy.units",
    "grouped_by": "dporl.privacy.units",
    "dataset_unit": "dporl.privacy.units",
    "UnitPartition": "dporl.privacy.partition",
    "PrivacyLedger": "dporl.privacy.ledger",
    "SecretRoot": "dporl.privacy.randomness",
    # algorithms: the contract and the Python API (each registered algorithm's names come from the registry)
    "PrivateAlgorithm": "dporl.algos.base",
    "OfflineEvalConfig": "dporl.pipelines.offline_eval",
    "PrivateLearner": "dporl.api",
    "FitResult": "dporl.api",
    # private training
    "Trainer": "dporl.train.trainer",
    "TrainerConfig": "dporl.train.config",
    "DPConfig": "dporl.train.config",
    "OptimizerConfig": "dporl.train.config",
    # private evaluation on logged data
    "dp_importance_sampling": "dporl.eval.ope_importance",
    "dp_fqe": "dporl.eval.ope_fqe",
    "dp_doubly_robust": "dporl.eval.ope_dr",
    "FQETraining": "dporl.eval.ope_fqe",
    "FQEConfig": "dporl.algos.fqe",
    "OPEResult": "dporl.eval.ope_result",
    "OPEScales": "dporl.eval.ope_scales",
    # policy export and loading
    "GreedyPolicy": "dporl.train.export",
    "save_policy": "dporl.train.export",
    "load_policy": "dporl.train.export",
    # private hyperparameter selection
    "tune": "dporl.tuning",
    # errors
    "ValidationError": "dporl.utils.validation",
    "PrivacyBudgetError": "dporl.utils.validation",
}



def _registered() -> dict[str, tuple[str, str]]:
    """The names the algorithm registry provides (imports the algorithm modules)."""
    from dporl.algos.registry import exported_names

    return exported_names()


def _resolve(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is not None:
        return getattr(importlib.import_module(module), name)
    registered = _registered().get(name)
    if registered is None:
        raise AttributeError(f"module 'dporl' has no attribute {name!r}")
    from dporl.algos.registry import get

    kind, algorithm = registered
    entry = get(algorithm)
    if kind == "api":
        from dporl.api import api_config

        return api_config(entry)
    if kind == "learner":
        from dporl.api import api_learner

        return api_learner(entry)
    return entry.config_cls if kind == "config" else entry.algorithm_cls


def __getattr__(name: str) -> Any:
    if name == "__all__":  # computed on first use: the registry's names need the algorithm modules
        value: Any = sorted({*_EXPORTS, *_registered(), "__version__"})
    else:
        value = _resolve(name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS) | set(_registered()))


if TYPE_CHECKING:  # static analysers and IDEs see the real names
    from dporl.algos.base import PrivateAlgorithm
    from dporl.algos.bc import BCConfig, DiscreteBCModule
    from dporl.algos.cql import CQLConfig, DiscreteCQLModule
    from dporl.algos.fqe import FQEConfig
    from dporl.api import FitResult, PrivateLearner
    from dporl.data.dataset import DatasetMetadata, TrajectoryDataset
    from dporl.data.table import import_summary, read_minari, read_table, to_frame
    from dporl.eval.ope_dr import dp_doubly_robust
    from dporl.eval.ope_fqe import FQETraining, dp_fqe
    from dporl.eval.ope_importance import dp_importance_sampling
    from dporl.eval.ope_result import OPEResult
    from dporl.eval.ope_scales import OPEScales
    from dporl.pipelines.offline_eval import OfflineEvalConfig
    from dporl.privacy.ledger import PrivacyLedger
    from dporl.privacy.partition import UnitPartition
    from dporl.privacy.randomness import SecretRoot
    from dporl.privacy.units import PrivacyUnit, dataset_unit, grouped_by
    from dporl.train.config import DPConfig, OptimizerConfig, TrainerConfig
    from dporl.train.export import GreedyPolicy, load_policy, save_policy
    from dporl.train.trainer import Trainer
    from dporl.tuning import tune
    from dporl.utils.validation import PrivacyBudgetError, ValidationError
