"""Stable-prefix release (Algorithms 1-2): queries, threshold use, laziness, identities, accounting, refusals."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from dporl.algos.stable_prefix import (
    RELEASE_STAGE,
    StablePrefixConfig,
    release_stable_prefixes,
    stability_log_queries,
)
from dporl.data.dataset import DatasetMetadata, TrajectoryDataset
from dporl.experts.expert_set import ExpertSet
from dporl.experts.policies import StackedLinearPolicy
from dporl.privacy.events import ApproxDPEvent
from dporl.privacy.noise import NoiseSource
from dporl.privacy.sparse_vector import stable_prefix_budget
from dporl.utils.validation import PrivacyBudgetError, ValidationError

P_MIN = 0.1
OBS_DIM, N_ACTIONS = 2, 2


class ZeroNoise(NoiseSource):
    """Test double: every Laplace draw is 0, so the release compares q_k with the threshold G itself."""

    def laplace(self, shape, scale, dtype=torch.float64):
        return torch.zeros(shape if not isinstance(shape, int) else (shape,), dtype=dtype)


class RecordingLedger:
    """Test double with the ledger's stage/record interface that remembers every call."""

    def __init__(self):
        self.stages, self.records = {}, []

    def stage(self, name, *, budget=None, mechanism="rdp", unit="expert", analysis=None):
        self.stages[name] = {"budget": budget, "mechanism": mechanism, "unit": unit, "analysis": analysis}

    def record(self, stage, event, count=1):
        self.records.append((stage, event, count))


def make_experts(m: int, spread: float, seed: int = 0) -> ExpertSet:
    """Linear experts that mostly agree (action 0 iff s_0 > s_1), each perturbed by ``spread``."""
    g = torch.Generator().manual_seed(seed)
    base = torch.tensor([[1.0, 0.0], [0.0, 1.0]])
    weight = base + spread * torch.randn(m, OBS_DIM, N_ACTIONS, generator=g)
    return ExpertSet(StackedLinearPolicy.from_weights(weight, torch.zeros(m, N_ACTIONS)), P_MIN, "argmax")


def make_dataset(experts: ExpertSet, per_expert: int, length: int, seed: int = 0, p_min: float = P_MIN):
    """Each expert logs ``per_expert`` episodes of ``length`` random states with its own best action."""
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
                    "expert_id": i,
                    "behavior_log_probs": np.full(length, math.log1p(-P_MIN), dtype=np.float32),
                }
            )
    meta = DatasetMetadata(
        env_id="test", n_actions=N_ACTIONS, n_experts=experts.n_experts, obs_shape=(OBS_DIM,), p_min=p_min,
        expert_set=experts.reference(),
    )
    return TrajectoryDataset.from_episodes(episodes, meta)


def brute_force_q(experts: ExpertSet, obs: np.ndarray, actions: np.ndarray) -> np.ndarray:
    """q_k = sum_i prod_{t<=k} pi_i(a_t | s_t), one expert at a time, in probability space (float64)."""
    q = np.zeros(len(actions))
    for i in range(experts.n_experts):
        probs = experts.log_probs(torch.tensor(obs[: len(actions)]), experts=[i])[0].double().exp().numpy()
        q += np.cumprod(probs[np.arange(len(actions)), actions])
    return q


def release(dataset, experts, *, epsilon=10.0, delta=1e-5, trajectories=5, noise=None, ledger=None, seed=0, **cfg):
    return release_stable_prefixes(
        dataset, experts, epsilon=epsilon, delta=delta,
        config=StablePrefixConfig(trajectories=trajectories, **cfg),
        noise=noise if noise is not None else NoiseSource(seed), generator=torch.Generator().manual_seed(seed),
        ledger=ledger,
    )


@pytest.fixture(scope="module")
def world():
    experts = make_experts(200, spread=0.3)
    return experts, make_dataset(experts, per_expert=2, length=30)


