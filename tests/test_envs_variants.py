"""Physics variants: parameters reach the dynamics, derived quantities follow, grids match the paper."""

import gymnasium as gym
import numpy as np
import pytest

from dporl.envs.variants import PHYSICS_GRIDS, make_variant, make_vector_variant, physics_grid, physics_of
from dporl.utils.validation import ValidationError


def step_from(env, state, action):
    env.reset(seed=0)
    env.unwrapped.state = np.array(state, dtype=np.float64)
    return env.step(action)[0]


def test_cartpole_variant_changes_dynamics_and_derived_quantities():
    default = gym.make("CartPole-v1")
    variant = make_variant("CartPole-v1", {"gravity": 11.0, "force_mag": 9.0, "masscart": 1.25})
    u = variant.unwrapped
    assert (u.gravity, u.force_mag, u.masscart) == (11.0, 9.0, 1.25)
    assert u.total_mass == pytest.approx(1.25 + 0.1) and u.polemass_length == pytest.approx(0.1 * 0.5)
    state = [0.0, 0.1, 0.05, -0.1]
    a, b = step_from(default, state, 1), step_from(variant, state, 1)
    assert not np.allclose(a, b)
    # hand-computed Euler step of Gymnasium's CartPole equations with the new physics
    force, total, pml = 9.0, 1.35, 0.05
    sin, cos = np.sin(0.05), np.cos(0.05)
    temp = (force + pml * 0.01 * sin) / total
    theta_acc = (11.0 * sin - cos * temp) / (0.5 * (4.0 / 3.0 - 0.1 * cos**2 / total))
    x_acc = temp - pml * theta_acc * cos / total
    expected = [0.0 + 0.02 * 0.1, 0.1 + 0.02 * x_acc, 0.05 + 0.02 * -0.1, -0.1 + 0.02 * theta_acc]
    np.testing.assert_allclose(b, expected, rtol=1e-5)


def test_acrobot_variant_changes_dynamics():
    params = {"LINK_LENGTH_1": 1.2, "LINK_LENGTH_2": 1.2, "LINK_MASS_1": 0.9, "LINK_MASS_2": 1.1}
    default, variant = gym.make("Acrobot-v1"), make_variant("Acrobot-v1", params)
    assert physics_of(variant, "Acrobot-v1") == params
    state = [0.3, -0.2, 0.5, 0.1]
    assert not np.allclose(step_from(default, state, 2), step_from(variant, state, 2))


def test_lunar_lander_variant_uses_make_arguments():
    pytest.importorskip("Box2D")
    params = {"gravity": -9.0, "enable_wind": True, "wind_power": 5.0, "turbulence_power": 0.5}
    env = make_variant("LunarLander-v3", params)
    assert physics_of(env, "LunarLander-v3") == params
    assert env.unwrapped.world.gravity[1] == pytest.approx(-9.0)


def test_hiv_variant_changes_the_penalty():
    default = make_variant("dporl/HIVTreatment-v0", {}, horizon=2)
    variant = make_variant("dporl/HIVTreatment-v0", {"R1": 18750.0, "R2": 2150.0}, horizon=2)
    default.reset(seed=0), variant.reset(seed=0)
    r_default, r_variant = default.step(3)[1], variant.step(3)[1]
    assert r_variant - r_default == pytest.approx((20000.0 - 18750.0) * 0.49 + (2000.0 - 2150.0) * 0.09, rel=1e-9)


def test_vector_cartpole_runs_one_setting_per_sub_env():
    gravities = np.array([8.75, 9.5, 10.25, 11.0])
    vec = make_vector_variant("CartPole-v1", {"gravity": gravities, "masscart": 0.8}, num_envs=4)
    assert physics_of(vec, "CartPole-v1")["gravity"] == gravities.tolist()
    assert vec.unwrapped.total_mass == pytest.approx(0.9)
    vec.reset(seed=0)
    state = np.array([0.0, 0.1, 0.05, -0.1])
    vec.unwrapped.state = np.repeat(state[:, None], 4, axis=1)  # CartPoleVectorEnv stores [4, num_envs]
    batched = vec.step(np.ones(4, dtype=int))[0]
    for i, g in enumerate(gravities):
        single = step_from(make_variant("CartPole-v1", {"gravity": float(g), "masscart": 0.8}), state, 1)
        np.testing.assert_allclose(batched[i], single, rtol=1e-6)


