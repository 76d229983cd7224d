"""The neighbour test: every pipeline and method that prints a guarantee, run on D and on its neighbour D' with the
same noise seed, through the code users run; every released field that differs (files under release/, the file list,
TensorBoard, stdout, refusals) must be an output of an accounted mechanism listed in ``dporl.audit.accounted``.

Neighbours: one expert removed with its policy and episodes (the train pipeline on a tiny version of the quickstart's
generated CartPole experts), one clinician removed (the table quickstart, the Python API), one trajectory removed or
replaced (the ope pipeline's GPOPE by its relation; DP-LSW / DP-LSL are replace-one), the reward function shifted by
1 (fnq and its private baselines, reward level). Runs are tiny (tens of steps): what is compared is what is released,
not how good it is.

Each case names the leak it guards against (what an unaccounted difference looked like before the fix).
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pytest
import torch

from dporl.algos.registry import names as registry_names
from dporl.audit.accounted import ENTRIES, classify, registry_table
from dporl.audit.neighbour_audit import audit_pair, check_pair
from dporl.audit.neighbour_runs import NeighbourPair
from dporl.audit.release_snapshot import compare, snapshot_of
from dporl.utils.config import apply_overrides, load_yaml

ROOT = Path(__file__).resolve().parents[1]
SEED = 5
torch.set_num_threads(1)

# ---------------------------------------------------------------------------------------------------- data
TINY_GENERATION = ["experts.points_per_axis=4", "experts.n_settings=64", "experts.candidates_per_setting=8",
                   "experts.keep_best=8", "trajectories_per_expert=1", "max_episode_steps=60", "progress=false"]


def make_expert_data(directory: Path) -> dict[str, str]:
    """The quickstart's generation (analytic CartPole LQR experts, p_min 0.1), tiny: 512 experts, 1 episode each."""
    from dporl.pipelines.train import generate_dataset

    generate = apply_overrides(load_yaml(ROOT / "configs/expert_cql_quickstart.yaml")["data"]["generate"],
                               TINY_GENERATION)
    dataset, experts = generate_dataset(generate, directory)
    return {"path": dataset, "expert_set": experts}


@pytest.fixture(scope="session")
def expert_data(tmp_path_factory) -> dict[str, str]:
    return make_expert_data(tmp_path_factory.mktemp("experts"))


def quickstart(expert_data: dict[str, str], *overrides: str) -> dict[str, Any]:
    """configs/expert_cql_quickstart.yaml on the tiny data: 16 experts per step, 20 steps, 5 release runs."""
    config = apply_overrides(load_yaml(ROOT / "configs/expert_cql_quickstart.yaml"), [
        "batch_size=16", "release.trajectories=5", "algorithm.hidden_sizes=[16]", "trainer.max_steps=20",
        "trainer.eval_every=10", "trainer.log_every=5", "trainer.checkpoint_every=10", "trainer.progress=false",
        "eval.episodes=2", "eval.num_envs=2", "eval.max_episode_steps=30", "eval.last_evals=2", *overrides])
    config["data"] = dict(expert_data)
    return config


def table_quickstart(*overrides: str) -> dict[str, Any]:
    """configs/table_quickstart.yaml, tiny: 240 clinicians x 2 episodes, 20 steps, DP-FQE of 20 steps on 2 folds,
    at eps 4 (at eps 1 the tiny folds' noisy denominators fall below zero and no value is released to compare)."""
    return apply_overrides(load_yaml(ROOT / "configs/table_quickstart.yaml"), [
        "epsilon=4.0", "batch_size=16", "data.example.units=240", "data.example.episodes_per_unit=2",
        "dp.rows_per_unit=2", "algorithm.hidden_sizes=[8]", "trainer.max_steps=20",
        "trainer.eval_every=10", "trainer.log_every=5", "trainer.checkpoint_every=10", "trainer.progress=false",
        "eval.offline.folds=2", "eval.offline.fqe.steps=20", "eval.offline.fqe.sample_rate=0.2",
        "eval.offline.fqe.rows_per_unit=4", "eval.offline.fqe.fqe.target_update_every=5",
        "eval.offline.tolerance=1.0e+6", *overrides])  # tiny folds: the predicted noise would refuse the evaluation


