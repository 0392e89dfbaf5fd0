"""Ctrl-C for every command: the first ends the run cleanly, the second at once; no child outlives either.

:func:`guard` (``python -m harness`` runs every command inside it; :func:`harness.campaign.engine.run_campaign`
enters it too, so a campaign keeps its promise as a library) takes SIGINT and SIGTERM:

* **It hears them however the process was started.** A shell's background job (``cmd &`` in a script,
  ``bash -c '... &'``) starts with SIGINT *ignored*, and a blocked signal mask is inherited through
  ``exec``: Python then keeps SIGINT ignored and Ctrl-C or ``kill -INT`` is lost for the whole run. The
  guard unignores and unblocks both signals, and so does :func:`take_signals`, which
  ``harness/__main__.py`` calls before its first import (SIGTERM is caught from then on).
* **The first raises** :class:`KeyboardInterrupt` in the main thread: the command's ``finally`` clauses
  stop its servers and kill its children, it prints what it has (a campaign's summary) and exits 130.
  Inside :func:`shielded` (starting a child and recording its pid, writing a report, the cleanup and
  the summary) the first is held and raised when the section ends, so a child is never started
  without being known, and a cleanup or a summary is never cut in the middle. It is never lost:
  a KeyboardInterrupt raised inside ``fork``'s at-fork hooks (``subprocess`` with ``preexec_fn``
  runs logging's) or inside a finalizer is swallowed by Python ("Exception ignored in ..."); starting
  a child is shielded, and the loops that wait call :func:`check`, which raises it again.
* **The second ends the process at once**: every live child process group this process started is
  SIGKILLed, one line goes to stderr, and the exit code is 130 (``os._exit``: no cleanup that could wait).

Every child that runs in a process group of its own (:mod:`harness.child`, ``llama-server`` in
:mod:`harness.targets.llama_server`) is :func:`track`\\ ed while it lives; when a guard ends on an
interrupt, whatever it started and is still tracked is killed (a child whose owner lost it between
``fork`` and the return of ``Popen`` included). :func:`interrupted` tells cleanup code to skip grace
periods (a server is SIGKILLed, not asked to stop).

This module imports nothing of the project but :mod:`harness.errors`: everything may use it.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
import signal
import sys
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any, NoReturn

from harness.errors import EXIT_INTERRUPTED

__all__ = [
    "SIGNALS",
    "check",
    "exit_now",
    "guard",
    "in_forked_child",
    "interrupted",
    "shielded",
    "take_signals",
    "track",
    "untrack",
]

SIGNALS = (signal.SIGINT, signal.SIGTERM)
AGAIN = b"interrupted again: every child killed, exiting at once\n"


class _State:
    def __init__(self) -> None:
        self.depth = 0  # nested guards; only the outermost installs and restores the handlers
        self.received = 0  # signals received inside the outermost guard
        self.shield = 0  # nested shielded sections
        self.pending = False  # the first signal arrived inside a shielded section: raise at its end


_state = _State()
_groups: set[int] = set()  # process-group leaders of live children (set.add/discard/copy are atomic)


def track(pid: int) -> None:
    """``pid`` leads a process group of its own: kill it on a second Ctrl-C, or if its owner loses it."""
    _groups.add(pid)


def untrack(pid: int) -> None:
    _groups.discard(pid)


def interrupted() -> bool:
    """Ctrl-C or SIGTERM was received by the current guard: clean up without grace periods."""
    return _state.received > 0


def _raise(signum: int, frame: FrameType | None) -> None:
    raise KeyboardInterrupt


def check() -> None:
    """Raise the Ctrl-C again if one came and the run goes on: Python swallows a KeyboardInterrupt raised
    inside a finalizer, a weakref callback or an at-fork hook ("Exception ignored in ..."), so the loops
    that must end on Ctrl-C (waiting for children, a soak's sampler) call this once per turn."""
    if _state.received and not _state.shield and threading.current_thread() is threading.main_thread():
        raise KeyboardInterrupt


def exit_now(code: int) -> NoReturn:
    """End an interrupted process whose cleanup is done: its ``atexit`` handlers, its output flushed, and then
    ``os._exit``, without the interpreter's teardown of every imported library (0.4 s of CPU, seconds on a
    loaded host: the larger part of a Ctrl-C's latency)."""
    gc.disable()  # no collection of a large heap now: it would free nothing the exit needs
    with contextlib.suppress(Exception):
        atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def take_signals() -> None:
    """Before a guard: SIGINT and SIGTERM raise :class:`KeyboardInterrupt`, even when they were inherited
    ignored (a script's background job) or blocked."""
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, _raise)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)


def _kill_groups(pids: tuple[int, ...]) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pid, signal.SIGKILL)


def _handler(signum: int, frame: FrameType | None) -> None:
    _state.received += 1
    if _state.received > 1:  # the second: now, whatever the process was doing
        _kill_groups(tuple(_groups))
        with contextlib.suppress(OSError):
            os.write(2, AGAIN)
        os._exit(EXIT_INTERRUPTED)
    if _state.shield:
        _state.pending = True
        return
    raise KeyboardInterrupt


@contextlib.contextmanager
def guard() -> Iterator[None]:
    """SIGINT and SIGTERM as the module says, for the time of the ``with`` (re-entrant; main thread only:
    elsewhere, and in a forked child, it changes nothing)."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers run in the main thread only
        return
    if _state.depth:
        _state.depth += 1
        try:
            yield
        finally:
            _state.depth -= 1
        return
    old = {s: signal.getsignal(s) for s in SIGNALS}
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, SIGNALS)
    before = set(_groups)
    _state.received, _state.pending, _state.shield = 0, False, 0
    for s in SIGNALS:
        signal.signal(s, _handler)
    old_hook = sys.unraisablehook

    def unraisable(u: Any) -> None:
        # a Ctrl-C raised inside a finalizer: Python would print "Exception ignored in ..." and its traceback;
        # it is already counted, and check() raises it again where the run can end
        if u.exc_type is not KeyboardInterrupt:
            old_hook(u)

    sys.unraisablehook = unraisable
    _state.depth = 1
    try:
        yield
    finally:
        try:
            if _state.received:  # children the run started and did not stop (or lost): not past its end
                _kill_groups(tuple(_groups - before))
        finally:
            _state.depth = 0
            sys.unraisablehook = old_hook
            for s, h in old.items():
                signal.signal(s, h if h is not None else signal.SIG_DFL)
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)


@contextlib.contextmanager
def shielded(*, reraise: bool = True) -> Iterator[None]:
    """A section the first signal does not cut: it is held and raised at the end of the outermost section
    (``reraise=False``: only recorded, :func:`interrupted` says so). A second signal still ends the process."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    with guard():
        _state.shield += 1
        try:
            yield
        finally:
            _state.shield -= 1
            if not _state.shield and _state.pending:
                _state.pending = False
                if reraise:
                    raise KeyboardInterrupt


def in_forked_child() -> None:
    """In a forked child: Python's own SIGINT and SIGTERM again, and none of the parent's children."""
    _groups.clear()
    _state.depth = _state.received = _state.shield = 0
    _state.pending = False
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
