"""Build the real ``llama-server`` (the C++ target the reference model stands in for) from any llama.cpp tree.

The llama.cpp tree we target is the one vendored in the ``llama-cpp-python==0.3.36`` sdist. It is
fetched with ``pip download`` (no binaries, no deps), extracted safely into the cache and hashed
once; :func:`build_server` then builds only the ``llama-server`` target with CMake, in one of three
flavours:

``master``
    the vendored tree as is.
``pr``
    the vendored tree plus ``fixtures/pr-27451.patch`` (shared, immutable, refcounted checkpoint
    payloads and an OOM-safe ``server_prompt_cache::alloc``; see the header of the patch).
``asan``
    the **pr** source (vendored tree + ``fixtures/pr-27451.patch``) built with
    ``-fsanitize=address,undefined -fno-omit-frame-pointer -g`` (at ``-O1``) in the C/C++ compile and link flags,
    so the ownership and lifetime changes of the patch run under the sanitizers.

Binaries are cached under ``$XDG_CACHE_HOME/prompt-cache-harness/llama-server/<key>/llama-server``
(``~/.cache`` without ``XDG_CACHE_HOME``), where ``<key>`` hashes the vendored source, the patch
bytes, the flavour, the CMake arguments and the compiler; a second call returns at once. A build
runs in a temporary directory next to the cache and is renamed into place when it succeeded.

Any other llama.cpp checkout builds the same way (:func:`build_source`, ``build-server --source``),
cached by :func:`tree_hash` of its content; :func:`server_build` says which binary the server backend
runs and what is known of it. :mod:`harness.targets.llama_server` runs a binary.

``python -m harness build-server [--semantics shared|master] [--asan] [--source DIR] [--jobs N] [--force]`` exits 0 and
prints the binary's path, 2 on a usage/environment error (no cmake, no compiler) and
:data:`EXIT_BUILD_FAILED` (4) when fetching, patching, configuring or compiling fails.

Size: one build pipeline, in the order a build runs: the sdist and the pinned trees, tree hashing and
semantics inference, the cache lookup, CMake, and what the server backend is told about the binary.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from harness.child import run_logged
from harness.errors import BuildError, HarnessError, UsageError

__all__ = [
    "EXIT_BUILD_FAILED",
    "FLAVOURS",
    "PATCH_PATH",
    "PINNED_COMMIT",
    "SDIST_NAME",
    "SDIST_VERSION",
    "BuildError",
    "ServerBuild",
    "build_server",
    "build_source",
    "cache_root",
    "cached_binary",
    "cmake_args",
    "infer_semantics",
    "log_tail",
    "pinned_status",
    "pinned_tree_hashes",
    "sdist_source",
    "server_build",
    "tree_hash",
]

SDIST_NAME = "llama-cpp-python"
SDIST_VERSION = "0.3.36"
_SDIST_STEM = f"llama_cpp_python-{SDIST_VERSION}"
_VENDOR_SUBDIR = "vendor/llama.cpp"
_SOURCE_MARKER = ".prompt-cache-harness-source.sha256"

FLAVOURS = ("master", "pr", "asan")
PINNED_COMMIT = "0c1e570"
"""The llama.cpp commit vendored by the sdist: the one the reference model mirrors."""
PATCH_PATH = Path(__file__).resolve().parents[2] / "fixtures" / "pr-27451.patch"

EXIT_BUILD_FAILED = 4
"""Exit code of ``build-server`` when the build itself fails (not a usage error, not a property)."""

_BINARY = "llama-server"
_SANITIZE = "-fsanitize=address,undefined -fno-omit-frame-pointer -g"

# Everything that decides what gets compiled. The prebuilt UI is off because it downloads at
# build time; OpenSSL is off (no https needed); LLAMA_CURL no longer exists in this tree (it is a
# deprecated no-op that only prints a warning), so it is not passed.
_BASE_CMAKE_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DGGML_NATIVE=OFF",
    "-DLLAMA_BUILD_COMMON=ON",
    "-DLLAMA_BUILD_TOOLS=ON",
    "-DLLAMA_BUILD_SERVER=ON",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    "-DLLAMA_BUILD_APP=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
)


# --------------------------------------------------------------------------------------------
# cache and source
# --------------------------------------------------------------------------------------------


def cache_root() -> Path:
    """``$XDG_CACHE_HOME/prompt-cache-harness`` (``~/.cache/prompt-cache-harness`` by default)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "prompt-cache-harness"