def find_table_units() -> dict[str, str]:
    """A clinician of the tiny table in each cell of the quickstart's keyed-hash partition."""
    import pandas as pd

    from dporl.pipelines.inputs import ExampleTable
    from dporl.privacy.partition import UnitPartition
    from dporl.utils.config import from_dict

    config = table_quickstart()
    frame = from_dict(ExampleTable, config["data"]["example"]).frame()
    keys = [str(k) for k in pd.unique(frame["clinician"])]
    cells = UnitPartition(config["eval"]["offline"]["salt"], {"train": 0.5, "evaluate0": 0.25, "evaluate1": 0.25})
    where = cells.cell_of_keys(keys)
    return {name: keys[int(np.flatnonzero(where == i)[0])] for i, name in enumerate(cells.names)}


@pytest.fixture(scope="session")
def table_units() -> dict[str, str]:
    return find_table_units()


LONE_UNITS = 12  # a table this small has an evaluation cell of one clinician at some salt


def lone_table(salt: str = "dporl-holdout") -> dict[str, Any]:
    """The tiny table with 12 clinicians, DP-FQE on 2 folds, partition salt ``salt``, 2 clinicians per step, a
    fifth of epsilon on the count (at this seed D runs when the exact cell counts decide, and both sides refuse on
    the released count when it does)."""
    return table_quickstart(f"data.example.units={LONE_UNITS}", f"eval.offline.salt={salt}", "batch_size=2",
                            "count_fraction=0.2")


def find_lone_unit() -> tuple[str, str, str]:
    """(salt, cell, clinician): the first salt "lone-<i>" at which an evaluation cell of the 12-clinician table
    holds exactly one clinician (searched deterministically), that cell and that clinician."""
    import pandas as pd

    from dporl.pipelines.inputs import ExampleTable
    from dporl.privacy.partition import UnitPartition
    from dporl.utils.config import from_dict

    frame = from_dict(ExampleTable, lone_table()["data"]["example"]).frame()
    keys = [str(k) for k in pd.unique(frame["clinician"])]
    for i in range(1000):
        cells = UnitPartition(f"lone-{i}", {"train": 0.5, "evaluate0": 0.25, "evaluate1": 0.25})
        counts = np.bincount(cells.cell_of_keys(keys), minlength=3)
        lone = [c for c in (1, 2) if counts[c] == 1 and counts[0] >= 2]
        if lone:
            return f"lone-{i}", cells.names[lone[0]], keys[int(np.flatnonzero(cells.cell_of_keys(keys) == lone[0])[0])]
    raise AssertionError("no salt puts one clinician alone in an evaluation cell")


@pytest.fixture(scope="session")
def lone_unit() -> tuple[str, str, str]:
    return find_lone_unit()


def make_canary_table(directory: Path) -> Path:
    """The tiny table plus a canary clinician who once logged action 2 (the table's actions are 0 and 1)."""
    import pandas as pd

    from dporl.pipelines.inputs import ExampleTable
    from dporl.utils.config import from_dict

    frame = from_dict(ExampleTable, table_quickstart()["data"]["example"]).frame()
    canary = frame.loc[frame["episode"] == frame["episode"].iloc[0]].copy()
    canary["clinician"], canary["episode"] = "canary", "canary-0"
    canary.loc[canary.index[0], "action"] = 2
    path = directory / "table.csv"
    pd.concat([frame, canary], ignore_index=True).to_csv(path, index=False)
    return path


@pytest.fixture(scope="session")
def canary_table(tmp_path_factory) -> Path:
    return make_canary_table(tmp_path_factory.mktemp("canary"))


def fnq_line(method: str) -> dict[str, Any]:
    """configs/fnq_line_compare.yaml (its declared reward range [0, 0.5]), one method at eps 1, 256 samples."""
    config = apply_overrides(load_yaml(ROOT / "configs/fnq_line_compare.yaml"), [
        "epsilons=[1.0]", "seeds=[0]", "samples=256", "batch_size=32", "env_steps_per_update=4", "eval_episodes=2",
        "evaluations=2", "progress=false"])
    config["methods"] = [method]
    return config


