"""Cells of a keyed-hash partition that hold no unit.

Under add/remove neighbours whether a cell holds any unit is private (a cell of one unit in D is empty in D minus that
unit), so a run never refuses on it: the split keeps an empty cell as a dataset of no units, its mechanisms run over no
units, and a cell is refused only on its RELEASED count (below one unit). Under replace-one the counts are public and
the preflight refuses an empty cell before anything is written. The neighbour case ("the one clinician of an
evaluation cell removed", tests/test_neighbours.py) runs the pair end to end.
"""

from __future__ import annotations

import math
import re
from pathlib import Path

import numpy as np
import pytest
import torch

from dporl.pipelines.inputs import DataConfig, import_dataset
from dporl.pipelines.train import TrainPipelineConfig, run
from dporl.privacy.count import Units
from dporl.privacy.partition import UnitPartition, fold_partition
from dporl.utils.config import apply_overrides, from_dict, load_yaml
from dporl.utils.validation import ValidationError

ROOT = Path(__file__).resolve().parents[1]
FQE_CELLS = {"train": 0.5, "evaluate0": 0.25, "evaluate1": 0.25}
torch.set_num_threads(1)


def table_config(*overrides: str) -> dict:
    """configs/table_quickstart.yaml on 12 clinicians x 2 stays, tiny training and DP-FQE (2 folds), in memory."""
    config = apply_overrides(load_yaml(ROOT / "configs/table_quickstart.yaml"), [
        "epsilon=4.0", "batch_size=2", "data.example.units=12", "data.example.episodes_per_unit=2",
        "dp.rows_per_unit=2", "algorithm.hidden_sizes=[8]", "trainer.max_steps=5", "trainer.eval_every=5",
        "trainer.log_every=5", "trainer.checkpoint_every=5", "trainer.progress=false", "eval.offline.folds=2",
        "eval.offline.fqe.steps=5", "eval.offline.fqe.sample_rate=0.5", "eval.offline.tolerance=1.0e+6",
        "noise_seed=3", *overrides])
    return config


@pytest.fixture(scope="module")
def table():
    config = table_config()
    dataset, _ = import_dataset(from_dict(DataConfig, config["data"]), progress=False)
    return dataset


def salt_with_empty(keys: list[str], cells, empty: str, prefix: str = "empty") -> str:
    """The first salt "<prefix>-<i>" at which cell ``empty`` of ``cells`` holds none of ``keys`` (and every other
    cell holds some), searched deterministically."""
    for i in range(200_000):
        partition = cells(f"{prefix}-{i}")
        counts = np.bincount(partition.cell_of_keys(keys), minlength=len(partition.names))
        index = partition.names.index(empty)
        if counts[index] == 0 and all(c > 0 for j, c in enumerate(counts) if j != index):
            return f"{prefix}-{i}"
    raise AssertionError(f"no salt leaves cell {empty!r} empty")


def memory_run(config: dict, dataset, run_dir: Path) -> dict:
    config = {**config, "data": {"format": "memory"}, "run_dir": str(run_dir)}
    return run(from_dict(TrainPipelineConfig, config), dataset=dataset)


# ------------------------------------------------------------------------------------------------ the refusal
def test_a_cell_whose_released_count_is_below_one_is_refused_by_name_with_the_units_it_needs():
    from dporl.privacy.count import check_cells_hold_units

    released = Units({"train": 5.0, "evaluate0": 0.0, "evaluate1": 3.0}, -math.inf, released=True, epsilon=0.04)
    with pytest.raises(ValidationError) as caught:
        check_cells_hold_units(released, FQE_CELLS, "eval.offline.holdout")
    message = str(caught.value)
    assert caught.value.field == "eval.offline.holdout"
    assert "cell 'evaluate0' holds no unit by the released count" in message and "m~ = 0" in message
    # One unit plus three standard deviations sqrt(2) / 0.04 of the count's noise, at the cell's share 0.25.
    assert f"about {math.ceil((1 + 3 * math.sqrt(2) / 0.04) / 0.25)} units in all" in message
    assert "a larger count_fraction" in message
    # Its words do not depend on the released count (only its numbers): the neighbour test masks the numbers.
    other = Units({"train": 5.0, "evaluate0": -7.0, "evaluate1": 3.0}, -math.inf, released=True, epsilon=0.04)
    with pytest.raises(ValidationError) as second:
        check_cells_hold_units(other, FQE_CELLS, "eval.offline.holdout")
    number = r"[-+]?\d+\.?\d*(e[-+]?\d+)?"
    assert re.sub(number, "#", message) == re.sub(number, "#", str(second.value))
    check_cells_hold_units(Units({"train": 5.0, "evaluate0": 1.0, "evaluate1": 3.0}, -math.inf, released=True,
                                 epsilon=0.04), FQE_CELLS)  # one unit by the released count: no refusal


def test_a_public_count_of_zero_is_refused_as_such():
    from dporl.privacy.count import check_cells_hold_units

    with pytest.raises(ValidationError, match="cell 'evaluate1' holds no unit .*public: the relation is replace-one"):
        check_cells_hold_units(Units.public({"train": 5, "evaluate0": 2, "evaluate1": 0}), FQE_CELLS)


