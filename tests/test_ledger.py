"""The ledger: budgets never exceeded, honest totals, exact restore."""

from __future__ import annotations

import pytest

from dporl.privacy.accountants import epsilon_for
from dporl.privacy.calibration import max_steps
from dporl.privacy.events import ApproxDPEvent, MixtureEvent, PoissonGaussianEvent, SampledWithoutReplacementGaussianEvent
from dporl.privacy.ledger import PrivacyLedger
from dporl.utils.validation import PrivacyBudgetError, ValidationError

TRAIN = MixtureEvent(0.5, PoissonGaussianEvent(1.0, 0.02))
RELEASE = ApproxDPEvent(0.05, 1e-7)


def _two_stage_ledger() -> PrivacyLedger:
    ledger = PrivacyLedger()
    ledger.stage("release", budget=(1.0, 5e-6), mechanism="pld", unit="expert")
    ledger.stage("train", budget=(2.0, 5e-6), mechanism="rdp", unit="expert")
    ledger.record("release", RELEASE, 10)
    return ledger


@pytest.mark.parametrize("mechanism", ["rdp", "pld"])
def test_stage_takes_exactly_max_steps_then_refuses(mechanism):
    ledger = PrivacyLedger()
    ledger.stage("train", budget=(1.5, 1e-5), mechanism=mechanism)
    allowed = max_steps(TRAIN, 1.5, 1e-5, mechanism=mechanism)
    for _ in range(allowed):  # one at a time, as the trainer records (exercises the headroom bookkeeping)
        ledger.record("train", TRAIN)
    with pytest.raises(PrivacyBudgetError, match="nothing was recorded"):
        ledger.record("train", TRAIN)
    assert len(ledger.stages["train"].accountant) == allowed
    assert ledger.spent("train") <= 1.5


def test_over_budget_block_records_nothing():
    ledger = _two_stage_ledger()
    before = list(ledger.stages["release"].accountant.history)
    with pytest.raises(PrivacyBudgetError):
        ledger.record("release", RELEASE, 1000)
    assert ledger.stages["release"].accountant.history == before
    ledger.record("release", MixtureEvent(0.0, PoissonGaussianEvent(1.0, 0.1)), 10**6)  # free steps always fit


def test_report_composes_stages_and_names_unit_and_analysis():
    ledger = _two_stage_ledger()
    ledger.record("train", TRAIN, 150)
    report = ledger.report()
    release, train = report.stages
    assert release.epsilon == pytest.approx(epsilon_for([(RELEASE, 10)], 5e-6, "pld"))
    assert train.epsilon == pytest.approx(epsilon_for([(TRAIN, 150)], 5e-6, "rdp"))
    assert report.basic == pytest.approx((release.epsilon + train.epsilon, 1e-5))
    joint = epsilon_for([(RELEASE, 10), (TRAIN, 150)], 1e-5, "pld")
    assert report.joint == pytest.approx((joint, 1e-5))
    assert report.joint[0] < report.basic[0]  # one PLD over both stages is tighter than adding epsilons
    eps, delta, analysis = report.guarantee
    assert (eps, delta) == report.joint and "joint PLD" in analysis
    text = report.describe()
    assert "unit: expert" in text and "RDP" in text and "PLD" in text and "GUARANTEE" in text
    payload = report.to_dict()
    assert payload["guarantee"]["unit"] == "expert" and payload["guarantee"]["epsilon"] == eps


def test_single_stage_guarantee_is_the_stage():
    ledger = PrivacyLedger()
    ledger.stage("train", budget=(2.0, 1e-5), mechanism="rdp", unit="trajectory")
    ledger.record("train", TRAIN, 100)
    report = ledger.report()
    assert report.guarantee[:2] == (ledger.spent("train"), 1e-5)
    assert "RDP" in report.guarantee[2] and report.unit.name == "trajectory"


def test_different_units_or_relations_are_never_combined():
    ledger = PrivacyLedger()
    ledger.stage("a", budget=(5.0, 1e-6), unit="expert")
    ledger.stage("b", budget=(5.0, 1e-6), unit="transition")
    ledger.record("a", TRAIN, 5)
    ledger.record("b", TRAIN, 5)
    report = ledger.report()
    assert report.guarantee is None and report.basic is None
    assert "different privacy units" in report.describe()

    ledger = PrivacyLedger()
    ledger.stage("swor", budget=(5.0, 1e-6), mechanism="rdp")
    ledger.stage("poisson", budget=(5.0, 1e-6), mechanism="rdp")
    ledger.record("swor", SampledWithoutReplacementGaussianEvent(2.0, 1, 50), 5)
    ledger.record("poisson", TRAIN, 5)
    report = ledger.report()
    # An add/remove guarantee and a replace-one guarantee hold for different neighbour pairs: adding their
    # epsilons would state a guarantee for neither relation.
    assert report.joint is None and report.basic is None and report.guarantee is None
    assert "different neighbouring relations" in report.describe()


