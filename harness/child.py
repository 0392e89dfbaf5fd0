"""Run a child process that may die, hang or exhaust memory, and report what happened to it.

The fault layers that cannot run inside the runner (``pymem``, ``rlimit``, ``native``) run their
target in a child through :func:`run_child`, and nothing else in the project forks or spawns a
child of its own. The child is either a command (``argv``: a fresh process, e.g. ``python -m
faults.pymem --child``) or a function (a **forked** copy of the caller that runs it and exits):
forking is for children that must start from the caller's state, e.g. a loaded model shared by
thousands of native-fault trials, or an address-space measurement whose ``VmPeak`` must start at
the caller's current size (``fork`` resets it) rather than include the set-up. It promises:

* **The runner survives.** A child killed by a signal or stuck past its timeout is a
  :class:`ChildResult` (``status`` ``"signalled"`` or ``"timeout"``), never an exception. The child
  runs in its own session; on timeout, on Ctrl-C, and in every case in ``finally``, its whole
  process group is killed and the child is reaped, so neither it nor a grandchild outlives the run.
  It is started inside :func:`harness.interrupt.shielded` and tracked while it lives
  (:func:`harness.interrupt.track`): a Ctrl-C never falls between its start and its caller knowing
  it, and a second Ctrl-C kills it at once with the process.
* **What it printed.** ``stdout`` and ``stderr`` of either kind of child are captured (a forked
  child's file descriptors 1 and 2 are redirected, so C libraries' output is captured too); a
  function's return value is the exit status (``None``: 0), an exception escaping it is printed to
  its ``stderr`` and exits 1.
* **Stacks of a crashed child.** The child gets the path of a stacks file in ``FAULTS_STACKS``. A
  Python child calls :func:`child_setup`, which enables :mod:`faulthandler` on that file (Python
  stacks on SIGSEGV, SIGABRT, SIGBUS, SIGFPE, SIGILL) and a watchdog that dumps every thread and
  exits when the child overruns. The native shim writes the C stack (``backtrace``) to the same
  file on a fatal signal. :attr:`ChildResult.stacks` holds whatever was written. A forked child
  inherits its parent's stacks file (faulthandler and the shim keep it open): its ``stacks`` are
  what it appended there.

A tool that runs to its end with its output in a file (a build step) goes through :func:`run_logged`:
its own session too, SIGINT and then SIGKILL for its group when the caller is interrupted.

A child that must run *beside* the caller (the workers of a fuzz campaign) is started with
:func:`spawn` instead: it returns at once with a :class:`Spawned` whose stdout is read line by line
without blocking (:func:`read_lines`). The same promises hold: its own session, its whole process
group killed in :meth:`Spawned.kill` (call it in ``finally``; :func:`spawn` callers use it as a
context manager), and on Linux it dies with the caller (``PR_SET_PDEATHSIG``) even when the caller
is killed by SIGKILL and cannot clean up.
"""

from __future__ import annotations

import contextlib
import ctypes
import faulthandler
import os
import select
import signal
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, NoReturn

from harness.interrupt import check, in_forked_child, shielded, track, untrack

__all__ = [
    "STACKS_ENV",
    "TOOL_GRACE",
    "WATCHDOG_ENV",
    "ChildResult",
    "Spawned",
    "child_setup",
    "child_stacks_file",
    "read_lines",
    "run_child",
    "run_logged",
    "spawn",
]

