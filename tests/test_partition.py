"""Parallel composition: a split of units by a keyed hash of their ids, and the ledger's per-cell composition."""

from __future__ import annotations

import math

import numpy as np
import pytest

from dporl.data.table import read_table
from dporl.privacy.accountants import epsilon_for
from dporl.privacy.events import ApproxDPEvent, PoissonGaussianEvent
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.partition import UnitPartition, fold_partition
from dporl.privacy.units import EXPERT, dataset_unit
from dporl.utils.validation import PrivacyBudgetError, ValidationError

from test_dataset import make_dataset

from test_table import COLUMNS, logged_frame

SPLIT = UnitPartition("public-salt-2026", {"train": 0.5, "heldout": 0.5})
STEP = PoissonGaussianEvent(2.0, 0.02)


def test_a_units_cell_depends_on_its_own_id_alone():
    keys = [f"patient-{i}" for i in range(2000)]
    cells = SPLIT.cell_of_keys(keys)
    # Adding or removing other units never moves a unit: the same key gets the same cell in any dataset.
    np.testing.assert_array_equal(SPLIT.cell_of_keys(keys[500:]), cells[500:])
    np.testing.assert_array_equal(SPLIT.cell_of_keys(list(reversed(keys))), cells[::-1])
    # Fractions: each unit lands independently with probability 1/2; 4.5 binomial standard deviations.
    share = np.mean(cells == 0)
    assert abs(share - 0.5) < 4.5 * math.sqrt(0.25 / len(keys))
    assert not np.array_equal(UnitPartition("other-salt", {"train": 0.5, "heldout": 0.5}).cell_of_keys(keys), cells)
    uneven = UnitPartition("s", {"a": 0.8, "b": 0.2}).cell_of_keys(keys)
    assert abs(np.mean(uneven == 1) - 0.2) < 4.5 * math.sqrt(0.16 / len(keys))


def test_split_covers_every_episode_once_and_keeps_unit_ids():
    dataset = read_table(logged_frame(seed=3, n_units=12, episodes_per_unit=2), **COLUMNS, terminated="terminated",
                         next_observations="next_")
    parts = SPLIT.split(dataset)
    assert sum(p.n_episodes for p in parts.values()) == dataset.n_episodes
    assert sum(p.n_units for p in parts.values()) == dataset.n_units
    keys = {name: set(p.metadata.unit_keys) for name, p in parts.items()}
    assert not keys["train"] & keys["heldout"]
    cell_of = dict(zip(dataset.metadata.unit_keys, SPLIT.cell_of_units(dataset)))
    for index, (name, part) in enumerate(parts.items()):
        assert all(cell_of[k] == index for k in part.metadata.unit_keys)
        # every episode keeps its unit's key (re-indexed densely within the cell)
        part_keys = np.asarray(part.metadata.unit_keys)[part.unit_ids]
        assert set(part_keys) == keys[name]
    assert sum(p.n_transitions for p in parts.values()) == dataset.n_transitions
    assert all(dataset_unit(p) == dataset_unit(dataset) for p in parts.values())  # the unit survives the split
    expert_data, _ = make_dataset(seed=9, n_episodes=30)
    assert all(dataset_unit(p) == EXPERT for p in SPLIT.split(expert_data).values())


def test_disjoint_cells_compose_in_parallel_and_shared_units_sequentially():
    ledger = PrivacyLedger()
    ledger.partition(SPLIT)
    ledger.stage("fit", budget=(10.0, 1e-6), unit="expert", mechanism="rdp", cells=["heldout"])
    ledger.stage("estimate", budget=(0.8, 1e-6), unit="expert", mechanism="pld", cells=["train"])
    ledger.record("fit", STEP, 200)
    ledger.record("estimate", ApproxDPEvent(0.7, 0.0))
    report = ledger.report()
    fit, estimate = ledger.spent("fit"), ledger.spent("estimate")
    assert report.guarantee[0] == pytest.approx(max(fit, estimate))  # the max, not the sum
    assert max(fit, estimate) < fit + estimate - 0.5
    assert report.guarantee[1] == pytest.approx(1e-6)
    assert "parallel" in report.composition and "parallel composition" in report.guarantee[2]
    assert "composition: parallel" in report.describe()
    # A stage over all units touches every cell: it composes sequentially with each cell's stages.
    ledger.stage("audit", budget=(0.5, 1e-6), unit="expert", mechanism="pld")
    ledger.record("audit", ApproxDPEvent(0.3, 0.0))
    cells = {c.name: c for c in ledger.report().cells}
    assert cells["heldout"].stages == ["fit", "audit"] and cells["train"].stages == ["estimate", "audit"]
    heldout_basic = fit + ledger.spent("audit")
    assert cells["heldout"].epsilon <= heldout_basic + 1e-9
    joint = epsilon_for([(STEP, 200), (ApproxDPEvent(0.3, 0.0), 1)], 2e-6, "pld")
    assert cells["heldout"].epsilon == pytest.approx(min(heldout_basic, joint))
    assert cells["train"].epsilon == pytest.approx(0.7 + 0.3, rel=1e-4)  # pure-DP stages add
    assert ledger.report().guarantee[0] == pytest.approx(max(c.epsilon for c in cells.values()))


