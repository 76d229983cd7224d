"""The privacy unit is owned by the data: sources group by the dataset's unit, the Trainer refuses a disagreeing
algorithm, and the report names the user's column."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dporl.algos.cql import CQLConfig, DiscreteCQLModule
from dporl.data.table import read_table
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.samplers import MixtureSource, PoissonUnitSource, UniformBatchSource
from dporl.privacy.units import EXPERT, TRAJECTORY, dataset_unit, grouped_by
from dporl.train.config import DPConfig, TrainerConfig
from dporl.train.trainer import Trainer
from dporl.utils.validation import ValidationError

from test_table import COLUMNS, logged_frame

torch.set_num_threads(1)
KEYS = ("obs", "actions", "rewards", "next_obs", "terminated")


def _table():
    return read_table(logged_frame(seed=11, n_units=6, episodes_per_unit=4), **COLUMNS, terminated="terminated",
                      next_observations="next_")


def _source(dataset, rate=0.5):
    t = dataset.transitions().to_torch()
    return PoissonUnitSource.from_dataset(dataset, {k: t[k] for k in KEYS}, rate)


def _trainer(tmp_path, algorithm, source, ledger):
    return Trainer(
        algorithm, source, config=TrainerConfig(max_steps=3, progress=False, eval_every=3, checkpoint_every=3),
        dp=DPConfig(epsilon=2.0, delta=1e-5, noise_multiplier=2.0, noise_seed=1), ledger=ledger,
        run_dir=tmp_path / "run", pipeline="t", pipeline_config={},
    )


def test_source_groups_rows_by_the_datasets_unit():
    dataset = _table()
    source = _source(dataset)
    assert source.unit == grouped_by("unit") and source.n_units == dataset.n_units == 6
    # Every row of a sampled batch belongs to the unit the index says: compare with the table's unit of each row.
    per_row = np.repeat(dataset.unit_ids, dataset.episode_lengths)
    np.testing.assert_array_equal(np.sort(source.index.counts.numpy()), np.sort(np.bincount(per_row)))
    padded = dataset.padded()
    by_episode = PoissonUnitSource.from_dataset(dataset, {"rewards": padded.rewards}, 0.5)
    np.testing.assert_array_equal(by_episode.index.counts.numpy(), np.bincount(dataset.unit_ids))
    with pytest.raises(ValidationError, match="rows"):
        PoissonUnitSource.from_dataset(dataset, {"x": torch.zeros(dataset.n_episodes + 1)}, 0.5)
    mixture = MixtureSource(0.5, source, UniformBatchSource({"x": torch.zeros(3)}, 2))
    assert mixture.unit == source.unit


def test_trainer_refuses_an_algorithm_declaring_another_unit_and_writes_nothing(tmp_path):
    dataset = _table()
    wrong = DiscreteCQLModule(3, 3, CQLConfig(hidden_sizes=[8]), privacy_unit=EXPERT)  # "one expert" on patient rows
    with pytest.raises(ValidationError, match="groups rows by unit") as info:
        _trainer(tmp_path, wrong, _source(dataset), PrivacyLedger()).fit()
    assert info.value.field == "algorithm.privacy_unit"
    assert not (tmp_path / "run").exists()
    with pytest.raises(ValidationError, match="privacy_unit"):
        _trainer(tmp_path, DiscreteCQLModule(3, 3, CQLConfig(hidden_sizes=[8]), privacy_unit=TRAJECTORY),
                 _source(dataset), PrivacyLedger()).fit()


def test_matching_unit_trains_and_the_report_names_the_users_column(tmp_path):
    dataset = _table()
    ledger = PrivacyLedger()
    algorithm = DiscreteCQLModule(3, 3, CQLConfig(hidden_sizes=[8]), privacy_unit=dataset_unit(dataset))
    result = _trainer(tmp_path, algorithm, _source(dataset), ledger).fit()
    guarantee = result.privacy["guarantee"]
    assert guarantee["unit"] == "unit" and guarantee["unit_column"] == "unit"
    assert "all rows sharing one value of column 'unit'" in result.privacy["text"]
