"""Crash-and-resume audit: SIGKILL a small train run at random points, resume it, and check that the run
never under-counts and never loses a paid step.

    python -m dporl.audit --sigkill 30 [--seed 0] [--out kills.json]

Each trial is a fresh run directory of a small Algorithm-3 run, as a user would run it (``dporl train``, a secret
noise seed): 600 LQR CartPole experts logging one episode each, a stable-prefix release of T = 5 fresh runs, then
60-300 mixed expert-level DP-SGD steps journaled in blocks of 20. It is started, killed with SIGKILL, resumed with
``--resume`` (possibly killed again), and finally run to its end. Kill points, drawn at random:

- ``delay``: after a uniform random delay (anywhere: imports, the release, training, writes, evaluation);
- ``before:journal.json:K`` / ``before:last.pt:K``: inside the K-th journal record / checkpoint write, after its
  temporary file is complete and before its rename;
- ``after:journal.json:K``: between the K-th journal record and its chain head in ``provenance.json``;
- ``after:d_stable.npz:1`` / ``after:release.json:1``: D_stable (and its public summary) written, the release not
  yet marked complete;
- ``step:K``: inside training step K (computed, not yet returned).

Each child process records, durably, every training step it begins, a hash of the parameters when the step ends,
and every release it begins. Checks:

- after every kill, the journal on disk charges every step any attempt began and, once a release began, all T of
  its events (the write-ahead property);
- at the end: the printed guarantee is the one the journal's events imply, never less (under-counts); the steps the
  released model was trained for equal the steps charged (paid steps lost); a step run in two attempts ended with
  the same parameters (a replayed step is the same mechanism run, not a new one); at most one release ran, and the
  released D_stable is the one the journal fingerprinted; no temporary file or lock is left behind.

A kill after the release is charged and before its files are whole makes the resume refuse by name: that
release's budget is spent and it is never run again (its secret randomness died with the process). Such a trial ends
"refused (release interrupted)": budget lost with nothing released, the honest outcome, not an under-count. A kill
after its files are whole and before it is marked complete is recovered: the resume reuses the written release.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Optional

import numpy as np

T_RELEASE = 5
JOURNAL_EVERY = 20
FAULT_KINDS = ("delay", "before:journal.json", "after:journal.json", "before:last.pt", "after:d_stable.npz",
               "after:release.json", "step")
FAULT_WEIGHTS = (0.4, 0.15, 0.1, 0.15, 0.05, 0.05, 0.1)


@dataclass
class Kill:
    trial: int
    attempt: int
    fault: str
    killed: bool  # False: the run ended before the fault point was reached
    began: int = 0  # the last training step begun when it died
    charged: int = 0  # training steps the journal on disk charged then
    release_began: bool = False
    release_charged: int = 0
    write_ahead_ok: bool = True
    phase: str = ""  # where it landed: "startup", "release", "training" or "final writes"


@dataclass
class Trial:
    trial: int
    steps: int
    outcome: str = ""  # "finished", "refused (release interrupted)", or what went wrong
    kills: int = 0
    printed_epsilon: Optional[float] = None
    journal_epsilon: Optional[float] = None
    charged: int = 0
    trained: int = 0
    releases_begun: int = 0
    replay_mismatches: int = 0
    leftovers: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)


# ------------------------------------------------------------------------------------------------ the child
def child(argv: list[str]) -> int:
    """``python -m dporl.audit.crash_resume FAULT LOG -- dporl-args...``: run ``dporl`` with the fault armed and
    every step / release recorded in LOG."""
    fault, log_path, rest = argv[0], argv[1], argv[3:]
    kind, _, where = fault.partition(":")
    target, _, index = where.rpartition(":") if kind in ("before", "after") else ("", "", where)
    log = open(log_path, "a")

    def record(line: str) -> None:
        log.write(line + "\n")
        log.flush()
        os.fsync(log.fileno())

    def die() -> None:
        os.kill(os.getpid(), signal.SIGKILL)

    record(f"start {time.time()}")

    counts: Counter = Counter()
    real_replace = os.replace

    def replace(src, dst, *args, **kwargs):
        name = Path(dst).name
        counts[name] += 1
        armed = name == target and str(counts[name]) == index
        if armed and kind == "before":
            die()
        real_replace(src, dst, *args, **kwargs)
        if armed and kind == "after":
            die()

    os.replace = replace

    from dporl.pipelines.train import release as train_release
    from dporl.train.trainer import Trainer

    real_step, real_release = Trainer._step, train_release.release_stable_prefixes

    def step(self, *args, **kwargs):
        number = self.current_step
        record(f"begin {number}")
        out = real_step(self, *args, **kwargs)
        if kind == "step" and str(number) == index:
            die()
        digest = hashlib.sha256()
        for tensor in self.algorithm.state_dict().values():
            digest.update(tensor.detach().cpu().contiguous().numpy().tobytes())
        record(f"end {number} {digest.hexdigest()}")
        return out

    def release(*args, **kwargs):
        record(f"release {time.time()}")
        return real_release(*args, **kwargs)

    Trainer._step = step
    train_release.release_stable_prefixes = release
    from dporl.cli import main

    return main(rest)


# ------------------------------------------------------------------------------------------------ the parent
def write_data(directory: Path) -> tuple[Path, Path]:
    """600 LQR CartPole experts (3 physics settings, p_min 0.1) and one logged episode each (<= 60 steps)."""
    from dporl.experts.analytic import cartpole_lqr_experts
    from dporl.experts.collect import collect
    from dporl.experts.expert_set import ExpertSet

    settings = [{"gravity": g, "force_mag": 10.0, "masscart": 1.0} for g in (9.0, 9.8, 10.5)]
    policy, _ = cartpole_lqr_experts(settings, 200, seed=0)
    experts = ExpertSet(policy, 0.1, "argmax")
    experts.save(directory / "experts.pt")
    collect(experts, "CartPole-v1", 1, max_episode_steps=60, seed=0, progress=False).save(directory / "data.npz")
    return directory / "data.npz", directory / "experts.pt"


def write_config(path: Path, run_dir: Path, data: tuple[Path, Path], steps: int) -> Path:
    import yaml

    config = {
        "pipeline": "train", "method": "mixed", "run_dir": str(run_dir), "epsilon": 10.0, "delta": 1e-5,
        "batch_size": 16, "data": {"dataset": str(data[0]), "expert_set": str(data[1])},
        "release": {"trajectories": T_RELEASE}, "dp": {"noise_multiplier": 1.0, "p_dp": 0.5},
        "algorithm": {"name": "cql", "hidden_sizes": [16]},
        "trainer": {"max_steps": steps, "journal_every": JOURNAL_EVERY, "eval_every": 100, "log_every": 10,
                    "checkpoint_every": 1000, "progress": False},
        "eval": {"episodes": 2, "num_envs": 2, "max_episode_steps": 50},
    }
    path.write_text(yaml.safe_dump(config))
    return path


def draw_fault(rng: np.random.Generator, steps: int, window: tuple[float, float]) -> tuple[str, float]:
    """(fault, delay in seconds for "delay", uniform over ``window``: from shortly before the release starts to the
    end of an uninterrupted run)."""
    kind = FAULT_KINDS[int(rng.choice(len(FAULT_KINDS), p=FAULT_WEIGHTS))]
    blocks = -(-steps // JOURNAL_EVERY)
    if kind == "delay":
        return "delay", float(rng.uniform(*window))
    if kind in ("before:journal.json", "after:journal.json"):
        return f"{kind}:{int(rng.integers(1, blocks + 6))}", 0.0
    if kind == "before:last.pt":
        return f"{kind}:{int(rng.integers(1, blocks + 2))}", 0.0
    if kind in ("after:d_stable.npz", "after:release.json"):
        return f"{kind}:1", 0.0
    return f"step:{int(rng.integers(1, steps + 1))}", 0.0


def _run_child(fault: str, delay: float, log: Path, config: Path, resume: bool, timeout: float = 600):
    command = [sys.executable, "-m", "dporl.audit.crash_resume", fault, str(log), "--", "train", "--config",
               str(config), *(["--resume"] if resume else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        out, err = process.communicate(timeout=delay if fault == "delay" else timeout)
    except subprocess.TimeoutExpired:
        process.send_signal(signal.SIGKILL)
        out, err = process.communicate()
    return process.returncode, out, err, time.monotonic() - started


def _log(log: Path, skip: int = 0) -> tuple[list[int], dict[int, set[str]], int]:
    """(steps begun, per step the parameter hashes its ends produced, releases begun), from line ``skip`` on."""
    begun, ends, releases = [], {}, 0
    if log.exists():
        for line in log.read_text().splitlines()[skip:]:
            parts = line.split()
            if parts[:1] == ["begin"]:
                begun.append(int(parts[1]))
            elif parts[:1] == ["end"] and len(parts) == 3:
                ends.setdefault(int(parts[1]), set()).add(parts[2])
            elif parts[:1] == ["release"]:
                releases += 1
    return begun, ends, releases


def _charged(run_dir: Path) -> dict[str, int]:
    """Events per stage in the journal on disk (read as a resume would: its own record, chain link checked)."""
    from dporl.train.run_dir import read_journal

    path = run_dir / "curator" / "journal.json"
    if not path.exists():
        return {}
    return {name: len(stage.accountant) for name, stage in read_journal(path).stages.items()}


def run_trial(number: int, rng: np.random.Generator, work: Path, data, kills: int, window: tuple[float, float],
              faults: Optional[list[str]] = None, steps: Optional[int] = None) -> tuple[Trial, list[Kill]]:
    """One run killed up to ``kills`` times at drawn points (or at ``faults``, in order), then run to its end."""
    steps = int(rng.integers(60, 301)) if steps is None else steps
    run_dir = work / f"trial{number}" / "run"
    run_dir.parent.mkdir(parents=True)
    config = write_config(run_dir.parent / "config.yaml", run_dir, data, steps)
    log = run_dir.parent / "steps.log"
    trial, records = Trial(number, steps), []
    resume = False
    finished = None
    for attempt in range(kills if faults is None else len(faults)):
        fault, delay = draw_fault(rng, steps, window) if faults is None else (faults[attempt], 0.0)
        lines_before = len(log.read_text().splitlines()) if log.exists() else 0
        code, out, err, _ = _run_child(fault, delay, log, config, resume)
        resume = True
        if code != -signal.SIGKILL:  # the fault point was never reached: the run ended by itself
            records.append(Kill(number, attempt, fault, killed=False))
            finished = (code, out, err)
            break
        begun, _, releases = _log(log)
        try:
            charged = _charged(run_dir)
        except Exception as exc:  # the journal on disk must always be readable: a kill never leaves half a file
            charged = {}
            trial.failures.append(f"after kill {attempt} ({fault}): journal unreadable: {exc}")
        kill = Kill(number, attempt, fault, True, max(begun, default=0), charged.get("train", 0), releases > 0,
                    charged.get("release", 0))
        kill.write_ahead_ok = kill.charged >= kill.began and (not kill.release_began or
                                                               kill.release_charged == T_RELEASE)
        mine, _, released_now = _log(log, lines_before)  # what this attempt did before it died
        kill.phase = ("training" if mine and max(mine) < steps else "final writes" if mine else
                      "release" if released_now else "startup")
        if not kill.write_ahead_ok:
            trial.failures.append(f"after kill {attempt} ({fault}): began step {kill.began}, charged {kill.charged}; "
                                  f"release began {kill.release_began}, charged {kill.release_charged}")
        records.append(kill)
        trial.kills += 1
    if finished is None:
        finished = _run_child("none", 0.0, log, config, resume)[:3]
    code, out, err = finished
    _check_end(trial, run_dir, log, code, out, err)
    return trial, records


def _check_end(trial: Trial, run_dir: Path, log: Path, code: int, out: str, err: str) -> None:
    from dporl.data.dataset import TrajectoryDataset
    from dporl.train import run_lock
    from dporl.train.run_dir import ATOMIC_TEMP, read_journal

    begun, ends, trial.releases_begun = _log(log)
    trial.replay_mismatches = sum(len(hashes) > 1 for hashes in ends.values())
    if trial.replay_mismatches:
        trial.failures.append(f"{trial.replay_mismatches} replayed steps ended with other parameters")
    if trial.releases_begun > 1:
        trial.failures.append(f"the release ran {trial.releases_begun} times")
    trial.leftovers = sorted(str(p.relative_to(run_dir)) for p in run_dir.rglob(".*") if ATOMIC_TEMP.match(p.name))
    if run_lock.lock_path(run_dir).exists():
        trial.leftovers.append(run_lock.lock_path(run_dir).name)
    charged = _charged(run_dir)
    trial.charged = charged.get("train", 0)
    if max(begun, default=0) > trial.charged:
        trial.failures.append(f"step {max(begun)} ran but only {trial.charged} were charged")
    if code == 2 and "error: release: an earlier attempt of this run authorised the stable-prefix release" in err:
        trial.outcome = "refused (release interrupted)"
        if charged.get("release") != T_RELEASE:
            trial.failures.append(f"refused release charged {charged.get('release')} of {T_RELEASE}")
        return
    if code != 0:
        trial.outcome = f"exit {code}"
        trial.failures.append(f"the final resume exited {code}: {err.strip().splitlines()[-1:] or ''}")
        return
    trial.outcome = "finished"
    match = re.search(r"GUARANTEE: \(([0-9.e+-]+), ([0-9.e+-]+)\)-DP", out)
    journal = read_journal(run_dir / "curator" / "journal.json").report().guarantee
    trial.journal_epsilon = journal[0]
    trial.printed_epsilon = float(match.group(1)) if match else None
    if trial.printed_epsilon is None or trial.printed_epsilon < journal[0] * (1 - 1e-3):  # printed with 4 digits
        trial.failures.append(f"under-count: printed {trial.printed_epsilon}, the journal implies {journal[0]:.6g}")
    summary = json.loads((run_dir / "release" / "summary.json").read_text())
    trial.trained = int(summary["steps"])
    if trial.trained != trial.charged:
        trial.failures.append(f"paid steps lost: trained {trial.trained}, charged {trial.charged}")
    if charged.get("release") != T_RELEASE:
        trial.failures.append(f"release charged {charged.get('release')} events, not {T_RELEASE}")
    manifest = json.loads((run_dir / "curator" / "journal.json").read_text())["completed"]["release"]
    if TrajectoryDataset.load(run_dir / "release" / "d_stable.npz").fingerprint() != manifest["d_stable"]:
        trial.failures.append("release/d_stable.npz is not the D_stable the journal fingerprinted")
    if trial.leftovers:
        trial.failures.append(f"left behind: {trial.leftovers}")


def audit(kills: int = 30, seed: int = 0, work_dir: Optional[str | Path] = None, kills_per_trial: int = 3,
          progress: bool = True, plan: Optional[list[tuple[int, list[str]]]] = None) -> dict[str, Any]:
    """Kill small runs ``kills`` times in all (see the module docstring); the results as a dict. ``plan``: instead
    of random draws, (steps, faults) per run."""
    rng = np.random.default_rng(seed)
    owned = work_dir is None
    work = Path(tempfile.mkdtemp(prefix="dporl-sigkill-") if owned else work_dir)
    work.mkdir(parents=True, exist_ok=True)
    data_dir = work / "data"
    data_dir.mkdir(exist_ok=True)
    data = write_data(data_dir)
    duration, window = 0.0, (0.0, 0.0)
    if plan is None:  # one uninterrupted run: when the release starts and how long a run takes (the delays' range)
        (work / "baseline").mkdir(exist_ok=True)
        baseline_config = write_config(work / "baseline" / "config.yaml", work / "baseline" / "run", data, 180)
        log = work / "baseline" / "steps.log"
        code, out, err, duration = _run_child("none", 0.0, log, baseline_config, False)
        if code != 0:
            raise RuntimeError(f"the uninterrupted run failed (exit {code}): {err[-2000:]}")
        times = {line.split()[0]: float(line.split()[-1]) for line in log.read_text().splitlines()
                 if line.split()[0] in ("start", "release")}
        window = (max(times["release"] - times["start"] - 0.3, 0.0), duration)
    trials, records = [], []
    number = 0
    while (sum(r.killed for r in records) < kills) if plan is None else number < len(plan):
        wanted = min(kills_per_trial, kills - sum(r.killed for r in records))
        steps, faults = plan[number] if plan is not None else (None, None)
        trial, kills_of_trial = run_trial(number, rng, work, data, wanted, window, faults, steps)
        trials.append(trial)
        records.extend(kills_of_trial)
        if progress:
            print(f"trial {number}: {trial.steps} steps, {trial.kills} kills "
                  f"({', '.join(k.fault for k in kills_of_trial if k.killed)}): {trial.outcome}"
                  + (f"; FAILED: {trial.failures}" if trial.failures else ""), file=sys.stderr, flush=True)
        number += 1
    killed = [r for r in records if r.killed]
    result = {
        "kills": len(killed),
        "trials": len(trials),
        "by_fault": dict(Counter(k.fault.rsplit(":", 1)[0] if ":" in k.fault else k.fault for k in killed)),
        "by_phase": dict(Counter(k.phase for k in killed)),
        "write_ahead_violations": sum(not k.write_ahead_ok for k in killed),
        "under_counts": sum(any(f.startswith("under-count") for f in t.failures) for t in trials),
        "paid_steps_lost": sum(max(t.charged - t.trained, 0) for t in trials if t.outcome == "finished"),
        "replay_mismatches": sum(t.replay_mismatches for t in trials),
        "repeated_releases": sum(t.releases_begun > 1 for t in trials),
        "finished": sum(t.outcome == "finished" for t in trials),
        "refused_release_interrupted": sum(t.outcome == "refused (release interrupted)" for t in trials),
        "failures": [f"trial {t.trial}: {f}" for t in trials for f in t.failures],
        "baseline_seconds": round(duration, 2),
        "delay_window_seconds": [round(w, 2) for w in window],
        "trial_details": [asdict(t) for t in trials],
        "kill_details": [asdict(k) for k in records],
    }
    result["passed"] = not result["failures"]
    if owned:
        import shutil

        shutil.rmtree(work, ignore_errors=True)
    return result


def describe(result: dict[str, Any]) -> str:
    lines = [
        f"{result['kills']} SIGKILLs over {result['trials']} runs ({result['finished']} finished after resuming, "
        f"{result['refused_release_interrupted']} refused by name: killed inside the release, its budget spent)",
        "kill points: " + ", ".join(f"{name} {count}" for name, count in sorted(result["by_fault"].items())),
        "landed in: " + ", ".join(f"{name} {count}" for name, count in sorted(result["by_phase"].items())),
        f"write-ahead violations (a step or release ran uncharged at a kill): {result['write_ahead_violations']}",
        f"under-counts (printed guarantee below the journal's events): {result['under_counts']}",
        f"paid steps lost (charged but not in the released model): {result['paid_steps_lost']}",
        f"replayed steps that differed from the original: {result['replay_mismatches']}",
        f"releases run more than once: {result['repeated_releases']}",
        "PASSED" if result["passed"] else "FAILED:\n  " + "\n  ".join(result["failures"]),
    ]
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(child(sys.argv[1:]))