STACKS_ENV = "FAULTS_STACKS"
WATCHDOG_ENV = "FAULTS_WATCHDOG"
TOOL_GRACE = 2.0  # seconds a tool interrupted by Ctrl-C has to clean up (run_logged) before SIGKILL
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
    argv: Sequence[str] | Callable[[], int | None],
    *,
    env: Mapping[str, str] | None = None,
    timeout: float = 60.0,
    preload: str | None = None,
    preexec: Callable[[], None] | None = None,
) -> ChildResult:
    """Run ``argv`` with ``FAULTS_STACKS`` (and ``LD_PRELOAD=preload``); never raises for its death.

    ``preexec`` runs in the child between ``fork`` and ``exec`` (entering a memory cgroup, setting an
    rlimit: :mod:`harness.memlimit`). ``argv`` may be a function instead: it runs in a forked
    child, which inherits the environment and the preloaded libraries of the caller (``env``,
    ``preload`` and ``preexec`` are refused).
    """
    if callable(argv):
        if env is not None or preload is not None or preexec is not None:
            raise ValueError(
                "a forked child inherits the caller's environment: env, preload and preexec are for commands"
            )
        return _run_forked(argv, timeout)
    with tempfile.TemporaryDirectory(prefix="faults-child-") as tmp:
        stacks = os.path.join(tmp, "stacks.txt")
        child_env = dict(os.environ if env is None else env)
        child_env[STACKS_ENV] = stacks
        child_env[WATCHDOG_ENV] = f"{max(1.0, timeout - 2.0):.1f}"
        child_env.setdefault("PYTHONFAULTHANDLER", "1")
        if preload is not None:
            child_env["LD_PRELOAD"] = preload
        t0 = time.monotonic()
        proc: subprocess.Popen[str] | None = None
        timed_out = False
        try:
            with shielded():  # a Ctrl-C now is raised once the child is known, inside this try
                proc = subprocess.Popen(
                    list(argv),
                    stdin=subprocess.DEVNULL,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.PIPE,
                    env=child_env,
                    start_new_session=True,
                    text=True,
                    errors="replace",
                    preexec_fn=preexec,
                )
                track(proc.pid)
            try:
                out, err = proc.communicate(timeout=timeout)
            except subprocess.TimeoutExpired:
                timed_out = True
                _kill_group(proc)
                out, err = proc.communicate(timeout=10)
        finally:
            if proc is not None:
                _kill_group(proc)
                if proc.poll() is None:
                    proc.kill()
                    proc.wait(timeout=10)
                untrack(proc.pid)
        elapsed = time.monotonic() - t0
        try:
            with open(stacks, errors="replace") as f:
                stack_text = f.read()
        except OSError:
            stack_text = ""
    assert proc is not None  # started, or the try above raised
    return _result(list(argv), proc.returncode, timed_out, out, err, stack_text, elapsed)


def _result(
    argv: list[str], rc: int | None, timed_out: bool, out: str, err: str, stacks: str, elapsed: float
) -> ChildResult:
    if timed_out:
        status, sig = "timeout", None
    elif rc is not None and rc < 0:
        status, sig = "signalled", signal.Signals(-rc).name
    else:
        status, sig = "exited", None
    return ChildResult(argv, status, None if rc is None or rc < 0 else rc, sig, out, err, stacks, elapsed)


def _kill_group(proc: subprocess.Popen[str]) -> None:
    _kill_pid_group(proc.pid)


def _kill_pid_group(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pid, signal.SIGKILL)


# ---- forked children ----------------------------------------------------------------------------


def _run_forked(fn: Callable[[], int | None], timeout: float) -> ChildResult:
    argv = [f"<fork {getattr(fn, '__qualname__', type(fn).__name__)}>"]
    inherited = os.environ.get(STACKS_ENV)  # the native shim keeps writing there: read what the fork appends
    offset = _file_size(inherited)
    with tempfile.TemporaryFile() as out_f, tempfile.TemporaryFile() as err_f, tempfile.TemporaryFile() as stacks_f:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()  # or the child would write the parent's pending output again
        t0 = time.monotonic()
        exited = False
        pid = 0
        try:
            with shielded():  # a Ctrl-C now is raised once the child is known, inside this try
                pid = os.fork()
                if pid == 0:
                    _forked(fn, out_f.fileno(), err_f.fileno(), inherited, stacks_f.fileno())
                track(pid)
            exited = _wait_exit(pid, timeout)
        finally:
            if pid:
                _kill_pid_group(pid)  # grandchildren, and the child itself on timeout or Ctrl-C
                if not exited:  # also when it was stopped before its setsid made the group
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, signal.SIGKILL)
                _, status = os.waitpid(pid, 0)
                untrack(pid)
        elapsed = time.monotonic() - t0
        out, err = _read_all(out_f), _read_all(err_f)
        stacks = _read_from(inherited, offset) if inherited else _read_all(stacks_f)
    rc = os.waitstatus_to_exitcode(status) if exited else None
    return _result(argv, rc, not exited, out, err, stacks, elapsed)


