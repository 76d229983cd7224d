"""Private OPE on logged data: sensitivity on fixed neighbours, exactness without noise, accounting, intervals."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from torch import nn

from dporl.algos.fqe import FQE_KEYS, DiscreteFQE, FQEConfig
from dporl.eval.ope_coverage import TreatmentChain, clopper_pearson, constant_policy
from dporl.eval.private_ope import (
    FQETraining,
    action_probabilities,
    dp_doubly_robust,
    dp_fqe,
    dp_importance_sampling,
    episode_terms,
    per_unit,
    release_ratio,
    unit_pairs,
)
from dporl.privacy.accountants import epsilon_for
from dporl.privacy.events import PoissonGaussianEvent
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.randomness import SecretRoot
from dporl.privacy.samplers import Batch
from dporl.utils.validation import ValidationError

torch.set_num_threads(1)
CHAIN = TreatmentChain()
TARGET = constant_policy(0.8)
RANGE = (-CHAIN.treat_cost / (1 - CHAIN.gamma), 1.0)  # any episode's return: at most 0.1 a step, one final 1


def _data(units=300, seed=0):
    return CHAIN.simulate(units, 4, (0.2, 0.8), np.random.default_rng(seed))


def test_truth_is_the_monte_carlo_value():
    dataset = CHAIN.simulate(20000, 1, (0.8, 0.8), np.random.default_rng(5))  # on-policy: returns are unbiased
    returns = episode_terms(dataset, TARGET, CHAIN.gamma)["G"]
    stderr = float(returns.std()) / math.sqrt(len(returns))
    assert abs(float(returns.mean()) - CHAIN.true_value(0.8)) < 4 * stderr  # 4 standard errors


def test_target_policy_forms():
    obs = torch.eye(6)[:3]
    torch.testing.assert_close(action_probabilities(TARGET, obs, 2), torch.tensor([[0.2, 0.8]] * 3, dtype=torch.float64))

    class Greedy(nn.Module):
        def act(self, x):
            return torch.tensor([1, 0, 1])

    np.testing.assert_array_equal(action_probabilities(Greedy(), obs, 2).numpy(), [[0, 1], [1, 0], [0, 1]])
    with pytest.raises(ValidationError, match="sum to 1"):
        action_probabilities(lambda x: torch.full((3, 2), 0.7), obs, 2)
    with pytest.raises(ValidationError, match="shape"):
        action_probabilities(lambda x: torch.full((3, 3), 1 / 3), obs, 2)


def test_one_units_removal_moves_the_released_vector_by_at_most_sqrt_2():
    """Fixed neighbours: the data set with and without one adversarial unit (huge weights and returns)."""
    rng = np.random.default_rng(1)
    a = torch.from_numpy(rng.standard_cauchy(50) * 100)
    b = torch.from_numpy(np.abs(rng.standard_cauchy(50)) * 30)
    full = unit_pairs(a, b, value_scale=1.0, unit_clip=5.0)
    assert float(full.norm(dim=1).max()) <= 1 + 1e-12
    x, y = full[:, 0], full[:, 1]
    rows = torch.stack([x, y, x * x, math.sqrt(2) * x * y, y * y], 1)
    for removed in range(50):
        keep = torch.arange(50) != removed
        assert float((rows.sum(0) - rows[keep].sum(0)).norm()) <= math.sqrt(2) + 1e-12
    # Clipping keeps a unit's own ratio (scaled, not distorted).
    ratio = a / b
    torch.testing.assert_close(full[:, 0] / full[:, 1], ratio)


def test_release_pays_one_calibrated_gaussian_before_releasing():
    ledger = PrivacyLedger()
    ledger.stage("s", budget=(0.5, 1e-6), mechanism="pld", unit="expert")
    pairs = unit_pairs(torch.ones(10), torch.ones(10), 1.0, 2.0)
    out = release_ratio(pairs, ledger=ledger, stage="s", noise=SecretRoot(0).noise("n"), moments=True)
    (event, count), = ledger.stages["s"].accountant.history
    assert count == 1 and isinstance(event, PoissonGaussianEvent) and event.sample_rate == 1.0
    assert epsilon_for([(event, 1)], 1e-6, "pld") <= 0.5
    assert out["noise_std"] == pytest.approx(event.noise_multiplier * math.sqrt(2))
    with pytest.raises(ValidationError, match="unit ball"):
        release_ratio(pairs * 3, ledger=ledger, stage="s", noise=SecretRoot(0).noise("m"), moments=True)


class _SilentRoot:
    """Stands in for a SecretRoot whose noise is exactly zero: isolates the estimators' arithmetic."""

    reproducible = True

    def noise(self, name):
        class Zero:
            def gaussian(self, shape, std, dtype=torch.float32):
                return torch.zeros(shape, dtype=dtype)

        return Zero()