def test_split_keeps_an_empty_cell_only_when_asked(table):
    keys = table.metadata.unit_key_strings()
    salt = salt_with_empty(keys, lambda s: UnitPartition(s, FQE_CELLS), "evaluate1")
    partition = UnitPartition(salt, FQE_CELLS)
    with pytest.raises(ValidationError, match="cell 'evaluate1' holds no unit"):
        partition.split(table)
    parts = partition.split(table, allow_empty=True)
    assert parts["evaluate1"].n_units == 0 and parts["evaluate1"].n_episodes == 0
    assert sum(p.n_units for p in parts.values()) == table.n_units


# ------------------------------------------------------------------------------------------------ the runs
def test_replace_one_refuses_an_empty_cell_before_anything_is_written(table, tmp_path):
    salt = salt_with_empty(table.metadata.unit_key_strings(), lambda s: UnitPartition(s, FQE_CELLS), "evaluate1")
    config = table_config(f"eval.offline.salt={salt}", "relation=replace_one")
    with pytest.raises(ValidationError, match="cell 'evaluate1' holds no unit") as caught:
        memory_run(config, table, tmp_path / "run")
    assert caught.value.field == "partition"
    assert not (tmp_path / "run" / "release").exists() or not any((tmp_path / "run" / "release").rglob("*"))


ESTIMATOR_CELLS = {"fqe": FQE_CELLS, "wis": {"train": 0.5, "evaluate": 0.5},
                   "dr": {"train": 0.5, "model": 0.25, "estimate": 0.25}}


@pytest.mark.parametrize("estimator, empty", [("fqe", "evaluate1"), ("fqe", "train"), ("wis", "evaluate"),
                                              ("dr", "model"), ("dr", "estimate")])
def test_add_remove_runs_over_an_empty_cell_its_released_count_says_holds_units(table, tmp_path, estimator, empty):
    """The event the released count cannot exclude (a cell empty, its noisy count >= 1): the run is the same
    mechanisms over no units in that cell (DP-SGD steps of noise only, DP-FQE / DP-IS on no units) and ends with its
    release, never an error that would tell the data apart. A count released before the run fixes m~ here."""
    cells = ESTIMATOR_CELLS[estimator]
    salt = salt_with_empty(table.metadata.unit_key_strings(), lambda s: UnitPartition(s, cells), empty)
    config = table_config(f"eval.offline.salt={salt}", f"eval.offline.estimator={estimator}",
                          "eval.offline.unit_clip=5.0")
    counts = {name: 12 // len(cells) for name in cells}
    config["released_count"] = {"count": sum(counts.values()), "cells": counts, "epsilon": 0.5}
    summary = memory_run(config, table, tmp_path / "run")
    release = tmp_path / "run" / "release"
    assert (release / "privacy_report.json").is_file() and (release / "policy" / "weights.pt").is_file()
    assert summary["headline"]
    if empty == "evaluate1":  # its fold's noisy episode count is noise only: no estimate, said as such
        assert summary["evaluation"]["status"] in ("no_estimate", "diverged")


def test_add_remove_runs_refuse_on_the_released_count_not_on_the_exact_one(table, tmp_path):
    """No released count given: the run's own count decides. An empty cell whose released count is below one is
    refused by that count (the refusal names the released estimate), after the count stage."""
    salt = salt_with_empty(table.metadata.unit_key_strings(), lambda s: UnitPartition(s, FQE_CELLS), "evaluate1")
    config = table_config(f"eval.offline.salt={salt}", "count_fraction=0.5")
    try:
        memory_run(config, table, tmp_path / "run")
    except ValidationError as exc:
        assert exc.field == "eval.offline.holdout" and "by the released count" in str(exc), exc
    journal = (tmp_path / "run").rglob("*journal*")
    assert any(journal)  # the count was charged (and journaled) before any decision on the cells


# ------------------------------------------------------------------------------------------------ the library
def _uniform(observations: torch.Tensor) -> torch.Tensor:
    return torch.full((observations.shape[0], 2), 0.5, dtype=torch.float64)


@pytest.mark.parametrize("relation", ["add_remove", "replace_one"])
def test_library_dp_fqe_over_an_empty_fold(table, tmp_path, relation):
    """dp_fqe on its own folds: under add/remove an empty fold is DP-FQE over no units (a public normaliser here),
    under replace-one it is refused by name before anything is spent."""
    from dporl.eval.ope_fqe import FQETraining, dp_fqe
    from dporl.privacy.ledger import PrivacyLedger
    from dporl.privacy.randomness import SecretRoot
    from dporl.privacy.units import Relation

    salt = salt_with_empty(table.metadata.unit_key_strings(), lambda s: fold_partition(s, 2, prefix="fqe-fold"),
                           "fqe-fold1", prefix="fold")
    ledger = PrivacyLedger((4.0, 1e-5), Relation.ADD_REMOVE if relation == "add_remove" else Relation.REPLACE_ONE)
    training = FQETraining(steps=3, sample_rate=0.5, expected_units=3.0)
    common = dict(epsilon=4.0, delta=1e-5, ledger=ledger, root=SecretRoot(3), run_dir=tmp_path, folds=2, salt=salt,
                  training=training, gamma=0.95, value_range=(-2.0, 1.0), episodes_per_unit=2, tolerance=1e6)
    if relation == "replace_one":
        with pytest.raises(ValidationError, match="cell 'fqe-fold1' holds no unit"):
            dp_fqe(table, _uniform, **common)
        assert not ledger.stages
        return
    result = dp_fqe(table, _uniform, **common)
    # Both folds ran and released (the empty one's value is a ratio of noises: an estimate or "no estimate").
    assert len(result.fold_values) == 2 and {"fqe-fold1/train", "fqe-fold1/value"} <= set(ledger.stages)