@contextlib.contextmanager
def _file_lock(path: Path) -> Iterator[None]:
    """An exclusive ``flock`` on ``path``, so two builds of the same thing do not race."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("a") as fh:
        fcntl.flock(fh.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh.fileno(), fcntl.LOCK_UN)


def _tree_hash(root: Path) -> str:
    """The sdist marker's hash: :func:`tree_hash` over every file, ``.git`` and build dirs included
    (the keys of the pinned builds hash it, so it stays as it was)."""
    return tree_hash(root, skip=False)


def _download_sdist(dest: Path, log: Callable[[str], None]) -> Path:
    tarball = dest / f"{_SDIST_STEM}.tar.gz"
    if tarball.is_file():
        return tarball
    dest.mkdir(parents=True, exist_ok=True)
    log(f"fetching {SDIST_NAME}=={SDIST_VERSION} sdist with pip download")
    cmd = [
        # --no-binary names the one package: ":all:" would also build its build dependencies
        # (cmake, ninja, scikit-build-core) from source while pip prepares the metadata, ~1 h on 2 cores
        sys.executable, "-m", "pip", "download", "--no-deps", "--no-binary", SDIST_NAME,
        f"{SDIST_NAME}=={SDIST_VERSION}", "-d", str(dest),
    ]  # fmt: skip
    log("$ " + shlex.join(cmd))
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0 or not tarball.is_file():
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-3:])
        raise BuildError(f"pip download of {SDIST_NAME}=={SDIST_VERSION} failed (exit {proc.returncode}): {tail}")
    return tarball


def _safe_members(tar: tarfile.TarFile, prefix: str) -> list[tarfile.TarInfo]:
    """The members under ``prefix``, refusing absolute paths, ``..`` and links that leave the tree."""
    out = []
    for m in tar.getmembers():
        name = m.name.removeprefix("./")
        if not (name == prefix.rstrip("/") or name.startswith(prefix)):
            continue
        parts = Path(name).parts
        if name.startswith("/") or ".." in parts:
            raise BuildError(f"unsafe path in sdist: {m.name!r}")
        if not (m.isfile() or m.isdir() or m.issym() or m.islnk()):
            continue  # devices, fifos: never in a source tree
        out.append(m)
    return out


def sdist_source() -> Path:
    """The vendored llama.cpp tree of the sdist, downloaded and extracted into the cache if needed.

    The returned directory is never modified; its content hash is stored next to it on extraction.
    """
    return _sdist_source(lambda _msg: None)


def _sdist_source(log: Callable[[str], None]) -> Path:
    root = cache_root() / "sdist"
    extracted = root / _SDIST_STEM
    vendored = extracted / _VENDOR_SUBDIR
    if (extracted / _SOURCE_MARKER).is_file():
        return vendored
    with _file_lock(root / ".lock"):
        if (extracted / _SOURCE_MARKER).is_file():
            return vendored
        tarball = _download_sdist(root, log)
        log(f"extracting {tarball.name} ({_VENDOR_SUBDIR})")
        tmp = Path(tempfile.mkdtemp(prefix=".extract-", dir=root))
        try:
            try:
                with tarfile.open(tarball, "r:gz") as tar:
                    members = _safe_members(tar, f"{_SDIST_STEM}/{_VENDOR_SUBDIR}/")
                    if not members:
                        raise BuildError(f"{tarball} has no {_VENDOR_SUBDIR}")
                    tar.extractall(tmp, members=members, filter="data")
            except (tarfile.TarError, OSError, EOFError) as e:
                tarball.unlink(missing_ok=True)  # a truncated download: fetch again next time
                raise BuildError(f"cannot extract {tarball}: {e}") from e
            digest = _tree_hash(tmp / _SDIST_STEM / _VENDOR_SUBDIR)
            (tmp / _SDIST_STEM / _SOURCE_MARKER).write_text(digest + "\n")
            if extracted.exists():
                shutil.rmtree(extracted)  # a half-finished earlier extraction (no marker)
            os.rename(tmp / _SDIST_STEM, extracted)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return vendored


def _source_hash(vendored: Path) -> str:
    return (vendored.parents[1] / _SOURCE_MARKER).read_text().strip()


# --------------------------------------------------------------------------------------------
# build
# --------------------------------------------------------------------------------------------


def cmake_args(flavour: str) -> list[str]:
    """The ``-D`` arguments for ``flavour`` (the generator and the paths are added by the build)."""
    if flavour not in FLAVOURS:
        raise UsageError(f"unknown flavour {flavour!r} (choose from {', '.join(FLAVOURS)})")
    args = list(_BASE_CMAKE_ARGS)
    if flavour == "asan":
        args += [
            f"-DCMAKE_C_FLAGS={_SANITIZE}",
            f"-DCMAKE_CXX_FLAGS={_SANITIZE}",
            # -O1, as the sanitizers' documentation advises: Release's -O3 with both sanitizers compiled
            # at ~1.5 units a minute on 2 cores (llama-model.cpp alone for minutes); -O1 keeps the checks
            "-DCMAKE_C_FLAGS_RELEASE=-O1 -DNDEBUG",
            "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG",
            "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=address,undefined",
        ]
    return args


def _uses_patch(flavour: str) -> bool:
    return flavour in ("pr", "asan")


def _compiler_id() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        raise UsageError("no C++ compiler found (need c++, g++ or clang++ on PATH)")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise UsageError(f"cannot run the C++ compiler {cxx}: {e}") from e
    return f"{cxx}: {out.splitlines()[0] if out else '?'}"


def _build_key(src_hash: str, patch: bytes | None, flavour: str, args: Sequence[str], compiler: str) -> str:
    h = hashlib.sha256()
    h.update(f"source {src_hash}\nflavour {flavour}\ncompiler {compiler}\n".encode())
    h.update(b"patch " + (hashlib.sha256(patch).hexdigest().encode() if patch is not None else b"none") + b"\n")
    for a in args:
        h.update(f"arg {a}\n".encode())
    return f"{flavour}-{h.hexdigest()[:16]}"


def log_tail(path: Path, n: int = 15) -> list[str]:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return []
    return lines[-n:]


def _run_logged(cmd: Sequence[str], log_path: Path, failure: str, cwd: Path | None = None) -> None:
    """Run ``cmd`` with its output appended to ``log_path``; a non-zero exit raises ``BuildError(failure)``."""
    with log_path.open("a") as fh:
        fh.write(f"\n$ {shlex.join(cmd)}\n")
        fh.flush()
        try:
            rc = run_logged(cmd, fh, cwd=cwd)  # its own group: a Ctrl-C stops the compilers too
        except OSError as e:
            raise BuildError(f"{failure}: cannot run {cmd[0]}: {e}") from e
    if rc != 0:
        raise BuildError(f"{failure} (exit {rc}); log: {log_path}")


def _apply_patch(src: Path, patch_path: Path, log_path: Path) -> None:
    not_applying = f"patch {patch_path.name} does not apply to the vendored llama.cpp tree"
    if shutil.which("patch"):
        base = [
            "patch",
            "-p1",
            "--batch",
            "--forward",
            "--no-backup-if-mismatch",
            "-d",
            str(src),
            "-i",
            str(patch_path),
        ]
        _run_logged([*base[:1], "--dry-run", *base[1:]], log_path, not_applying)
        _run_logged(base, log_path, f"applying {patch_path.name} failed")
    elif shutil.which("git"):
        _run_logged(["git", "apply", "--check", "-p1", str(patch_path)], log_path, not_applying, cwd=src)
        _run_logged(["git", "apply", "-p1", str(patch_path)], log_path, f"applying {patch_path.name} failed", cwd=src)
    else:
        # a fresh machine may have neither: patch-ng (a dependency) applies unified diffs in Python
        import patch_ng  # type: ignore[import-untyped]

        pset = patch_ng.fromfile(str(patch_path))
        if not pset:
            raise BuildError(f"{not_applying} (patch-ng cannot parse it)")
        with log_path.open("a") as fh:
            fh.write(f"$ patch_ng.apply(strip=0, root={src})\n")
        if not pset.apply(strip=0, root=str(src)):  # patch-ng strips git's a/ b/ itself
            raise BuildError(f"{not_applying} (patch-ng)")


def _tool(name: str) -> str | None:
    """``cmake``/``ninja`` from PATH, else from their PyPI packages (whose scripts may not be on PATH)."""
    found = shutil.which(name)
    if found:
        return found
    try:
        mod = __import__(name)
    except ImportError:
        return None
    bin_dir = getattr(mod, "CMAKE_BIN_DIR" if name == "cmake" else "BIN_DIR", None)
    if bin_dir is None:
        return None
    candidate = Path(bin_dir) / name
    return str(candidate) if candidate.is_file() else None


def cached_binary(flavour: str) -> Path | None:
    """The cached ``llama-server`` of ``flavour`` if it was already built for this source, else None (never builds)."""
    args = cmake_args(flavour)
    root = cache_root() / "sdist" / _SDIST_STEM
    if not (root / _SOURCE_MARKER).is_file():
        return None
    try:
        patch = PATCH_PATH.read_bytes() if _uses_patch(flavour) else None
        key = _build_key(_source_hash(root / _VENDOR_SUBDIR), patch, flavour, args, _compiler_id())
    except (OSError, UsageError):
        return None
    binary = cache_root() / "llama-server" / key / _BINARY
    return binary if binary.is_file() else None


def build_server(
    flavour: str = "pr",
    *,
    jobs: int | None = None,
    force: bool = False,
    log: Callable[[str], None] = print,
) -> Path:
    """Build (or reuse) ``llama-server`` for ``flavour`` and return the binary's path.

    Raises :class:`~harness.errors.UsageError` for a bad flavour or missing tools and
    :class:`BuildError` (one line, naming the log file) when the build fails.
    """
    args = cmake_args(flavour)
    cmake = _cmake()
    compiler = _compiler_id()
    patch: bytes | None = None
    if _uses_patch(flavour):
        try:
            patch = PATCH_PATH.read_bytes()
        except OSError as e:
            raise UsageError(f"cannot read the PR patch {PATCH_PATH}: {e}") from e

    vendored = _sdist_source(log)
    key = _build_key(_source_hash(vendored), patch, flavour, args, compiler)
    servers = cache_root() / "llama-server"
    final = servers / key
    binary = final / _BINARY
    with _file_lock(servers / f".{key}.lock"):
        if not binary.is_file() or force:
            work = servers / ".work" / "pinned"
            with _file_lock(work / ".lock"):
                logs = servers / "logs"
                logs.mkdir(parents=True, exist_ok=True)
                src = _pinned_work_tree(vendored, patch, work, log, flavour, logs / f"{key}.patch.log")
                info = {
                    "flavour": flavour,
                    "semantics": "shared" if patch is not None else "master",
                    "sdist": f"{SDIST_NAME}=={SDIST_VERSION}",
                    "source_sha256": _source_hash(vendored),
                    "patch": str(PATCH_PATH) if patch is not None else None,
                    "patch_sha256": hashlib.sha256(patch).hexdigest() if patch is not None else None,
                }
                _build_locked(flavour, args, src, final, cmake, compiler, jobs, log, info, _build_dir(work, args))
        _ensure_tree_recorded(final, vendored, patch, compiler, log)
    return binary


def _build_dir(work: Path, args: Sequence[str]) -> Path:
    return work / ("build-" + hashlib.sha256("\n".join(args).encode()).hexdigest()[:12])


def _pinned_work_tree(
    vendored: Path, patch: bytes | None, work: Path, log: Callable[[str], None], label: str, log_path: Path
) -> Path:
    """One persistent copy of the pinned tree, patched or not as ``label`` needs, shared by the master
    and pr builds (and their build directories): the second build recompiles only what the patch
    touches (``common``, the server) instead of all of ggml and libllama. Switching back rewrites the
    patched files from the vendored tree with fresh mtimes, so the build tool sees them change."""
    src = work / "src"
    state = work / "state"
    patch_sha = hashlib.sha256(PATCH_PATH.read_bytes()).hexdigest()
    want = f"patched {patch_sha}" if patch is not None else "plain"
    have = state.read_text().strip() if state.is_file() and src.is_dir() else None
    if have is not None and have not in ("plain", f"patched {patch_sha}"):
        have = None  # patched with another version of the patch: start again from the vendored tree
    if have is None:
        log(f"[{label}] copying the pinned tree to {src}")
        state.unlink(missing_ok=True)
        shutil.rmtree(src, ignore_errors=True)
        work.mkdir(parents=True, exist_ok=True)
        # the sdist keeps the submodule's `.git` file (pointing nowhere): drop it so git apply works
        shutil.copytree(vendored, src, symlinks=True, ignore=lambda d, names: [".git"] if d == str(vendored) else [])
        have = "plain"
        state.write_text(have + "\n")
    if have == want:
        return src
    state.unlink()  # half-switched trees are recopied next time
    if patch is not None:
        log(f"[{label}] applying {PATCH_PATH.name}")
        try:
            _apply_patch(src, PATCH_PATH, log_path)
        except BuildError as e:
            raise BuildError(f"{e} | " + " | ".join(log_tail(log_path, 5))) from None
    else:
        log(f"[{label}] restoring the files {PATCH_PATH.name} touches")
        for rel in _patch_files():
            if (vendored / rel).is_file():
                shutil.copyfile(vendored / rel, src / rel)  # copyfile: a new mtime
            else:
                (src / rel).unlink(missing_ok=True)
    state.write_text(want + "\n")
    return src


def _cmake() -> str:
    cmake = _tool("cmake")
    if cmake is None:
        raise UsageError("cmake not found: neither on PATH nor from the `cmake` Python package (a dependency)")
    return cmake


def _pinned_tree(
    vendored: Path, patch: bytes | None, tmp: Path, log: Callable[[str], None], label: str, log_path: Path
) -> Path:
    """The vendored tree itself (``patch`` None) or a copy of it under ``tmp`` with the PR patch applied."""
    if patch is None:
        return vendored
    log(f"[{label}] copying source and applying {PATCH_PATH.name}")
    src = tmp / "src"
    # the sdist keeps the submodule's `.git` file (pointing nowhere): drop it so git apply works
    shutil.copytree(vendored, src, symlinks=True, ignore=lambda d, names: [".git"] if d == str(vendored) else [])
    try:
        _apply_patch(src, PATCH_PATH, log_path)
    except BuildError as e:
        raise BuildError(f"{e} | " + " | ".join(log_tail(log_path, 5))) from None
    return src


def _ensure_tree_recorded(
    final: Path, vendored: Path, patch: bytes | None, compiler: str, log: Callable[[str], None]
) -> None:
    """Record the content hash of the tree a flavour was built from (older builds lack it), so a
    ``--source`` tree with the same content and flags reuses that build instead of compiling again."""
    info_path = final / "build-info.json"
    try:
        info = json.loads(info_path.read_text())
    except (OSError, ValueError):
        return
    if info.get("tree_sha256") and info.get("compiler"):
        return
    hashes = pinned_tree_hashes(log)
    info["tree_sha256"] = hashes["shared" if patch is not None else "master"]
    info["compiler"] = compiler
    info.setdefault("semantics", "shared" if patch is not None else "master")
    info_path.write_text(json.dumps(info, indent=2) + "\n")


def pinned_tree_hashes(log: Callable[[str], None] = lambda _m: None) -> dict[str, str]:
    """:func:`tree_hash` of the pinned tree (``master``) and of it with the PR patch (``shared``), computed once."""
    vendored = _sdist_source(log)
    record = vendored.parents[1] / ".pinned-trees.json"
    try:
        patch_sha = hashlib.sha256(PATCH_PATH.read_bytes()).hexdigest()
    except OSError as e:
        raise UsageError(f"cannot read the PR patch {PATCH_PATH}: {e}") from e
    try:
        known = json.loads(record.read_text())
        if known.get("patch_sha256") == patch_sha:
            return {"master": known["master"], "shared": known["shared"]}
    except (OSError, ValueError, KeyError):
        pass
    with tempfile.TemporaryDirectory(prefix=".pinned-", dir=vendored.parents[1]) as tmp:
        patched = _pinned_tree(vendored, PATCH_PATH.read_bytes(), Path(tmp), log, "pinned", Path(tmp) / "patch.log")
        hashes = {"master": tree_hash(vendored), "shared": tree_hash(patched)}
    record.write_text(json.dumps({**hashes, "patch_sha256": patch_sha}, indent=2) + "\n")
    return hashes


# --------------------------------------------------------------------------------------------
# any llama.cpp tree (``--source``) or binary (``--server-bin``)
# --------------------------------------------------------------------------------------------

_SKIP_DIRS = frozenset({".git", "__pycache__", ".venv", "venv", "node_modules", ".cache", ".ccache"})


def tree_hash(root: Path, *, skip: bool = True) -> str:
    """sha256 over a source tree's files (relative path, x bit, contents) and symlink targets,
    leaving out (``skip``) ``.git``, caches and build directories (any directory holding a
    ``CMakeCache.txt``), so a checkout, a copy of it and the same tree with a build inside hash the same."""
    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        if skip:
            dirnames[:] = [
                d for d in dirnames if d not in _SKIP_DIRS and not (Path(dirpath) / d / "CMakeCache.txt").exists()
            ]
        dirnames.sort()
        for name in sorted(filenames):
            if (skip and name in _SKIP_DIRS) or name == _SOURCE_MARKER:
                continue
            p = Path(dirpath) / name
            rel = p.relative_to(root).as_posix()
            if p.is_symlink():
                h.update(f"L {rel} {os.readlink(p)}\n".encode())
                continue
            h.update(f"F {rel} {os.stat(p).st_mode & 0o111:o}\n".encode())
            with p.open("rb") as fh:
                for chunk in iter(lambda: fh.read(1 << 20), b""):
                    h.update(chunk)
    return h.hexdigest()


def _check_tree(src: Path) -> Path:
    src = src.expanduser().resolve()
    if not src.is_dir():
        raise UsageError(f"--source {src}: no such directory")
    missing = [p for p in ("CMakeLists.txt", "tools/server", "common/common.h") if not (src / p).exists()]
    if missing:
        raise UsageError(f"--source {src} is not a llama.cpp tree (no {', '.join(missing)})")
    return src


_CKPT_STRUCT = re.compile(r"struct\s+common_prompt_checkpoint\s*\{(.*?)\n\};", re.S)


def infer_semantics(src: Path) -> str | None:
    """``shared`` when the tree's ``common_prompt_checkpoint`` holds its payloads by ``shared_ptr`` (PR
    #27451's shared checkpoint storage), ``master`` when it holds plain vectors, None if unknown."""
    try:
        header = (src / "common" / "common.h").read_text(errors="replace")
    except OSError:
        return None
    m = _CKPT_STRUCT.search(header)
    if m is None:
        return None
    body = m.group(1)
    if "shared_ptr" in body:
        return "shared"
    if re.search(r"std::vector<uint8_t>\s+data", body):
        return "master"
    return None


