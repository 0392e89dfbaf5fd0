"""The slot-file sandbox: a directory tree a ``llama-server`` saves slots into, watched for anything outside.

The tree (under one fresh temporary ``base``)::

    base/                     watched
      root/                   watched
        save/                 watched: ``--slot-save-path`` (given without its trailing slash, which
                              common/arg.cpp:3622-3624 appends at 0c1e570)
          link.bin -> ../outside/secret.bin     planted symlinks
          dirlink  -> ../outside
          new.bin  -> ../outside/created.bin    (dangling)
        outside/              watched: secret.bin, planted
        save-evil/            watched: the sibling a missing separator would reach ("save" + "-evil...")
      elsewhere/              watched: where the absolute-path names point

Two real oracles, both outside ``save/``: a :class:`Snapshot` of every entry (type, size, mtime, inode, mode,
symlink target, sha256 of regular files) taken before and after a request, and Linux inotify
(:class:`Inotify`, ``inotify_init1``/``inotify_add_watch`` through ctypes on libc) on every directory of the
tree, which sees a file *opened or read* even when nothing changes (a restore reading through a symlink).
inotify reports an event on the directory that holds the real file, so a write through ``save/link.bin`` is
an event in ``outside/``. :meth:`Sandbox.reset` puts the planted state back between names.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import hashlib
import os
import shutil
import struct
import tempfile
from dataclasses import dataclass
from pathlib import Path

from harness.errors import Unavailable

__all__ = ["SECRET", "SYMLINKS", "Entry", "Event", "Inotify", "Sandbox", "Snapshot", "diff"]

SECRET = b"planted secret: not a slot file\n"
#: the planted symlinks: name in save/ -> target (relative to save/)
SYMLINKS: dict[str, str] = {
    "link.bin": "../outside/secret.bin",
    "dirlink": "../outside",
    "new.bin": "../outside/created.bin",
}

_IN = {
    "ACCESS": 0x001, "MODIFY": 0x002, "ATTRIB": 0x004, "CLOSE_WRITE": 0x008, "CLOSE_NOWRITE": 0x010,
    "OPEN": 0x020, "MOVED_FROM": 0x040, "MOVED_TO": 0x080, "CREATE": 0x100, "DELETE": 0x200,
}  # fmt: skip
_IN_ISDIR = 0x40000000
_IN_Q_OVERFLOW = 0x4000
_IN_NONBLOCK = 0o4000
_IN_CLOEXEC = 0o2000000
_HEADER = struct.Struct("iIII")  # struct inotify_event: wd, mask, cookie, len


@dataclass(frozen=True)
class Event:
    """One inotify event: the watched directory (relative to the sandbox's base), the entry's name in it
    ("" for the directory itself) and the event names (``OPEN``, ``ACCESS``, ``CREATE``, ``MODIFY``, ...)."""

    dir: str
    name: str
    kinds: tuple[str, ...]

    @property
    def path(self) -> str:
        return f"{self.dir}/{self.name}" if self.name else self.dir


class Inotify:
    """inotify on a set of directories through libc (no dependency): :meth:`read` drains what is queued.

    A kernel without inotify (or a libc without it) raises :class:`OSError`, which :class:`Sandbox` turns into
    one :class:`~harness.errors.Unavailable` line (exit 2): the oracle would be blind to reads."""

    def __init__(self) -> None:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        self._add = libc.inotify_add_watch
        self._add.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        fd = int(libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC))
        if fd < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"inotify_init1: {os.strerror(e)}")
        self.fd = fd
        self._dirs: dict[int, str] = {}
        self.overflowed = False

    def watch(self, path: Path, label: str) -> None:
        mask = 0
        for v in _IN.values():
            mask |= v
        wd = int(self._add(self.fd, os.fsencode(path), mask))
        if wd < 0:
            e = ctypes.get_errno()
            raise OSError(e, f"inotify_add_watch {path}: {os.strerror(e)}")
        self._dirs[wd] = label

    def read(self) -> list[Event]:
        out: list[Event] = []
        while True:
            try:
                buf = os.read(self.fd, 1 << 16)
            except BlockingIOError:
                return out
            except OSError as e:  # pragma: no cover - EINTR
                if e.errno == errno.EINTR:
                    continue
                raise
            off = 0
            while off < len(buf):
                wd, mask, _cookie, n = _HEADER.unpack_from(buf, off)
                name = buf[off + _HEADER.size : off + _HEADER.size + n].rstrip(b"\0")
                off += _HEADER.size + n
                if mask & _IN_Q_OVERFLOW:
                    self.overflowed = True
                    continue
                kinds = tuple(k for k, v in _IN.items() if mask & v) + (("ISDIR",) if mask & _IN_ISDIR else ())
                if wd in self._dirs:
                    out.append(Event(self._dirs[wd], os.fsdecode(name), kinds))

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


@dataclass(frozen=True)
class Entry:
    """What a snapshot records of one path: the bytes hashed only for regular files."""

    kind: str  # "file" | "dir" | "link" | "other"
    size: int
    mtime_ns: int
    ino: int
    mode: int
    target: str = ""  # a symlink's target
    sha256: str = ""


Snapshot = dict[str, Entry]  # path relative to the base -> entry


def diff(before: Snapshot, after: Snapshot) -> list[str]:
    """What changed between two snapshots, one line per path: ``created``, ``removed`` or ``changed (fields)``."""
    out = []
    for p in sorted(before.keys() | after.keys()):
        a, b = before.get(p), after.get(p)
        if a is None:
            out.append(f"{p}: created")
        elif b is None:
            out.append(f"{p}: removed")
        elif a != b:
            fields = [f for f in ("kind", "size", "mtime_ns", "ino", "mode", "target", "sha256")
                      if getattr(a, f) != getattr(b, f)]  # fmt: skip
            out.append(f"{p}: changed ({', '.join(fields)})")
    return out


class Sandbox:
    """The tree above, created under a fresh temporary directory; use it as a context manager."""

    WATCHED = ("", "root", "root/save", "root/outside", "root/save-evil", "elsewhere")

    def __init__(self) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="slot-files-")).resolve()
        self.save = self.base / "root" / "save"
        self.outside = self.base / "root" / "outside"
        self.elsewhere = self.base / "elsewhere"
        self.notify: Inotify | None = None
        for d in self.WATCHED:
            (self.base / d).mkdir(exist_ok=True)
        self.reset()

    def __enter__(self) -> Sandbox:
        try:
            self.notify = Inotify()
            for d in self.WATCHED:
                self.notify.watch(self.base / d, d or ".")
        except OSError as e:
            self.close()
            raise Unavailable(f"inotify: {e}; without it the slot-files oracle cannot see reads") from None
        self.notify.read()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.notify is not None:
            self.notify.close()
            self.notify = None
        shutil.rmtree(self.base, ignore_errors=True)

    def reset(self) -> None:
        """The planted state again: save/ holds only the symlinks, outside/ only secret.bin, the rest empty."""
        for d in self.WATCHED:
            keep = {"root": {"save", "outside", "save-evil"}, "": {"root", "elsewhere"}}.get(d, set())
            for p in (self.base / d).iterdir():
                if p.name in keep:
                    continue
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p)
                else:
                    p.unlink()
        (self.outside / "secret.bin").write_bytes(SECRET)
        for name, target in SYMLINKS.items():
            (self.save / name).symlink_to(target)

    def snapshot(self) -> Snapshot:
        """Every entry of the tree, symlinks not followed (``lstat``), regular files hashed."""
        snap: Snapshot = {}
        for top, dirs, files in os.walk(self.base, followlinks=False):
            for n in dirs + files:
                p = Path(top, n)
                st = p.lstat()
                rel = p.relative_to(self.base).as_posix()
                if p.is_symlink():
                    snap[rel] = Entry("link", st.st_size, st.st_mtime_ns, st.st_ino, st.st_mode, os.readlink(p))
                elif p.is_dir():
                    snap[rel] = Entry("dir", 0, st.st_mtime_ns, st.st_ino, st.st_mode)
                elif p.is_file():
                    digest = hashlib.sha256(p.read_bytes()).hexdigest()
                    snap[rel] = Entry("file", st.st_size, st.st_mtime_ns, st.st_ino, st.st_mode, sha256=digest)
                else:
                    snap[rel] = Entry("other", st.st_size, st.st_mtime_ns, st.st_ino, st.st_mode)
        return snap

    def events(self) -> list[Event]:
        """What inotify queued since the last call (an overflow loses events: raised, the oracle went blind)."""
        assert self.notify is not None, "use the sandbox as a context manager"
        ev = self.notify.read()
        if self.notify.overflowed:
            raise Unavailable("inotify's queue overflowed: events were lost, the oracle went blind")
        return ev

    @staticmethod
    def inside(path: str) -> bool:
        """Is a path (relative to the base) the save directory or an entry in it, symlinks not followed?"""
        return path == "root/save" or path.startswith("root/save/")
