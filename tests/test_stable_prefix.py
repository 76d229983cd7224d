"""Stable-prefix release (Algorithms 1-2): fresh rollouts in the public simulator (sound, default) and the paper's
logged-prefix variant (no guarantee): queries, threshold use, laziness, independence from the logged records,
identities, accounting, refusals."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from dporl.algos.stable_prefix import (
    LOGGED_NO_GUARANTEE,
    RELEASE_STAGE,
    StablePrefixConfig,
    execute_release,
    plan_release,
    release_stable_prefixes,
    stability_log_queries,
    with_budget,
)
from dporl.data.dataset import DatasetMetadata, TrajectoryDataset
from dporl.experts.analytic import cartpole_lqr_experts
from dporl.experts.collect import collect
from dporl.experts.expert_set import ExpertSet
from dporl.experts.policies import StackedLinearPolicy
from dporl.privacy.events import ApproxDPEvent
from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.randomness import SecretRoot
from dporl.utils.validation import PrivacyBudgetError, ValidationError

P_MIN = 0.1
OBS_DIM, N_ACTIONS = 2, 2


# ---------------------------------------------------------------------------------------------------- worlds
def make_experts(m: int, spread: float, seed: int = 0) -> ExpertSet:
    """Linear experts on 2-d states that mostly agree (action 0 iff s_0 > s_1), each perturbed by ``spread``."""
    g = torch.Generator().manual_seed(seed)
    base = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    weight = base + spread * torch.randn(m, OBS_DIM, N_ACTIONS, generator=g)
    return ExpertSet(StackedLinearPolicy.from_weights(weight, torch.zeros(m, N_ACTIONS)), P_MIN, "argmax")


def make_dataset(experts: ExpertSet, per_expert: int, length: int, seed: int = 0, p_min: float = P_MIN):
    """Each expert logs ``per_expert`` episodes of ``length`` random states with its own best action (no simulator:
    for the logged variant and the query arithmetic only)."""
    rng = np.random.default_rng(seed)
    episodes = []
    for i in range(experts.n_experts):
        for _ in range(per_expert):
            obs = rng.standard_normal((length + 1, OBS_DIM)).astype(np.float32)
            best = experts.log_probs(torch.from_numpy(obs[:-1]), experts=[i])[0].argmax(-1).numpy()
            episodes.append(
                {
                    "observations": obs,
                    "actions": best,
                    "rewards": np.ones(length, dtype=np.float32),
                    "terminated": True,
                    "truncated": False,
                    "unit_id": i,
                    "behavior_log_probs": np.full(length, math.log1p(-P_MIN), dtype=np.float32),
                }
            )
    meta = DatasetMetadata(
        env_id="test", n_actions=N_ACTIONS, n_units=experts.n_experts, obs_shape=(OBS_DIM,), p_min=p_min,
        expert_set=experts.reference(),
    )
    return TrajectoryDataset.from_episodes(episodes, meta)


def cartpole_experts(m: int, identical: bool = False) -> ExpertSet:
    """LQR bang-bang CartPole experts on three gravities (or m copies of one)."""
    if identical:
        policy, _ = cartpole_lqr_experts([{"gravity": 9.8}], 1, seed=0)
        policy = policy.select(torch.zeros(m, dtype=torch.long))
    else:
        settings = [{"gravity": g} for g in (9.0, 9.8, 10.5)]
        policy, _ = cartpole_lqr_experts(settings, m // 3, seed=0)
    return ExpertSet(policy, P_MIN, "argmax")


@pytest.fixture(scope="module")
def cartpole():
    """150 CartPole experts, 2 logged episodes each of <= 60 steps (logging seed 0), and the same experts' data
    logged with another seed (different records, identical metadata)."""
    experts = cartpole_experts(150)
    data = collect(experts, "CartPole-v1", 2, max_episode_steps=60, seed=0, progress=False)
    other = collect(experts, "CartPole-v1", 2, max_episode_steps=60, seed=1, progress=False)
    return experts, data, other


@pytest.fixture(scope="module")
def synthetic():
    experts = make_experts(200, spread=0.3)
    return experts, make_dataset(experts, per_expert=2, length=30)


def release(dataset, experts, *, epsilon=10.0, delta=1e-5, trajectories=5, seed=0, ledger=None, **cfg):
    return release_stable_prefixes(
        dataset, experts, epsilon=epsilon, delta=delta, config=StablePrefixConfig(trajectories=trajectories, **cfg),
        root=SecretRoot(seed), ledger=ledger,
    )


def brute_force_q(experts: ExpertSet, obs: np.ndarray, actions: np.ndarray) -> np.ndarray:
    """q_k = sum_i prod_{t<=k} pi_i(a_t | s_t), one expert at a time, in probability space (float64)."""
    q = np.zeros(len(actions))
    for i in range(experts.n_experts):
        probs = experts.log_probs(torch.tensor(obs[: len(actions)]), experts=[i])[0].double().exp().numpy()
        q += np.cumprod(probs[np.arange(len(actions)), actions])
    return q


def released_episodes(stable: TrajectoryDataset):
    for e in range(stable.n_episodes):
        yield stable.episode_observations_actions(e)


# ---------------------------------------------------------------------------------------------------- queries
def test_stability_query_equals_brute_force_sum(synthetic):
    experts, data = synthetic
    obs, actions = data.episode_observations_actions(3)
    log_mass = torch.zeros(experts.n_experts, 1, dtype=torch.float64)
    log_q = []
    for k in range(len(actions)):  # step by step, in expert chunks of 7 (not a divisor of 200)
        step_q, log_mass = stability_log_queries(
            experts, torch.tensor(obs[k : k + 1]), torch.tensor(actions[k : k + 1]), log_mass, expert_chunk=7
        )
        log_q.append(float(step_q[0]))
    np.testing.assert_allclose(np.exp(log_q), brute_force_q(experts, obs, actions), rtol=1e-9)


# ---------------------------------------------------------------------------------------------------- fresh release
def test_fresh_release_stops_exactly_at_the_derived_threshold(cartpole):
    """m identical softened experts: q_k = m prod_t pi(a_t | s_t), with pi = 0.9 for the best action and 0.1
    otherwise. G = G0/p_min + t_beta exceeds m p_min, so with the Laplace noise scaled to ~0 a run passes query k iff
    its first k actions are all best and m 0.9^k >= G: prefixes hold best actions only and never pass
    K* = floor(log(G/m) / log 0.9) = 11 (T = 5, eps 10); P[a run reaches K*] = 0.9^11 ~ 0.31, so among 12 x 5 runs
    some do (fails with probability 0.69^60 < 1e-9). A comparison against G0 alone, or in log space, would give other
    lengths."""
    _, data, _ = cartpole
    experts = cartpole_experts(150, identical=True)
    config = StablePrefixConfig(trajectories=5, check_expert_set_hash=False)
    plan = plan_release(data, experts, epsilon=10.0, delta=1e-5, config=config)
    budget = plan.budget
    assert budget.threshold == pytest.approx(budget.g0 / P_MIN + budget.t_beta)
    assert 150 * P_MIN < budget.threshold < 150 * 0.9
    k_star = math.floor(math.log(budget.threshold / 150) / math.log(0.9))
    runs = execute_release(with_budget(plan, noise_scale=1e-12), data, experts, SecretRoot(4), trials=12)
    stable = runs.stable_dataset(data.metadata)
    best = [experts.log_probs(torch.tensor(obs[:-1]))[0].argmax(-1).numpy() for obs, _ in released_episodes(stable)]
    assert all(np.array_equal(actions, b) for (_, actions), b in zip(released_episodes(stable), best))
    assert runs.lengths.max() == k_star and np.all(runs.lengths <= k_star)
    for obs, actions in released_episodes(stable):  # every released query passed, on the brute-force sum
        assert np.all(brute_force_q(experts, obs, actions) >= budget.threshold)


def test_fresh_release_never_reads_the_logged_records(cartpole):
    """D_stable is a function of the public metadata, the experts and the secret randomness only: the same root on
    two datasets with identical metadata but different logged records gives the same D_stable, and no logged
    observation row of either appears in it (states come from fresh simulator resets, seeded secretly)."""
    experts, data, other = cartpole
    other = TrajectoryDataset(**{k: getattr(other, k) for k in (
        "observations", "actions", "rewards", "terminations", "truncations", "episode_lengths", "unit_ids")},
        metadata=data.metadata)
    first = release(data, experts, trajectories=5, seed=11).stable
    second = release(other, experts, trajectories=5, seed=11).stable
    assert first.n_transitions > 0
    for name in ("observations", "actions", "rewards", "terminations", "truncations", "episode_lengths"):
        np.testing.assert_array_equal(getattr(first, name), getattr(second, name))
    released = {row.tobytes() for row in first.observations}
    for logged in (data, other):
        assert not released & {row.tobytes() for row in logged.observations}
    assert not np.array_equal(release(data, experts, trajectories=5, seed=12).stable.observations[:1],
                              first.observations[:1])  # another root: other initial states


def test_fresh_prefixes_are_simulator_transitions(cartpole):
    """Each released prefix replays exactly in the public simulator: CartPole is deterministic given the state, so
    setting the first state and applying the released actions reproduces every state, reward and end flag."""
    import gymnasium as gym

    experts, data, _ = cartpole
    stable = release(data, experts, trajectories=20, seed=5).stable
    env = gym.make("CartPole-v1", max_episode_steps=60)
    env.reset(seed=0)
    for e in range(stable.n_episodes):
        episode = stable.episode(e)
        env.unwrapped.state = episode["observations"][0].astype(np.float64)
        for t, action in enumerate(episode["actions"]):
            obs, reward, term, _, _ = env.step(int(action))
            np.testing.assert_allclose(obs, episode["observations"][t + 1], rtol=1e-6, atol=1e-6)
            assert reward == episode["rewards"][t]
        assert bool(term) == bool(episode["terminated"])
    env.close()


@pytest.mark.parametrize("env_id", ["CartPole-v1", "Acrobot-v1", "LunarLander-v3", "dporl/HIVTreatment-v0"])
def test_the_public_simulator_rebuilds_from_the_logging_metadata(env_id):
    """Every shipped environment's logging physics (as ``collect`` records it: all parameters, LunarLander's wind
    settings too while wind is off) rebuilds the simulator, which accepts a 128-bit secret reset seed."""
    from dporl.algos.stable_prefix import PublicSimulator
    from dporl.envs.vector import logging_physics

    env = PublicSimulator(env_id, logging_physics(env_id, {}, {}), {}, 5).make(3)
    try:
        first, _ = env.reset(seed=2**127 + 3)
        second, _ = env.reset(seed=2**127 + 4)
        assert first.shape[0] == 3 and not np.array_equal(first, second) or env_id == "dporl/HIVTreatment-v0"
    finally:
        env.close()


def test_fresh_release_never_evaluates_past_the_first_failed_query(cartpole):
    experts, data, _ = cartpole
    seen = []

    class Spy(ExpertSet):
        def log_probs(self, states, experts=None, **kwargs):
            seen.append(torch.as_tensor(states).clone())
            return super().log_probs(states, experts, **kwargs)

    spy = Spy(experts.policy, P_MIN, "argmax")
    out = release(data, spy, trajectories=12, expert_chunk=64, check_expert_set_hash=False, seed=3)
    shown = torch.cat(seen[::3])  # 150 experts in chunks of 64: 3 calls per step, same states each
    lengths = out.runs.lengths
    # A run shows its states s_1..s_K of the released prefix, plus s_{K+1} when its query K+1 was asked and
    # failed: i.e. unless it ended by termination or reached the horizon.
    ended = out.runs.prefixes.terminated | (lengths == 60)
    assert len(shown) == out.runs.states_evaluated == int((lengths + ~ended).sum())
    expected = np.concatenate([out.runs.prefixes.observations[: k + (not e), r] for r, (k, e) in
                               enumerate(zip(lengths, ended))])
    assert sorted(map(tuple, shown.numpy().tolist())) == sorted(map(tuple, expected.tolist()))


@pytest.mark.parametrize("source", ["fresh", "logged"])
def test_release_log_mass_is_the_released_prefixes_likelihood(cartpole, synthetic, source):
    """ReleaseRuns.log_mass[i, r] = sum over run r's RELEASED prefix of log pi_i(a_t | s_t) (what its last passed
    query compared; the failed query's action is not in it): the audits' likelihood ratio relies on it."""
    experts, data = cartpole[:2] if source == "fresh" else synthetic
    plan = plan_release(data, experts, epsilon=10.0, delta=1e-5, config=StablePrefixConfig(trajectories=5, source=source))
    runs = execute_release(plan, data, experts, SecretRoot(8), trials=4)
    assert runs.lengths.max() > 0
    for r, k in enumerate(runs.lengths):
        obs = torch.from_numpy(runs.prefixes.observations[:k, r])
        actions = torch.from_numpy(runs.prefixes.actions[:k, r])
        expected = experts.log_prob_of(obs, actions).double().sum(1) if k else torch.zeros(experts.n_experts)
        torch.testing.assert_close(runs.log_mass[:, r], expected.double(), rtol=1e-6, atol=1e-6)


def test_stable_data_carry_no_expert_identity(cartpole):
    experts, data, _ = cartpole
    out = release(data, experts, trajectories=10, seed=1)
    assert out.stable.n_episodes > 0
    assert np.all(out.stable.unit_ids == 0) and out.stable.metadata.n_units == 1
    assert out.stable.behavior_log_probs is None
    assert out.stable.metadata.expert_set is None and out.stable.metadata.p_min is None
    assert "sha256" not in str(out.stable.metadata.to_dict())
    assert out.stable.metadata.extra["source"] == "fresh"


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fresh_release_with_experts_on_cuda(cartpole):
    """Experts on the GPU, simulator and secret streams on the CPU: same release as on the CPU (the softened
    policies only use each expert's argmax, which float differences leave unchanged on these states)."""
    experts, data, _ = cartpole
    import copy

    on_gpu = copy.deepcopy(experts).to("cuda")
    gpu = release(data, on_gpu, trajectories=5, seed=31).stable
    cpu = release(data, experts, trajectories=5, seed=31).stable
    np.testing.assert_array_equal(gpu.actions, cpu.actions)
    np.testing.assert_allclose(gpu.observations, cpu.observations)


def test_same_root_same_release_and_streams_are_named(cartpole):
    experts, data, _ = cartpole
    a = release(data, experts, seed=21).stable
    b = release(data, experts, seed=21).stable
    np.testing.assert_array_equal(a.observations, b.observations)
    root = SecretRoot(21)
    release_stable_prefixes(data, experts, epsilon=10.0, delta=1e-5, config=StablePrefixConfig(trajectories=5),
                            root=root)
    assert "release/laplace" in repr(root) and "release/env" in repr(root)
    with pytest.raises(ValidationError):  # a root hands each stream out once: a second release must use a new root
        release_stable_prefixes(data, experts, epsilon=10.0, delta=1e-5, config=StablePrefixConfig(trajectories=5),
                                root=root)


def test_ledger_receives_T_events_of_two_eps_prime_beta(cartpole):
    experts, data, _ = cartpole
    ledger = PrivacyLedger()
    out = release(data, experts, epsilon=8.0, delta=2e-6, trajectories=7, ledger=ledger)
    stage = ledger.stages[RELEASE_STAGE]
    assert stage.analysis.startswith("sparse-vector stable-prefix release of fresh rollouts")
    assert stage.budget == (8.0, 2e-6) and stage.mechanism == "pld" and stage.unit.name == "expert"
    assert stage.accountant.history == [(ApproxDPEvent(2 * out.budget.epsilon_prime, out.budget.beta), 7)]
    assert out.budget.noise_scale == pytest.approx(2 / out.budget.epsilon_prime)  # monotone-query scale
    report = ledger.report()
    assert report.guarantee is not None and report.void is None


def test_release_saves_public_and_curator_outputs_apart(cartpole, tmp_path):
    experts, data, _ = cartpole
    out = release(data, experts, trajectories=4)
    out.save(tmp_path / "release", tmp_path / "curator")
    stable = TrajectoryDataset.load(tmp_path / "release" / "d_stable.npz")
    assert stable.n_transitions == out.stable.n_transitions
    import json

    public = json.loads((tmp_path / "release" / "release.json").read_text())
    assert set(public) == {"source", "guarantee", "runs", "released_prefixes", "stable_transitions", "epsilon_prime",
                           "beta", "threshold", "noise_scale"}
    curator = json.loads((tmp_path / "curator" / "release_runs.json").read_text())
    assert len(curator["run_experts"]) == 4 and curator["note"].startswith("CURATOR-ONLY")
    assert not (tmp_path / "release" / "d_unstable.npz").exists()


# ---------------------------------------------------------------------------------------------------- refusals
@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"epsilon": 0.0}, "release.epsilon"),
        ({"epsilon": -1.0}, "release.epsilon"),
        ({"delta": 1.0}, "release.delta"),
        ({"delta": 0.0}, "release.delta"),
    ],
)
def test_bad_budgets_are_refused(cartpole, kwargs, field):
    experts, data, _ = cartpole
    with pytest.raises(ValidationError) as info:
        release(data, experts, **kwargs)
    assert info.value.field == field