_COMPARED = ("src", "include", "common", "tools/server", "ggml/src", "ggml/include")


def _files(root: Path) -> dict[str, str]:
    out: dict[str, str] = {}
    for top in _COMPARED:
        base = root / top
        if not base.is_dir():
            continue
        for dirpath, dirnames, filenames in os.walk(base):
            dirnames[:] = [d for d in dirnames if d not in _SKIP_DIRS]
            for name in filenames:
                p = Path(dirpath) / name
                if p.is_file() and not p.is_symlink():
                    out[p.relative_to(root).as_posix()] = hashlib.sha256(p.read_bytes()).hexdigest()
    return out


def pinned_status(
    src: Path, digest: str | None = None, log: Callable[[str], None] = lambda _m: None
) -> tuple[bool, str]:
    """Is ``src`` the tree the model is pinned to (with or without the PR patch), and one line saying
    so or which source files differ from it. Never raises: without the sdist it says so."""
    try:
        hashes = pinned_tree_hashes(log)
        digest = digest or tree_hash(src)
        if digest == hashes["master"]:
            return True, f"the tree is llama.cpp {PINNED_COMMIT}, the commit the model is pinned to"
        if digest == hashes["shared"]:
            return True, f"the tree is llama.cpp {PINNED_COMMIT} + PR #27451, the commit the model is pinned to"
        vendored = _sdist_source(log)
        pinned, mine = _files(vendored), _files(src)
        with_pr = {**pinned, **_patched_files(vendored)}
    except (HarnessError, OSError) as e:
        return False, f"cannot compare the tree with llama.cpp {PINNED_COMMIT}: {e}"

    def differing(base: Mapping[str, str | None]) -> list[str]:
        return sorted(k for k in base.keys() | mine.keys() if base.get(k) != mine.get(k))

    # measured against the pinned tree the tree's own semantics start from (with the PR or without)
    base, name = (
        (with_pr, f"{PINNED_COMMIT} + PR #27451") if infer_semantics(src) == "shared" else (pinned, PINNED_COMMIT)
    )
    diff = differing(base)
    shown = ", ".join(diff[:6]) + (f" and {len(diff) - 6} more" if len(diff) > 6 else "")
    return False, (
        f"the tree differs from llama.cpp {name} (the model is pinned to {PINNED_COMMIT}) in {len(diff)} "
        f"source file{'' if len(diff) == 1 else 's'}: {shown}"
    )


