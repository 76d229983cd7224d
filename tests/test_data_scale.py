"""Data at scale: linear grouping, sources that share the dataset's arrays (equal to the copying path), memory-mapped
loading (equal to reading), aligned archives, chunked validation, the fingerprint unchanged."""

from __future__ import annotations

import hashlib
import json
import mmap
import struct
import zipfile

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import dporl.data.storage as storage_module
from dporl.algos.expert_sources import CQL_KEYS, expert_source, stable_source
from dporl.data import DatasetMetadata, TrajectoryDataset
from dporl.privacy.samplers import PoissonUnitSource
from dporl.privacy.count import WHOLE, Units
from dporl.privacy.units import dataset_unit
from dporl.utils.grouping import stable_group_order
from dporl.utils.validation import ValidationError

from test_dataset import (
    _PROPERTY_SETTINGS,
    _archive_members,
    arrays_of,
    assert_same_dataset,
    make_episodes,
    random_datasets,
)


def _dataset(seed=0, n_units=9, n_episodes=40, max_len=4, obs_shape=(3,)):
    """Episodes of length 1..max_len from a pool where some experts log nothing (empty units)."""
    rng = np.random.default_rng(seed)
    episodes = make_episodes(rng, n_episodes=n_episodes, obs_shape=obs_shape, n_units=n_units - 2,
                             max_len=max_len)
    meta = DatasetMetadata(env_id="Test-v0", n_actions=3, n_units=n_units, obs_shape=obs_shape)
    return TrajectoryDataset.from_episodes(episodes, meta)


def _is_mapped(array) -> bool:
    while array is not None:
        if isinstance(array, (np.memmap, mmap.mmap)):
            return True
        array = getattr(array, "base", None)
    return False


# ---------------------------------------------------------------- grouping
@pytest.mark.parametrize("n_groups", [1, 7, 70_000])  # 70,000 > 2**16: two radix passes
@pytest.mark.parametrize("arrangement", ["random", "sorted", "reversed"])
def test_stable_group_order_is_a_stable_argsort(n_groups, arrangement):
    rng = np.random.default_rng(n_groups)
    keys = rng.integers(0, n_groups, 5000)
    if arrangement != "random":
        keys = np.sort(keys)[:: 1 if arrangement == "sorted" else -1]
    order, offsets = stable_group_order(keys, n_groups)
    assert order.dtype == np.int64 and offsets.dtype == np.int64
    np.testing.assert_array_equal(order, np.argsort(keys, kind="stable"))
    np.testing.assert_array_equal(np.diff(offsets), np.bincount(keys, minlength=n_groups))
    empty_order, empty_offsets = stable_group_order(np.zeros(0, dtype=np.int64), 3)
    assert len(empty_order) == 0 and empty_offsets.tolist() == [0, 0, 0, 0]


def test_expert_episode_index_matches_a_stable_argsort():
    dataset = _dataset(seed=1)
    order, offsets = dataset.unit_episode_index()
    np.testing.assert_array_equal(order, np.argsort(dataset.unit_ids, kind="stable"))
    np.testing.assert_array_equal(np.diff(offsets), np.bincount(dataset.unit_ids, minlength=9))
    assert offsets[-1] == dataset.n_episodes and (np.diff(offsets) == 0).any()  # an empty expert


# ---------------------------------------------------------------- columns shared with the dataset
@_PROPERTY_SETTINGS
@given(dataset=random_datasets(), data=st.data())
def test_transition_columns_gather_what_transitions_copies(dataset, data):
    """Any dataset (empty, one-step episodes, scalar observations): indexing the shared columns gives the rows of
    the copied ``transitions()`` view."""
    t = dataset.transitions()
    columns = dataset.transition_columns()
    n = len(t)
    rows = torch.tensor(data.draw(st.lists(st.integers(0, max(n - 1, 0)), max_size=12)) if n else [],
                        dtype=torch.long)
    expected = {"obs": t.obs, "next_obs": t.next_obs, "actions": t.actions, "rewards": t.rewards,
                "terminated": t.terminated, "truncated": t.truncated}
    if t.behavior_log_probs is not None:
        expected["behavior_log_probs"] = t.behavior_log_probs
    assert set(columns) == set(expected)
    for key, values in expected.items():
        column = columns[key]
        assert tuple(column.shape) == values.shape, key
        assert torch.equal(column.index_select(0, rows), torch.from_numpy(values)[rows]), key
        assert torch.equal(column.index_select(0, torch.arange(n)), torch.from_numpy(values)), key


