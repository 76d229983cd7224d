"""The relation printed is the relation that holds: the number of units is released by a private count (add/remove)
or public by definition (replace-one), and nothing a run releases depends on the exact count otherwise.

The neighbour tests run D and D minus one unit with the same noise seed, with the count's draw fixed so that the
released estimate m~ is the same on both sides (injected where the mechanism draws it): every field derived from
the number of units (the sampling rate, sigma, the step count, the epsilon digits, the count itself) must then be
byte-identical in release/privacy_report.json, summary.json and policy/policy.json.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import dporl
import dporl.privacy.count as count_module
from dporl.cli import main
from dporl.data.dataset import TrajectoryDataset
from dporl.experts.expert_set import ExpertSet
from dporl.pipelines.train import run
from dporl.privacy.count import (
    COUNT_STAGE,
    CountPlan,
    ReleasedCount,
    Units,
    release_count,
    tail_margin,
)
from dporl.privacy.events import PoissonGaussianEvent, ReplaceOneEvent, event_from_dict
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.partition import UnitPartition
from dporl.privacy.randomness import SecretRoot
from dporl.privacy.relations import REPLACE_ONE, epsilon_for_relation
from dporl.utils.validation import PrivacyBudgetError, ValidationError

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_expert_cql import M, config, log_lqr_experts  # noqa: E402

COLUMNS = dict(episode="episode", unit="clinician", observations="obs_", action="action", reward="reward",
               terminated="terminated", truncated="truncated", next_observations="next_obs_", actions=2)
torch.set_num_threads(1)


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    return log_lqr_experts(tmp_path_factory.mktemp("logged"), {"data.npz": 0})


@pytest.fixture(scope="module")
def without_one(logged):
    """D' = D minus expert 7 (its policy and its episodes), saved beside D."""
    from dporl.audit.stable_prefix_audit import neighbours_of

    pair = neighbours_of(TrajectoryDataset.load(logged / "data.npz"), ExpertSet.load(logged / "experts.pt"), 7)
    pair.experts_without.save(logged / "experts_without.pt")
    pair.data_without.save(logged / "data_without.npz")
    return logged


def inject(monkeypatch, draws: list[int]) -> None:
    """The count's discrete Laplace draws, in the order the mechanism takes them (one per cell)."""
    queue = list(draws)
    monkeypatch.setattr(count_module, "sample_discrete_laplace", lambda scale, rng: queue.pop(0))


def released(run_dir: Path) -> dict:
    """Everything a run released that depends on the number of units, as bytes-comparable JSON."""
    report = (run_dir / "release" / "privacy_report.json").read_bytes()
    summary = json.loads((run_dir / "release" / "summary.json").read_text())
    policy = json.loads((run_dir / "release" / "policy" / "policy.json").read_text())
    derived = {key: summary[key] for key in ("noise_multiplier", "steps", "privacy", "unit_count", "budget")}
    return {"privacy_report.json": report, "summary.json": json.dumps(derived, sort_keys=True),
            "policy.json": json.dumps(policy["privacy"], sort_keys=True)}


# ---------------------------------------------------------------------------------------------------- neighbours
@pytest.mark.parametrize("method", ["dp_sgd", "mixed"])
def test_expert_cql_d_and_d_minus_one_expert_release_the_same_count_derived_fields(
        without_one, tmp_path, monkeypatch, method):
    sides = {}
    for name, data, experts, draw in (("D", "data.npz", "experts.pt", 0),
                                      ("D'", "data_without.npz", "experts_without.pt", 1)):
        inject(monkeypatch, [draw])  # m~ = M on both sides
        overrides = {"dp.noise_multiplier": None, "data": {"dataset": str(without_one / data),
                                                           "expert_set": str(without_one / experts)}}
        summary = run(config(without_one, tmp_path / name, method=method, **overrides))
        assert summary["unit_count"]["count"] == M
        sides[name] = released(tmp_path / name / "run")
    assert sides["D"] == sides["D'"]
    report = json.loads(sides["D"]["privacy_report.json"])
    (event, _), = report["stages"][-1]["events"]
    rate = event["sample_rate"] if method == "dp_sgd" else event["event"]["sample_rate"]
    assert rate == 16 / M and "assumes" not in report["text"] and not report["notes"]


@pytest.fixture(scope="module")
def tables(tmp_path_factory):
    """A 600-clinician treatment-chain CSV and the same without one clinician."""
    root = tmp_path_factory.mktemp("tables")
    assert main(["data", "example", "treatment_chain", str(root / "d.csv"), "--units", "600", "--seed", "3"]) == 0
    frame = pd.read_csv(root / "d.csv")
    removed = str(frame["clinician"].iloc[0])
    frame[frame["clinician"].astype(str) != removed].to_csv(root / "d_minus.csv", index=False)
    return root, removed


