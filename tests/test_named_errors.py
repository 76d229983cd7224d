"""Every fault is a named error (exit 2, the field on stderr, no traceback) and leaves nothing half-written.

A full disk (a real tmpfs where the test may mount one, an injected ENOSPC otherwise), a generation environment that
does not exist, a symlinked run directory under ``--overwrite``, inputs inside the run directory ``--overwrite``
would delete, an example table too small for a unit-level guarantee, a delta no guarantee can use, and accountant
calls whose grids would explode.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
import sys
import tracemalloc
import uuid
from pathlib import Path

import pytest
import torch
import yaml

from dporl.utils.validation import ValidationError
from test_expert_cql import log_lqr_experts

MIB = 1 << 20


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    return log_lqr_experts(tmp_path_factory.mktemp("logged"), {"data.npz": 0})


def _config(logged: Path, run_dir: Path, **sections) -> dict:
    config = {
        "pipeline": "train", "method": "dp_sgd", "run_dir": str(run_dir), "epsilon": 10.0, "delta": 1e-5,
        "batch_size": 16, "noise_seed": 1,
        "data": {"dataset": str(logged / "data.npz")},
        "algorithm": {"name": "cql", "hidden_sizes": [8]},
        "trainer": {"max_steps": 4, "eval_every": 4, "log_every": 4, "checkpoint_every": 4, "progress": False},
        "eval": {"enabled": False, "offline": {"estimator": "none"}},  # no evaluation: these runs test their files
    }
    for key, value in sections.items():
        section, _, name = key.partition("__")
        if name:
            config[section] = {**config.get(section, {}), name: value}
        else:
            config[key] = value
    return config


def _train(cwd: Path, config: dict, *flags: str) -> subprocess.CompletedProcess:
    path = cwd / f"config-{uuid.uuid4().hex[:8]}.yaml"
    path.write_text(yaml.safe_dump(config))
    return subprocess.run([sys.executable, "-m", "dporl", "train", "--config", str(path), *flags], cwd=cwd,
                          capture_output=True, text=True, timeout=600)


def _refused(result: subprocess.CompletedProcess, field: str) -> None:
    assert result.returncode == 2, result.stdout + result.stderr
    assert f"error: {field}" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


def _temporary_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if ".tmp" in p.name]


# ------------------------------------------------------------------------------------------------ disk full
class _FullDisk:
    """A file object that accepts ``room`` bytes, then fails every write with ENOSPC (like a full file system)."""

    def __init__(self, handle, room: int):
        self.handle, self.room = handle, room

    def write(self, data) -> int:
        if len(data) > self.room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self.room -= len(data)
        return self.handle.write(data)

    def __getattr__(self, name):
        return getattr(self.handle, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.close()


@pytest.mark.parametrize("room", [0, 700])
def test_a_full_disk_during_torch_save_is_a_named_error_and_leaves_no_temporary_file(tmp_path, monkeypatch, room):
    """torch.save on a full disk fails inside its C++ zip writer ("unexpected pos"); the writer goes through a
    Python file object so the ENOSPC it hit is known, named, and the temporary file removed."""
    from dporl.train.checkpoint import save_checkpoint
    from dporl.utils import io

    target = tmp_path / "curator" / "checkpoints" / "last.pt"
    real_open = open
    monkeypatch.setattr(io, "open", lambda path, mode="r", *a, **k: (
        _FullDisk(real_open(path, mode, *a, **k), room) if "w" in mode else real_open(path, mode, *a, **k)),
        raising=False)
    payload = {"pipeline": "p", "config_sha256": "0", "step": 1, "budget_steps": 2, "algorithm": {"w": torch.ones(512)},
               "optimizer": {}, "scheduler": {}, "eval_history": [], "rng": {}, "journal": {"seq": 0, "charged": {}}}
    with pytest.raises(io.DiskFullError) as refused:
        save_checkpoint(target, payload)
    assert refused.value.field == "disk" and "last.pt" in str(refused.value)
    assert list(target.parent.iterdir()) == []


def test_a_full_disk_in_a_json_or_npz_writer_keeps_the_old_file(tmp_path, monkeypatch):
    import numpy as np

    from dporl.utils import io

    io.atomic_write_json(tmp_path / "journal.json", {"old": True})

    def full(tmp):
        tmp.write_text("half")
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    with pytest.raises(io.DiskFullError):
        io.atomic_write(tmp_path / "journal.json", full)
    def npz_then_full(tmp):
        with open(tmp, "wb") as handle:
            np.savez(handle, a=np.zeros(3))
        full(tmp)

    with pytest.raises(io.DiskFullError):
        io.atomic_write(tmp_path / "d_stable.npz", npz_then_full, suffix=".npz")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["journal.json"]
    assert io.read_json(tmp_path / "journal.json", "journal") == {"old": True}


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 96 KiB tmpfs mounted for the test (root with mount permission only; skipped elsewhere)."""
    mount = tmp_path / "tmpfs"
    mount.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    done = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(mount)], capture_output=True)
    if done.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], capture_output=True)


