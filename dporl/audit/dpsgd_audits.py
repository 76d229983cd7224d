"""Audits of expert-level DP-SGD steps (Algorithm 4), the mixture step of Algorithm 3, and one GPOPE update
(Poisson and the paper's one-trajectory replace-one mode).

All run the library's own code: the claimed epsilon is the accountant's for the event the source states,
``DPSGDEngine`` clips, sums and adds the ``NoiseSource`` noise.

Expert-level steps on FIXED data. D is a ``TrajectoryDataset`` of m experts: a canary expert whose every logged
observation is 100 C e1, and m - 1 others whose observations are fixed vectors orthogonal to e1; D' is D without
the canary's episodes. Both sample at the same rate q = B / m (the canary keeps its place in the population, so
the two differ only in the canary's rows; a run derives q from a released count of the units, post-processing that
is the same on both sides once drawn, and the count itself is its own accounted stage). The batch source is the one the train pipeline trains with,
built by the method objects of ``dporl.methods.unit_level`` (``dp_sgd``: Poisson over experts with ``rows_per_unit``
rows per sampled expert; ``mixed``: Algorithm 3's ``MixtureSource`` around it and D_stable). The learner is linear
with loss -w . obs per row, so a unit's gradient is minus the mean of its rows (the canary's is clipped to exactly
C along -e1; the others' add nothing along e1), and one SGD step of learning rate 1 from w = 0 releases
w = -(clipped sum + noise) / B. Statistic: the released parameters' e1 coordinate in units of C / B (likelihood-ratio
optimal). Several steps of the constant canary are independent, so their statistics add.

Vectorised trials: every trial draws its own batch from the real source (its own Poisson inclusions and, for the
mixture, its own branch); the private batches of all trials then run as ONE engine call on a module holding one
parameter block per trial (row r's loss touches only its trial's block). Clipping is per unit over the whole
parameter vector, which equals the norm within the unit's block, and the noise is i.i.d. per coordinate, so the
blocks are exactly independent DP-SGD steps.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from dporl.algos.base import LossForm, PrivateAlgorithm
from dporl.audit.experiment import Experiment
from dporl.privacy.accountants import analysis_name, epsilon_for, paper_mixture_epsilon
from dporl.privacy.dpsgd import DPSGDEngine
from dporl.privacy.noise import NoiseSource
from dporl.privacy.samplers import FixedSizeSource, MixtureSource, PoissonUnitSource, UniformBatchSource
from dporl.utils.seeding import make_generator
from dporl.utils.validation import ValidationError, check_positive, check_probability

CANARY_NORM = 100.0  # in units of the clip norm: far beyond it, so the canary is clipped to exactly C


def step_event_factory(sample_rate: float, private_probability: float | None = None):
    """make_event(sigma) of the batch source a pipeline builds (Poisson, or the mixture of Algorithm 3): the event
    comes from the source itself, never from a description written here. The population does not enter it."""
    dummy = {"x": torch.zeros(1, 1)}
    private = PoissonUnitSource(dummy, torch.zeros(1, dtype=torch.long), 1, sample_rate)
    if private_probability is None:
        return private.step_event
    return MixtureSource(private_probability, private, UniformBatchSource(dummy, 1)).step_event


class IndependentSteps(PrivateAlgorithm):
    """``trials`` independent linear models as one module. An observation's last coordinate is the trial copy it
    belongs to (``canary_dataset(copies=...)``); row r's loss is -w_{trial(r)} . features(r), features = the rest."""

    privacy_unit = "expert"
    loss_form = LossForm.ROW_LOSSES
    batch_keys = ("obs",)
    policy_kind = None

    def __init__(self, trials: int, dim: int):
        super().__init__()
        self.layer = nn.Linear(dim, trials, bias=False)
        nn.init.zeros_(self.layer.weight)

    def row_losses(self, batch) -> torch.Tensor:
        obs = batch.data["obs"]
        outputs = self.layer(obs[:, :-1])  # [rows, trials]
        return -outputs.gather(1, obs[:, -1:].long()).squeeze(1)