def refused(data, experts, field, **kwargs):
    """The release refuses with ``field`` named and nothing recorded in the ledger."""
    ledger = PrivacyLedger()
    with pytest.raises(ValidationError) as info:
        release(data, experts, ledger=ledger, **kwargs)
    assert info.value.field == field, info.value
    assert not ledger.stages and ledger.void_reason is None


def with_metadata(data: TrajectoryDataset, **changes) -> TrajectoryDataset:
    meta = dataclasses.replace(data.metadata, **changes)
    return TrajectoryDataset(**{k: getattr(data, k) for k in (
        "observations", "actions", "rewards", "terminations", "truncations", "episode_lengths", "unit_ids",
        "behavior_log_probs")}, metadata=meta)


def test_no_public_simulator_is_refused_before_spending(cartpole):
    experts, data, _ = cartpole
    refused(with_metadata(data, env_id="nowhere/Unknown-v0"), experts, "dataset.metadata.env_id")
    refused(with_metadata(data, env_id="not an id"), experts, "dataset.metadata.env_id")
    # A makeable environment with other spaces than the experts' (Acrobot: 3 actions, 6 features).
    refused(with_metadata(data, env_id="Acrobot-v1", env_params={}), experts, "dataset.metadata.env_id")
    no_limit = with_metadata(data, extra={k: v for k, v in data.metadata.extra.items() if k != "max_episode_steps"})
    refused(no_limit, experts, "release.horizon")
    assert release(no_limit, experts, horizon=30).stable.episode_lengths.max() <= 30