NINE = Units.public({WHOLE: 9})  # the test datasets' 9 units, exact (replace-one: the count is public)


def _copying_source(dataset, batch_size, rows_per_unit):
    """The expert source as it was built before shared columns: every column copied by ``transitions()`` and a
    per-transition expert id (reference)."""
    t = dataset.transitions().to_torch()
    m = dataset.metadata.n_units
    return PoissonUnitSource({k: t[k] for k in CQL_KEYS}, t["unit_ids"], m, batch_size / m, rows_per_unit,
                             unit=dataset_unit(dataset))


@pytest.mark.parametrize("rows_per_unit", [1, 3])
@pytest.mark.parametrize("sort_by_expert", [False, True])  # interleaved experts, or logged expert by expert
def test_expert_source_batches_equal_the_copying_path(rows_per_unit, sort_by_expert):
    dataset = _dataset(seed=2 + rows_per_unit)
    if sort_by_expert:
        dataset = dataset.subset(np.argsort(dataset.unit_ids, kind="stable"))
    shared, copied = expert_source(dataset, 4.0, rows_per_unit, NINE), _copying_source(dataset, 4.0, rows_per_unit)
    assert torch.equal(shared.index.counts, copied.index.counts)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    for _ in range(25):
        a, b = shared.sample(g1), copied.sample(g2)
        assert a.n_units == b.n_units and torch.equal(a.unit_index, b.unit_index)
        for key in CQL_KEYS:
            assert torch.equal(a.data[key], b.data[key]), key
    public, reference = stable_source(dataset, 16), None
    t = dataset.transitions().to_torch()
    g1, g2 = torch.Generator().manual_seed(4), torch.Generator().manual_seed(4)
    a = public.sample(g1)
    rows = torch.randint(0, dataset.n_transitions, (16,), generator=g2)
    for key in CQL_KEYS:
        assert torch.equal(a.data[key], t[key][rows]), key


def test_shared_columns_leave_the_dataset_untouched_and_copy_nothing():
    dataset = _dataset(seed=5)
    before = dataset.fingerprint()
    columns = dataset.transition_columns()
    assert columns["actions"].data_ptr() == dataset.actions.ctypes.data  # shared, not copied
    assert columns["obs"].episodes.observations.data_ptr() == dataset.observations.ctypes.data
    assert columns["obs"].episodes is columns["next_obs"].episodes  # one copy of the observations...
    moved = {key: columns[key].to("cpu") for key in ("obs", "next_obs")}
    assert moved["obs"].episodes is moved["next_obs"].episodes  # ... also after a move
    t = dataset.transitions()
    rows = torch.tensor([0, 5, 2])
    assert torch.equal(columns["obs"].index_select(0, rows), torch.from_numpy(t.obs[[0, 5, 2]]))
    rows[1] = 7  # the same tensor changed in place: the cached episode lookup must not be reused
    assert torch.equal(columns["next_obs"].index_select(0, rows), torch.from_numpy(t.next_obs[[0, 7, 2]]))
    batch = expert_source(dataset, 4.0, 2, NINE).sample(torch.Generator().manual_seed(0))
    batch.data["obs"].add_(1.0)  # a batch is a fresh gather: writing into it cannot reach the dataset
    assert dataset.fingerprint() == before == _dataset(seed=5).fingerprint()


# ---------------------------------------------------------------- memory-mapped loading
def _member_data_offsets(path):
    """File offset of every member's array data, parsed from the zip local headers and .npy headers."""
    offsets = {}
    with zipfile.ZipFile(path) as archive, open(path, "rb") as handle:
        for info in archive.infolist():
            handle.seek(info.header_offset)
            local = handle.read(30)
            name_length, extra_length = struct.unpack("<HH", local[26:30])
            handle.seek(info.header_offset + 30 + name_length + extra_length)
            assert np.lib.format.read_magic(handle) == (1, 0)
            np.lib.format.read_array_header_1_0(handle)
            offsets[info.filename[:-4]] = handle.tell()
    return offsets