def test_stability_query_equals_brute_force_sum(world):
    experts, data = world
    obs, actions = data.episode_observations_actions(3)
    log_mass = torch.zeros(experts.n_experts, 1, dtype=torch.float64)
    log_q = []
    for k in range(len(actions)):  # step by step, in expert chunks of 7 (not a divisor of 200)
        step_q, log_mass = stability_log_queries(
            experts, torch.tensor(obs[k : k + 1]), torch.tensor(actions[k : k + 1]), log_mass, expert_chunk=7
        )
        log_q.append(float(step_q[0]))
    np.testing.assert_allclose(np.exp(log_q), brute_force_q(experts, obs, actions), rtol=1e-9)


def test_zero_noise_release_stops_exactly_at_the_derived_threshold(world):
    """With Laplace draws at 0, run r passes query k iff q_k >= G = G0/p_min + t_beta: the prefix ends at the first
    k with brute-force q_k < G. (A comparison in log space or against G0 alone would give other lengths.)"""
    experts, data = world
    out = release(data, experts, noise=ZeroNoise(0), trajectories=6)
    budget = stable_prefix_budget(10.0, 1e-5, 6, P_MIN, experts.n_experts)
    assert out.budget.threshold == pytest.approx(budget.g0 / P_MIN + budget.t_beta)
    lengths = []
    for episode in out.processed_episodes:
        obs, actions = data.episode_observations_actions(int(episode))
        below = np.flatnonzero(brute_force_q(experts, obs, actions) < out.budget.threshold)
        lengths.append(int(below[0]) if len(below) else len(actions))
    np.testing.assert_array_equal(out.prefix_lengths, lengths)
    assert 0 < out.prefix_lengths.min() and out.prefix_lengths.max() < 30  # the fixture exercises both outcomes


def test_release_never_evaluates_past_the_first_failed_query(world):
    experts, data = world
    seen = []

    class Spy(ExpertSet):
        def log_prob_of(self, states, actions, experts=None):
            seen.append(torch.as_tensor(states).clone())
            return super().log_prob_of(states, actions, experts)

    spy = Spy(experts.policy, P_MIN, "argmax")
    out = release(data, spy, trajectories=8, expert_chunk=64, check_expert_set_hash=False, seed=3)
    shown = torch.cat(seen[::4])  # 200 experts in chunks of 64: 4 calls per step, same states each
    full = data.episode_lengths[out.processed_episodes]
    reached = np.minimum(out.prefix_lengths + 1, full)  # the prefix's states plus the state of the failed query
    assert len(shown) == out.states_evaluated == reached.sum()
    expected = np.concatenate(
        [data.episode_observations_actions(int(e))[0][:n] for e, n in zip(out.processed_episodes, reached)]
    )
    assert sorted(map(tuple, shown.numpy().tolist())) == sorted(map(tuple, expected.tolist()))


def test_stable_data_carry_no_expert_identity_and_partition_the_data(world):
    experts, data = world
    out = release(data, experts, trajectories=10, seed=1)
    assert out.stable.n_episodes > 0
    assert np.all(out.stable.expert_ids == 0) and out.stable.metadata.n_experts == 1
    assert out.stable.behavior_log_probs is None
    assert out.stable.metadata.expert_set is None and out.stable.metadata.p_min is None
    assert "sha256" not in str(out.stable.metadata.to_dict())
    # Every logged transition ends up in exactly one of D_stable / D_unstable.
    assert out.stable.n_transitions + out.unstable.n_transitions == data.n_transitions
    assert out.unstable.metadata == data.metadata and out.unstable.behavior_log_probs is not None


def test_trajectory_choice_uses_each_episode_at_most_once_and_exhausts_experts():
    experts = make_experts(40, spread=0.0)
    data = make_dataset(experts, per_expert=1, length=5)
    out = release(data, experts, epsilon=100.0, trajectories=60, seed=2)
    used = out.processed_episodes[out.processed_episodes >= 0]
    assert len(np.unique(used)) == len(used)
    # 60 runs over 40 experts with one episode each: repeats of an expert release nothing (-1) but still run.
    assert (out.processed_episodes == -1).sum() == 60 - len(used) >= 20
    assert len(out.prefix_lengths) == 60 and np.all(out.prefix_lengths[out.processed_episodes == -1] == 0)