def test_missing_or_foreign_expert_sets_are_refused(cartpole):
    experts, data, _ = cartpole
    refused(data, None, "data.expert_set")
    other = cartpole_experts(150, identical=True)
    refused(data, other, "expert_set")
    refused(with_metadata(data, expert_set=None), experts, "dataset.metadata.expert_set")
    # The check can be waived explicitly (the user asserts the experts are the loggers).
    assert release(with_metadata(data, expert_set=None), experts, check_expert_set_hash=False).stable is not None


def test_too_few_experts_for_the_first_action_is_refused():
    # m p_min = 5 * 0.1 = 0.5 < G0 = 1 / (1 - e^{-eps'}) >= 1 for every eps'.
    experts = cartpole_experts(5, identical=True)
    data = collect(experts, "CartPole-v1", 1, max_episode_steps=5, seed=0, progress=False)
    ledger = PrivacyLedger()
    with pytest.raises(PrivacyBudgetError) as info:
        release(data, experts, ledger=ledger)
    assert info.value.field == "p_min" and not ledger.stages  # refused before anything is spent


def test_p_min_mismatch_between_data_and_experts_is_refused(synthetic):
    experts, _ = synthetic
    softer_logging = make_dataset(experts, per_expert=1, length=3, p_min=0.05)
    with pytest.raises(ValidationError) as info:
        release(softer_logging, experts, source="logged")
    assert info.value.field == "expert_set.p_min"
    unknown = make_dataset(experts, per_expert=1, length=3, p_min=None)
    with pytest.raises(ValidationError) as info:
        release(unknown, experts, source="logged")
    assert info.value.field == "dataset.metadata.p_min"


