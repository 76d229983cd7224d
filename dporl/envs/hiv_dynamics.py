"""HIV infection dynamics (Adams et al. 2004, "Dynamic multidrug therapies for HIV: optimal and STI control
approaches"; the treatment problem of Ernst et al. 2006, "Clinical data based optimal STI strategies for HIV: a
reinforcement learning approach"): the model's constants, its right-hand side and analytic Jacobian, the scipy
reference integration, and the pieces of the Rosenbrock step ``dporl.envs.hiv.HIVVectorSimulator`` takes.

State (T1, T2, T1*, T2*, V, E); the drug efficacies (eps1 of the reverse-transcriptase inhibitor, eps2 of the
protease inhibitor) of the 4 actions are ``ACTION_EFFICACIES``. The integrator works on the logarithm of the state.
"""

from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Any

import numpy as np
from scipy.integrate import solve_ivp

from dporl.utils.validation import check_positive

STATE_NAMES = ("T1", "T2", "T1*", "T2*", "V", "E")
# Efficacies (eps1 of the reverse-transcriptase inhibitor, eps2 of the protease inhibitor) per action.
ACTION_EFFICACIES = np.array([[0.0, 0.0], [0.7, 0.0], [0.0, 0.3], [0.7, 0.3]])
# Published equilibria (Adams et al. 2004), rounded to integers in the paper.
UNHEALTHY_EQUILIBRIUM = np.array([163573.0, 5.0, 11945.0, 46.0, 63919.0, 24.0])
HEALTHY_EQUILIBRIUM = np.array([967839.0, 621.0, 76.0, 6.0, 415.0, 353108.0])


@dataclass(frozen=True)
class HIVParameters:
    """Model constants of Adams et al. 2004 (units: cells/ml, copies/ml, days)."""

    l1: float = 1e4
    d1: float = 0.01
    k1: float = 8e-7
    l2: float = 31.98
    d2: float = 0.01
    f: float = 0.34
    k2: float = 1e-4
    delta: float = 0.7
    m1: float = 1e-5
    m2: float = 1e-5
    NT: float = 100.0
    c: float = 13.0
    rho1: float = 1.0
    rho2: float = 1.0
    lE: float = 1.0
    bE: float = 0.3
    Kb: float = 100.0
    dE: float = 0.25
    Kd: float = 500.0
    deltaE: float = 0.1

    def __post_init__(self) -> None:
        for field in fields(self):
            check_positive(f"hiv.{field.name}", getattr(self, field.name))


def hiv_derivatives(y: np.ndarray, eps1: np.ndarray, eps2: np.ndarray, params: HIVParameters = HIVParameters()) -> np.ndarray:
    """dy/dt for states ``y[n, 6]`` under efficacies ``eps1[n]``, ``eps2[n]``."""
    p = params
    T1, T2, I1, I2, V, E = y.T
    infected = I1 + I2
    inf1 = (1.0 - eps1) * p.k1 * V * T1
    inf2 = (1.0 - p.f * eps1) * p.k2 * V * T2
    out = np.empty_like(y)
    out[:, 0] = p.l1 - p.d1 * T1 - inf1
    out[:, 1] = p.l2 - p.d2 * T2 - inf2
    out[:, 2] = inf1 - p.delta * I1 - p.m1 * E * I1
    out[:, 3] = inf2 - p.delta * I2 - p.m2 * E * I2
    out[:, 4] = (1.0 - eps2) * p.NT * p.delta * infected - p.c * V - (p.rho1 * inf1 + p.rho2 * inf2)
    out[:, 5] = (
        p.lE
        + p.bE * infected / (infected + p.Kb) * E
        - p.dE * infected / (infected + p.Kd) * E
        - p.deltaE * E
    )
    return out