def _patched_files(vendored: Path) -> dict[str, str | None]:
    """sha256 of each file the PR patch touches, as the patch leaves it (None: the patch deletes it)."""
    with tempfile.TemporaryDirectory(prefix=".patched-files-") as tmp:
        root = Path(tmp) / "tree"
        for rel in _patch_files():
            if (vendored / rel).is_file():
                (root / rel).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(vendored / rel, root / rel)
        _apply_patch(root, PATCH_PATH, Path(tmp) / "patch.log")
        return {
            rel: hashlib.sha256((root / rel).read_bytes()).hexdigest() if (root / rel).is_file() else None
            for rel in _patch_files()
        }


def _patch_files() -> list[str]:
    try:
        text = PATCH_PATH.read_text()
    except OSError:
        return []
    return re.findall(r"^\+\+\+ b/(\S+)", text, re.M)


def _pinned_flavour(digest: str, asan: bool) -> str | None:
    """The flavour whose tree has this content (``master``, ``pr``, or ``asan`` for the patched tree
    with ``asan``), or None; None too when the pinned tree cannot be had (no sdist, no network)."""
    try:
        hashes = pinned_tree_hashes()
    except HarnessError:
        return None
    if digest == hashes["shared"]:
        return "asan" if asan else "pr"
    if digest == hashes["master"] and not asan:
        return "master"
    return None


