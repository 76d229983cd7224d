"""TrajectoryDataset: views against per-episode loops, fragments, validation of every field, save/load."""

from __future__ import annotations

import io
import json
import os
import zipfile

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dporl.data import FORMAT_VERSION, DatasetMetadata, TrajectoryDataset
from dporl.data.dataset import write_npz_members
from dporl.utils.validation import ValidationError


def make_episodes(rng, n_episodes=7, obs_shape=(3,), n_actions=3, n_units=4, log_probs=True, max_len=6):
    episodes = []
    for _ in range(n_episodes):
        length = int(rng.integers(1, max_len + 1))
        terminated = bool(rng.integers(0, 2))
        episode = {
            "observations": rng.normal(size=(length + 1, *obs_shape)).astype(np.float32),
            "actions": rng.integers(0, n_actions, length),
            "rewards": rng.normal(size=length).astype(np.float32),
            "terminated": terminated,
            "truncated": not terminated or bool(rng.integers(0, 2)),
            "unit_id": int(rng.integers(0, n_units)),
        }
        if log_probs:
            episode["behavior_log_probs"] = -rng.exponential(size=length).astype(np.float32)
        episodes.append(episode)
    return episodes


def make_metadata(obs_shape=(3,), n_actions=3, n_units=4, **kw):
    return DatasetMetadata(env_id="Test-v0", n_actions=n_actions, n_units=n_units, obs_shape=obs_shape, **kw)


def make_dataset(seed=0, log_probs=True, **kw):
    rng = np.random.default_rng(seed)
    shape_kw = {k: kw.pop(k) for k in ("obs_shape", "n_actions", "n_units") if k in kw}
    episodes = make_episodes(rng, log_probs=log_probs, **shape_kw, **kw)
    return TrajectoryDataset.from_episodes(episodes, make_metadata(**shape_kw)), episodes


def arrays_of(dataset):
    names = ["observations", "actions", "rewards", "terminations", "truncations", "episode_lengths", "unit_ids",
             "start_steps", "behavior_log_probs"]
    return {n: getattr(dataset, n) for n in names}


def assert_same_dataset(a, b):
    assert a.metadata == b.metadata
    for name, value in arrays_of(a).items():
        other = getattr(b, name)
        if value is None:
            assert other is None, name
        else:
            assert other.dtype == value.dtype and np.array_equal(other, value), name


# ---------------------------------------------------------------- construction and per-episode access
def test_from_episodes_round_trips_every_episode():
    dataset, episodes = make_dataset(seed=1)
    assert dataset.n_episodes == len(episodes)
    assert dataset.n_transitions == sum(len(e["actions"]) for e in episodes)
    for i, original in enumerate(episodes):
        episode = dataset.episode(i)
        for key in ("observations", "actions", "rewards", "behavior_log_probs"):
            np.testing.assert_array_equal(episode[key], original[key])
        assert episode["terminated"] == original["terminated"] and episode["truncated"] == original["truncated"]
        assert episode["unit_id"] == original["unit_id"] and episode["start_step"] == 0
        obs, actions = dataset.episode_observations_actions(i)
        np.testing.assert_array_equal(obs, original["observations"])
        np.testing.assert_array_equal(actions, original["actions"])


def test_stored_arrays_are_read_only_and_views_are_copies():
    dataset, _ = make_dataset(seed=22)
    with pytest.raises(ValueError):
        dataset.unit_ids[0] = 3  # would bypass the range check
    transitions = dataset.transitions()
    transitions.actions[0] = 1 - transitions.actions[0]  # views handed out are the caller's to modify...
    transitions.obs[0] += 1.0
    assert dataset.transitions().actions[0] != transitions.actions[0]  # ...without touching the dataset
    assert dataset.transitions().obs[0, 0] != transitions.obs[0, 0]


def test_from_episodes_requires_log_probs_on_all_or_none():
    rng = np.random.default_rng(2)
    episodes = make_episodes(rng, n_episodes=3)
    del episodes[1]["behavior_log_probs"]
    with pytest.raises(ValidationError) as info:
        TrajectoryDataset.from_episodes(episodes, make_metadata())
    assert info.value.field == "episodes[1].behavior_log_probs"


def test_from_episodes_observation_count_checked():
    rng = np.random.default_rng(3)
    episodes = make_episodes(rng, n_episodes=2)
    episodes[1]["observations"] = episodes[1]["observations"][:-1]
    with pytest.raises(ValidationError) as info:
        TrajectoryDataset.from_episodes(episodes, make_metadata())
    assert info.value.field == "episodes[1].observations"


def test_from_episodes_rejects_empty_episode_and_missing_keys():
    rng = np.random.default_rng(21)
    episodes = make_episodes(rng, n_episodes=2)
    episodes[0] = {**episodes[0], "actions": episodes[0]["actions"][:0], "observations": episodes[0]["observations"][:1]}
    with pytest.raises(ValidationError) as info:
        TrajectoryDataset.from_episodes(episodes, make_metadata())
    assert info.value.field == "episodes[0].actions"
    episodes = make_episodes(rng, n_episodes=2)
    del episodes[1]["unit_id"]
    with pytest.raises(ValidationError) as info:
        TrajectoryDataset.from_episodes(episodes, make_metadata())
    assert info.value.field == "episodes[1].unit_id"