def test_without_noise_or_clipping_the_estimators_are_the_textbook_ones():
    dataset = _data(200)
    terms = episode_terms(dataset, TARGET, CHAIN.gamma)
    wis = float((terms["w"] * terms["G"]).sum() / terms["w"].sum())
    common = dict(epsilon=1.0, delta=1e-5, gamma=CHAIN.gamma, min_signal=0.0, root=_SilentRoot(), value_range=RANGE)
    c, h = sum(RANGE) / 2, (RANGE[1] - RANGE[0]) / 2  # returns enter centred and scaled: (G - c) / h
    a, b = per_unit(terms["w"] * (terms["G"] - c), dataset) / h, per_unit(terms["w"], dataset)
    clip = float(torch.stack([a, b], 1).norm(dim=1).max()) * (1 + 1e-9)  # no unit clipped
    result = dp_importance_sampling(dataset, TARGET, kind="wis", ledger=PrivacyLedger(), unit_clip=clip, **common)
    assert result.value == pytest.approx(wis, rel=1e-9)
    a, b = per_unit(terms["pdis"] - c, dataset) / h, per_unit(torch.ones(dataset.n_episodes), dataset)
    clip = float(torch.stack([a, b], 1).norm(dim=1).max()) * (1 + 1e-9)
    ledger = PrivacyLedger()
    pdis = dp_importance_sampling(dataset, TARGET, kind="pdis", ledger=ledger, unit_clip=clip, **common)
    assert pdis.value == pytest.approx(float(terms["pdis"].mean()), rel=1e-9)
    # The interval: every value in the range that the test of ope_interval does not reject, found here by brute
    # force on a grid (the noise is silenced, so the released sums and moments are exact; s is the nominal noise std
    # in the clip's units): accept r when (A - r B)^2 <= z^2 [max(Q(r) + kappa s (1 + r^2), 0) + s^2 (1 + r^2)].
    from dporl.eval.ope_interval import variance_margin

    s = ledger.stages["ope/pdis"].accountant.history[0][0].noise_multiplier * math.sqrt(2)
    x, y = (a / clip).double().numpy(), (b / clip).double().numpy()
    grid = np.linspace(-1, 1, 200_001)
    q = (x**2).sum() - 2 * grid * (x * y).sum() + grid**2 * (y**2).sum()
    noise = s * s * (1 + grid**2)
    accepted = grid[(x.sum() - grid * y.sum()) ** 2
                    <= 1.959964**2 * (np.maximum(q + variance_margin(s, 0.95) * s * (1 + grid**2), 0) + noise)]
    assert RANGE[0] < pdis.ci_low and pdis.ci_high < RANGE[1]  # an informative interval, not the range
    assert pdis.ci_low == pytest.approx(c + h * accepted.min(), abs=2e-5 * h)
    assert pdis.ci_high == pytest.approx(c + h * accepted.max(), abs=2e-5 * h)
    # DR with a zero model is per-decision IS, episode by episode.
    zero = episode_terms(dataset, TARGET, CHAIN.gamma, q_model=lambda obs: torch.zeros(len(obs), 2))
    torch.testing.assert_close(zero["dr"], zero["pdis"])


def test_dr_with_the_true_q_has_far_less_variance_than_pdis():
    dataset = _data(300, seed=3)
    # Exact Q of the target (horizon-free approximation: the horizon is never reached in practice).
    S, g, h = CHAIN.n_states, CHAIN.gamma, CHAIN.hazard
    V = np.zeros(S)
    for _ in range(500):
        Q = np.zeros((S, 2))
        for act, p in ((0, CHAIN.p_wait), (1, CHAIN.p_treat)):
            nxt = np.where(np.arange(S) + 1 == S - 1, 1.0, g * (1 - h) * V[np.minimum(np.arange(S) + 1, S - 1)])
            Q[:, act] = -CHAIN.treat_cost * act + p * nxt + (1 - p) * g * (1 - h) * V
        Q[-1] = 0
        V = Q @ np.array([0.2, 0.8])
    q = torch.from_numpy(Q)
    terms = episode_terms(dataset, TARGET, CHAIN.gamma, q_model=lambda obs: obs.double() @ q)
    # DR removes the variance of the action choices, not that of the transitions (Jiang & Li 2016, Theorem 2):
    # here about two thirds of per-decision IS's variance.
    assert float(terms["dr"].var()) < 0.5 * float(terms["pdis"].var())
    assert float(terms["dr"].mean()) == pytest.approx(CHAIN.true_value(0.8), abs=4 * float(terms["dr"].std()) / 35)


