"""Files are hostile input: nothing a file says is imported or executed, and what it makes dporl allocate is bounded
before it is allocated.

Environment ids from a policy, a dataset, an expert set, a Minari dataset and a checkpoint's config are names, never
modules: a ``policy_env.py`` beside the file (Gymnasium imports the module named before a colon) must never run.
Zip bombs (npz datasets, torch files, gzip tables), forged array headers, oversized CSV cells and deeply nested JSON
are refused by name, without a large allocation and without a traceback.
"""

from __future__ import annotations

import gzip
import json
import subprocess
import sys
import tracemalloc
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from dporl.data.dataset import TrajectoryDataset
from dporl.experts.expert_set import ExpertSet
from dporl.train.export import GreedyPolicy, save_policy
from dporl.utils.validation import ValidationError
from test_dataset import make_dataset
from test_expert_cql import log_lqr_experts

# A module that proves it ran: it writes a marker file named after itself next to itself.
MARKER_MODULE = "from pathlib import Path\nPath(__file__).with_suffix('.ran').write_text('imported')\n"
MIB = 1 << 20
# What a refusal may allocate: far below the payloads below (128 MiB each), which a reader that inflates first hits.
ALLOCATION_BOUND = 16 * MIB


def _plant_marker(directory: Path, name: str = "policy_env") -> Path:
    (directory / f"{name}.py").write_text(MARKER_MODULE)
    return directory / f"{name}.ran"