# ---------------------------------------------------------------------------------------------------- logged variant
def test_logged_variant_voids_the_guarantee_and_records_the_papers_figure(synthetic):
    experts, data = synthetic
    ledger = PrivacyLedger()
    out = release(data, experts, trajectories=6, ledger=ledger, source="logged")
    report = ledger.report()
    assert not ledger.stages and report.guarantee is None and report.void == LOGGED_NO_GUARANTEE
    text = report.describe()
    assert "the paper's mechanism: NO guarantee" in text
    assert not any(line.startswith("GUARANTEE") for line in text.splitlines())
    (claim,) = report.paper_claims
    assert claim.epsilon == pytest.approx(out.budget.composed_epsilon) and "NOT a guarantee" in claim.describe()


def test_logged_variant_stops_exactly_at_the_derived_threshold(synthetic):
    """With the noise scaled to ~0, run r passes query k iff q_k >= G on its logged episode."""
    experts, data = synthetic
    config = StablePrefixConfig(trajectories=6, source="logged")
    plan = plan_release(data, experts, epsilon=10.0, delta=1e-5, config=config)
    runs = execute_release(with_budget(plan, noise_scale=1e-12), data, experts, SecretRoot(0))
    lengths = []
    for episode in runs.episodes:
        obs, actions = data.episode_observations_actions(int(episode))
        below = np.flatnonzero(brute_force_q(experts, obs, actions) < plan.budget.threshold)
        lengths.append(int(below[0]) if len(below) else len(actions))
    np.testing.assert_array_equal(runs.lengths, lengths)
    assert 0 < runs.lengths.min() and runs.lengths.max() < 30  # the fixture exercises both outcomes
    # What it releases are the logged rows themselves (why it is not private on fixed data).
    stable = runs.stable_dataset(data.metadata)
    logged = {row.tobytes() for row in data.observations}
    assert all(row.tobytes() in logged for row in stable.observations)