def _forked(fn: Callable[[], int | None], out_fd: int, err_fd: int, stacks: str | None, stacks_fd: int) -> NoReturn:
    """The forked child: its own session, output to the capture files, ``fn``'s status; never returns."""
    code = 1
    try:
        in_forked_child()
        os.setsid()
        os.dup2(out_fd, 1)
        os.dup2(err_fd, 2)
        # Python's streams may not be file descriptors 1 and 2 (a test runner's capture): rebind them
        sys.stdout = open(1, "w", errors="replace", closefd=False)  # noqa: SIM115 - lives until _exit
        sys.stderr = open(2, "w", errors="replace", closefd=False)  # noqa: SIM115
        if stacks:
            stacks_fd = os.open(stacks, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        faulthandler.enable(stacks_fd, all_threads=True)
        ret = fn()
        code = 0 if ret is None else int(ret)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        with contextlib.suppress(Exception):
            traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            with contextlib.suppress(Exception):
                stream.flush()
        os._exit(code)


def _wait_exit(pid: int, timeout: float) -> bool:
    """Wait for ``pid`` to exit without reaping it (a zombie keeps its group killable); False on timeout."""
    deadline = time.monotonic() + timeout
    try:
        pidfd = os.pidfd_open(pid)
    except (AttributeError, OSError):
        pidfd = None
    if pidfd is not None:
        try:
            ready, _, _ = select.select([pidfd], [], [], max(0.0, timeout))
            return bool(ready)
        finally:
            os.close(pidfd)
    delay = 0.001
    while time.monotonic() < deadline:  # no pidfd (an old kernel): poll without reaping
        info = os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        if info is not None:
            return True
        time.sleep(delay)
        delay = min(delay * 2, 0.05)
    return False


def _file_size(path: str | None) -> int:
    try:
        return os.path.getsize(path) if path else 0
    except OSError:
        return 0


def _read_from(path: str | None, offset: int) -> str:
    if not path:
        return ""
    try:
        with open(path, errors="replace") as f:
            f.seek(offset)
            return f.read()
    except OSError:
        return ""


def _read_all(f: IO[bytes]) -> str:
    f.seek(0)
    return f.read().decode(errors="replace")


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


# ---- a tool run to its end ------------------------------------------------------------------------


def run_logged(
    argv: Sequence[str],
    out: IO[str],
    *,
    cwd: str | os.PathLike[str] | None = None,
    env: Mapping[str, str] | None = None,
) -> int:
    """Run a tool (a build step) to its end, its output to the file ``out``; its exit code.

    Its own session, tracked, dying with the caller (so a ``kill -INT`` of the caller reaches it, not only
    a terminal's Ctrl-C): when this returns by an exception (Ctrl-C) its group gets SIGINT, so that a build
    tool removes what it had half written (ninja does), then SIGKILL after :data:`TOOL_GRACE` seconds.
    """
    proc: subprocess.Popen[bytes] | None = None
    try:
        with shielded():  # a Ctrl-C now is raised once the tool is known, inside this try
            proc = subprocess.Popen(
                list(argv), stdin=subprocess.DEVNULL, stdout=out, stderr=subprocess.STDOUT, cwd=cwd,
                env=None if env is None else {**os.environ, **env},
                start_new_session=True, preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )  # fmt: skip
            track(proc.pid)
        return proc.wait()
    finally:
        if proc is not None:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGINT)
                with contextlib.suppress(subprocess.TimeoutExpired):
                    proc.wait(timeout=TOOL_GRACE)
            _kill_pid_group(proc.pid)  # what is left of its group, and the tool itself
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
            untrack(proc.pid)


