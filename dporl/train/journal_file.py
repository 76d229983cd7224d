"""The privacy journal's file format: a hash chain of records, each the whole ledger state.

Each write of the journal (``dporl.train.run_dir.RunDirectory``) is a record of the whole ledger state with a chain
link: ``seq`` (writes so far), ``prev`` (the previous record's hash) and ``hash`` = sha256(prev, record). The chain
head (seq, hash, events charged per stage) is copied into ``provenance.json``; ``verify_chain`` refuses a journal
that is missing, edited, rolled back or foreign to that head. ``charged_per_stage``, ``stage_history`` and
``extends_history`` read the charges a saved ledger state records, for the witnesses that checkpoints and completion
manifests keep. ``read_journal`` loads the ledger a journal file records.
"""

from __future__ import annotations

import hashlib
from pathlib import Path
from typing import Any, Mapping, Optional

from dporl.privacy.ledger import PrivacyLedger
from dporl.train.provenance import canonical_json
from dporl.utils.io import json_ready, read_json
from dporl.utils.validation import ValidationError

PROVENANCE_FORMAT = "dporl-run"
JOURNAL_FORMAT = "dporl-privacy-journal"
FORMAT_VERSION = 2  # 2: the journal is a hash chain whose head provenance.json copies
GENESIS = "0" * 64  # the "previous hash" of a journal's first record


def plain(value: Any) -> Any:
    """``value`` as the JSON data a reader will load (numpy scalars, paths and tuples made plain)."""
    return json_ready(value)


def record_hash(prev: str, body: Mapping[str, Any]) -> str:
    return hashlib.sha256((prev + canonical_json(body)).encode()).hexdigest()


def check_record(journal: Mapping[str, Any], path: Path) -> dict[str, Any]:
    """The chain link of a journal record, after checking its hash."""
    chain = journal.get("chain")
    if not (isinstance(chain, dict) and isinstance(chain.get("seq"), int) and not isinstance(chain["seq"], bool)
            and chain["seq"] >= 1 and isinstance(chain.get("prev"), str) and isinstance(chain.get("hash"), str)):
        raise ValidationError("journal", f"{path} has no valid chain link; refusing to guess what it says")
    body = {key: value for key, value in journal.items() if key != "chain"}
    if record_hash(chain["prev"], body) != chain["hash"]:
        raise ValidationError(
            "journal", f"{path} does not verify (its hash chain breaks at record {chain['seq']}): it was edited or "
            "damaged after it was written; refusing to resume from it or report what it says. Start a new run_dir "
            "(or --overwrite)"
        )
    return chain


def head_of(journal: Mapping[str, Any]) -> dict[str, Any]:
    chain = journal["chain"]
    return {"seq": chain["seq"], "hash": chain["hash"], "charged": charged_per_stage(journal["ledger"])}


def _stages(ledger_state: Optional[Mapping[str, Any]]) -> list:
    stages = (ledger_state or {}).get("stages") or []
    return stages if isinstance(stages, list) else []


def stage_history(ledger_state: Optional[Mapping[str, Any]], stage: str) -> list:
    for entry in _stages(ledger_state):
        if isinstance(entry, dict) and entry.get("name") == stage:
            return list(((entry.get("accountant") or {}).get("history")) or [])
    return []


def charged_per_stage(ledger_state: Optional[Mapping[str, Any]]) -> dict[str, int]:
    """Events charged per stage in a saved ledger state."""
    tally = {}
    for entry in _stages(ledger_state):
        try:
            tally[str(entry["name"])] = sum(int(count) for _, count in entry["accountant"]["history"])
        except (KeyError, TypeError, ValueError):
            raise ValidationError("journal", "a stage's recorded events are malformed") from None
    return tally


def extends_history(now: list, then: list) -> bool:
    """Whether the event history ``now`` continues ``then`` (same events in order; the last may have grown)."""
    if not then:
        return True
    if len(now) < len(then) or any(list(a) != list(b) for a, b in zip(now[: len(then) - 1], then[:-1])):
        return False
    (event_then, count_then), (event_now, count_now) = then[-1], now[len(then) - 1]
    return event_now == event_then and int(count_now) >= int(count_then)


def read_versioned(path: Path, field: str, kind: str, required: Mapping[str, type]) -> dict[str, Any]:
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
    journal = read_versioned(Path(path), "journal", JOURNAL_FORMAT, {"ledger": dict})
    check_record(journal, Path(path))
    ledger = PrivacyLedger()
    ledger.load_state_dict(journal["ledger"])
    return ledger


def verify_chain(
journal: Optional[dict[str, Any]], head: Any, path: Path, provenance_path: Path
) -> Optional[dict[str, Any]]:
    """The verified chain head of ``journal`` against the copy provenance.json holds (``head``); refuses a
    missing, edited, rolled-back or foreign journal. The journal may be one record ahead of its copy (a run
    stopped between the two writes); never behind."""
    if head is not None and not (
        isinstance(head, dict) and isinstance(head.get("seq"), int) and isinstance(head.get("hash"), str)
    ):
        raise ValidationError("run_dir.provenance", f"{provenance_path}: malformed journal head {head!r}")
    if journal is None:
        if head is not None:
            raise ValidationError(
                "journal", f"{path} is missing, but {provenance_path.name} records {head['seq']} journal "
                "writes: the privacy spent by this run cannot be recovered; refusing to resume or re-run any "
                "paid step. Start a new run_dir (or --overwrite)"
            )
        return None
    chain = check_record(journal, path)
    expected = head["hash"] if head is not None else GENESIS
    seq = head["seq"] if head is not None else 0
    if head is not None and (chain["seq"], chain["hash"]) == (seq, expected):
        return head_of(journal)
    if chain["seq"] == seq + 1 and chain["prev"] == expected:
        return head_of(journal)  # written, then stopped before its head was copied
    if chain["seq"] <= seq:
        raise ValidationError(
            "journal", f"{path} is record {chain['seq']} of its chain but {provenance_path.name} records "
            f"{seq}: an older (or other) journal was put back; refusing to under-count. Start a new run_dir"
        )
    raise ValidationError(
        "journal", f"{path} (record {chain['seq']}) does not continue the chain head {provenance_path.name} "
        f"records (record {seq}): refusing to resume from a journal that is not this run's"
    )
