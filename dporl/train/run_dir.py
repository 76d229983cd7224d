"""Run directories: what is released, what stays with the curator, and the provenance that ties them to one run.

A guarantee covers the artifacts that leave the curator, on FIXED neighbouring datasets, so every run keeps two
places apart::

    RUN/release/     exactly what the printed guarantee covers; safe to hand out
        policy/              weights.pt (a plain state_dict, weights-only), policy.json (architecture, spaces,
                             guarantee), policy.torchscript.pt (deployable without dporl)
        d_stable.npz         released data, when the method releases some
        privacy_report.json  the ledger's report
        summary.json         public summary (budgets, guarantee, public-simulator returns)
        evaluations/         public-simulator evaluations (evaluate.py)
        tensorboard/         public scalars only (returns in the public simulator, privacy spent)
    RUN/curator/     everything else; never shared
        provenance.json      pipeline, config hash and config, input hashes (dataset content, expert set)
        journal.json         the write-ahead privacy journal (every authorised event, as authorised)
        checkpoints/last.pt  resumable state, with the secret generators' states
        summary.json         the full summary (config included: it may hold a noise seed)
        tensorboard/         curator diagnostics (raw losses, clip fractions; off unless
                             ``trainer.curator_diagnostics``)

Nothing in ``release/`` may depend on private data except through an accounted mechanism (no counts of private
rows, raw losses, realised batch sizes or generator states).

Provenance. ``RunDirectory(root, pipeline=, config=, mode=)`` decides, before anything is written, whether this
run may use ``root``: mode ``"new"`` (the default) refuses a non-empty directory; ``"resume"`` continues one only if
its recorded pipeline and config hash equal this run's (naming the keys that differ otherwise);
``"overwrite"`` replaces a dporl run directory, removing the old one at ``begin()``, after every check passed.
``check_inputs(dataset=..., expert_set=...)`` compares input hashes the same way. Only then does ``begin()`` write.
Keys that do not change what a run computes (``IGNORED_KEYS``: where it writes, progress bars) are not hashed.

The journal is the write-ahead log of the run's ``PrivacyLedger`` (``run.ledger(budget)``): the ledger hands its
whole state to the journal before any mechanism it charges can run; recovery charges every authorised event as
recorded. ``complete(name, manifest)`` marks an artifact (e.g. the stable-prefix release) as fully written, after
its events were journaled and its files written, so a resumed run knows whether a paid release is whole.

One process per run directory (``dporl.train.run_lock``): the constructor takes an exclusive OS lock before it
reads anything, held until ``close()`` (pipelines close in a ``finally``; the kernel drops it if the process dies).
Nothing is written before ``begin()`` (or ``prepare()``, for inputs generated into the run directory); a run that
ends before ``begin()`` (a refusal, an interrupt) removes what it created, so a refused run leaves no directory.

The journal vouches for the artifacts, and they for it. Each journal write is a record of the whole ledger state
with a chain link: ``seq`` (writes so far), ``prev`` (the previous record's hash) and ``hash`` = sha256(prev,
record). The chain head (seq, hash, events charged per stage) is copied into ``provenance.json`` after every
journal write; completion manifests and checkpoints record the head and the charges at the time they were written
(``journal_witness``). A resumed run refuses, by name and before anything runs: a journal missing while the
provenance records a head; a record whose hash does not verify; a journal behind its head (an older copy put back)
or off it; a manifest or checkpoint that records more charges than the journal; release artifacts without their
journal events. The pipelines add what only they know: the release stage's events must be exactly the T events its
configuration and ``release.json`` imply, and training events the ones its configuration calibrates.

Threat model, precisely. The curator owns the run directory and can always destroy a run (``--overwrite``, ``rm``).
What dporl prevents is printing less than was spent, by accident (a deleted, truncated, rolled-back or half-edited
journal, a crash at any point) or by a quick edit of a number: every such change breaks the chain, its copy in the
provenance, or a count recorded in another file. A hash chain does not authenticate: whoever can write the directory
can recompute it. Nor would an HMAC whose key the run reads from disk (the curator can read it too), so none is
used. A deliberate forger who rewrites the journal, recomputes the chain and its copy, and makes every witness agree
(the release manifest, ``release.json``, D_stable's fingerprint, each checkpoint's counters) is outside what
software on the curator's own machine can stop; against that, keep the chain head (``provenance.json``'s
``journal``) somewhere the curator cannot rewrite. It holds no private data: it is not meant for ``release/``.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
import shutil
import sys
import weakref
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, get_args

from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.units import Relation
from dporl.train import run_lock
from dporl.utils.io import atomic_write_json, read_json
from dporl.utils.validation import ValidationError

RunMode = Literal["new", "resume", "overwrite"]
RUN_MODES: tuple[str, ...] = get_args(RunMode)
PROVENANCE_FORMAT = "dporl-run"
JOURNAL_FORMAT = "dporl-privacy-journal"
FORMAT_VERSION = 2  # 2: the journal is a hash chain whose head provenance.json copies
GENESIS = "0" * 64  # the "previous hash" of a journal's first record
# Temporary files of dporl.utils.io's atomic writers (".NAME.XXXXXXXX.tmp[.ext]"): what a killed write leaves.
ATOMIC_TEMP = re.compile(r"^\..+\.[A-Za-z0-9_]{8}\.tmp(\.[A-Za-z0-9]+)?$")
# Config keys (at any depth) that do not change what a run computes: where it is written, progress display.
IGNORED_KEYS = frozenset({"run_dir", "out_dir", "progress", "resume"})


def canonical_config(config: Mapping[str, Any]) -> dict[str, Any]:
    """``config`` as plain JSON data with the ``IGNORED_KEYS`` removed at every depth."""

    def strip(value: Any) -> Any:
        if isinstance(value, Mapping):
            return {str(k): strip(v) for k, v in value.items() if str(k) not in IGNORED_KEYS}
        if isinstance(value, (list, tuple)):
            return [strip(v) for v in value]
        return value

    return json.loads(json.dumps(strip(dict(config)), default=str))


def canonical_json(value: Any) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), allow_nan=True)


def config_sha256(config: Mapping[str, Any]) -> str:
    """sha256 of the canonical JSON of ``config`` (ignored keys removed, keys sorted)."""
    return hashlib.sha256(canonical_json(canonical_config(config)).encode()).hexdigest()


def config_differences(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted keys at which two canonical configs differ (``"dp.noise_multiplier: 3.0 -> 1.0"``)."""
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new)):
            name = f"{prefix}.{key}" if prefix else key
            if key not in old:
                out.append(f"{name}: (absent) -> {new[key]!r}")
            elif key not in new:
                out.append(f"{name}: {old[key]!r} -> (absent)")
            else:
                out.extend(config_differences(old[key], new[key], name))
        return out
    same = old == new or (isinstance(old, float) and isinstance(new, float) and math.isnan(old) and math.isnan(new))
    return [] if same else [f"{prefix or '(config)'}: {old!r} -> {new!r}"]


