"""Minari interop: export -> import round trips, foreign datasets, expert-id sources and errors."""

from __future__ import annotations

import os

import gymnasium as gym
import numpy as np
import pytest

minari = pytest.importorskip("minari")
from minari.data_collector.episode_buffer import EpisodeBuffer  # noqa: E402

from dporl.data import DatasetMetadata, TrajectoryDataset  # noqa: E402
from dporl.data import minari_io  # noqa: E402
from dporl.data.minari_io import export_minari, import_minari  # noqa: E402
from dporl.utils.validation import ValidationError  # noqa: E402

from test_dataset import assert_same_dataset, make_dataset  # noqa: E402

# Minari nags about optional provenance fields (eval_env, env_spec...): irrelevant to what these tests check.
pytestmark = pytest.mark.filterwarnings("ignore::UserWarning")


@pytest.fixture(autouse=True)
def minari_root(tmp_path, monkeypatch):
    root = tmp_path / "minari"
    monkeypatch.setenv("MINARI_DATASETS_PATH", str(root))
    return root


def _with_rich_metadata(dataset):
    meta = DatasetMetadata(
        "CartPole-v1", dataset.metadata.n_actions, dataset.metadata.n_units, dataset.metadata.obs_shape,
        env_params={"gravity": 9.5}, p_min=0.05, seed=3, expert_set={"family": "analytic", "sha256": "00ff"},
    )
    names = ["observations", "actions", "rewards", "terminations", "truncations", "episode_lengths", "unit_ids",
             "start_steps", "behavior_log_probs"]
    return TrajectoryDataset(metadata=meta, **{n: getattr(dataset, n) for n in names})


@pytest.mark.parametrize("log_probs", [True, False])
def test_export_import_round_trip(minari_root, monkeypatch, log_probs):
    monkeypatch.setattr(minari_io, "_WRITE_CHUNK", 4)  # 7 episodes: the first chunk, then appended chunks
    dataset, _ = make_dataset(seed=30, n_episodes=6, log_probs=log_probs)
    dataset = _with_rich_metadata(dataset)
    longest = int(np.argmax(dataset.episode_lengths))
    assert dataset.episode_lengths[longest] >= 2
    dataset = TrajectoryDataset.concatenate([dataset, dataset.fragments([longest], [1], [2])])  # start_step survives
    exported = export_minari(dataset, "dporl/roundtrip-v0")
    assert exported.total_episodes == dataset.n_episodes and exported.total_steps == dataset.n_transitions
    assert exported.action_space == gym.spaces.Discrete(3)
    assert_same_dataset(import_minari("dporl/roundtrip-v0"), dataset)
    # the same dataset found by path, either the dataset directory or its data directory
    assert_same_dataset(import_minari(minari_root / "dporl" / "roundtrip-v0"), dataset)
    assert_same_dataset(import_minari(minari_root / "dporl" / "roundtrip-v0" / "data"), dataset)
    # nothing but the dataset and its namespace is left in the root (no staging directory)
    assert sorted(os.listdir(minari_root)) == ["dporl"]
    assert "dporl/roundtrip-v0" in minari.list_local_datasets()  # Minari itself sees a complete dataset


def test_empty_and_unfragmented_datasets_round_trip():
    empty = TrajectoryDataset.from_episodes([], DatasetMetadata("E-v0", 2, 3, (4,)))
    export_minari(empty, "empty-v0", progress=False)
    assert_same_dataset(import_minari("empty-v0", progress=False), empty)
    whole, _ = make_dataset(seed=38, n_episodes=3)  # all start steps 0: no start_step info is written
    exported = export_minari(whole, "whole-v0")
    assert "start_step" not in next(exported.iterate_episodes()).infos
    assert_same_dataset(import_minari("whole-v0"), whole)


def test_export_to_explicit_root_and_no_overwrite(tmp_path):
    dataset, _ = make_dataset(seed=31, n_episodes=3, n_actions=2, obs_shape=(4,))
    exported = export_minari(dataset, "plain-v1", root=tmp_path / "elsewhere", env="CartPole-v1")
    assert exported.env_spec.id == "CartPole-v1"  # Minari users can recover the logging environment
    assert_same_dataset(import_minari("plain-v1", root=tmp_path / "elsewhere"), dataset)
    with pytest.raises(ValidationError) as info:
        export_minari(dataset, "plain-v1", root=tmp_path / "elsewhere")
    assert info.value.field == "dataset_id"
    with pytest.raises(ValidationError) as info:
        export_minari(dataset, "no version")
    assert info.value.field == "dataset_id"


def test_failed_export_leaves_nothing(minari_root, monkeypatch):
    dataset, _ = make_dataset(seed=32, n_episodes=3)
    real_create = minari.create_dataset_from_buffers

    def create_then_fail(*args, **kwargs):
        real_create(*args, **kwargs)  # the dataset is fully written in staging...
        raise OSError("disk full")  # ...and the export still fails before the rename

    monkeypatch.setattr(minari_io.minari, "create_dataset_from_buffers", create_then_fail)
    with pytest.raises(OSError):
        export_minari(dataset, "broken-v0")
    assert os.listdir(minari_root) == []
    with pytest.raises(ValidationError) as info:
        import_minari("broken-v0")
    assert info.value.field == "source"


