"""The LunarLander heuristic family: Gymnasium's controller exactly at the default gains, varied per expert."""

import numpy as np
import pytest
import torch

from dporl.experts import ExpertSet
from dporl.experts.analytic import LANDER_THRESHOLD_RANGE, analytic_experts
from dporl.experts.generate import GenerationConfig, generate_experts
from dporl.experts.policies import LANDER_HEURISTIC_GAINS, StackedLanderHeuristic
from dporl.utils.validation import ValidationError

gym = pytest.importorskip("gymnasium")
pytest.importorskip("Box2D")


def heuristic_rollout_states(episodes: int = 3):
    from gymnasium.envs.box2d.lunar_lander import heuristic

    env = gym.make("LunarLander-v3")
    states, actions = [], []
    for episode in range(episodes):
        state, _ = env.reset(seed=episode)
        for _ in range(1000):
            action = heuristic(env, state)
            states.append(state)
            actions.append(action)
            state, _, terminated, truncated, _ = env.step(action)
            if terminated or truncated:
                break
    return torch.as_tensor(np.array(states)), np.array(actions)


def test_default_gains_reproduce_gymnasiums_heuristic_on_its_own_trajectories():
    states, actions = heuristic_rollout_states()
    assert len(set(actions.tolist())) == 4 and (states[:, 6] > 0).any()  # every branch, legs touching included
    default = torch.tensor([list(LANDER_HEURISTIC_GAINS.values())])
    policy = StackedLanderHeuristic.from_gains(default.repeat(2, 1), logit_scale=3.0)
    logits = policy.forward_paired(states.unsqueeze(0).repeat(2, 1, 1))
    # Same float32 arithmetic as Gymnasium's numpy code on float32 observations: every action equal.
    np.testing.assert_array_equal(logits.argmax(-1)[0].numpy(), actions)
    assert set(logits.unique().tolist()) == {0.0, 3.0}  # logit_scale on the chosen action, 0 elsewhere
    torch.testing.assert_close(policy.forward_all(states), logits)


def test_family_varies_gains_and_thresholds_and_selection_keeps_the_best():
    policy, info = analytic_experts("LunarLander-v3", [{}, {}], 3, seed=0)
    gains = policy.gains.numpy()
    assert isinstance(policy, StackedLanderHeuristic) and gains.shape == (6, 11) and info["setting"] == [0, 0, 0, 1, 1, 1]
    default = np.array(list(LANDER_HEURISTIC_GAINS.values()))
    ratio = gains[:, :9] / default[:9]
    assert np.all((ratio >= 0.5 - 1e-6) & (ratio <= 2.0 + 1e-6)) and len(np.unique(ratio.round(6))) == ratio.size
    assert np.all((gains[:, 9:] >= LANDER_THRESHOLD_RANGE[0]) & (gains[:, 9:] <= LANDER_THRESHOLD_RANGE[1]))
    config = GenerationConfig(env_id="LunarLander-v3", candidates_per_setting=3, keep_best=1, eval_episodes=1,
                              max_episode_steps=150)
    wind = {"gravity": -10.0, "enable_wind": True, "wind_power": 2.0, "turbulence_power": 0.2}
    generated = generate_experts(config, settings=[wind, {**wind, "gravity": -11.0}], progress=False)
    assert generated.policy.n_experts == 2
    np.testing.assert_array_equal(generated.eval_returns, generated.candidate_returns.max(axis=1))
    best = generated.candidate_returns.argmax(axis=1) + np.array([0, 3])
    torch.testing.assert_close(generated.policy.gains, policy.gains[torch.as_tensor(best)])


def test_lander_expert_set_round_trips_and_validates(tmp_path):
    policy, _ = analytic_experts("LunarLander-v3", [{}], 2, seed=1, logit_scale=2.0)
    experts = ExpertSet(policy, p_min=0.05)
    loaded = ExpertSet.load(experts.save(tmp_path / "experts.pt"))
    states = torch.randn(5, 8)
    torch.testing.assert_close(loaded.log_probs(states), experts.log_probs(states))
    assert loaded.policy.config()["logit_scale"] == 2.0 and loaded.fingerprint() == experts.fingerprint()
    with pytest.raises(ValidationError, match="gains"):
        StackedLanderHeuristic.from_gains(torch.zeros(2, 5))
    with pytest.raises(ValidationError, match="obs_dim"):
        StackedLanderHeuristic(1, obs_dim=6)
