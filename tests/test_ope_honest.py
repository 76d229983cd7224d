"""Private OPE gives a usable, honest answer: scales derived from declared public facts, noise predicted and refused
before spending, values clamped into the range and inside their interval, failed estimates never calibrated, the
target called on logged states only, a unit never contributing more rows than it owns, and a new user's table with
negative rewards either evaluated within the range or refused before spending with the units it needs."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

import dporl
from dporl.eval.ope_coverage import TreatmentChain, constant_policy
from dporl.eval.ope_feasibility import InfeasibleEvaluation, predict_ratio
from dporl.eval.ope_fqe import FQETraining, dp_fqe, row_weights
from dporl.eval.ope_importance import dp_importance_sampling
from dporl.eval.ope_scales import OPEScales, return_range
from dporl.eval.ope_suite_problems import HospitalStays, stays_target
from dporl.pipelines.offline_eval import OfflineEvalConfig, plan_evaluation
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.randomness import SecretRoot
from dporl.privacy.samplers import PoissonUnitSource
from dporl.utils.validation import ValidationError

torch.set_num_threads(1)
CHAIN = TreatmentChain()
TARGET = constant_policy(0.8)
RANGE = (-2.0, 1.0)


def _chain(units: int = 300, seed: int = 0):
    return CHAIN.simulate(units, 4, (0.2, 0.8), np.random.default_rng(seed))


# ---------------------------------------------------------------------------------------------------- scales
def test_the_value_range_is_derived_from_the_declared_reward_range():
    # All rewards negative (hospital days): the range is all negative, from gamma and the horizon.
    scales = OPEScales.declare(reward_range=(-1.5, -1.0), gamma=0.99, horizon=30)
    steps = (1 - 0.99**30) / 0.01
    assert scales.value_range == pytest.approx((-1.5 * steps, -1.0))
    assert scales.centre < 0 and scales.half == pytest.approx((1.5 * steps - 1) / 2)
    assert return_range((-1.5, -1.0), 0.99, None) == pytest.approx((-150.0, -1.0))  # unbounded: 1 / (1 - gamma)
    assert return_range((0.0, 1.0), 0.95, None) == pytest.approx((0.0, 20.0))
    assert return_range((0.5, 2.0), 0.9, 3) == pytest.approx((0.5, 2.0 * 2.71))  # one step at least
    assert "derived from the declared reward range [-1.5, -1]" in scales.origin
    declared = OPEScales.declare(value_range=RANGE, reward_range=(-1, 1), gamma=0.9)  # the declared range wins
    assert declared.value_range == RANGE and declared.origin == "declared value range [-2, 1]"


def test_undeclared_or_malformed_scales_are_refused_by_name():
    with pytest.raises(ValidationError) as info:
        OPEScales.declare(gamma=0.99)
    assert info.value.field == "reward_range"
    with pytest.raises(ValidationError) as info:
        OPEScales.declare(reward_range=(-1, 0), gamma=1.0)  # undiscounted and unbounded: no range
    assert info.value.field == "horizon"
    for bad in ({"value_range": (1.0, 1.0)}, {"value_range": (0, math.inf)}, {"min_propensity": 0.0},
                {"horizon": 0}, {"episodes_per_unit": -1}):
        with pytest.raises(ValidationError):
            OPEScales.declare(**{"value_range": RANGE, **bad})
    # The pipeline refuses before anything is written: no scale is copied from an example.
    with pytest.raises(ValidationError) as info:
        plan_evaluation(OfflineEvalConfig(estimator="wis", unit_clip=5.0), _chain(20), (1.0, 1e-5), (1.0, 1e-5))
    assert info.value.field == "eval.offline.reward_range"


def test_the_unit_clip_comes_from_public_facts_with_its_bias_variance_choice_in_one_line():
    scales = OPEScales.declare(value_range=RANGE, min_propensity=0.2, horizon=2, episodes_per_unit=3)
    assert scales.max_weight() == pytest.approx(25.0)  # (1 / 0.2)^2
    assert scales.unit_clip("wis", None) == pytest.approx(math.sqrt(2) * 3 * 25)  # nothing can be clipped
    assert scales.unit_clip("fqe", None) == pytest.approx(math.sqrt(3) * 3)
    assert "nothing is clipped (no clip bias)" in scales.clip_choice("wis", scales.unit_clip("wis", None))
    assert "below the public maximum" in scales.clip_choice("wis", 5.0)
    with pytest.raises(ValidationError) as info:
        OPEScales.declare(value_range=RANGE).unit_clip("wis", None)
    assert info.value.field == "unit_clip" and "min_propensity" in str(info.value)
    # The declared minimum propensity bounds every per-step ratio, whatever the logs say.
    dataset = _chain(50)
    low = dataset.replace(behavior_log_probs=np.full_like(dataset.behavior_log_probs, np.log(1e-6)))
    from dporl.eval.ope_importance import episode_terms

    terms = episode_terms(low, TARGET, CHAIN.gamma, min_propensity=0.2)
    assert float(terms["w"].max()) <= 5.0 ** int(dataset.episode_lengths.max()) * (1 + 1e-9)
    assert float(episode_terms(low, TARGET, CHAIN.gamma)["w"].max()) > 1e5  # without it: unbounded


# ---------------------------------------------------------------------------------------------------- feasibility
def test_an_evaluation_whose_predicted_noise_exceeds_the_range_is_refused_before_spending():
    ledger = PrivacyLedger()
    dataset = _chain(60)
    with pytest.raises(InfeasibleEvaluation) as info:
        dp_importance_sampling(dataset, TARGET, epsilon=0.05, delta=1e-5, ledger=ledger, root=SecretRoot(0),
                               value_range=RANGE, unit_clip=12.0, units=60, gamma=CHAIN.gamma)
    assert not ledger.stages  # nothing spent
    message = str(info.value)
    needed = int(message.split("needs about ")[1].split(" ")[0])
    assert needed > 60 and "or epsilon about" in message and "refused before anything was spent" in message
    # The number it names is enough by the same prediction, and the refused call fits with that many units.
    scales = OPEScales.declare(value_range=RANGE)
    common = dict(epsilon=0.05, delta=1e-5, unit_clip=12.0, scales=scales)
    assert not predict_ratio("wis", units=60, **common).ok
    assert predict_ratio("wis", units=needed, **common).ok
    dp_importance_sampling(dataset, TARGET, epsilon=0.05, delta=1e-5, ledger=ledger, root=SecretRoot(0),
                           value_range=RANGE, unit_clip=12.0, units=needed, gamma=CHAIN.gamma)  # not refused


def test_dp_fqe_is_refused_before_any_training(tmp_path):
    from dporl.privacy.units import Relation

    ledger = PrivacyLedger(None, Relation.REPLACE_ONE)  # the number of units is public: no count to release
    with pytest.raises(InfeasibleEvaluation, match="needs about"):
        dp_fqe(_chain(90), TARGET, epsilon=0.1, delta=1e-5, ledger=ledger, root=SecretRoot(1), run_dir=tmp_path,
               value_range=RANGE, episodes_per_unit=4, gamma=CHAIN.gamma)
    assert not ledger.stages
    # Under add/remove the prediction reads the folds' released counts: the count is spent first, nothing else.
    ledger = PrivacyLedger()
    with pytest.raises(InfeasibleEvaluation, match=r"a released count; at most \d+ at 95%"):
        dp_fqe(_chain(90), TARGET, epsilon=0.1, delta=1e-5, ledger=ledger, root=SecretRoot(1), run_dir=tmp_path,
               value_range=RANGE, episodes_per_unit=4, gamma=CHAIN.gamma, count_fraction=0.5)
    assert list(ledger.stages) == ["fqe/count"]


# ---------------------------------------------------------------------------------------------------- results
class _Root:
    """A SecretRoot whose noise is one constant: pins the release to a chosen side of the range."""

    def __init__(self, value: float):
        self.value = value

    def noise(self, name):
        value = self.value

        class Constant:
            def gaussian(self, shape, std, dtype=torch.float32):
                return torch.full((shape,) if isinstance(shape, int) else shape, value, dtype=dtype)

        return Constant()


def test_the_value_is_clamped_into_the_declared_range_and_inside_its_interval():
    dataset = _chain(400, seed=2)
    # Every return is at least -2 and most are 0 or 1: declared [0.5, 2], the raw WIS estimate (~ -0.1) lies below.
    result = dp_importance_sampling(dataset, TARGET, epsilon=1.0, delta=1e-5, ledger=PrivacyLedger(),
                                    root=_Root(0.0), value_range=(0.5, 2.0), unit_clip=12.0, gamma=CHAIN.gamma)
    assert result.value == 0.5 and result.ci_low <= result.value <= result.ci_high
    assert 0.5 <= result.ci_low and result.ci_high <= 2.0
    for seed in range(5):  # and in ordinary draws
        r = dp_importance_sampling(dataset, TARGET, epsilon=0.3, delta=1e-5, ledger=PrivacyLedger(),
                                   root=SecretRoot(seed), value_range=RANGE, unit_clip=12.0, gamma=CHAIN.gamma)
        assert RANGE[0] <= r.ci_low <= r.value <= r.ci_high <= RANGE[1]


def test_a_failed_estimate_is_nan_with_the_range_as_interval_and_never_calibrated():
    dataset = _chain(100, seed=3)
    declared = dict(value_range=RANGE, min_propensity=0.2, horizon=1, episodes_per_unit=4)  # (a nominal clip)
    one_step = dataset  # the clip is what the declared facts give; only the noise matters here
    ok = dp_importance_sampling(one_step, TARGET, epsilon=1.0, delta=1e-5, ledger=PrivacyLedger(), root=_Root(0.0),
                                gamma=CHAIN.gamma, **declared)
    # The configuration the suite measured nominal (nothing clipped, a stochastic target): answered and calibrated.
    assert ok.status == "ok" and ok.calibrated
    failed = dp_importance_sampling(one_step, TARGET, epsilon=1.0, delta=1e-5, ledger=PrivacyLedger(),
                                    root=_Root(-1e9), gamma=CHAIN.gamma, **declared)  # the noisy denominator < 0
    assert math.isnan(failed.value) and (failed.ci_low, failed.ci_high) == RANGE
    assert failed.calibrated is False and failed.status == "no_estimate"
    assert failed.notes[0].startswith("no estimate (no_estimate): the noisy denominator was <= 0")
    assert "FAILED (no_estimate)" in failed.describe()


def test_a_diverged_dp_fqe_is_named_and_never_calibrated(tmp_path):
    training = FQETraining(steps=40, sample_rate=0.3, lr=1e4, fqe=dporl.FQEConfig(gamma=CHAIN.gamma))
    result = dp_fqe(_chain(300, seed=4), TARGET, epsilon=5.0, delta=1e-5, ledger=PrivacyLedger(),
                    root=SecretRoot(2), run_dir=tmp_path, value_range=RANGE, unit_clip=12.0, training=training,
                    tolerance=1e6)
    assert result.status == "diverged" and math.isnan(result.value) and not result.calibrated
    assert (result.ci_low, result.ci_high) == RANGE and "diverged" in result.notes[0]


def test_dp_doubly_robust_runs_with_its_defaults(tmp_path):
    result, model = dporl.dp_doubly_robust(_chain(400, seed=5), TARGET, epsilon=2.0, delta=1e-5,
                                           ledger=PrivacyLedger(), root=SecretRoot(3), run_dir=tmp_path,
                                           value_range=RANGE, unit_clip=12.0, tolerance=1e6)
    assert model.config.gamma == FQETraining().fqe.gamma  # DR's discount is the model's unless given
    assert result.status == "ok" and RANGE[0] <= result.value <= RANGE[1]


# ---------------------------------------------------------------------------------------------------- target, rows
def _strict(obs: torch.Tensor) -> torch.Tensor:
    """Refuses anything that is not a one-hot state (padding and terminal placeholders are all zeros)."""
    if not torch.all(obs.sum(1) == 1):
        raise AssertionError("the target policy was called on a padding or placeholder state")
    return torch.tensor([[0.2, 0.8]], dtype=torch.float64).expand(obs.shape[0], 2)


def test_the_target_policy_is_never_called_on_padding_or_terminal_placeholders(tmp_path):
    dataset = _chain(200, seed=6)
    assert len(set(dataset.episode_lengths.tolist())) > 1  # padded episodes of several lengths
    dp_importance_sampling(dataset, _strict, epsilon=1.0, delta=1e-5, ledger=PrivacyLedger(), root=SecretRoot(0),
                           value_range=RANGE, unit_clip=12.0, kind="pdis", gamma=CHAIN.gamma)
    training = FQETraining(steps=10, fqe=dporl.FQEConfig(gamma=CHAIN.gamma))
    dp_fqe(dataset, _strict, epsilon=1.0, delta=1e-5, ledger=PrivacyLedger(), root=SecretRoot(0), run_dir=tmp_path,
           value_range=RANGE, unit_clip=12.0, training=training, tolerance=1e6)


def test_a_sampled_unit_never_contributes_more_rows_than_it_owns():
    owned = np.array([1, 3, 20, 8])
    unit_of_row = torch.from_numpy(np.repeat(np.arange(4), owned))
    data = {"row": torch.arange(int(owned.sum()))}
    source = PoissonUnitSource(data, unit_of_row, 4, 1.0, rows_per_unit=8, replace=False)
    counts = np.zeros(int(owned.sum()))
    generator = torch.Generator().manual_seed(0)
    for _ in range(2000):
        batch = source.sample(generator)
        units = unit_of_row[batch.data["row"]].numpy()
        assert np.array_equal(np.bincount(units, minlength=4), np.minimum(owned, 8))  # min(k, rows), never more
        rows = batch.data["row"].numpy()
        assert len(np.unique(rows)) == len(rows)  # distinct rows
        counts[rows] += 1
    # Uniform over a unit's rows: a row of the 20-row unit is drawn 8/20 of the time (binomial, 4.5 sd of 2000).
    big = counts[4:24] / 2000
    assert np.all(np.abs(big - 0.4) < 4.5 * math.sqrt(0.4 * 0.6 / 2000))
    assert np.all(counts[:4] == 2000) and np.all(counts[24:] == 2000)


def test_every_transition_weighs_alike_whatever_its_episode_turned_out():
    dataset = _chain(30, seed=7)
    weights = row_weights(dataset, length_cap=CHAIN.horizon).numpy()
    units = np.repeat(dataset.unit_ids, dataset.episode_lengths)
    rows = np.bincount(units, minlength=dataset.n_units)
    episodes = np.bincount(dataset.unit_ids, minlength=dataset.n_units)
    np.testing.assert_allclose(weights, (rows / episodes / CHAIN.horizon)[units], rtol=1e-6)
    assert weights.max() <= 1.0 and len(weights) == dataset.n_transitions


# ---------------------------------------------------------------------------------------------------- done means
def _stays_csv(path, units: int, seed: int) -> None:
    stays = HospitalStays()
    logged = stays.simulate(units, 4, (0.2, 0.8), np.random.default_rng(seed))
    dporl.to_frame(logged, next_observations=True, unit="doctor").to_csv(path, index=False)


def _fit(csv, tmp_path, name: str, steps: int):
    data = dporl.read_table(csv, episode="episode", unit="doctor", observations="obs_", action="action", actions=2,
                            reward="reward", terminated="terminated", truncated="truncated",
                            next_observations="next_obs_")
    evaluation = dporl.OfflineEvalConfig(reward_range=(-1.5, -1.0), horizon=30, episodes_per_unit=4)
    cql = dporl.DiscreteCQLConfig(epsilon=1.0, gamma=0.99, steps=steps, hidden_sizes=[16], batch_size=64,
                                  noise_seed=5, progress=False, evaluation=evaluation).create(data)
    return cql.fit(run_dir=tmp_path / name)


def test_a_new_users_negative_reward_table_is_refused_before_spending_with_the_units_it_needs(tmp_path, capsys):
    """500 doctors at eps 1 through the README's API with the reward range declared: the predicted noise of DP-FQE
    on the held-out half exceeds the value range, so the run stops after the count, naming the units needed."""
    csv = tmp_path / "stays.csv"
    _stays_csv(csv, 500, seed=0)
    with pytest.raises(InfeasibleEvaluation) as info:
        _fit(csv, tmp_path, "run", steps=50)
    assert info.value.field == "eval.offline.estimator"
    assert "held-out units" in str(info.value) and "needs about" in str(info.value)
    journal = json.loads((tmp_path / "run" / "curator" / "journal.json").read_text())
    charged = [s["name"] for s in journal["ledger"]["stages"] if s["accountant"]["history"]]
    assert charged == ["unit_count"]  # only the count was spent
    assert "public scales: value range [-39.04, -1] derived from the declared reward range [-1.5, -1]" in (
        capsys.readouterr().out)


def test_a_new_users_negative_reward_table_with_enough_units_gets_a_value_inside_a_narrow_interval(tmp_path):
    csv = tmp_path / "stays.csv"
    _stays_csv(csv, 4000, seed=1)
    result = _fit(csv, tmp_path, "run", steps=50)
    value, low, high = result.value
    lo, hi = return_range((-1.5, -1.0), 0.99, 30)
    assert all(math.isfinite(x) for x in (value, low, high)) and lo <= low <= value <= high <= hi
    assert high - low < hi - lo  # narrower than the value range
