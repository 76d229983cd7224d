import math

import numpy as np
import pytest
import torch

from dporl.experts import ExpertSet, StackedLinearPolicy
from dporl.experts.analytic import cartpole_lqr_experts
from dporl.envs.variants import physics_of
from dporl.envs.process_env import make_vector_env
from dporl.experts.collect import collect, evaluate_policies
from dporl.utils.validation import ValidationError


def _lqr_set(n_experts=4, p_min=0.2, softening="argmax", logit_scale=1.0):
    policy, _ = cartpole_lqr_experts([{}] * n_experts, 1, seed=0, logit_scale=logit_scale)
    return ExpertSet(policy, p_min, softening)


def test_shapes_ids_metadata_and_logged_log_probs():
    experts = _lqr_set()
    data = collect(experts, "CartPole-v1", 3, 40, seed=5, progress=False)
    assert data.n_episodes == 12
    np.testing.assert_array_equal(data.unit_ids, np.repeat(np.arange(4), 3))
    assert data.episode_lengths.max() <= 40 and data.n_transitions == data.episode_lengths.sum()
    assert data.observations.shape == (data.n_transitions + data.n_episodes, 4)
    meta = data.metadata
    assert (meta.env_id, meta.n_actions, meta.n_units, meta.p_min, meta.seed) == ("CartPole-v1", 2, 4, 0.2, 5)
    assert meta.expert_set["sha256"] == experts.fingerprint()
    assert meta.extra["trajectories_per_expert"] == 3
    # The logged behaviour log-probs are exactly the softened expert's log-prob of the taken action.
    t = data.transitions()
    recomputed = experts.log_prob_of(torch.as_tensor(t.obs), torch.as_tensor(t.actions))  # [m, N]
    own = recomputed[torch.as_tensor(t.unit_ids), torch.arange(len(t.actions))]
    np.testing.assert_allclose(t.behavior_log_probs, own.numpy(), rtol=1e-6)
    # Episodes that stop before 40 steps fell (terminated); the others were cut off at 40 (truncated; a pole that
    # falls on step 40 is both).
    last = np.cumsum(data.episode_lengths) - 1
    assert np.all(data.terminations[last][data.episode_lengths < 40])
    assert not np.any(data.terminations[last][data.episode_lengths < 40] & data.truncations[last][data.episode_lengths < 40])
    assert np.all(data.truncations[last][data.episode_lengths == 40])


def test_logged_actions_follow_the_softened_policy():
    p_min = 0.2
    experts = _lqr_set(p_min=p_min)
    data = collect(experts, "CartPole-v1", 10, 60, seed=1, progress=False)
    t = data.transitions()
    best = experts.log_probs(torch.as_tensor(t.obs)).argmax(-1)  # [m, N]: each expert's preferred action
    took_best = (best[torch.as_tensor(t.unit_ids), torch.arange(len(t.actions))].numpy() == t.actions)
    # Given the visited states, each step takes the best action with probability exactly 1 - (n_A - 1) p_min = 0.8,
    # independently: the count is Binomial(N, 0.8); 4.5 sd keeps the false-alarm rate below 1e-5.
    n, p = len(took_best), 1 - p_min
    assert abs(took_best.sum() - n * p) <= 4.5 * math.sqrt(n * p * (1 - p))
    assert n > 1000


def test_collection_is_deterministic_under_a_seed_and_chunking_keeps_ids():
    experts = _lqr_set(n_experts=5)
    first = collect(experts, "CartPole-v1", 2, 30, seed=3, progress=False)
    again = collect(experts, "CartPole-v1", 2, 30, seed=3, progress=False)
    other = collect(experts, "CartPole-v1", 2, 30, seed=4, progress=False)
    for name in ("observations", "actions", "rewards", "episode_lengths", "behavior_log_probs"):
        np.testing.assert_array_equal(getattr(first, name), getattr(again, name))
    assert not np.array_equal(first.observations[:10], other.observations[:10])
    chunked = collect(experts, "CartPole-v1", 2, 30, seed=3, experts_per_chunk=2, progress=False)
    np.testing.assert_array_equal(chunked.unit_ids, np.repeat(np.arange(5), 2))
    assert chunked.n_episodes == 10


def test_collect_refuses_experts_that_break_p_min():
    # Raw softmax of large LQR logits puts far less than 0.2 on the weaker action: a configuration error.
    experts = _lqr_set(softening="none", logit_scale=100.0)
    with pytest.raises(ValidationError) as info:
        collect(experts, "CartPole-v1", 2, 30, seed=0, progress=False)
    assert info.value.field == "expert_set.p_min"


def test_bad_collection_arguments_and_action_space_mismatch():
    experts = _lqr_set()
    with pytest.raises(ValidationError, match="trajectories_per_expert"):
        collect(experts, "CartPole-v1", 0, 30, seed=0, progress=False)
    with pytest.raises(ValidationError, match="max_episode_steps"):
        collect(experts, "CartPole-v1", 1, 0, seed=0, progress=False)
    three_actions = ExpertSet(StackedLinearPolicy(2, 4, 3), 0.1)
    with pytest.raises(ValidationError, match="action space"):
        collect(three_actions, "CartPole-v1", 1, 10, seed=0, progress=False)


def test_evaluate_policies_scores_each_expert_greedily():
    good, _ = cartpole_lqr_experts([{}] * 2, 1, seed=0)
    weight = torch.cat([good.weight, torch.zeros(1, 4, 2)])  # a third expert that always pushes left
    policy = StackedLinearPolicy.from_weights(weight, torch.zeros(3, 2))
    returns = evaluate_policies(policy, "CartPole-v1", [{}] * 3, episodes=2, max_episode_steps=50, seed=0)
    assert returns.shape == (3,)
    np.testing.assert_array_equal(returns[:2], [50.0, 50.0])  # the LQR controllers balance for 50 steps
    assert returns[2] < 20  # always pushing one way drops the pole within ~10 steps
    with pytest.raises(ValidationError, match="settings"):
        evaluate_policies(policy, "CartPole-v1", [{}], episodes=1, max_episode_steps=5, seed=0)


def test_per_expert_physics_settings_reach_their_sub_envs():
    # LunarLander settings mix a shared boolean (enable_wind) with per-expert numbers; the sub-envs must get them.
    settings = [{"enable_wind": True, "gravity": -9.0, "wind_power": 0.0, "turbulence_power": 0.0},
                {"enable_wind": True, "gravity": -11.0, "wind_power": 5.0, "turbulence_power": 0.5}]
    vector_env = make_vector_env("LunarLander-v3", 2, 10, settings)
    try:
        physics = physics_of(vector_env, "LunarLander-v3")
    finally:
        vector_env.close()
    assert physics["gravity"] == [-9.0, -11.0] and physics["wind_power"] == [0.0, 5.0]
    assert physics["enable_wind"] == [True, True]
    with pytest.raises(ValidationError, match="same physics parameters"):
        make_vector_env("LunarLander-v3", 2, 10, [settings[0], {"gravity": -10.0}])