def test_empty_dataset_is_valid_and_views_are_empty(tmp_path):
    dataset = TrajectoryDataset.from_episodes([], make_metadata())
    assert dataset.n_episodes == 0 and dataset.n_transitions == 0
    assert dataset.observations.shape == (0, 3)
    assert len(dataset.transitions()) == 0
    assert dataset.padded().observations.shape == (0, 1, 3)
    order, offsets = dataset.unit_episode_index()
    assert len(order) == 0 and offsets.tolist() == [0] * 5
    assert dataset.summary()["episode_return"]["mean"] is None
    assert_same_dataset(TrajectoryDataset.load(dataset.save(tmp_path / "e.npz")), dataset)


# ---------------------------------------------------------------- views against brute-force loops
@pytest.mark.parametrize("log_probs", [True, False])
@pytest.mark.parametrize("obs_shape", [(3,), (2, 2)])
def test_transitions_match_per_episode_loop(log_probs, obs_shape):
    dataset, episodes = make_dataset(seed=4, log_probs=log_probs, obs_shape=obs_shape)
    rows = {k: [] for k in ("obs", "actions", "rewards", "next_obs", "terminated", "truncated", "unit_ids",
                            "episode_ids", "timesteps", "behavior_log_probs")}
    for e, ep in enumerate(episodes):
        length = len(ep["actions"])
        for t in range(length):
            rows["obs"].append(ep["observations"][t])
            rows["next_obs"].append(ep["observations"][t + 1])
            rows["actions"].append(ep["actions"][t])
            rows["rewards"].append(ep["rewards"][t])
            rows["terminated"].append(ep["terminated"] and t == length - 1)
            rows["truncated"].append(ep["truncated"] and t == length - 1)
            rows["unit_ids"].append(ep["unit_id"])
            rows["episode_ids"].append(e)
            rows["timesteps"].append(t)
            if log_probs:
                rows["behavior_log_probs"].append(ep["behavior_log_probs"][t])
    transitions = dataset.transitions()
    for key, expected in rows.items():
        actual = getattr(transitions, key)
        if key == "behavior_log_probs" and not log_probs:
            assert actual is None
            continue
        np.testing.assert_array_equal(actual, np.array(expected), err_msg=key)
    tensors = transitions.to_torch()
    assert tensors["obs"].dtype == torch.float32 and tensors["actions"].dtype == torch.int64
    assert tensors["terminated"].dtype == torch.bool
    assert ("behavior_log_probs" in tensors) == log_probs


def test_expert_episode_index_groups_episodes_in_order():
    dataset, episodes = make_dataset(seed=5, n_episodes=20, n_units=6)
    order, offsets = dataset.unit_episode_index()
    assert offsets.shape == (7,) and offsets[0] == 0 and offsets[-1] == 20
    for expert in range(6):
        expected = [i for i, ep in enumerate(episodes) if ep["unit_id"] == expert]
        assert order[offsets[expert] : offsets[expert + 1]].tolist() == expected


@pytest.mark.parametrize("log_probs", [True, False])
def test_padded_matches_per_episode_loop(log_probs):
    dataset, episodes = make_dataset(seed=6, n_episodes=9, log_probs=log_probs)
    selection = np.array([4, 0, 4, 8])
    padded = dataset.padded(selection)
    width = max(len(episodes[i]["actions"]) for i in selection)
    assert padded.actions.shape == (4, width) and padded.observations.shape == (4, width + 1, 3)
    for row, i in enumerate(selection):
        ep, length = episodes[i], len(episodes[i]["actions"])
        assert padded.lengths[row] == length and padded.unit_ids[row] == ep["unit_id"]
        assert bool(padded.terminated[row]) == ep["terminated"] and bool(padded.truncated[row]) == ep["truncated"]
        np.testing.assert_array_equal(padded.observations[row, : length + 1].numpy(), ep["observations"])
        np.testing.assert_array_equal(padded.actions[row, :length].numpy(), ep["actions"])
        np.testing.assert_array_equal(padded.rewards[row, :length].numpy(), ep["rewards"])
        assert padded.mask[row].tolist() == [True] * length + [False] * (width - length)
        # padding is zero so masked sums need no extra care
        assert padded.observations[row, length + 1 :].abs().sum() == 0 and padded.rewards[row, length:].abs().sum() == 0
        if log_probs:
            np.testing.assert_array_equal(padded.behavior_log_probs[row, :length].numpy(), ep["behavior_log_probs"])
            assert padded.behavior_log_probs[row, length:].abs().sum() == 0
    assert (padded.behavior_log_probs is None) == (not log_probs)
    as_dict = padded.to_dict()
    assert ("behavior_log_probs" in as_dict) == log_probs and as_dict["mask"] is padded.mask
    assert dataset.padded().actions.shape[0] == dataset.n_episodes