def test_same_cell_reuse_is_sequential_and_without_cells_nothing_changes():
    ledger = PrivacyLedger()
    ledger.partition(SPLIT)
    ledger.stage("a", budget=(1.0, 1e-6), unit="expert", mechanism="pld", cells=["train"])
    ledger.stage("b", budget=(1.0, 1e-6), unit="expert", mechanism="pld", cells=["train"])
    ledger.record("a", ApproxDPEvent(0.4, 0.0))
    ledger.record("b", ApproxDPEvent(0.5, 0.0))
    report = ledger.report()
    # the same units twice: sequential (PLD of two pure-DP events sits within discretisation of the sum)
    assert report.guarantee[0] == pytest.approx(0.9, rel=1e-4) and report.guarantee[0] <= 0.9 + 1e-12
    cells = {c.name: c for c in report.cells}
    assert cells["heldout"].stages == [] and cells["heldout"].epsilon == 0.0
    plain = PrivacyLedger()
    plain.stage("a", budget=(1.0, 1e-6), unit="expert", mechanism="pld")
    plain.record("a", ApproxDPEvent(0.4, 0.0))
    assert plain.report().cells is None and "sequential" in plain.report().composition
    # naming every cell is touching every unit
    every = PrivacyLedger()
    every.partition(SPLIT)
    assert every.stage("x", budget=(1.0, 1e-6), cells=["train", "heldout"]).cells is None


@pytest.mark.parametrize("split", [
    np.array([0, 1, 0, 1]),  # an assignment computed from the data
    {"train": [0, 2], "heldout": [1, 3]},
    lambda unit: unit % 2,
    "train/heldout",
])
def test_a_split_that_could_depend_on_the_data_cannot_be_declared(split):
    with pytest.raises(ValidationError) as info:
        PrivacyLedger().partition(split)
    assert info.value.field == "ledger.partition"


def test_partition_construction_and_stage_cells_are_validated():
    with pytest.raises(ValidationError, match="assignment computed from the data"):
        UnitPartition("s", np.array([0, 1, 1]))
    with pytest.raises(ValidationError, match="sum to 1"):
        UnitPartition("s", {"a": 0.5, "b": 0.4})
    with pytest.raises(ValidationError, match="salt"):
        UnitPartition("", {"a": 0.5, "b": 0.5})
    ledger = PrivacyLedger()
    with pytest.raises(ValidationError, match="declare the partition"):
        ledger.stage("x", budget=(1.0, 1e-6), cells=["train"])
    ledger.partition(SPLIT)
    with pytest.raises(ValidationError, match="unknown cell"):
        ledger.stage("x", budget=(1.0, 1e-6), cells=["test"])
    with pytest.raises(ValidationError, match="already declared"):
        ledger.partition(fold_partition("s", 3))


def test_state_dict_round_trip_keeps_partition_and_cells():
    ledger = PrivacyLedger()
    ledger.partition(fold_partition("salt", 3))
    for i in range(3):
        ledger.stage(f"fold{i}", budget=(1.0, 1e-6), unit="expert", mechanism="pld", cells=[f"fold{i}"])
        ledger.record(f"fold{i}", ApproxDPEvent(0.2 * (i + 1), 0.0))
    restored = PrivacyLedger()
    restored.load_state_dict(ledger.state_dict())
    assert restored.report().to_dict() == ledger.report().to_dict()
    # The largest cell: one pure 0.6-DP release, which at delta 1e-6 is exactly log(e^0.6 - 1e-6 (1 + e^0.6)).
    assert restored.report().guarantee[0] == pytest.approx(math.log(math.exp(0.6) - 1e-6 * (1 + math.exp(0.6))))


def test_a_run_budget_is_checked_cell_by_cell():
    ledger = PrivacyLedger(budget=(1.0, 1e-5))
    ledger.partition(SPLIT)
    ledger.stage("fit", budget=(1.0, 5e-6), unit="expert", mechanism="pld", cells=["heldout"])
    ledger.stage("estimate", budget=(1.0, 5e-6), unit="expert", mechanism="pld", cells=["train"])  # disjoint: fits
    with pytest.raises(PrivacyBudgetError, match="in cell 'train'"):
        ledger.stage("more", budget=(0.1, 1e-6), unit="expert", mechanism="pld", cells=["train"])
    with pytest.raises(PrivacyBudgetError, match="in cell"):
        ledger.stage("everyone", budget=(0.1, 1e-6), unit="expert", mechanism="pld")
    ledger.record("fit", ApproxDPEvent(0.9, 0.0))
    ledger.record("estimate", ApproxDPEvent(1.0, 0.0))
    assert ledger.report().guarantee[0] == pytest.approx(1.0, rel=1e-4)  # within the run budget: parallel, not 1.9


def test_the_journal_carries_partition_cells_and_assumptions():
    written = []
    ledger = PrivacyLedger()
    ledger.attach_journal(written.append)
    ledger.partition(SPLIT)
    assert written[-1]["partition"] == SPLIT.to_dict()  # durable before a stage can name a cell
    ledger.stage("fit", budget=(1.0, 1e-6), unit="expert", mechanism="pld", cells=["heldout"])
    ledger.assume("the number of units is public")
    ledger.record("fit", ApproxDPEvent(0.5, 0.0))
    state = written[-1]
    assert state["stages"][0]["cells"] == ["heldout"] and state["assumptions"] == ["the number of units is public"]
    recovered = PrivacyLedger()
    recovered.attach_journal(lambda s: None, recovered=state)
    assert recovered.report().to_dict() == ledger.report().to_dict()
    other = PrivacyLedger()
    other.partition(UnitPartition("another-salt", {"train": 0.5, "heldout": 0.5}))
    with pytest.raises(ValidationError, match="different partition"):
        other.attach_journal(lambda s: None, recovered=state)