def test_saved_archives_align_every_array_and_stay_plain_npz(tmp_path):
    dataset = _dataset(seed=6)
    path = dataset.save(tmp_path / "d.npz")
    assert all(offset % 64 == 0 for offset in _member_data_offsets(path).values())
    with np.load(path, allow_pickle=False) as archive:  # an ordinary npz for any reader
        for name, value in arrays_of(dataset).items():
            np.testing.assert_array_equal(archive[name], value)
    assert path.read_bytes() == dataset.save(tmp_path / "again.npz").read_bytes()  # no timestamps: reproducible


@pytest.mark.parametrize("seed", range(4))
def test_mapped_load_equals_read_load_and_trains_the_same(tmp_path, seed):
    dataset = _dataset(seed=10 + seed, obs_shape=(2, 2) if seed % 2 else (3,))
    path = dataset.save(tmp_path / "d.npz")
    mapped, read = TrajectoryDataset.load(path, mmap=True), TrajectoryDataset.load(path)
    assert_same_dataset(mapped, dataset)
    assert_same_dataset(read, dataset)
    assert mapped.fingerprint() == read.fingerprint() == dataset.fingerprint()
    for name in ("observations", "actions", "rewards", "terminations", "behavior_log_probs", "unit_ids"):
        assert _is_mapped(getattr(mapped, name)), name
        assert not _is_mapped(getattr(read, name)), name
        assert not getattr(mapped, name).flags.writeable
    g1, g2 = torch.Generator().manual_seed(seed), torch.Generator().manual_seed(seed)
    on_disk, in_memory = expert_source(mapped, 3.0, 2, NINE), expert_source(read, 3.0, 2, NINE)
    for _ in range(10):
        a, b = on_disk.sample(g1), in_memory.sample(g2)
        for key in CQL_KEYS:
            assert torch.equal(a.data[key], b.data[key]), key


@pytest.mark.parametrize("writer", [np.savez, np.savez_compressed])
def test_mapped_load_reads_archives_of_a_bare_numpy_writer(tmp_path, writer):
    """Files written by np.savez (members not aligned) or compressed: what cannot be mapped is read."""
    dataset = _dataset(seed=20)
    with open(tmp_path / "old.npz", "wb") as handle:
        writer(handle, **_archive_members(dataset))
    loaded = TrajectoryDataset.load(tmp_path / "old.npz", mmap=True)
    assert_same_dataset(loaded, dataset)
    if writer is np.savez_compressed:
        assert not any(_is_mapped(a) for a in arrays_of(loaded).values())


def test_mapped_load_refuses_object_members_and_truncation(tmp_path):
    dataset = _dataset(seed=21)
    members = _archive_members(dataset)
    members["rewards"] = np.array([None] * dataset.n_transitions, dtype=object)
    with zipfile.ZipFile(tmp_path / "obj.npz", "w") as archive:
        for name, value in members.items():
            with archive.open(f"{name}.npy", "w") as member:
                np.lib.format.write_array(member, value, allow_pickle=True)
    with pytest.raises(ValidationError) as info:
        TrajectoryDataset.load(tmp_path / "obj.npz", mmap=True)
    assert info.value.field == "rewards" and "pickle" in str(info.value)
    # A member whose header promises more data than the member holds: refused before anything is mapped.
    raw = bytearray(dataset.save(tmp_path / "d.npz").read_bytes())
    header = np.lib.format.header_data_from_array_1_0(dataset.observations)
    original = repr(header["shape"]).encode()
    bigger = repr((dataset.observations.shape[0] + 10, dataset.observations.shape[1])).encode().ljust(len(original))
    position = raw.index(original)
    assert len(bigger) == len(original)
    raw[position : position + len(original)] = bigger
    (tmp_path / "d.npz").write_bytes(bytes(raw))
    with pytest.raises(ValidationError) as info:
        TrajectoryDataset.load(tmp_path / "d.npz", mmap=True)
    assert info.value.field == "observations"