def test_episode_returns_and_summary_match_loops():
    dataset, episodes = make_dataset(seed=7, n_episodes=12, n_units=5, n_actions=4)
    returns = np.array([np.sum(ep["rewards"], dtype=np.float64) for ep in episodes])
    np.testing.assert_allclose(dataset.episode_returns(), returns, rtol=1e-6)
    summary = dataset.summary()
    json.dumps(summary)  # JSON-safe
    counts = np.bincount([ep["unit_id"] for ep in episodes], minlength=5)
    assert summary["episodes_per_unit"] == {"min": counts.min(), "mean": counts.mean(), "max": counts.max()}
    assert summary["units_with_episodes"] == int(np.count_nonzero(counts))
    assert summary["episode_return"]["mean"] == pytest.approx(returns.mean(), rel=1e-6)
    all_actions = np.concatenate([ep["actions"] for ep in episodes])
    assert summary["action_counts"] == np.bincount(all_actions, minlength=4).tolist()
    assert summary["terminated_episodes"] == sum(ep["terminated"] for ep in episodes)
    assert summary["episode_length"]["max"] == max(len(ep["actions"]) for ep in episodes)


# ---------------------------------------------------------------- fragments, subset, concatenate
def test_fragments_semantics():
    dataset, episodes = make_dataset(seed=8, n_episodes=5, max_len=8)
    lengths = dataset.episode_lengths
    ids = np.array([e for e in range(5) if lengths[e] >= 2])
    cut = lengths[ids] // 2
    prefixes = dataset.fragments(ids, np.zeros_like(cut), cut)
    tails = dataset.fragments(ids, cut, lengths[ids])
    for j, e in enumerate(ids):
        ep, prefix, tail = episodes[e], prefixes.episode(j), tails.episode(j)
        # a prefix cut before the end is truncated by the cut, never terminated
        assert prefix["truncated"] and not prefix["terminated"]
        assert (tail["terminated"], tail["truncated"]) == (ep["terminated"], ep["truncated"])
        assert prefix["start_step"] == 0 and tail["start_step"] == cut[j]
        np.testing.assert_array_equal(np.concatenate([prefix["actions"], tail["actions"]]), ep["actions"])
        np.testing.assert_array_equal(np.concatenate([prefix["rewards"], tail["rewards"]]), ep["rewards"])
        # the prefix's last observation is the tail's first: s_{cut} belongs to both
        np.testing.assert_array_equal(prefix["observations"], ep["observations"][: cut[j] + 1])
        np.testing.assert_array_equal(tail["observations"], ep["observations"][cut[j] :])
        np.testing.assert_array_equal(tail["behavior_log_probs"], ep["behavior_log_probs"][cut[j] :])
        assert prefix["unit_id"] == tail["unit_id"] == ep["unit_id"]
    # time indices survive fragmenting, also of a fragment of a fragment
    original = dataset.transitions()
    tail_t = tails.transitions()
    for j, e in enumerate(ids):
        np.testing.assert_array_equal(tail_t.timesteps[tail_t.episode_ids == j], np.arange(cut[j], lengths[e]))
    inner = tails.fragments([0], [1], [2]) if tails.episode_lengths[0] >= 2 else None
    if inner is not None:
        assert inner.start_steps[0] == cut[0] + 1
        assert inner.transitions().timesteps.tolist() == [cut[0] + 1]
        assert original.actions[original.episode_ids == ids[0]][cut[0] + 1] == inner.actions[0]


@pytest.mark.parametrize(
    "ids, starts, ends, field",
    [
        ([0], [0], [0], "ends"),  # empty fragment
        ([0], [2], [1], "ends"),
        ([0], [-1], [1], "starts"),
        ([0], [0], [99], "ends"),  # past the episode's end
        ([9], [0], [1], "episode_ids"),
        ([0, 1], [0], [1, 1], "starts"),
        ([0], [0.5], [1], "starts"),
    ],
)
def test_fragments_rejects_bad_ranges(ids, starts, ends, field):
    dataset, _ = make_dataset(seed=9, n_episodes=3)
    with pytest.raises(ValidationError) as info:
        dataset.fragments(np.array(ids), np.array(starts), np.array(ends))
    assert info.value.field == field


def test_subset_and_concatenate_agree_with_episode_lists():
    dataset, episodes = make_dataset(seed=10, n_episodes=8)
    first, second = [3, 1, 3], [7, 0]
    joined = TrajectoryDataset.concatenate([dataset.subset(first), dataset.subset(second)])
    assert_same_dataset(joined, dataset.subset(first + second))
    for j, e in enumerate(first + second):
        np.testing.assert_array_equal(joined.episode(j)["observations"], episodes[e]["observations"])
    assert_same_dataset(dataset.subset(np.arange(8)), dataset)
    assert dataset.subset(np.array([], dtype=np.int64)).n_episodes == 0


def test_concatenate_refuses_mixed_metadata_and_log_probs():
    a, _ = make_dataset(seed=11)
    b, _ = make_dataset(seed=12, log_probs=False)
    with pytest.raises(ValidationError) as info:
        TrajectoryDataset.concatenate([a, b])
    assert info.value.field == "datasets[1].behavior_log_probs"
    other_meta = a.with_identities_removed(make_metadata(n_units=5))
    other_meta = TrajectoryDataset.concatenate([other_meta])  # a one-element list is itself
    with pytest.raises(ValidationError) as info:
        TrajectoryDataset.concatenate([b, other_meta])
    assert info.value.field == "datasets[1].metadata"
    with pytest.raises(ValidationError):
        TrajectoryDataset.concatenate([])


