"""Calibration: dporl's step-count and noise searches against doubling + bisection and dp_accounting's own
calibration, and the tightness of dporl's answers against dp_accounting's PLD on the fine (1e-4) grid, in one run.

Tightness grid (``--grid``, also part of the full run): for q in {1e-3, 1e-2, 0.1}, steps in {1e2, ..., 1e6},
eps in {1, 10} (delta 1e-5), dporl's calibrated noise multiplier (PLD, each event on its own grid) beside
``dp_accounting.calibrate_dp_mechanism`` with its ``PLDAccountant`` at value discretisation 1e-4 (the referee;
Brent's method to a relative 5e-4, from the bracket [sigma / 1.5, 1.5 sigma] around dporl's answer, which favours
it), interleaved per point, with the ratio of the sigmas and of the CPU seconds; then the epsilon that
dp_accounting's PLD gives dporl's sigma on a grid finer than both (half of dporl's grid, at most 1e-4): the answer
must fit the budget under it. The same for step counts at a fixed sigma (the referee's sigma at that point rounded
to 3 digits, so that about that many steps fit): dporl's ``max_steps`` beside dp_accounting's discrete calibration.
Where dporl's grid is finer than 1e-4 the referee itself over-states epsilon (by ~1% at 1e6 steps, eps 1):
dporl's sigma is then below the referee's: the "finer" columns check that it still fits and give the smallest sigma
(largest count) under dp_accounting on that finer grid (bisection over its dense composition), with the ratio.

Search cost (the other sections): per case (a Poisson-subsampled Gaussian step and a budget allowing ~10^3 to
~10^6 steps), three searches for the largest step count that fits, each from cold caches (imports done once
before), in interleaved rounds:

- ``dporl``: ``dporl.privacy.calibration.max_steps`` (RDP start, extrapolation, inverse interpolation);
- ``doubling``: double from 1, then bisect, over the same accountant;
- ``dp_accounting``: ``dp_accounting.calibrate_dp_mechanism`` (Brent's method) with its PLD accountant on the
  event's own grid (the same analysis) and adjacency (add/remove), bracketing from [1, 2] by doubling gaps.

Prints the step count each found (dporl's is verified: it fits and one more step does not), the number of
accountant evaluations, and the median (min-max) CPU seconds over rounds with the ratio to dporl. Also: the noise
multiplier search (dporl vs bisection), and ``accountant: prv`` (a PLD search whose answer starts the PRV search)
against a PRV search by doubling + bisection. CPU seconds on a shared machine: the load average is printed.

    python benchmarks/bench_calibration.py            # full (tens of minutes: the referee is slow at 1e6 steps)
    python benchmarks/bench_calibration.py --grid     # the tightness grid only
    python benchmarks/bench_calibration.py --quick    # smoke test (a corner of the grid)
"""

from __future__ import annotations

import argparse
import contextlib
import math
import os
import statistics
import time
from typing import Callable

from dporl.privacy import accountants, pld
from dporl.privacy.accountants import epsilon_for, within_budget
from dporl.privacy.calibration import calibrate_noise_multiplier, max_steps
from dporl.privacy.events import PoissonGaussianEvent

DELTA = 1e-5
# (sample rate, noise multiplier, epsilon): budgets allowing about 10^3, 10^4, 10^5 and 10^6 steps
CASES = [(0.01, 1.0, 2.0), (1e-3, 1.0, 0.5), (1e-3, 1.0, 1.8), (1e-3, 1.0, 6.0)]


REFEREE_GRID = 1e-4
GRID_RATES, GRID_STEPS, GRID_EPSILONS = (1e-3, 1e-2, 0.1), (100, 1_000, 10_000, 100_000, 1_000_000), (1.0, 10.0)


