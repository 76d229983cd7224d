"""``dporl.pipelines.sweep --from-runs``: re-tabulating earlier sweeps' runs.csv files without running anything."""

import csv
import math

import pytest

from dporl.pipelines.sweep import SweepConfig, _write_outputs, main, read_runs, summarise, tabulate
from dporl.utils.config import from_dict
from dporl.utils.validation import ValidationError


def _row(method, eps, seed, ret, guarantee=math.nan):
    return {"method": method, "epsilon": eps, "seed": seed, "return": ret, "final_return": ret,
            "guarantee_epsilon": guarantee, "guarantee_delta": 1e-5, "steps": 100,
            "stable_transitions": 7 if method in ("mixed", "stable_only") else None, "error": None}


def _sweep(tmp_path, name, rows, methods=("non_private", "dp_sgd", "mixed"), epsilons=(10.0, 1.0)):
    config = from_dict(SweepConfig, {"methods": list(methods), "epsilons": list(epsilons), "seeds": [0, 1],
                                     "out_dir": str(tmp_path / name), "progress": False})
    _write_outputs(tmp_path / name, rows, summarise(rows, config), config)
    return config, tmp_path / name / "runs.csv"


def test_later_runs_replace_earlier_cells_and_round_trip(tmp_path):
    old = [_row("non_private", None, s, 500.0 + s) for s in (0, 1)]
    old += [_row(m, e, s, 100.0 * e + s, 0.7 * e) for m in ("dp_sgd", "mixed") for e in (10.0, 1.0) for s in (0, 1)]
    config, old_csv = _sweep(tmp_path, "old", old)
    new = [_row("mixed", e, s, 50.0 * e + 10 * s, e) for e in (10.0, 1.0) for s in (0, 1)]
    new.append(_row("mixed", 7.5, 0, -1.0, 7.5))  # outside the grid below: dropped
    _, new_csv = _sweep(tmp_path, "new", new, methods=("mixed",), epsilons=(10.0, 7.5, 1.0))

    # the CSV round-trips every field, None and nan included (repr: nan != nan)
    assert repr(read_runs([old_csv], config)) == repr(old)
    merged = from_dict(SweepConfig, {**vars(config), "out_dir": str(tmp_path / "merged")})
    table = {(e["method"], e["epsilon"]): e for e in tabulate(merged, [old_csv, new_csv])["table"]}
    # a two-seed mean is exact arithmetic here: (500 + 10*s) for s in {0, 1} -> 505 at eps 10
    assert table["mixed", 10.0]["return_mean"] == pytest.approx(505.0)
    assert table["mixed", 10.0]["guarantee_epsilon"] == pytest.approx(10.0)  # the new runs' guarantee, not 7.0
    assert table["dp_sgd", 1.0]["return_mean"] == pytest.approx(100.5)  # untouched cells come from the old file
    assert table["non_private", 1.0]["return_mean"] == pytest.approx(500.5)
    with open(tmp_path / "merged" / "runs.csv") as f:
        assert len(list(csv.DictReader(f))) == 2 + 8  # non_private once per seed, 2 methods x 2 eps x 2 seeds
    assert (tmp_path / "merged" / "return_vs_epsilon.png").stat().st_size > 0


def test_bad_runs_files_are_refused_by_field(tmp_path, capsys):
    config = from_dict(SweepConfig, {"out_dir": str(tmp_path / "out"), "progress": False})
    bad = tmp_path / "bad.csv"
    bad.write_text("method,epsilon\nmixed,10\n")
    with pytest.raises(ValidationError, match="from_runs.*missing columns"):
        tabulate(config, [bad])
    _, good = _sweep(tmp_path, "good", [_row("mixed", 10.0, 0, 1.0, 10.0)], methods=("mixed",), epsilons=(10.0,))
    text = good.read_text().replace("mixed,10.0", "mixed,")
    bad.write_text(text)
    with pytest.raises(ValidationError, match="from_runs.*epsilon"):
        tabulate(config, [bad])
    config_path = tmp_path / "sweep.yaml"
    config_path.write_text(f"out_dir: {tmp_path / 'out'}\nprogress: false\n")
    assert main(["--config", str(config_path), "--from-runs", str(tmp_path / "absent.csv")]) == 2
    assert "from_runs" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()  # nothing half-written
