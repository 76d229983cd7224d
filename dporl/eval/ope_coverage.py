"""Coverage of the private OPE intervals, by simulation where the truth is exact.

The problem (a treatment chain, the chain of the policy-evaluation papers with two actions and clinicians as
units): states 0..S-1 one-hot encoded; from a non-final state, "wait" (action 0) advances with probability
``p_wait`` and "treat" (action 1) with ``p_treat`` at reward ``-treat_cost``; reaching state S-1 pays 1 and ends the
episode; every step also ends the episode with probability ``hazard`` (reward 0); episodes are cut at ``horizon``
steps (truncated, next state logged). Each clinician (unit) treats with its own probability, drawn uniformly from
``behaviour_range`` and logged as the propensity; the target policy treats with probability ``target_treat`` in
every state. The true value E[sum_{t < horizon} gamma^t r_t] comes from exact backward induction.

``python -m dporl.eval.ope_coverage --datasets 300`` draws that many independent logged datasets, runs each
estimator at the given budget and reports the fraction of intervals covering the truth with its Clopper-Pearson
interval, the mean width and bias, into ``--out`` (JSON + PNG).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np
import torch

from dporl.data.dataset import DatasetMetadata, TrajectoryDataset
from dporl.utils.validation import ValidationError, check_probability


@dataclass(frozen=True)
class TreatmentChain:
    n_states: int = 6
    p_wait: float = 0.2
    p_treat: float = 0.6
    treat_cost: float = 0.1
    hazard: float = 0.05
    gamma: float = 0.95
    horizon: int = 60

    def __post_init__(self) -> None:
        if self.n_states < 2 or self.horizon < 1:
            raise ValidationError("chain", "need n_states >= 2 and horizon >= 1")
        for name in ("p_wait", "p_treat", "hazard", "gamma"):
            check_probability(f"chain.{name}", getattr(self, name))

    def true_value(self, treat_probability) -> float:
        """E[sum_{t < horizon} gamma^t r_t] from state 0 under "treat with this probability" (a number, or one per
        state), by backward induction."""
        S = self.n_states
        p = np.broadcast_to(np.asarray(treat_probability, dtype=np.float64), (S,))[: S - 1]
        value = np.zeros(S)  # value with k steps to go, k = 0
        reach = (1 - p) * self.p_wait + p * self.p_treat  # reaching the next state (the last one pays 1 and ends)
        s = np.arange(S - 1)
        for _ in range(self.horizon):
            new = np.zeros(S)
            next_value = np.where(s + 1 == S - 1, 1.0, self.gamma * (1 - self.hazard) * value[np.minimum(s + 1, S - 1)])
            stay_value = self.gamma * (1 - self.hazard) * value[s]
            # The hazard ends an episode after the step's reward; reaching S-1 pays 1 and ends it regardless.
            new[s] = -self.treat_cost * p + reach * next_value + (1 - reach) * stay_value
            value = new
        return float(value[0])

    def simulate(
        self, n_units: int, episodes_per_unit: int, behaviour_range: tuple[float, float], rng: np.random.Generator
    ) -> TrajectoryDataset:
        """Logged episodes of every unit (vectorised over episodes), with propensities and unit keys ``c<i>``."""
        n = n_units * episodes_per_unit
        units = np.repeat(np.arange(n_units), episodes_per_unit)
        treat_p = rng.uniform(*behaviour_range, size=n_units)[units]
        S, H = self.n_states, self.horizon
        state = np.zeros(n, dtype=np.int64)
        alive = np.ones(n, dtype=bool)
        cols = {k: [] for k in ("state", "action", "reward", "next_state", "term", "prob", "episode", "t")}
        for t in range(H):
            idx = np.flatnonzero(alive)
            if len(idx) == 0:
                break
            treat = rng.random(len(idx)) < treat_p[idx]
            p_adv = np.where(treat, self.p_treat, self.p_wait)
            advance = rng.random(len(idx)) < p_adv
            nxt = state[idx] + advance
            reached = nxt == S - 1
            hazard = rng.random(len(idx)) < self.hazard
            reward = np.where(treat, -self.treat_cost, 0.0) + reached.astype(float)
            term = reached | hazard
            for key, value in (("state", state[idx]), ("action", treat.astype(np.int64)), ("reward", reward),
                               ("next_state", nxt), ("term", term),
                               ("prob", np.where(treat, treat_p[idx], 1 - treat_p[idx])), ("episode", idx),
                               ("t", np.full(len(idx), t))):
                cols[key].append(value)
            state[idx] = nxt
            alive[idx[term]] = False
        flat = {k: np.concatenate(v) for k, v in cols.items()}
        order = np.lexsort((flat["t"], flat["episode"]))
        flat = {k: v[order] for k, v in flat.items()}
        lengths = np.bincount(flat["episode"], minlength=n)
        last = np.cumsum(lengths) - 1
        terminated = flat["term"].copy()
        truncated = np.zeros_like(terminated)
        truncated[last] = ~terminated[last]
        eye = np.eye(S, dtype=np.float32)
        obs_states = np.zeros(len(order) + n, dtype=np.int64)
        shift = np.repeat(np.arange(n), lengths)
        obs_states[np.arange(len(order)) + shift] = flat["state"]
        obs_states[last + np.arange(n) + 1] = flat["next_state"][last]
        observations = eye[obs_states]
        observations[last[terminated[last]] + np.flatnonzero(terminated[last]) + 1] = 0.0  # terminal placeholder
        meta = DatasetMetadata(
            env_id="dporl/TreatmentChain", n_actions=2, n_units=n_units, obs_shape=(S,),
            unit_column="clinician", unit_keys=tuple(f"c{i}" for i in range(n_units)),
        )
        return TrajectoryDataset(
            observations=observations, actions=flat["action"], rewards=flat["reward"].astype(np.float32),
            terminations=terminated, truncations=truncated, episode_lengths=lengths, unit_ids=units,
            behavior_log_probs=np.log(flat["prob"]).astype(np.float32), metadata=meta,
        )


def treatment_chain_frame(
    units: int, episodes_per_unit: int, behaviour_range: tuple[float, float] = (0.2, 0.8), seed: int = 0,
    chain: Optional[TreatmentChain] = None,
):
    """A logged treatment-chain table (pandas, one row per decision), clinicians ``c<i>`` as units: columns
    episode, clinician, step, obs_0..obs_{S-1} (one-hot state), action (1 = treat), reward, terminated, truncated,
    next_obs_0.., propensity (the clinician's probability of the logged action). Every policy's value is exact
    (``TreatmentChain.true_value``). Public randomness (``seed``): an example standing in for private data."""
    from dporl.data.table import to_frame

    chain = chain or TreatmentChain()
    logged = chain.simulate(units, episodes_per_unit, behaviour_range, np.random.default_rng(seed))
    frame = to_frame(logged, next_observations=True, unit="clinician")
    frame["propensity"] = np.exp(frame.pop("log_propensity").astype(np.float64))
    return frame


def state_policy_probabilities(policy, n_states: int) -> np.ndarray:
    """Each state's treat probability under ``policy`` (a dporl policy or a callable, evaluated on the one-hot
    states): what ``TreatmentChain.true_value`` takes."""
    from dporl.eval.private_ope import action_probabilities

    return action_probabilities(policy, torch.eye(n_states), 2)[:, 1].numpy()


def constant_policy(treat_probability: float):
    """obs [B, S] -> [[1 - p, p]] * B: the target policy (public)."""

    def policy(obs: torch.Tensor) -> torch.Tensor:
        probs = torch.tensor([1 - treat_probability, treat_probability], dtype=torch.float64)
        return probs.expand(obs.shape[0], 2)

    policy.deterministic = treat_probability in (0.0, 1.0)  # declared from the public parameter, not from any data
    return policy


def state_policy(treat_probabilities) -> Any:
    """obs [B, S] (one-hot) -> the per-state treat probabilities as [[1 - p, p]] (public)."""
    treat = torch.as_tensor(np.asarray(treat_probabilities, dtype=np.float64))

    def policy(obs: torch.Tensor) -> torch.Tensor:
        p = treat[obs.argmax(1)]
        return torch.stack([1 - p, p], 1)

    # Deterministic only if it is so in EVERY state (public parameters), whichever states some dataset logged.
    policy.deterministic = bool(((treat == 0) | (treat == 1)).all())
    return policy


def clopper_pearson(successes: int, trials: int, confidence: float = 0.95) -> tuple[float, float]:
    from scipy import stats

    alpha = 1 - confidence
    low = 0.0 if successes == 0 else float(stats.beta.ppf(alpha / 2, successes, trials - successes + 1))
    high = 1.0 if successes == trials else float(stats.beta.ppf(1 - alpha / 2, successes + 1, trials - successes))
    return low, high


def run(args: argparse.Namespace) -> dict:
    from tqdm import tqdm

    from dporl.eval.private_ope import FQETraining, dp_doubly_robust, dp_fqe, dp_importance_sampling
    from dporl.algos.fqe import FQEConfig
    from dporl.privacy.ledger import PrivacyLedger
    from dporl.privacy.randomness import SecretRoot

    torch.set_num_threads(1)
    chain = TreatmentChain()
    if args.greedy is not None:  # a deterministic target: treat in the listed states, wait elsewhere
        treat = np.zeros(chain.n_states)
        treat[list(args.greedy)] = 1.0
        truth, policy = chain.true_value(treat), state_policy(treat)
    else:
        truth, policy = chain.true_value(args.target), constant_policy(args.target)
    training = FQETraining(steps=args.fqe_steps, sample_rate=args.sample_rate, rows_per_unit=8,
                           max_grad_norm=1.0, optimizer=args.optimizer, lr=args.lr, train_fraction=args.train_fraction,
                           fqe=FQEConfig(gamma=chain.gamma, average_last=args.average_last))
    value_range = (-chain.treat_cost / (1 - chain.gamma), 1.0)  # public bounds on any policy's value here
    results: dict[str, dict] = {}
    rows: dict[str, list] = {name: [] for name in args.estimators}
    eps_by_stage: dict[str, dict] = {}
    rng = np.random.default_rng(args.seed)
    start = time.perf_counter()
    for i in tqdm(range(args.datasets), desc="coverage", unit="dataset"):
        dataset = chain.simulate(args.units, args.episodes_per_unit, (0.2, 0.8), rng)
        for name in args.estimators:
            ledger, root = PrivacyLedger(), SecretRoot(args.seed * 100_003 + i)
            common = dict(epsilon=args.epsilon, delta=args.delta, ledger=ledger, root=root, unit_clip=args.unit_clip,
                          value_range=value_range)
            with tempfile.TemporaryDirectory() as tmp:
                if name in ("wis", "pdis"):
                    result = dp_importance_sampling(dataset, policy, kind=name, gamma=chain.gamma, **common)
                elif name == "dr":
                    result, _ = dp_doubly_robust(dataset, policy, gamma=chain.gamma, training=training, run_dir=tmp,
                                                 **common)
                else:
                    result = dp_fqe(dataset, policy, folds=args.folds, training=training, run_dir=tmp, **common)
            rows[name].append((result.value, result.ci_low, result.ci_high))
            if i == 0:
                report = ledger.report()
                eps_by_stage[name] = {
                    "stages": {s.name: s.epsilon for s in report.stages},
                    "guarantee": report.guarantee[:2], "composition": report.composition,
                }
    for name, values in rows.items():
        array = np.asarray(values)
        covered = int(np.sum((array[:, 1] <= truth) & (truth <= array[:, 2])))
        low, high = clopper_pearson(covered, len(array))
        results[name] = {
            "coverage": covered / len(array), "coverage_ci95": [low, high], "covered": covered, "datasets": len(array),
            "mean_estimate": float(array[:, 0].mean()), "bias": float(array[:, 0].mean() - truth),
            "rmse": float(np.sqrt(np.mean((array[:, 0] - truth) ** 2))),
            "mean_width": float(np.mean(array[:, 2] - array[:, 1])),
            "privacy": eps_by_stage[name],
        }
    summary = {"truth": truth, "settings": vars(args), "chain": asdict(chain), "results": results,
               "seconds": time.perf_counter() - start}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from dporl.utils.io import atomic_write_json

    atomic_write_json(out / "coverage.json", summary)
    _plot(rows, truth, out / "coverage.png")
    return summary


def _plot(rows: dict, truth: float, path: Path, show: int = 60) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(rows), figsize=(4 * len(rows), 3.5), squeeze=False, sharey=True)
    for ax, (name, values) in zip(axes[0], rows.items()):
        array = np.asarray(values)[:show]
        hit = (array[:, 1] <= truth) & (truth <= array[:, 2])
        x = np.arange(len(array))
        ax.vlines(x[hit], array[hit, 1], array[hit, 2], color="tab:blue", lw=1)
        ax.vlines(x[~hit], array[~hit, 1], array[~hit, 2], color="tab:red", lw=1)
        ax.plot(x, array[:, 0], ".", color="k", ms=2)
        ax.axhline(truth, color="tab:green", lw=1)
        ax.set_title(f"{name}: {hit.mean():.0%} of first {len(array)} cover")
        ax.set_xlabel("simulated dataset")
    axes[0][0].set_ylabel("policy value (truth in green)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Optional[list[str]] = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--datasets", type=int, default=200)
    parser.add_argument("--estimators", nargs="+", default=["wis", "pdis", "dr", "fqe"])
    parser.add_argument("--units", type=int, default=1000)
    parser.add_argument("--episodes-per-unit", type=int, default=4)
    parser.add_argument("--unit-clip", type=float, default=12.0)
    parser.add_argument("--epsilon", type=float, default=1.0)
    parser.add_argument("--delta", type=float, default=1e-5)
    parser.add_argument("--target", type=float, default=0.8, help="treat probability of the target in every state")
    parser.add_argument("--greedy", type=int, nargs="*", default=None,
                        help="a deterministic target instead: treat in these states, wait elsewhere (e.g. 3 4)")
    parser.add_argument("--folds", type=int, default=5)
    parser.add_argument("--fqe-steps", type=int, default=300)
    parser.add_argument("--sample-rate", type=float, default=0.05)
    parser.add_argument("--optimizer", default="sgd")
    parser.add_argument("--lr", type=float, default=0.2)
    parser.add_argument("--average-last", type=float, default=0.5, help="FQE: average the last fraction of iterates")
    parser.add_argument("--train-fraction", type=float, default=0.8, help="FQE: share of a fold's epsilon for training")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", default="runs/ope_coverage")
    summary = run(parser.parse_args(argv))
    print(json.dumps({k: {m: v[m] for m in ("coverage", "coverage_ci95", "bias", "mean_width")}
                      for k, v in summary["results"].items()}, indent=1))
    print(f"truth {summary['truth']:.5f}; {summary['seconds']:.0f} s")


if __name__ == "__main__":
    main()