def ope_chain(relation: str) -> dict[str, Any]:
    """configs/ope_chain_tiny.yaml at one m (30 trajectories), one trial, GPOPE hyper-parameters given."""
    return apply_overrides(load_yaml(ROOT / "configs/ope_chain_tiny.yaml"), [
        "m_values=[30]", "trials=1", f"gpope.relation={relation}", "gpope.step_size=0.1", "gpope.clip_norm=1.0",
        "gpope.epochs=2.0", "gpope.step_size_multipliers=[1.0]", "output_perturbation.lsl_lambda_scale=3.0",
        "progress=false"])


# ---------------------------------------------------------------------------------------------------- cases
COUNT_LEAK = ("the rate B / m, the calibrated sigma, the step count and every epsilon digit are computed from the "
              "exact number of units (no private unit count)")
TB_LEAK = "TensorBoard in release/ carries wall-clock times and host/pid file names"
FNQ_LEAK = ("a reward outside the declared reward_range stops D' with an error (D releases), and the returns table "
            "(computed from the protected rewards) is printed on stdout")


# case name -> (its neighbour pair, the leak it guards against)
PIPELINE_CASES: dict[str, tuple[Callable[..., NeighbourPair], str]] = {
    "train/mixed": (lambda f: NeighbourPair(quickstart(f["expert_data"]), unit=7), f"{COUNT_LEAK}; {TB_LEAK}"),
    "train/dp_sgd": (lambda f: NeighbourPair(quickstart(f["expert_data"], "method=dp_sgd"), unit=7),
                          f"{COUNT_LEAK}; {TB_LEAK}"),
    "train/dp_sgd replace-one": (
        lambda f: NeighbourPair(quickstart(f["expert_data"], "method=dp_sgd", "relation=replace_one"),
                                relation="replace", unit=7, donor=8),
        "under replace-one the number of units is public; every other difference must be the mechanisms'"),
    "train/stable_only": (lambda f: NeighbourPair(quickstart(f["expert_data"], "method=stable_only"), unit=7),
                               TB_LEAK),
    "quickstart via dporl train (subprocess)": (
        lambda f: NeighbourPair(quickstart(f["expert_data"]), unit=7, via="cli"), f"{COUNT_LEAK}; {TB_LEAK}"),
    "table: a training clinician removed": (
        lambda f: NeighbourPair(table_quickstart(), unit_key=f["table_units"]["train"]), f"{COUNT_LEAK}; {TB_LEAK}"),
    "table: a held-out clinician removed (DP-FQE)": (
        lambda f: NeighbourPair(table_quickstart(), unit_key=f["table_units"]["evaluate0"]),
        f"DP-FQE's fold normaliser divides by the fold's exact unit count; {TB_LEAK}"),
    "table: a held-out clinician removed (DP-WIS)": (
        lambda f: NeighbourPair(table_quickstart("eval.offline.estimator=wis"), unit_key=f["table_units"]["evaluate0"]),
        TB_LEAK),
    "table: a held-out clinician removed (DP-DR)": (
        lambda f: NeighbourPair(table_quickstart("eval.offline.estimator=dr"), unit_key=f["table_units"]["evaluate1"]),
        f"DP-DR's DP-FQE model normalises by the cell's exact unit count; {TB_LEAK}"),
    "table: the one clinician of an evaluation cell removed": (
        lambda f: NeighbourPair(lone_table(f["lone_unit"][0]), unit_key=f["lone_unit"][2]),
        "a cell without units was refused before the count (D ran and released, D' refused), on the exact number of "
        "units per cell"),
    "table: a canary clinician who logged action 2": (
        lambda f: NeighbourPair(_canary_config(f["canary_table"]), unit_key="canary"),
        "n_actions is read from the data (max action + 1): 3 actions with the canary, 2 without"),
    "Python API: DiscreteCQLConfig(...).create(data).fit()": (
        lambda f: NeighbourPair({"pipeline": "train", "data": table_quickstart()["data"]}, via="api",
                                unit_key=f["table_units"]["train"], api=API_SETTINGS),
        f"{COUNT_LEAK}; {TB_LEAK}"),
    "fnq/fnq": (lambda f: NeighbourPair(fnq_line("fnq"), relation="reward"), FNQ_LEAK),
    "fnq/input_perturbation": (lambda f: NeighbourPair(fnq_line("input_perturbation"), relation="reward"), FNQ_LEAK),
    "fnq/dp_sgd": (lambda f: NeighbourPair(fnq_line("dp_sgd"), relation="reward"), FNQ_LEAK),
    "ope/gpope add/remove": (lambda f: NeighbourPair(ope_chain("add_remove"), relation="remove", unit=4),
                             f"GPOPE's rate B / m, steps epochs * m / B and sigma come from the exact m; {TB_LEAK}"),
    "ope/gpope replace-one": (lambda f: NeighbourPair(ope_chain("replace_one"), relation="replace", unit=4, donor=5),
                              TB_LEAK),
}
def _with_algorithm(config: dict[str, Any], name: str) -> dict[str, Any]:
    """``config`` with registered algorithm ``name`` (its hidden sizes kept) and, for an algorithm without a discount
    of its own, the evaluation's discount the config's algorithm had."""
    from dporl.algos.registry import algorithm_config

    previous = algorithm_config(config["algorithm"])
    config = {**config, "algorithm": {"name": name, "hidden_sizes": previous.hidden_sizes}}
    if algorithm_config(config["algorithm"]).discount() is None and previous.discount() is not None:
        config["eval"] = {**config.get("eval", {}), "gamma": previous.discount()}
    return config