def _removed_cell_draws(partition: dict, removed: str) -> list[int]:
    """One draw per cell: +1 in the cell of the removed unit (its count is one lower in D'), 0 elsewhere."""
    cells = UnitPartition.from_dict(partition)
    draws = [0] * len(cells.names)
    draws[int(cells.cell_of_keys([removed])[0])] = 1
    return draws


def test_the_table_pipeline_releases_the_same_count_derived_fields_without_one_clinician(
        tables, tmp_path, monkeypatch):
    import yaml

    root, removed = tables
    spec = yaml.safe_load((Path(__file__).resolve().parents[1] / "configs" / "table_quickstart.yaml").read_text())
    del spec["data"]["example"]
    spec.update(noise_seed=5, batch_size=32)
    spec["algorithm"]["hidden_sizes"] = [16]
    spec["trainer"].update(max_steps=20, eval_every=20, checkpoint_every=20, progress=False)
    spec["eval"]["offline"].update(fqe={"steps": 20}, tolerance=1e6)  # tiny folds: the noise check would refuse
    sides, partition = {}, None
    for name, csv in (("D", "d.csv"), ("D'", "d_minus.csv")):
        inject(monkeypatch, [0] * 4 if partition is None else _removed_cell_draws(partition, removed))
        spec.update(run_dir=str(tmp_path / name))
        spec["data"]["path"] = str(root / csv)
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump(spec))
        assert main(["train", "--config", str(tmp_path / f"{name}.yaml")]) == 0
        sides[name] = released(tmp_path / name)
        partition = json.loads(sides[name]["privacy_report.json"])["partition"]
    assert sides["D"] == sides["D'"]
    count = json.loads(sides["D"]["privacy_report.json"])["stages"][0]
    assert count["name"] == COUNT_STAGE and set(count["released"]["cells"]) == {"train", "evaluate0", "evaluate1",
                                                                                 "evaluate2"}


def test_the_python_api_releases_the_same_count_derived_fields_without_one_unit(tables, tmp_path, monkeypatch):
    root, removed = tables
    settings = dict(epsilon=1.0, steps=20, hidden_sizes=[16], batch_size=32, noise_seed=4, progress=False,
                    evaluation=dporl.pipelines.offline_eval.OfflineEvalConfig(
                        value_range=(-2.0, 1.0), unit_clip=5.0, tolerance=1e6,
                        fqe=dporl.FQETraining(steps=20, fqe=dporl.algos.fqe.FQEConfig(hidden_sizes=[]))))
    sides, partition = {}, None
    for name, csv in (("D", "d.csv"), ("D'", "d_minus.csv")):
        inject(monkeypatch, [0] * 4 if partition is None else _removed_cell_draws(partition, removed))
        data = dporl.read_table(root / csv, **COLUMNS)
        result = dporl.DiscreteCQLConfig(**settings).create(data).fit(run_dir=tmp_path / name)
        sides[name] = released(tmp_path / name)
        partition = result.summary["privacy"]["partition"]
    assert sides["D"] == sides["D'"]


# ---------------------------------------------------------------------------------------------------- the mechanism
def test_the_count_is_discrete_laplace_with_scale_one_over_epsilon():
    """4000 cells of one histogram (independent draws) at eps = 0.5: mean, variance and tails as the two-sided
    geometric distribution says, p = e^-eps: Var Z = 2p / (1 - p)^2, P[Z > t] = p^(t+1) / (1 + p)."""
    epsilon, n = 0.5, 4000
    names = tuple(f"c{i}" for i in range(n))
    ledger = PrivacyLedger()
    ledger.partition(UnitPartition("s", list(names)))
    exact = {name: 1000 for name in names}
    out = release_count(CountPlan(epsilon, names), exact, ledger=ledger, root=SecretRoot(2024), unit="expert")
    z = np.array([out.counts[name] - 1000 for name in names], dtype=float)
    assert np.all(z == np.round(z))  # integers: no floating-point low bits
    p = math.exp(-epsilon)
    variance = 2 * p / (1 - p) ** 2  # 7.70 here; 2 / eps^2 = 8 in the continuous limit
    # mean: 5 standard errors; variance: the sample variance's std is about sqrt((kurtosis - 1) / n) var, the
    # discrete Laplace's kurtosis about 6 -> ~3.5% of var: 5 of those.
    assert abs(z.mean()) < 5 * math.sqrt(variance / n)
    assert abs(z.var() / variance - 1) < 5 * math.sqrt(5 / n)
    for t in (0, 2, 5):
        tail = p ** (t + 1) / (1 + p)
        assert abs(np.mean(z > t) - tail) < 5 * math.sqrt(tail * (1 - tail) / n)
    # the ledger charged one pure eps = 0.5 event for every unit (one stage over all cells)
    (stage,) = ledger.report().stages
    assert stage.epsilon == pytest.approx(0.5) and stage.delta == 0 and stage.cells is None