def test_state_dict_restores_exactly_and_continues_identically():
    ledger = _two_stage_ledger()
    ledger.record("train", TRAIN, 120)
    restored = PrivacyLedger()
    restored.load_state_dict(ledger.state_dict())
    assert restored.report().to_dict() == ledger.report().to_dict()
    for each in (ledger, restored):
        each.record("train", TRAIN, 30)
    assert restored.spent("train") == ledger.spent("train")


def test_stage_validation():
    ledger = PrivacyLedger()
    ledger.stage("train", budget=(1.0, 1e-5))
    with pytest.raises(ValidationError):
        ledger.stage("train", budget=(1.0, 1e-5))
    with pytest.raises(ValidationError, match="unit"):
        ledger.stage("x", budget=(1.0, 1e-5), unit="person")
    with pytest.raises(ValidationError, match="delta"):
        ledger.stage("x")  # no budget and no delta to report at
    with pytest.raises(ValidationError):
        ledger.stage("x", budget=(0.0, 1e-5))
    with pytest.raises(ValidationError, match="no stage"):
        ledger.record("missing", TRAIN)
    ledger.stage("free", delta=1e-5)  # an unbudgeted stage only reports
    ledger.record("free", TRAIN, 10**4)
    assert ledger.spent("free") > 1.0


def test_a_release_of_exactly_the_budget_fits_but_one_more_does_not():
    ledger = PrivacyLedger()
    ledger.stage("release", budget=(0.1, 1e-5), mechanism="pld", unit="trajectory")
    ledger.record("release", ApproxDPEvent(0.1, 1e-5))  # composes to 0.1 + 7e-17 in floating point
    with pytest.raises(PrivacyBudgetError):
        ledger.record("release", ApproxDPEvent(1e-3, 0.0))


def test_report_names_the_proof_and_what_a_unit_is_and_restores_them():
    ledger = PrivacyLedger()
    ledger.stage("train", mechanism="pld", unit="reward", delta=1e-4, analysis="public-iterate Gaussian updates")
    ledger.record("train", PoissonGaussianEvent(30.0, 1.0), 78)
    text = ledger.report().describe()
    assert "public-iterate Gaussian updates; composed by PLD" in text
    assert "sup |r - r'| <= 1" in text and "one unit" not in text
    restored = PrivacyLedger()
    restored.load_state_dict(ledger.state_dict())
    assert restored.report().describe() == text


def test_paper_figures_are_printed_but_never_the_guarantee():
    ledger = _two_stage_ledger()
    ledger.paper_claim("training stage at rate p*q", 0.44, 5e-6, "Sharma et al. 2024, Alg. 3; the branch is observable")
    report = ledger.report()
    text = report.describe()
    assert "the paper's figure, NOT a guarantee: training stage at rate p*q: eps=0.44" in text
    assert report.guarantee is not None and report.guarantee[0] != 0.44  # the guarantee stays the ledger's own
    payload = report.to_dict()
    assert payload["paper_figures_NOT_guarantees"][0]["epsilon"] == 0.44
    restored = PrivacyLedger()
    restored.load_state_dict(ledger.state_dict())
    assert restored.report().describe() == text


def test_a_void_run_prints_no_guarantee_line_and_survives_a_restore():
    ledger = _two_stage_ledger()
    ledger.void("the release published logged prefixes (the paper's mechanism)")
    report = ledger.report()
    assert report.guarantee is None and report.to_dict()["guarantee"] is None
    assert "GUARANTEE:" not in report.describe().replace("NO GUARANTEE:", "")
    assert "NO GUARANTEE: the release published logged prefixes" in report.describe()
    restored = PrivacyLedger()
    restored.load_state_dict(ledger.state_dict())
    assert restored.report().guarantee is None
    with pytest.raises(ValidationError, match="ledger.void"):
        ledger.void("")


def test_units_are_types_and_the_report_names_the_chosen_column():
    from dporl.privacy.units import REWARD, Relation, grouped_by

    ledger = PrivacyLedger()
    clinician = grouped_by("clinician_id")
    ledger.stage("train", budget=(1.0, 1e-5), mechanism="rdp", unit=clinician)
    ledger.record("train", PoissonGaussianEvent(2.0, 0.01), 10)
    payload = ledger.report().to_dict()["guarantee"]
    assert payload["unit"] == "clinician_id" and payload["unit_column"] == "clinician_id"
    assert "one value of column 'clinician_id'" in payload["neighbouring"]
    restored = PrivacyLedger()
    restored.load_state_dict(ledger.state_dict())
    assert restored.stages["train"].unit == clinician

    rewards = PrivacyLedger()
    rewards.stage("train", budget=(5.0, 1e-5), mechanism="rdp", unit=REWARD)
    rewards.record("train", PoissonGaussianEvent(5.0, 1.0), 3)
    report = rewards.report()
    assert report.relation is Relation.BOUNDED_CHANGE and "sup |r - r'| <= 1" in report.neighbours
    with pytest.raises(ValidationError, match="privacy_unit"):
        PrivacyLedger().stage("x", budget=(1.0, 1e-5), unit="clinician")  # a bare unknown string is not a unit