def test_a_run_on_a_full_file_system_is_a_named_error_with_no_temporary_file_left(logged, tmp_path, tiny_tmpfs):
    run = tiny_tmpfs / "run"
    result = _train(tmp_path, _config(logged, run, algorithm__hidden_sizes=[256, 256], trainer__max_steps=8,
                                      trainer__checkpoint_every=2))
    _refused(result, "disk")
    assert _temporary_files(tiny_tmpfs) == []


# ------------------------------------------------------------------------------------------------ configs
def test_a_generation_environment_that_does_not_exist_is_named_before_anything_is_written(logged, tmp_path):
    config = _config(logged, tmp_path / "run", data={"generate": {"experts": {"env_id": "NoSuchEnv-v0"}}})
    _refused(_train(tmp_path, config), "data.generate.experts.env_id")
    assert not (tmp_path / "run").exists()


def test_an_example_table_too_small_names_the_field_and_its_range(logged, tmp_path):
    config = _config(logged, tmp_path / "run", data={"format": "table", "example": {"units": 1}})
    result = _train(tmp_path, config)
    _refused(result, "data.example.units")
    assert "[2, 1000000]" in result.stderr and not (tmp_path / "run").exists()


def test_a_delta_no_guarantee_can_use_is_refused_at_once(logged, tmp_path):
    """delta = 0.5 was accepted and then hung in PLD composition; it is refused by name before any work."""
    _refused(_train(tmp_path, _config(logged, tmp_path / "run", delta=0.5)), "delta")
    assert not (tmp_path / "run").exists()


def test_accountant_calls_on_tiny_noise_answer_without_building_huge_grids():
    """A noise multiplier of 0.001 asks dp_accounting for a ~1e9-point grid (GBs, minutes): the analyses size grids
    before building them and answer with the RDP bound instead (also an upper bound) and a small allocation."""
    from dporl.privacy.accountants import epsilon_for
    from dporl.privacy.calibration import calibrate_noise_multiplier
    from dporl.privacy.events import MixtureEvent, PoissonGaussianEvent

    tiny = PoissonGaussianEvent(1e-3, 0.25)
    for mechanism in ("rdp", "pld", "prv"):  # the analyses' imports are not what is measured
        epsilon_for([(PoissonGaussianEvent(1.0, 0.25), 2)], 1e-5, mechanism)
    tracemalloc.start()
    try:
        rdp = epsilon_for([(tiny, 60)], 1e-5, "rdp")
        assert epsilon_for([(tiny, 60)], 1e-5, "pld") == pytest.approx(rdp)
        assert epsilon_for([(tiny, 60)], 1e-5, "prv") == pytest.approx(rdp)
        assert epsilon_for([(MixtureEvent(0.1, tiny), 2000)], 1e-5, "pld") > 0
        # a calibration still finds the noise a budget needs, every answer checked by the accountant
        sigma = calibrate_noise_multiplier(1.0, 1e-5, 100, make_event=lambda s: PoissonGaussianEvent(s, 0.05),
                                           mechanism="pld")
        assert epsilon_for([(PoissonGaussianEvent(sigma, 0.05), 100)], 1e-5, "pld") <= 1.0
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 256 * MIB, peak
    with pytest.raises(ValidationError) as refused:
        epsilon_for([(tiny, 1)], 0.5, "pld")
    assert refused.value.field == "delta"


