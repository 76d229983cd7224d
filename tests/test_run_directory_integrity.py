"""A run directory cannot be turned against its user or the budget: one process per run directory; a journal
that is missing, damaged, rolled back or edited down is refused by name before anything is spent again; artifacts
and the journal vouch for each other; a refused run leaves no directory; an interrupt loses no paid step."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from dporl import cli
from dporl.algos.cql import DiscreteCQLModule
from dporl.train.checkpoint import load_checkpoint
from dporl.train.run_dir import RunDirectory, read_journal
from dporl.utils.validation import ValidationError

ROOT = Path(__file__).resolve().parents[1]
STEPS = 60


@pytest.fixture(scope="module")
def logged(tmp_path_factory):
    from test_expert_cql import log_lqr_experts

    return log_lqr_experts(tmp_path_factory.mktemp("logged"), {"data.npz": 0})


def write_config(logged: Path, directory: Path, **trainer) -> Path:
    """A small train run (Algorithm 3: a stable-prefix release of T = 5 runs, then 60 mixed steps) with a
    secret noise seed, as a YAML file; data outside the run directory."""
    config = {
        "pipeline": "train", "method": "mixed", "run_dir": str(directory / "run"), "epsilon": 10.0,
        "delta": 1e-5, "batch_size": 16,
        "data": {"dataset": str(logged / "data.npz"), "expert_set": str(logged / "experts.pt")},
        "release": {"trajectories": 5}, "dp": {"noise_multiplier": 1.0, "p_dp": 0.5}, "algorithm": {"name": "cql", "hidden_sizes": [16]},
        "trainer": {"max_steps": STEPS, "journal_every": 10, "eval_every": 1000, "log_every": 10,
                    "checkpoint_every": 1000, "progress": False, **trainer},
        "eval": {"episodes": 2, "num_envs": 2, "max_episode_steps": 50},
    }
    path = directory / "config.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


# Subprocesses train on one thread each: on a shared machine, torch's thread pool stalls on tiny networks.
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}


def train(config: Path, *extra: str) -> int:
    return cli.main(["train", "--config", str(config), *extra])


def crash_at(monkeypatch, step: int) -> None:
    """The next run raises after optimizer step ``step`` (as a crash would stop it)."""
    original = DiscreteCQLModule.on_step_end

    def crashing(self, done):
        original(self, done)
        if done == step:
            raise RuntimeError(f"injected crash after step {step}")

    monkeypatch.setattr(DiscreteCQLModule, "on_step_end", crashing)


def crashed_run(logged, tmp_path, monkeypatch, step: int = 45) -> Path:
    config = write_config(logged, tmp_path)
    crash_at(monkeypatch, step)
    with pytest.raises(RuntimeError, match="injected crash"):
        train(config)
    monkeypatch.undo()
    return config


def charged(run: Path) -> dict[str, int]:
    ledger = read_journal(run / "curator" / "journal.json")
    return {name: len(stage.accountant) for name, stage in ledger.stages.items()}


def released_bytes(run: Path) -> dict[str, bytes]:
    return {name: (run / "release" / name).read_bytes() for name in ("d_stable.npz", "release.json")}


def forge(run: Path, edit) -> None:
    """Edit the journal the way a careful forger would: change the state, then recompute its chain link and the
    head provenance.json copies (what a plain text-editor edit leaves inconsistent)."""
    path, provenance_path = run / "curator" / "journal.json", run / "curator" / "provenance.json"
    journal = json.loads(path.read_text())
    edit(journal)
    chain = journal.pop("chain", None)
    if chain is not None:  # (a journal without a chain needs no forging)
        from dporl.train.journal_file import record_hash as _record_hash

        chain["hash"] = _record_hash(chain["prev"], journal)
        journal["chain"] = chain
        provenance = json.loads(provenance_path.read_text())
        provenance["journal"] = {**provenance["journal"], "seq": chain["seq"], "hash": chain["hash"]}
        provenance_path.write_text(json.dumps(provenance))
    path.write_text(json.dumps(journal))


def stage_entry(journal: dict, name: str) -> dict:
    return next(s for s in journal["ledger"]["stages"] if s["name"] == name)


# ------------------------------------------------------------------------------------------------ one process
# Two `dporl train` processes, imports done, each waiting for the same go file: they start the run together.
READY_THEN_TRAIN = """
import os, sys, time
import dporl.pipelines.train  # noqa: F401  (imports first, so that both start at the go signal)
from dporl.cli import main
go = sys.argv[1]
print("ready", flush=True)
while not os.path.exists(go):
    time.sleep(0.002)