# Every other registered algorithm through the same two neighbour constructions: expert-level DP-SGD on the
# quickstart's experts, and unit-level DP-SGD with the private evaluation on the table.
for _name in [name for name in registry_names() if name != "cql"]:
    PIPELINE_CASES[f"train/dp_sgd, algorithm {_name}"] = (
        lambda f, n=_name: NeighbourPair(_with_algorithm(quickstart(f["expert_data"], "method=dp_sgd"), n), unit=7),
        f"{COUNT_LEAK}; {TB_LEAK}")
    PIPELINE_CASES[f"table, algorithm {_name}: a training clinician removed"] = (
        lambda f, n=_name: NeighbourPair(_with_algorithm(table_quickstart(), n), unit_key=f["table_units"]["train"]),
        f"{COUNT_LEAK}; {TB_LEAK}")

API_SETTINGS = {"epsilon": 4.0, "steps": 20, "hidden_sizes": [8], "batch_size": 16, "rows_per_unit": 2,
                "gamma": 0.95, "evaluation": {"folds": 2, "unit_clip": 5.0, "value_range": [-2.0, 1.0],
                                              "tolerance": 1e6,  # tiny folds: the noise check would refuse
                                              "fqe": {"steps": 20, "sample_rate": 0.2, "rows_per_unit": 4}}}


def _canary_config(path: Path) -> dict[str, Any]:
    """The tiny table with the canary, its action set left undeclared (a private run must not read it from the rows:
    refused alike on both sides, or the same declared set on both)."""
    config = table_quickstart("eval.offline.estimator=none")
    columns = {k: v for k, v in config["data"]["columns"].items() if k not in ("actions", "n_actions")}
    config["data"] = {"format": "table", "path": str(path), "columns": columns}
    return config


@pytest.fixture
def fixtures(request) -> dict[str, Any]:
    """Session fixtures by name, built only when a case asks for them."""

    class Lazy(dict):
        def __missing__(self, name):
            value = request.getfixturevalue(name)
            self[name] = value
            return value

    return Lazy()


@pytest.mark.parametrize("case", list(PIPELINE_CASES))
def test_every_released_difference_is_accounted(case, fixtures, tmp_path):
    pair = PIPELINE_CASES[case][0](fixtures)
    check = check_pair(pair, tmp_path, noise_seed=SEED)
    d, dp = check.sides["D"].snapshot, check.sides["D'"].snapshot
    # Not vacuous: the two sides' inputs differ, and D released files (or both refused alike, before releasing
    # anything: a refusal that names a public field, not the unit). A release may legitimately not move at all:
    # GPOPE's release/ holds no estimate, and a held-out unit whose importance weights are 0 adds nothing to DP-WIS.
    inputs = {side: {p.relative_to(run.run_dir.parent): p.read_bytes() for p in
                     sorted((run.run_dir.parent / "data").rglob("*")) if p.is_file()}
              for side, run in check.sides.items()}
    assert inputs["D"] != inputs["D'"] or not inputs["D"], "D' was not built: its inputs equal D's"
    # Both refused: alike, or on the released count (the outcome's difference is then an accounted one, below).
    refused_alike = d["outcome"]["status"] != "ok" and dp["outcome"]["status"] != "ok"
    assert refused_alike or (d["outcome"]["status"] == "ok" and d["files"]), (d["outcome"], dp["outcome"])
    assert check.classified.clean, check.describe()