def _find_build(digest: str, args: Sequence[str], compiler: str) -> Path | None:
    """A cached binary built from a tree with this content and these flags (any origin)."""
    for info_path in sorted((cache_root() / "llama-server").glob("*/build-info.json")):
        try:
            info = json.loads(info_path.read_text())
        except (OSError, ValueError):
            continue
        if (
            info.get("tree_sha256") == digest
            and info.get("cmake_args") == list(args)
            and info.get("compiler") == compiler
        ):
            binary = info_path.parent / _BINARY
            if binary.is_file():
                return binary
    return None


def build_source(
    src: Path,
    *,
    asan: bool = False,
    jobs: int | None = None,
    force: bool = False,
    log: Callable[[str], None] = print,
) -> Path:
    """Build (or reuse) ``llama-server`` from any llama.cpp checkout ``src`` and return its path.

    The build is cached by :func:`tree_hash` of the tree, the CMake flags (the same portable flags
    as the pinned builds; ``asan`` adds the sanitizers) and the compiler: a tree with the same
    content as an earlier build (a copy, another checkout of the same commit, the pinned tree)
    reuses it. The tree itself is never written to (the build directory is in the cache).
    """
    src = _check_tree(src)
    args = cmake_args("asan" if asan else "master")
    cmake = _cmake()
    compiler = _compiler_id()
    log(f"[source] hashing {src}")
    digest = tree_hash(src)
    flavour = _pinned_flavour(digest, asan)
    if flavour is not None:
        # the pinned tree itself (e.g. a copy of it): build it where the pinned builds share their work
        log(f"[source] {src} is the pinned llama.cpp {PINNED_COMMIT} tree: using the {flavour} build")
        return build_server(flavour, jobs=jobs, force=force, log=log)
    h = hashlib.sha256(f"tree {digest}\ncompiler {compiler}\n".encode())
    for a in args:
        h.update(f"arg {a}\n".encode())
    key = f"source-{h.hexdigest()[:16]}"
    servers = cache_root() / "llama-server"
    final = servers / key
    binary = final / _BINARY
    if binary.is_file() and not force:
        return binary
    if not force:
        same = _find_build(digest, args, compiler)
        if same is not None:
            log(f"[source] the same tree and flags were built before ({same.parent.name}): reusing {same}")
            return same
    with _file_lock(servers / f".{key}.lock"):
        if binary.is_file() and not force:
            return binary
        info = {
            "flavour": None,
            "source": str(src),
            "semantics": infer_semantics(src),
            "asan": asan,
        }
        # one build directory per tree path and flags, kept: the next build of an edited tree is incremental
        work = servers / ".work" / ("source-" + hashlib.sha256(str(src).encode()).hexdigest()[:12])
        with _file_lock(work / ".lock"):
            return _build_locked(
                "source", args, src, final, cmake, compiler, jobs, log, {**info, "tree_sha256": digest},
                _build_dir(work, args),
            )  # fmt: skip


