"""Cheap analytic expert families: hand-designed controllers with gains varied per expert and per setting.

These are STAND-INS for the paper's PPO experts (Sharma et al. 2024 train 3000 PPO actors per environment).
They cost milliseconds instead of GPU-days, are deterministic given a seed, and behave like a pool of
competent-but-different experts, which is what the stable-prefix release and expert-level DP-SGD consume. Measured
quality is reported by the ``dataset`` pipeline (mean logged return) and in the EXPERTS report.

Every family but LunarLander's returns a ``StackedLinearPolicy`` whose logits are ``logit_scale * u(s) * c`` for a
scalar control signal ``u(s) = k . s + k0`` and a fixed action code ``c`` (CartPole: [-1, +1] for push left/right;
Acrobot: [-1, 0, +1] for torque -1/0/+1; HIV: [0, -1, 0, +1] over none/RTI/PI/both), so the sign of ``u`` picks the
action. The ``"argmax"`` p_min softening of ``ExpertSet`` only uses that argmax; ``logit_scale`` matters only for the
raw softmax (``softening="none"``).

- CartPole-v1: discrete-time LQR on the cart-pole linearised about the upright position, for each expert's physics
  setting (gravity, force_mag, masscart; other constants from Gymnasium's CartPole), with state weights Q drawn
  log-uniformly per expert. The bang-bang action is the sign of the LQR force. Riccati equations for all experts are
  solved together by the structure-preserving doubling algorithm (batched, quadratic convergence).
- Acrobot-v1: energy-pumping-style rule "torque in the direction of the second joint's velocity" plus small random
  feedback on the first joint's velocity and the links' sines, drawn per expert. Physics does not enter the gains;
  per-setting specialisation comes only from keeping the best candidates on each setting (``generate.py``).
- dporl/HIVTreatment-v0: "both drugs while log10 V - log10 E > c, otherwise RTI only", with the switch point c drawn
  per expert. On the paper's 20-day x 50-step setting (c = 1) this rule's return is 2.24e6, against 1.76e6 for both
  drugs throughout and 0.86e6 without treatment (measured). The drug costs R1, R2 of a setting do not enter; as for
  Acrobot, selection on the setting does.

- LunarLander-v3: Gymnasium's heuristic lander controller (``gymnasium.envs.box2d.lunar_lander.heuristic``: aim
  the angle at the pad, hover at a height proportional to the horizontal offset, damp the fall once a leg touches)
  with its nine gains scaled by log-uniform factors in [1/LANDER_GAIN_SPREAD, LANDER_GAIN_SPREAD] and its two
  engine thresholds drawn uniformly from LANDER_THRESHOLD_RANGE, per expert (``StackedLanderHeuristic``: piecewise,
  not linear). Physics does not enter the gains; selection on the setting does, as for Acrobot.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import numpy as np
import torch

from dporl.experts.policies import LANDER_HEURISTIC_GAINS, StackedLanderHeuristic, StackedLinearPolicy, StackedPolicy
from dporl.utils.validation import ValidationError

# Gymnasium CartPole-v1 constants that the expert-level paper does not vary.
CARTPOLE_DEFAULTS = {"gravity": 9.8, "masscart": 1.0, "masspole": 0.1, "length": 0.5, "force_mag": 10.0, "tau": 0.02}
# Log-uniform ranges of the LQR state weights (x, x_dot, theta, theta_dot); R = 1. Angle dominates, as it must for
# balancing; the cart terms keep the cart inside +-2.4.
CARTPOLE_Q_RANGES = ((0.01, 1.0), (0.01, 1.0), (1.0, 100.0), (0.1, 10.0))
# Uniform ranges of the Acrobot gains on (cos1, sin1, cos2, sin2, dtheta1, dtheta2); dtheta2 has gain 1.
# The hand-tuned rule u = dtheta2 swings up in ~80 steps on the default physics; these perturbations stay near it.
ACROBOT_GAIN_RANGES = ((0.0, 0.0), (0.0, 0.3), (0.0, 0.0), (-0.3, 0.0), (-0.2, 0.05), (1.0, 1.0))
# HIV observation = log10 (T1, T2, T1*, T2*, V, E); the switch point c of "both drugs while log V - log E > c".
HIV_VIRUS, HIV_EFFECTORS = 4, 5
HIV_SWITCH_RANGE = (0.0, 2.0)
# LunarLander heuristic: each gain times a log-uniform factor in [1/spread, spread]; thresholds uniform in the range.
LANDER_GAIN_SPREAD = 2.0
LANDER_THRESHOLD_RANGE = (0.01, 0.2)


def cartpole_linearisation(settings: Sequence[Mapping[str, float]]) -> tuple[np.ndarray, np.ndarray]:
    """Discrete-time (A [S, 4, 4], B [S, 4, 1]) of Gymnasium's cart-pole about upright, force in units of force_mag.

    Gymnasium's dynamics with M = masscart + masspole, l = length (half pole), m = masspole:
    theta_acc = (g sin th - cos th * temp) / (l (4/3 - m cos^2 th / M)), temp = (F + m l th_dot^2 sin th) / M,
    x_acc = temp - m l theta_acc cos th / M. At th = 0 with L = l (4/3 - m / M):
    theta_acc = (g / L) th - F / (M L),   x_acc = -(m l g / (M L)) th + (F / M)(1 + m l / (M L)).
    Euler step of length tau, as the environment integrates.
    """
    params = {name: np.array([_setting_value(s, name, i) for i, s in enumerate(settings)]) for name in CARTPOLE_DEFAULTS}
    g, l, m = params["gravity"], params["length"], params["masspole"]
    total = params["masscart"] + m
    effective = l * (4.0 / 3.0 - m / total)
    count = len(settings)
    a_c = np.zeros((count, 4, 4))
    a_c[:, 0, 1] = 1.0
    a_c[:, 1, 2] = -m * l * g / (total * effective)
    a_c[:, 2, 3] = 1.0
    a_c[:, 3, 2] = g / effective
    b_c = np.zeros((count, 4, 1))
    b_c[:, 1, 0] = (1.0 + m * l / (total * effective)) / total
    b_c[:, 3, 0] = -1.0 / (total * effective)
    tau = params["tau"][:, None, None]
    a = np.eye(4)[None] + tau * a_c
    b = tau * b_c * params["force_mag"][:, None, None]
    return a, b


def discrete_lqr_gains(a: np.ndarray, b: np.ndarray, q: np.ndarray, r: np.ndarray, iterations: int = 60) -> np.ndarray:
    """Batched infinite-horizon discrete LQR gains K [E, n_u, n] (u = -K x) by structure-preserving doubling.

    a [E, n, n], b [E, n, n_u], q [E, n, n] (psd), r [E, n_u, n_u] (pd). Doubling (Chu et al. 2004) converges
    quadratically, so ~30 iterations reach machine precision for stabilisable systems; we iterate to convergence.
    """
    eye = np.eye(a.shape[-1])[None]
    a_k = a.copy()
    g_k = b @ np.linalg.solve(r, np.swapaxes(b, 1, 2))
    h_k = q.copy()
    for _ in range(iterations):
        w = np.linalg.inv(eye + g_k @ h_k)
        a_next = a_k @ w @ a_k
        g_next = g_k + a_k @ w @ g_k @ np.swapaxes(a_k, 1, 2)
        h_next = h_k + np.swapaxes(a_k, 1, 2) @ h_k @ w @ a_k
        converged = np.max(np.abs(h_next - h_k)) <= 1e-10 * max(1.0, float(np.max(np.abs(h_next))))
        a_k, g_k, h_k = a_next, g_next, h_next
        if converged:
            break
    else:
        raise ValidationError("lqr", "Riccati doubling did not converge (is the system stabilisable?)")
    p = 0.5 * (h_k + np.swapaxes(h_k, 1, 2))
    bt = np.swapaxes(b, 1, 2)
    return np.linalg.solve(r + bt @ p @ b, bt @ p @ a)


def cartpole_lqr_experts(
    settings: Sequence[Mapping[str, float]], experts_per_setting: int, seed: int, logit_scale: float = 1.0
) -> tuple[StackedLinearPolicy, dict[str, list]]:
    """``experts_per_setting`` LQR bang-bang controllers per physics setting (setting-major order)."""
    rng = np.random.default_rng(seed)
    count = len(settings) * experts_per_setting
    setting_of = np.repeat(np.arange(len(settings)), experts_per_setting)
    log_q = np.stack([rng.uniform(np.log(lo), np.log(hi), count) for lo, hi in CARTPOLE_Q_RANGES], axis=1)
    q = np.zeros((count, 4, 4))
    q[:, np.arange(4), np.arange(4)] = np.exp(log_q)
    a, b = cartpole_linearisation(settings)
    gains = discrete_lqr_gains(a[setting_of], b[setting_of], q, np.ones((count, 1, 1)))[:, 0, :]  # [E, 4]
    # u = -K s: push right (action 1) when u > 0.
    return _signed_linear_policy(-gains, np.array([-1.0, 1.0]), logit_scale), {
        "setting": setting_of.tolist(),
        "q_diagonal": np.exp(log_q).round(6).tolist(),
    }


def acrobot_pumping_experts(
    settings: Sequence[Mapping[str, float]], experts_per_setting: int, seed: int, logit_scale: float = 1.0
) -> tuple[StackedLinearPolicy, dict[str, list]]:
    """``experts_per_setting`` perturbed pumping rules per setting; the settings only fix the count and order."""
    rng = np.random.default_rng(seed)
    count = len(settings) * experts_per_setting
    gains = np.stack([rng.uniform(lo, hi, count) for lo, hi in ACROBOT_GAIN_RANGES], axis=1)
    return _signed_linear_policy(gains, np.array([-1.0, 0.0, 1.0]), logit_scale), {
        "setting": np.repeat(np.arange(len(settings)), experts_per_setting).tolist(),
        "gains": gains.round(6).tolist(),
    }


def hiv_switching_experts(
    settings: Sequence[Mapping[str, float]], experts_per_setting: int, seed: int, logit_scale: float = 1.0
) -> tuple[StackedLinearPolicy, dict[str, list]]:
    """Per expert: u = log10 V - log10 E - c; both drugs (action 3) if u > 0, RTI only (action 1) if u < 0.

    Action code [0, -1, 0, +1] over (none, RTI, PI, both): no drug and PI-only keep logit 0 and never win unless
    u is exactly 0.
    """
    rng = np.random.default_rng(seed)
    count = len(settings) * experts_per_setting
    gains = np.zeros((count, 6))
    gains[:, HIV_VIRUS], gains[:, HIV_EFFECTORS] = 1.0, -1.0
    switch = rng.uniform(*HIV_SWITCH_RANGE, count)
    return _signed_linear_policy(gains, np.array([0.0, -1.0, 0.0, 1.0]), logit_scale, offsets=-switch), {
        "setting": np.repeat(np.arange(len(settings)), experts_per_setting).tolist(),
        "switch": switch.round(6).tolist(),
    }


def lunar_lander_heuristic_experts(
    settings: Sequence[Mapping[str, float]], experts_per_setting: int, seed: int, logit_scale: float = 1.0
) -> tuple[StackedLanderHeuristic, dict[str, list]]:
    """``experts_per_setting`` perturbed heuristic landers per setting; the settings only fix the count and order."""
    rng = np.random.default_rng(seed)
    count = len(settings) * experts_per_setting
    names = list(LANDER_HEURISTIC_GAINS)
    gains = np.tile(np.array([LANDER_HEURISTIC_GAINS[n] for n in names]), (count, 1))
    thresholds = np.array([n.endswith("_threshold") for n in names])
    log_spread = np.log(LANDER_GAIN_SPREAD)
    gains[:, ~thresholds] *= np.exp(rng.uniform(-log_spread, log_spread, (count, int((~thresholds).sum()))))
    gains[:, thresholds] = rng.uniform(*LANDER_THRESHOLD_RANGE, (count, int(thresholds.sum())))
    return StackedLanderHeuristic.from_gains(torch.as_tensor(gains, dtype=torch.float32), logit_scale), {
        "setting": np.repeat(np.arange(len(settings)), experts_per_setting).tolist(),
        "gains": gains.round(6).tolist(),
    }


AnalyticFamily = Callable[..., tuple[StackedPolicy, dict[str, list]]]
ANALYTIC_FAMILIES: dict[str, AnalyticFamily] = {
    "CartPole-v1": cartpole_lqr_experts,
    "Acrobot-v1": acrobot_pumping_experts,
    "LunarLander-v3": lunar_lander_heuristic_experts,
    "dporl/HIVTreatment-v0": hiv_switching_experts,
}


def analytic_experts(
    env_id: str, settings: Sequence[Mapping[str, float]], experts_per_setting: int, seed: int, logit_scale: float = 1.0
) -> tuple[StackedPolicy, dict[str, list]]:
    """Dispatch to the analytic family of ``env_id``; returns the stacked policy and per-expert provenance."""
    if env_id not in ANALYTIC_FAMILIES:
        raise ValidationError("env_id", f"no analytic expert family for {env_id!r} (have: {sorted(ANALYTIC_FAMILIES)}); "
                              "use the PPO family")
    if experts_per_setting < 1 or not settings:
        raise ValidationError("experts_per_setting", "need at least one setting and one expert per setting")
    return ANALYTIC_FAMILIES[env_id](settings, experts_per_setting, seed, logit_scale)


def _signed_linear_policy(gains: np.ndarray, action_code: np.ndarray, logit_scale: float,
                          offsets: np.ndarray | None = None) -> StackedLinearPolicy:
    """logits = logit_scale * (gains . s + offset) * action_code: weight [E, d, A] and bias [E, A] outer products."""
    offsets = np.zeros(len(gains)) if offsets is None else offsets
    weight = logit_scale * gains[:, :, None] * action_code[None, None, :]
    bias = logit_scale * offsets[:, None] * action_code[None, :]
    return StackedLinearPolicy.from_weights(torch.as_tensor(weight, dtype=torch.float32),
                                            torch.as_tensor(bias, dtype=torch.float32))


def _setting_value(setting: Mapping[str, Any], name: str, index: int) -> float:
    value = setting.get(name, CARTPOLE_DEFAULTS[name])
    try:
        return float(value)
    except (TypeError, ValueError):
        raise ValidationError(f"settings[{index}].{name}", f"expected a number, got {value!r}") from None