# ---- children beside the caller -----------------------------------------------------------------


def _die_with_parent() -> None:  # pragma: no cover - runs in the child between fork and exec
    """Linux: SIGKILL this child when the process that spawned it dies (even by SIGKILL)."""
    with contextlib.suppress(Exception):
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(signal.SIGKILL), 0, 0, 0)  # PR_SET_PDEATHSIG


class Spawned:
    """A child started by :func:`spawn`: stdout a pipe read without blocking, stderr a file."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str] | None, stderr_path: str) -> None:
        self.argv = list(argv)
        self.stderr_path = stderr_path
        self._buf = b""
        self.eof = False
        with open(stderr_path, "wb") as err, shielded():  # known before a Ctrl-C is raised
            self.proc = subprocess.Popen(
                self.argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=err,
                env=None if env is None else dict(env),
                start_new_session=True,
                preexec_fn=_die_with_parent if sys.platform == "linux" else None,
            )
            track(self.proc.pid)
        assert self.proc.stdout is not None
        self.fd = self.proc.stdout.fileno()
        os.set_blocking(self.fd, False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()

    def _read(self) -> list[str]:
        """The complete lines readable now (the last partial line too, at end of file)."""
        chunks = []
        while not self.eof:
            try:
                chunk = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                break
            if not chunk:
                self.eof = True
                break
            chunks.append(chunk)
        data = self._buf + b"".join(chunks)
        *lines, self._buf = data.split(b"\n")
        if self.eof and self._buf:
            lines.append(self._buf)
            self._buf = b""
        return [line.decode(errors="replace") for line in lines]

    def stderr_tail(self, n: int = 5) -> str:
        try:
            with open(self.stderr_path, errors="replace") as f:
                return " | ".join(line.rstrip() for line in f.readlines()[-n:])
        except OSError:
            return ""

    def kill(self, *, close: bool = True) -> None:
        """Kill the child's whole process group and reap it (idempotent). ``close=False`` keeps its stdout
        open: what it wrote before it died can still be read (:meth:`drain`)."""
        _kill_pid_group(self.proc.pid)
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=10)
        untrack(self.proc.pid)
        if close and self.proc.stdout is not None:
            with contextlib.suppress(OSError):
                self.proc.stdout.close()
            self.eof = True

    def drain(self) -> list[str]:
        """The lines still unread of a child that is dead (:meth:`kill` with ``close=False``)."""
        if self.proc.stdout is None or self.proc.stdout.closed:
            return []
        return self._read()

    def __enter__(self) -> Spawned:
        return self

    def __exit__(self, *exc: object) -> None:
        self.kill()


def spawn(argv: Sequence[str], *, stderr_path: str, env: Mapping[str, str] | None = None) -> Spawned:
    """Start ``argv`` beside the caller and return at once; the caller must :meth:`Spawned.kill` it."""
    return Spawned(argv, env, stderr_path)


def read_lines(children: Sequence[Spawned], timeout: float) -> list[tuple[Spawned, str]]:
    """Wait up to ``timeout`` s for output of any child; every complete line read, with its child."""
    check()  # a Ctrl-C Python swallowed (in a finalizer) still ends the wait
    live = [c for c in children if not c.eof]
    if not live:
        time.sleep(max(0.0, min(timeout, 0.05)))
        return []
    ready, _, _ = select.select([c.fd for c in live], [], [], max(0.0, timeout))
    return [(c, line) for c in live if c.fd in ready for line in c._read()]
