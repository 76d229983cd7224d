"""dporl: differentially private offline reinforcement learning in PyTorch.

The public surface, in the order a user meets it::

    import dporl

    data = dporl.read_table("stays.csv", episode="stay", unit="clinician", observations="obs_",
                            action="action", actions=2, reward="reward", propensity="propensity")
    cql = dporl.DiscreteCQLConfig(epsilon=1.0).create(data)         # declared actions, unit from the data
    result = cql.fit(run_dir="runs/stays")                            # private CQL + private offline evaluation
    policy = dporl.load_policy(result.policy_dir)                     # plain torch: policy.act(obs)

- datasets and readers: ``TrajectoryDataset``, ``DatasetMetadata``, ``read_table``, ``read_minari``, ``to_frame``,
  ``import_summary``;
- privacy units and splits: ``PrivacyUnit``, ``grouped_by``, ``dataset_unit``, ``UnitPartition``;
- algorithm configs: ``DiscreteCQLConfig`` (d3rlpy-like: ``.create(dataset)`` -> ``PrivateCQL`` with ``.fit``),
  ``CQLConfig`` / ``DiscreteCQL`` (the network and its per-row losses);
- private training: ``Trainer``, ``TrainerConfig``, ``DPConfig``, ``OptimizerConfig``, ``PrivacyLedger``,
  ``SecretRoot``;
- private evaluation on logged data: ``dp_importance_sampling``, ``dp_fqe``, ``dp_doubly_robust``, ``FQETraining``
  and ``FQEConfig`` (DP-FQE's settings), ``OPEScales`` (public scales from declared facts), ``OPEResult``;
- policy export and loading: ``GreedyQPolicy`` (``policy.save(dir)``), ``save_policy``, ``load_policy``;
- errors: ``ValidationError`` (bad input, naming the field), ``PrivacyBudgetError``.

Importing ``dporl`` registers dporl's Gymnasium environments (``dporl/HIVTreatment-v0``, ``dporl/Chain-v0``,
``dporl/Line1D-v0``), as Gymnasium plugin packages do: ``gym.make("dporl:dporl/Chain-v0")`` works without an
explicit import. Everything else is imported on first use (``import dporl`` does not import torch), so the
command line starts quickly.

Layers, each importing only the ones before it:
utils -> data, envs, experts -> privacy -> algos -> train -> eval, logging -> audit -> pipelines -> api, cli.
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
    # algorithms and their configs
    "CQLConfig": "dporl.algos.cql",
    "DiscreteCQL": "dporl.algos.cql",
    "DiscreteCQLConfig": "dporl.api",
    "OfflineEvalConfig": "dporl.pipelines.offline_eval",
    "PrivateCQL": "dporl.api",
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
    "GreedyQPolicy": "dporl.train.export",
    "save_policy": "dporl.train.export",
    "load_policy": "dporl.train.export",
    # errors
    "ValidationError": "dporl.utils.validation",
    "PrivacyBudgetError": "dporl.utils.validation",
}

__all__ = sorted(_EXPORTS) + ["__version__"]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'dporl' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value  # later lookups skip this hook
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # static analysers and IDEs see the real names
    from dporl.algos.cql import CQLConfig, DiscreteCQL
    from dporl.api import DiscreteCQLConfig, FitResult, PrivateCQL
    from dporl.data.dataset import DatasetMetadata, TrajectoryDataset
    from dporl.data.table import import_summary, read_minari, read_table, to_frame
    from dporl.algos.fqe import FQEConfig
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
    from dporl.train.export import GreedyQPolicy, load_policy, save_policy
    from dporl.train.trainer import Trainer
    from dporl.utils.validation import PrivacyBudgetError, ValidationError