# Noise seeds at which the lone clinician's pair ends one way or the other (the cell's released counts are one apart).
LONE_OUTCOMES = {0: ("ok", "refused"), 1: ("ok", "ok")}


@pytest.mark.parametrize("seed", sorted(LONE_OUTCOMES))
def test_a_lone_clinicians_cell_is_accounted_whether_its_released_count_stops_a_side_or_not(seed, lone_unit, tmp_path):
    """D runs and D' stops on its released count (seed 0), or both run, D' over a cell of no units (seed 1): either
    way every released difference is accounted; the first only through the count refusal's gate."""
    salt, _, clinician = lone_unit
    check = check_pair(NeighbourPair(lone_table(salt), unit_key=clinician), tmp_path, noise_seed=seed)
    outcomes = tuple("ok" if check.sides[side].snapshot["outcome"]["status"] == "ok" else "refused"
                     for side in ("D", "D'"))
    assert outcomes == LONE_OUTCOMES[seed]
    assert check.classified.clean, check.describe()
    d, dp = check.sides["D"].snapshot, check.sides["D'"].snapshot
    ungated = [replace(entry, gate=False) for entry in ENTRIES]
    gated_only = classify(compare(d, dp), check.classified.keys, d, dp, ungated)
    assert gated_only.clean == (outcomes == ("ok", "ok")), gated_only.describe()


def test_the_held_out_cases_remove_held_out_clinicians(table_units):
    """DP-WIS holds out one cell "evaluate", DP-FQE "evaluate0" and "evaluate1", DP-DR "model" and "estimate", all
    at the same keyed hash: the clinicians the held-out cases remove are held out (not trained on) by each."""
    from dporl.privacy.partition import UnitPartition

    salt = table_quickstart()["eval"]["offline"]["salt"]
    assert len(set(table_units.values())) == 3
    for cells, key, cell in (({"train": 0.5, "evaluate": 0.5}, table_units["evaluate0"], "evaluate"),
                             ({"train": 0.5, "model": 0.25, "estimate": 0.25}, table_units["evaluate1"], "estimate"),
                             ({"train": 0.5, "evaluate0": 0.25, "evaluate1": 0.25}, table_units["train"], "train")):
        partition = UnitPartition(salt, cells)
        assert partition.names[int(partition.cell_of_keys([key])[0])] == cell


# ---------------------------------------------------------------------------------------------------- mechanisms
def _chain_data(n: int = 30):
    from dporl.eval.ope_problems import ChainSettings, chain_problem, padded_data

    problem = chain_problem(ChainSettings(n_states=8), 0.99)
    dataset = problem.sample(n, torch.Generator().manual_seed(3))
    return problem, dataset, padded_data


def _output_perturbation(method: str, dataset, problem, padded_data, seed: int) -> dict[str, Any]:
    from dporl.algos.dp_lsw_lsl import dp_lsl, dp_lsw, first_visit_returns
    from dporl.privacy.randomness import SecretRoot

    visits = first_visit_returns(padded_data(dataset), problem.n_states, 0.99, 1.0)
    noise = SecretRoot(seed).noise(f"{method}/noise")
    if method == "dp_lsw":
        release = dp_lsw(visits, problem.feature_matrix, epsilon=1.0, delta=1e-5, return_bound=1.0, noise=noise,
                         weights=problem.lsw_weights)
    else:
        release = dp_lsl(visits, problem.feature_matrix, epsilon=1.0, delta=1e-5, return_bound=1.0,
                         lam=3.0 * np.sqrt(visits.n_trajectories), noise=noise)
    # What the mechanism releases: theta and its (eps, delta) event (sigma and psi are curator-only diagnostics).
    return {"theta": release.theta, "epsilon": release.epsilon, "delta": release.delta, "unit": release.unit,
            "analysis": release.analysis}


@pytest.mark.parametrize("method", ["dp_lsw", "dp_lsl"])
def test_output_perturbation_releases_only_theta_on_replace_one_neighbours(method):
    from dporl.audit.neighbours import episode_replaced

    problem, dataset, padded_data = _chain_data()
    neighbour = episode_replaced(dataset, 4, 5)
    d = snapshot_of(_output_perturbation(method, dataset, problem, padded_data, SEED))
    dp = snapshot_of(_output_perturbation(method, neighbour, problem, padded_data, SEED))
    differences = compare(d, dp)
    classified = classify(differences, (f"ope/{method}",), d, dp)
    assert [x.field for x in differences] == ["theta"]
    assert classified.clean, classified.describe()