class RunDirectory:
    """One run's directory: ``release/`` vs ``curator/``, its provenance and its privacy journal (module docstring).

    ``curator_only=True`` is for directories whose every file is curator data (the logged datasets the "dataset"
    pipeline writes): the files and ``provenance.json`` sit at the root and there is no ``release/``.

    The constructor takes the directory's lock (refusing a second process) and checks what is there; use it as a
    context manager, or call ``close()`` when the run ends.
    """

    def __init__(
        self,
        root: str | Path,
        *,
        pipeline: str,
        config: Mapping[str, Any],
        mode: RunMode = "new",
        curator_only: bool = False,
    ):
        if mode not in RUN_MODES:
            raise ValidationError("mode", f"expected one of {list(RUN_MODES)}, got {mode!r}")
        self.root = Path(root)
        self.pipeline = pipeline
        self.mode = mode
        self.curator_only = curator_only
        self.config = canonical_config(config)
        self.config_sha256 = hashlib.sha256(canonical_json(self.config).encode()).hexdigest()
        self.inputs: dict[str, str] = {}
        self._recorded: Optional[dict[str, Any]] = None
        self._journal: Optional[dict[str, Any]] = None
        self._completed: dict[str, Any] = {}
        self._ledger_state: Optional[dict[str, Any]] = None
        self._head: Optional[dict[str, Any]] = None  # the journal's chain head: seq, hash, charges per stage
        self._begun = False
        self._made: Optional[str] = None  # what prepare() made: "root" (created it) or "contents" (it was empty)
        if self.root.exists() and not self.root.is_dir():
            raise ValidationError("run_dir", f"{self.root} exists and is not a directory")
        # The lock comes first: nothing is read before this process owns the directory.
        self._lock = run_lock.acquire(self.root)
        self._release_lock = weakref.finalize(self, run_lock.release, self._lock)
        try:
            self.existing = self._inspect()
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> "RunDirectory":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def close(self) -> None:
        """End this process's use of the directory: a run that never began removes what ``prepare()`` created (a
        refused or interrupted run leaves nothing); the lock is released. Idempotent."""
        if not self._begun and self._made is not None:
            made, self._made = self._made, None
            _remove_made(self.root, made)
        self._release_lock()

    # ------------------------------------------------------------------ layout
    @property
    def release(self) -> Path:
        if self.curator_only:
            raise ValidationError("run_dir", f"{self.root} holds curator data only; it has no release/")
        return self.root / "release"

    @property
    def curator(self) -> Path:
        return self.root if self.curator_only else self.root / "curator"

    @property
    def policy_dir(self) -> Path:
        return self.release / "policy"

    @property
    def checkpoint_path(self) -> Path:
        return self.curator / "checkpoints" / "last.pt"

    @property
    def journal_path(self) -> Path:
        return self.curator / "journal.json"

    @property
    def provenance_path(self) -> Path:
        return self.curator / "provenance.json"

    @property
    def summary_path(self) -> Path:
        return self.curator / "summary.json"

    # ------------------------------------------------------------------ checks (no writes)
    def _inspect(self) -> bool:
        """Whether ``root`` already holds a run; refuses what this mode may not use. Writes nothing."""
        root = self.root
        if not root.exists() or not any(root.iterdir()):
            return False
        if self.mode == "overwrite" and root.is_symlink():
            raise ValidationError("run_dir", f"{root} is a symbolic link to {root.resolve()}: --overwrite never deletes "
                                  "through a link; give the directory itself (nothing was deleted)")
        if self.mode == "new":
            raise ValidationError(
                "run_dir",
                f"{root} already holds files: continue that run with --resume, replace it with --overwrite, or "
                "choose a new run_dir (nothing was written)",
            )
        recorded = self._read_provenance()
        if self.mode == "overwrite":
            self._recorded = recorded  # a dporl run directory: removing it at begin() is allowed
            return True
        if recorded["pipeline"] != self.pipeline:
            raise ValidationError(
                "run_dir", f"{root} holds a {recorded['pipeline']!r} run, not {self.pipeline!r}; use a new run_dir"
            )
        if recorded["config_sha256"] != self.config_sha256:
            differences = config_differences(recorded.get("config"), self.config)
            shown = "; ".join(differences[:8]) + (f"; and {len(differences) - 8} more" if len(differences) > 8 else "")
            raise ValidationError(
                "run_dir",
                f"{root} holds a run of another configuration (on disk -> now: {shown or 'config hash differs'}); "
                "refusing to resume or reuse anything from it: use a new run_dir, or --overwrite to replace it",
            )
        self._recorded = recorded
        self._journal = self._read_journal()
        self._head = self._verify_chain(self._journal, recorded.get("journal"))
        if self._journal is not None:
            self._completed = dict(self._journal.get("completed") or {})
            self._ledger_state = self._journal["ledger"]
        self._verify_witnesses()
        return True

    def _read_provenance(self) -> dict[str, Any]:
        path = self.provenance_path
        if not path.is_file():
            raise ValidationError(
                "run_dir",
                f"{self.root} is not empty and is not a dporl run directory ({path.relative_to(self.root)} is "
                "missing): refusing to resume, reuse or delete it; choose a new run_dir",
            )
        return _read_versioned(path, "run_dir.provenance", PROVENANCE_FORMAT,
                               {"pipeline": str, "config_sha256": str, "inputs": dict})

    def _read_journal(self) -> Optional[dict[str, Any]]:
        path = self.journal_path
        if not path.exists():
            return None
        journal = _read_versioned(path, "journal", JOURNAL_FORMAT, {"ledger": dict, "completed": dict, "chain": dict})
        if journal.get("config_sha256") != self.config_sha256:
            raise ValidationError("journal", f"{path} belongs to another configuration than {self.provenance_path}")
        return journal

    def _verify_chain(self, journal: Optional[dict[str, Any]], head: Any) -> Optional[dict[str, Any]]:
        """The verified chain head of ``journal`` against the copy provenance.json holds (``head``); refuses a
        missing, edited, rolled-back or foreign journal. The journal may be one record ahead of its copy (a run
        stopped between the two writes); never behind."""
        path = self.journal_path
        if head is not None and not (
            isinstance(head, dict) and isinstance(head.get("seq"), int) and isinstance(head.get("hash"), str)
        ):
            raise ValidationError("run_dir.provenance", f"{self.provenance_path}: malformed journal head {head!r}")
        if journal is None:
            if head is not None:
                raise ValidationError(
                    "journal", f"{path} is missing, but {self.provenance_path.name} records {head['seq']} journal "
                    "writes: the privacy spent by this run cannot be recovered; refusing to resume or re-run any "
                    "paid step. Start a new run_dir (or --overwrite)"
                )
            return None
        chain = _check_record(journal, path)
        expected = head["hash"] if head is not None else GENESIS
        seq = head["seq"] if head is not None else 0
        if head is not None and (chain["seq"], chain["hash"]) == (seq, expected):
            return _head_of(journal)
        if chain["seq"] == seq + 1 and chain["prev"] == expected:
            return _head_of(journal)  # written, then stopped before its head was copied
        if chain["seq"] <= seq:
            raise ValidationError(
                "journal", f"{path} is record {chain['seq']} of its chain but {self.provenance_path.name} records "
                f"{seq}: an older (or other) journal was put back; refusing to under-count. Start a new run_dir"
            )
        raise ValidationError(
            "journal", f"{path} (record {chain['seq']}) does not continue the chain head {self.provenance_path.name} "
            f"records (record {seq}): refusing to resume from a journal that is not this run's"
        )

    def _verify_witnesses(self) -> None:
        """Completion manifests record the charges they were written after; released files need a journal."""
        for name, manifest in self._completed.items():
            witness = manifest.get("journal") if isinstance(manifest, dict) else None
            if not isinstance(witness, dict):
                raise ValidationError("journal", f"the completion manifest {name!r} in {self.journal_path} has no "
                                      "journal witness: refusing to trust it")
            self.check_witness(witness, f"the completion manifest {name!r}")
        if self.curator_only or self._journal is not None:
            return
        released = sorted(str(p.relative_to(self.root)) for p in self.release.rglob("*")
                          if p.is_file() and not ATOMIC_TEMP.match(p.name)) if self.release.is_dir() else []
        if released:
            raise ValidationError(
                "journal", f"{self.root} holds released files ({', '.join(released[:3])}) but no privacy journal: a "
                "release artifact without its journal events; refusing to resume or re-run anything. Start a new "
                "run_dir (or --overwrite)"
            )

    def journal_witness(self, stage: Optional[str] = None) -> dict[str, Any]:
        """What a file written now records of the journal (``check_witness`` compares it later): the chain head and
        the charges per stage; with ``stage``, also that stage's events as recorded (in order)."""
        witness: dict[str, Any] = {"seq": 0 if self._head is None else self._head["seq"],
                                   "charged": _tally(self._ledger_state)}
        if stage is not None:
            witness["stage"], witness["history"] = stage, _history(self._ledger_state, stage)
        return witness

    def check_witness(self, witness: Mapping[str, Any], what: str) -> None:
        """Refuse a journal that charges less than a file written earlier saw it charge (``journal_witness``)."""
        seq = 0 if self._head is None else self._head["seq"]
        charged = _tally(self._ledger_state)
        try:
            then_seq = int(witness["seq"])
            then = {str(k): int(v) for k, v in dict(witness["charged"]).items()}
            history = witness.get("history")
        except (KeyError, TypeError, ValueError) as exc:
            raise ValidationError("journal", f"{what} holds a malformed journal witness ({exc})") from None
        fewer = {name: (count, charged.get(name, 0)) for name, count in then.items() if charged.get(name, 0) < count}
        if then_seq > seq or fewer:
            shown = "; ".join(f"stage {n!r}: {a} then, {b} now" for n, (a, b) in fewer.items())
            raise ValidationError(
                "journal", f"{what} was written after journal record {then_seq} but {self.journal_path} holds "
                f"record {seq}{'; charges ' + shown if shown else ''}: the journal records less than was spent; "
                "refusing to resume. Start a new run_dir (or --overwrite)"
            )
        if history is not None:
            stage = witness.get("stage")
            now = _history(self._ledger_state, stage) if isinstance(stage, str) else None
            if now is None or not _extends(now, history):
                raise ValidationError(
                    "journal", f"{what} saw stage {stage!r} charge {history} but {self.journal_path} records "
                    f"{now}: the events were changed; refusing to resume"
                )

    def check_inputs(self, **hashes: str) -> None:
        """Record input hashes; resuming, each must equal the one recorded (the error names it). Writes nothing
        before ``begin()``."""
        recorded = (self._recorded or {}).get("inputs", {}) if self.mode == "resume" else {}
        for name, value in hashes.items():
            before = recorded.get(name)
            if before is not None and before != value:
                raise ValidationError(
                    f"inputs.{name}",
                    f"the {name} differs from the one {self.root} was made with (sha256 {str(before)[:16]}... on "
                    f"disk, {str(value)[:16]}... now): refusing to resume or reuse anything from it; use a new run_dir",
                )
            self.inputs[name] = value
        if self._begun:
            self._write_provenance()

    @property
    def finished(self) -> bool:
        """A resumed run whose curator summary was written (the last file a pipeline writes)."""
        return self.mode == "resume" and self.existing and self.summary_path.is_file()

    def completed(self, name: str) -> Optional[dict[str, Any]]:
        """The manifest ``complete(name, ...)`` journaled (as given, without the journal witness), or None."""
        manifest = self._completed.get(name)
        return None if manifest is None else {k: v for k, v in manifest.items() if k != "journal"}

    # ------------------------------------------------------------------ writes
    def prepare(self) -> "RunDirectory":
        """Make the directory's layout without starting the run (no provenance): for inputs generated into it
        before the run's last checks. Removes the old directory in mode overwrite. A run that never reaches
        ``begin()`` removes what this created when it closes."""
        if self._made is not None or self._begun:
            return self
        if self.mode == "overwrite" and self.existing:
            _warn_discarded(self.root, self.curator / "journal.json")
            shutil.rmtree(self.root)
            self.existing = False
        if not self.existing:
            self._made = "contents" if self.root.is_dir() else "root"
        self.curator.mkdir(parents=True, exist_ok=True)
        if not self.curator_only:
            self.release.mkdir(parents=True, exist_ok=True)
        return self

    def begin(self) -> "RunDirectory":
        """The run really starts (call after every check): ``prepare()``, then ``provenance.json``; a resumed run
        removes the temporary files a killed write left behind (``release/`` included)."""
        if self._begun:
            return self
        self.prepare()
        if self.existing:
            _remove_stale_temporaries(self.root)
        self._begun = True
        self._made = None
        self._write_provenance()
        return self

    def _write_provenance(self) -> None:
        inputs = {**((self._recorded or {}).get("inputs", {}) if self.mode == "resume" else {}), **self.inputs}
        provenance = {
            "format": PROVENANCE_FORMAT,
            "version": FORMAT_VERSION,
            "pipeline": self.pipeline,
            "config_sha256": self.config_sha256,
            "config": self.config,
            "inputs": inputs,
            "journal": self._head,
        }
        if provenance != self._recorded:  # a resumed run whose provenance is unchanged writes nothing
            atomic_write_json(self.provenance_path, provenance)
            self._recorded = provenance

    def ledger(self, budget: Optional[tuple[float, float]] = None, relation: Relation | str = Relation.ADD_REMOVE
               ) -> PrivacyLedger:
        """The run's ledger, journaled: recovered from an earlier attempt's journal, every change written ahead."""
        return self.attach(PrivacyLedger(budget, relation))

    def attach(self, ledger: PrivacyLedger) -> PrivacyLedger:
        """Make this run's journal the write-ahead log of ``ledger`` (what an earlier attempt authorised is charged
        as recorded; what ``ledger`` holds already is charged on top)."""
        if not self._begun:
            raise RuntimeError("RunDirectory.begin() must run before the journal is written")
        ledger.attach_journal(self._write_journal, recovered=self._ledger_state)
        return ledger

    def _write_journal(self, ledger_state: dict[str, Any]) -> None:
        """One record of the chain: the journal first, then its head in provenance.json (a stop between the two
        leaves the journal one record ahead, which ``_verify_chain`` accepts)."""
        body = _plain({
            "format": JOURNAL_FORMAT,
            "version": FORMAT_VERSION,
            "pipeline": self.pipeline,
            "config_sha256": self.config_sha256,
            "inputs": dict(self.inputs),
            "ledger": ledger_state,
            "completed": self._completed,
        })
        if self._journal is not None and body == {k: v for k, v in self._journal.items() if k != "chain"}:
            return  # nothing new to record (a resumed run re-attaching its ledger): the chain stays as it is
        seq = 1 if self._head is None else self._head["seq"] + 1
        prev = GENESIS if self._head is None else self._head["hash"]
        record = {**body, "chain": {"seq": seq, "prev": prev, "hash": _record_hash(prev, body)}}
        atomic_write_json(self.journal_path, record)
        self._journal = record
        self._ledger_state = body["ledger"]
        self._head = _head_of(record)
        self._write_provenance()

    def complete(self, name: str, manifest: Mapping[str, Any]) -> None:
        """Journal that artifact ``name`` is whole (written after its files; ``manifest`` is JSON-safe). The manifest
        records the journal's head and charges at this point (checked whenever the run is resumed)."""
        if self._ledger_state is None:
            raise RuntimeError("complete() needs the run's ledger journal (run.ledger())")
        self._completed = {**self._completed, name: {**dict(manifest), "journal": self.journal_witness()}}
        self._write_journal(self._ledger_state)

    def write_summaries(self, public: Optional[Mapping[str, Any]], curator: Mapping[str, Any]) -> None:
        """``release/summary.json`` (public) and ``curator/summary.json`` (full; written last: marks the run done)."""
        if public is not None:
            atomic_write_json(self.release / "summary.json", dict(public))
        atomic_write_json(self.summary_path, dict(curator))

    def read_summary(self, public: bool = True) -> dict[str, Any]:
        """A finished run's public summary (``release/summary.json``), or the curator's with ``public=False``."""
        path = self.summary_path if public is False or self.curator_only else self.release / "summary.json"
        summary = read_json(path, "run_dir.summary")
        if not isinstance(summary, dict):
            raise ValidationError("run_dir.summary", f"{path} is not a JSON object")
        return summary