def test_with_identities_removed_drops_ids_and_log_probs():
    dataset, _ = make_dataset(seed=13)
    public = dataset.with_identities_removed(make_metadata(n_units=1, extra={"released_by": "test"}))
    assert public.unit_ids.tolist() == [0] * dataset.n_episodes and public.behavior_log_probs is None
    np.testing.assert_array_equal(public.observations, dataset.observations)
    assert public.metadata.extra == {"released_by": "test"}


# ---------------------------------------------------------------- validation of constructor inputs
def _valid_kwargs():
    dataset, _ = make_dataset(seed=14, n_episodes=4, max_len=5)
    kwargs = {k: (None if v is None else v.copy()) for k, v in arrays_of(dataset).items()}
    kwargs["metadata"] = dataset.metadata
    return kwargs


def _set(name, index, value):
    def mutate(kw):
        kw[name][index] = value
    return mutate


def _replace(name, make):
    def mutate(kw):
        kw[name] = make(kw)
    return mutate


def _flag_inside(kw):
    lengths = kw["episode_lengths"]
    episode = int(np.flatnonzero(lengths >= 2)[0])  # seed 14 has such an episode; its first step is not its last
    kw["terminations"][np.cumsum(lengths)[episode] - lengths[episode]] = True


def _unflag_last(kw):
    last = np.cumsum(kw["episode_lengths"]) - 1
    kw["terminations"][last[1]] = kw["truncations"][last[1]] = False


MALFORMED = [
    ("observations", _replace("observations", lambda kw: kw["observations"][:-1])),
    ("observations", _replace("observations", lambda kw: kw["observations"][:, :2])),
    ("observations", _set("observations", (2, 1), np.nan)),
    ("observations", _set("observations", (0, 0), np.inf)),
    ("observations", _replace("observations", lambda kw: kw["observations"].astype(bool))),
    ("observations", _replace("observations", lambda kw: kw["observations"].astype(np.float64) * 1e300)),
    ("actions", _set("actions", 1, 3)),
    ("actions", _set("actions", 0, -1)),
    ("actions", _replace("actions", lambda kw: kw["actions"].astype(np.float32))),
    ("actions", _replace("actions", lambda kw: kw["actions"][:-1])),
    ("rewards", _set("rewards", 0, np.nan)),
    ("rewards", _replace("rewards", lambda kw: kw["rewards"][None])),
    ("terminations", _replace("terminations", lambda kw: kw["terminations"].astype(np.int64))),
    ("terminations", _flag_inside),
    ("terminations", _unflag_last),
    ("truncations", _replace("truncations", lambda kw: np.roll(kw["truncations"] | kw["terminations"], 1))),
    ("episode_lengths", _set("episode_lengths", 0, 0)),
    ("actions", _set("episode_lengths", 0, 99)),  # lengths no longer sum to the transition count
    ("episode_lengths", _replace("episode_lengths", lambda kw: kw["episode_lengths"][:, None])),
    ("unit_ids", _set("unit_ids", 2, 4)),
    ("unit_ids", _set("unit_ids", 2, -3)),
    ("unit_ids", _replace("unit_ids", lambda kw: kw["unit_ids"][:-1])),
    ("start_steps", _set("start_steps", 1, -1)),
    ("behavior_log_probs", _set("behavior_log_probs", 3, 0.5)),
    ("behavior_log_probs", _set("behavior_log_probs", 3, np.nan)),
    ("behavior_log_probs", _replace("behavior_log_probs", lambda kw: kw["behavior_log_probs"][1:])),
    ("metadata", _replace("metadata", lambda kw: {"env_id": "x"})),
]


@pytest.mark.parametrize("field, mutate", MALFORMED, ids=[f"{i}-{f}" for i, (f, _) in enumerate(MALFORMED)])
def test_malformed_arrays_name_the_field(field, mutate):
    kwargs = _valid_kwargs()
    TrajectoryDataset(**kwargs)  # the unmutated input is valid
    mutate(kwargs)
    with pytest.raises(ValidationError) as info:
        TrajectoryDataset(**kwargs)
    assert info.value.field == field


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"env_id": ""}, "metadata.env_id"),
        ({"n_actions": 0}, "metadata.n_actions"),
        ({"n_actions": True}, "metadata.n_actions"),
        ({"n_units": 2.5}, "metadata.n_units"),
        ({"obs_shape": (3, 0)}, "metadata.obs_shape"),
        ({"obs_shape": "3"}, "metadata.obs_shape"),
        ({"p_min": 0.0}, "metadata.p_min"),
        ({"p_min": 0.34}, "metadata.p_min"),  # above 1/n_actions = 1/3
        ({"p_min": float("nan")}, "metadata.p_min"),
        ({"p_min": "0.1"}, "metadata.p_min"),
        ({"seed": 1.5}, "metadata.seed"),
        ({"env_params": [1, 2]}, "metadata.env_params"),
        ({"env_params": {"g": float("inf")}}, "metadata.env_params"),
        ({"extra": {"f": object()}}, "metadata.extra"),
        ({"expert_set": "path"}, "metadata.expert_set"),
    ],
)
def test_bad_metadata_names_the_field(overrides, field):
    base = {"env_id": "Test-v0", "n_actions": 3, "n_units": 4, "obs_shape": (3,)}
    with pytest.raises(ValidationError) as info:
        DatasetMetadata(**{**base, **overrides})
    assert info.value.field == field


