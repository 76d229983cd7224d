"""The problems of the private OPE benchmark suite: logged datasets whose target policy has a known value.

Each ``SuiteProblem`` draws independent logged datasets (``sample``), knows the target's true value (``truth``),
and states the public facts a user of that data would declare (``declared``: the value or reward range, horizon,
minimum logging propensity, episodes per unit) and a practical unit clip below the public maximum (``clip``):

- ``chain``: the treatment chain of dporl's table example (``dporl.eval.ope_coverage.TreatmentChain``): 1000
  clinicians x 4 episodes, each clinician treating with its own probability in [0.2, 0.8]; the target treats with
  probability 0.8 in every state; exact truth by backward induction.
- ``digits``: a supervised-to-bandit problem (Dudik, Langford, Li 2011) on scikit-learn's ``load_digits`` (1797
  images, 10 classes): a context is an image, an action a label, the reward 1 for the right label. The logging policy
  is a weak logistic regression (fitted on 10% of the images) mixed with 20% uniform (every propensity >= 0.02), the
  target a stronger logistic regression (fitted on another 50%), stochastic (its softmax). Each dataset redraws the
  logged actions for every image; the truth is exact: the mean over the images of the target's probability of the
  right label. One image is one unit.
- ``cartpole``: CartPole (Gymnasium's dynamics, integrated here in numpy over all episodes at once) with a linear
  balancing controller: the logging policy takes a random action with probability 0.6, the target with 0.4; 1000
  episodes of at most 200 steps, one per unit, gamma 0.98. The truth is the mean discounted return of 200,000
  rollouts of the target (cached; its standard error is printed with the table).
- ``stays``: hospital stays with every reward negative: a patient's severity 1-4 starts at 2, each day in hospital
  costs 1 (1.5 with intensive care), severity falls with probability 0.42 (0.62 with intensive care) and rises with
  0.15 (0.05); severity 0 is discharge; stays are cut at 30 days; gamma 0.99. 1000 doctors (the unit) x 4 stays, each
  doctor giving intensive care with its own probability in [0.2, 0.8] (behaviour value about -5.7); the target gives
  it with probability 0.8 at severity >= 3 and 0.3 below. Exact truth by backward induction.

Every dataset is public randomness (a seed), standing in for private data.
"""

from __future__ import annotations

import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

import numpy as np
import torch

from dporl.data.dataset import DatasetMetadata, TrajectoryDataset
from dporl.eval.ope_coverage import TreatmentChain, constant_policy
from dporl.utils.validation import ValidationError


@dataclass
class SuiteProblem:
    name: str
    title: str
    truth: float
    target: Any  # obs [B, d] -> probabilities [B, A], declaring ``deterministic``
    gamma: float
    declared: dict[str, Any]  # the public facts (dporl.eval.ope_scales.OPEScales.declare's keywords)
    clip: float  # a practical unit clip below the public maximum (WIS, PDIS, DR)
    sample: Callable[[np.random.Generator], TrajectoryDataset]
    obs_scale: float = 1.0  # DP-FQE's public observation scale
    truth_stderr: float = 0.0  # Monte Carlo truth: its standard error (0: exact)
    baselines: Optional[Callable[[TrajectoryDataset], dict[str, float]]] = None  # non-private estimators
    notes: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------------------------------- chain
def chain_problem(units: int = 1000) -> SuiteProblem:
    chain = TreatmentChain()
    return SuiteProblem(
        "chain", f"treatment chain ({units} clinicians x 4 episodes, target treats w.p. 0.8)",
        chain.true_value(0.8), constant_policy(0.8), chain.gamma,
        {"value_range": (-chain.treat_cost / (1 - chain.gamma), 1.0), "min_propensity": 0.2,
         "horizon": chain.horizon, "episodes_per_unit": 4},
        12.0, lambda rng: chain.simulate(units, 4, (0.2, 0.8), rng))