def _plain(value: Any) -> Any:
    """``value`` as the JSON data a reader will load (numpy scalars, paths and tuples made plain)."""
    from dporl.utils.io import _json_default

    return json.loads(json.dumps(value, default=_json_default, allow_nan=True))


def _record_hash(prev: str, body: Mapping[str, Any]) -> str:
    return hashlib.sha256((prev + canonical_json(body)).encode()).hexdigest()


def _check_record(journal: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """The chain link of a journal record, after checking its hash."""
    chain = journal.get("chain")
    if not (isinstance(chain, dict) and isinstance(chain.get("seq"), int) and not isinstance(chain["seq"], bool)
            and chain["seq"] >= 1 and isinstance(chain.get("prev"), str) and isinstance(chain.get("hash"), str)):
        raise ValidationError("journal", f"{path} has no valid chain link; refusing to guess what it says")
    body = {key: value for key, value in journal.items() if key != "chain"}
    if _record_hash(chain["prev"], body) != chain["hash"]:
        raise ValidationError(
            "journal", f"{path} does not verify (its hash chain breaks at record {chain['seq']}): it was edited or "
            "damaged after it was written; refusing to resume from it or report what it says. Start a new run_dir "
            "(or --overwrite)"
        )
    return chain


def _head_of(journal: Mapping[str, Any]) -> dict[str, Any]:
    chain = journal["chain"]
    return {"seq": chain["seq"], "hash": chain["hash"], "charged": _tally(journal["ledger"])}


def _stages(ledger_state: Optional[Mapping[str, Any]]) -> list:
    stages = (ledger_state or {}).get("stages") or []
    return stages if isinstance(stages, list) else []


def _history(ledger_state: Optional[Mapping[str, Any]], stage: str) -> list:
    for entry in _stages(ledger_state):
        if isinstance(entry, dict) and entry.get("name") == stage:
            return list(((entry.get("accountant") or {}).get("history")) or [])
    return []


def _tally(ledger_state: Optional[Mapping[str, Any]]) -> dict[str, int]:
    """Events charged per stage in a saved ledger state."""
    tally = {}
    for entry in _stages(ledger_state):
        try:
            tally[str(entry["name"])] = sum(int(count) for _, count in entry["accountant"]["history"])
        except (KeyError, TypeError, ValueError):
            raise ValidationError("journal", "a stage's recorded events are malformed") from None
    return tally


def _extends(now: list, then: list) -> bool:
    """Whether the event history ``now`` continues ``then`` (same events in order; the last may have grown)."""
    if not then:
        return True
    if len(now) < len(then) or any(list(a) != list(b) for a, b in zip(now[: len(then) - 1], then[:-1])):
        return False
    (event_then, count_then), (event_now, count_now) = then[-1], now[len(then) - 1]
    return event_now == event_then and int(count_now) >= int(count_then)


def _remove_made(root: Path, made: str) -> None:
    """Undo ``prepare()`` of a run that never began: the directory it created, or the contents of the empty one it
    found."""
    if made == "root":
        shutil.rmtree(root, ignore_errors=True)
        return
    for child in list(root.iterdir()) if root.is_dir() else []:
        if child.is_dir() and not child.is_symlink():
            shutil.rmtree(child, ignore_errors=True)
        else:
            child.unlink(missing_ok=True)


def _remove_stale_temporaries(root: Path) -> None:
    """Remove what atomic writes killed mid-way left behind (the lock guarantees no writer is running)."""
    for path in root.rglob(".*"):
        if path.is_file() and not path.is_symlink() and ATOMIC_TEMP.match(path.name):
            print(f"run_dir: removing {path.relative_to(root)}, left by an interrupted write", file=sys.stderr)
            path.unlink(missing_ok=True)


def _read_versioned(path: Path, field: str, kind: str, required: Mapping[str, type]) -> dict[str, Any]:
    """A JSON file of format ``kind`` (this version) whose ``required`` keys have the given types."""
    value = read_json(path, field)
    if (
        not isinstance(value, dict)
        or value.get("format") != kind
        or value.get("version") != FORMAT_VERSION
        or not all(isinstance(value.get(key), type_) for key, type_ in required.items())
    ):
        raise ValidationError(field, f"{path} is not a {kind} v{FORMAT_VERSION} file; refusing to guess what it says")
    return value


def read_journal(path: str | Path) -> PrivacyLedger:
    """The ledger a journal file records (every authorised event, as authorised); validated (its hash chain link
    included), never guessed."""
    journal = _read_versioned(Path(path), "journal", JOURNAL_FORMAT, {"ledger": dict})
    _check_record(journal, Path(path))
    ledger = PrivacyLedger()
    ledger.load_state_dict(journal["ledger"])
    return ledger


def _warn_discarded(root: Path, journal_path: Path) -> None:
    """Say what an overwritten run had spent: the new run's guarantee does not include it."""
    spent = "no privacy journal"
    try:
        guarantee = read_journal(journal_path).report().guarantee
        spent = "nothing" if guarantee is None else f"eps={guarantee[0]:.4g}, delta={guarantee[1]:g}"
    except Exception:  # a corrupt journal of a run being discarded: still say that it existed
        if journal_path.exists():
            spent = "an unreadable amount (corrupt journal)"
    print(
        f"--overwrite: removing {root}; its journal records spending {spent}. That spend is NOT part of the new "
        "run's guarantee: if anything from the old run was shared, the two compose.",
        file=sys.stderr,
    )