def _importance_sampling(dataset, seed: int) -> dict[str, Any]:
    from dporl.eval.private_ope import dp_importance_sampling
    from dporl.privacy.ledger import PrivacyLedger
    from dporl.privacy.randomness import SecretRoot

    def target(obs: torch.Tensor) -> torch.Tensor:
        """Treat (action 1) at every one-hot state (and padding); uniform where the observation is not one-hot."""
        odd = obs.abs().sum(1, keepdim=True) > 1.5
        treat = torch.tensor([[0.0, 1.0]], dtype=torch.float64)
        return torch.where(odd, torch.full_like(treat, 0.5), treat).expand(obs.shape[0], 2)

    result = dp_importance_sampling(dataset, target, epsilon=4.0, delta=1e-5, ledger=PrivacyLedger(),
                                    root=SecretRoot(seed), unit_clip=5.0, kind="wis", gamma=0.95,
                                    value_range=(-2.0, 1.0))
    return result.to_dict()


def test_dp_importance_sampling_flags_do_not_depend_on_one_unit(tmp_path):
    from dporl.audit.neighbours import without_unit
    from dporl.pipelines.inputs import DataConfig, import_dataset
    from dporl.utils.config import from_dict

    dataset, _ = import_dataset(from_dict(DataConfig, table_quickstart()["data"]), progress=False)  # as runs do
    observations = np.array(dataset.observations)
    # The canary (unit 0): its first episode's observations are no one-hot states (the target is uniform there, so
    # the canary's weight is positive and its removal moves the estimate).
    observations[: int(dataset.episode_lengths[0]) + 1] = 0.5
    dataset = dataset.replace(observations=observations)
    canary = int(dataset.unit_ids[0])
    d = snapshot_of(_importance_sampling(dataset, SEED))
    dp = snapshot_of(_importance_sampling(without_unit(dataset, canary), SEED))
    differences = compare(d, dp)
    assert {x.field for x in differences} & {"value", "ci_low", "ci_high"}  # the estimate moved: not vacuous
    classified = classify(differences, ("offline/wis",), d, dp)
    assert classified.clean, classified.describe()


# ---------------------------------------------------------------------------------------------------- registry
def test_registry_lists_each_entry_once_with_its_mechanism_and_reason():
    seen = set()
    for entry in ENTRIES:
        key = (entry.pipelines, entry.files, entry.fields, entry.value, entry.stage)
        assert key not in seen, key
        seen.add(key)
        assert entry.mechanism and entry.why and entry.pipelines
        assert set(entry.needs) <= {"count", "failed"}
    table = registry_table()
    assert table.count("\n") == len(ENTRIES) + 1 and "unit_count" in table


def _difference(location: str, field: str, a: Any, b: Any):
    from dporl.audit.release_snapshot import Difference

    return Difference(location, field, a, b)


def _report(stages: list[str], notes: tuple[str, ...] = (), relation: str = "add/remove one unit") -> dict:
    fields = {f"stages[{i}].name": name for i, name in enumerate(stages)}
    fields.update({f"notes{{{note}}}": "present" for note in notes})
    fields["guarantee.relation"] = relation
    return {"release/privacy_report.json": fields}


@pytest.mark.parametrize("report, accounted", [
    (_report(["train"]), False),  # the exact count feeds the rate: never accounted
    (_report(["unit_count", "train"]), True),  # a private count stage: what is derived from it is accounted
    (_report(["unit_count", "train"], ("assumes: the number of units in the training data is public",)), False),
    (_report(["train"], relation="replace one unit"), True),  # replace-one: m is public by the relation
])
def test_count_derived_fields_are_accounted_only_when_the_count_is(report, accounted):
    rate = _difference("release/privacy_report.json", "stages[1].events[0][0].sample_rate", 0.256, 0.25625625)
    digits = _difference("stdout", "line[3]", "GUARANTEE: (9.993, 1e-05)-DP", "GUARANTEE: (9.994, 1e-05)-DP")
    words = _difference("stdout", "line[3]", "GUARANTEE: (9.993, 1e-05)-DP", "GUARANTEE: (9.993, 1e-05)-DP; 999")
    classified = classify([rate, digits, words], ("train/dp_sgd",), report, report)
    assert [d for d, _ in classified.accounted] == ([rate, digits] if accounted else [])
    assert words in classified.unaccounted  # more than digits changed: never a function of the count alone


