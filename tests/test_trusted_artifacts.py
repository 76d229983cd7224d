"""Run directories and artifacts you can trust, checked through the command lines: a reused run directory never
overspends the budget; a changed config never overwrites the data; a crashed release is counted once, with a
write-ahead record; loading a file never runs code; the released model carries no secret; one secret root derives
every random stream; malformed inputs are named errors with nothing written. (The DP-SGD engine's hooks are tested
with the engine.)
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml

from dporl.data.dataset import TrajectoryDataset
from dporl.train.checkpoint import load_checkpoint
from dporl.train.export import load_policy
from dporl.train.run_dir import read_journal
from dporl.utils.validation import ValidationError
from test_expert_cql import M, log_lqr_experts, with_overrides

ROOT = Path(__file__).resolve().parents[1]
# A 128-bit noise seed: what a reproducible release must use, and distinctive enough to search for in files.
SEED = 0x1F2E3D4C5B6A79880123456789ABCDEF


def _cli(name: str):
    spec = importlib.util.spec_from_file_location(f"dporl_{name}_cli", ROOT / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    """test_expert_cql's 600 LQR experts, with two datasets logged under different seeds."""
    return log_lqr_experts(tmp_path_factory.mktemp("logged"), {"a.npz": 0, "b.npz": 1})


def _config(logged: Path, run_dir: Path, *, dataset: str = "a.npz", **overrides) -> dict:
    config = {
        "pipeline": "train",
        "method": "mixed",
        "run_dir": str(run_dir),
        "epsilon": 10.0,
        "delta": 1e-5,
        "batch_size": 16,
        "noise_seed": SEED,
        "data": {"dataset": str(logged / dataset), "expert_set": str(logged / "experts.pt")},
        "release": {"trajectories": 5},
        "dp": {"noise_multiplier": 1.0, "p_dp": 0.5},
        "algorithm": {"name": "cql", "hidden_sizes": [16]},
        "trainer": {"max_steps": 12, "eval_every": 6, "log_every": 6, "checkpoint_every": 6, "journal_every": 4,
                    "progress": False},
        "eval": {"episodes": 2, "num_envs": 2, "max_episode_steps": 30},
    }
    return with_overrides(config, overrides)


def _train(tmp_path: Path, config: dict, *flags: str, name: str = "config.yaml") -> int:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return _cli("train")(["--config", str(path), *flags])


