"""A table's public vocabulary reaches the released policy: string action labels (declared, mapped to indices in
the declared order) and the observation columns' names are stored in ``policy.json`` and ``act`` answers
``{column: value}`` with a label."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch

import dporl
from dporl.data.dataset import TrajectoryDataset
from dporl.eval.ope_coverage import TreatmentChain
from dporl.pipelines.offline_eval import OfflineEvalConfig
from dporl.train.export import GreedyPolicy, load_policy, save_policy
from dporl.utils.validation import ValidationError

torch.set_num_threads(1)
FEATURES = ["age", "bp", "hr", "spo2", "temp", "lactate"]  # the treatment chain's 6 one-hot states, renamed


@pytest.fixture(scope="module")
def table(tmp_path_factory):
    frame = dporl.to_frame(TreatmentChain().simulate(60, 2, (0.2, 0.8), np.random.default_rng(1)), unit="clinician")
    frame = frame.rename(columns={f"obs_{j}": name for j, name in enumerate(FEATURES)})
    frame["action"] = np.where(frame["action"] == 1, "treat", "wait")
    path = tmp_path_factory.mktemp("vocabulary") / "stays.csv"
    frame.to_csv(path, index=False)
    return path


def read(path, **changes):
    kwargs = dict(episode="episode", unit="clinician", observations=FEATURES, action="action",
                  actions=["wait", "treat"], reward="reward", terminated="terminated", truncated="truncated")
    return dporl.read_table(path, **{**kwargs, **changes})


def test_string_labels_map_in_declared_order_and_names_are_kept(table, tmp_path):
    frame = pd.read_csv(table)
    forward, backward = read(table), read(table, actions=["treat", "wait"])
    assert forward.metadata.action_labels == ("wait", "treat")
    assert forward.metadata.observation_names == tuple(FEATURES)
    logged = frame["action"].to_numpy()
    assert np.array_equal(forward.actions, (logged == "treat").astype(np.int64))  # declared order, not the rows'
    assert np.array_equal(backward.actions, (logged == "wait").astype(np.int64))
    forward.save(tmp_path / "d.npz")
    assert TrajectoryDataset.load(tmp_path / "d.npz").metadata.observation_names == tuple(FEATURES)


def test_a_label_no_episode_may_hold_is_refused_naming_the_column_and_value(table, tmp_path):
    frame = pd.read_csv(table)
    frame["action"] = frame["action"].replace({"treat": "fluids"})  # a label the declaration lacks, in every episode
    frame.loc[frame["action"] == "wait", "action"] = "fluids"
    frame.to_csv(tmp_path / "bad.csv", index=False)
    with pytest.raises(ValidationError) as info:
        read(tmp_path / "bad.csv")
    assert info.value.field == "action" and "'fluids'" in str(info.value) and "wait" in str(info.value)


def test_labels_and_names_round_trip_into_the_released_policy_and_act(table, tmp_path):
    data = read(table)
    cql = dporl.DiscreteCQLConfig(epsilon=1.0, gamma=0.95, steps=20, hidden_sizes=[8], batch_size=32, progress=False,
                                  noise_seed=3, evaluation=OfflineEvalConfig(estimator="none")).create(data)
    cql.fit(run_dir=tmp_path / "run")
    spec = json.loads((tmp_path / "run" / "release" / "policy" / "policy.json").read_text())
    assert spec["action_space"]["labels"] == ["wait", "treat"]
    assert spec["observation_space"]["names"] == FEATURES
    policy = load_policy(tmp_path / "run" / "release" / "policy")
    assert policy.observation_names == tuple(FEATURES) and policy.action_labels == ("wait", "treat")
    states = torch.eye(6)
    indices = policy.act(states)  # a tensor: the action indices (what the TorchScript file computes)
    assert indices.dtype == torch.int64 and torch.equal(indices, cql.predict(states))
    expected = [("wait", "treat")[int(i)] for i in indices]
    for row in range(6):  # one observation by name -> one label
        assert policy.act(dict(zip(FEATURES, states[row].tolist()))) == expected[row]
    reordered = {name: states[:, j].numpy() for j, name in reversed(list(enumerate(FEATURES)))}
    assert policy.act(reordered) == expected  # a batch by name, in any key order -> a list of labels
    assert policy.act(pd.DataFrame(reordered)) == expected
    assert policy.act(states.numpy(), labels=True) == expected  # an array, asked for labels
    assert cql.policy.act(dict(zip(FEATURES, states[0].tolist()))) == expected[0]  # the API's policy knows them too
    with pytest.raises(ValidationError) as info:
        policy.act({name: 0.0 for name in FEATURES[:-1]})
    assert info.value.field == "obs.lactate"
    with pytest.raises(ValidationError) as info:
        policy.act({**{name: 0.0 for name in FEATURES}, "weight": 1.0})
    assert info.value.field == "obs.weight"
    with pytest.raises(ValidationError) as info:
        policy.act({**{name: 0.0 for name in FEATURES}, "bp": float("nan")})
    assert info.value.field == "obs.bp"


def test_a_policy_file_whose_labels_or_names_do_not_fit_is_refused(tmp_path):
    policy = GreedyPolicy(3, [4], 2, observation_names=["a", "b", "c"], action_labels=["no", "yes"])
    save_policy(policy, tmp_path / "p")
    loaded = load_policy(tmp_path / "p")
    assert loaded.act({"a": 1.0, "b": 0.0, "c": 2.0}) in ("no", "yes")
    spec_path = tmp_path / "p" / "policy.json"
    spec = json.loads(spec_path.read_text())
    for space, entry, value in (("action_space", "labels", ["no", "yes", "maybe"]),
                                ("action_space", "labels", ["no", "no"]),
                                ("observation_space", "names", ["a", "b"]),
                                ("observation_space", "names", ["a", "b", 3])):
        broken = json.loads(json.dumps(spec))
        broken[space][entry] = value
        spec_path.write_text(json.dumps(broken))
        with pytest.raises(ValidationError) as info:
            load_policy(tmp_path / "p")
        assert info.value.field == f"policy.{space}.{entry}"
    with pytest.raises(ValidationError) as info:  # a policy without names takes arrays only
        GreedyPolicy(3, [4], 2).act({"a": 1.0, "b": 0.0, "c": 2.0})
    assert info.value.field == "obs"