def clear_caches() -> None:
    accountants.rdp_curve.cache_clear()
    pld.clear_caches()


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
    """Counts the accountant evaluations dporl's calibration makes (on the coarse grid and on the events' own)."""
    import dporl.privacy.calibration as calibration

    original = calibration._evaluate

    def counting(events, delta, analysis):
        counter.calls += 1
        return original(events, delta, analysis)

    calibration._evaluate = counting
    try:
        yield
    finally:
        calibration._evaluate = original


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
                             value_discretization_interval=pld.event_interval(event))

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


# ------------------------------------------------------------------------------------------- tightness grid
def referee_event(q: float, steps: int):
    import dp_accounting

    return lambda sigma: dp_accounting.SelfComposedDpEvent(
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), int(steps))


def referee_epsilon(q: float, sigma: float, steps: int, grid: float) -> float:
    """dp_accounting's PLD accountant (pessimistic, connect-the-dots) on ``grid``."""
    from dp_accounting.pld import PLDAccountant

    accountant = PLDAccountant(value_discretization_interval=grid)
    accountant.compose(referee_event(q, steps)(sigma))
    return accountant.get_epsilon(DELTA)


def referee_sigma(q: float, steps: int, epsilon: float, near: float, grid: float = REFEREE_GRID) -> float:
    """dp_accounting's own noise calibration on ``grid``: Brent's method from a bracket around ``near``."""
    import dp_accounting
    from dp_accounting.pld import PLDAccountant

    for spread in (1.5, 3.0, 10.0):
        bracket = dp_accounting.ExplicitBracketInterval(near / spread, near * spread)
        try:
            return float(dp_accounting.calibrate_dp_mechanism(
                lambda: PLDAccountant(value_discretization_interval=grid), referee_event(q, steps), epsilon, DELTA,
                bracket, tol=5e-4 * near))
        except ValueError:
            continue
    raise RuntimeError(f"no bracket for q={q}, steps={steps}, eps={epsilon}")


def referee_steps(q: float, sigma: float, epsilon: float, near: int, grid: float = REFEREE_GRID) -> int:
    """dp_accounting's own discrete calibration of the step count on ``grid`` (the largest that fits, to 1)."""
    import dp_accounting
    from dp_accounting.pld import PLDAccountant

    event = lambda n: dp_accounting.SelfComposedDpEvent(  # noqa: E731
        dp_accounting.PoissonSampledDpEvent(q, dp_accounting.GaussianDpEvent(sigma)), max(1, int(n)))
    for spread in (1.5, 3.0, 10.0):
        bracket = dp_accounting.ExplicitBracketInterval(max(1, int(near / spread)), int(near * spread) + 2)
        try:
            return int(dp_accounting.calibrate_dp_mechanism(
                lambda: PLDAccountant(value_discretization_interval=grid), event, epsilon, DELTA, bracket,
                discrete=True))
        except ValueError:
            continue
    raise RuntimeError(f"no bracket for q={q}, sigma={sigma}, eps={epsilon}")


def dense_referee_epsilon(q: float, sigma: float, steps: int, grid: float) -> float:
    """``referee_epsilon`` through dp_accounting's dense composition directly (its accountant's sparse path first
    computes size ** steps as an exact integer: seconds per evaluation at 1e6 steps and large sigma)."""
    from dp_accounting.pld import privacy_loss_distribution as plds

    single = plds.from_gaussian_mechanism(sigma, sampling_prob=q, value_discretization_interval=grid)
    composed = plds.PrivacyLossDistribution(single._pmf_remove.to_dense_pmf().self_compose(steps),
                                            single._pmf_add.to_dense_pmf().self_compose(steps))
    return composed.get_epsilon_for_delta(DELTA)


