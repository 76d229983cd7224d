"""Interrupting a run without throwing paid work away.

A paid unit of work (a training step, the stable-prefix release, a private evaluation) is charged in the journal
before it runs; stopping in the middle of it wastes what was paid. Inside ``deferred_interrupts()`` the first SIGINT
or SIGTERM is held: the work in flight finishes, the code that polls ``pending()`` (the training loop, after each
step) saves its state and raises ``Interrupted``; a block that does not poll raises it when it ends. A second
signal stops at once (KeyboardInterrupt, or ``Interrupted`` for SIGTERM) and says that paid work may be lost.

``Interrupted`` carries where the run stopped; the command line prints it with the command that continues the
run and exits 128 + the signal number (130 for SIGINT, 143 for SIGTERM), without a traceback.
Signals are handled only in the main thread (elsewhere the blocks are plain blocks).
"""

from __future__ import annotations

import contextlib
import signal
import sys
import threading
from typing import Iterator, Optional

_SIGNALS = (signal.SIGINT, signal.SIGTERM)


class Interrupted(Exception):
    """A run stopped on a signal; ``where`` says how far it got (e.g. "at step 40 of 60"), ``detail`` what was
    saved and charged."""

    def __init__(self, signum: int, where: str = "", *, step: Optional[int] = None, total: Optional[int] = None,
                 detail: str = ""):
        self.signum = int(signum)
        self.step, self.total, self.detail = step, total, detail
        self.where = where or (f"at step {step} of {total}" if step is not None and total is not None else "")
        super().__init__(f"interrupted ({signal.Signals(self.signum).name}) {self.where}".rstrip())

    @property
    def exit_code(self) -> int:
        return 128 + self.signum


class _State:
    depth = 0
    pending: Optional[int] = None
    previous: dict[int, object] = {}


def pending() -> Optional[int]:
    """The signal received inside the current ``deferred_interrupts()`` block, or None."""
    return _State.pending


def _handler(signum, frame) -> None:
    if _State.pending is None:
        _State.pending = signum
        print(f"\n{signal.Signals(signum).name}: finishing the paid work in flight, then saving and stopping "
              "(signal again to stop at once: paid work may then be lost)", file=sys.stderr, flush=True)
        return
    if signum == signal.SIGINT:
        raise KeyboardInterrupt
    raise Interrupted(signum, "at once (second signal): the work in flight was lost; its charge stays")


@contextlib.contextmanager
def deferred_interrupts() -> Iterator[None]:
    """Hold SIGINT / SIGTERM until the block ends (or a poller raises); see the module docstring."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    outer = _State.depth == 0
    if outer:
        _State.pending = None
        _State.previous = {s: signal.signal(s, _handler) for s in _SIGNALS}
    _State.depth += 1
    try:
        yield
    finally:
        _State.depth -= 1
        if outer:
            for s, previous in _State.previous.items():
                signal.signal(s, previous)
            _State.previous = {}
    if outer and _State.pending is not None:
        signum, _State.pending = _State.pending, None
        raise Interrupted(signum, "after the paid work in flight finished")


@contextlib.contextmanager
def terminate_as_interrupt() -> Iterator[None]:
    """SIGTERM raises ``Interrupted`` (like SIGINT raises KeyboardInterrupt) while the block runs, so a command line
    can stop on either without a traceback. Main thread only."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def stop(signum, frame):
        raise Interrupted(signum, "before it finished")

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, previous)
