"""ProcessVectorEnv: sub-envs stepped in worker processes behave exactly as the one-process vector env."""

import numpy as np
import pytest

from dporl.experts.collect import make_vector_env
from dporl.experts.process_env import ProcessVectorEnv
from dporl.utils.validation import ValidationError

pytest.importorskip("Box2D")


def test_workers_give_the_same_transitions_as_one_process():
    params = [{"gravity": g, "enable_wind": True, "wind_power": w, "turbulence_power": 0.3}
              for g, w in zip((-9.0, -10.0, -11.0, -9.5, -10.5), (0.0, 1.0, 2.0, 3.0, 4.0))]
    actions = np.random.default_rng(0).integers(0, 4, size=(80, 5))
    outputs = []
    for workers in (1, 3):
        env = make_vector_env("LunarLander-v3", 5, 30, params, workers=workers)
        try:
            assert isinstance(env, ProcessVectorEnv) == (workers > 1)
            steps = [env.reset(seed=[3, 1, 4, 1, 5])[0]]
            for action in actions:  # 30-step limit: every sub-env autoresets at least twice
                obs, reward, terminated, truncated, _ = env.step(action)
                steps.append(np.concatenate([obs, reward[:, None], terminated[:, None], truncated[:, None]], axis=1))
            outputs.append(np.stack(steps[1:]))
        finally:
            env.close()
    # Same code, same seeds, the same float maths in another process: identical, not merely close.
    np.testing.assert_array_equal(outputs[0], outputs[1])
    assert outputs[1][..., -1].sum() >= 5


def test_bad_inputs_and_worker_failures_are_reported():
    with pytest.raises(ValidationError, match="env_workers"):
        ProcessVectorEnv("LunarLander-v3", 2, 10, workers=0)
    with pytest.raises(ValidationError, match="params.gravity"):  # raised in a worker, re-raised here
        ProcessVectorEnv("LunarLander-v3", 2, 10, [{"gravity": 3.0}] * 2, workers=2)  # gravity must be negative
