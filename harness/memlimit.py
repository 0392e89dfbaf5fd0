"""A real, hard memory limit for a child process: a memory cgroup (v1 or v2), or ``RLIMIT_AS``.

**A memory cgroup** (:class:`MemoryCgroup`) is what a container's memory limit is: the kernel charges every page
the child touches (anonymous memory, page cache it reads in) to the group, and when the group is at its limit
and nothing can be reclaimed it OOM-kills the largest process in it with SIGKILL, which no ``catch`` can
handle. The group is created beside the caller's own (cgroup v1: a child of the caller's ``memory`` group;
v2: a sibling under the parent whose ``cgroup.subtree_control`` has ``memory``), swap off for it where the
kernel allows (v1 ``memory.memsw.limit_in_bytes`` and ``memory.swappiness``, v2 ``memory.swap.max``), and the
child is moved into it between ``fork`` and ``exec`` (:meth:`MemoryCgroup.preexec`), so that everything it
allocates from its first instruction on is charged. What it reports, read from the kernel's own counters:
the OOM kills (v1 the ``oom_kill`` line of ``memory.oom_control``, v2 ``memory.events``), ``failcnt`` (v1),
the peak (v1 ``memory.max_usage_in_bytes``, v2 ``memory.peak``; both can be reset before the part measured)
and the usage without reclaimable page cache (:meth:`MemoryCgroup.anon_bytes`).

**Clean-up is absolute.** The group is removed on leaving the ``with`` (normally, on an exception, on
Ctrl-C: the removal is :func:`~harness.interrupt.shielded`), and at exit; every process still in it is
SIGKILLed first. A harness killed with SIGKILL cannot remove it, so groups are named
``pch-memlimit-<owner pid>-<owner start time>-<n>`` and every new group first sweeps the stale ones whose
owner is gone (:func:`sweep_stale`): their processes killed, the groups removed.

**RLIMIT_AS** is the other kind of limit: the child's address space is capped, an allocation past it fails
(``mmap`` returns ``ENOMEM``, ``operator new`` throws ``std::bad_alloc``), and the child decides what happens:
it can catch it. :func:`address_limit_preexec` sets it between ``fork`` and ``exec``;
:func:`limit_address_space` on a running process (``prlimit``), once its baseline is known.

Neither cgroup version usable is one line, :class:`~harness.errors.NoMemoryLimit` (exit 5).
"""

from __future__ import annotations

import atexit
import contextlib
import errno
import itertools
import os
import resource
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

from harness.errors import NoMemoryLimit
from harness.interrupt import shielded

__all__ = [
    "PREFIX",
    "CgroupCounters",
    "MemoryCgroup",
    "address_limit_preexec",
    "address_space",
    "cgroup_support",
    "limit_address_space",
    "sweep_stale",
]

PREFIX = "pch-memlimit-"
_SEQ = itertools.count(1)
_LIVE: set[MemoryCgroup] = set()
_LIVE_LOCK = threading.Lock()


@atexit.register
def _remove_all() -> None:
    with _LIVE_LOCK:
        live = list(_LIVE)
    for cg in live:
        with contextlib.suppress(Exception):
            cg.remove()


# --------------------------------------------------------------------------------------------
# where a group can be made
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Where:
    version: int  # 1 or 2
    base: Path  # the directory our groups are made in (and stale ones swept from)


def _mounts() -> list[tuple[str, str, str, str]]:
    """(mount point, root inside the hierarchy, fs type, super options) of every cgroup mount."""
    out = []
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return []
    for line in lines:
        left, _, right = line.partition(" - ")
        f, r = left.split(), right.split()
        if len(f) >= 5 and len(r) >= 3 and r[0] in ("cgroup", "cgroup2"):
            out.append((f[4].replace("\\040", " "), f[3], r[0], r[2]))
    return out


def _own_paths() -> dict[str, str]:
    """This process's cgroup per hierarchy: ``{"memory": "/a/b", "": "/x"}`` (``""`` is v2's)."""
    out = {}
    with contextlib.suppress(OSError):
        for line in Path("/proc/self/cgroup").read_text().splitlines():
            _, controllers, path = line.split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c] = path
    return out


