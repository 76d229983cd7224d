"""read_table: tables in (DataFrame, CSV, Parquet), the unit owned by the data, no invented states, named refusals."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

from dporl.algos.cql import CQLConfig, DiscreteCQLModule
from dporl.data import DatasetMetadata, TrajectoryDataset
from dporl.data.table import import_summary, read_table, to_frame, with_unit
from dporl.privacy.samplers import Batch
from dporl.privacy.units import EXPERT, dataset_unit, grouped_by
from dporl.utils.validation import ValidationError

from test_dataset import assert_same_dataset, make_dataset

COLUMNS = dict(episode="episode", unit="unit", observations="obs_", action="action", actions=3, reward="reward",
               step="step")


def logged_frame(seed=0, n_units=4, episodes_per_unit=3, max_len=6, obs_dim=3, n_actions=3):
    """A table of episodes whose last row is terminated with probability 1/2 (else truncated, next state logged)."""
    rng = np.random.default_rng(seed)
    rows = []
    episode = 0
    for u in range(n_units):
        for _ in range(episodes_per_unit):
            length = int(rng.integers(1, max_len + 1))
            terminated = bool(rng.integers(0, 2))
            states = rng.normal(size=(length + 1, obs_dim))
            for t in range(length):
                row = {"episode": f"e{episode}", "unit": f"patient-{u}", "step": t + 3,
                       "action": int(rng.integers(0, n_actions)), "reward": float(rng.normal()),
                       "terminated": terminated and t == length - 1, "truncated": (not terminated) and t == length - 1,
                       "propensity": float(rng.uniform(0.05, 1.0))}
                row.update({f"obs_{j}": states[t, j] for j in range(obs_dim)})
                row.update({f"next_{j}": states[t + 1, j] for j in range(obs_dim)})
                rows.append(row)
            episode += 1
    return pd.DataFrame(rows)


def test_round_trip_through_a_table_keeps_every_transition(tmp_path):
    dataset, _ = make_dataset(seed=3, n_episodes=9)
    frame = to_frame(dataset, next_observations=True)
    back = read_table(frame, **{**COLUMNS, "actions": dataset.metadata.n_actions}, terminated="terminated",
                      truncated="truncated", next_observations="next_obs_", propensity="log_propensity",
                      propensity_kind="log_prob")
    # Units are re-keyed by the table's values; everything else is the same data (terminal next states: zeros).
    assert back.metadata.unit_column == "unit" and back.n_units == len(np.unique(dataset.unit_ids))
    ours, theirs = back.transitions(), dataset.transitions()
    for name in ("obs", "actions", "rewards", "terminated", "truncated", "timesteps", "behavior_log_probs"):
        np.testing.assert_allclose(getattr(ours, name), getattr(theirs, name), rtol=1e-6)
    live = ~theirs.terminated
    np.testing.assert_array_equal(ours.next_obs[live], theirs.next_obs[live])
    assert np.all(ours.next_obs[theirs.terminated] == 0)  # placeholder, never the source's value
    keys = np.asarray(back.metadata.unit_keys)[back.unit_ids]
    np.testing.assert_array_equal(keys, np.asarray([str(i) for i in dataset.unit_ids]))


@pytest.mark.parametrize("fmt", ["csv", "parquet", "frame"])
def test_formats_agree_and_unit_is_the_users_column(tmp_path, fmt):
    frame = logged_frame(seed=1)
    source = frame
    if fmt == "csv":
        source = tmp_path / "log.csv"
        frame.to_csv(source, index=False)
    elif fmt == "parquet":
        source = tmp_path / "log.parquet"
        frame.to_parquet(source)
    dataset = read_table(source, **COLUMNS, terminated="terminated", next_observations="next_", propensity="propensity")
    reference = read_table(frame, **COLUMNS, terminated="terminated", next_observations="next_", propensity="propensity")
    assert_same_dataset(dataset, reference)
    assert dataset_unit(dataset) == grouped_by("unit")
    assert dataset.metadata.unit_keys == tuple(f"patient-{u}" for u in range(4))
    assert dataset.n_episodes == 12 and dataset.n_transitions == len(frame)
    np.testing.assert_allclose(np.exp(dataset.behavior_log_probs), frame["propensity"], rtol=1e-6)
    np.testing.assert_array_equal(dataset.start_steps, 3)


def test_saved_unit_metadata_round_trips_and_version_1_files_still_load(tmp_path):
    dataset = read_table(logged_frame(seed=2), **COLUMNS, terminated="terminated", next_observations="next_")
    path = dataset.save(tmp_path / "d.npz")
    loaded = TrajectoryDataset.load(path)
    assert_same_dataset(loaded, dataset)
    assert loaded.metadata.unit_keys == dataset.metadata.unit_keys and dataset_unit(loaded) == grouped_by("unit")
    # A version-1 archive (no unit fields; the unit index is expert_ids, their number n_experts) loads, and its
    # unit is the logging expert.
    old, _ = make_dataset(seed=4)
    with np.load(old.save(tmp_path / "old.npz")) as archive:
        members = dict(archive)
    members["format_version"] = np.array(1, dtype=np.int64)
    members["expert_ids"] = members.pop("unit_ids")
    meta = json.loads(str(members["metadata"]))
    meta["n_experts"] = meta.pop("n_units")
    del meta["unit_column"], meta["unit_keys"]
    members["metadata"] = np.array(json.dumps(meta))
    np.savez(tmp_path / "v1.npz", **members)
    v1 = TrajectoryDataset.load(tmp_path / "v1.npz")
    assert_same_dataset(v1, old) and dataset_unit(v1) == EXPERT
    assert v1.metadata.unit_key_strings() == [str(i) for i in range(old.n_units)]


def test_truncated_last_step_without_next_state_is_dropped_and_counted():
    frame = logged_frame(seed=5)
    lengths = frame.groupby("episode", sort=False).size()
    truncated_eps = frame.loc[frame["truncated"], "episode"]
    if (lengths[truncated_eps] == 1).any():  # a one-row truncated episode has no usable step: tested below
        frame = frame[~frame["episode"].isin(lengths[lengths == 1].index)]
    dataset = read_table(frame, **COLUMNS, terminated="terminated")
    summary = import_summary(dataset)
    n_truncated = int(frame["truncated"].sum())
    assert summary["dropped_truncated_steps"] == n_truncated > 0
    assert dataset.n_transitions == len(frame) - n_truncated
    # The dropped row's state is the episode's final state: nothing was invented.
    t = dataset.transitions()
    assert np.all(t.next_obs[t.truncated] != 0)
    kept = frame[~frame["truncated"]]
    np.testing.assert_array_equal(t.obs, kept[["obs_0", "obs_1", "obs_2"]].to_numpy(np.float32))


def test_interleaved_episodes_keep_their_row_order_and_default_end_is_terminal():
    frame = pd.DataFrame({"ep": [7, 8, 7, 8, 7], "who": [1, 2, 1, 2, 1], "s": [0.0, 10, 1, 11, 2],
                          "a": [0, 1, 1, 0, 1], "r": [1.0, 2, 3, 4, 5]})
    dataset = read_table(frame, episode="ep", unit="who", observations="s", action="a", actions=2, reward="r")
    assert list(dataset.episode_lengths) == [3, 2]
    np.testing.assert_array_equal(dataset.observations[:, 0], [0, 1, 2, 0, 10, 11, 0])
    np.testing.assert_array_equal(dataset.rewards, [1, 3, 5, 2, 4])
    assert dataset.terminations.sum() == 2 and import_summary(dataset)["terminal_placeholders"] == 2


def test_action_labels_map_to_indices_in_declared_order_and_survive_save_and_to_frame(tmp_path):
    frame = pd.DataFrame({"ep": [1, 1, 2, 2], "who": ["a", "a", "b", "b"], "s": [0.0, 1, 2, 3],
                          "a": ["treat", "wait", "wait", "wait"], "r": [1.0, 0, 0, 1]})
    # Declared order, not the order of first appearance or of sorting: "wait" is 0 although "treat" comes first.
    dataset = read_table(frame, episode="ep", unit="who", observations="s", action="a", actions=["wait", "treat"],
                         reward="r")
    np.testing.assert_array_equal(dataset.actions, [1, 0, 0, 0])
    assert dataset.metadata.n_actions == 2 and dataset.metadata.action_labels == ("wait", "treat")
    # A declared label no row logged is part of the set all the same (the set is public, not observed).
    wider = read_table(frame, episode="ep", unit="who", observations="s", action="a",
                       actions=["wait", "treat", "refer"], reward="r")
    assert wider.metadata.n_actions == 3 and wider.summary()["action_counts"] == [3, 1, 0]
    back = TrajectoryDataset.load(dataset.save(tmp_path / "d.npz"))
    assert back.metadata.action_labels == ("wait", "treat") and back.fingerprint() == dataset.fingerprint()
    assert to_frame(back)["action"].tolist() == ["treat", "wait", "wait", "wait"]
    # Integer labels (e.g. codes 10 / 20) map the same way; 0..n-1 as labels is just the count.
    coded = frame.assign(a=[20, 10, 10, 10])
    codes = read_table(coded, episode="ep", unit="who", observations="s", action="a", actions=[10, 20], reward="r")
    np.testing.assert_array_equal(codes.actions, [1, 0, 0, 0])
    plain = read_table(coded.assign(a=[1, 0, 0, 0]), episode="ep", unit="who", observations="s", action="a",
                       actions=[0, 1], reward="r")
    assert plain.metadata.action_labels is None and "action_labels" not in plain.metadata.to_dict()


def test_an_episode_with_an_action_outside_the_declared_set_is_dropped_whole_never_refused(capsys):
    # Units a (episodes 1, 2) and b (episode 3): episode 2 logs action 2 once, episode 3 logs action -1.
    frame = pd.DataFrame({"ep": [1, 1, 2, 2, 3], "u": ["a", "a", "a", "a", "b"], "x": [0.0, 1, 2, 3, 4],
                          "a": [0, 1, 1, 2, -1], "r": [1.0, 0, 0, 1, 0]})
    dataset = read_table(frame, episode="ep", unit="u", observations="x", action="a", actions=2, reward="r")
    # Episode 1 intact; episode 2 gone whole (no row glued across the gap); unit b gone with its only episode.
    assert list(dataset.episode_lengths) == [2] and dataset.metadata.unit_keys == ("a",)
    np.testing.assert_array_equal(dataset.actions, [0, 1])
    assert import_summary(dataset)["dropped_out_of_set_episodes"] == 2
    err = capsys.readouterr().err
    assert err.startswith("curator-only") and "dropped 2 episode(s)" in err
    # Dropping depends on each unit's own rows: without unit b's episode the import is the same dataset's.
    without_b = read_table(frame[frame["u"] == "a"], episode="ep", unit="u", observations="x", action="a",
                           actions=2, reward="r")
    assert without_b.fingerprint() != dataset.fingerprint()  # the import summary's counts differ (curator-only) ...
    for name in ("observations", "actions", "rewards", "episode_lengths", "unit_ids"):  # ... the data do not
        np.testing.assert_array_equal(getattr(without_b, name), getattr(dataset, name))


def _q_targets_with_placeholder(dataset, value, algorithm):
    t = dataset.transitions().to_torch()
    next_obs = t["next_obs"].clone()
    next_obs[t["terminated"]] = value
    data = {"obs": t["obs"], "actions": t["actions"], "rewards": t["rewards"], "next_obs": next_obs,
            "terminated": t["terminated"]}
    return algorithm.row_losses(Batch(data, torch.zeros(len(next_obs), dtype=torch.long), 1, private=True))


def test_cql_target_ignores_the_terminal_placeholder():
    dataset = read_table(logged_frame(seed=6), **COLUMNS, terminated="terminated", next_observations="next_")
    assert dataset.terminations.any()
    torch.manual_seed(0)
    cql = DiscreteCQLModule(3, 3, CQLConfig(hidden_sizes=[8]), privacy_unit=dataset_unit(dataset))
    zero = _q_targets_with_placeholder(dataset, 0.0, cql)
    huge = _q_targets_with_placeholder(dataset, 1e6, cql)
    torch.testing.assert_close(zero, huge, rtol=0, atol=0)  # bit-identical: the placeholder is masked, not used


@pytest.mark.filterwarnings("ignore::UserWarning")
def test_read_minari_records_the_unit(tmp_path, monkeypatch):
    pytest.importorskip("minari")
    from dporl.data.minari_io import export_minari
    from dporl.data.table import read_minari

    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari"))
    dataset, _ = make_dataset(seed=7, n_episodes=5)
    export_minari(dataset, "units-v0", progress=False)
    back = read_minari("units-v0", unit="expert_id", progress=False)
    assert dataset_unit(back) == grouped_by("expert_id")
    np.testing.assert_array_equal(np.asarray(back.metadata.unit_keys, dtype=int)[back.unit_ids], dataset.unit_ids)
    assert with_unit(dataset, "expert_id").metadata.unit_keys == back.metadata.unit_keys


# ---------------------------------------------------------------------------------------------------- refusals
def _base():
    return pd.DataFrame({"ep": [1, 1, 1, 2, 2], "u": ["a", "a", "a", "b", "b"], "step": [0, 1, 2, 0, 1],
                         "x": [0.1, 0.2, 0.3, 0.4, 0.5], "a": [0, 1, 0, 1, 1], "r": [0.0, 1, 0, 1, 0],
                         "p": [0.5, 0.5, 0.5, 0.5, 0.5], "done": [0, 0, 1, 0, 1]})


def _read(frame, **kw):
    args = dict(episode="ep", unit="u", observations=["x"], action="a", actions=2, reward="r", step="step",
                terminated="done")
    args.update(kw)
    return read_table(frame, **args)


def _edit(column, values):
    frame = _base()
    frame[column] = values
    return frame


@pytest.mark.parametrize("frame, kw, field, message", [
    (_base(), {"observations": ["x", "heart_rate"]}, "heart_rate", "no such column"),
    (_base(), {"reward": "outcome"}, "outcome", "no such column"),
    (_edit("x", [0.1, np.nan, 0.3, 0.4, 0.5]), {}, "x", "NaN/inf"),
    (_edit("ep", [1.0, 1.0, np.nan, 2.0, 2.0]), {}, "ep", "NaN/inf"),
    (_edit("u", [1.0, 1.0, 1.0, np.nan, np.nan]), {}, "u", "NaN/inf"),
    (_edit("r", [0.0, np.inf, 0, 1, 0]), {}, "r", "NaN/inf"),
    (_edit("a", [0, 1.5, 0, 1, 1]), {}, "a", "expected integers"),
    (_base(), {"actions": 1}, "a", r"every episode holds an action outside the declared set 0..0 \(actions=1\) "
                                   r"\(e.g. 1\)"),
    (_base(), {"actions": None}, "actions", "declare the action set"),
    (_base(), {"actions": ["x", "x"]}, "actions", "distinct"),
    (_base(), {"actions": ["x", 1]}, "actions", "all strings or all integers"),
    (_base(), {"actions": 0}, "actions", "count"),
    (_edit("a", ["x", "y", "x", "z", "z"]), {"actions": ["w"]}, "a", r"every episode .* \['w'\] \(e.g. 'x'\)"),
    (_edit("a", ["x", "y", "x", "y", "y"]), {}, "a", "expected numbers"),
    (_edit("step", [0, 2, 1, 0, 1]), {}, "step", "step"),
    (_edit("step", [0, 1, 1, 0, 1]), {}, "step", "duplicated"),
    (_edit("step", [0, 1, 0, 0, 1]), {}, "step", "unsorted"),
    (_edit("step", [0, 1, 3, 0, 1]), {}, "step", "skipped"),
    (_edit("u", ["a", "a", "c", "b", "b"]), {}, "u", "split across units"),
    (_edit("done", [0, 1, 1, 0, 1]), {}, "done", "not its last"),
    (_edit("p", [0.5, 0.0, 0.5, 0.5, 0.5]), {"propensity": "p"}, "p", r"\(0, 1\]"),
    (_edit("p", [0.5, 1.2, 0.5, 0.5, 0.5]), {"propensity": "p"}, "p", r"\(0, 1\]"),
    (_edit("p", [-0.1, 0.2, -1, -1, -1]), {"propensity": "p", "propensity_kind": "log_prob"}, "p", "<= 0"),
    (_edit("done", [0, 0, 1, 0, 0]).iloc[[0, 1, 2, 3]], {}, "episode", "no usable step"),
    (_base(), {"next_observations": ["x", "x"]}, "next_observations", "column"),
    (_base(), {"propensity_kind": "odds"}, "propensity_kind", "prob"),
])
def test_bad_tables_get_named_errors(frame, kw, field, message):
    with pytest.raises(ValidationError, match=message) as info:
        _read(frame, **kw)
    assert info.value.field == field


def test_missing_values_and_foreign_sources_are_named(tmp_path):
    frame = _base().astype({"u": object})
    frame.loc[1, "u"] = None
    with pytest.raises(ValidationError) as info:
        _read(frame)
    assert info.value.field in ("u", "id")
    path = tmp_path / "log.csv"
    path.write_text("ep,u,step,x,a,r,done\n1,a,0,0.1,0,0,0\n1,a,1,,1,1,1\n")
    with pytest.raises(ValidationError, match="NaN") as info:
        _read(path)
    assert info.value.field == "x"
    with pytest.raises(ValidationError) as info:
        read_table(tmp_path / "nothing.csv", **COLUMNS)
    assert info.value.field == "source"
    (tmp_path / "x.json").write_text("{}")
    with pytest.raises(ValidationError, match="format"):
        read_table(tmp_path / "x.json", **COLUMNS)


def test_next_state_must_be_the_following_rows_state():
    frame = _base()
    frame["nx"] = [0.2, 0.2, np.nan, 0.5, np.nan]  # row 1's next state should be 0.3
    with pytest.raises(ValidationError, match="following row") as info:
        _read(frame, next_observations=["nx"])
    assert info.value.field == "nx"
    frame["nx"] = [0.2, 0.3, np.nan, 0.5, np.nan]  # terminal next states may be empty
    dataset = _read(frame, next_observations=["nx"])
    assert dataset.n_transitions == 5 and np.all(np.isfinite(dataset.observations))
    truncated = _edit("done", [0, 0, 1, 0, 0])
    truncated["nx"] = [0.2, 0.3, np.nan, 0.5, np.nan]  # a truncated last step needs its next state
    with pytest.raises(ValidationError, match="NaN") as info:
        _read(truncated, next_observations=["nx"])
    assert info.value.field == "nx"


def test_metadata_refuses_inconsistent_unit_keys():
    with pytest.raises(ValidationError) as info:
        DatasetMetadata("T-v0", 2, 3, (1,), unit_column="u", unit_keys=("a", "b"))
    assert info.value.field == "metadata.unit_keys"
    with pytest.raises(ValidationError, match="distinct"):
        DatasetMetadata("T-v0", 2, 2, (1,), unit_column="u", unit_keys=("a", "a"))


@pytest.mark.parametrize("block", [1, 3, 7, 64])
def test_blockwise_passes_match_one_block(monkeypatch, block):
    """The importer's blockwise passes (observation interleaving, step and unit checks) agree with one big block,
    including blocks that end inside an episode or on an inserted final state."""
    import dporl.data.table_phases as table_module

    frame = logged_frame(seed=8, n_units=5, episodes_per_unit=4)
    sizes = frame.groupby("episode", sort=False)["step"].transform("size")
    frame = frame[~(frame["truncated"] & (sizes == 1))].reset_index(drop=True)  # no episode without a usable step
    assert frame["truncated"].any() and frame["terminated"].any()
    reference = read_table(frame, **COLUMNS, terminated="terminated")  # truncated last steps dropped: mixed layout
    monkeypatch.setattr(table_module, "_BLOCK", block)
    assert_same_dataset(read_table(frame, **COLUMNS, terminated="terminated"), reference)
    bad = frame.copy()
    bad.loc[len(bad) - 2, "step"] = bad.loc[len(bad) - 3, "step"]  # a duplicated step near the end
    assert bad.loc[len(bad) - 2, "episode"] == bad.loc[len(bad) - 3, "episode"]  # inside one episode
    with pytest.raises(ValidationError, match="duplicated"):
        read_table(bad, **COLUMNS, terminated="terminated")
    split = frame.copy()
    last_episode = split["episode"].iloc[-1]
    rows = np.flatnonzero(split["episode"] == last_episode)
    split.loc[rows[-1], "unit"] = "someone-else"
    assert len(rows) > 1
    with pytest.raises(ValidationError, match="split across units"):
        read_table(split, **COLUMNS, terminated="terminated")