def _files(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------------------- reused run directory
def test_a_reused_run_directory_never_overspends_the_budget(logged, tmp_path, capsys):
    """Failure 1: a directory holding an earlier release (journal, no checkpoint) was reused by a run on another
    dataset, which trained on the old release and printed GUARANTEE (103.8, 1e-5) on a budget of 10."""
    run = tmp_path / "run"
    assert _train(tmp_path, _config(logged, run, epsilon=100.0)) == 0
    for checkpoint in run.rglob("last.pt"):
        checkpoint.unlink()  # as in the report: the earlier run's release is on disk, no checkpoint
    (run / "curator" / "summary.json").unlink()
    before = _files(run)
    capsys.readouterr()

    new = _config(logged, run, dataset="b.npz", epsilon=10.0)
    assert _train(tmp_path, new) == 2  # an existing directory is refused by default
    assert "--resume" in capsys.readouterr().err
    assert _train(tmp_path, new, "--resume") == 2  # nothing of another configuration is ever reused
    error = capsys.readouterr().err
    assert "another configuration" in error and "epsilon: 100.0 -> 10.0" in error and "b.npz" in error
    assert _files(run) == before  # refused before writing anything

    # Same config, dataset file swapped underneath: the content hash names it.
    (logged / "swap.npz").write_bytes((logged / "a.npz").read_bytes())
    first = _config(logged, tmp_path / "run2", dataset="swap.npz")
    assert _train(tmp_path, first) == 0
    (tmp_path / "run2" / "curator" / "summary.json").unlink()
    (logged / "swap.npz").write_bytes((logged / "b.npz").read_bytes())
    capsys.readouterr()
    assert _train(tmp_path, first, "--resume") == 2
    assert "error: inputs.dataset" in capsys.readouterr().err

    # Replacing is explicit; the new run's guarantee is within its own budget.
    assert _train(tmp_path, new, "--overwrite") == 0
    out = capsys.readouterr()
    assert "its journal records spending eps=" in out.err  # the discarded spend is stated, not silently dropped
    guarantee = json.loads((run / "release" / "summary.json").read_text())["privacy"]["guarantee"]
    assert guarantee["epsilon"] <= 10.0 * (1 + 1e-12) and guarantee["delta"] <= 1e-5
    provenance = json.loads((run / "curator" / "provenance.json").read_text())
    assert provenance["inputs"]["dataset"] == TrajectoryDataset.load(logged / "b.npz").fingerprint()


def test_no_state_on_disk_can_raise_the_guarantee_above_the_budget(logged, tmp_path, capsys):
    """Whatever the journal says (here: a forged one with the provenance of this config, a recomputed hash chain
    and a release stage spending eps = 50), a run with budget 10 refuses it rather than print a guarantee above 10."""
    from test_run_directory_integrity import forge

    run = tmp_path / "run"
    config = _config(logged, run, method="dp_sgd", epsilon=10.0)
    assert _train(tmp_path, config) == 0
    forge(run, lambda journal: journal["ledger"]["stages"].insert(0, {
        "name": "release", "budget": [50.0, 5e-6], "mechanism": "pld", "unit": "expert", "delta": 5e-6,
        "analysis": "forged", "accountant": {"mechanism": "pld", "history": [
            [{"type": "ApproxDPEvent", "epsilon": 10.0, "delta": 1e-6}, 5]]}}))
    (run / "curator" / "summary.json").unlink()
    capsys.readouterr()
    assert _train(tmp_path, config, "--resume") == 2
    assert "error: ledger.release.budget" in capsys.readouterr().err


# ------------------------------------------------------------------------------------------- changed config
def test_a_changed_config_never_overwrites_the_data(logged, tmp_path, capsys):
    """Failure 2: with a changed config in an existing directory, data/dataset.npz was overwritten (5000 -> 6000
    episodes) before the run refused."""
    generate = {"experts": {"env_id": "CartPole-v1", "family": "analytic", "n_settings": 4,
                            "candidates_per_setting": 1, "keep_best": 1, "eval_episodes": 1},
                "p_min": 0.1, "trajectories_per_expert": 2, "max_episode_steps": 20, "seed": 7, "progress": False}
    base = {**_config(logged, tmp_path / "run", method="non_private"), "data": {"generate": generate}}
    assert _train(tmp_path, base) == 0
    data = tmp_path / "run" / "curator" / "data" / "dataset.npz"
    assert TrajectoryDataset.load(data).n_episodes == 8
    before = _files(tmp_path / "run")
    changed = {**base, "data": {"generate": {**generate, "trajectories_per_expert": 3}}}
    capsys.readouterr()
    for flags in ((), ("--resume",)):
        assert _train(tmp_path, changed, *flags) == 2
        assert _files(tmp_path / "run") == before  # the data (and everything else) untouched
    assert "data.generate.trajectories_per_expert: 2 -> 3" in capsys.readouterr().err
    assert _train(tmp_path, changed, "--overwrite") == 0  # explicit replacement regenerates
    assert TrajectoryDataset.load(data).n_episodes == 12

    # A generation directory shared by several runs is reused when it holds this very generation, refused otherwise.
    shared = {**generate, "out_dir": str(tmp_path / "shared")}
    assert _train(tmp_path, {**base, "run_dir": str(tmp_path / "r1"), "data": {"generate": shared}}) == 0
    stamp = _files(tmp_path / "shared")
    assert _train(tmp_path, {**base, "run_dir": str(tmp_path / "r2"), "data": {"generate": shared}}) == 0
    assert _files(tmp_path / "shared") == stamp  # reused, not regenerated
    other = {**shared, "seed": 8}
    capsys.readouterr()
    assert _train(tmp_path, {**base, "run_dir": str(tmp_path / "r3"), "data": {"generate": other}}) == 2
    assert "error: data.generate.out_dir" in capsys.readouterr().err
    assert _files(tmp_path / "shared") == stamp and not (tmp_path / "r3").exists()


# ----------------------------------------------------------------------------------------- crash and resume
@pytest.mark.parametrize("crash_on", ["release.json", "release_runs.json"])
def test_a_crashed_release_is_counted_once_and_never_repeated(logged, tmp_path, monkeypatch, capsys,
                                                               crash_on):
    """Failure 3 (release): a crash between writing D_stable and the ledger produced two releases, of which the
    ledger counted one. The release's events are journaled before any query; a resumed run that finds an
    authorised, unfinished release refuses a second one, and reuses it only when its released files were all
    written (D_stable and release.json; the curator's release_runs.json is diagnostics)."""
    import dporl.utils.io as io

    run = tmp_path / "run"
    config = _config(logged, run)
    original = io.atomic_write_json

    def crash_on_the_record(path, payload):  # after D_stable, before the release is marked complete
        if Path(path).name == crash_on:
            raise RuntimeError("killed while writing the release")
        return original(path, payload)

    monkeypatch.setattr(io, "atomic_write_json", crash_on_the_record)
    with pytest.raises(RuntimeError, match="killed"):
        _train(tmp_path, config)
    monkeypatch.setattr(io, "atomic_write_json", original)
    assert (run / "release" / "d_stable.npz").exists()
    count, stage = read_journal(run / "curator" / "journal.json").report().stages
    assert count.name == "unit_count"  # the count came first, and was completed
    assert stage.name == "release" and sum(count for _, count in stage.events) == 5  # T runs, journaled first
    before = _files(run)
    capsys.readouterr()
    if crash_on == "release.json":  # the release's public summary was never written: refused, nothing changes
        assert _train(tmp_path, config, "--resume") == 2
        assert "error: release: an earlier attempt of this run authorised the stable-prefix release" in \
            capsys.readouterr().err
        assert _files(run) == before  # no second release
        return
    assert _train(tmp_path, config, "--resume") == 0
    assert "reusing it (charged once, never run again)" in capsys.readouterr().err
    assert (run / "release" / "d_stable.npz").read_bytes() == before[run / "release" / "d_stable.npz"]
    stages = {s.name: s for s in read_journal(run / "curator" / "journal.json").report().stages}
    assert sum(count for _, count in stages["release"].events) == 5  # charged once


def test_a_crash_then_another_noise_multiplier_charges_the_journal_as_recorded(logged, tmp_path, capsys):
    """Failure 3 (training): after a crash before the first checkpoint, a re-run with another sigma charged the
    authorised steps at the NEW event (245 steps at sigma 3 reported as eps 0.216). Now another sigma is another
    configuration (refused); the same one resumes, charging every authorised step at the event it was authorised."""
    from dporl.privacy.events import PoissonGaussianEvent

    run = tmp_path / "run"
    config = _config(logged, run, method="dp_sgd", **{"dp.noise_multiplier": 3.0, "trainer.checkpoint_every": 1000})
    import dporl.algos.cql as cql

    original = cql.DiscreteCQLModule.on_step_end

    def crash(self, step):
        if step == 9:
            raise RuntimeError("crash before the first checkpoint")
        return original(self, step)

    cql.DiscreteCQLModule.on_step_end = crash
    try:
        with pytest.raises(RuntimeError, match="crash"):
            _train(tmp_path, config)
    finally:
        cql.DiscreteCQLModule.on_step_end = original
    # A checkpoint before every journal block: the one before the block holding step 9.
    assert load_checkpoint(run / "curator" / "checkpoints" / "last.pt")["step"] == 8
    journaled = read_journal(run / "curator" / "journal.json").stages["train"].accountant.history
    sigma3 = PoissonGaussianEvent(3.0, 16 / M)
    assert journaled == [(sigma3, 12)]  # steps 1-9 ran inside blocks of 4: 12 authorised
    before = _files(run)
    capsys.readouterr()
    assert _train(tmp_path, {**config, "dp": {**config["dp"], "noise_multiplier": 1.0}}, "--resume") == 2
    assert "dp.noise_multiplier: 3.0 -> 1.0" in capsys.readouterr().err
    assert _files(run) == before
    assert _train(tmp_path, config, "--resume") == 0
    history = read_journal(run / "curator" / "journal.json").stages["train"].accountant.history
    assert history == [(sigma3, 12)]  # the 12 authorised steps were all the budget left (trainer.max_steps = 12)
    assert load_checkpoint(run / "curator" / "checkpoints" / "last.pt")["step"] == 12  # and all of them trained


# -------------------------------------------------------------------------------------------- loading files
class _Payload:
    """Unpickling this creates a file: the stand-in for arbitrary code in a hostile checkpoint."""

    def __init__(self, marker: Path):
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def test_loading_a_file_never_runs_code(logged, tmp_path, capsys):
    """Failure 4: evaluate.py on a checkpoint with a pickle payload executed it, and so did train.py through
    release/ledger.pt (fnq's released.pt too)."""
    marker = tmp_path / "pwned"
    evil = tmp_path / "evil.pt"
    torch.save({"format": 2, "pipeline": "train", "payload": _Payload(marker)}, evil)

    assert _cli("evaluate")(["--checkpoint", str(evil)]) == 2
    assert "error: checkpoint" in capsys.readouterr().err and not marker.exists()

    run = tmp_path / "run"
    config = _config(logged, run, method="non_private")
    assert _train(tmp_path, config) == 0
    (run / "curator" / "summary.json").unlink()
    for place in (run / "release" / "ledger.pt", run / "checkpoints" / "last.pt", run / "curator" / "checkpoints" / "last.pt"):
        place.parent.mkdir(parents=True, exist_ok=True)
        torch.save({"format": 2, "payload": _Payload(marker)}, place)
    capsys.readouterr()
    assert _train(tmp_path, config) == 2 and _train(tmp_path, config, "--resume") == 2
    assert "error: checkpoint" in capsys.readouterr().err and not marker.exists()

    torch.save(_Payload(marker), run / "release" / "policy" / "weights.pt")
    assert _cli("evaluate")(["--run", str(run), "--episodes", "1"]) == 2
    assert not marker.exists()

    from dporl.algos.fnq import load_noisy_q

    torch.save({"spec": {}, "state_dict": {}, "metadata": _Payload(marker)}, tmp_path / "released.pt")
    with pytest.raises(ValidationError, match="released"):
        load_noisy_q(tmp_path / "released.pt")
    assert not marker.exists()


def test_no_unsafe_loader_remains_in_the_tree():
    """No ``weights_only=False``, no unpickling, no ``allow_pickle=True`` anywhere in the library or the CLIs."""
    offenders = []
    for path in [*ROOT.glob("dporl/**/*.py"), ROOT / "train.py", ROOT / "evaluate.py", *ROOT.glob("benchmarks/*.py")]:
        text = path.read_text()
        for needle in ("weights_only=False", "allow_pickle=True", "pickle.load", "pickle.loads"):
            if needle in text:
                offenders.append(f"{path.relative_to(ROOT)}: {needle}")
    assert offenders == []


# ----------------------------------------------------------------------------------- secrets in the release
def _secret_byte_windows(checkpoint: dict) -> list[bytes]:
    """16-byte windows of every secret generator state a checkpoint holds (MT19937 words and their neighbours)."""
    states = [checkpoint["rng"]["sampler"], checkpoint["rng"]["noise"]["generator"]]
    windows = []
    for state in states:
        raw = state.numpy().tobytes()
        windows += [raw[i : i + 16] for i in range(24, 24 + 8 * 624, 8 * 52)]  # 12 windows across the state words
    return windows


def test_the_release_carries_no_secret(logged, tmp_path, capsys):
    """Failure 5: the only model artifact was a checkpoint storing the secret generator states (its first bytes
    were the noise seed) and the DP noise stream was regenerated from it. Now release/ holds weights and JSON only;
    no byte of the noise seed or of any secret stream's state appears in any file under release/."""
    run = tmp_path / "run"
    assert _train(tmp_path, _config(logged, run)) == 0
    release = run / "release"
    policy = load_policy(release / "policy")  # plain weights, weights-only
    assert torch.load(release / "policy" / "weights.pt", weights_only=True).keys() == policy.network.state_dict().keys()
    checkpoint = load_checkpoint(run / "curator" / "checkpoints" / "last.pt")
    secrets = [SEED.to_bytes(16, "little"), SEED.to_bytes(16, "little")[:8], str(SEED).encode(), hex(SEED).encode()]
    secrets += _secret_byte_windows(checkpoint)
    leaked = [(path.relative_to(run), secret.hex()[:16]) for path, data in _files(release).items()
              for secret in secrets if secret in data]
    assert leaked == []
    for path in release.rglob("*.pt"):
        if path.suffix == ".pt" and "torchscript" not in path.name:
            tensors = torch.load(path, weights_only=True)
            assert all(t.dtype != torch.uint8 for t in tensors.values())  # no generator state (uint8) at all
    # The curator side does hold the states (a checkpoint must, to resume); the test above is not vacuous.
    assert any(window in (run / "curator" / "checkpoints" / "last.pt").read_bytes()
               for window in _secret_byte_windows(checkpoint))
    assert "noise_seed" not in (release / "summary.json").read_text()


# ---------------------------------------------------------------------------------------- secret randomness
def test_one_root_derives_every_secret_stream_and_seeds_reproduce_exactly(logged, tmp_path, monkeypatch):
    """Failure 6: secret seeds carried 32 bits (s and s + 2^32 collided), the release's expert choice and the
    trainer's sampler were seeded alike, and seeds were derived three ways. Now one SecretRoot per run hands out one
    named stream per mechanism; a fixed noise_seed reproduces the run exactly; s and s + 2^32 differ."""
    from dporl.privacy.randomness import SecretRoot

    handed_out = []
    original = SecretRoot.sequence

    def record(self, name):
        handed_out.append((id(self), name))
        return original(self, name)

    monkeypatch.setattr(SecretRoot, "sequence", record)
    seed = 5
    assert _train(tmp_path, _config(logged, tmp_path / "a", noise_seed=seed)) == 0
    roots = {root for root, _ in handed_out}
    names = [name for _, name in handed_out]
    assert len(roots) == 1 and sorted(names) == ["release/actions", "release/env", "release/expert_choice",
                                                 "release/laplace", "train/noise", "train/sampler",
                                                 "unit_count/noise"]
    monkeypatch.setattr(SecretRoot, "sequence", original)

    assert _train(tmp_path, _config(logged, tmp_path / "b", noise_seed=seed)) == 0
    assert _train(tmp_path, _config(logged, tmp_path / "c", noise_seed=seed + 2**32)) == 0

    def outputs(run):
        weights = torch.load(run / "release" / "policy" / "weights.pt", weights_only=True)
        choice = json.loads((run / "curator" / "release_runs.json").read_text())["run_experts"]
        return weights, choice, (run / "release" / "d_stable.npz").read_bytes()

    (wa, ca, da), (wb, cb, db), (wc, cc, dc) = outputs(tmp_path / "a"), outputs(tmp_path / "b"), outputs(tmp_path / "c")
    assert ca == cb and all(torch.equal(wa[k], wb[k]) for k in wa)  # a fixed noise_seed reproduces the run exactly
    assert TrajectoryDataset.load(tmp_path / "a" / "release" / "d_stable.npz").fingerprint() == \
        TrajectoryDataset.load(tmp_path / "b" / "release" / "d_stable.npz").fingerprint()
    # s + 2^32: another expert choice (5 runs over 600 experts: equal by chance with probability < 1e-12).
    assert ca != cc and not all(torch.equal(wa[k], wc[k]) for k in wa)


# ----------------------------------------------------------------------------------------- malformed inputs
def _without_config_json(logged: Path, tmp_path: Path) -> Path:
    payload = torch.load(logged / "experts.pt", weights_only=True)
    del payload["config_json"]
    torch.save(payload, tmp_path / "experts_no_config.pt")
    return tmp_path / "experts_no_config.pt"


def _huge_n_actions(logged: Path, tmp_path: Path) -> Path:
    with np.load(logged / "a.npz", allow_pickle=False) as archive:
        arrays = {k: archive[k] for k in archive.files}
    meta = json.loads(str(arrays["metadata"]))
    meta["n_actions"] = 10**12
    arrays["metadata"] = np.array(json.dumps(meta))
    with open(tmp_path / "huge.npz", "wb") as handle:
        np.savez(handle, **arrays)
    return tmp_path / "huge.npz"


MALFORMED = {
    "unknown evaluation env": (lambda c, logged, tmp: {**c, "eval": {**c["eval"], "env_id": "NoSuchEnv-v9"}},
                               "eval.env_id"),
    "expert set without config_json": (
        lambda c, logged, tmp: {**c, "data": {**c["data"], "expert_set": str(_without_config_json(logged, tmp))}},
        "expert_set.config_json"),
    "n_actions = 1e12": (lambda c, logged, tmp: {**c, "data": {**c["data"], "dataset": str(_huge_n_actions(logged, tmp))}},
                         "metadata.n_actions"),
    "absurd hidden sizes": (lambda c, logged, tmp: {**c, "algorithm": {"name": "cql", "hidden_sizes": [10**10, 10**10]}},
                            "algorithm.hidden_sizes[0]"),
    "absurd parameter count": (lambda c, logged, tmp: {**c, "algorithm": {"name": "cql", "hidden_sizes": [60000] * 64}},
                               "algorithm.hidden_sizes"),
    "cuda on a CPU build": (lambda c, logged, tmp: {**c, "trainer": {**c["trainer"], "device": "cuda"}},
                            "trainer.device"),
    "unknown device": (lambda c, logged, tmp: {**c, "trainer": {**c["trainer"], "device": "gpu"}}, "trainer.device"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_malformed_inputs_are_named_errors_and_nothing_is_written(logged, tmp_path, capsys, case):
    """Failure 7: each of these crashed with a traceback (or tried to allocate a petabyte)."""
    if case == "cuda on a CPU build" and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    make, field = MALFORMED[case]
    config = make(_config(logged, tmp_path / "run"), logged, tmp_path)
    assert _train(tmp_path, config) == 2
    error = capsys.readouterr().err
    assert error.startswith(f"error: {field}"), error
    assert not (tmp_path / "run").exists()


def test_a_checkpoint_that_does_not_match_and_a_garbage_journal(logged, tmp_path, capsys):
    run = tmp_path / "run"
    config = _config(logged, run, method="dp_sgd")
    assert _train(tmp_path, config) == 0
    (run / "curator" / "summary.json").unlink()
    path = run / "curator" / "checkpoints" / "last.pt"
    checkpoint = torch.load(path, weights_only=True)
    checkpoint["algorithm"]["q_network.0.weight"] = torch.zeros(3, 3)  # provenance intact, weights do not fit
    torch.save(checkpoint, path)
    before = _files(run)
    capsys.readouterr()
    assert _train(tmp_path, config, "--resume") == 2
    assert capsys.readouterr().err.startswith("error: checkpoint.algorithm")
    assert _files(run) == before

    (run / "curator" / "journal.json").write_text('{"format": "dporl-privacy-journal", "version": 2, "ledger": 7}')
    before = _files(run)
    assert _train(tmp_path, config, "--resume") == 2
    assert capsys.readouterr().err.startswith("error: journal")
    assert _files(run) == before