def test_metadata_accepts_p_min_at_uniform_and_normalises_json():
    meta = DatasetMetadata("E-v0", 4, 2, [5], p_min=0.25, env_params={"g": (1, 2)}, seed=np.int64(3))
    assert meta.obs_shape == (5,) and meta.env_params == {"g": [1, 2]} and meta.seed == 3


# ---------------------------------------------------------------- persistence
@pytest.mark.parametrize("log_probs", [True, False])
def test_save_load_round_trip(tmp_path, log_probs):
    dataset, _ = make_dataset(seed=15, log_probs=log_probs)
    meta = DatasetMetadata(
        "Test-v0", 3, 4, (3,), env_params={"gravity": 9.8, "force_mag": 10.0}, p_min=0.05, seed=7,
        expert_set={"path": "experts.pt", "family": "analytic", "sha256": "ab" * 32}, extra={"note": "ü"},
    )
    dataset = TrajectoryDataset(**{**arrays_of(dataset), "metadata": meta})
    fragment = dataset.fragments([0], [0], [1])  # start_steps and flags from a fragment survive too
    for original in (dataset, TrajectoryDataset.concatenate([dataset, fragment])):
        path = original.save(tmp_path / "d.npz")
        assert sorted(os.listdir(tmp_path)) == ["d.npz"]  # no temporary left beside it
        assert_same_dataset(TrajectoryDataset.load(path), original)


