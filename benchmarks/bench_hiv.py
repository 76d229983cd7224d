"""Throughput of the batched HIV simulator against scipy's solve_ivp one patient at a time, in one run.

Both integrate the same patients under the same random treatment sequences (5-day intervals). The baseline is
what public single-patient HIV envs do: scipy's LSODA called once per patient-step on a plain-Python scalar
right-hand side (cheaper per call than the library's batched numpy one). Accuracy of both is measured against
LSODA at rtol 1e-10 on a sample of intervals, so the speed-up is quoted at matched (or better) accuracy.
Timings are CPU seconds of this process (time.process_time: everything here is single-threaded), so the
numbers mean "per core" and survive a shared machine; on an idle machine they equal wall-clock.

    python benchmarks/bench_hiv.py            # 4000 patients x 20 steps
    python benchmarks/bench_hiv.py --quick    # smoke test (seconds)
    python benchmarks/bench_hiv.py --plot hiv_throughput.png   # also plot throughput against batch size
"""

from __future__ import annotations

import argparse
import time

import numpy as np
from scipy.integrate import solve_ivp

from dporl.envs.hiv import ACTION_EFFICACIES, HIVParameters, HIVVectorSimulator, integrate_scipy


def simulate_vectorised(n_patients: int, actions: np.ndarray, tolerance: float) -> tuple[float, list[np.ndarray]]:
    sim = HIVVectorSimulator(n_patients, tolerance=tolerance)
    states = [sim.state]
    start = time.process_time()
    for step_actions in actions:
        sim.step(step_actions[:n_patients])
        states.append(sim.state)
    return time.process_time() - start, states


def scalar_rhs(_t, y, eps1, eps2, p=HIVParameters()):
    """Adams et al. 2004's equations for one patient in plain Python (the baseline's right-hand side)."""
    T1, T2, I1, I2, V, E = y
    infected = I1 + I2
    inf1 = (1.0 - eps1) * p.k1 * V * T1
    inf2 = (1.0 - p.f * eps1) * p.k2 * V * T2
    return [
        p.l1 - p.d1 * T1 - inf1,
        p.l2 - p.d2 * T2 - inf2,
        inf1 - p.delta * I1 - p.m1 * E * I1,
        inf2 - p.delta * I2 - p.m2 * E * I2,
        (1.0 - eps2) * p.NT * p.delta * infected - p.c * V - (p.rho1 * inf1 + p.rho2 * inf2),
        p.lE + p.bE * infected / (infected + p.Kb) * E - p.dE * infected / (infected + p.Kd) * E - p.deltaE * E,
    ]


def simulate_scipy(n_patients: int, actions: np.ndarray, rtol: float, atol: float) -> tuple[float, list[np.ndarray]]:
    states = [np.tile(HIVVectorSimulator(1).state, (n_patients, 1))]
    start = time.process_time()
    for step_actions in actions:
        after = []
        for i in range(n_patients):
            eps1, eps2 = ACTION_EFFICACIES[step_actions[i]]
            solution = solve_ivp(scalar_rhs, (0.0, 5.0), states[-1][i], method="LSODA", rtol=rtol, atol=atol,
                                 args=(eps1, eps2))
            after.append(solution.y[:, -1])
        states.append(np.stack(after))
    return time.process_time() - start, states


def interval_error(states: list[np.ndarray], actions: np.ndarray, samples: int) -> float:
    """Largest relative error of one interval against LSODA at rtol 1e-10, restarted from the method's own state."""
    worst = 0.0
    for t in range(min(samples, len(actions))):
        for i in range(min(2, states[t].shape[0])):
            reference = integrate_scipy(states[t][i], int(actions[t, i]), 5.0)
            worst = max(worst, float(np.max(np.abs(states[t + 1][i] / reference - 1.0))))
    return worst


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--patients", type=int, default=4000)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--tolerance", type=float, default=1e-5, help="simulator's local error tolerance (log-state)")
    parser.add_argument("--baseline-patients", type=int, default=10)
    parser.add_argument("--baseline-rtol", type=float, default=1e-6)
    parser.add_argument("--plot", default=None, help="write a PNG of throughput against the number of patients")
    args = parser.parse_args()
    if args.quick:
        args.patients, args.steps, args.baseline_patients = 200, 4, 2
    rng = np.random.default_rng(0)
    actions = rng.integers(0, 4, size=(args.steps, args.patients))

    print(f"HIV simulator, 5-day intervals, {args.steps} steps, random actions")
    print(f"{'method':<44}{'patients':>9}{'patient-steps/cpu-s':>21}{'max rel err':>13}")
    rates = {}
    sizes = sorted({1, min(10, args.patients), min(100, args.patients), min(1000, args.patients), args.patients})
    for n in sizes:
        elapsed, states = simulate_vectorised(n, actions, args.tolerance)
        rates[n] = n * args.steps / elapsed
        error = interval_error(states, actions, samples=3)
        print(f"{f'HIVVectorSimulator (tol {args.tolerance:g})':<44}{n:>9}{rates[n]:>21,.0f}{error:>13.1e}")
    n = args.baseline_patients
    elapsed, states = simulate_scipy(n, actions, args.baseline_rtol, atol=1e-6)
    baseline = n * args.steps / elapsed
    error = interval_error(states, actions, samples=3)
    print(f"{f'solve_ivp LSODA per patient (rtol {args.baseline_rtol:g})':<44}{n:>9}{baseline:>21,.0f}{error:>13.1e}")
    print(f"speed-up of the batched simulator ({args.patients} patients) over solve_ivp: "
          f"{rates[args.patients] / baseline:.1f}x")
    if args.plot:
        from dporl.logging import plot_lines

        series = {
            "HIVVectorSimulator": (sizes, [rates[n] for n in sizes], None),
            "solve_ivp LSODA, one patient at a time": (sizes, [baseline] * len(sizes), None),
        }
        path = plot_lines(args.plot, series, xlabel="patients simulated together", ylabel="patient-steps per CPU second",
                          title="HIV simulator throughput (5-day steps)", logx=True, logy=True)
        print(f"plot: {path}")


if __name__ == "__main__":
    main()
