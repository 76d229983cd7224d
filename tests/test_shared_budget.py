"""A stage sharing the run budget (Algorithm 3's training stage): calibrated against one joint PLD over every
stage's events, so that the run's guarantee meets its budget, and never past it (records, resume, later charges)."""

from __future__ import annotations

import pytest

from dporl.privacy.accountants import epsilon_for
from dporl.privacy.calibration import calibrate_noise_multiplier, max_steps
from dporl.privacy.events import ApproxDPEvent, MixtureEvent, PoissonGaussianEvent
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.partition import UnitPartition
from dporl.privacy.sparse_vector import stable_prefix_budget
from dporl.utils.validation import PrivacyBudgetError, ValidationError

# The CartPole quickstart's shapes: 1000 experts, p_min 0.1, T = 25 release runs, B = 256 (q = 0.256); fewer steps.
M, P_MIN, T, Q, DELTA, STEPS, BLOCK = 1000, 0.1, 25, 0.256, 1e-5, 500, 50


def step_maker(p_dp: float):
    return lambda sigma: MixtureEvent(p_dp, PoissonGaussianEvent(sigma, Q))


def mixed_ledger(epsilon: float, fraction: float = 0.5) -> tuple[PrivacyLedger, ApproxDPEvent]:
    """Algorithm 3's ledger after its release: the release stage as the pipeline records it (T runs of (2 eps',
    beta) at (f eps, delta / 2)), then the training stage, nominal share (eps - f eps, delta / 2), sharing the run's."""
    ledger = PrivacyLedger((epsilon, DELTA))
    release = stable_prefix_budget(fraction * epsilon, DELTA / 2, T, P_MIN, M)
    ledger.stage("release", budget=(fraction * epsilon, DELTA / 2), mechanism="pld", unit="expert")
    ledger.record("release", release.event, T)
    ledger.stage("train", budget=(epsilon - fraction * epsilon, DELTA / 2), mechanism="rdp", unit="expert",
                 shares_run_budget=True)
    return ledger, release.event


def spend_in_blocks(ledger: PrivacyLedger, event, steps: int) -> None:
    """As the trainer does: authorise blocks of BLOCK steps, then record each step against its authorisation."""
    for start in range(0, steps, BLOCK):
        ledger.authorise("train", event, min(BLOCK, steps - start))
    for _ in range(steps):
        ledger.record("train", event)


def assert_budget_met(ledger: PrivacyLedger, epsilon: float) -> None:
    eps, delta, analysis = ledger.report().guarantee
    # Never above (up to the ledger's 1e-12 relative round-off); within 1% below: sigma is calibrated to a relative
    # 1e-3 and epsilon moves at most ~2x as fast as 1/sigma, the PLD grid (1e-3) is pessimistic, not lax.
    assert 0.99 * epsilon <= eps <= epsilon * (1 + 1e-12) and delta == pytest.approx(DELTA, rel=1e-12)
    assert "joint PLD" in analysis


@pytest.mark.parametrize("epsilon, p_dp", [(1.0, 0.1), (5.0, 0.5), (10.0, 1.0)])
def test_calibrated_sigma_meets_the_run_budget_and_no_step_more_fits(epsilon, p_dp):
    ledger, _ = mixed_ledger(epsilon)
    target = ledger.shared_budget("train", DELTA / 2)
    assert (target.epsilon, target.delta) == (epsilon, pytest.approx(DELTA)) and len(target.prior) == 1
    sigma = calibrate_noise_multiplier(target.epsilon, target.delta, STEPS, make_event=step_maker(p_dp),
                                       mechanism="pld", prior=target.prior)
    event = step_maker(p_dp)(sigma)
    spend_in_blocks(ledger, event, STEPS)
    assert_budget_met(ledger, epsilon)
    assert ledger.spent("train") > epsilon / 2  # past its nominal share: what the joint analysis leaves
    more = ledger.remaining("train", event, 10**6)
    assert more < 0.01 * STEPS  # sigma is the smallest (to 1e-3) for STEPS: a handful more steps at most
    if more:
        ledger.authorise("train", event, more)
    history = list(ledger.stages["train"].accountant.history)
    with pytest.raises(PrivacyBudgetError, match="past its budget"):
        ledger.authorise("train", event, 1)
    assert ledger.stages["train"].accountant.history == history  # refused: nothing recorded
    assert_budget_met(ledger, epsilon)


def test_step_count_for_a_given_sigma_is_the_exact_largest():
    ledger, _ = mixed_ledger(5.0)
    target = ledger.shared_budget("train", DELTA / 2)
    event = step_maker(0.5)(10.0)
    n = max_steps(event, target.epsilon, target.delta, mechanism="pld", prior=target.prior)
    joint = lambda k: epsilon_for([*target.prior, (event, k)], DELTA, "pld")  # noqa: E731
    assert joint(n) <= 5.0 < joint(n + 1)
    ledger.authorise("train", event, n)
    assert_budget_met(ledger, 5.0)
    assert ledger.remaining("train", event, 10) == 0
    with pytest.raises(PrivacyBudgetError):
        ledger.authorise("train", event, 1)