def _foreign_dataset(dataset_id, episodes, action_space=None, observation_space=None):
    """A Minari dataset written without dporl (per-step infos as another tool would log them)."""
    buffers = [EpisodeBuffer(**episode) for episode in episodes]
    return minari.create_dataset_from_buffers(
        dataset_id, buffers, observation_space=observation_space or gym.spaces.Box(-1.0, 1.0, (2,), np.float64),
        action_space=action_space or gym.spaces.Discrete(4), algorithm_name="other-tool",
    )


def _foreign_episodes(rng, n=4, info_key="agent", constant=True):
    episodes = []
    for i in range(n):
        length = 3 + i
        agent = np.full(length + 1, i % 2, dtype=np.int64)
        if not constant:
            agent[-1] = 1 - agent[-1]
        episodes.append(dict(
            observations=rng.uniform(-1, 1, (length + 1, 2)),
            actions=rng.integers(0, 4, length),
            rewards=rng.normal(size=length),
            terminations=np.arange(length) == length - 1,
            truncations=np.zeros(length, dtype=bool),
            infos={info_key: agent},
        ))
    return episodes


def test_import_foreign_dataset_with_info_key_or_mapping():
    rng = np.random.default_rng(33)
    episodes = _foreign_episodes(rng)
    _foreign_dataset("foreign-v0", episodes)
    imported = import_minari("foreign-v0", expert_id_key="agent")
    assert imported.metadata.n_actions == 4 and imported.metadata.obs_shape == (2,)
    assert imported.metadata.n_units == 2 and imported.metadata.env_id == "foreign-v0"
    assert imported.metadata.extra["minari_dataset_id"] == "foreign-v0"
    assert imported.unit_ids.tolist() == [0, 1, 0, 1] and imported.behavior_log_probs is None
    for i, episode in enumerate(episodes):
        got = imported.episode(i)
        np.testing.assert_array_equal(got["observations"], episode["observations"].astype(np.float32))
        np.testing.assert_array_equal(got["actions"], episode["actions"])
        np.testing.assert_allclose(got["rewards"], episode["rewards"], rtol=1e-6)
        assert got["terminated"] and not got["truncated"]
    by_map = import_minari("foreign-v0", expert_id_key={0: 5, 1: 5, 2: 0, 3: 1}, n_units=8)
    assert by_map.unit_ids.tolist() == [5, 5, 0, 1] and by_map.metadata.n_units == 8
    meta = DatasetMetadata("Custom-v0", 4, 3, (2,), p_min=0.1)
    assert import_minari("foreign-v0", expert_id_key="agent", metadata=meta).metadata == meta


@pytest.mark.parametrize(
    "kwargs, field",
    [
        ({"expert_id_key": "missing_key"}, "infos.missing_key"),
        ({"expert_id_key": {0: 0, 1: 0}}, "expert_id_key"),  # episodes 2 and 3 unmapped
        ({"expert_id_key": ["not", "a", "mapping"]}, "expert_id_key"),
        ({"expert_id_key": "agent", "n_units": 1}, "unit_ids"),  # id 1 out of range
        ({"expert_id_key": {0: 0, 1: 0, 2: 0, 3: -1}}, "unit_ids"),
    ],
)
def test_import_rejects_bad_expert_ids(kwargs, field):
    _foreign_dataset("ids-v0", _foreign_episodes(np.random.default_rng(34)))
    with pytest.raises(ValidationError) as info:
        import_minari("ids-v0", **kwargs)
    assert info.value.field == field


def test_import_rejects_non_constant_expert_id_and_bad_spaces():
    rng = np.random.default_rng(35)
    _foreign_dataset("varying-v0", _foreign_episodes(rng, constant=False))
    with pytest.raises(ValidationError) as info:
        import_minari("varying-v0", expert_id_key="agent")
    assert info.value.field == "infos.agent"
    episodes = _foreign_episodes(rng)
    for episode in episodes:
        episode["actions"] = rng.uniform(-1, 1, (len(episode["rewards"]), 1))
    _foreign_dataset("continuous-v0", episodes, action_space=gym.spaces.Box(-1.0, 1.0, (1,)))
    with pytest.raises(ValidationError) as info:
        import_minari("continuous-v0", expert_id_key="agent")
    assert info.value.field == "action_space"


def test_import_validates_the_data_itself():
    rng = np.random.default_rng(36)
    episodes = _foreign_episodes(rng)
    episodes[1]["observations"][2, 0] = np.nan
    _foreign_dataset("nan-v0", episodes, observation_space=gym.spaces.Box(-np.inf, np.inf, (2,), np.float64))
    with pytest.raises(ValidationError) as info:
        import_minari("nan-v0", expert_id_key="agent")
    assert info.value.field == "observations"


def test_import_rejects_corrupt_stored_metadata():
    dataset, _ = make_dataset(seed=37, n_episodes=2)
    exported = export_minari(dataset, "meta-v0")
    exported.storage.update_metadata({minari_io.DPORL_METADATA_KEY: '{"env_id": "x", "colour": 1}'})
    with pytest.raises(ValidationError) as info:
        import_minari("meta-v0")
    assert info.value.field == "metadata.colour"
    exported.storage.update_metadata({minari_io.DPORL_METADATA_KEY: "{truncated"})
    with pytest.raises(ValidationError) as info:
        import_minari("meta-v0")
    assert info.value.field == minari_io.DPORL_METADATA_KEY


@pytest.mark.parametrize("source", ["absent-v0", "not a valid id"])
def test_import_missing_dataset_names_the_source(source):
    with pytest.raises(ValidationError) as info:
        import_minari(source)
    assert info.value.field == "source"