def test_fields_of_the_count_stage_are_accounted_by_stage_name():
    report = _report(["unit_count", "train"])
    estimate = _difference("release/privacy_report.json", "stages[0].released", 998.3, 997.1)
    other = _difference("release/privacy_report.json", "stages[1].released", 998.3, 997.1)
    classified = classify([estimate, other], ("train/mixed",), report, report)
    assert [d for d, _ in classified.accounted] == [estimate] and classified.unaccounted == [other]


def test_notes_are_compared_as_sets_and_only_noisy_ones_are_accounted():
    d = snapshot_of({"value": 0.5, "notes": ["noisy denominator 0.3 is below 10 noise std (1.2): interval = public "
                                             "range", "the target policy is deterministic"]})
    dp = snapshot_of({"value": 0.5, "notes": ["the target policy is deterministic"]})
    (difference,) = compare(d, dp)
    assert difference.field.startswith("notes{noisy denominator")
    assert classify([difference], ("offline/wis",), d, dp).clean
    flag = compare(snapshot_of({"notes": ["the target policy is deterministic"]}), snapshot_of({"notes": ["x"]}))
    assert not classify(flag, ("offline/wis",), d, dp).accounted


# ---------------------------------------------------------------------------------------------------- audit power
def test_the_audit_names_an_unaccounted_count_printed_by_a_broken_variant(expert_data, tmp_path):
    """Power: the stable-prefix pipeline plus one printed line, the exact number of experts it read. The diff
    names that line as a distinguisher (eps_lb = inf), whatever else the release holds."""
    pair = NeighbourPair(quickstart(expert_data, "method=stable_only"), unit=7)
    result = audit_pair(pair, tmp_path / "leak", trials=0, seed=SEED, leak=True)
    leaked = [d for d in result.unaccounted if d.location == "stdout" and "units in the data" in str(d.value_d)]
    assert leaked and (leaked[0].value_d, leaked[0].value_dp) == ("units in the data: 512",
                                                                  "units in the data: 511")
    assert result.epsilon_lower_bound == float("inf") and result.violated
    assert "units in the data: 512" in result.describe()


def test_a_registry_without_the_weights_entry_reports_the_weights(expert_data, tmp_path):
    """Power of the registry check: remove the entries of the stable-prefix policy weights and the weights, which
    differ between D and D' (they are trained on D_stable), become unaccounted."""
    pair = NeighbourPair(quickstart(expert_data, "method=stable_only"), unit=7)
    full = check_pair(pair, tmp_path / "full", noise_seed=SEED)
    broken = tuple(e for e in ENTRIES if not e.files.endswith(("weights.pt", "torchscript.pt")))
    weights = [d for d, _ in full.classified.accounted if d.location.endswith("weights.pt")]
    assert weights  # accounted with the full registry
    reclassified = classify(full.differences, ("train/stable_only",), full.sides["D"].snapshot,
                            full.sides["D'"].snapshot, broken)
    assert set(map(id, weights)) <= set(map(id, reclassified.unaccounted))


def test_audit_bounds_the_accounted_scalars_over_fresh_seeds(expert_data, tmp_path):
    """The statistical half: fresh noise seeds per run, a bound per accounted scalar field that differed (the size
    of D_stable, the returns), none above the claimed epsilon with 8 trials (log(4 / 3.7) ~ 0.08 at most)."""
    pair = NeighbourPair(quickstart(expert_data, "method=stable_only", "release.trajectories=3",
                                    "trainer.max_steps=5", "trainer.eval_every=5"), unit=7)
    result = audit_pair(pair, tmp_path, trials=8, seed=SEED, max_fields=3)
    assert result.bounds and result.trials == 8
    assert all(0.0 <= b.bound.epsilon <= result.claimed_epsilon for b in result.bounds)
    assert result.claimed_epsilon == pytest.approx(10.0, rel=0.01)
    payload = result.to_dict()
    assert payload["field_bounds"] and payload["claimed_epsilon"] == result.claimed_epsilon
    assert not list((tmp_path / "D").glob("trial*"))  # trial runs are removed once read