def _under(mount: str, root: str, path: str) -> Path:
    rel = os.path.relpath(path, root) if root != "/" else path.lstrip("/")
    return Path(mount) if rel in ("", ".") else Path(mount) / rel


def _locate() -> tuple[_Where | None, list[str]]:
    """Where groups can be made, v1 ``memory`` first, then v2; else None and why each is unusable."""
    why: list[str] = []
    own = _own_paths()
    mounts = _mounts()
    v1 = [m for m in mounts if m[2] == "cgroup" and "memory" in m[3].split(",")]
    if v1:
        mount, root, _, _ = v1[0]
        base = _under(mount, root, own.get("memory", "/"))
        if not base.is_dir():  # a namespaced view: fall back to the mount itself
            base = Path(mount)
        if os.access(base, os.W_OK) and (base / "memory.limit_in_bytes").exists():
            return _Where(1, base), why
        why.append(f"cgroup v1 memory at {base} is not writable (run as root)")
    else:
        why.append("no cgroup v1 memory hierarchy is mounted")
    v2 = [m for m in mounts if m[2] == "cgroup2"]
    if v2:
        mount, root, _, _ = v2[0]
        mine = _under(mount, root, own.get("", "/"))
        base = mine if mine == Path(mount) else mine.parent
        try:
            controllers = (base / "cgroup.controllers").read_text().split()
        except OSError:
            controllers = []
        if "memory" not in controllers:
            why.append(f"cgroup v2 at {mount} has no memory controller for {base}")
        elif not os.access(base, os.W_OK):
            why.append(f"cgroup v2 {base} is not writable (run as root)")
        else:
            sub = base / "cgroup.subtree_control"
            try:
                if "memory" not in sub.read_text().split():
                    sub.write_text("+memory")
                return _Where(2, base), why
            except OSError as e:
                why.append(f"cgroup v2: cannot enable memory in {sub}: {e.strerror}")
    else:
        why.append("no cgroup v2 is mounted")
    return None, why


def cgroup_support() -> tuple[int, Path] | None:
    """(version, directory groups are made in), or None when neither cgroup version is usable here."""
    where, _ = _locate()
    return None if where is None else (where.version, where.base)


# --------------------------------------------------------------------------------------------
# stale groups
# --------------------------------------------------------------------------------------------


