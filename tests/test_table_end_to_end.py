"""From a CSV to a private policy and its private value, in one ledger: the pieces phase 2's API will wire.

A CSV of treatment-chain episodes logged by clinicians (the unit) -> read_table -> a keyed-hash split of the
clinicians into "train" and "evaluate" -> unit-level DP-SGD CQL on "train" (the Trainer groups by the data's unit)
-> DP-WIS of the learned (softened greedy) policy on "evaluate" -> one guarantee: the larger of the two cells'.
"""

from __future__ import annotations

import numpy as np
import torch

from dporl.algos.cql import CQLConfig, DiscreteCQLModule
from dporl.data.table import read_table, to_frame
from dporl.eval.ope_coverage import TreatmentChain
from dporl.eval.private_ope import dp_importance_sampling
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.partition import UnitPartition
from dporl.privacy.randomness import SecretRoot
from dporl.privacy.samplers import PoissonUnitSource
from dporl.privacy.units import dataset_unit
from dporl.train.config import DPConfig, OptimizerConfig, TrainerConfig
from dporl.train.trainer import Trainer

torch.set_num_threads(1)
KEYS = ("obs", "actions", "rewards", "next_obs", "terminated")


def test_csv_to_private_policy_and_its_private_value_in_one_ledger(tmp_path):
    chain = TreatmentChain()
    logged = chain.simulate(600, 4, (0.2, 0.8), np.random.default_rng(11))
    frame = to_frame(logged, next_observations=True, unit="clinician")
    frame["propensity"] = np.exp(frame.pop("log_propensity"))
    frame.to_csv(tmp_path / "stays.csv", index=False)

    dataset = read_table(tmp_path / "stays.csv", episode="episode", unit="clinician", observations="obs_",
                         action="action", actions=2, reward="reward", step="step", terminated="terminated",
                         truncated="truncated", next_observations="next_obs_", propensity="propensity")
    assert dataset.n_units == 600 and dataset.metadata.unit_keys[0] == "c0"

    ledger = PrivacyLedger()
    split = ledger.partition(UnitPartition("public-salt", {"train": 0.5, "evaluate": 0.5}))
    cells = split.split(dataset)
    train = cells["train"]
    unit = dataset_unit(train)
    t = train.transitions().to_torch()
    source = PoissonUnitSource.from_dataset(train, {k: t[k] for k in KEYS}, sample_rate=0.1, rows_per_unit=4)
    cql = DiscreteCQLModule(6, 2, CQLConfig(hidden_sizes=[16], gamma=chain.gamma, target_update_every=20), unit)
    ledger.stage("train", budget=(1.0, 1e-5), mechanism="rdp", unit=unit, cells=["train"])
    Trainer(cql, source, config=TrainerConfig(max_steps=150, progress=False, eval_every=150, checkpoint_every=150,
                                              optimizer=OptimizerConfig(lr=0.01)),
            dp=DPConfig(epsilon=1.0, delta=1e-5, noise_seed=3), ledger=ledger, run_dir=tmp_path / "run",
            pipeline="e2e", pipeline_config={}).fit()

    greedy = cql.act(torch.eye(6)).numpy()
    treat = np.where(greedy == 1, 0.75, 0.25)  # softened greedy policy (public post-processing of the release)

    def policy(obs):
        p = torch.from_numpy(treat)[obs.argmax(1)]
        return torch.stack([1 - p, p], 1)

    result = dp_importance_sampling(cells["evaluate"], policy, epsilon=1.0, delta=1e-5, ledger=ledger,
                                    root=SecretRoot(4), unit_clip=12.0, gamma=chain.gamma, cells=["evaluate"],
                                    value_range=(-2.0, 1.0))
    truth = chain.true_value(treat)
    assert result.ci_low <= truth <= result.ci_high, (result.describe(), truth)

    report = ledger.report()
    eps, delta, analysis = report.guarantee
    assert eps <= 1.0 + 1e-9 and "parallel" in analysis  # the larger cell's eps, not 1 + 1
    assert sum(s.epsilon for s in report.stages) > 1.9
    payload = report.to_dict()
    assert payload["guarantee"]["unit_column"] == "clinician"
    assert "one unit = all rows sharing one value of column 'clinician'" in report.describe()