def test_the_lower_bound_holds_with_its_failure_probability():
    for epsilon, failure in ((0.1, 5e-8), (0.5, 1e-3), (2.0, 0.2)):
        t = tail_margin(epsilon, failure)
        p = math.exp(-epsilon)
        assert p ** (t + 1) / (1 + p) <= failure < p ** t / (1 + p)  # the smallest integer margin
    count = ReleasedCount({"all": 1000}, 0.1, 5e-8)
    assert count.lower_bound() == 1000 - tail_margin(0.1, 5e-8)
    assert count.units().lower == count.lower_bound() and count.units().released


def test_the_stable_prefix_precondition_is_checked_on_the_released_lower_bound(logged):
    from dporl.algos.stable_prefix import StablePrefixConfig, check_precondition, plan_release

    data, experts = TrajectoryDataset.load(logged / "data.npz"), ExpertSet.load(logged / "experts.pt")
    plan = plan_release(data, experts, epsilon=5.0, delta=5e-6, config=StablePrefixConfig(trajectories=5),
                        defer_precondition=True)
    floor = math.ceil(plan.budget.g0 / plan.p_min) + 1  # the precondition needs lower - 1 >= G0 / p_min
    check_precondition(plan, Units({"all": 2000.0}, floor, released=True, epsilon=0.1, failure=5e-8))
    with pytest.raises(PrivacyBudgetError) as info:
        check_precondition(plan, Units({"all": 2000.0}, floor - 1, released=True, epsilon=0.1, failure=5e-8))
    assert info.value.field == "p_min" and "lower confidence bound of the released count" in str(info.value)
    assert "m~ = 2000" in str(info.value)
    assert "a larger count_fraction" in str(info.value) and "here 0.1" in str(info.value)  # the way out it names
    with pytest.raises(PrivacyBudgetError) as public:  # a public count has no bound to tighten
        check_precondition(plan, Units({"all": float(floor - 2)}, floor - 2, released=False))
    assert "count_fraction" not in str(public.value)


# ---------------------------------------------------------------------------------------------------- once per run
def test_the_count_is_charged_once_journaled_and_reused_on_resume(logged, tmp_path, monkeypatch):
    import dporl.pipelines.train.runners as pipeline

    cfg = config(logged, tmp_path, method="dp_sgd")
    original = pipeline.after_count

    def killed(*args, **kwargs):  # after the count was charged and recorded, before training
        raise RuntimeError("killed")

    monkeypatch.setattr(pipeline, "after_count", killed)
    with pytest.raises(RuntimeError):
        run(cfg)
    journal = json.loads((tmp_path / "run" / "curator" / "journal.json").read_text())
    (stage,) = journal["ledger"]["stages"]
    assert stage["name"] == COUNT_STAGE and stage["accountant"]["history"] == [
        [{"type": "ApproxDPEvent", "epsilon": 0.5, "delta": 0.0, "replace_one": False}, 1]]
    first = journal["completed"][COUNT_STAGE]["released"]["count"]
    monkeypatch.setattr(pipeline, "after_count", original)
    inject(monkeypatch, [1000])  # a second draw would be far off: the resumed run must not draw
    summary = run(cfg, mode="resume")
    count = {s["name"]: s for s in summary["privacy"]["stages"]}[COUNT_STAGE]
    assert count["released"]["count"] == first and count["events"] == [[stage["accountant"]["history"][0][0], 1]]


def test_a_count_charged_but_never_recorded_is_not_drawn_again(logged, tmp_path, monkeypatch):
    from dporl.train.run_dir import RunDirectory

    cfg = config(logged, tmp_path, method="dp_sgd")
    complete = RunDirectory.complete

    def killed(self, name, manifest):
        if name == COUNT_STAGE:
            raise RuntimeError("killed between the draw and its record")
        return complete(self, name, manifest)

    monkeypatch.setattr(RunDirectory, "complete", killed)
    with pytest.raises(RuntimeError):
        run(cfg)
    monkeypatch.setattr(RunDirectory, "complete", complete)
    with pytest.raises(PrivacyBudgetError) as info:
        run(cfg, mode="resume")
    assert info.value.field == "count" and "earlier attempt" in str(info.value)


# ---------------------------------------------------------------------------------------------------- replace-one
def _unwrapped(report: dict) -> list:
    events = []
    for stage in report["stages"]:
        for event, count in stage["events"]:
            event = event_from_dict(event)
            assert isinstance(event, ReplaceOneEvent)  # every event recorded for replace-one neighbours
            events.append((event.event, count))
    return events