def hiv_jacobian(y: np.ndarray, eps1: np.ndarray, eps2: np.ndarray, params: HIVParameters = HIVParameters()) -> np.ndarray:
    """Analytic d(dy/dt)/dy, ``[n, 6, 6]``."""
    p = params
    T1, T2, I1, I2, V, E = y.T
    a1 = (1.0 - eps1) * p.k1
    a2 = (1.0 - p.f * eps1) * p.k2
    infected = I1 + I2
    J = np.zeros((y.shape[0], 6, 6))
    J[:, 0, 0] = -p.d1 - a1 * V
    J[:, 0, 4] = -a1 * T1
    J[:, 1, 1] = -p.d2 - a2 * V
    J[:, 1, 4] = -a2 * T2
    J[:, 2, 0] = a1 * V
    J[:, 2, 2] = -p.delta - p.m1 * E
    J[:, 2, 4] = a1 * T1
    J[:, 2, 5] = -p.m1 * I1
    J[:, 3, 1] = a2 * V
    J[:, 3, 3] = -p.delta - p.m2 * E
    J[:, 3, 4] = a2 * T2
    J[:, 3, 5] = -p.m2 * I2
    production = (1.0 - eps2) * p.NT * p.delta
    J[:, 4, 0] = -p.rho1 * a1 * V
    J[:, 4, 1] = -p.rho2 * a2 * V
    J[:, 4, 2] = production
    J[:, 4, 3] = production
    J[:, 4, 4] = -p.c - p.rho1 * a1 * T1 - p.rho2 * a2 * T2
    # d/dI of I/(I + K) is K/(I + K)^2, shared by both infected compartments.
    dE_dI = (p.bE * p.Kb / (infected + p.Kb) ** 2 - p.dE * p.Kd / (infected + p.Kd) ** 2) * E
    J[:, 5, 2] = dE_dI
    J[:, 5, 3] = dE_dI
    J[:, 5, 5] = p.bE * infected / (infected + p.Kb) - p.dE * infected / (infected + p.Kd) - p.deltaE
    return J


def integrate_scipy(
    y0: np.ndarray,
    action: int,
    duration: float,
    *,
    method: str = "LSODA",
    rtol: float = 1e-10,
    atol: float = 1e-8,
    params: HIVParameters = HIVParameters(),
) -> np.ndarray:
    """Reference: one patient over ``duration`` days with scipy's ``solve_ivp`` (state space, analytic Jacobian)."""
    eps = ACTION_EFFICACIES[action]
    e1, e2 = np.array([eps[0]]), np.array([eps[1]])

    def rhs(_t, y):
        return hiv_derivatives(y[None], e1, e2, params)[0]

    def jac(_t, y):
        return hiv_jacobian(y[None], e1, e2, params)[0]

    implicit = {"jac": jac} if method in ("Radau", "BDF", "LSODA") else {}
    solution = solve_ivp(rhs, (0.0, duration), np.asarray(y0, dtype=float), method=method, rtol=rtol, atol=atol, **implicit)
    if not solution.success:
        raise RuntimeError(f"solve_ivp failed: {solution.message}")
    return solution.y[:, -1]


# Rosenbrock parameters of Kaps & Rentrop (1979) as chosen by Shampine (1982): order 4, embedded order 3,
# A-stable. Same constants as Numerical Recipes' `stiff`; the 4th stage reuses the 3rd stage's derivative.
_GAM = 0.5
_A21, _A31, _A32 = 2.0, 48.0 / 25.0, 6.0 / 25.0
_C21, _C31, _C32 = -8.0, 372.0 / 25.0, 12.0 / 5.0
_C41, _C42, _C43 = -112.0 / 125.0, -54.0 / 125.0, -2.0 / 5.0
_B1, _B2, _B3, _B4 = 19.0 / 9.0, 1.0 / 2.0, 25.0 / 108.0, 125.0 / 108.0
_E1, _E2, _E4 = 17.0 / 54.0, 7.0 / 36.0, 125.0 / 108.0  # error weights (the third stage's is 0)