# ---------------------------------------------------------------------------------------------------- stays
@dataclass(frozen=True)
class HospitalStays:
    """The ``stays`` problem's MDP (module docstring); observations one-hot over severities 0..4."""

    severities: int = 5
    start: int = 2
    day_cost: float = 1.0
    intensive_cost: float = 0.5
    improve: tuple[float, float] = (0.42, 0.62)
    worsen: tuple[float, float] = (0.15, 0.05)
    gamma: float = 0.99
    horizon: int = 30

    def true_value(self, intensive: np.ndarray) -> float:
        """E[sum_{t < horizon} gamma^t r_t] from ``start`` with intensive care w.p. ``intensive[s]``."""
        S = self.severities
        p = np.broadcast_to(np.asarray(intensive, dtype=np.float64), (S,))
        up = (1 - p) * self.improve[0] + p * self.improve[1]
        down = (1 - p) * self.worsen[0] + p * self.worsen[1]
        reward = -self.day_cost - self.intensive_cost * p
        value = np.zeros(S)  # severity 0 (discharged) stays 0
        s = np.arange(1, S)
        for _ in range(self.horizon):
            new = np.zeros(S)
            worse = np.minimum(s + 1, S - 1)
            new[s] = reward[s] + self.gamma * (up[s] * value[s - 1] + down[s] * value[worse]
                                               + (1 - up[s] - down[s]) * value[s])
            new[S - 1] = reward[S - 1] + self.gamma * (up[S - 1] * value[S - 2] + (1 - up[S - 1]) * value[S - 1])
            value = new
        return float(value[self.start])

    def simulate(self, n_units: int, stays_per_unit: int, behaviour_range: tuple[float, float],
                 rng: np.random.Generator) -> TrajectoryDataset:
        n = n_units * stays_per_unit
        units = np.repeat(np.arange(n_units), stays_per_unit)
        treat_p = rng.uniform(*behaviour_range, size=n_units)[units]
        H, S = self.horizon, self.severities
        state = np.full(n, self.start)
        obs = np.zeros((n, H + 1), dtype=np.int64)
        actions = np.zeros((n, H), dtype=np.int64)
        rewards = np.zeros((n, H))
        probs = np.ones((n, H))
        alive = np.ones(n, dtype=bool)
        lengths = np.zeros(n, dtype=np.int64)
        for t in range(H):
            obs[:, t] = np.where(alive, state, 0)
            a = (rng.random(n) < treat_p).astype(np.int64)
            u = rng.random(n)
            up = np.asarray(self.improve)[a]
            down = np.asarray(self.worsen)[a]
            nxt = np.where(u < up, state - 1, np.where(u < up + down, np.minimum(state + 1, S - 1), state))
            actions[:, t] = np.where(alive, a, 0)
            rewards[:, t] = np.where(alive, -self.day_cost - self.intensive_cost * a, 0.0)
            probs[:, t] = np.where(alive, np.where(a == 1, treat_p, 1 - treat_p), 1.0)
            lengths += alive
            state = np.where(alive, nxt, state)
            alive &= nxt > 0
        obs[:, H] = state
        terminated = state == 0
        last = lengths  # the observation after the last step
        obs[np.arange(n), last] = np.where(terminated, 0, state)
        mask = np.arange(H)[None, :] < lengths[:, None]
        eye = np.eye(S, dtype=np.float32)
        observations = eye[obs]
        observations[np.arange(n), last] *= (~terminated)[:, None]  # the terminal placeholder is all zeros
        meta = DatasetMetadata("suite/HospitalStays", 2, n_units, (S,), unit_column="doctor",
                               unit_keys=tuple(f"d{i}" for i in range(n_units)))
        return TrajectoryDataset.from_padded(
            observations=observations, actions=actions, rewards=rewards.astype(np.float32), mask=mask,
            terminated=terminated, behavior_log_probs=np.log(probs).astype(np.float32), unit_ids=units,
            metadata=meta)