def _dporl(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m dporl ARGS`` in ``cwd`` (which Python puts first on the module path, as a user's shell would)."""
    return subprocess.run([sys.executable, "-m", "dporl", *args], cwd=cwd, capture_output=True, text=True, timeout=300)


def _refused(result: subprocess.CompletedProcess, field: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"error: {field}" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    return log_lqr_experts(tmp_path_factory.mktemp("logged"), {"data.npz": 0})


def _train_config(logged: Path, run_dir: Path, **data) -> dict:
    return {
        "pipeline": "train", "method": "dp_sgd", "run_dir": str(run_dir), "epsilon": 10.0, "delta": 1e-5,
        "batch_size": 16, "noise_seed": 1,
        "data": {"dataset": str(logged / "data.npz"), **data},
        "algorithm": {"name": "cql", "hidden_sizes": [8]},
        "trainer": {"max_steps": 4, "eval_every": 4, "log_every": 4, "checkpoint_every": 4, "progress": False},
        "eval": {"enabled": False, "offline": {"estimator": "none"}},  # no evaluation: these runs test their files
    }


def _write_members(path: Path, members: dict) -> None:
    with open(path, "wb") as handle:
        np.savez(handle, **members)


def _members_of(path: Path) -> dict:
    with np.load(path, allow_pickle=False) as archive:
        return {key: archive[key] for key in archive.files}


# ------------------------------------------------------------------------------------------ env ids are names
@pytest.mark.parametrize("env_id", ["policy_env:CartPole-v1", "this:CartPole-v1"])
def test_evaluate_never_imports_the_module_a_policy_names(tmp_path, env_id):
    marker = _plant_marker(tmp_path)
    policy = tmp_path / "policy"
    save_policy(GreedyPolicy(4, [8], 2), policy, env_id=env_id)
    result = _dporl(tmp_path, "evaluate", "--policy", str(policy), "--episodes", "1", "--no-progress")
    _refused(result, "policy.env_id")
    assert not marker.exists()
    assert "Beautiful is better than ugly" not in result.stdout + result.stderr  # `import this` prints the Zen


def test_evaluate_refuses_a_module_in_the_env_flag_too(tmp_path):
    marker = _plant_marker(tmp_path)
    policy = tmp_path / "policy"
    save_policy(GreedyPolicy(4, [8], 2), policy, env_id="CartPole-v1")
    _refused(_dporl(tmp_path, "evaluate", "--policy", str(policy), "--env", "policy_env:CartPole-v1", "--episodes",
                    "1", "--no-progress"), "env")
    assert not marker.exists()


def test_training_refuses_a_dataset_whose_env_id_names_a_module(logged, tmp_path):
    marker = _plant_marker(tmp_path)
    members = _members_of(logged / "data.npz")
    meta = json.loads(str(members["metadata"]))
    members["metadata"] = np.array(json.dumps({**meta, "env_id": "policy_env:CartPole-v1"}))
    _write_members(tmp_path / "hostile.npz", members)
    config = _train_config(logged, tmp_path / "run")
    config["data"]["dataset"] = str(tmp_path / "hostile.npz")
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    _refused(_dporl(tmp_path, "train", "--config", "config.yaml"), "metadata.env_id")
    assert not marker.exists() and not (tmp_path / "run").exists()


def test_dataset_generation_refuses_an_expert_set_whose_provenance_names_a_module(logged, tmp_path):
    marker = _plant_marker(tmp_path)
    experts = ExpertSet.load(logged / "experts.pt")
    hostile = ExpertSet(experts.policy, experts.p_min, "argmax", {"generation": {"env_id": "policy_env:CartPole-v1"}})
    hostile.save(tmp_path / "hostile.pt")
    config = {"pipeline": "dataset", "out_dir": str(tmp_path / "out"), "expert_set_path": str(tmp_path / "hostile.pt"),
              "trajectories_per_expert": 1, "max_episode_steps": 10, "progress": False}
    (tmp_path / "config.yaml").write_text(yaml.safe_dump(config))
    _refused(_dporl(tmp_path, "train", "--config", "config.yaml"), "expert_set.info.generation.env_id")
    assert not marker.exists()


def test_minari_metadata_cannot_make_minari_build_the_environment_it_names(tmp_path, monkeypatch):
    """Minari recovers missing spaces with gym.make(env spec from the file): the spec's entry point is code."""
    pytest.importorskip("minari")
    from dporl.data.minari_io import export_minari, import_minari

    monkeypatch.setenv("MINARI_DATASETS_PATH", str(tmp_path / "minari"))
    marker = _plant_marker(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    dataset, _ = make_dataset(seed=3, n_episodes=2)
    export_minari(dataset, "hostile-v0", progress=False)
    metadata_path = tmp_path / "minari" / "hostile-v0" / "data" / "metadata.json"
    metadata = json.loads(metadata_path.read_text())
    del metadata["observation_space"]
    metadata["env_spec"] = json.dumps({
        "id": "Hostile-v0", "entry_point": "policy_env:Env", "reward_threshold": None, "nondeterministic": False,
        "max_episode_steps": None, "order_enforce": True, "disable_env_checker": False, "kwargs": {},
        "additional_wrappers": [], "vector_entry_point": None})
    metadata_path.write_text(json.dumps(metadata))
    with pytest.raises(ValidationError) as refused:
        import_minari("hostile-v0", progress=False)
    assert refused.value.field == "source.metadata.observation_space"
    assert not marker.exists() and "policy_env" not in sys.modules


def test_a_checkpoint_config_cannot_name_a_module_as_its_environment():
    from dporl.pipelines.fnq import FNQPipelineConfig
    from dporl.utils.config import from_dict

    with pytest.raises(ValidationError) as refused:
        from_dict(FNQPipelineConfig, {"env_id": "policy_env:Line1D-v0"})  # how ``evaluate --checkpoint`` reads it
    assert refused.value.field == "env_id"


def test_env_ids_are_checked_against_the_registry_without_importing_anything(tmp_path, monkeypatch):
    from dporl.envs.registry import check_env_id, is_registered

    marker = _plant_marker(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert check_env_id("f", "CartPole-v1") == "CartPole-v1" and check_env_id("f", "dporl/Chain-v0")
    for bad in ("policy_env:CartPole-v1", "this:CartPole-v1", "NoSuchEnv-v0", "CartPole", "", None, 3):
        with pytest.raises(ValidationError) as refused:
            check_env_id("eval.env_id", bad)
        assert refused.value.field == "eval.env_id"
    assert not is_registered("f", "offline-table")
    with pytest.raises(ValidationError):
        is_registered("f", "policy_env:offline-table")
    assert not marker.exists() and "policy_env" not in sys.modules


# ------------------------------------------------------------------------------------------ bounded sizes
def _npy_header(shape: tuple, descr: str = "<f4") -> bytes:
    import io

    buffer = io.BytesIO()
    np.lib.format.write_array_header_1_0(buffer, {"descr": descr, "fortran_order": False, "shape": shape})
    return buffer.getvalue()


def _deflated_zeros(archive: zipfile.ZipFile, name: str, size: int, header: bytes = b"") -> None:
    """A deflated member of ``header`` + ``size`` zero bytes: ~1000:1, built in ~1 s, never held in memory."""
    with archive.open(name, "w", force_zip64=True) as member:  # the archive's compression: deflate, level 9
        member.write(header)
        chunk = bytes(4 * MIB)
        for _ in range(size // len(chunk)):
            member.write(chunk)


def _zip_bomb_dataset(source: Path, target: Path, size: int) -> None:
    """``source``'s members, its observations replaced by ``size`` bytes of deflated zeros (a valid .npy)."""
    members = _members_of(source)
    rows = size // (4 * 4)
    with zipfile.ZipFile(target, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as archive:
        for key, value in members.items():
            if key != "observations":
                with archive.open(f"{key}.npy", "w") as member:
                    np.lib.format.write_array(member, value, allow_pickle=False)
        _deflated_zeros(archive, "observations.npy", rows * 16, _npy_header((rows, 4)))


def _peak_allocation(call) -> tuple[BaseException | None, int]:
    tracemalloc.start()
    try:
        call()
        error = None
    except Exception as exc:  # noqa: BLE001 - returned for the caller's assertion
        error = exc
    finally:
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return error, peak


def test_an_npz_zip_bomb_is_refused_before_it_is_inflated(logged, tmp_path):
    bomb = tmp_path / "bomb.npz"
    _zip_bomb_dataset(logged / "data.npz", bomb, 128 * MIB)
    assert bomb.stat().st_size < 2 * MIB
    error, peak = _peak_allocation(lambda: TrajectoryDataset.load(bomb))
    assert isinstance(error, ValidationError) and error.field == "path", error
    assert "ratio" in str(error) and peak < ALLOCATION_BOUND, (str(error), peak)


def test_a_forged_array_header_is_refused_before_its_declared_size_is_allocated(logged, tmp_path):
    """A stored member whose header declares 128 MiB but holds a few bytes: numpy would allocate, then hit EOF."""
    members = _members_of(logged / "data.npz")
    path = tmp_path / "forged.npz"
    with zipfile.ZipFile(path, "w") as archive:
        for key, value in members.items():
            with archive.open(f"{key}.npy", "w") as member:
                if key == "rewards":
                    member.write(_npy_header((32 * MIB,)) + bytes(64))
                else:
                    np.lib.format.write_array(member, value, allow_pickle=False)
    error, peak = _peak_allocation(lambda: TrajectoryDataset.load(path))
    assert isinstance(error, ValidationError) and error.field == "rewards", error
    assert peak < ALLOCATION_BOUND, peak


def test_members_are_checked_against_the_metadata_before_they_are_read(logged, tmp_path, monkeypatch):
    """A consistent, honest archive whose observations disagree with metadata.obs_shape is refused from the
    headers alone: no member is read after the metadata."""
    from dporl.utils import archives

    members = _members_of(logged / "data.npz")
    members["observations"] = np.zeros((len(members["observations"]), 5), np.float32)
    _write_members(tmp_path / "mismatch.npz", members)
    read = []
    original = archives.NpzArchive.read
    monkeypatch.setattr(archives.NpzArchive, "read", lambda self, key: read.append(key) or original(self, key))
    with pytest.raises(ValidationError) as refused:
        TrajectoryDataset.load(tmp_path / "mismatch.npz")
    assert refused.value.field == "observations" and "refused before reading" in str(refused.value)
    assert read == ["format_version", "metadata"]


def _torch_bomb(path: Path, size: int) -> None:
    """A valid expert-set file whose one tensor record is replaced by ``size`` deflated zero bytes."""
    from dporl.experts.analytic import cartpole_lqr_experts

    policy, _ = cartpole_lqr_experts([{"gravity": 9.8, "force_mag": 10.0, "masscart": 1.0}], 2, seed=0)
    ExpertSet(policy, 0.1, "argmax").save(path.with_suffix(".plain"))
    with zipfile.ZipFile(path.with_suffix(".plain")) as source, \
            zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=9) as archive:
        records = [info.filename for info in source.infolist()]
        target = next(name for name in records if "/data/" in name and not name.endswith(".pkl"))
        for name in records:
            if name == target:
                _deflated_zeros(archive, name, size)
            else:
                archive.writestr(name, source.read(name))


def test_a_torch_zip_bomb_is_refused_before_torch_inflates_it(tmp_path):
    """torch.load inflates deflated records in C++ (invisible to tracemalloc): the peak RSS of a fresh process
    that loads the bomb must not grow by its inflated size."""
    _torch_bomb(tmp_path / "experts.pt", 128 * MIB)
    assert (tmp_path / "experts.pt").stat().st_size < 2 * MIB
    probe = (
        "import resource, sys\n"
        "from dporl.experts.expert_set import ExpertSet\n"
        "from dporl.utils.validation import ValidationError\n"
        "before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss\n"
        "try:\n    ExpertSet.load(sys.argv[1]); outcome = 'loaded'\n"
        "except ValidationError as exc:\n    outcome = exc.field\n"
        "print(outcome, (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024)\n"
    )
    result = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "experts.pt")], capture_output=True,
                            text=True, timeout=300)
    outcome, grown = result.stdout.split()
    assert outcome == "expert_set.path", result.stdout + result.stderr
    assert int(grown) < 32 * MIB, grown


TABLE_FLAGS = ["--episode", "episode", "--unit", "unit", "--observations", "obs_", "--action", "action", "--reward",
               "reward"]


def _inspect(path: Path, capsys) -> tuple[int, str]:
    """``dporl data inspect PATH`` in this process: (exit status, stderr)."""
    from dporl.cli import main

    status = main(["data", "inspect", str(path), *TABLE_FLAGS])
    return status, capsys.readouterr().err


def test_a_gzip_table_bomb_is_refused_while_streaming_it(tmp_path, capsys):
    import pandas  # noqa: F401  (imported before measuring: an import's allocations are not the bomb's)
    from pyarrow import csv  # noqa: F401

    path = tmp_path / "bomb.csv.gz"
    with gzip.open(path, "wb", compresslevel=9) as handle:
        handle.write(b"episode,unit,obs_0,action,reward\n")
        row = b"0,0,0,0,0\n" * (MIB // 10)
        for _ in range(64):
            handle.write(row)
    _inspect(tmp_path / "missing.csv", capsys)  # the command's own imports, outside the measurement
    outcome = {}
    error, peak = _peak_allocation(lambda: outcome.update(zip(("status", "err"), _inspect(path, capsys))))
    assert error is None and outcome["status"] == 2, outcome
    assert "error: source" in outcome["err"] and "inflates" in outcome["err"], outcome["err"]
    assert peak < ALLOCATION_BOUND, peak


def test_a_parquet_file_is_sized_from_its_footer_before_it_is_read(tmp_path, monkeypatch, capsys):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from dporl.utils import archives

    pq.write_table(pa.table({"episode": np.arange(50_000), "unit": np.arange(50_000), "obs_0": np.zeros(50_000),
                             "action": np.zeros(50_000, np.int64), "reward": np.zeros(50_000)}), tmp_path / "t.parquet")
    monkeypatch.setattr(archives, "load_budget_bytes", lambda: MIB // 4)  # one column: 50k rows x 8 bytes = 400 kB

    def never(*args, **kwargs):
        raise AssertionError("the table was read before its size was checked")

    monkeypatch.setattr(pq, "read_table", never)
    status, err = _inspect(tmp_path / "t.parquet", capsys)
    assert status == 2 and "error: source" in err and "declares 50000 rows" in err, err


def test_huge_csv_cells_are_named_errors(tmp_path):
    header_cell = tmp_path / "header.csv"
    header_cell.write_text("episode,unit,obs_" + "x" * 200_000 + ",action,reward\n0,0,1,0,1.0\n")
    data_cell = tmp_path / "cell.csv"
    data_cell.write_text("episode,unit,obs_0,action,reward\n0,0," + "1" * (2 * MIB) + ",0,1.0\n")
    _refused(_dporl(tmp_path, "data", "inspect", str(header_cell), *TABLE_FLAGS), "source")
    result = _dporl(tmp_path, "data", "inspect", str(data_cell), *TABLE_FLAGS)
    _refused(result, "source")
    assert "a row longer than 1 MiB" in result.stderr


# ------------------------------------------------------------------------------------------ nested JSON
def _nested(depth: int) -> str:
    return "[" * depth + "]" * depth


def test_deeply_nested_policy_json_is_a_named_error(tmp_path):
    policy = tmp_path / "policy"
    save_policy(GreedyPolicy(4, [8], 2), policy, env_id="CartPole-v1")
    spec = json.loads((policy / "policy.json").read_text())
    text = json.dumps({**spec, "extra": "@"}).replace('"@"', _nested(200_000))
    (policy / "policy.json").write_text(text)
    _refused(_dporl(tmp_path, "evaluate", "--policy", str(policy), "--episodes", "1", "--no-progress"), "policy")


def test_deeply_nested_expert_set_config_and_dataset_metadata_are_named_errors(logged, tmp_path):
    payload = torch.load(logged / "experts.pt", weights_only=True)
    config = json.loads(payload["config_json"])
    payload["config_json"] = json.dumps({**config, "info": "@"}).replace('"@"', _nested(100_000))
    torch.save(payload, tmp_path / "nested.pt")
    with pytest.raises(ValidationError) as refused:
        ExpertSet.load(tmp_path / "nested.pt")
    assert refused.value.field == "expert_set.config_json" and "deep" in str(refused.value)

    members = _members_of(logged / "data.npz")
    meta = json.loads(str(members["metadata"]))
    members["metadata"] = np.array(json.dumps({**meta, "extra": "@"}).replace('"@"', _nested(100_000)))
    _write_members(tmp_path / "nested.npz", members)
    with pytest.raises(ValidationError) as refused:
        TrajectoryDataset.load(tmp_path / "nested.npz")
    assert refused.value.field == "metadata" and "deep" in str(refused.value)


def test_json_depth_ignores_brackets_inside_strings():
    from dporl.utils.io import json_depth, parse_json

    assert json_depth('{"a": "[[[[{{{{", "b": [1, [2]]}') == 3
    assert json_depth('["\\\\", ["\\"]]]]"]]') == 2  # an escaped quote does not end the string
    assert json_depth("3") == 0
    assert parse_json('{"a": [[1]]}', "f") == {"a": [[1]]}
    with pytest.raises(ValidationError) as refused:
        parse_json(_nested(65), "f")
    assert refused.value.field == "f"