def test_refusals():
    dataset = _data(50)
    common = dict(epsilon=1, delta=1e-5, unit_clip=4, value_range=RANGE)
    with pytest.raises(ValidationError, match="q_model"):
        dp_importance_sampling(dataset, TARGET, kind="dr", ledger=PrivacyLedger(), root=SecretRoot(0), **common)
    no_props = dataset.with_identities_removed(dataset.metadata)
    with pytest.raises(ValidationError, match="propensities"):
        dp_importance_sampling(no_props, TARGET, ledger=PrivacyLedger(), root=SecretRoot(0), **common)
    ledger = PrivacyLedger()
    dp_importance_sampling(dataset, TARGET, ledger=ledger, root=SecretRoot(0), **common)
    with pytest.raises(ValidationError, match="already exists"):
        dp_importance_sampling(dataset, TARGET, ledger=ledger, root=SecretRoot(1), **common)
    with pytest.raises(ValidationError, match="reward_range"):  # no scale without a declared range
        dp_importance_sampling(dataset, TARGET, ledger=PrivacyLedger(), root=SecretRoot(0), epsilon=1, delta=1e-5,
                               unit_clip=4)


def test_wis_interval_covers_the_truth_in_repeated_simulation():
    """40 independent datasets at eps = 1: the 95% interval must cover at least 32 times. For a true coverage of
    0.95, P(X <= 31) = 0.5% under Binomial(40, 0.95); the seeds are fixed, so the test is deterministic."""
    rng = np.random.default_rng(7)
    truth, covered = CHAIN.true_value(0.8), 0
    for i in range(40):
        dataset = CHAIN.simulate(400, 4, (0.2, 0.8), rng)
        result = dp_importance_sampling(dataset, TARGET, epsilon=1.0, delta=1e-5, ledger=PrivacyLedger(),
                                        root=SecretRoot(1000 + i), unit_clip=12.0, gamma=CHAIN.gamma,
                                        value_range=RANGE)
        covered += result.ci_low <= truth <= result.ci_high
    assert covered >= 32
    assert clopper_pearson(covered, 40)[0] > 0.6


TRAINING = FQETraining(steps=30, sample_rate=0.2, lr=0.5,
                       fqe=FQEConfig(hidden_sizes=[], gamma=CHAIN.gamma, td_loss="mse", target_update_every=10))


def test_dp_fqe_folds_compose_in_parallel(tmp_path):
    ledger = PrivacyLedger()
    result = dp_fqe(_data(300), TARGET, epsilon=1.0, delta=1e-5, ledger=ledger, root=SecretRoot(4),
                    run_dir=tmp_path, unit_clip=12.0, folds=3, training=TRAINING, value_range=RANGE,
                    tolerance=1e6)  # tiny folds: the noise check would refuse
    report = ledger.report()
    # DP-SGD divides by sample_rate x a released count of each fold's units: one count per fold (1% of epsilon, one
    # stage over the three cells), then each fold's training and value.
    assert len(report.cells) == 3 and len(report.stages) == 7 and report.stages[0].name == "fqe/count"
    assert report.stages[0].budget == (0.01, 0.0) and report.stages[0].cells is None  # every fold's cell
    assert all(c.stages[0] == "fqe/count" for c in report.cells)
    eps, delta, analysis = report.guarantee
    assert eps <= 1.0 + 1e-9 and delta == pytest.approx(1e-5) and "parallel" in analysis
    assert sum(s.epsilon for s in report.stages) > 2.5  # sequential composition would have cost ~3x
    assert len(result.fold_values) == 3 and result.ci_low <= result.value <= result.ci_high
    assert "folds" in result.variance
    # No premise contradicting the add/remove relation is printed with the guarantee.
    assert not report.notes and "assumes:" not in report.describe()
    restored = PrivacyLedger()
    restored.load_state_dict(ledger.state_dict())
    assert restored.report().describe() == report.describe()


