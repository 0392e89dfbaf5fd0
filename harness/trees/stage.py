"""Where every llama.cpp build compiles: one staging directory, and the compiler cache.

A branch and its base share nearly every file, but compiled from two paths they share no object: the
compile lines, ``__FILE__`` and the build tool's records all name the path. So every tree is synced into
one stage (:func:`sync_stage`: only files whose content differs are rewritten, so their mtimes tell ninja
exactly what changed) and built in a build directory per flag set beside it, through ``ccache`` when it
is installed (:func:`ccache_setup`: ``CCACHE_DIR`` in the harness cache, ``CCACHE_BASEDIR`` at the stage,
so the compile lines of two trees match). The second of two near-identical trees recompiles only the
files that differ (ninja); switching back costs cache hits (ccache). :func:`copy_artifacts` takes the
binary and the shared libraries beside it out of the build directory.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

from harness.errors import BuildError
from harness.trees.tree import cache_root, walk_tree

__all__ = ["BINARY", "ccache_counts", "ccache_setup", "copy_artifacts", "links_libllama", "stage_root", "sync_stage"]

BINARY = "llama-server"
_LIBS = re.compile(r"^lib.*\.so(\.\d+)*$")


def stage_root() -> Path:
    return cache_root() / "llama-server" / ".work" / "stage"


def sync_stage(files: Mapping[str, Path | bytes], stage: Path) -> int:
    """Make ``stage`` hold exactly ``files`` (relative path -> source file, or content), rewriting only
    what differs; returns how many files were written or removed. The manifest beside the stage records
    each staged file's digest; without it (a first or interrupted sync) staged files are compared by content."""
    manifest_path = stage.parent / "stage-manifest.json"
    try:
        old: dict[str, str] = json.loads(manifest_path.read_text()) if stage.is_dir() else {}
    except (OSError, ValueError):
        old = {}
    manifest_path.unlink(missing_ok=True)  # rewritten below once the stage matches it
    stage.mkdir(parents=True, exist_ok=True)
    new: dict[str, str] = {}
    changed = 0
    for rel, item in files.items():
        dest = stage / rel
        if isinstance(item, Path) and item.is_symlink():
            target = os.readlink(item)
            digest = f"L {target}"
            new[rel] = digest
            if old.get(rel) != digest or not dest.is_symlink() or os.readlink(dest) != target:
                _remove(dest)
                dest.parent.mkdir(parents=True, exist_ok=True)
                os.symlink(target, dest)
                changed += 1
            continue
        data = item.read_bytes() if isinstance(item, Path) else item
        # what a build sees: the content and the executable bit (a checkout's umask is not a change)
        mode = 0o755 if isinstance(item, Path) and os.stat(item).st_mode & 0o111 else 0o644
        digest = f"F {mode:o} {hashlib.sha256(data).hexdigest()}"
        new[rel] = digest
        if old.get(rel) == digest and dest.is_file() and not dest.is_symlink():
            continue
        same = (old.get(rel, "").split(" ")[-1] == digest.split(" ")[-1]) if rel in old else None
        if dest.is_file() and not dest.is_symlink() and (same or (same is None and dest.read_bytes() == data)):
            os.chmod(dest, mode)  # the same content (an interrupted sync, or only the x bit moved): keep its mtime
            continue
        _remove(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        dest.write_bytes(data)
        os.chmod(dest, mode)
        changed += 1
    present = {rel for rel, _ in walk_tree(stage, skip=False)}
    for rel in sorted(present - new.keys()):
        _remove(stage / rel)
        changed += 1
    manifest_path.write_text(json.dumps(new))
    return changed


def _remove(p: Path) -> None:
    if p.is_symlink() or p.is_file():
        p.unlink()
    elif p.is_dir():
        shutil.rmtree(p)


def ccache_setup() -> tuple[list[str], dict[str, str]]:
    """The CMake launcher arguments and environment for ccache, or nothing when it is not installed."""
    ccache = shutil.which("ccache")
    if ccache is None:
        return [], {}
    env = {
        "CCACHE_DIR": os.environ.get("CCACHE_DIR") or str(cache_root() / "ccache"),
        "CCACHE_MAXSIZE": os.environ.get("CCACHE_MAXSIZE") or "5G",
        "CCACHE_BASEDIR": str(stage_root()),
        "CCACHE_NOHASHDIR": "true",
    }
    return [f"-DCMAKE_C_COMPILER_LAUNCHER={ccache}", f"-DCMAKE_CXX_COMPILER_LAUNCHER={ccache}"], env


def ccache_counts(env: Mapping[str, str]) -> dict[str, int] | None:
    """ccache's hit and miss counters (``--print-stats``), or None without ccache."""
    ccache = shutil.which("ccache")
    if ccache is None or not env:
        return None
    try:
        out = subprocess.run([ccache, "--print-stats"], capture_output=True, text=True, timeout=30, check=False,
                             env={**os.environ, **env}).stdout  # fmt: skip
    except (OSError, subprocess.TimeoutExpired):
        return None
    stats = dict(line.split("\t", 1) for line in out.splitlines() if "\t" in line)
    try:
        hits = int(stats.get("direct_cache_hit", 0)) + int(stats.get("preprocessed_cache_hit", 0))
        return {"hits": hits, "misses": int(stats.get("cache_miss", 0))}
    except ValueError:
        return None


def copy_artifacts(bin_dir: Path, out: Path) -> None:
    """``llama-server`` and the shared libraries beside it (symlinks kept); check that the binary finds its
    libllama beside it, not in the build directory the next build rewrites."""
    built = bin_dir / BINARY
    if not built.is_file():
        raise BuildError(f"build finished but {built} is missing")
    shutil.copy2(built, out / BINARY)
    for p in sorted(bin_dir.iterdir()):
        if _LIBS.match(p.name):
            shutil.copy2(p, out / p.name, follow_symlinks=False)
    if not (out / "libllama.so").exists():
        raise BuildError(f"the build made no libllama.so beside {built} (BUILD_SHARED_LIBS ignored?)")
    wrong = [line for line in _ldd(out / BINARY) if "libllama" in line and str(out) not in line]
    if wrong:
        raise BuildError(f"the built llama-server does not load libllama from beside it: {wrong[0].strip()}")


def _ldd(binary: Path) -> list[str]:
    """The libraries ``ldd`` lists for ``binary``; none when it cannot say (not a dynamic executable, no ldd)."""
    try:
        return subprocess.check_output(["ldd", str(binary)], text=True, timeout=30,
                                       stderr=subprocess.DEVNULL).splitlines()  # fmt: skip
    except (OSError, subprocess.CalledProcessError, subprocess.TimeoutExpired):
        return []


def sanitizer_first(binary: Path, preload: str) -> str:
    """``preload`` (an ``LD_PRELOAD`` value) with the AddressSanitizer runtime ``binary`` links put first: ASan
    refuses to start after another preloaded library ("ASan runtime does not come first in initial library
    list"). Unchanged for a binary without ASan. An interposer after it still sees the calls it wraps (the libllama
    trace's ``llama_*``); one that wraps ``malloc`` (the native fault shim) is shadowed by ASan's own."""
    runtime = asan_runtime(binary)
    if runtime is None or preload.split(":")[0] == runtime:
        return preload
    return f"{runtime}:{preload}" if preload else runtime


def asan_runtime(binary: Path) -> str | None:
    """The AddressSanitizer runtime ``binary`` links (its path, from ``ldd``), or None: not an ASan build."""
    return _asan_runtime(str(binary))


@functools.lru_cache(maxsize=16)
def _asan_runtime(binary: str) -> str | None:
    for line in _ldd(Path(binary)):
        name, _, where = line.strip().partition(" => ")
        if name.startswith("libasan.so") and where.startswith("/"):
            return where.split(" (")[0]
    return None


def links_libllama(binary: Path) -> bool:
    """Does ``binary`` load ``libllama`` as a shared library (an interposer or ``LLAMA_CPP_LIB_PATH`` can
    reach it), rather than link it in statically?"""
    return any("libllama" in line for line in _ldd(binary))