def test_replace_one_runs_print_that_relation_and_its_analysis(logged, tmp_path, capsys):
    import dp_accounting
    from dp_accounting.pld import privacy_loss_distribution as plds

    # eps 2: the replace-one PLD (discretised at 1e-4) of a wide Gaussian is slow to calibrate at small sigma
    summary = run(config(logged, tmp_path / "dp", method="dp_sgd", relation="replace_one", epsilon=2.0,
                         **{"dp.noise_multiplier": None}))
    report = summary["privacy"]
    assert [s["name"] for s in report["stages"]] == ["train"] and summary["unit_count"] is None  # no count stage
    words = "replace one unit's data; the number of units is public"
    assert words in report["guarantee"]["neighbouring"] and words in capsys.readouterr().out
    events = _unwrapped(report)
    (event, steps), = events
    assert event == PoissonGaussianEvent(summary["noise_multiplier"], 16 / M)  # the public m: rate B / m
    epsilon = report["guarantee"]["epsilon"]
    assert epsilon == pytest.approx(epsilon_for_relation(events, 1e-5, REPLACE_ONE), rel=1e-12)
    direct = plds.from_gaussian_mechanism(
        event.noise_multiplier, sampling_prob=event.sample_rate, value_discretization_interval=1e-4,
        neighboring_relation=dp_accounting.NeighboringRelation.REPLACE_ONE).self_compose(steps)
    assert epsilon == pytest.approx(direct.get_epsilon_for_delta(1e-5), rel=1e-9)
    assert 0.99 * 2 <= epsilon <= 2 * (1 + 1e-12)  # calibrated by the same analysis: the budget is used

    mixed = run(config(logged, tmp_path / "mixed", relation="replace_one", **{"dp.noise_multiplier": 2.0}))
    report = mixed["privacy"]
    assert [s["name"] for s in report["stages"]] == ["release", "train"]
    assert words in report["guarantee"]["neighbouring"]
    (release_event, runs), = report["stages"][0]["events"]
    beta = mixed["release"]["beta"]  # (2 eps', beta) per run, by group privacy: (4 eps', (1 + e^{2 eps'}) beta)
    assert event_from_dict(release_event).event.delta == beta
    assert runs * (1 + math.exp(2 * mixed["release"]["epsilon_prime"])) * beta == pytest.approx(report["stages"][0]
                                                                                                  ["delta"] / 2)
    joint = epsilon_for_relation(_unwrapped(report), report["joint_pld"][1], REPLACE_ONE, mechanism="pld")
    assert report["joint_pld"][0] == pytest.approx(joint, rel=1e-12)


def test_a_replace_one_ledger_refuses_add_remove_events():
    ledger = PrivacyLedger(relation=REPLACE_ONE)
    ledger.stage("s", mechanism="pld", delta=1e-5)
    with pytest.raises(ValidationError, match="replace-one"):
        ledger.record("s", PoissonGaussianEvent(1.0, 0.1))
    ledger.record("s", ReplaceOneEvent(PoissonGaussianEvent(1.0, 0.1)))
    restored = PrivacyLedger()
    restored.load_state_dict(ledger.state_dict())
    assert restored.relation == REPLACE_ONE and "replace one unit's data" in restored.report().describe()


# ---------------------------------------------------------------------------------------------------- delta vs 1/n
def test_delta_at_least_one_over_n_is_refused_by_name(logged, tmp_path):
    with pytest.raises(ValidationError) as info:  # replace-one: n = the public m, before anything is written
        run(config(logged, tmp_path / "r", method="dp_sgd", relation="replace_one", delta=1 / 500))
    assert info.value.field == "delta" and "600 units" in str(info.value)
    assert not (tmp_path / "r" / "run").exists()
    with pytest.raises(ValidationError) as info:  # add/remove: n = the released m~ (after its count)
        run(config(logged, tmp_path / "a", method="dp_sgd", delta=1 / 500))
    assert info.value.field == "delta" and "the released estimate of the number of units" in str(info.value)
    with pytest.raises(ValidationError) as info:  # any n DP-SGD can sample from: refused at once, never a hang
        run(config(logged, tmp_path / "h", delta=0.5))
    assert info.value.field == "delta" and not (tmp_path / "h" / "run").exists()
    from dporl.pipelines.ope import OPEConfig

    with pytest.raises(ValidationError) as info:  # GPOPE: n = the declared number of trajectories
        OPEConfig(m_values=[100, 1000], delta=0.01)
    assert info.value.field == "delta"


def test_no_note_says_the_number_of_units_is_public_under_add_remove(logged, tmp_path):
    summary = run(config(logged, tmp_path, method="dp_sgd"))
    privacy = summary["privacy"]
    assert privacy["guarantee"]["relation"] == "add/remove one unit"
    assert not privacy["notes"] and "assumes" not in privacy["text"] and "is public" not in privacy["text"]