def _other_units(n_units: int, dim: int, clip: float) -> torch.Tensor:
    """Fixed non-canary vectors (the same in D and D'), orthogonal to e1, norms spread around the clip norm."""
    generator = make_generator(12345)
    x = torch.randn(n_units, dim, generator=generator)
    x[:, 0] = 0.0
    norms = clip * (0.2 + 2.8 * torch.rand(n_units, generator=generator))
    return x / x.norm(dim=1, keepdim=True).clamp_min(1e-12) * norms.unsqueeze(1)


def canary_dataset(n_units: int, dim: int, clip: float, rows_per_unit: int, with_canary: bool, copies: int = 1):
    """The fixed expert-level dataset D (``with_canary``) or D', ``copies`` times (one per trial).

    In every copy, expert 0 is the canary, whose every observation is 100 C e1; expert i > 0 logs one episode of
    ``rows_per_unit`` steps at its fixed vector (orthogonal to e1). Copy c holds experts c m .. c m + m - 1 and
    its observations carry c as an extra last coordinate (the trial index ``IndependentSteps`` routes by).
    """
    from dporl.data.dataset import DatasetMetadata, TrajectoryDataset

    vectors = torch.cat([torch.zeros(1, dim), _other_units(n_units - 1, dim, clip)])
    vectors[0, 0] = CANARY_NORM * clip  # loss -w . obs: the canary's gradient is -100 C e1
    members = np.arange(0 if with_canary else 1, n_units)
    length, n = rows_per_unit, copies * len(members)
    per_copy = vectors[members].repeat_interleave(length + 1, dim=0).numpy()
    copy_index = np.repeat(np.arange(copies, dtype=np.float32), len(per_copy))[:, None]
    observations = np.concatenate([np.tile(per_copy, (copies, 1)), copy_index], axis=1)
    terminations = np.zeros(n * length, dtype=bool)
    terminations[length - 1 :: length] = True
    metadata = DatasetMetadata(env_id="audit/fixed-vectors", n_actions=2, n_units=copies * n_units,
                               obs_shape=(dim + 1,))
    return TrajectoryDataset(
        observations=observations, actions=np.zeros(n * length, dtype=np.int64),
        rewards=np.zeros(n * length, dtype=np.float32), terminations=terminations,
        truncations=np.zeros(n * length, dtype=bool), episode_lengths=np.full(n, length, dtype=np.int64),
        unit_ids=(np.arange(copies)[:, None] * n_units + members[None, :]).ravel(), metadata=metadata,
    )


def _public_stable(dim: int):
    """A public D_stable for the mixture's noiseless branch (its content does not matter: that branch is visible)."""
    from dporl.data.dataset import DatasetMetadata, TrajectoryDataset

    metadata = DatasetMetadata(env_id="audit/fixed-vectors", n_actions=2, n_units=1, obs_shape=(dim + 1,))
    return TrajectoryDataset(
        observations=np.zeros((2, dim + 1), dtype=np.float32), actions=np.zeros(1, dtype=np.int64),
        rewards=np.zeros(1, dtype=np.float32), terminations=np.ones(1, dtype=bool),
        truncations=np.zeros(1, dtype=bool), episode_lengths=np.ones(1, dtype=np.int64),
        unit_ids=np.zeros(1, dtype=np.int64), metadata=metadata,
    )


def expert_level_source(method: str, *, n_units: int, dim: int, clip: float, rows_per_unit: int,
                        sample_rate: float, with_canary: bool, copies: int = 1, private_probability: float = 1.0):
    """The source the train pipeline trains ``method`` with (its ``source``), on ``copies`` copies of D or D'."""
    from dporl.methods.unit_level import unit_level_method
    from dporl.privacy.count import WHOLE, Units

    data = canary_dataset(n_units, dim, clip, rows_per_unit, with_canary, copies)
    stable = _public_stable(dim) if method == "mixed" else None
    # Both neighbours sample at the attacked rate: the population is the audit's public parameter, not D's size.
    return unit_level_method(method).source(
        data, stable, batch_size=sample_rate * n_units * copies, units=Units.public({WHOLE: n_units * copies}),
        rows_per_unit=rows_per_unit, p_dp=private_probability, keys=IndependentSteps.batch_keys)