@dataclass(frozen=True)
class ServerBuild:
    """A ``llama-server`` binary and what is known of it: where it came from, the semantics of its
    tree (None when unknown), whether it is instrumented, and how a replay program gets it again."""

    binary: Path
    origin: str  # "flavour pr", "source DIR", "binary PATH"
    semantics: str | None
    asan: bool
    replay_expr: str  # a Python expression giving the binary in a replay program
    replay_flags: str  # the gate's command-line flags that select it
    tree: Path | None = None
    pinned: bool = True  # built from the tree the model mirrors (0c1e570, with or without the patch)

    @property
    def label(self) -> str:
        return self.origin.split(" ", 1)[1] if self.origin.startswith("flavour ") else self.origin


def server_build(
    *,
    flavour: str | None = None,
    source: Path | None = None,
    binary: Path | None = None,
    asan: bool = False,
    log: Callable[[str], None] = print,
) -> ServerBuild:
    """The binary the server backend runs: one of our flavours, a user's tree (built, cached) or a
    user's binary. Raises :class:`UsageError` (exit 2) for a bad tree or binary, :class:`BuildError`
    (exit 4) when the tree does not build."""
    if sum(x is not None for x in (flavour, source, binary)) != 1:
        raise UsageError("choose one of a flavour, --source DIR and --server-bin PATH")
    if binary is not None:
        path = binary.expanduser().resolve()
        if not path.is_file() or not os.access(path, os.X_OK):
            raise UsageError(f"--server-bin {binary}: not an executable file")
        sem, pinned = None, False
        info_path = path.parent / "build-info.json"  # ours, when the binary was built by this harness
        if info_path.is_file():
            with contextlib.suppress(OSError, ValueError, HarnessError):
                info = json.loads(info_path.read_text())
                sem = info.get("semantics")
                pinned = info.get("tree_sha256") in pinned_tree_hashes(log).values()
        instrumented = b"__asan_init" in path.read_bytes()
        return ServerBuild(path, f"binary {path}", sem, instrumented, f"Path({str(path)!r})",
                           f"--server-bin {shlex.quote(str(path))}", None, pinned)  # fmt: skip
    if source is not None:
        path = build_source(source, asan=asan, log=log)
        tree = _check_tree(source)
        instrumented = b"__asan_init" in path.read_bytes()
        return ServerBuild(path, f"source {tree}", infer_semantics(tree), instrumented,
                           f"build_source(Path({str(tree)!r}){', asan=True' if asan else ''})",
                           f"--source {shlex.quote(str(tree))}" + (" --asan" if asan else ""), tree, False)  # fmt: skip
    assert flavour is not None
    path = build_server(flavour, log=log)
    sem = "master" if flavour == "master" else "shared"
    flags = "--semantics master" if flavour == "master" else ("--asan" if flavour == "asan" else "--semantics shared")
    return ServerBuild(path, f"flavour {flavour}", sem, flavour == "asan", f"build_server({flavour!r})", flags)