def test_dp_fqe_reproduces_under_a_fixed_root_whatever_ran_before(tmp_path):
    """The Q-network's initialisation is public and seeded (``FQETraining.seed``), so a run with a fixed noise_seed
    reproduces its release exactly; it once came from torch's global generator, whose state depends on what ran
    before (the released value then changed from run to run)."""
    values = []
    for i, global_seed in enumerate((1, 2, 1)):
        torch.manual_seed(global_seed)  # whatever the global generator holds
        training = TRAINING if i < 2 else FQETraining(**{**TRAINING.__dict__, "seed": 1})
        result = dp_fqe(_data(200), TARGET, epsilon=1.0, delta=1e-5, ledger=PrivacyLedger(), root=SecretRoot(9),
                        run_dir=tmp_path / str(i), unit_clip=12.0, folds=2, training=training,
                        value_range=RANGE, tolerance=1e6)  # tiny folds: the noise check would refuse
        values.append(result.fold_values)
    assert values[0] == values[1]  # exact: same root, same public seed
    assert values[2] != values[0]  # the seed is used: another initialisation gives another (noisy) fixed point


def test_dp_doubly_robust_spends_each_budget_on_its_own_cell(tmp_path):
    ledger = PrivacyLedger()
    public = FQETraining(**{**TRAINING.__dict__, "expected_units": 20.0})  # a public normaliser: count stays private
    result, model = dp_doubly_robust(_data(400), TARGET, epsilon=1.0, delta=1e-5, ledger=ledger, root=SecretRoot(5),
                                     run_dir=tmp_path, unit_clip=12.0, gamma=CHAIN.gamma, training=public,
                                     value_range=RANGE)
    report = ledger.report()
    assert {c.name: c.stages for c in report.cells} == {"estimate": ["dr/estimate"], "model": ["dr/model"]}
    assert report.guarantee[0] <= 1.0 + 1e-9 and result.estimator == "dr"
    assert isinstance(model, DiscreteFQE)
    assert not any("number of units" in note for note in report.notes)


def test_fqe_target_ignores_the_terminal_placeholder():
    dataset = _data(30)
    t = dataset.transitions().to_torch()
    assert t["terminated"].any()
    t["next_pi"] = action_probabilities(TARGET, t["next_obs"], 2).float()
    torch.manual_seed(0)
    fqe = DiscreteFQE(6, 2, FQEConfig(hidden_sizes=[16]), "expert")
    losses = []
    for value in (0.0, 1e6):
        data = {k: t[k].clone() for k in FQE_KEYS}
        data["next_obs"][data["terminated"]] = value
        losses.append(fqe.row_losses(Batch(data, torch.zeros(len(data["obs"]), dtype=torch.long), 1, True)))
    torch.testing.assert_close(losses[0], losses[1], rtol=0, atol=0)


def test_dp_fqe_can_use_cells_of_a_partition_that_also_holds_a_training_cell(tmp_path):
    from dporl.privacy.partition import UnitPartition

    ledger = PrivacyLedger()
    ledger.partition(UnitPartition("s", {"train": 0.4, "eval0": 0.2, "eval1": 0.2, "eval2": 0.2}))
    result = dp_fqe(_data(300), TARGET, epsilon=1.0, delta=1e-5, ledger=ledger, root=SecretRoot(6), run_dir=tmp_path,
                    unit_clip=12.0, training=TRAINING, fold_cells=["eval0", "eval1", "eval2"], value_range=RANGE,
                    tolerance=1e6)  # tiny folds: the noise check would refuse
    cells = {c.name: c for c in ledger.report().cells}
    assert cells["train"].stages == [] and len(result.fold_values) == 3  # the folds' count touches their cells only
    assert cells["eval1"].stages == ["fqe/count", "eval1/train", "eval1/value"]
    with pytest.raises(ValidationError, match="unknown cell"):
        dp_fqe(_data(300), TARGET, epsilon=1.0, delta=1e-5, ledger=ledger, root=SecretRoot(7), run_dir=tmp_path,
               unit_clip=12.0, training=TRAINING, fold_cells=["eval0", "test"], value_range=RANGE)
