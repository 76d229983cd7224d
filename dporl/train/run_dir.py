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
"""

from __future__ import annotations

import hashlib
import json
import math
import shutil
import sys
from pathlib import Path
from typing import Any, Literal, Mapping, Optional, get_args

from dporl.privacy.ledger import PrivacyLedger
from dporl.privacy.units import Relation
from dporl.utils.io import atomic_write_json, read_json
from dporl.utils.validation import ValidationError

RunMode = Literal["new", "resume", "overwrite"]
RUN_MODES: tuple[str, ...] = get_args(RunMode)
PROVENANCE_FORMAT = "dporl-run"
JOURNAL_FORMAT = "dporl-privacy-journal"
FORMAT_VERSION = 1
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
        self._begun = False
        self.existing = self._inspect()

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
        if root.exists() and not root.is_dir():
            raise ValidationError("run_dir", f"{root} exists and is not a directory")
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
        if self._journal is not None:
            self._completed = dict(self._journal.get("completed") or {})
            self._ledger_state = self._journal["ledger"]
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
        journal = _read_versioned(path, "journal", JOURNAL_FORMAT, {"ledger": dict, "completed": dict})
        if journal.get("config_sha256") != self.config_sha256:
            raise ValidationError("journal", f"{path} belongs to another configuration than {self.provenance_path}")
        return journal

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
        """The manifest ``complete(name, ...)`` journaled, or None."""
        return self._completed.get(name)

    # ------------------------------------------------------------------ writes
    def begin(self) -> "RunDirectory":
        """The first write of the run (call after every check): removes the old directory in mode overwrite,
        creates the layout and writes ``provenance.json``."""
        if self._begun:
            return self
        if self.mode == "overwrite" and self.existing:
            _warn_discarded(self.root, self.curator / "journal.json")
            shutil.rmtree(self.root)
            self.existing = False
        self.curator.mkdir(parents=True, exist_ok=True)
        if not self.curator_only:
            self.release.mkdir(parents=True, exist_ok=True)
        self._begun = True
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
        atomic_write_json(
            self.journal_path,
            {
                "format": JOURNAL_FORMAT,
                "version": FORMAT_VERSION,
                "pipeline": self.pipeline,
                "config_sha256": self.config_sha256,
                "inputs": dict(self.inputs),
                "ledger": ledger_state,
                "completed": self._completed,
            },
        )
        self._ledger_state = ledger_state

    def complete(self, name: str, manifest: Mapping[str, Any]) -> None:
        """Journal that artifact ``name`` is whole (written after its files; ``manifest`` is JSON-safe)."""
        if self._ledger_state is None:
            raise RuntimeError("complete() needs the run's ledger journal (run.ledger())")
        self._completed = {**self._completed, name: dict(manifest)}
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
    """The ledger a journal file records (every authorised event, as authorised); validated, never guessed."""
    journal = _read_versioned(Path(path), "journal", JOURNAL_FORMAT, {"ledger": dict})
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
