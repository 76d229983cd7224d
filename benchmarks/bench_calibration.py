"""Calibration speed: dporl's step-count and noise searches against doubling + bisection and dp_accounting's own
calibration, in one run, on the same analysis.

Per case (a Poisson-subsampled Gaussian step and a budget allowing ~10^3 to ~10^6 steps), three searches for the
largest step count that fits, each from cold caches (imports done once before), in interleaved rounds:

- ``dporl``: ``dporl.privacy.calibration.max_steps`` (RDP start, extrapolation, inverse interpolation);
- ``doubling``: the search dporl used before (double from 1, then bisect) over the same accountant;
- ``dp_accounting``: ``dp_accounting.calibrate_dp_mechanism`` (Brent's method) with its PLD accountant at the
  same discretisation (1e-3) and adjacency (add/remove), bracketing from [1, 2] by doubling gaps.

Prints the step count each found (dporl's is verified: it fits and one more step does not), the number of
accountant evaluations, and the median (min-max) CPU seconds over rounds with the ratio to dporl. Also: the noise
multiplier search (dporl vs bisection), and ``accountant: prv`` (a PLD search whose answer starts the PRV search)
against a PRV search by doubling + bisection.

    python benchmarks/bench_calibration.py            # full (a few minutes)
    python benchmarks/bench_calibration.py --quick    # smoke test
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import time
from typing import Callable

from dporl.privacy import accountants
from dporl.privacy.accountants import epsilon_for, within_budget
from dporl.privacy.calibration import calibrate_noise_multiplier, max_steps
from dporl.privacy.events import PoissonGaussianEvent

DELTA = 1e-5
# (sample rate, noise multiplier, epsilon): budgets allowing about 10^3, 10^4, 10^5 and 10^6 steps
CASES = [(0.01, 1.0, 2.0), (1e-3, 1.0, 0.5), (1e-3, 1.0, 1.8), (1e-3, 1.0, 6.0)]


def clear_caches() -> None:
    accountants.rdp_curve.cache_clear()
    accountants.event_pld.cache_clear()
    accountants._COMPOSED_PLDS.clear()


class Counter:
    def __init__(self) -> None:
        self.calls = 0


def doubling_max_steps(event, epsilon: float, mechanism: str, counter: Counter) -> int:
    """The search dporl used before: double from 1 until it no longer fits, then bisect."""

    def fits(n: int) -> bool:
        counter.calls += 1
        return within_budget(epsilon_for([(event, n)], DELTA, mechanism), epsilon)

    if not fits(1):
        return 0
    good, bad = 1, None
    while bad is None:
        if fits(2 * good):
            good = 2 * good
        else:
            bad = 2 * good
    while bad - good > 1:
        middle = (good + bad) // 2
        good, bad = (middle, bad) if fits(middle) else (good, middle)
    return good


@contextlib.contextmanager
def counting_evaluations(counter: Counter):
    """Counts the accountant evaluations dporl's calibration makes."""
    import dporl.privacy.calibration as calibration

    original = calibration.epsilon_for

    def counting(events, delta, analysis):
        counter.calls += 1
        return original(events, delta, analysis)

    calibration.epsilon_for = counting
    try:
        yield
    finally:
        calibration.epsilon_for = original


def dporl_max_steps(event, epsilon: float, mechanism: str, counter: Counter) -> int:
    with counting_evaluations(counter):
        return max_steps(event, epsilon, DELTA, mechanism=mechanism)


def dp_accounting_max_steps(event, epsilon: float, mechanism: str, counter: Counter) -> int:
    import dp_accounting
    from dp_accounting.pld import PLDAccountant

    def make_event(n: int):
        counter.calls += 1
        step = dp_accounting.PoissonSampledDpEvent(event.sample_rate, dp_accounting.GaussianDpEvent(event.noise_multiplier))
        return dp_accounting.SelfComposedDpEvent(step, n)

    def make_accountant():
        return PLDAccountant(dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE,
                             value_discretization_interval=accountants.PLD_DISCRETIZATION)

    # Its bracket search from [1, 2] (its default starts at 0 steps, which its event builder refuses).
    bracket = dp_accounting.LowerEndpointAndGuess(1, 2)
    return int(dp_accounting.calibrate_dp_mechanism(make_accountant, make_event, epsilon, DELTA, bracket, discrete=True))