def test_failed_save_keeps_the_old_file(tmp_path, monkeypatch):
    old, _ = make_dataset(seed=16)
    path = old.save(tmp_path / "d.npz")
    before = path.read_bytes()

    def exploding_write(handle, array, **kwargs):  # every member is written through np.lib.format.write_array
        handle.write(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(np.lib.format, "write_array", exploding_write)
    new, _ = make_dataset(seed=17)
    with pytest.raises(OSError):
        new.save(path)
    assert path.read_bytes() == before and os.listdir(tmp_path) == ["d.npz"]


def _archive_members(dataset):
    return {
        "format_version": np.array(FORMAT_VERSION, dtype=np.int64),
        "metadata": np.array(json.dumps(dataset.metadata.to_dict())),
        **{k: v for k, v in arrays_of(dataset).items() if v is not None},
    }


def _write_members(path, members):
    with open(path, "wb") as handle:
        np.savez(handle, **members)


def _edit(**changes):
    def mutate(members):
        for key, value in changes.items():
            if value is None:
                del members[key]
            else:
                members[key] = value(members) if callable(value) else value
    return mutate


def _meta_edit(**changes):
    def mutate(members):
        meta = json.loads(str(members["metadata"]))
        meta.update(changes)
        members["metadata"] = np.array(json.dumps(meta))
    return mutate


def _as_version_2(members):
    """The archive members as dataset format version 2 writes them: the unit fields are expert_ids / n_experts."""
    meta = json.loads(str(members["metadata"]))
    meta["n_experts"] = meta.pop("n_units")
    members["metadata"] = np.array(json.dumps(meta))
    members["expert_ids"] = members.pop("unit_ids")
    members["format_version"] = np.array(2, dtype=np.int64)


def _renamed(old, new):
    def mutate(members):
        members[new] = members.pop(old)
    return mutate


def _then(*edits):
    def mutate(members):
        for edit in edits:
            edit(members)
    return mutate


BAD_FILES = [
    # the unit fields' names belong to the file's version: a mix of the two spellings is not a dporl dataset
    ("expert_ids", _renamed("unit_ids", "expert_ids")),
    ("metadata.n_experts", _meta_edit(n_experts=4)),
    ("unit_ids", _then(_as_version_2, _renamed("expert_ids", "unit_ids"))),
    ("metadata.n_units", _then(_as_version_2, _meta_edit(n_units=4))),
    ("unit_ids", _then(_as_version_2, _edit(expert_ids=lambda m: m["expert_ids"] + 4))),
    ("format_version", _edit(format_version=np.array(FORMAT_VERSION + 1, dtype=np.int64))),
    ("format_version", _edit(format_version=np.array([1], dtype=np.int64))),
    ("format_version", _edit(format_version=None)),
    ("metadata", _edit(metadata=None)),
    ("metadata", _edit(metadata=np.array("{not json"))),
    ("metadata", _edit(metadata=np.array("[1, 2]"))),
    ("metadata", _edit(metadata=np.array([1.0]))),
    ("metadata.colour", _meta_edit(colour="red")),
    ("metadata.p_min", _meta_edit(p_min=2.0)),
    ("metadata.obs_shape", _meta_edit(obs_shape=None)),
    ("observations", _edit(observations=None)),
    ("observations", _edit(observations=lambda m: m["observations"].astype(np.float64))),
    ("observations", _edit(observations=lambda m: np.where(np.arange(len(m["observations"]))[:, None] == 1,
                                                           np.nan, m["observations"]).astype(np.float32))),
    ("actions", _edit(actions=lambda m: m["actions"].astype(np.int32))),
    ("actions", _edit(actions=lambda m: m["actions"] + 3)),
    ("unit_ids", _edit(unit_ids=lambda m: m["unit_ids"] + 4)),
    ("terminations", _edit(terminations=lambda m: np.zeros_like(m["terminations"]),
                           truncations=lambda m: np.zeros_like(m["truncations"]))),
    ("episode_lengths", _edit(episode_lengths=None)),
    ("start_steps", _edit(start_steps=lambda m: m["start_steps"].astype(np.float32))),
    ("behavior_log_probs", _edit(behavior_log_probs=lambda m: -m["behavior_log_probs"] + 0.1)),
    ("pickle", _edit(pickle=np.array([1]))),
]


@pytest.mark.parametrize("field, mutate", BAD_FILES, ids=[f"{i}-{f}" for i, (f, _) in enumerate(BAD_FILES)])
def test_malformed_files_name_the_field(tmp_path, field, mutate):
    dataset, _ = make_dataset(seed=18)
    members = _archive_members(dataset)
    _write_members(tmp_path / "ok.npz", members)
    assert_same_dataset(TrajectoryDataset.load(tmp_path / "ok.npz"), dataset)  # the helper writes valid files
    mutate(members)
    _write_members(tmp_path / "bad.npz", members)
    with pytest.raises(ValidationError) as info:
        TrajectoryDataset.load(tmp_path / "bad.npz")
    assert info.value.field == field


def test_a_version_2_layout_loads_to_the_same_dataset(tmp_path):
    """Format version 2 names the unit fields expert_ids (member) and n_experts (metadata): read back as unit_ids
    and n_units, to the same dataset with the same fingerprint; saving writes the current version."""
    dataset, _ = make_dataset(seed=21)
    members = _archive_members(dataset)
    _as_version_2(members)
    _write_members(tmp_path / "v2.npz", members)
    for mmap in (False, True):
        loaded = TrajectoryDataset.load(tmp_path / "v2.npz", mmap=mmap)
        assert_same_dataset(loaded, dataset)
        assert loaded.fingerprint() == dataset.fingerprint()
    with np.load(loaded.save(tmp_path / "again.npz")) as archive:
        assert int(archive["format_version"]) == FORMAT_VERSION == 3
        assert "unit_ids" in archive.files and "expert_ids" not in archive.files
        assert json.loads(str(archive["metadata"]))["n_units"] == dataset.n_units


FIXTURES = os.path.join(os.path.dirname(__file__), "data")


def test_a_file_written_by_a_format_2_dporl_loads_to_the_same_dataset_and_fingerprint(tmp_path):
    """tests/data/dataset_format_2.npz was written by dporl's format-2 writer from ``_fixture_content("expert_id",
    "n_experts")``; dataset_format_2.json holds the fingerprint that writer's dporl computed for it. Loaded here it is
    the dataset built from the same content, and keeps its fingerprint (run directories and searches record it)."""
    episodes, fields = _fixture_content("unit_id", "n_units")
    expected = TrajectoryDataset.from_episodes(episodes, DatasetMetadata(**fields))
    with open(os.path.join(FIXTURES, "dataset_format_2.json")) as handle:
        recorded = json.load(handle)
    path = os.path.join(FIXTURES, "dataset_format_2.npz")
    with zipfile.ZipFile(path) as archive:  # the file is the old layout, not a copy of the current one
        assert "expert_ids.npy" in archive.namelist() and "unit_ids.npy" not in archive.namelist()
    for mmap in (False, True):
        loaded = TrajectoryDataset.load(path, mmap=mmap)
        assert_same_dataset(loaded, expected)
        assert loaded.metadata.unit_keys == ("c7", "c2", "c9") and loaded.n_units == 3
        assert (loaded.n_episodes, loaded.n_transitions) == (recorded["n_episodes"], recorded["n_transitions"])
        assert loaded.fingerprint() == expected.fingerprint() == recorded["fingerprint"]
    assert_same_dataset(TrajectoryDataset.load(loaded.save(tmp_path / "v3.npz")), expected)


def _fixture_content(unit_key, count_key):
    """Episodes and metadata fields of tests/data/dataset_format_2.npz, with the per-episode unit under
    ``unit_key`` and the number of units under ``count_key``."""
    rng = np.random.default_rng(7)
    episodes = []
    for i in range(6):
        length = int(rng.integers(1, 5))
        terminated = bool(i % 2)
        episodes.append({
            "observations": rng.normal(size=(length + 1, 2)).astype(np.float32),
            "actions": rng.integers(0, 3, length),
            "rewards": rng.normal(size=length).astype(np.float32),
            "terminated": terminated, "truncated": not terminated,
            unit_key: int(rng.integers(0, 3)), "start_step": int(rng.integers(0, 4)),
            "behavior_log_probs": np.log(rng.uniform(0.2, 1.0, size=length)).astype(np.float32),
        })
    metadata = {"env_id": "Fixture-v0", "n_actions": 3, count_key: 3, "obs_shape": (2,), "p_min": 0.1, "seed": 5,
                "extra": {"source": "fixture"}, "unit_column": "clinician", "unit_keys": ("c7", "c2", "c9"),
                "action_labels": ("wait", "treat", "refer"), "observation_names": ("x", "y")}
    return episodes, metadata


def test_unreadable_files_name_the_path(tmp_path):
    dataset, _ = make_dataset(seed=19)
    good = dataset.save(tmp_path / "good.npz").read_bytes()
    cases = {
        "missing.npz": None,
        "truncated.npz": good[: len(good) // 2],
        "empty.npz": b"",
        "text.npz": b"hello, not an archive",
        "zip_no_members.npz": _empty_zip(),
        "single_array.npy": _npy_bytes(np.arange(3)),
    }
    for name, content in cases.items():
        if content is not None:
            (tmp_path / name).write_bytes(content)
        with pytest.raises(ValidationError) as info:
            TrajectoryDataset.load(tmp_path / name)
        # an archive with no members is readable but lacks every member: the first missing one is named
        assert info.value.field == ("actions" if name == "zip_no_members.npz" else "path"), name


def test_corrupt_member_names_the_member(tmp_path):
    dataset, _ = make_dataset(seed=20)
    raw = bytearray(dataset.save(tmp_path / "d.npz").read_bytes())
    with zipfile.ZipFile(tmp_path / "d.npz") as archive:
        info = archive.getinfo("rewards.npy")
    # data of a stored member starts after its 30-byte local header, name and extra field
    name_len, extra_len = np.frombuffer(bytes(raw[info.header_offset + 26 : info.header_offset + 30]), "<u2")
    data_start = info.header_offset + 30 + int(name_len) + int(extra_len)
    raw[data_start + info.file_size - 1] ^= 0xFF  # flip the last byte of the rewards payload: CRC mismatch
    (tmp_path / "d.npz").write_bytes(bytes(raw))
    with pytest.raises(ValidationError) as err:
        TrajectoryDataset.load(tmp_path / "d.npz")
    assert err.value.field == "rewards"


def _empty_zip():
    buffer = io.BytesIO()
    zipfile.ZipFile(buffer, "w").close()
    return buffer.getvalue()


def _npy_bytes(array):
    buffer = io.BytesIO()
    np.save(buffer, array)
    return buffer.getvalue()


# ---------------------------------------------------------------- property tests of the loader
@st.composite
def random_datasets(draw):
    seed = draw(st.integers(0, 2**32 - 1))
    rng = np.random.default_rng(seed)
    obs_shape = tuple(draw(st.lists(st.integers(1, 3), min_size=0, max_size=2)))
    n_actions, n_units = draw(st.integers(1, 5)), draw(st.integers(1, 6))
    episodes = make_episodes(
        rng, n_episodes=draw(st.integers(0, 6)), obs_shape=obs_shape, n_actions=n_actions, n_units=n_units,
        log_probs=draw(st.booleans()), max_len=draw(st.integers(1, 7)),
    )
    for episode in episodes:
        episode["start_step"] = int(rng.integers(0, 50))
    p_min = draw(st.none() | st.floats(1e-6, 1.0).map(lambda x: x / n_actions))
    meta = DatasetMetadata(
        env_id=draw(st.text(min_size=1, max_size=8).filter(lambda s: ":" not in s)),  # an id never names a module
        n_actions=n_actions, n_units=n_units, obs_shape=obs_shape,
        p_min=p_min, seed=draw(st.none() | st.integers(-(2**40), 2**40)),
        env_params=draw(st.dictionaries(st.text(max_size=5), st.floats(allow_nan=False, allow_infinity=False),
                                        max_size=3)),
    )
    return TrajectoryDataset.from_episodes(episodes, meta)


_PROPERTY_SETTINGS = settings(
    max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@_PROPERTY_SETTINGS
@given(dataset=random_datasets())
def test_property_valid_datasets_round_trip(tmp_path, dataset):
    assert_same_dataset(TrajectoryDataset.load(dataset.save(tmp_path / "p.npz")), dataset)


@_PROPERTY_SETTINGS
@given(
    dataset=random_datasets(),
    edits=st.lists(st.tuples(st.floats(0, 1, exclude_max=True), st.integers(1, 255)), min_size=1, max_size=4),
    cut=st.none() | st.floats(0, 1, exclude_max=True),
)
def test_property_corrupt_files_raise_validation_error_only(tmp_path, dataset, edits, cut):
    """XOR random bytes (and maybe truncate): load either fails with ValidationError or returns the same data
    (bytes such as zip timestamps are not covered by any checksum and may change harmlessly). A mapped load
    (members not CRC-checked) fails with ValidationError or returns a dataset that passed every value check."""
    raw = bytearray(dataset.save(tmp_path / "c.npz").read_bytes())
    for position, mask in edits:
        raw[int(position * len(raw))] ^= mask
    if cut is not None:
        raw = raw[: int(cut * len(raw))]
    (tmp_path / "c.npz").write_bytes(bytes(raw))
    for mmap in (True, False):
        try:
            loaded = TrajectoryDataset.load(tmp_path / "c.npz", mmap=mmap)
        except ValidationError:
            continue
        assert isinstance(loaded, TrajectoryDataset)
        if not mmap:
            assert_same_dataset(loaded, dataset)


_ARCHIVE_MEMBERS = ["format_version", "metadata", "observations", "actions", "rewards", "terminations",
                    "truncations", "episode_lengths", "unit_ids", "start_steps", "behavior_log_probs"]
_MEMBER_VALUES = st.one_of(
    st.integers(-3, 10).map(lambda v: np.array(v)),
    st.lists(st.integers(-(2**40), 2**40), max_size=6).map(lambda v: np.array(v, dtype=np.int64)),
    st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), max_size=6).map(
        lambda v: np.array(v, dtype=np.float32)
    ),
    st.lists(st.booleans(), max_size=6).map(np.array),
    st.text(max_size=20).map(np.array),
    st.sampled_from([np.zeros((2, 3), np.float32), np.zeros((0,), np.uint8), np.array([1 + 2j]),
                     np.array(["a", "b"]), np.array([None, 1], dtype=object), np.zeros((2,), "V4")]),
)


@_PROPERTY_SETTINGS
@given(dataset=random_datasets(), member=st.sampled_from(_ARCHIVE_MEMBERS), value=_MEMBER_VALUES)
def test_property_replaced_member_raises_validation_error_only(tmp_path, dataset, member, value):
    """Any member replaced by an arbitrary array (any dtype, shape, object or void): ValidationError or a
    dataset that passed every check, never another exception."""
    members = _archive_members(dataset)
    members[member] = value
    _write_members(tmp_path / "m.npz", members)
    with open(tmp_path / "aligned.npz", "wb") as handle:  # every member mappable (numpy's writer pickles objects)
        (np.savez if value.dtype.hasobject else lambda h, **m: write_npz_members(h, m))(handle, **members)
    for path, mmap in ((tmp_path / "m.npz", False), (tmp_path / "aligned.npz", True)):
        try:
            loaded = TrajectoryDataset.load(path, mmap=mmap)
        except ValidationError:
            continue
        assert isinstance(loaded, TrajectoryDataset)


@_PROPERTY_SETTINGS
@given(dataset=random_datasets(), data=st.data())
def test_property_views_match_episode_slices(dataset, data):
    """transitions(), padded() and fragments() of random datasets (any obs shape, incl. scalars) agree with
    slicing each episode() by hand."""
    episodes = [dataset.episode(i) for i in range(dataset.n_episodes)]
    transitions = dataset.transitions()
    padded = dataset.padded()
    position = 0
    for i, ep in enumerate(episodes):
        length = len(ep["actions"])
        rows = slice(position, position + length)
        np.testing.assert_array_equal(transitions.obs[rows], ep["observations"][:-1])
        np.testing.assert_array_equal(transitions.next_obs[rows], ep["observations"][1:])
        assert transitions.timesteps[rows].tolist() == list(range(ep["start_step"], ep["start_step"] + length))
        np.testing.assert_array_equal(padded.observations[i, : length + 1].numpy(), ep["observations"])
        np.testing.assert_array_equal(padded.actions[i, :length].numpy(), ep["actions"])
        assert int(padded.mask[i].sum()) == length
        position += length
    if not episodes:
        return
    ids = np.array(data.draw(st.lists(st.integers(0, dataset.n_episodes - 1), min_size=1, max_size=5)))
    lengths = dataset.episode_lengths[ids]
    starts = np.array([data.draw(st.integers(0, int(n) - 1)) for n in lengths])
    ends = np.array([data.draw(st.integers(int(s) + 1, int(n))) for s, n in zip(starts, lengths)])
    pieces = dataset.fragments(ids, starts, ends)
    for j, (e, s, t) in enumerate(zip(ids, starts, ends)):
        piece, whole = pieces.episode(j), episodes[e]
        np.testing.assert_array_equal(piece["observations"], whole["observations"][s : t + 1])
        np.testing.assert_array_equal(piece["rewards"], whole["rewards"][s:t])
        assert piece["start_step"] == whole["start_step"] + s
        reaches_end = t == len(whole["actions"])
        assert piece["terminated"] == (whole["terminated"] and reaches_end)
        assert piece["truncated"] == (whole["truncated"] if reaches_end else True)


def test_a_zip_needing_a_foreign_zip_version_is_refused_by_name(tmp_path):
    """A central directory asking for a zip version Python cannot extract (zipfile raises NotImplementedError) is a
    corrupt file like any other: ValidationError, mapped or read."""
    raw = bytearray(make_dataset()[0].save(tmp_path / "v.npz").read_bytes())
    start = raw.index(b"PK\x01\x02")  # the first central directory entry: signature, made-by, needed-to-extract
    raw[start + 6:start + 8] = (109).to_bytes(2, "little")
    (tmp_path / "v.npz").write_bytes(bytes(raw))
    for mmap in (True, False):
        with pytest.raises(ValidationError, match="not a readable zip archive"):
            TrajectoryDataset.load(tmp_path / "v.npz", mmap=mmap)
