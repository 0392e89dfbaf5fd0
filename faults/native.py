"""Native allocation faults: an LD_PRELOAD shim that fails the Nth malloc, calloc or realloc.

``shim.c`` (beside this file) interposes the three allocation functions; when call ``nth`` after
arming returns NULL, C++ ``operator new`` throws ``std::bad_alloc`` inside native code.
``new_demo.cpp`` is a small C++ program that allocates through ``new`` and, depending on a flag,
catches the ``bad_alloc`` or lets it terminate the process (SIGABRT), the way an exception escaping
llama-server's task loop would.

What this module promises:

* :func:`build_shim` and :func:`build_new_demo` compile with the system ``gcc``/``g++`` on first
  use and cache the result under the user cache dir (``$PROMPT_CACHE_HARNESS_CACHE``, else
  ``$XDG_CACHE_HOME/prompt-cache-harness``, else ``~/.cache/prompt-cache-harness``), keyed by a
  hash of the source, so an edited source is rebuilt. A missing compiler raises
  :class:`NativeUnavailable` with one line.
* :func:`run_native` runs any command under the shim in a child (:func:`harness.child.run_child`):
  armed from the start through ``FAULTSHIM_NTH``, or left for the child to arm at run time with
  ``faultshim_arm`` (``ctypes`` in Python, ``dlsym`` in C/C++; see :class:`ShimControl`). A
  SIGABRT or SIGSEGV of the child comes back as a :class:`~harness.child.ChildResult` with
  ``crashed`` set and the C stack (and, for Python children, the Python stack) in ``stacks``.
* :class:`RemoteShim` arms the shim inside a process that cannot call us (``llama-server``): it gives
  the environment to start that process with, and :meth:`~RemoteShim.arm` writes
  ``"NTH PERSISTENT MIN_SIZE"`` to the arm file and sends SIGUSR2, so that the process's ``nth``
  allocation of at least ``min_size`` bytes (:data:`LARGE_ALLOCATION` unless given) fails;
  :meth:`~RemoteShim.observe` says where it failed (:func:`faults.sites.observe` of what the shim wrote
  since that arming: the failed allocation's call stack, a fatal signal's).
* :func:`run_new_demo` classifies the demo's run as a :class:`faults.kinds.Outcome`:
  ``accepted-error`` (it caught and printed the ``bad_alloc``), ``aborted`` (SIGABRT with a stack),
  ``ok`` (the fault did not fire), ``killed`` (another signal, or a hang) or ``crash`` (it exited
  with an error).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import re
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from faults.kinds import Outcome
from faults.sites import Observation, observe
from harness.child import ChildResult, run_child
from harness.errors import Unavailable, UsageError

__all__ = [
    "LARGE_ALLOCATION",
    "DemoResult",
    "NativeUnavailable",
    "RemoteShim",
    "ShimControl",
    "build_new_demo",
    "build_shim",
    "cache_dir",
    "run_native",
    "run_new_demo",
]

_HERE = Path(__file__).resolve().parent

#: What counts as a large allocation: a cache state or checkpoint buffer, not the small bookkeeping around it.
LARGE_ALLOCATION = 512 * 1024


class NativeUnavailable(Unavailable):
    """The native layer cannot run here (no compiler, or compilation failed): one line."""


def cache_dir() -> Path:
    explicit = os.environ.get("PROMPT_CACHE_HARNESS_CACHE")
    if explicit:
        return Path(explicit)
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "prompt-cache-harness"


def _build(source: str, compiler: str, flags: Sequence[str], suffix: str) -> Path:
    src = _HERE / source
    cc = shutil.which(compiler)
    if cc is None:
        raise NativeUnavailable(f"{compiler} not found: the native fault layer needs it to build {source}")
    digest = hashlib.sha256(src.read_bytes() + " ".join(flags).encode()).hexdigest()[:12]
    out = cache_dir() / f"{src.stem}-{digest}{suffix}"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{src.stem}-", suffix=suffix, dir=out.parent)
    os.close(fd)
    try:
        proc = subprocess.run(
            [cc, *flags, "-o", tmp, str(src), "-ldl"], capture_output=True, text=True, timeout=120, check=False
        )
        if proc.returncode != 0:
            first = (proc.stderr.strip().splitlines() or ["no output"])[0]
            raise NativeUnavailable(f"{compiler} failed to build {source}: {first}")
        os.chmod(tmp, 0o755)
        os.replace(tmp, out)  # atomic: a concurrent build of the same source is harmless
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def build_shim() -> Path:
    """The shared object of ``shim.c`` (built on first use, then cached)."""
    return _build("shim.c", "gcc", ["-O2", "-Wall", "-shared", "-fPIC"], ".so")


def build_new_demo() -> Path:
    """The executable of ``new_demo.cpp`` (built on first use, then cached)."""
    return _build("new_demo.cpp", "g++", ["-O0", "-g", "-rdynamic", "-Wall"], "")


class ShimControl:
    """Arm and disarm the preloaded shim from inside a Python process that runs under it."""

    def __init__(self) -> None:
        lib = ctypes.CDLL(None)
        try:
            self._arm = lib.faultshim_arm
            self._disarm = lib.faultshim_disarm
            self._count = lib.faultshim_count
        except AttributeError:
            raise NativeUnavailable("the fault shim is not preloaded in this process (LD_PRELOAD)") from None
        self._arm.argtypes = [ctypes.c_long, ctypes.c_int]
        self._arm.restype = None
        self._disarm.restype = ctypes.c_long
        self._count.restype = ctypes.c_long

    def arm(self, nth: int, *, persistent: bool = False) -> None:
        self._arm(nth, int(persistent))

    def disarm(self) -> int:
        return int(self._disarm())

    def count(self) -> int:
        return int(self._count())


def run_native(
    argv: Sequence[str],
    *,
    nth: int | None = None,
    persistent: bool = False,
    timeout: float = 30.0,
    env: Mapping[str, str] | None = None,
    min_size: int = 0,
) -> ChildResult:
    """Run ``argv`` under the shim; with ``nth``, armed from load time (else the child arms it).

    ``min_size``: only allocations of at least that many bytes are counted and can fail.
    """
    child_env = dict(os.environ if env is None else env)
    child_env.pop("FAULTSHIM_NTH", None)
    if nth is not None:
        child_env["FAULTSHIM_NTH"] = str(nth)
        child_env["FAULTSHIM_PERSISTENT"] = "1" if persistent else "0"
    if min_size:
        child_env["FAULTSHIM_MIN_SIZE"] = str(min_size)
    return run_child(argv, env=child_env, timeout=timeout, preload=str(build_shim()))


class RemoteShim:
    """The shim preloaded into another process (``llama-server``) and armed from here with SIGUSR2.

    Start the process with :meth:`env` merged into its environment, then :meth:`arm` it right
    before the request whose allocation should fail and :meth:`disarm` it afterwards::

        shim = RemoteShim(tmp_path)
        with ServerProcess(binary, Launch(model=model), env=shim.env()) as srv:
            shim.arm(srv.pid, 1)          # the next allocation of >= 512 KiB fails
            ...                           # a request that saves a slot to the cache
            fired = shim.disarm(srv.pid)  # how many allocations failed meanwhile

    A crash's C stack (the shim writes it on SIGABRT/SIGSEGV) is in :meth:`stacks`, and the stack of every
    allocation the shim failed too; :meth:`observe` reads the failed allocation's site from them.
    """

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.arm_file = self.directory / "faultshim.arm"
        self.stacks_file = self.directory / "faultshim.stacks"
        self._armed_at = 0  # the stacks file's length at the last arm: what the shim wrote since is its trial

    def env(self) -> dict[str, str]:
        """The environment the process must start with (builds the shim on first use)."""
        return {
            "LD_PRELOAD": str(build_shim()),
            "FAULTSHIM_ARM_FILE": str(self.arm_file),
            "FAULTS_STACKS": str(self.stacks_file),
            "GGML_NO_BACKTRACE": "1",  # ggml would attach gdb to a dying process: seconds per crash
        }

    def arm(self, pid: int, nth: int, *, min_size: int = LARGE_ALLOCATION, persistent: bool = False) -> None:
        """From now on, fail the process's ``nth`` allocation of at least ``min_size`` bytes (and, if
        ``persistent``, every later one)."""
        if nth < 1:
            raise ValueError(f"nth must be >= 1, got {nth}")
        self._armed_at = self.stacks_file.stat().st_size if self.stacks_file.exists() else 0
        self._signal(pid, f"{nth} {int(persistent)} {min_size}")

    def disarm(self, pid: int, timeout: float = 5.0) -> int | None:
        """Disarm; the number of allocations that failed since :meth:`arm` (None: the process is gone
        or did not answer within ``timeout``)."""
        before = self._fired_lines()
        try:
            self._signal(pid, "0 0 0")
        except ProcessLookupError:
            return None
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            lines = self._fired_lines()
            if len(lines) > len(before):
                return lines[-1]
            time.sleep(0.01)
        return None

    def stacks(self) -> str:
        """What the shim wrote: ``faultshim: fired N`` per signal, and the C stack of a fatal signal."""
        try:
            return self.stacks_file.read_text(errors="replace")
        except FileNotFoundError:
            return ""

    def observe(self, modules: Mapping[str, str] | None = None) -> Observation:
        """Where the allocation that failed since the last :meth:`arm` was made, and the fatal signal if the
        process died (``modules``: paths of modules by file name, for frames dladdr left unnamed)."""
        try:
            text = self.stacks_file.read_bytes()[self._armed_at :].decode(errors="replace")
        except FileNotFoundError:
            text = ""
        return observe(text, modules)

    def _signal(self, pid: int, line: str) -> None:
        # SIGUSR2 kills a process that has no handler for it: make sure it runs with our environment
        try:
            environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        except FileNotFoundError:
            raise ProcessLookupError(f"process {pid} is gone") from None
        except OSError:
            environ = None  # no /proc or not ours to read: trust the caller
        if environ is not None and f"FAULTSHIM_ARM_FILE={self.arm_file}".encode() not in environ:
            raise UsageError(f"process {pid} was not started with this RemoteShim's env(): it cannot be armed")
        tmp = self.arm_file.with_suffix(".tmp")
        tmp.write_text(line + "\n")
        os.replace(tmp, self.arm_file)  # the handler never reads a half-written line
        os.kill(pid, signal.SIGUSR2)

    def _fired_lines(self) -> list[int]:
        return [int(m) for m in re.findall(r"^faultshim: fired (\d+)$", self.stacks(), re.M)]


@dataclass
class DemoResult:
    """What :func:`run_new_demo` saw: ``outcome`` and, when caught, the allocation that failed."""

    outcome: Outcome  # accepted-error (caught) | aborted | ok (the fault did not fire) | killed | crash
    failed_at: int | None
    child: ChildResult

    def describe(self) -> str:
        if self.outcome == Outcome.ACCEPTED:
            return f"caught std::bad_alloc at allocation #{self.failed_at}"
        if self.outcome == Outcome.ABORTED:
            return f"terminated by {self.child.signal} (std::bad_alloc had no handler); stack captured"
        if self.outcome == Outcome.OK:
            return "completed: the fault did not fire"
        return f"unexpected: {self.child.describe()}: {self.child.stderr.strip()[:200]}"


def run_new_demo(nth: int, *, catch: bool, count: int = 16, timeout: float = 30.0) -> DemoResult:
    """Run ``new_demo`` under the shim with allocation ``nth`` failing; classify how it ended."""
    child = run_native(
        [str(build_new_demo()), "--catch" if catch else "--no-catch", str(nth), str(count)], timeout=timeout
    )
    m = re.search(r"caught std::bad_alloc: .* at allocation #(\d+)", child.stdout)
    if child.status == "exited" and child.returncode == 0 and m:
        return DemoResult(Outcome.ACCEPTED, int(m.group(1)), child)
    if child.status == "signalled" and child.signal == "SIGABRT":
        return DemoResult(Outcome.ABORTED, None, child)
    if child.status == "exited" and child.returncode == 0 and "completed" in child.stdout:
        return DemoResult(Outcome.OK, None, child)
    return DemoResult(Outcome.KILLED if child.crashed else Outcome.CRASH, None, child)


def _main() -> int:
    for catch in (True, False):
        r = run_new_demo(3, catch=catch)
        print(f"new_demo {'--catch' if catch else '--no-catch'} 3: {r.describe()}")
        if r.child.stacks:
            print("  " + r.child.stacks.strip().replace("\n", "\n  "))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