def stays_target() -> Any:
    intensive = torch.tensor([0.3, 0.3, 0.3, 0.8, 0.8], dtype=torch.float64)

    def policy(obs: torch.Tensor) -> torch.Tensor:
        p = intensive[obs.argmax(1)]
        return torch.stack([1 - p, p], 1)

    policy.deterministic = False
    policy.intensive = intensive.numpy()
    return policy


def stays_problem(units: int = 1000) -> SuiteProblem:
    stays = HospitalStays()
    target = stays_target()
    days = stays.day_cost + stays.intensive_cost
    return SuiteProblem(
        "stays", f"hospital stays, all rewards negative ({units} doctors x 4 stays)", stays.true_value(target.intensive),
        target, stays.gamma,
        {"reward_range": (-days, -stays.day_cost), "horizon": stays.horizon, "min_propensity": 0.2,
         "episodes_per_unit": 4},
        12.0, lambda rng: stays.simulate(units, 4, (0.2, 0.8), rng),
        notes={"behaviour_value": stays.true_value(np.full(stays.severities, 0.5))})


# ---------------------------------------------------------------------------------------------------- cartpole
CARTPOLE_GAINS = np.array([1.0, 1.5, 18.0, 3.0])  # push right when gains . (x, x_dot, theta, theta_dot) > 0


def cartpole_rollouts(n: int, random_action: float, horizon: int, gamma: float, rng: np.random.Generator,
                      log: bool = True) -> dict[str, np.ndarray]:
    """``n`` CartPole episodes (Gymnasium CartPole-v1's Euler dynamics and termination) of the linear controller
    taking a uniformly random action with probability ``random_action``; returns padded arrays (or, with ``log``
    False, the discounted returns only)."""
    g, mc, mp, half_length, force, tau = 9.8, 1.0, 0.1, 0.5, 10.0, 0.02
    total, pml = mc + mp, mp * half_length
    state = rng.uniform(-0.05, 0.05, size=(n, 4))
    alive = np.ones(n, dtype=bool)
    returns = np.zeros(n)
    if log:
        obs = np.zeros((n, horizon + 1, 4), dtype=np.float32)
        actions = np.zeros((n, horizon), dtype=np.int64)
        probs = np.ones((n, horizon))
        lengths = np.zeros(n, dtype=np.int64)
    for t in range(horizon):
        greedy = (state @ CARTPOLE_GAINS > 0).astype(np.int64)
        explore = rng.random(n) < random_action
        a = np.where(explore, rng.integers(0, 2, n), greedy)
        if log:
            obs[:, t] = np.where(alive[:, None], state, 0.0)
            actions[:, t] = np.where(alive, a, 0)
            probs[:, t] = np.where(alive, np.where(a == greedy, 1 - random_action / 2, random_action / 2), 1.0)
            lengths += alive
        returns += alive * gamma**t
        x, x_dot, theta, theta_dot = state.T
        f = np.where(a == 1, force, -force)
        cos, sin = np.cos(theta), np.sin(theta)
        temp = (f + pml * theta_dot**2 * sin) / total
        theta_acc = (g * sin - cos * temp) / (half_length * (4.0 / 3.0 - mp * cos**2 / total))
        x_acc = temp - pml * theta_acc * cos / total
        nxt = np.stack([x + tau * x_dot, x_dot + tau * x_acc, theta + tau * theta_dot, theta_dot + tau * theta_acc], 1)
        done = (np.abs(nxt[:, 0]) > 2.4) | (np.abs(nxt[:, 2]) > 12 * 2 * math.pi / 360)
        state = np.where(alive[:, None], nxt, state)
        if log:
            obs[:, t + 1] = np.where(alive[:, None], nxt, obs[:, t + 1])
        alive &= ~done
    if not log:
        return {"returns": returns}
    terminated = ~alive
    return {"obs": obs, "actions": actions, "probs": probs, "lengths": lengths, "terminated": terminated,
            "returns": returns}


