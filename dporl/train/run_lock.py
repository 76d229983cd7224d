"""One process per run directory: an exclusive OS lock taken before a run reads or writes anything there.

The lock is ``fcntl.flock(LOCK_EX | LOCK_NB)`` on ``PARENT/.NAME.dporl-lock``, beside the run directory ``NAME``
(its real path, so two spellings of one directory share one lock). Beside, not inside: the lock must exist before
the run directory does (two processes creating one directory at once both hold nothing yet) and must outlive
``--overwrite`` removing it. The holder writes its pid into the file; a second process is refused by name
(``run_dir``: "another dporl process (pid N) holds this run directory"), before any query or spend.

The kernel releases a flock when its holder dies (SIGKILL included), so a lock file whose lock can be taken is
stale: its recorded pid no longer holds it. A stale lock is reported and taken over, never trusted. A holder
removes the file on release, while still holding it; a process that opened the file just before that removal
checks, after locking, that the path still names the inode it locked, and retries otherwise.

Within one process the lock is shared: opening the same run directory again (a pipeline's check, then its run)
counts a reference instead of refusing itself. Parent directories created to hold the lock are removed again
(when empty) once the last reference is released.
"""

from __future__ import annotations

import errno
import fcntl
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

from dporl.utils.validation import ValidationError

LOCK_SUFFIX = ".dporl-lock"
HOLDER_PID_POLLS = 100  # x 10 ms: how long a refused process waits for the holder to record its pid


@dataclass
class _Held:
    fd: int
    path: Path
    count: int = 1
    created: list[Path] = field(default_factory=list)  # parent directories this process created, deepest last


_HELD: dict[str, _Held] = {}
_GUARD = threading.Lock()


def lock_path(root: str | os.PathLike) -> Path:
    """Where the lock of run directory ``root`` lives (beside it, in its real parent)."""
    real = Path(os.path.realpath(root))
    if real.parent == real:
        raise ValidationError("run_dir", f"{root} is a filesystem root; a run directory needs a parent")
    return real.parent / f".{real.name}{LOCK_SUFFIX}"


def acquire(root: str | os.PathLike) -> Path:
    """Take the lock of ``root`` (or one more reference to this process's); returns the lock file's path.

    Raises ValidationError("run_dir") naming the holder's pid when another process holds it.
    """
    path = lock_path(root)
    key = str(path)
    with _GUARD:
        held = _HELD.get(key)
        if held is not None:
            held.count += 1
            return path
        created = _make_parents(path.parent)
        try:
            fd, stale = _lock(path, root)
        except BaseException:
            _remove_empty(created)
            raise
        _HELD[key] = _Held(fd, path, created=created)
    if stale is not None:
        print(f"run_dir: found a stale lock of {root} (pid {stale} left it and no longer holds it: it ended "
              "without releasing it, e.g. killed); taking it over", file=sys.stderr)
    return path


def release(path: Path) -> None:
    """Drop one reference; the last removes the lock file (while still holding it) and unlocks."""
    with _GUARD:
        held = _HELD.get(str(path))
        if held is None:
            return
        held.count -= 1
        if held.count > 0:
            return
        del _HELD[str(path)]
        try:
            if _same_file(held.fd, path):
                path.unlink()
        except OSError:
            pass
        os.close(held.fd)  # releases the flock
        _remove_empty(held.created)


def holds(root: str | os.PathLike) -> bool:
    """Whether this process holds the lock of ``root``."""
    return str(lock_path(root)) in _HELD


def _lock(path: Path, root) -> tuple[int, Optional[str]]:
    """(locked fd, pid recorded by a stale holder or None)."""
    flags = os.O_RDWR | os.O_CREAT | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_CLOEXEC", 0)
    for _ in range(100):
        try:
            fd = os.open(path, flags, 0o600)
        except OSError as exc:
            if exc.errno == errno.ELOOP:
                raise ValidationError("run_dir", f"the lock file {path} is a symbolic link: refusing to follow it")
            raise ValidationError("run_dir", f"cannot create the lock file {path} ({exc.strerror})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            busy = exc.errno in (errno.EWOULDBLOCK, errno.EAGAIN, errno.EACCES)
            holder = _read_pid(fd)
            for _ in range(HOLDER_PID_POLLS if busy else 0):  # a holder writes its pid just after it locks
                if holder:
                    break
                time.sleep(0.01)
                holder = _read_pid(fd)
            os.close(fd)
            if busy:
                raise ValidationError(
                    "run_dir", f"another dporl process (pid {holder or 'unknown'}) holds this run directory ({root}); "
                    "wait for it to finish or stop it (nothing was read or written)"
                ) from None
            raise ValidationError("run_dir", f"cannot lock {path} ({exc.strerror})") from None
        if not _same_file(fd, path):  # removed or replaced by its last holder between our open and our lock
            os.close(fd)
            continue
        stale = _read_pid(fd)
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return fd, stale or None
    raise ValidationError("run_dir", f"could not take the lock {path}: it keeps being replaced")


def _same_file(fd: int, path: Path) -> bool:
    try:
        on_disk = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (mine.st_dev, mine.st_ino) == (on_disk.st_dev, on_disk.st_ino)


def _read_pid(fd: int) -> str:
    try:
        text = os.pread(fd, 64, 0).decode("ascii", "replace").strip()
    except OSError:
        return ""
    return text if text.isdigit() else ""


def _make_parents(directory: Path) -> list[Path]:
    """Create ``directory`` and its missing ancestors one by one; the ones this call created, outermost first."""
    missing = []
    current = directory
    while not current.exists():
        missing.append(current)
        current = current.parent
    created = []
    for path in reversed(missing):
        try:
            path.mkdir()
            created.append(path)
        except FileExistsError:  # another process made it first: it is not ours to remove
            pass
        except OSError as exc:
            _remove_empty(created)
            raise ValidationError("run_dir", f"cannot create {path} ({exc.strerror})") from None
    return created


def _remove_empty(created: list[Path]) -> None:
    for path in reversed(created):
        try:
            path.rmdir()
        except OSError:  # not empty (the run, or someone else, put something there): keep it
            break