def test_ledger_receives_T_events_of_two_eps_prime_beta(world):
    experts, data = world
    ledger = RecordingLedger()
    out = release(data, experts, epsilon=8.0, delta=2e-6, trajectories=7, ledger=ledger)
    stage = ledger.stages[RELEASE_STAGE]
    assert stage.pop("analysis").startswith("sparse-vector stable-prefix release")
    assert stage == {"budget": (8.0, 2e-6), "mechanism": "pld", "unit": "expert"}
    assert ledger.records == [(RELEASE_STAGE, ApproxDPEvent(2 * out.budget.epsilon_prime, out.budget.beta), 7)]
    assert out.budget.noise_scale == pytest.approx(2 / out.budget.epsilon_prime)  # monotone-query scale


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"epsilon": 0.0}, "release.epsilon"),
        ({"epsilon": -1.0}, "release.epsilon"),
        ({"delta": 1.0}, "release.delta"),
        ({"delta": 0.0}, "release.delta"),
    ],
)
def test_bad_budgets_are_refused(world, kwargs, field):
    experts, data = world
    with pytest.raises(ValidationError) as info:
        release(data, experts, **kwargs)
    assert info.value.field == field


def test_too_few_experts_for_the_first_action_is_refused():
    # m p_min = 5 * 0.1 = 0.5 < G0 = 1 / (1 - e^{-eps'}) >= 1 for every eps'.
    experts = make_experts(5, spread=0.0)
    data = make_dataset(experts, per_expert=1, length=3)
    with pytest.raises(PrivacyBudgetError) as info:
        release(data, experts, ledger=(ledger := RecordingLedger()))
    assert info.value.field == "p_min" and ledger.records == []  # refused before anything is spent


def test_p_min_mismatch_between_data_and_experts_is_refused(world):
    experts, _ = world
    softer_logging = make_dataset(experts, per_expert=1, length=3, p_min=0.05)
    with pytest.raises(ValidationError) as info:
        release(softer_logging, experts)
    assert info.value.field == "expert_set.p_min"
    unknown = make_dataset(experts, per_expert=1, length=3, p_min=None)
    with pytest.raises(ValidationError) as info:
        release(unknown, experts)
    assert info.value.field == "dataset.metadata.p_min"


def test_other_expert_set_than_the_loggers_is_refused(world):
    experts, data = world
    with pytest.raises(ValidationError) as info:
        release(data, make_experts(200, spread=0.3, seed=9))
    assert info.value.field == "expert_set"


def test_release_saves_inspectable_outputs(world, tmp_path):
    experts, data = world
    out = release(data, experts, trajectories=4)
    out.save(tmp_path)
    stable = TrajectoryDataset.load(tmp_path / "d_stable.npz")
    assert stable.n_transitions == out.stable.n_transitions
    assert TrajectoryDataset.load(tmp_path / "d_unstable.npz").n_transitions == out.unstable.n_transitions
    assert (tmp_path / "release.json").exists()


def test_unstable_part_cuts_every_episode_that_starts_with_a_released_prefix():
    """D_unstable is a per-episode function of (D, D_stable): an identical copy of a source episode (another
    expert's) loses the same prefix, so neighbouring datasets give D_unstable sets differing in one expert only."""
    from dporl.algos.stable_prefix import unstable_remainder

    experts = make_experts(3, spread=0.0)
    data = make_dataset(experts, per_expert=1, length=6)
    episodes = [data.episode(i) for i in range(3)]
    episodes[2] = {**episodes[0], "expert_id": 2}  # expert 2 logged exactly expert 0's episode
    data = TrajectoryDataset.from_episodes(episodes, data.metadata)
    rest = unstable_remainder(data, np.array([0]), np.array([4]))
    np.testing.assert_array_equal(rest.episode_lengths, [2, 6, 2])
    np.testing.assert_array_equal(rest.start_steps, [4, 0, 4])
    np.testing.assert_array_equal(rest.expert_ids, [0, 1, 2])
    whole = unstable_remainder(data, np.array([1, 0]), np.array([6, 2]))  # a fully released episode disappears
    np.testing.assert_array_equal(whole.expert_ids, [0, 2])
    np.testing.assert_array_equal(whole.start_steps, [2, 2])