sys.exit(main(sys.argv[2:]))
"""


def test_a_refused_process_names_a_holder_that_records_its_pid_just_after_locking(tmp_path):
    """The holder locks first and writes its pid a moment later; a process refused in between still names it
    (two processes started together once read the empty file and said "pid unknown")."""
    import fcntl
    import threading

    from dporl.train import run_lock

    root = tmp_path / "run"
    path = run_lock.lock_path(root)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # another open file description: acquire() is refused
    timer = threading.Timer(0.05, lambda: os.pwrite(fd, b"4242\n", 0))
    timer.start()
    try:
        with pytest.raises(ValidationError, match=r"another dporl process \(pid 4242\) holds this run directory"):
            run_lock.acquire(root)
    finally:
        timer.join()
        os.close(fd)


def test_two_processes_started_together_on_one_run_directory_exactly_one_runs(logged, tmp_path):
    config = write_config(logged, tmp_path, max_steps=200)
    run, go = tmp_path / "run", tmp_path / "go"
    command = [sys.executable, "-c", READY_THEN_TRAIN, str(go), "train", "--config", str(config), "--resume"]
    processes = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
                 for _ in range(2)]
    for process in processes:
        assert process.stdout.readline().strip() == "ready"
    go.touch()
    results = [(process, *process.communicate(timeout=600)) for process in processes]
    codes = sorted(process.returncode for process, _, _ in results)
    assert codes == [0, 2], [err[-2000:] for _, _, err in results]
    (winner, _, _), (loser, out, err) = sorted(results, key=lambda r: r[0].returncode)
    assert f"run_dir: another dporl process (pid {winner.pid}) holds this run directory" in err
    assert "stable-prefix release" not in out  # refused before any query
    # One release, charged once; the released policy was trained on the released D_stable.
    # (the unit count: the noisy count and the failure probability of its lower bound, which the release uses)
    assert charged(run) == {"unit_count": 2, "release": 5, "train": 200}
    journal = json.loads((run / "curator" / "journal.json").read_text())
    from dporl.data.dataset import TrajectoryDataset

    stable = TrajectoryDataset.load(run / "release" / "d_stable.npz")
    assert stable.fingerprint() == journal["completed"]["release"]["d_stable"]
    summary = json.loads((run / "release" / "summary.json").read_text())
    assert summary["stable_transitions"] == stable.n_transitions and summary["steps"] == 200
    assert not list(tmp_path.glob(".run.*lock"))  # released at the end


def test_a_live_lock_names_its_holder_and_a_stale_one_is_reported_and_taken_over(tmp_path, capsys):
    from dporl.train import run_lock

    run = tmp_path / "run"
    holder = subprocess.Popen(
        [sys.executable, "-c", "import sys, time; from dporl.train import run_lock; run_lock.acquire(sys.argv[1]); "
         "print('held', flush=True); time.sleep(60)", str(run)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ValidationError, match=rf"another dporl process \(pid {holder.pid}\) holds") as info:
            RunDirectory(run, pipeline="p", config={})
        assert info.value.field == "run_dir"
    finally:
        holder.kill()  # SIGKILL: the kernel drops the flock, the file stays behind
        holder.wait()
    assert run_lock.lock_path(run).read_text().strip() == str(holder.pid)
    with RunDirectory(run, pipeline="p", config={}) as directory:
        assert f"stale lock of {run} (pid {holder.pid}" in capsys.readouterr().err
        assert run_lock.holds(run) and run_lock.lock_path(run).read_text().strip() == str(os.getpid())
        directory.begin()
    assert not run_lock.lock_path(run).exists() and not run_lock.holds(run)


# ------------------------------------------------------------------------------------------------ the journal
@pytest.mark.parametrize("also_checkpoint", [False, True], ids=["journal", "journal_and_checkpoint"])
def test_a_deleted_journal_is_refused_and_nothing_paid_runs_again(logged, tmp_path, monkeypatch, capsys,
                                                                   also_checkpoint):
    config = crashed_run(logged, tmp_path, monkeypatch)
    run = tmp_path / "run"
    released = released_bytes(run)
    (run / "curator" / "journal.json").unlink()
    if also_checkpoint:
        (run / "curator" / "checkpoints" / "last.pt").unlink(missing_ok=True)
    capsys.readouterr()
    assert train(config, "--resume") == 2
    out, err = capsys.readouterr()
    assert "error: journal:" in err and "is missing" in err
    assert "stable-prefix release" not in out and "GUARANTEE" not in out
    assert released_bytes(run) == released  # the paid release was not run again


def test_a_checkpoint_or_chain_head_ahead_of_a_journal_put_back_is_refused(logged, tmp_path, monkeypatch, capsys):
    config = crashed_run(logged, tmp_path, monkeypatch, step=25)
    run = tmp_path / "run"
    older = {name: (run / "curator" / name).read_bytes() for name in ("journal.json", "provenance.json")}
    assert charged(run)["train"] == 30
    crash_at(monkeypatch, 45)
    with pytest.raises(RuntimeError, match="injected crash"):
        train(config, "--resume")
    monkeypatch.undo()
    assert charged(run)["train"] == 50
    # The journal alone, then journal and provenance together (an older, self-consistent chain).
    (run / "curator" / "journal.json").write_bytes(older["journal.json"])
    capsys.readouterr()
    assert train(config, "--resume") == 2
    assert "an older (or other) journal was put back" in capsys.readouterr().err
    (run / "curator" / "provenance.json").write_bytes(older["provenance.json"])
    assert train(config, "--resume") == 2
    err = capsys.readouterr().err
    assert "error: journal:" in err and "records less than was spent" in err  # the checkpoint saw 40 charged


def test_a_damaged_journal_is_refused(logged, tmp_path, monkeypatch, capsys):
    config = crashed_run(logged, tmp_path, monkeypatch)
    path = tmp_path / "run" / "curator" / "journal.json"
    text = path.read_text()
    path.write_text(text[: len(text) // 2])
    capsys.readouterr()
    assert train(config, "--resume") == 2
    assert "error: journal:" in capsys.readouterr().err


def _release_count_to_1(journal):
    stage_entry(journal, "release")["accountant"]["history"][0][1] = 1


def _train_sigma_to_50(journal):
    for event, _ in stage_entry(journal, "train")["accountant"]["history"]:
        event["event"]["noise_multiplier"] = 50.0


@pytest.mark.parametrize("edit", [_release_count_to_1, _train_sigma_to_50], ids=["release_count", "train_sigma"])
@pytest.mark.parametrize("how", ["text_editor", "forged_chain", "forged_chain_and_witnesses"])
def test_a_journal_edited_down_is_refused_by_name(logged, tmp_path, monkeypatch, capsys, edit, how):
    config = crashed_run(logged, tmp_path, monkeypatch)
    run = tmp_path / "run"
    path = run / "curator" / "journal.json"
    if how == "text_editor":
        journal = json.loads(path.read_text())
        edit(journal)
        path.write_text(json.dumps(journal, indent=2))
    elif how == "forged_chain":
        forge(run, edit)
    else:  # and the witnesses a forger can reach: the manifest's record of the charges, the checkpoint
        def everything(journal):
            edit(journal)
            journal["completed"]["release"]["journal"]["charged"]["release"] = 1
        forge(run, everything)
        (run / "curator" / "checkpoints" / "last.pt").unlink(missing_ok=True)
    capsys.readouterr()
    assert train(config, "--resume") == 2
    out, err = capsys.readouterr()
    assert "GUARANTEE" not in out
    field = re.search(r"error: ([\w.]+):", err).group(1)
    if how == "text_editor":
        assert field == "journal" and "does not verify" in err
    elif how == "forged_chain" and edit is _release_count_to_1:  # the release's completion manifest saw 5 charged
        assert field == "journal" and "the completion manifest 'release'" in err
        assert "records less than was spent" in err
    else:  # what the configuration (and release.json) imply: T = 5 release events, the calibrated sigma
        assert field == ("journal.release" if edit is _release_count_to_1 else "journal.train"), err
        assert "refusing to resume from a journal that does not say what this run spent" in err


def test_release_files_without_their_journal_events_are_refused(logged, tmp_path, monkeypatch, capsys):
    config = crashed_run(logged, tmp_path, monkeypatch)
    run = tmp_path / "run"
    journal = json.loads((run / "curator" / "journal.json").read_text())
    # An earlier journal, from before the release was charged: what a careful forger would put back.
    def before_release(j):
        j["ledger"]["stages"] = [s for s in j["ledger"]["stages"] if s["name"] not in ("release", "train")]
        j["completed"] = {}
    forge(run, before_release)
    (run / "curator" / "checkpoints" / "last.pt").unlink(missing_ok=True)
    capsys.readouterr()
    assert train(config, "--resume") == 2
    err = capsys.readouterr().err
    assert "release artifact without its journal events" in err
    assert journal["completed"]["release"]["journal"]["charged"]["release"] == 5  # the manifest's own witness


# ------------------------------------------------------------------------------------------------ interrupts
@pytest.mark.parametrize("signum,code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_an_interrupt_finishes_the_step_checkpoints_and_resume_loses_no_paid_step(logged, tmp_path, signum, code):
    config = write_config(logged, tmp_path, max_steps=400)
    run = tmp_path / "run"
    process = subprocess.Popen([sys.executable, "-m", "dporl", "train", "--config", str(config)],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    journal = run / "curator" / "journal.json"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and process.poll() is None:
        try:  # the charges as recorded (read_journal would also analyse them: too slow to poll)
            stages = json.loads(journal.read_text())["ledger"]["stages"]
            if sum(c for s in stages if s["name"] == "train" for _, c in s["accountant"]["history"]) >= 20:
                break  # training is under way
        except (OSError, ValueError, KeyError):  # not written yet
            pass
        time.sleep(0.01)
    process.send_signal(signum)
    out, err = process.communicate(timeout=120)
    assert process.returncode == code, err[-3000:]
    assert "Traceback" not in err
    match = re.search(r"interrupted at step (\d+) of (\d+); continue with: (.+ --resume)$", err, re.MULTILINE)
    assert match, err[-2000:]
    stopped, total = int(match.group(1)), int(match.group(2))
    assert 0 < stopped < total == 400
    assert load_checkpoint(run / "curator" / "checkpoints" / "last.pt")["step"] == stopped  # checkpointed on the way out
    assert charged(run)["train"] >= stopped
    command = match.group(3).split()
    assert command[:3] == ["python", "-m", "dporl"] and command.count("--resume") == 1
    resumed = subprocess.run([sys.executable, *command[1:]], capture_output=True, text=True, timeout=600, env=ENV)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resume: stage 'train': {stopped} steps trained" in resumed.stderr
    assert f"{total - stopped} steps to come (of {total})" in resumed.stderr
    # No paid step lost: the model was trained for exactly the steps the journal charged.
    summary = json.loads((run / "release" / "summary.json").read_text())
    assert summary["steps"] == charged(run)["train"] == total
    assert load_checkpoint(run / "curator" / "checkpoints" / "last.pt")["step"] == total
    assert journal.exists()


def test_the_resume_hint_is_the_command_that_was_run_with_one_resume():
    from dporl.cli import resume_command

    assert resume_command(["/usr/bin/python3.11", "-m", "dporl", "train", "--config", "my runs.yaml", "--overwrite",
                           "epsilon=1"]) == "python -m dporl train --config 'my runs.yaml' epsilon=1 --resume"
    assert resume_command(["/venv/bin/python", "/venv/bin/dporl", "train", "--config", "c.yaml", "--resume"]) == \
        "dporl train --config c.yaml --resume"
    assert resume_command(["python3", "train.py", "--config", "c.yaml"]) == "python train.py --config c.yaml --resume"


def test_temporary_files_of_killed_writes_are_removed_on_resume(logged, tmp_path, monkeypatch, capsys):
    config = crashed_run(logged, tmp_path, monkeypatch)
    run = tmp_path / "run"
    left = [run / "release" / ".d_stable.npz.k3x9_a2q.tmp.npz", run / "curator" / "checkpoints" / ".last.pt.ab12cd34.tmp",
            run / "curator" / ".journal.json.zz99yy88.tmp"]
    for path in left:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(b"half")
    assert train(config, "--resume") == 0
    assert not [path for path in left if path.exists()]
    assert "left by an interrupted write" in capsys.readouterr().err
    assert charged(run)["train"] == STEPS and json.loads((run / "release" / "summary.json").read_text())["steps"] == STEPS


# ------------------------------------------------------------------------------------------------ refusals
@pytest.mark.parametrize("override", ["eval.env_id=NoSuchEnv-v0", "batch_size=100000", "trainer.max_steps=0"])
def test_a_refused_run_leaves_no_run_directory(tmp_path, capsys, override):
    """The quickstart generates its data inside the run directory: a refusal after that removes it again."""
    run = tmp_path / "runs" / "quick"
    code = cli.main(["train", "--config", str(ROOT / "configs" / "expert_cql_quickstart.yaml"), f"run_dir={run}",
                     "trainer.progress=false", "data.generate.progress=false", override])
    assert code == 2 and "error:" in capsys.readouterr().err
    assert not run.exists() and not (tmp_path / "runs").exists()
    # ... so the same command, corrected, is a new run, not "an existing run".
    assert not list(tmp_path.rglob("*"))


# ------------------------------------------------------------------------------------------------ the chain
CONFIG = {"epsilon": 1.0}


def _journaled(root: Path) -> RunDirectory:
    from dporl.privacy.events import ApproxDPEvent

    run = RunDirectory(root, pipeline="p", config=CONFIG).begin()
    ledger = run.ledger()
    ledger.stage("s", budget=(5.0, 1e-5), mechanism="pld", unit="expert")
    ledger.record("s", ApproxDPEvent(0.1, 0.0), 3)
    run.close()
    return run


def test_the_journal_chain_and_its_copy_in_the_provenance(tmp_path):
    from dporl.train import run_lock
    from dporl.train.journal_file import GENESIS, record_hash as _record_hash

    run = _journaled(tmp_path / "run")
    journal = json.loads(run.journal_path.read_text())
    provenance = json.loads(run.provenance_path.read_text())
    chain = journal["chain"]
    assert chain["seq"] == 3 and provenance["journal"] == {"seq": 3, "hash": chain["hash"], "charged": {"s": 3}}
    body = {k: v for k, v in journal.items() if k != "chain"}
    assert chain["hash"] == _record_hash(chain["prev"], body) and chain["prev"] != GENESIS
    RunDirectory(run.root, pipeline="p", config=CONFIG, mode="resume").close()  # verifies

    # One record ahead of its copy (stopped between the two writes): accepted.
    behind = {**provenance, "journal": {"seq": 2, "hash": chain["prev"], "charged": {"s": 0}}}
    run.provenance_path.write_text(json.dumps(behind))
    RunDirectory(run.root, pipeline="p", config=CONFIG, mode="resume").close()
    # Two ahead, or off the chain: refused.
    run.provenance_path.write_text(json.dumps({**provenance, "journal": {"seq": 1, "hash": GENESIS}}))
    with pytest.raises(ValidationError, match="does not continue the chain head") as info:
        RunDirectory(run.root, pipeline="p", config=CONFIG, mode="resume")
    assert info.value.field == "journal"
    run.provenance_path.write_text(json.dumps(provenance))
    # A record whose hash does not verify: refused, and read_journal refuses it too.
    journal["ledger"]["stages"][0]["accountant"]["history"][0][1] = 1
    run.journal_path.write_text(json.dumps(journal))
    with pytest.raises(ValidationError, match="does not verify"):
        RunDirectory(run.root, pipeline="p", config=CONFIG, mode="resume")
    with pytest.raises(ValidationError, match="does not verify"):
        read_journal(run.journal_path)
    assert not run_lock.holds(run.root)  # a refusal releases the lock


def test_a_file_written_earlier_refuses_a_journal_charging_less_or_other_events(tmp_path):
    run = _journaled(tmp_path / "run")
    with RunDirectory(run.root, pipeline="p", config=CONFIG, mode="resume") as directory:
        witness = directory.journal_witness("s")  # what a checkpoint written now records
        assert witness == {"seq": 3, "charged": {"s": 3}, "stage": "s",
                           "history": [[{"type": "ApproxDPEvent", "epsilon": 0.1, "delta": 0.0,
                                         "replace_one": False}, 3]]}
        directory.check_witness(witness, "a checkpoint")
        for changed, message in (({"charged": {"s": 4}}, "records less than was spent"),
                                 ({"seq": 4}, "records less than was spent"),
                                 ({"history": [[{**witness["history"][0][0], "epsilon": 0.2}, 3]]},
                                  "the events were changed")):
            with pytest.raises(ValidationError, match=message) as info:
                directory.check_witness({**witness, **changed}, "a checkpoint")
            assert info.value.field == "journal"


def test_a_completion_manifest_records_its_witness_and_returns_what_was_given(tmp_path):
    run = _journaled(tmp_path / "run")
    with RunDirectory(run.root, pipeline="p", config=CONFIG, mode="resume") as directory:
        directory.begin()
        directory.ledger()
        directory.complete("evaluation", {"value": 1.5})
        assert directory.completed("evaluation") == {"value": 1.5}  # what a pipeline publishes: no witness in it
    stored = json.loads(run.journal_path.read_text())["completed"]["evaluation"]
    assert stored == {"value": 1.5, "journal": {"seq": 3, "charged": {"s": 3}}}
    with RunDirectory(run.root, pipeline="p", config=CONFIG, mode="resume") as directory:
        assert directory.completed("evaluation") == {"value": 1.5}
