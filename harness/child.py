"""Run a child process that may die, hang or exhaust memory, and report what happened to it.

The fault layers that cannot run inside the runner (``pymem``, ``rlimit``, ``native``) run their
target in a child through :func:`run_child`. It promises:

* **The runner survives.** A child killed by a signal or stuck past its timeout is a
  :class:`ChildResult` (``status`` ``"signalled"`` or ``"timeout"``), never an exception. The child
  runs in its own session; on timeout, and in every case in ``finally``, its whole process group is
  killed, so a forked grandchild cannot outlive the run.
* **Stacks of a crashed child.** The child gets the path of a stacks file in ``FAULTS_STACKS``. A
  Python child calls :func:`child_setup`, which enables :mod:`faulthandler` on that file (Python
  stacks on SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL) and a watchdog that dumps every thread and
  exits when the child overruns. The native shim writes the C stack (``backtrace``) to the same
  file on a fatal signal. :attr:`ChildResult.stacks` holds whatever was written.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import IO

__all__ = ["STACKS_ENV", "WATCHDOG_ENV", "ChildResult", "child_setup", "child_stacks_file", "run_child"]

STACKS_ENV = "FAULTS_STACKS"
WATCHDOG_ENV = "FAULTS_WATCHDOG"
_stacks_file: IO[str] | None = None  # kept open for faulthandler for the child's lifetime


@dataclass
class ChildResult:
    """How a child ended: ``exited`` (``returncode``), ``signalled`` (``signal``) or ``timeout``."""

    argv: list[str]
    status: str
    returncode: int | None
    signal: str | None
    stdout: str
    stderr: str
    stacks: str
    elapsed: float

    @property
    def crashed(self) -> bool:
        """The child died of a signal or had to be killed: a finding, with :attr:`stacks`."""
        return self.status != "exited"

    def describe(self) -> str:
        if self.status == "exited":
            return f"exited with {self.returncode}"
        if self.status == "signalled":
            return f"killed by {self.signal}"
        return f"timed out after {self.elapsed:.1f}s and was killed"


def run_child(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 60.0,
    preload: str | None = None,
) -> ChildResult:
    """Run ``argv`` with ``FAULTS_STACKS`` (and ``LD_PRELOAD=preload``); never raises for its death."""
    with tempfile.TemporaryDirectory(prefix="faults-child-") as tmp:
        stacks = os.path.join(tmp, "stacks.txt")
        child_env = dict(os.environ if env is None else env)
        child_env[STACKS_ENV] = stacks
        child_env[WATCHDOG_ENV] = f"{max(1.0, timeout - 2.0):.1f}"
        child_env.setdefault("PYTHONFAULTHANDLER", "1")
        if preload is not None:
            child_env["LD_PRELOAD"] = preload
        t0 = time.monotonic()
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=child_env,
            start_new_session=True,
            text=True,
            errors="replace",
        )
        timed_out = False
        try:
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc)
                out, err = proc.communicate(timeout=10)
        finally:
            _kill_group(proc)
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        elapsed = time.monotonic() - t0
        try:
            with open(stacks, errors="replace") as f:
                stack_text = f.read()
        except OSError:
            stack_text = ""
    rc = proc.returncode
    if timed_out:
        status, sig = "timeout", None
    elif rc is not None and rc < 0:
        status, sig = "signalled", signal.Signals(-rc).name
    else:
        status, sig = "exited", None
    return ChildResult(list(argv), status, None if rc is None or rc < 0 else rc, sig, out, err, stack_text, elapsed)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)


def child_stacks_file() -> IO[str]:
    """The stream faulthandler writes to in this child (the stacks file, else stderr)."""
    return _stacks_file or sys.stderr


def child_setup(*, watchdog: bool = True) -> None:
    """In a Python child: faulthandler on the stacks file, and (``watchdog``) the parent's watchdog."""
    global _stacks_file
    path = os.environ.get(STACKS_ENV)
    if path and _stacks_file is None:
        _stacks_file = open(path, "a")  # noqa: SIM115 - must stay open for faulthandler
        faulthandler.enable(_stacks_file, all_threads=True)
    seconds = os.environ.get(WATCHDOG_ENV)
    if watchdog and seconds:
        faulthandler.dump_traceback_later(float(seconds), exit=True, file=child_stacks_file())