def _build_locked(
    label: str,
    args: list[str],
    src: Path,
    final: Path,
    cmake: str,
    compiler: str,
    jobs: int | None,
    log: Callable[[str], None],
    info: Mapping[str, Any],
    build_dir: Path,
) -> Path:
    servers = final.parent
    key = final.name
    logs = servers / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{key}.log"
    log_path.write_text(f"# llama-server build {key} ({label}) of {src} started {time.ctime()}\n")
    for stale in servers.glob(f".build-{key}-*"):  # left by a killed build; we hold the key's lock
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".build-{key}-", dir=servers))
    t0 = time.monotonic()
    try:
        ninja = _tool("ninja")
        gen = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"] if ninja else []
        log(f"[{label}] configuring with cmake in {build_dir} (log: {log_path})")
        try:
            _run_logged(
                [cmake, "-S", str(src), "-B", str(build_dir), *gen, *args],
                log_path,
                f"cmake configure ({label}) failed",
            )
        except BuildError:
            shutil.rmtree(build_dir, ignore_errors=True)  # no half-configured cache for the next try
            raise
        n = jobs or min(os.cpu_count() or 1, 2)
        log(f"[{label}] building target {_BINARY} with -j{n} (slow on the first run)")
        _run_logged(
            [cmake, "--build", str(build_dir), "--target", _BINARY, "-j", str(n)],
            log_path,
            f"compiling llama-server ({label}) failed",
        )
        built = build_dir / "bin" / _BINARY
        if not built.is_file():
            raise BuildError(f"build finished but {built} is missing; log: {log_path}")
        out = tmp / "out"
        out.mkdir()
        shutil.copy2(built, out / _BINARY)
        shutil.copy2(log_path, out / "build.log")
        record = {**info, "cmake_args": args, "compiler": compiler, "seconds": round(time.monotonic() - t0, 1)}
        (out / "build-info.json").write_text(json.dumps(record, indent=2) + "\n")
        if final.exists():  # --force: swap the old build out, then drop it
            trash = tmp / "old"
            os.rename(final, trash)
        os.rename(out, final)
        log(f"[{label}] built {final / _BINARY} in {time.monotonic() - t0:.0f}s")
        return final / _BINARY
    except BuildError as e:
        tail = log_tail(log_path)
        raise BuildError(
            f"{e}; last lines: " + " | ".join(line.strip() for line in tail[-4:] if line.strip())
        ) from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
