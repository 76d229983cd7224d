import os

import pytest

from dporl.utils.io import atomic_write, atomic_write_json, atomic_write_text


def test_atomic_write_replaces_whole_file(tmp_path):
    target = tmp_path / "sub" / "f.txt"
    atomic_write_text(target, "first")
    atomic_write_text(target, "second")
    assert target.read_text() == "second"
    assert os.listdir(target.parent) == ["f.txt"]


def test_failed_write_leaves_old_file_and_no_temporary(tmp_path):
    target = tmp_path / "f.json"
    atomic_write_json(target, {"a": 1})

    def explode(tmp):
        tmp.write_text("partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError):
        atomic_write(target, explode)
    assert target.read_text().strip().startswith("{")
    assert sorted(os.listdir(tmp_path)) == ["f.json"]


def test_failed_first_write_leaves_nothing(tmp_path):
    target = tmp_path / "new.bin"
    with pytest.raises(ValueError):
        atomic_write(target, lambda tmp: (_ for _ in ()).throw(ValueError("boom")))
    assert os.listdir(tmp_path) == []