def _components(a: np.ndarray) -> Any:
    """Rows of a [6, m] array, or Python floats of a 6-vector (scalar arithmetic is much cheaper than numpy's)."""
    return a.tolist() if a.ndim == 1 else a


def _trial_step(x: np.ndarray, drugs: Any, step: Any, p: HIVParameters, tolerance: float) -> tuple[np.ndarray, Any]:
    """One Rosenbrock step of size ``step`` from log-states ``x`` ([6, m], or [6] for one patient).

    Returns the candidate state and its error relative to ``tolerance`` (accept when <= 1; inf when a stage
    produced a non-finite value)."""
    try:
        g0, terms = _log_rates(_components(np.exp(x)), drugs, p)
        solve = _RosenbrockSolver(terms, 1.0 / (_GAM * step), p)
        inv_h = 1.0 / step
        k1 = solve(g0)
        g1 = _log_rates(_components(np.exp(x + _A21 * k1)), drugs, p)[0]
        k2 = solve(g1 + (_C21 * inv_h) * k1)
        g2 = _log_rates(_components(np.exp(x + _A31 * k1 + _A32 * k2)), drugs, p)[0]
        k3 = solve(g2 + inv_h * (_C31 * k1 + _C32 * k2))
        k4 = solve(g2 + inv_h * (_C41 * k1 + _C42 * k2 + _C43 * k3))
    except (ZeroDivisionError, OverflowError):  # scalar path only: a component under/overflowed
        return x, np.inf
    error = np.abs(_E1 * k1 + _E2 * k2 + _E4 * k4).max(axis=0) / tolerance
    error = np.where(np.isfinite(error), error, np.inf)
    return x + _B1 * k1 + _B2 * k2 + _B3 * k3 + _B4 * k4, error


def _next_step_size(error: Any, step: Any, h: Any) -> Any:
    """Standard controller: grow by err^(-1/4) (order 4) after success, shrink by err^(-1/3) after failure.

    A step shortened to land on the interval's end (step < h) says little about the next step size: keep h."""
    grow = np.maximum(step * np.minimum(np.maximum(0.9 * error**-0.25, 0.2), 5.0), np.where(step < h, h, 0.0))
    shrink = step * np.minimum(np.maximum(0.9 * error ** (-1.0 / 3.0), 0.1), 0.5)
    return np.where(error <= 1.0, grow, shrink)


def _drug_coefficients(e1: np.ndarray, e2: np.ndarray, p: HIVParameters) -> np.ndarray:
    """Per-patient coefficients fixed over an interval, ``[5, m]``: infection rates (1 - eps1) k1 and
    (1 - f eps1) k2, virion production (1 - eps2) NT delta, and the infection rates times rho1, rho2."""
    a1 = (1.0 - e1) * p.k1
    a2 = (1.0 - p.f * e1) * p.k2
    return np.stack([a1, a2, (1.0 - e2) * (p.NT * p.delta), p.rho1 * a1, p.rho2 * a2])


def _log_rates(y: Any, drugs: Any, p: HIVParameters) -> tuple[np.ndarray, dict]:
    """d(log y)/dt, ``[6, m]`` (or ``[6]``), from the 6 components of the state y (rows of a component-major
    [6, m] array, or floats), and the terms the Jacobian reuses."""
    T1, T2, I1, I2, V, E = y
    a1, a2, production, ra1, ra2 = drugs
    infected = I1 + I2
    a1V, a2V = a1 * V, a2 * V  # infection rate per healthy cell
    u1, u2 = a1V * T1 / I1, a2V * T2 / I2  # new infected cells per infected cell
    rates = np.array([
        p.l1 / T1 - p.d1 - a1V,
        p.l2 / T2 - p.d2 - a2V,
        u1 - p.delta - p.m1 * E,
        u2 - p.delta - p.m2 * E,
        production * infected / V - p.c - ra1 * T1 - ra2 * T2,
        p.lE / E + p.bE * infected / (infected + p.Kb) - p.dE * infected / (infected + p.Kd) - p.deltaE,
    ])
    terms = dict(y=y, drugs=drugs, a1V=a1V, a2V=a2V, u1=u1, u2=u2, infected=infected)
    return rates, terms


