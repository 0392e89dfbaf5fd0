"""Reading a user's llama.cpp tree: is it one, what is its content, and where the harness keeps what it makes of it.

Nothing here builds; :mod:`harness.trees.build` builds a tree this module has read.

* :func:`check_tree`: a directory that holds a llama.cpp tree (``CMakeLists.txt``, ``tools/server``,
  ``common/common.h``), or one :class:`~harness.errors.UsageError` line.
* :func:`tree_hash`: the content hash every build cache key and pinned-tree comparison uses.
* :func:`source_files`: the per-file hashes of the parts of a tree the model's behaviour depends on,
  to say which files differ from the pinned tree.
* :func:`tree_at_revision`: a revision of a user's git checkout, exported once into the cache.
* :func:`cache_root`, :func:`file_lock`: where the harness keeps what it builds, and its locks.

Which semantics a tree has is :mod:`harness.trees.semantics`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import shutil
import subprocess
import tarfile
import tempfile
from collections.abc import Iterator
from pathlib import Path

from harness.errors import UsageError

__all__ = [
    "SKIP_DIRS",
    "cache_root",
    "check_tree",
    "file_lock",
    "source_files",
    "tree_at_revision",
    "tree_hash",
]

SKIP_DIRS = frozenset({".git", "__pycache__", ".venv", "venv", "node_modules", ".cache", ".ccache"})
MARKER_FILES = frozenset({".prompt-cache-harness-source.sha256", ".complete"})



def cache_root() -> Path:
    """``$XDG_CACHE_HOME/prompt-cache-harness`` (``~/.cache/prompt-cache-harness`` by default): where the
    harness keeps the sdist, the builds, the compiler cache and trees exported from a git revision."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "prompt-cache-harness"


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path``, so two processes do not build or export the same thing at once."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def tree_hash(root: Path, *, skip: bool = True) -> str:
    """sha256 over a source tree's files (relative path, x bit, contents) and symlink targets,
    leaving out (``skip``) ``.git``, caches and build directories (any directory holding a
    ``CMakeCache.txt``), so a checkout, a copy of it and the same tree with a build inside hash the same."""
    h = hashlib.sha256()
    for rel, path in walk_tree(root, skip=skip):
        if path.is_symlink():
            h.update(f"L {rel} {os.readlink(path)}\n".encode())
            continue
        h.update(f"F {rel} {os.stat(path).st_mode & 0o111:o}\n".encode())
        with path.open("rb") as fh:
            for chunk in iter(lambda: fh.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()


def walk_tree(root: Path, *, skip: bool = True) -> list[tuple[str, Path]]:
    """Every file and symlink of a tree as ``(relative posix path, path)``, in the order :func:`tree_hash`
    hashes them (a directory's files by name, then its subdirectories by name), with its exclusions."""
    out: list[tuple[str, Path]] = []
    for dirpath, dirnames, filenames in os.walk(root):
        if skip:
            dirnames[:] = [
                d for d in dirnames if d not in SKIP_DIRS and not (Path(dirpath) / d / "CMakeCache.txt").exists()
            ]
        dirnames.sort()
        for name in sorted(filenames):
            if (skip and name in SKIP_DIRS) or name in MARKER_FILES:
                continue
            p = Path(dirpath) / name
            out.append((p.relative_to(root).as_posix(), p))
    return out


def check_tree(src: Path, flag: str = "--source") -> Path:
    """``src`` resolved, if it is a llama.cpp tree; else one :class:`UsageError` line naming ``flag``."""
    src = src.expanduser().resolve()
    if not src.is_dir():
        raise UsageError(f"{flag} {src}: no such directory")
    missing = [p for p in ("CMakeLists.txt", "tools/server", "common/common.h") if not (src / p).exists()]
    if missing:
        raise UsageError(f"{flag} {src} is not a llama.cpp tree (no {', '.join(missing)})")
    return src


def _git(checkout: Path, *args: str) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(["git", "-C", str(checkout), *args], capture_output=True, check=False, timeout=600)


def tree_at_revision(checkout: Path, rev: str, flag: str = "--base") -> Path:
    """The tree of revision ``rev`` of the git checkout ``checkout``, exported once into the cache with
    ``git archive`` (the checkout, its index and its work tree are never touched). One
    :class:`UsageError` line when ``checkout`` is not a git checkout or ``rev`` names no commit."""
    if shutil.which("git") is None:
        raise UsageError(f"{flag} {rev}: not a directory, and git is not installed to read it as a revision")
    if _git(checkout, "rev-parse", "--git-dir").returncode != 0:
        raise UsageError(f"{flag} {rev}: not a directory, and {checkout} is not a git checkout to find it in")
    found = _git(checkout, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    if found.returncode != 0:
        raise UsageError(f"{flag} {rev}: neither a directory nor a revision of the git checkout {checkout}")
    sha = found.stdout.decode().strip()
    root = cache_root() / "trees"
    final = root / f"git-{sha[:16]}"
    if (final / ".complete").is_file():
        return final
    with file_lock(root / f".{sha[:16]}.lock"):
        if (final / ".complete").is_file():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=".export-", dir=root))
        try:
            proc = subprocess.Popen(["git", "-C", str(checkout), "archive", "--format=tar", sha],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE)  # fmt: skip
            assert proc.stdout is not None
            try:
                with tarfile.open(fileobj=proc.stdout, mode="r|") as tar:
                    tar.extractall(tmp / "tree", filter="data")
            except (tarfile.TarError, OSError) as e:
                proc.kill()
                raise UsageError(f"{flag} {rev}: git archive of {sha[:12]} failed: {e}") from None
            err = proc.stderr.read().decode(errors="replace").strip() if proc.stderr else ""
            if proc.wait() != 0:
                raise UsageError(f"{flag} {rev}: git archive of {sha[:12]} failed: {err.splitlines()[-1:] or '?'}")
            (tmp / "tree" / ".complete").write_text(sha + "\n")
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tmp / "tree", final)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


COMPARED = ("src", "include", "common", "tools/server", "ggml/src", "ggml/include")
"""The parts of a tree whose files :func:`source_files` lists (what libllama and the server compile)."""


def source_files(root: Path) -> dict[str, str]:
    """sha256 of every file under :data:`COMPARED`, by relative path."""
    out: dict[str, str] = {}
    for top in COMPARED:
        base = root / top
        if not base.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
            for name in filenames:
                p = Path(dirpath) / name
                if p.is_file() and not p.is_symlink():
                    out[p.relative_to(root).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