def test_vector_variant_falls_back_to_sync_envs():
    vec = make_vector_variant("Acrobot-v1", {"LINK_MASS_1": [0.9, 1.1]}, num_envs=2)
    assert not isinstance(vec, gym.vector.SyncVectorEnv)  # numpy-batched (dporl.envs.classic_vector)
    assert physics_of(vec, "Acrobot-v1")["LINK_MASS_1"] == [0.9, 1.1]
    pytest.importorskip("Box2D")
    lander = make_vector_variant("LunarLander-v3", {"gravity": [-9.0, -11.0]}, num_envs=2)
    assert isinstance(lander, gym.vector.SyncVectorEnv)
    assert physics_of(lander, "LunarLander-v3")["gravity"] == [-9.0, -11.0]


def test_paper_grids():
    expected = {
        "CartPole-v1": {"gravity": (8.75, 11.0), "force_mag": (9.0, 11.25), "masscart": (0.8, 1.25)},
        "Acrobot-v1": {"LINK_LENGTH_1": (0.8, 1.2), "LINK_MASS_1": (0.9, 1.1), "LINK_MASS_2": (0.9, 1.1)},
        "LunarLander-v3": {"gravity": (-11.0, -9.0), "wind_power": (0.0, 5.0), "turbulence_power": (0.0, 0.5)},
        "dporl/HIVTreatment-v0": {"R1": (18750.0, 21250.0), "R2": (1850.0, 2150.0), "efficacy_noise": (0.0, 0.01)},
    }
    sizes = {"CartPole-v1": 1000, "Acrobot-v1": 1000, "LunarLander-v3": 1000, "dporl/HIVTreatment-v0": 2000}
    for env_id, ranges in expected.items():
        grid = physics_grid(env_id)
        assert len(grid) == sizes[env_id] == PHYSICS_GRIDS[env_id].size
        assert len({tuple(sorted(s.items())) for s in grid}) == len(grid)  # all distinct
        for name, (low, high) in ranges.items():
            values = sorted({s[name] for s in grid})
            assert values[0] == pytest.approx(low) and values[-1] == pytest.approx(high)
            assert np.allclose(np.diff(values), np.diff(values)[0])  # equally spaced
    assert all(s["LINK_LENGTH_1"] == s["LINK_LENGTH_2"] for s in physics_grid("Acrobot-v1"))
    assert all(s["enable_wind"] for s in physics_grid("LunarLander-v3"))
    quick = physics_grid("dporl/HIVTreatment-v0", points_per_axis=3)
    assert len(quick) == 3 * 3 * 2  # the noise axis has only two values
    for setting in physics_grid("CartPole-v1", points_per_axis=2):  # every setting builds
        make_variant("CartPole-v1", setting)


def test_bad_parameters_are_validation_errors():
    with pytest.raises(ValidationError, match="params.gravity_"):
        make_variant("CartPole-v1", {"gravity_": 9.0})
    with pytest.raises(ValidationError, match="env_id"):
        make_variant("Pendulum-v1", {})
    with pytest.raises(ValidationError, match="params.masscart"):
        make_variant("CartPole-v1", {"masscart": -1.0})
    with pytest.raises(ValidationError, match="params.gravity"):
        make_variant("LunarLander-v3", {"gravity": -13.0})
    with pytest.raises(ValidationError, match="params.wind_power"):
        make_variant("LunarLander-v3", {"wind_power": 2.0})  # wind disabled: would be silently ignored
    with pytest.raises(ValidationError, match="params.gravity"):
        make_variant("CartPole-v1", {"gravity": float("nan")})
    with pytest.raises(ValidationError, match="params.gravity"):
        make_variant("CartPole-v1", {"gravity": [9.0, 10.0]})  # per-env values only for vector variants
    with pytest.raises(ValidationError, match="params.gravity"):
        make_vector_variant("CartPole-v1", {"gravity": [9.0, 10.0]}, num_envs=3)
    with pytest.raises(ValidationError, match="points_per_axis"):
        physics_grid("CartPole-v1", points_per_axis=0)
