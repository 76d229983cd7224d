"""Budget fully used (issue 16): Algorithm 3's training stage calibrated on its own share of the budget (before)
against calibrated to the run budget under the joint PLD over both stages (after), in one run.

For the CartPole quickstart's shapes (1000 experts, p_min 0.1, T = 25 release runs at (eps / 2, delta / 2),
q = B / m = 0.256, 2000 mixture steps, delta 1e-5) and each (eps, p_dp): the training noise multiplier both ways
and the run's guarantee the ledger prints for each (one PrivacyLedger per run, the release recorded as the pipeline
records it), the ratio sigma_after / sigma_before, the step count the old sigma allows now, and the CPU seconds of
each calibration from cold caches (the joint one runs the PLD, the old one RDP). No training: the accounting only.

    python benchmarks/bench_shared_budget.py            # eps 1, 2, 5, 10 x p_dp 0.1, 0.5, 1
    python benchmarks/bench_shared_budget.py --quick    # eps 10, p_dp 0.1
"""

from __future__ import annotations

import argparse
import time

from dporl.privacy import accountants, pld
from dporl.privacy.calibration import calibrate_noise_multiplier, max_steps
from dporl.privacy.events import MixtureEvent, PoissonGaussianEvent
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.sparse_vector import stable_prefix_budget

EXPERTS, P_MIN, TRAJECTORIES, RATE, STEPS, DELTA = 1000, 0.1, 25, 0.256, 2000, 1e-5


def cold() -> None:
    accountants.rdp_curve.cache_clear()
    pld.clear_caches()


def run_guarantee(epsilon: float, release, event, steps: int, share: bool) -> tuple[float, PrivacyLedger]:
    """The guarantee the ledger prints for the release's T runs and ``steps`` training events."""
    ledger = PrivacyLedger((epsilon, DELTA))
    ledger.stage("release", budget=(epsilon / 2, DELTA / 2), mechanism="pld", unit="expert")
    ledger.record("release", release.event, TRAJECTORIES)
    ledger.stage("train", budget=(epsilon / 2, DELTA / 2), mechanism="rdp", unit="expert", shares_run_budget=share)
    ledger.authorise("train", event, steps)
    return ledger.report().guarantee[0], ledger


def case(epsilon: float, p_dp: float) -> str:
    release = stable_prefix_budget(epsilon / 2, DELTA / 2, TRAJECTORIES, P_MIN, EXPERTS)

    def make(sigma: float) -> MixtureEvent:
        return MixtureEvent(p_dp, PoissonGaussianEvent(sigma, RATE))

    cold()
    start = time.process_time()
    before = calibrate_noise_multiplier(epsilon / 2, DELTA / 2, STEPS, make_event=make, mechanism="rdp")
    seconds_before = time.process_time() - start
    guarantee_before, ledger = run_guarantee(epsilon, release, make(before), STEPS, share=False)
    target = ledger.shared_budget("train", DELTA / 2)
    cold()
    start = time.process_time()
    after = calibrate_noise_multiplier(target.epsilon, target.delta, STEPS, make_event=make, mechanism="pld",
                                       prior=target.prior)
    seconds_after = time.process_time() - start
    guarantee_after, _ = run_guarantee(epsilon, release, make(after), STEPS, share=True)
    steps = max_steps(make(before), target.epsilon, target.delta, mechanism="pld", prior=target.prior)
    guarantee_steps, _ = run_guarantee(epsilon, release, make(before), steps, share=True)
    return (
        f"| {epsilon:g} | {p_dp:g} | {before:.3f} | {guarantee_before:.3f} | {after:.3f} ({after / before:.2f}x) | "
        f"{guarantee_after:.3f} | {steps} ({steps / STEPS:.2f}x; {guarantee_steps:.3f}) | "
        f"{seconds_before:.2f} / {seconds_after:.2f} |"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    grid = [(10.0, 0.1)] if args.quick else [(e, p) for e in (1.0, 2.0, 5.0, 10.0) for p in (0.1, 0.5, 1.0)]
    print("| eps | p_dp | sigma before | guarantee before | sigma after | guarantee after | steps at the old sigma "
          "(guarantee) | calibration CPU s before / after |")
    print("|---|---|---|---|---|---|---|---|")
    for epsilon, p_dp in grid:
        print(case(epsilon, p_dp), flush=True)


if __name__ == "__main__":
    main()