def finer_referee_sigma(q: float, steps: int, epsilon: float, near: float, grid: float) -> float:
    """The smallest sigma (to a relative 5e-4, fitting end) with dp_accounting's PLD on ``grid`` within epsilon."""
    low, high = near / 1.05, near * 1.05
    while dense_referee_epsilon(q, low, steps, grid) <= epsilon:
        low /= 1.05
    while dense_referee_epsilon(q, high, steps, grid) > epsilon:
        high *= 1.05
    while high / low > 1 + 5e-4:
        middle = math.sqrt(low * high)
        low, high = (middle, high) if dense_referee_epsilon(q, middle, steps, grid) > epsilon else (low, middle)
    return high


def finer_referee_steps(q: float, sigma: float, epsilon: float, near: int, grid: float) -> int:
    """The largest step count with dp_accounting's PLD on ``grid`` within epsilon (to 1)."""
    low, high = int(near / 1.05), int(near * 1.05) + 1
    while dense_referee_epsilon(q, sigma, low, grid) > epsilon:
        low = int(low / 1.05)
    while dense_referee_epsilon(q, sigma, high, grid) <= epsilon:
        high = int(high * 1.05) + 1
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if dense_referee_epsilon(q, sigma, middle, grid) <= epsilon else (low, middle)
    return low


def timed(function: Callable[[], float]) -> tuple[float, float]:
    clear_caches()
    start = time.process_time()
    answer = function()
    return answer, time.process_time() - start


def check_grid(q: float, sigma: float) -> float:
    """A grid finer than both dporl's (half of its own, nested) and the referee's."""
    return min(REFEREE_GRID, pld.event_interval(PoissonGaussianEvent(sigma, q)) / 2)


def tightness_grid(points: list[tuple[float, int, float]]) -> None:
    print(f"\nnoise multiplier, PLD, delta={DELTA}: dporl (each event on its own grid) vs dp_accounting's "
          f"calibrate_dp_mechanism on the {REFEREE_GRID:g} grid (interleaved per point; CPU seconds, cold caches); "
          f"load {os.getloadavg()[0]:.2f}")
    print(f"{'q':>6} {'steps':>8} {'eps':>4} | {'dporl':>9} {'referee':>9} {'ratio':>7} | {'grid':>8} "
          f"{'eps(dporl) finer':>17} {'finer ref':>9} {'ratio':>7} | {'dporl s':>7} {'ref s':>7} {'speed-up':>8}")
    fixed_sigmas = {}
    worst = 1.0
    for i, (q, steps, epsilon) in enumerate(points):
        make = lambda s, q=q: PoissonGaussianEvent(s, q)  # noqa: E731
        ours_first = i % 2 == 0
        if ours_first:
            ours, ours_s = timed(lambda: calibrate_noise_multiplier(epsilon, DELTA, steps, make_event=make,
                                                                    mechanism="pld"))
        guess = ours if ours_first else calibrate_noise_multiplier(epsilon, DELTA, steps, make_event=make,
                                                                    mechanism="pld")
        theirs, theirs_s = timed(lambda: referee_sigma(q, steps, epsilon, guess))
        if not ours_first:
            ours, ours_s = timed(lambda: calibrate_noise_multiplier(epsilon, DELTA, steps, make_event=make,
                                                                    mechanism="pld"))
        grid = check_grid(q, ours)
        check = referee_epsilon(q, ours, steps, grid)
        assert check <= epsilon * (1 + 1e-9), (q, steps, epsilon, ours, check)
        worst = max(worst, ours / theirs)
        fixed_sigmas[(q, steps, epsilon)] = float(f"{theirs:.3g}")
        finer = finer_referee_sigma(q, steps, epsilon, ours, grid) if grid < REFEREE_GRID else None
        _print_row(f"{q:>6g} {steps:>8d} {epsilon:>4g}", ours, theirs, ".5g", grid, check, finer, ours_s, theirs_s)
    print(f"largest ratio dporl / referee: {worst:.4f}; every dporl sigma fits under the finer grid; load "
          f"{os.getloadavg()[0]:.2f}")

    print(f"\nlargest step count, PLD, delta={DELTA}, at a fixed sigma (the referee's above, 3 digits): dporl "
          f"max_steps vs dp_accounting's discrete calibrate_dp_mechanism on the {REFEREE_GRID:g} grid; "
          f"load {os.getloadavg()[0]:.2f}")
    print(f"{'q':>6} {'sigma':>8} {'eps':>4} | {'dporl':>9} {'referee':>9} {'ratio':>7} | {'grid':>8} "
          f"{'eps(dporl) finer':>17} {'finer ref':>9} {'ratio':>7} | {'dporl s':>7} {'ref s':>7} {'speed-up':>8}")
    lowest = 1.0
    for i, (q, steps, epsilon) in enumerate(points):
        sigma = fixed_sigmas[(q, steps, epsilon)]
        event = PoissonGaussianEvent(sigma, q)
        ours_first = i % 2 == 0
        if ours_first:
            ours, ours_s = timed(lambda: max_steps(event, epsilon, DELTA, mechanism="pld"))
        guess = ours if ours_first else max_steps(event, epsilon, DELTA, mechanism="pld")
        theirs, theirs_s = timed(lambda: referee_steps(q, sigma, epsilon, guess))
        if not ours_first:
            ours, ours_s = timed(lambda: max_steps(event, epsilon, DELTA, mechanism="pld"))
        grid = check_grid(q, sigma)
        check = referee_epsilon(q, sigma, ours, grid)
        assert check <= epsilon * (1 + 1e-9), (q, sigma, epsilon, ours, check)
        lowest = min(lowest, ours / theirs)
        finer = finer_referee_steps(q, sigma, epsilon, ours, grid) if grid < REFEREE_GRID else None
        _print_row(f"{q:>6g} {sigma:>8.4g} {epsilon:>4g}", ours, theirs, "d", grid, check, finer, ours_s, theirs_s)
    print(f"smallest ratio dporl / referee: {lowest:.4f}; every dporl count fits under the finer grid; load "
          f"{os.getloadavg()[0]:.2f}")