def bisection_sigma(epsilon: float, steps: int, rate: float, mechanism: str, counter: Counter) -> float:
    """The noise search dporl used before: bracket from sigma = 1 by factors of 4, bisect in log space to 1e-3."""

    def fits(sigma: float) -> bool:
        counter.calls += 1
        return within_budget(epsilon_for([(PoissonGaussianEvent(sigma, rate), steps)], DELTA, mechanism), epsilon)

    low, high = 1.0, 1.0
    if fits(1.0):
        while fits(low):
            high, low = low, low / 4
    else:
        while not fits(high):
            low, high = high, high * 4
    while high / low > 1.001:
        middle = math.sqrt(low * high)
        low, high = (low, middle) if fits(middle) else (middle, high)
    return high


def dporl_sigma(epsilon: float, steps: int, rate: float, mechanism: str, counter: Counter) -> float:
    with counting_evaluations(counter):
        return calibrate_noise_multiplier(epsilon, DELTA, steps, make_event=lambda s: PoissonGaussianEvent(s, rate),
                                          mechanism=mechanism)


def measure(methods: dict[str, Callable[[Counter], float]], rounds: int) -> dict[str, tuple[list[float], float, int]]:
    """{name: (seconds per round, answer, evaluations)}; methods interleaved, rotating, caches cleared before each."""
    results: dict[str, tuple[list[float], float, int]] = {}
    names = list(methods)
    for r in range(rounds):
        shift = r % len(names)
        for name in names[shift:] + names[:shift]:
            clear_caches()
            counter = Counter()
            start = time.process_time()  # CPU time: on a shared machine wall time counts the neighbours too
            answer = methods[name](counter)
            seconds = time.process_time() - start
            times = results.get(name, ([], answer, counter.calls))[0]
            results[name] = (times + [seconds], answer, counter.calls)
    return results


def print_results(title: str, results, reference: str, fmt: str = "{:d}") -> None:
    print(title, flush=True)
    base = statistics.median(results[reference][0])
    for name, (times, answer, calls) in results.items():
        median = statistics.median(times)
        print(f"  {name:28s} answer {fmt.format(answer):>12s}  evaluations {calls:4d}  "
              f"{median:8.3f} s ({min(times):.3f}-{max(times):.3f})  {median / base:7.2f}x dporl's time", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--skip-prv", action="store_true", help="skip the PRV comparison (its baseline takes minutes)")
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    cases = CASES[:2] if args.quick else CASES
    # Imports and one-time setup (opacus' RDP, dp_accounting's PLD, scipy) outside the timings.
    warm = PoissonGaussianEvent(2.0, 0.5)  # a few steps fit
    max_steps(warm, 2.0, DELTA, mechanism="pld")
    dp_accounting_max_steps(warm, 2.0, "pld", Counter())
    print(f"max_steps, PLD (discretisation {accountants.PLD_DISCRETIZATION}), delta={DELTA}, {rounds} interleaved "
          "rounds, cold caches")
    for rate, sigma, epsilon in cases:
        event = PoissonGaussianEvent(sigma, rate)
        results = measure({
            "dporl": lambda c: dporl_max_steps(event, epsilon, "pld", c),
            "doubling + bisection": lambda c: doubling_max_steps(event, epsilon, "pld", c),
            "dp_accounting calibrate": lambda c: dp_accounting_max_steps(event, epsilon, "pld", c),
        }, rounds)
        n = results["dporl"][1]
        assert epsilon_for([(event, n)], DELTA, "pld") <= epsilon < epsilon_for([(event, n + 1)], DELTA, "pld")
        print_results(f"q={rate:g}, sigma={sigma:g}, eps={epsilon:g} (dporl's answer verified: fits, +1 does not)",
                      results, "dporl")
    rate, steps, epsilon = 1e-3, (2_000 if args.quick else 20_000), 1.0
    results = measure({
        "dporl": lambda c: dporl_sigma(epsilon, steps, rate, "pld", c),
        "bisection": lambda c: bisection_sigma(epsilon, steps, rate, "pld", c),
    }, rounds)
    print_results(f"noise multiplier for eps={epsilon:g} over {steps} steps at q={rate:g}, PLD", results, "dporl",
                  "{:.5g}")
    if not args.skip_prv and not args.quick:
        rate, sigma, epsilon = 1e-3, 1.0, 1.8
        event = PoissonGaussianEvent(sigma, rate)
        results = measure({
            "dporl (PLD, then PRV search)": lambda c: dporl_max_steps(event, epsilon, "prv", c),
            "doubling + bisection, PRV": lambda c: doubling_max_steps(event, epsilon, "prv", c),
        }, 1)
        print_results(f"max_steps with accountant prv, q={rate:g}, sigma={sigma:g}, eps={epsilon:g}", results,
                      "dporl (PLD, then PRV search)")


if __name__ == "__main__":
    main()