def test_grids_are_sized_from_the_event_before_they_are_built():
    from dporl.privacy.events import LaplaceEvent, MixtureEvent, PoissonGaussianEvent, ReplaceOneEvent
    from dporl.privacy.pld import COARSEST, event_pld, event_points, history_interval
    from dporl.privacy.pld_fft import plan_self_composition, self_compose_planned

    for event in (PoissonGaussianEvent(0.3, 0.25), PoissonGaussianEvent(2.0, 1.0), MixtureEvent(0.1, PoissonGaussianEvent(
            0.5, 0.1)), LaplaceEvent(0.05), ReplaceOneEvent(PoissonGaussianEvent(0.7, 0.05)),
            ReplaceOneEvent(LaplaceEvent(0.5))):
        interval = history_interval([event])  # the adaptive grid the event is analysed on
        built = event_pld(event, interval)
        assert max(built._pmf_remove.size, built._pmf_add.size) <= event_points(event, interval)  # an upper bound
    event = PoissonGaussianEvent(0.3, 0.25)
    single = event_pld(event, history_interval([event]))
    for pmf in (single._pmf_remove, single._pmf_add):
        sizes = [plan_self_composition(pmf, count)[2] for count in (1, 2, 10, 200, 201, 5000)]
        assert sizes == sorted(sizes)  # never smaller at a larger count: refusals are monotone in counts
        dense, window, predicted = plan_self_composition(pmf, 200)
        exact = self_compose_planned(dense, 200, window)
        assert exact.size <= predicted <= 1.01 * exact.size + 3
    assert event_points(PoissonGaussianEvent(1e-3, 0.25), COARSEST) > 0.5 / 1e-6 / COARSEST


# ------------------------------------------------------------------------------------------------ --overwrite
def test_overwrite_never_deletes_through_a_symlinked_run_directory(logged, tmp_path):
    real = tmp_path / "real"
    assert _train(tmp_path, _config(logged, real)).returncode == 0
    before = sorted(p.relative_to(real) for p in real.rglob("*"))
    (tmp_path / "link").symlink_to(real, target_is_directory=True)
    _refused(_train(tmp_path, _config(logged, tmp_path / "link"), "--overwrite"), "run_dir")
    assert sorted(p.relative_to(real) for p in real.rglob("*")) == before


@pytest.mark.parametrize("inside", ["dataset", "expert_set"])
def test_overwrite_refuses_to_delete_an_input_that_lives_in_the_run_directory(logged, tmp_path, inside):
    run = tmp_path / "run"
    assert _train(tmp_path, _config(logged, run)).returncode == 0
    source = logged / ("data.npz" if inside == "dataset" else "experts.pt")
    moved = run / "curator" / source.name
    shutil.copy(source, moved)
    data = {"dataset": str(moved if inside == "dataset" else source)}
    if inside == "expert_set":
        data["expert_set"] = str(moved)
    before = sorted(run.rglob("*"))
    _refused(_train(tmp_path, _config(logged, run, data=data), "--overwrite"), f"data.{inside}")
    assert moved.is_file() and sorted(run.rglob("*")) == before


def test_overwrite_still_regenerates_a_generation_inside_the_run_directory(tmp_path):
    """Generated data inside the run directory are the run's own output: --overwrite regenerates them."""
    config = {
        "pipeline": "train", "method": "dp_sgd", "run_dir": str(tmp_path / "run"), "epsilon": 10.0,
        "delta": 1e-5, "batch_size": 2, "count_fraction": 0.5, "noise_seed": 1,  # 8 experts: a sharp count
        "data": {"generate": {"experts": {"env_id": "CartPole-v1", "family": "analytic", "points_per_axis": 2,
                                          "candidates_per_setting": 1, "keep_best": 1, "eval_episodes": 1},
                              "trajectories_per_expert": 1, "max_episode_steps": 20, "progress": False}},
        "algorithm": {"name": "cql", "hidden_sizes": [8]},
        "trainer": {"max_steps": 2, "eval_every": 2, "log_every": 2, "checkpoint_every": 2, "progress": False},
        "eval": {"enabled": False, "offline": {"estimator": "none"}},
    }
    assert _train(tmp_path, config).returncode == 0
    result = _train(tmp_path, config, "--overwrite")
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "run" / "curator" / "data" / "dataset.npz").is_file()