def test_logged_choice_uses_each_episode_at_most_once_per_trial():
    experts = make_experts(40, spread=0.0)
    data = make_dataset(experts, per_expert=1, length=5)
    config = StablePrefixConfig(trajectories=60, source="logged")
    plan = plan_release(data, experts, epsilon=100.0, delta=1e-5, config=config)
    runs = execute_release(plan, data, experts, SecretRoot(2), trials=3)
    episodes = runs.episodes.reshape(3, 60)
    for trial in episodes:
        used = trial[trial >= 0]
        assert len(np.unique(used)) == len(used)
        # 60 runs over 40 experts with one episode each: repeats of an expert release nothing (-1) but still run.
        assert (trial == -1).sum() == 60 - len(used) >= 20
    assert not np.array_equal(episodes[0], episodes[1])  # trials are independent releases
    assert np.all(runs.lengths[runs.episodes == -1] == 0)


def test_a_release_repairs_an_expert_below_p_min_instead_of_refusing_mid_run():
    """An expert is one privacy unit: a release that refused when one expert's softmax dips below p_min would tell
    that expert's presence by an error. The release lifts that (expert, state) to p_min by mixing with the uniform
    policy (that expert alone; compliant ones untouched) and counts it, curator-only."""
    from dporl.experts.policies import StackedLinearPolicy

    weight = torch.zeros(3, 1, 2)
    weight[2, 0] = torch.tensor([-20.0, 20.0])  # expert 2: pi(0 | s) = sigmoid(-40 s), far below p_min for s > 0.2
    experts = ExpertSet(StackedLinearPolicy.from_weights(weight, torch.zeros(3, 2)), p_min=0.1, softening="none")
    states = torch.tensor([[0.0], [1.0]])
    with pytest.raises(ValidationError) as info:  # a direct query (the curator's own) still refuses
        experts.log_probs(states)
    assert info.value.field == "expert_set.p_min"
    probs = experts.log_probs(states, repair=True).exp()
    assert experts.repaired_queries == 1  # expert 2 at s = 1 only
    torch.testing.assert_close(probs[:2], torch.full((2, 2, 2), 0.5))  # compliant experts: untouched
    torch.testing.assert_close(probs[2, 0], torch.tensor([0.5, 0.5]))  # s = 0 complies: untouched
    assert float(probs[2, 1].min()) == pytest.approx(0.1) and float(probs[2, 1].sum()) == pytest.approx(1.0)