def test_reward_shift_reaches_training_and_evaluation_environments():
    import gymnasium as gym

    import dporl.envs  # noqa: F401
    from dporl.audit.neighbour_runs import shifted_rewards

    def first_reward(env):
        env.reset(seed=0)
        reward = env.step(np.zeros(env.num_envs, dtype=np.int64) if hasattr(env, "num_envs") else 0)[1]
        env.close()
        return np.asarray(reward, dtype=float)

    base = first_reward(gym.make("dporl/Line1D-v0"))
    with shifted_rewards("dporl/Line1D-v0", 1.0):
        shifted = first_reward(gym.make("dporl/Line1D-v0"))
        vector = first_reward(gym.make_vec("dporl/Line1D-v0", num_envs=2, vectorization_mode="sync"))
        other = first_reward(gym.make("CartPole-v1"))
    assert shifted == pytest.approx(base + 1.0) and np.all(vector >= 1.0) and other == pytest.approx(1.0)
    assert gym.make.__name__ == "make"  # restored


def test_neighbour_datasets_differ_by_exactly_one_unit(expert_data):
    from dporl.audit.neighbours import replace_unit, with_reward_changed, without_unit
    from dporl.data.dataset import TrajectoryDataset

    data = TrajectoryDataset.load(expert_data["path"])
    smaller = without_unit(data, 7)
    assert smaller.n_units == data.n_units - 1 and smaller.n_episodes == data.n_episodes - 1
    kept = data.subset(np.flatnonzero(data.unit_ids != 7))
    assert np.array_equal(smaller.observations, kept.observations)
    assert np.array_equal(smaller.unit_ids, np.where(kept.unit_ids > 7, kept.unit_ids - 1, kept.unit_ids))
    replaced = replace_unit(data, 7, 8)
    assert replaced.n_units == data.n_units and np.array_equal(replaced.unit_ids[-1:], [7])
    changed = with_reward_changed(data, 3, 1.0)
    assert np.flatnonzero(changed.rewards != data.rewards).tolist() == [3]
    assert changed.rewards[3] == data.rewards[3] + 1
    with pytest.raises(Exception, match="at most 1"):
        with_reward_changed(data, 3, 2.0)


def test_audit_cli_runs_the_neighbour_audit_and_names_the_leak(expert_data, tmp_path, capsys):
    """``python -m dporl.audit --neighbours CONFIG --power``: the quickstart's pipeline (stable_only, tiny) on D and
    D minus expert 7; the power variant's printed unit count is named and the claim is reported violated (exit 1)."""
    import json

    import yaml

    from dporl.audit.__main__ import main

    config = tmp_path / "quickstart.yaml"
    config.write_text(yaml.safe_dump(quickstart(expert_data, "method=stable_only")))
    out = tmp_path / "audit.json"
    code = main(["--neighbours", str(config), "--unit", "7", "--trials", "0", "--power", "--no-progress",
                 "--work", str(tmp_path / "work"), "--out", str(out)])
    text = capsys.readouterr().out
    assert code == 1 and "eps_lb = inf" in text and "units in the data: 512" in text
    (result,) = json.loads(out.read_text())["results"]
    assert result["violated"] and any(d["value_d"] == "units in the data: 512" for d in result["unaccounted"])
    assert result["claimed_epsilon"] == pytest.approx(10.0, rel=0.01)


def test_audit_cli_refuses_a_relation_the_pipeline_does_not_protect(expert_data, tmp_path, capsys):
    import yaml

    from dporl.audit.__main__ import main

    config = tmp_path / "quickstart.yaml"
    config.write_text(yaml.safe_dump(quickstart(expert_data)))
    code = main(["--neighbours", str(config), "--relation", "reward", "--trials", "0", "--no-progress",
                 "--work", str(tmp_path / "work")])
    assert code == 2 and "relation" in capsys.readouterr().err


def test_audit_cli_prints_the_registry(capsys):
    from dporl.audit.__main__ import main

    assert main(["--accounted"]) == 0
    text = capsys.readouterr().out
    assert text.count("\n") == len(ENTRIES) + 2 and "stage 'unit_count'" in text