# ---------------------------------------------------------------- validation and fingerprint in chunks
def test_chunked_checks_count_every_bad_value_and_flag(monkeypatch):
    monkeypatch.setattr(storage_module, "_CHUNK_BYTES", 16)  # 4 float32 per chunk: many chunks
    dataset = _dataset(seed=30)
    fields = {name: value for name, value in arrays_of(dataset).items()}
    observations = fields["observations"].copy()
    observations[[0, 7, len(observations) - 1], 0] = [np.nan, np.inf, -np.inf]
    with pytest.raises(ValidationError, match="contains 3 non-finite") as info:
        TrajectoryDataset(**{**fields, "observations": observations}, metadata=dataset.metadata)
    assert info.value.field == "observations"
    ends = np.cumsum(dataset.episode_lengths) - 1
    inside = int(np.flatnonzero(dataset.episode_lengths > 1)[-1])  # the last episode with an inner step
    truncations = fields["truncations"].copy()
    truncations[ends[inside] - 1] = True
    with pytest.raises(ValidationError, match=f"transition {ends[inside] - 1} \\(inside episode {inside}\\)") as info:
        TrajectoryDataset(**{**fields, "truncations": truncations}, metadata=dataset.metadata)
    assert info.value.field == "truncations"


def test_fingerprint_hashes_the_same_bytes_in_chunks(monkeypatch):
    """Run directories record fingerprints as provenance: the value is sha256 over metadata and whole arrays, the
    unit fields labelled as format version 2 names them (expert_ids, n_experts), so the same content keeps its
    fingerprint."""
    monkeypatch.setattr(storage_module, "_CHUNK_BYTES", 24)
    dataset = _dataset(seed=31)
    metadata = dataset.metadata.to_dict()
    metadata["n_experts"] = metadata.pop("n_units")
    digest = hashlib.sha256(json.dumps(metadata, sort_keys=True).encode())
    for name, array in arrays_of(dataset).items():
        digest.update(("expert_ids" if name == "unit_ids" else name).encode())
        digest.update(f"{array.dtype.str}{array.shape}".encode())
        digest.update(np.ascontiguousarray(array).tobytes())
    assert dataset.fingerprint() == digest.hexdigest()
    without = dataset.replace(behavior_log_probs=None)
    assert without.fingerprint() != dataset.fingerprint()


# ---------------------------------------------------------------- the pipeline on a mapped file
def test_a_run_on_a_mapped_file_equals_the_run_on_the_read_file(tmp_path):
    from test_expert_cql import config, log_lqr_experts

    from dporl.pipelines.train import run
    from dporl.utils.io import load_weights

    (tmp_path / "logged").mkdir()
    logged = log_lqr_experts(tmp_path / "logged", {"data.npz": 0})
    results = []
    for mmap in (False, True):
        cfg = config(logged, tmp_path / f"mmap_{mmap}", method="dp_sgd",
                     **{"data.mmap": mmap, "trainer.max_steps": 12, "trainer.eval_every": 12,
                        "trainer.checkpoint_every": 12})
        summary = run(cfg)
        weights = sorted((tmp_path / f"mmap_{mmap}" / "run" / "release").rglob("weights.pt"))
        assert weights, "the run released no weights"
        results.append((summary["steps"], load_weights(weights[0], "weights")))
    (steps_read, read), (steps_mapped, mapped) = results
    assert steps_read == steps_mapped == 12
    assert read.keys() == mapped.keys() and all(torch.equal(read[k], mapped[k]) for k in read)


def test_mmap_applies_to_npz_files_only():
    from dporl.pipelines.train import TrainPipelineConfig
    from dporl.utils.config import from_dict

    for data in ({"format": "minari", "path": "d-v0", "unit": "u", "mmap": True}, {"path": "d.npz", "mmap": "yes"}):
        with pytest.raises(ValidationError) as info:
            from_dict(TrainPipelineConfig, {"data": data})
        assert info.value.field == "data.mmap"