class _RosenbrockSolver:
    """Solves (s I - G) k = b for every patient, G = d(log-rates)/d(log-state), by block elimination.

    G's sparsity (T1, T2 couple only to V; T1*, T2* to their T, V and E; V to everything but E; E to T1*, T2*)
    leaves a 2x2 system in (V, E) after eliminating T1, T2, T1*, T2*. The eliminated pivots
    s + l1/T1, s + l2/T2, s + u1, s + u2 are all > s > 0, so no pivoting is needed. A test checks the result
    against a dense solve built from ``hiv_jacobian``.
    """

    def __init__(self, terms: dict, s: np.ndarray, p: HIVParameters):
        T1, T2, I1, I2, V, E = terms["y"]
        u1, u2 = terms["u1"], terms["u2"]
        infected = terms["infected"]
        # Nonzero entries m_ij of M = s I - G (derived from G_ij = J_ij y_j / y_i - delta_ij f_i / y_i).
        self.inv00 = 1.0 / (s + p.l1 / T1)
        self.inv11 = 1.0 / (s + p.l2 / T2)
        self.inv22 = 1.0 / (s + u1)
        self.inv33 = 1.0 / (s + u2)
        self.u1, self.u2 = u1, u2  # m20 = m24 = -u1, m31 = m34 = -u2
        _, _, production, ra1, ra2 = terms["drugs"]
        self.m40 = ra1 * T1
        self.m41 = ra2 * T2
        self.m42 = -production * I1 / V
        self.m43 = -production * I2 / V
        m44 = s + production * infected / V
        saturation = p.bE * p.Kb / (infected + p.Kb) ** 2 - p.dE * p.Kd / (infected + p.Kd) ** 2
        self.m52, self.m53 = -saturation * I1, -saturation * I2
        m55 = s + p.lE / E
        # x0 = p0 + q0 x4, x1 = p1 + q1 x4, x2 = p2 + q2 x4 + r2 x5, x3 = p3 + q3 x4 + r3 x5.
        self.q0 = -terms["a1V"] * self.inv00
        self.q1 = -terms["a2V"] * self.inv11
        self.q2 = u1 * (1.0 + self.q0) * self.inv22
        self.q3 = u2 * (1.0 + self.q1) * self.inv33
        self.r2 = -p.m1 * E * self.inv22
        self.r3 = -p.m2 * E * self.inv33
        # 2x2 system in (x4, x5): [A B; C D].
        self.A = self.m40 * self.q0 + self.m41 * self.q1 + self.m42 * self.q2 + self.m43 * self.q3 + m44
        self.B = self.m42 * self.r2 + self.m43 * self.r3
        self.C = self.m52 * self.q2 + self.m53 * self.q3
        self.D = self.m52 * self.r2 + self.m53 * self.r3 + m55
        self.inv_det = 1.0 / (self.A * self.D - self.B * self.C)

    def __call__(self, b: np.ndarray) -> np.ndarray:
        b = _components(b)
        p0 = b[0] * self.inv00
        p1 = b[1] * self.inv11
        p2 = (b[2] + self.u1 * p0) * self.inv22
        p3 = (b[3] + self.u2 * p1) * self.inv33
        c4 = b[4] - self.m40 * p0 - self.m41 * p1 - self.m42 * p2 - self.m43 * p3
        c5 = b[5] - self.m52 * p2 - self.m53 * p3
        x4 = (c4 * self.D - self.B * c5) * self.inv_det
        x5 = (self.A * c5 - self.C * c4) * self.inv_det
        return np.array([
            p0 + self.q0 * x4, p1 + self.q1 * x4, p2 + self.q2 * x4 + self.r2 * x5, p3 + self.q3 * x4 + self.r3 * x5, x4, x5
        ])