def _print_row(point: str, ours, theirs, form: str, grid: float, check: float, finer, ours_s: float,
               theirs_s: float) -> None:
    """One row of the tightness tables: the point, both answers and their ratio, the check, the finer referee."""
    finer_text = f"{'-':>9} {'-':>7}" if finer is None else f"{finer:>9{form}} {ours / finer:>7.4f}"
    print(f"{point} | {ours:>9{form}} {theirs:>9{form}} {ours / theirs:>7.4f} | {grid:>8.3g} {check:>17.5f} "
          f"{finer_text} | {ours_s:>7.3f} {theirs_s:>7.2f} {theirs_s / max(ours_s, 1e-9):>7.1f}x", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--skip-prv", action="store_true", help="skip the PRV comparison (its baseline takes minutes)")
    parser.add_argument("--grid", action="store_true", help="the tightness grid only")
    args = parser.parse_args()
    rounds = args.rounds or (1 if args.quick else 3)
    cases = CASES[:2] if args.quick else CASES
    # Imports and one-time setup (opacus' RDP, dp_accounting's PLD, scipy) outside the timings.
    warm = PoissonGaussianEvent(2.0, 0.5)  # a few steps fit
    max_steps(warm, 2.0, DELTA, mechanism="pld")
    dp_accounting_max_steps(warm, 2.0, "pld", Counter())
    print(f"load average (1, 5, 15 min): {' '.join(f'{x:.2f}' for x in os.getloadavg())} on {os.cpu_count()} cores")
    points = [(q, n, e) for q in GRID_RATES for n in GRID_STEPS for e in GRID_EPSILONS]
    if args.quick:
        points = [(1e-3, 100, 1.0), (1e-2, 10_000, 10.0), (1e-3, 100_000, 1.0)]
    tightness_grid(points)
    if args.grid:
        return
    print(f"max_steps, PLD (each event on its own grid), delta={DELTA}, {rounds} interleaved rounds, cold caches")
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