def released_step_scores(source, trials: int, *, noise_multiplier: float, clip: float, mode: str,
                         seed: int) -> np.ndarray:
    """One Poisson batch of the pipeline's private ``source`` over ``trials`` copies of the data (each copy's experts
    included independently: ``trials`` independent steps), one ``DPSGDEngine`` call and an SGD step of learning
    rate 1 from w = 0; returns each trial's released w along e1 in units of C / (per-trial expected batch)."""
    batch = source.sample(make_generator(seed))
    dim = int(batch.data["obs"].shape[1]) - 1
    model = IndependentSteps(trials, dim)
    engine = DPSGDEngine(model, max_grad_norm=clip, noise_multiplier=noise_multiplier,
                         expected_batch_size=source.expected_batch_size, noise=NoiseSource(seed + 1), mode=mode)
    optimizer = torch.optim.SGD(model.parameters(), lr=1.0)
    engine.private_backward(model.row_losses(batch), batch.unit_index, batch.n_units)
    optimizer.step()
    return (model.layer.weight.detach()[:, 0].double() * source.expected_batch_size / clip).numpy()


def dpsgd_step_audit(
    noise_multiplier: float = 1.0,
    sample_rate: float = 0.5,
    n_units: int = 4,
    dim: int = 3,
    max_grad_norm: float = 1.0,
    delta: float = 1e-5,
    mode: str = "bookkeeping",
    accountant: str = "pld",
    noise_factor: float = 1.0,
    steps: int = 1,
    rows_per_unit: int = 2,
) -> Experiment:
    """``steps`` expert-level DP-SGD steps on the fixed D (canary + ``n_units`` - 1 experts) vs D' (no canary).

    Several steps audit the accountant's composition too: the canary's clipped gradient stays C e1 at every step
    (the worst case, which a linear model with a fixed canary attains), so the steps are independent and the
    statistic is the sum of their e1 projections (likelihood-ratio optimal without subsampling).
    """
    sigma = check_positive("noise_multiplier", noise_multiplier)
    q = check_probability("sample_rate", sample_rate, allow_zero=False)
    if n_units < 2 or dim < 2:
        raise ValidationError("n_units", f"need n_units >= 2 and dim >= 2, got {n_units}, {dim}")
    if not isinstance(steps, int) or steps < 1:
        raise ValidationError("steps", f"must be an integer >= 1, got {steps!r}")
    used_sigma = sigma * check_positive("noise_factor", noise_factor)
    common = {"n_units": n_units, "dim": dim, "clip": max_grad_norm, "rows_per_unit": rows_per_unit,
              "sample_rate": q}
    event = expert_level_source("dp_sgd", with_canary=True, **common).step_event(sigma)

    def scores(n: int, on_d: bool, seed: int) -> np.ndarray:
        source = expert_level_source("dp_sgd", with_canary=on_d, copies=n * steps, **common)
        per_step = released_step_scores(source, n * steps, noise_multiplier=used_sigma, clip=max_grad_norm,
                                        mode=mode, seed=seed)
        return per_step.reshape(n, steps).sum(1)

    return Experiment(
        name="dpsgd_step" if steps == 1 else f"dpsgd_{steps}_steps",
        claimed_epsilon=epsilon_for([(event, steps)], delta, accountant),
        delta=delta,
        privacy_unit="expert",
        analysis=f"{event} by {analysis_name(accountant)}",
        neighbours=(f"fixed data: D = a canary expert (observations {CANARY_NORM:g} C e1) + {n_units - 1} experts "
                    "orthogonal to e1; D' = D without the canary's episodes; the train pipeline's dp_sgd source"),
        scores=scores,
        chunk_trials=max(1, 2_000 // steps),
        settings={"noise_multiplier": sigma, "sample_rate": q, "n_units": n_units, "dim": dim, "mode": mode,
                  "max_grad_norm": max_grad_norm, "noise_factor": noise_factor, "steps": steps,
                  "rows_per_unit": rows_per_unit},
    )


def mixture_audit(
    private_probability: float = 0.02,
    noise_multiplier: float = 1.0,
    sample_rate: float = 1.0,
    n_units: int = 4,
    dim: int = 3,
    max_grad_norm: float = 1.0,
    delta: float = 1e-5,
    accountant: str = "pld",
    noise_factor: float = 1.0,
    rows_per_unit: int = 2,
) -> Experiment:
    """One step of Algorithm 3 on the fixed D vs D', through the train pipeline's ``mixed`` source: with probability p an
    expert-level DP-SGD step, else a noiseless step on D_stable.

    The branch is visible in the iterates (a noiseless step differs from a noisy one), so the statistic of a
    public-branch trial is -inf (it carries nothing about D) and of a private-branch trial the e1 projection.
    The claim audited is the sound ``MixtureEvent``; the paper's rate-(p q) figure is reported beside it, and
    an audit bound above it refutes that figure.
    """
    p = check_probability("private_probability", private_probability, allow_zero=False)
    sigma = check_positive("noise_multiplier", noise_multiplier)
    q = check_probability("sample_rate", sample_rate, allow_zero=False)
    used_sigma = sigma * check_positive("noise_factor", noise_factor)
    common = {"n_units": n_units, "dim": dim, "clip": max_grad_norm, "rows_per_unit": rows_per_unit,
              "sample_rate": q, "private_probability": p}
    mixture = expert_level_source("mixed", with_canary=True, **common)
    event = mixture.step_event(sigma)

    def scores(n: int, on_d: bool, seed: int) -> np.ndarray:
        # MixtureSource's branch rule (one uniform < p per step), one independent draw per trial; the private
        # trials then take one step of the mixture's own private source each.
        private = (torch.rand(n, generator=make_generator(seed)) < mixture.private_probability).numpy()
        out = np.full(n, -np.inf)
        k = int(private.sum())
        if k:
            source = expert_level_source("mixed", with_canary=on_d, copies=k, **common).private_source
            out[private] = released_step_scores(source, k, noise_multiplier=used_sigma, clip=max_grad_norm,
                                                mode="bookkeeping", seed=seed + 7)
        return out

    return Experiment(
        name="mixture",
        claimed_epsilon=epsilon_for([(event, 1)], delta, accountant),
        delta=delta,
        privacy_unit="expert",
        analysis=f"{event} by {analysis_name(accountant)} (branch observable)",
        neighbours=(f"fixed data: D = a canary expert (observations {CANARY_NORM:g} C e1) + {n_units - 1} experts "
                    "orthogonal to e1; D' = D without the canary's episodes; the train pipeline's mixed source"),
        scores=scores,
        chunk_trials=50_000,
        references={
            "paper (rate p*q subsampled Gaussian)": paper_mixture_epsilon(p, q, sigma, 1, delta, accountant),
        },
        settings={"private_probability": p, "noise_multiplier": sigma, "sample_rate": q, "n_units": n_units,
                  "noise_factor": noise_factor, "rows_per_unit": rows_per_unit},
    )


class _OneHot:
    """Tabular features of integer states stored as floats (obs [..., 1] -> [..., n])."""

    def __init__(self, n_states: int):
        self.n_features = n_states

    def __call__(self, obs: torch.Tensor) -> torch.Tensor:
        return nn.functional.one_hot(obs[..., 0].long(), self.n_features).to(torch.float32)


def _gpope_trajectories(n_others: int, length: int, n_states: int, canary_reward: float | None) -> dict[str, torch.Tensor]:
    """Padded trajectories: the others wander over states 0..n-2; the canary sits in state n-1 with a huge reward."""
    generator = make_generator(2024)
    obs = torch.randint(0, n_states - 1, (n_others, length + 1, 1), generator=generator).float()
    rewards = torch.rand(n_others, length, generator=generator)
    if canary_reward is not None:
        obs = torch.cat([torch.full((1, length + 1, 1), float(n_states - 1)), obs])
        rewards = torch.cat([torch.full((1, length), canary_reward), rewards])
    n = obs.shape[0]
    return {
        "observations": obs,
        "actions": torch.zeros(n, length, dtype=torch.long),
        "rewards": rewards,
        "mask": torch.ones(n, length, dtype=torch.bool),
        "terminated": torch.ones(n, dtype=torch.bool),
    }


def _gpope_directions(canary_reward: float | None, n_others: int) -> torch.Tensor:
    """B_i of every trajectory from ``GPOPE.unit_directions`` at a fixed public, non-trivial iterate (theta, w)."""
    from dporl.algos.gpope import GPOPE, GPOPEConfig
    from dporl.privacy.samplers import Batch

    n_states, length = 5, 6
    model = GPOPE(_OneHot(n_states), GPOPEConfig(gamma=0.9))
    with torch.no_grad():  # both halves of B_i active
        model.theta.copy_(torch.linspace(-1, 1, n_states))
        model.w.copy_(torch.linspace(0.5, -0.5, n_states))
    data = _gpope_trajectories(n_others, length, n_states, canary_reward)
    n = data["mask"].shape[0]
    return model.unit_directions(Batch(data, torch.arange(n), n, private=True))


def _released_updates(units: torch.Tensor, chosen: torch.Tensor, trial: torch.Tensor, n: int, *, sigma: float,
                      clip: float, expected: float, seed: int) -> torch.Tensor:
    """[n, width] released updates: sampled unit ``chosen[k]`` of trial ``trial[k]`` placed in that trial's block of
    one flat vector, clipped, summed, noised and divided by the engine (``private_direction``)."""
    width = units.shape[1]
    vectors = torch.zeros(len(chosen), n * width, dtype=units.dtype)
    vectors.scatter_(1, trial.unsqueeze(1) * width + torch.arange(width), units[chosen])
    holder = nn.Linear(1, 1)  # the engine needs a module; private_direction only uses clip, noise and divisor
    engine = DPSGDEngine(holder, max_grad_norm=clip, noise_multiplier=sigma, expected_batch_size=expected,
                         noise=NoiseSource(seed))
    return engine.private_direction(vectors).reshape(n, width)


def gpope_audit(
    noise_multiplier: float = 1.0,
    sample_rate: float = 0.5,
    n_trajectories: int = 6,
    max_grad_norm: float = 1.0,
    delta: float = 1e-5,
    accountant: str = "pld",
    noise_factor: float = 1.0,
    replace_one: bool = False,
) -> Experiment:
    """One GPOPE update (Poisson mode) on D = canary trajectory + others vs D' = others (add/remove).

    The canary visits a state no other trajectory visits, with reward 1000, so its B_i is clipped to norm h along a
    direction u orthogonal to every other B_i. Statistic: the released update's projection on u.

    ``replace_one``: D' replaces the canary by its mirror (reward -1000) instead of removing it, and the claim is the
    replace-one analysis of the same Poisson events (``dporl.privacy.relations``): the two clipped directions point
    nearly opposite ways, and the statistic is the projection on their difference.
    """
    sigma = check_positive("noise_multiplier", noise_multiplier)
    q = check_probability("sample_rate", sample_rate, allow_zero=False)
    used_sigma = sigma * check_positive("noise_factor", noise_factor)
    other = -1000.0 if replace_one else None
    others = n_trajectories - 1
    directions = {True: _gpope_directions(1000.0, others), False: _gpope_directions(other, others)}
    canary_dir = directions[True][0] / directions[True][0].norm()
    if replace_one:
        mirror_dir = directions[False][0] / directions[False][0].norm()
        canary_dir = (canary_dir - mirror_dir) / (canary_dir - mirror_dir).norm()
    if float((directions[True][1:] @ canary_dir).abs().max()) > 1e-4:
        raise AssertionError("the GPOPE canary is not orthogonal to the other trajectories")  # construction bug
    expected = q * n_trajectories
    event = step_event_factory(q)(sigma)
    if replace_one:
        from dporl.privacy.accountants import REPLACE_ONE
        from dporl.privacy.relations import CONVERSION, epsilon_for_relation

        claimed = epsilon_for_relation([(event, 1)], delta, REPLACE_ONE)
        analysis = f"{event}, {CONVERSION}"
        neighbours = "replace-one: canary trajectory (reward +1000) vs its mirror (reward -1000), Poisson sampling"
    else:
        claimed = epsilon_for([(event, 1)], delta, accountant)
        analysis = f"{event} by {analysis_name(accountant)} (Poisson mode)"
        neighbours = "add/remove a canary trajectory in a state no other visits, reward 1000 (B_i clipped to h)"

    def scores(n: int, on_d: bool, seed: int) -> np.ndarray:
        units = directions[on_d]
        per_trial = units.shape[0]
        source = PoissonUnitSource(
            {"unit": torch.arange(per_trial).repeat(n), "trial": torch.arange(n).repeat_interleave(per_trial)},
            torch.arange(n * per_trial), n * per_trial, q,
        )
        batch = source.sample(make_generator(seed))
        update = _released_updates(units, batch.data["unit"], batch.data["trial"], n, sigma=used_sigma,
                                   clip=max_grad_norm, expected=expected, seed=seed + 1)
        return (update @ canary_dir.to(update.dtype)).double().numpy() * expected / max_grad_norm

    return Experiment(
        name="gpope",
        claimed_epsilon=claimed,
        delta=delta,
        privacy_unit="trajectory",
        analysis=analysis,
        neighbours=neighbours,
        scores=scores,
        chunk_trials=500,
        settings={"noise_multiplier": sigma, "sample_rate": q, "n_trajectories": n_trajectories,
                  "noise_factor": noise_factor, "replace_one": replace_one},
    )


def gpope_paper_audit(
    noise_multiplier: float = 2.0,
    n_trajectories: int = 4,
    max_grad_norm: float = 1.0,
    delta: float = 1e-5,
    noise_factor: float = 1.0,
) -> Experiment:
    """One GPOPE update in the paper's mode: one trajectory uniformly at random (``FixedSizeSource``, sample 1),
    replace-one adjacency. D holds the canary (reward +1000), D' replaces it by its mirror (reward -1000): their
    clipped B_i point in nearly opposite directions, the worst case 2h of the replace-one analysis. Statistic:
    projection of the update on the difference of the two clipped directions.
    """
    sigma = check_positive("noise_multiplier", noise_multiplier)
    used_sigma = sigma * check_positive("noise_factor", noise_factor)
    directions = {True: _gpope_directions(1000.0, n_trajectories - 1), False: _gpope_directions(-1000.0, n_trajectories - 1)}
    clipped = [d[0] / d[0].norm() for d in (directions[True], directions[False])]
    axis = (clipped[0] - clipped[1]) / (clipped[0] - clipped[1]).norm()
    source = FixedSizeSource({"unit": torch.arange(n_trajectories)}, torch.arange(n_trajectories), n_trajectories, 1)
    event = source.step_event(sigma)

    def scores(n: int, on_d: bool, seed: int) -> np.ndarray:
        generator = make_generator(seed)
        # FixedSizeSource(sample_size=1) takes randperm(m)[:1]: one unit uniformly at random. The same law is drawn
        # for all trials at once (the source's Python-level call per trial would dominate the audit's cost).
        chosen = torch.randint(0, n_trajectories, (n,), generator=generator)
        update = _released_updates(directions[on_d], chosen, torch.arange(n), n, sigma=used_sigma,
                                   clip=max_grad_norm, expected=1.0, seed=seed + 1)
        return (update @ axis.to(update.dtype)).double().numpy() / max_grad_norm

    return Experiment(
        name="gpope_paper",
        claimed_epsilon=epsilon_for([(event, 1)], delta, "rdp"),
        delta=delta,
        privacy_unit="trajectory",
        analysis=f"{event} by {analysis_name('rdp')} (sampling without replacement, replace-one)",
        neighbours="replace-one: canary trajectory (reward +1000) vs its mirror (reward -1000) in a state no other visits",
        scores=scores,
        chunk_trials=500,
        settings={"noise_multiplier": sigma, "n_trajectories": n_trajectories, "noise_factor": noise_factor},
    )