def test_refusals_hold_on_resume_and_no_state_past_the_budget_loads():
    ledger, _ = mixed_ledger(5.0)
    journal = []
    ledger.attach_journal(journal.append)
    target = ledger.shared_budget("train", DELTA / 2)
    event = step_maker(0.5)(10.0)
    ledger.authorise("train", event, max_steps(event, 5.0, DELTA, mechanism="pld", prior=target.prior))
    saved = journal[-1]
    assert [s["shares_run_budget"] for s in saved["stages"]] == [False, True]
    resumed = PrivacyLedger((5.0, DELTA))
    resumed.attach_journal(lambda state: None, recovered=saved)  # as a run directory recovers its journal
    assert resumed.stages["train"].shares_run_budget and resumed.remaining("train", event, 10**6) == 0
    with pytest.raises(PrivacyBudgetError):
        resumed.authorise("train", event, 1)
    assert resumed.report().guarantee[:2] == ledger.report().guarantee[:2]
    reader = PrivacyLedger()  # a ledger without a budget of its own (reading a journal) takes the saved one
    reader.load_state_dict(saved)
    assert reader.budget == (5.0, DELTA) and reader.remaining("train", event, 10) == 0
    # A state whose training stage holds one block more than fits is refused, whatever its stage budgets say.
    tampered = {**saved, "stages": [dict(s) for s in saved["stages"]]}
    accountant = tampered["stages"][1]["accountant"]
    tampered["stages"][1]["accountant"] = {**accountant, "history": [[e, c + BLOCK] for e, c in accountant["history"]]}
    with pytest.raises(PrivacyBudgetError, match="past its budget"):
        PrivacyLedger((5.0, DELTA)).load_state_dict(tampered)


def test_a_later_charge_elsewhere_cannot_eat_the_slack_the_sharing_stage_spent():
    ledger = PrivacyLedger((10.0, DELTA))
    ledger.stage("release", budget=(6.0, DELTA / 2), mechanism="pld", unit="expert")
    ledger.record("release", ApproxDPEvent(0.1, 1e-8), 20)  # about 2 of its 6
    ledger.stage("train", budget=(4.0, DELTA / 2), mechanism="pld", unit="expert", shares_run_budget=True)
    target = ledger.shared_budget("train", DELTA / 2)
    event = step_maker(1.0)(5.0)
    ledger.authorise("train", event, max_steps(event, 10.0, DELTA, mechanism="pld", prior=target.prior))
    assert ledger.spent("train") > 4.0
    before = list(ledger.stages["release"].accountant.history)
    with pytest.raises(PrivacyBudgetError, match="past its budget"):  # within the release's own 6, not the run's
        ledger.record("release", ApproxDPEvent(0.5, 0.0))
    assert ledger.stages["release"].accountant.history == before
    assert ledger.report().guarantee[0] <= 10.0 * (1 + 1e-12)


def test_sharing_needs_a_run_budget_sequential_composition_and_a_prior_that_leaves_something():
    with pytest.raises(PrivacyBudgetError) as info:
        PrivacyLedger().stage("train", budget=(1.0, 1e-6), shares_run_budget=True)
    assert info.value.field == "ledger.train.shares_run_budget"
    partitioned = PrivacyLedger((2.0, 1e-5))
    partitioned.partition(UnitPartition("public-salt", ["a", "b"]))
    partitioned.stage("a", budget=(1.0, 1e-6), cells=["a"], mechanism="pld")
    with pytest.raises(ValidationError) as info:
        partitioned.stage("train", budget=(1.0, 1e-6), shares_run_budget=True)
    assert info.value.field == "ledger.train.cells"
    ledger, _ = mixed_ledger(5.0)
    with pytest.raises(PrivacyBudgetError) as info:  # the deltas of all stages must fit the run's
        ledger.shared_budget("train", DELTA)
    assert info.value.field == "ledger.train.delta"
    # Events that alone take the whole budget leave nothing to calibrate: a named refusal, not an endless search.
    prior = [(ApproxDPEvent(1.0, 0.0), 3)]  # about 2.9 at delta 1e-5
    with pytest.raises(PrivacyBudgetError, match="nothing is left"):
        calibrate_noise_multiplier(2.0, DELTA, 10, make_event=step_maker(1.0), mechanism="pld", prior=prior)
    with pytest.raises(PrivacyBudgetError, match="nothing is left"):
        max_steps(step_maker(1.0)(1.0), 1.5, DELTA, mechanism="pld", prior=prior)