def _start_time(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks since boot (field 22 of /proc/PID/stat), None if gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _owner_alive(name: str) -> bool:
    parts = name[len(PREFIX) :].split("-")
    try:
        pid, start = int(parts[0]), int(parts[1])
    except (ValueError, IndexError):
        return True  # not one of ours after all: leave it alone
    return _start_time(pid) == start


def _procs(path: Path) -> list[int]:
    try:
        return [int(x) for x in (path / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def _kill_and_remove(path: Path, timeout: float = 10.0) -> bool:
    """SIGKILL every process in the group, then remove it (retrying while the kernel still holds it)."""
    deadline = time.monotonic() + timeout
    while True:
        for pid in _procs(path):
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)
        try:
            path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError as e:
            if e.errno not in (errno.EBUSY, errno.ENOTEMPTY) or time.monotonic() > deadline:
                return False
        time.sleep(0.02)


def sweep_stale(base: Path | None = None) -> list[str]:
    """Remove the groups left by harness runs that are gone (killed with SIGKILL); the names removed."""
    if base is None:
        where, _ = _locate()
        if where is None:
            return []
        base = where.base
    removed = []
    with contextlib.suppress(OSError):
        for p in sorted(base.iterdir()):
            if p.is_dir() and p.name.startswith(PREFIX) and not _owner_alive(p.name) and _kill_and_remove(p):
                removed.append(p.name)
    return removed


# --------------------------------------------------------------------------------------------
# the group
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CgroupCounters:
    """What the kernel counted for a group, read at one moment."""

    version: int
    limit_bytes: int | None  # None: unlimited
    usage_bytes: int
    anon_bytes: int  # usage without reclaimable page cache
    peak_bytes: int  # since the last reset_peak (or the group's creation)
    oom_kills: int  # processes the OOM killer killed in the group
    failcnt: int | None  # v1: times the limit was hit; v2: memory.events "max"

    def to_json(self) -> dict[str, int | None]:
        return {
            "cgroup_version": self.version,
            "limit_bytes": self.limit_bytes,
            "usage_bytes": self.usage_bytes,
            "anon_bytes": self.anon_bytes,
            "peak_bytes": self.peak_bytes,
            "oom_kills": self.oom_kills,
            "failcnt": self.failcnt,
        }


class MemoryCgroup:
    """A memory cgroup with a hard limit, removed when done; use it as a context manager::

        with MemoryCgroup(limit_bytes=1 << 30) as cg:
            proc = subprocess.Popen(argv, preexec_fn=cg.preexec)   # charged from its first instruction
            ...
            cg.counters().oom_kills

    ``limit_bytes=None`` starts it unlimited (:meth:`set_limit` later, e.g. once a baseline is measured).
    Raises :class:`~harness.errors.NoMemoryLimit` (exit 5) when neither cgroup version is usable.
    """

    def __init__(self, limit_bytes: int | None = None, *, tag: str = "") -> None:
        self._initial = limit_bytes
        self._tag = "".join(c if c.isalnum() or c in "_." else "_" for c in tag)[-40:]  # a directory name
        self.path: Path | None = None
        self.version = 0
        self._peak_fd: int | None = None  # v2: memory.peak is reset per open file

    # -- lifecycle -------------------------------------------------------------------------

    def __enter__(self) -> MemoryCgroup:
        self.create()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.remove()

    def create(self) -> None:
        where, why = _locate()
        if where is None:
            raise NoMemoryLimit("no memory limit can be set on this machine: " + "; ".join(why))
        sweep_stale(where.base)
        me = os.getpid()
        name = f"{PREFIX}{me}-{_start_time(me)}-{next(_SEQ)}" + (f"-{self._tag}" if self._tag else "")
        path = where.base / name
        with shielded():  # known before a Ctrl-C can end the run
            try:
                path.mkdir()
            except OSError as e:
                raise NoMemoryLimit(f"cannot create the memory cgroup {path}: {e.strerror}") from None
            self.path, self.version = path, where.version
            with _LIVE_LOCK:
                _LIVE.add(self)
        try:
            self._swap_off()
            if self._initial is not None:
                self.set_limit(self._initial)
        except BaseException:
            self.remove()
            raise

    def remove(self) -> None:
        """Kill whatever is left in the group and remove it (idempotent)."""
        path = self.path
        if path is None:
            return
        with shielded():
            if self._peak_fd is not None:
                with contextlib.suppress(OSError):
                    os.close(self._peak_fd)
                self._peak_fd = None
            _kill_and_remove(path)
            self.path = None
            with _LIVE_LOCK:
                _LIVE.discard(self)

    # -- the child -------------------------------------------------------------------------

    def preexec(self) -> None:  # pragma: no cover - runs in the child between fork and exec
        """Move the calling process into the group (``preexec_fn``: the child, before ``exec``)."""
        assert self.path is not None
        with open(self.path / "cgroup.procs", "w") as f:
            f.write(str(os.getpid()))

    def add(self, pid: int) -> None:
        """Move a running process into the group (what it allocated before stays charged elsewhere)."""
        self._write("cgroup.procs", str(pid))

    def pids(self) -> list[int]:
        return [] if self.path is None else _procs(self.path)

    # -- the limit -------------------------------------------------------------------------

    def _file(self, name: str) -> Path:
        if self.path is None:
            raise RuntimeError("the cgroup was not created, or was removed")
        return self.path / name

    def _write(self, name: str, value: str) -> None:
        self._file(name).write_text(value)

    def _read(self, name: str) -> str:
        return self._file(name).read_text()

    def _swap_off(self) -> None:
        """No swap for the group where the kernel lets us say so (the limit then means RAM)."""
        if self.version == 1:
            with contextlib.suppress(OSError):
                self._write("memory.swappiness", "0")
        else:
            with contextlib.suppress(OSError):
                self._write("memory.swap.max", "0")

    def set_limit(self, nbytes: int | None) -> None:
        """The hard limit (None: unlimited). v1 keeps ``memsw`` (memory + swap) equal to it: no swap."""
        if self.version == 2:
            self._write("memory.max", "max" if nbytes is None else str(nbytes))
            return
        value = "-1" if nbytes is None else str(nbytes)
        memsw = self._file("memory.memsw.limit_in_bytes")
        has_memsw = memsw.exists()
        current = int(self._read("memory.limit_in_bytes"))
        raising = nbytes is None or nbytes > current
        # the kernel keeps limit <= memsw: raise memsw first, lower it last
        if has_memsw and raising:
            memsw.write_text(value)
        self._write("memory.limit_in_bytes", value)
        if has_memsw and not raising:
            memsw.write_text(value)

    def reset_peak(self) -> None:
        """Start the peak over from the current usage (v2: kernel >= 6.12, else the peak since creation)."""
        if self.version == 1:
            self._write("memory.max_usage_in_bytes", "0")
            return
        if self._peak_fd is not None:
            os.close(self._peak_fd)
            self._peak_fd = None
        with contextlib.suppress(OSError):
            fd = os.open(self._file("memory.peak"), os.O_RDWR)
            try:
                os.write(fd, b"reset\n")
            except OSError:
                os.close(fd)
                return
            self._peak_fd = fd

    # -- the counters ----------------------------------------------------------------------

    def _keyed(self, name: str) -> dict[str, int]:
        """A flat keyed file (``memory.stat``, ``memory.events``, ``memory.oom_control``) as a dict."""
        out = {}
        for line in self._read(name).splitlines():
            k, _, v = line.partition(" ")
            with contextlib.suppress(ValueError):
                out[k] = int(v)
        return out

    def usage(self) -> int:
        return int(self._read("memory.usage_in_bytes" if self.version == 1 else "memory.current"))

    def anon_bytes(self) -> int:
        """The usage without the page cache the kernel would reclaim before it OOM-kills."""
        st = self._keyed("memory.stat")
        if self.version == 1:
            file = st.get("total_inactive_file", 0) + st.get("total_active_file", 0)
        else:
            file = st.get("inactive_file", 0) + st.get("active_file", 0)
        return max(0, self.usage() - file)

    def peak(self) -> int:
        if self.version == 1:
            return int(self._read("memory.max_usage_in_bytes"))
        if self._peak_fd is not None:
            return int(os.pread(self._peak_fd, 64, 0).split()[0])
        try:
            return int(self._read("memory.peak"))
        except OSError:  # kernels before 5.19 have no memory.peak
            return self.usage()

    def limit(self) -> int | None:
        raw = self._read("memory.limit_in_bytes" if self.version == 1 else "memory.max").strip()
        if raw == "max" or int(raw) >= 1 << 62:
            return None
        return int(raw)

    def oom_kills(self) -> int:
        if self.version == 1:
            return self._keyed("memory.oom_control").get("oom_kill", 0)
        return self._keyed("memory.events").get("oom_kill", 0)

    def failcnt(self) -> int | None:
        if self.version == 1:
            return int(self._read("memory.failcnt"))
        return self._keyed("memory.events").get("max")

    def counters(self) -> CgroupCounters:
        return CgroupCounters(
            self.version, self.limit(), self.usage(), self.anon_bytes(), self.peak(), self.oom_kills(), self.failcnt()
        )


# --------------------------------------------------------------------------------------------
# RLIMIT_AS
# --------------------------------------------------------------------------------------------


def address_limit_preexec(nbytes: int) -> Callable[[], None]:
    """A ``preexec_fn`` capping the child's address space at ``nbytes`` (``RLIMIT_AS``, soft and hard)."""

    def preexec() -> None:  # pragma: no cover - runs in the child between fork and exec
        resource.setrlimit(resource.RLIMIT_AS, (nbytes, nbytes))

    return preexec


def limit_address_space(pid: int, nbytes: int | None) -> None:
    """Cap a running process's address space (``prlimit``; None lifts it). An allocation that would take the
    process past it fails from then on; what it already has stays."""
    value = resource.RLIM_INFINITY if nbytes is None else nbytes
    resource.prlimit(pid, resource.RLIMIT_AS, (value, value))


def address_space(pid: int) -> int:
    """``VmSize`` of ``pid`` in bytes: what ``RLIMIT_AS`` is compared with."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    raise ProcessLookupError(pid)