def cartpole_target(random_action: float) -> Any:
    gains = torch.from_numpy(CARTPOLE_GAINS)

    def policy(obs: torch.Tensor) -> torch.Tensor:
        greedy = (obs.double() @ gains > 0).double()
        right = greedy * (1 - random_action / 2) + (1 - greedy) * random_action / 2
        return torch.stack([1 - right, right], 1)

    policy.deterministic = random_action == 0
    return policy


def _cached_truth(key: dict, compute: Callable[[], tuple[float, float]], cache: Optional[Path]) -> tuple[float, float]:
    """A Monte Carlo truth, cached by its settings' hash under ``cache`` (None: not cached)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = None if cache is None else Path(cache) / f"truth-{key['problem']}-{digest}.json"
    if path is not None and path.is_file():
        stored = json.loads(path.read_text())
        return float(stored["truth"]), float(stored["stderr"])
    truth, stderr = compute()
    if path is not None:
        from dporl.utils.io import atomic_write_json

        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write_json(path, {**key, "truth": truth, "stderr": stderr})
    return truth, stderr


def cartpole_problem(units: int = 1000, rollouts: int = 200_000, cache: Optional[Path] = None) -> SuiteProblem:
    horizon, gamma, behaviour, target_random = 200, 0.98, 0.6, 0.4

    def truth() -> tuple[float, float]:
        rng = np.random.default_rng(20_250_101)
        returns = np.concatenate([cartpole_rollouts(min(50_000, rollouts - i), target_random, horizon, gamma, rng,
                                                    log=False)["returns"] for i in range(0, rollouts, 50_000)])
        return float(returns.mean()), float(returns.std() / math.sqrt(len(returns)))

    value, stderr = _cached_truth({"problem": "cartpole", "rollouts": rollouts, "horizon": horizon, "gamma": gamma,
                                   "target": target_random, "gains": CARTPOLE_GAINS.tolist()}, truth, cache)

    def sample(rng: np.random.Generator) -> TrajectoryDataset:
        r = cartpole_rollouts(units, behaviour, horizon, gamma, rng)
        mask = np.arange(horizon)[None, :] < r["lengths"][:, None]
        observations = r["obs"]
        last = r["lengths"]
        observations[np.arange(units)[r["terminated"]], last[r["terminated"]]] = 0.0  # terminal placeholder
        meta = DatasetMetadata("suite/CartPole", 2, units, (4,))
        return TrajectoryDataset.from_padded(
            observations=observations, actions=r["actions"], rewards=mask.astype(np.float32), mask=mask,
            terminated=r["terminated"], behavior_log_probs=np.log(r["probs"]).astype(np.float32),
            unit_ids=np.arange(units), metadata=meta)

    return SuiteProblem(
        "cartpole", f"logged CartPole ({units} episodes of <= {horizon} steps, one per unit)", value,
        cartpole_target(target_random), gamma,
        {"reward_range": (0.0, 1.0), "horizon": horizon, "min_propensity": behaviour / 2, "episodes_per_unit": 1},
        3.0, sample, obs_scale=3.0, truth_stderr=stderr, notes={"rollouts": rollouts})


# ---------------------------------------------------------------------------------------------------- digits
def _softmax(logits: np.ndarray) -> np.ndarray:
    z = np.exp(logits - logits.max(1, keepdims=True))
    return z / z.sum(1, keepdims=True)


def digits_problem(uniform_share: float = 0.2) -> SuiteProblem:
    try:
        from sklearn.datasets import load_digits
        from sklearn.linear_model import LogisticRegression
    except ImportError:  # a dev extra (setup.cfg)
        raise ValidationError("problem", "the digits problem needs scikit-learn (pip install -e '.[dev]')") from None
    x, y = load_digits(return_X_y=True)
    n, classes = len(y), 10
    order = np.random.default_rng(0).permutation(n)  # public: which images fit which policy
    weak = LogisticRegression(C=1e-4, max_iter=2000).fit(x[order[: n // 10]], y[order[: n // 10]])
    strong = LogisticRegression(C=1e-3, max_iter=2000).fit(x[order[n // 10: n // 10 + n // 2]],
                                                         y[order[n // 10: n // 10 + n // 2]])
    logging = (1 - uniform_share) * _softmax(weak.decision_function(x)) + uniform_share / classes
    target_probs = _softmax(strong.decision_function(x))
    truth = float(target_probs[np.arange(n), y].mean())
    coef, intercept = torch.from_numpy(strong.coef_.T.copy()), torch.from_numpy(strong.intercept_.copy())

    def target(obs: torch.Tensor) -> torch.Tensor:
        return torch.softmax(obs.double() @ coef + intercept, dim=1)

    target.deterministic = False
    cumulative = np.cumsum(logging, axis=1)
    obs = np.zeros((n, 2, x.shape[1]), dtype=np.float32)
    obs[:, 0] = x

    def sample(rng: np.random.Generator) -> TrajectoryDataset:
        actions = np.minimum((rng.random(n)[:, None] > cumulative).sum(1), classes - 1)
        meta = DatasetMetadata("suite/Digits", classes, n, (x.shape[1],))
        return TrajectoryDataset.from_padded(
            observations=obs, actions=actions[:, None], rewards=(actions == y).astype(np.float32)[:, None],
            mask=np.ones((n, 1), bool), terminated=np.ones(n, bool),
            behavior_log_probs=np.log(logging[np.arange(n), actions]).astype(np.float32)[:, None],
            unit_ids=np.arange(n), metadata=meta)

    def baselines(dataset: TrajectoryDataset) -> dict[str, float]:
        """Non-private IPW, SNIPW and DR (a ridge model per action, cross-fitted over two halves)."""
        a = dataset.actions.astype(np.int64)
        r = dataset.rewards.astype(np.float64)
        w = target_probs[np.arange(n), a] / logging[np.arange(n), a]
        features = np.hstack([x / 16.0, np.ones((n, 1))])
        q = np.zeros((n, classes))
        half = np.arange(n) % 2
        for part in (0, 1):
            fit, use = half != part, half == part
            for action in range(classes):
                rows = fit & (a == action)
                design = features[rows]
                theta = np.linalg.solve(design.T @ design + 1.0 * np.eye(design.shape[1]), design.T @ r[rows])
                q[use, action] = features[use] @ theta
        dr = (target_probs * q).sum(1) + w * (r - q[np.arange(n), a])
        return {"ipw": float(np.mean(w * r)), "snipw": float(np.sum(w * r) / np.sum(w)), "dr": float(np.mean(dr))}

    return SuiteProblem(
        "digits", f"supervised-to-bandit on load_digits ({n} images, one per unit)", truth, target, 1.0,
        {"reward_range": (0.0, 1.0), "horizon": 1, "min_propensity": uniform_share / classes, "episodes_per_unit": 1},
        6.0, sample, obs_scale=64.0, baselines=baselines,
        notes={"logging_value": float(logging[np.arange(n), y].mean())})


def problems(names: Optional[list[str]] = None, quick: bool = False, cache: Optional[Path] = None
             ) -> list[SuiteProblem]:
    """The suite's problems (``quick``: smaller datasets and a cheaper Monte Carlo truth, for the smoke test)."""
    units = 300 if quick else 1000
    makers = {
        "chain": lambda: chain_problem(units),
        "digits": digits_problem,
        "cartpole": lambda: cartpole_problem(units, 20_000 if quick else 200_000, cache),
        "stays": lambda: stays_problem(units),
    }
    unknown = [n for n in (names or []) if n not in makers]
    if unknown:
        raise ValidationError("problems", f"unknown problem {unknown[0]!r} (known: {sorted(makers)})")
    return [makers[name]() for name in (names or list(makers))]
