"""Build the real ``llama-server`` and its ``libllama`` (the C++ the reference model stands in for) from any tree.

Two entry points, one pipeline:

:func:`build_server` (``build-server [--semantics shared|master] [--asan] [--coverage]``)
    the pinned tree (:mod:`harness.trees.pinned`): a build is a **semantics** (``master`` as vendored;
    ``shared`` with ``fixtures/pr-27451.patch``: shared, immutable, refcounted checkpoint payloads and an
    OOM-safe ``server_prompt_cache::alloc``) plus an **instrumentation** (:data:`INSTRUMENTATIONS`: ``plain``;
    ``asan``, ``-fsanitize=address,undefined -fno-omit-frame-pointer -g`` at ``-O1``; ``coverage``,
    ``--coverage`` at ``-O0``, its gcov notes kept in the entry, :mod:`~harness.trees.gcov`; both
    instrumented builds are of the ``shared`` source). The cache names the four builds as it always has
    (:func:`build_name`: ``master``, ``pr``, ``asan``, ``coverage``), and ``build_server("shared")`` of older
    replay programs still works.
:func:`build_source` (``build-server --source DIR``)
    any llama.cpp checkout, never written to, cached by :func:`~harness.trees.tree.tree_hash` of
    its content (a copy of a tree built before, or of the pinned tree, reuses that build).

How a build runs (:func:`_build_locked`): the tree is synced into the one stage of
:mod:`harness.trees.stage` and built there with CMake and ninja, through ccache when installed,
so a branch and its base share every object they have in common. Each build says how many files it staged
and what ccache made of it.

libllama and ggml are built as **shared libraries** (``BUILD_SHARED_LIBS=ON``, ``$ORIGIN`` run paths) and
copied beside ``llama-server``: the cache entry ``<key>/`` holds ``llama-server``, ``libllama.so``,
``libggml*.so`` and ``libmtmd.so``, so llama-cpp-python can load the tree's own libllama
(``LLAMA_CPP_LIB_PATH``, :mod:`harness.trees.api`) and an ``LD_PRELOAD`` interposer sees the
server's libllama calls. ``<key>`` hashes the tree's content, the build's name, the CMake arguments and the
compiler; a second call returns at once.

``build-server`` exits 0 and prints the binary's path, 2 on a usage/environment error (no cmake, no
compiler) and :data:`EXIT_BUILD_FAILED` (4) when fetching, patching, configuring or compiling fails.
:func:`server_build` says which binary the server backend runs and what is known of it.

Size: one pipeline for the pinned builds and the users' trees (the cache key, the stage, CMake and ninja, the
record of each build) reads best in one place; :func:`server_build` is the one entry the commands use.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import tempfile
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from harness.errors import EXIT_BUILD_FAILED, BuildError, UsageError
from harness.trees.gcov import coverage_cmake_args, is_coverage, keep_notes
from harness.trees.pinned import (
    PATCH_PATH,
    PINNED_COMMIT,
    SDIST_NAME,
    SDIST_VERSION,
    log_tail,
    pinned_files,
    pinned_semantics,
    pinned_status,
    pinned_tree_hashes,
    run_logged,
    sdist_extracted,
    sdist_source,
    source_hash,
)
from harness.trees.semantics import SemanticsInference, infer_semantics
from harness.trees.stage import (
    BINARY,
    ccache_counts,
    ccache_setup,
    copy_artifacts,
    links_libllama,
    stage_root,
    sync_stage,
)
from harness.trees.tree import cache_root, check_tree, file_lock, registry_origin, tree_hash, walk_tree

__all__ = [
    "EXIT_BUILD_FAILED",
    "INSTRUMENTATIONS",
    "PATCH_PATH",
    "PINNED_COMMIT",
    "BuildError",
    "Instrumentation",
    "ServerBuild",
    "build_name",
    "build_server",
    "build_source",
    "cache_root",
    "cached_binary",
    "cmake_args",
    "infer_semantics",
    "links_libllama",
    "log_tail",
    "pinned_status",
    "sdist_source",
    "server_build",
    "tree_hash",
]

Instrumentation = Literal["plain", "asan", "coverage"]
INSTRUMENTATIONS: tuple[Instrumentation, ...] = ("plain", "asan", "coverage")
_NAMES = ("master", "pr", "asan", "coverage")  # the builds of the pinned tree, as the cache names them


def build_name(semantics: str = "shared", instrumentation: str = "plain") -> str:
    """The name the cache gives the pinned tree's build of ``semantics`` with ``instrumentation``: ``master``,
    ``pr`` (``shared``, plain), ``asan`` or ``coverage`` (both ``shared``). Each cache key and build-info.json
    begins with it, so it keeps the spelling of the first release. A name itself is taken as ``semantics``
    (``build_server("shared")``, as older replay programs say)."""
    if semantics in _NAMES and instrumentation == "plain":
        return semantics
    if instrumentation not in INSTRUMENTATIONS:
        raise UsageError(f"unknown instrumentation {instrumentation!r} (choose from {', '.join(INSTRUMENTATIONS)})")
    if semantics not in ("shared", "master"):
        raise UsageError(f"unknown semantics {semantics!r} (choose from shared, master)")
    if instrumentation != "plain" and semantics != "shared":
        raise UsageError(f"the {instrumentation} build is of the shared semantics only (PR #27451)")
    return "pr" if instrumentation == "plain" and semantics == "shared" else (
        "master" if instrumentation == "plain" else instrumentation)  # fmt: skip

_SANITIZE = "-fsanitize=address,undefined -fno-omit-frame-pointer -g"

# Everything that decides what gets compiled. The prebuilt UI is off because it downloads at
# build time; OpenSSL is off (no https needed); LLAMA_CURL no longer exists in this tree (it is a
# deprecated no-op that only prints a warning), so it is not passed. Shared libraries with $ORIGIN
# run paths: the binary and its libraries move together into the cache entry.
_BASE_CMAKE_ARGS = (
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=ON",
    "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",
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


def cmake_args(semantics: str = "shared", instrumentation: str = "plain") -> list[str]:
    """The ``-D`` arguments of a build (the generator, the compiler launcher and the paths are added by the
    build; they do not change what is compiled). The semantics changes the source, not the arguments."""
    name = build_name(semantics, instrumentation)
    args = list(_BASE_CMAKE_ARGS)
    if name == "asan":
        args += [
            f"-DCMAKE_C_FLAGS={_SANITIZE}",
            f"-DCMAKE_CXX_FLAGS={_SANITIZE}",
            # -O1, as the sanitizers' documentation advises: Release's -O3 with both sanitizers compiled
            # at ~1.5 units a minute on 2 cores (llama-model.cpp alone for minutes); -O1 keeps the checks
            "-DCMAKE_C_FLAGS_RELEASE=-O1 -DNDEBUG",
            "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG",
            "-DCMAKE_EXE_LINKER_FLAGS=-fsanitize=address,undefined",
            "-DCMAKE_SHARED_LINKER_FLAGS=-fsanitize=address,undefined",
        ]
    return args + (coverage_cmake_args() if name == "coverage" else [])


def _uses_patch(name: str) -> bool:
    return name != "master"


def _compiler_id() -> str:
    cxx = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if not cxx:
        raise UsageError("no C++ compiler found (need c++, g++ or clang++ on PATH)")
    try:
        out = subprocess.run([cxx, "--version"], capture_output=True, text=True, check=False, timeout=30).stdout
    except (OSError, subprocess.TimeoutExpired) as e:
        raise UsageError(f"cannot run the C++ compiler {cxx}: {e}") from e
    return f"{cxx}: {out.splitlines()[0] if out else '?'}"


def _build_key(src_hash: str, patch: bytes | None, name: str, args: Sequence[str], compiler: str) -> str:
    h = hashlib.sha256()
    # "flavour": the word the first release hashed; another word would change every key and orphan the cache
    h.update(f"source {src_hash}\nflavour {name}\ncompiler {compiler}\n".encode())
    h.update(b"patch " + (hashlib.sha256(patch).hexdigest().encode() if patch is not None else b"none") + b"\n")
    for a in args:
        h.update(f"arg {a}\n".encode())
    return f"{name}-{h.hexdigest()[:16]}"


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


def _cmake() -> str:
    cmake = _tool("cmake")
    if cmake is None:
        raise UsageError("cmake not found: neither on PATH nor from the `cmake` Python package (a dependency)")
    return cmake


# --------------------------------------------------------------------------------------------
# build
# --------------------------------------------------------------------------------------------


def cached_binary(semantics: str = "shared", instrumentation: str = "plain") -> Path | None:
    """The pinned tree's cached ``llama-server`` of ``semantics`` with ``instrumentation`` if it was already
    built, else None (never builds)."""
    name = build_name(semantics, instrumentation)
    args = cmake_args(name)
    vendored = sdist_extracted()
    if vendored is None:
        return None
    try:
        patch = PATCH_PATH.read_bytes() if _uses_patch(name) else None
        key = _build_key(source_hash(vendored), patch, name, args, _compiler_id())
    except (OSError, UsageError):
        return None
    binary = cache_root() / "llama-server" / key / BINARY
    return binary if binary.is_file() else None


def build_server(
    semantics: str = "shared",
    instrumentation: str = "plain",
    *,
    jobs: int | None = None,
    force: bool = False,
    log: Callable[[str], None] = print,
) -> Path:
    """Build (or reuse) the pinned tree's ``llama-server`` of ``semantics`` with ``instrumentation`` and
    return the binary's path.

    Raises :class:`~harness.errors.UsageError` for a bad semantics or instrumentation or missing tools and
    :class:`BuildError` (one line, naming the log file) when the build fails.
    """
    name = build_name(semantics, instrumentation)
    args = cmake_args(name)
    cmake = _cmake()
    compiler = _compiler_id()
    patch: bytes | None = None
    if _uses_patch(name):
        try:
            patch = PATCH_PATH.read_bytes()
        except OSError as e:
            raise UsageError(f"cannot read the PR patch {PATCH_PATH}: {e}") from e

    vendored = sdist_source(log)
    key = _build_key(source_hash(vendored), patch, name, args, compiler)
    servers = cache_root() / "llama-server"
    final = servers / key
    binary = final / BINARY
    with file_lock(servers / f".{key}.lock"):
        if not binary.is_file() or force:
            info = {
                "flavour": name,  # build-info.json's key since the first release (older entries have only it)
                "build_name": name,
                "semantics": "shared" if patch is not None else "master",
                "sdist": f"{SDIST_NAME}=={SDIST_VERSION}",
                "source_sha256": source_hash(vendored),
                "patch": str(PATCH_PATH) if patch is not None else None,
                "patch_sha256": hashlib.sha256(patch).hexdigest() if patch is not None else None,
            }
            files = pinned_files(patch is not None, log)
            _build_locked(name, args, files, str(vendored), final, cmake, compiler, jobs, log, info)
        _ensure_tree_recorded(final, patch, compiler, log)
    return binary


def _ensure_tree_recorded(final: Path, patch: bytes | None, compiler: str, log: Callable[[str], None]) -> None:
    """Record the content hash of the tree a pinned build was built from (older builds lack it), so a
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
            binary = info_path.parent / BINARY
            if binary.is_file():
                return binary
    return None


def _forget_ui_assets(build_dir: Path, src: Path) -> None:
    """The web UI's generated files (provisioned assets, ``ui.cpp``, the embed stamps) live in the build directory,
    which every tree built with the same flags shares: one tree's fail another tree's embed step ("missing required
    asset(s)", b9631). They are dropped when the staged tree's UI generation (``scripts/ui-assets.cmake``,
    ``tools/ui``'s CMake files and templates) differs from the last build's, and kept otherwise, so near-identical
    trees still recompile only what differs (the harness never serves the UI)."""
    h = hashlib.sha256()
    for f in sorted([src / "scripts" / "ui-assets.cmake", *(src / "tools" / "ui").glob("*.cmake"),
                     *(src / "tools" / "ui").glob("*.in"), *(src / "tools" / "ui").glob("CMakeLists.txt"),
                     *(src / "tools" / "ui").glob("*.cpp")]):  # fmt: skip
        if f.is_file():
            h.update(f.name.encode() + b"\0" + f.read_bytes())
    marker = build_dir / ".harness-ui-generation"
    with contextlib.suppress(OSError):
        if marker.read_text() == h.hexdigest():
            return
    shutil.rmtree(build_dir / "tools" / "ui", ignore_errors=True)
    build_dir.mkdir(parents=True, exist_ok=True)
    marker.write_text(h.hexdigest())


def _tree_args(src: Path) -> list[str]:
    """Flags a tree itself needs: the embedded web UI off where the tree has the option but not the assets it
    embeds (a package index's sdist ships ``tools/server`` without the generated ``public/`` bundle; the harness
    never serves the UI). Nothing for a tree that builds as it is, so its cache key stays."""
    cml = src / "tools" / "server" / "CMakeLists.txt"
    try:
        text = cml.read_text(errors="replace")
    except OSError:
        return []
    assets = re.findall(r"^\s+(bundle\.\w+|index\.html\.gz)\s*$", text, re.M)
    missing = [a for a in assets if not (src / "tools" / "server" / "public" / a).is_file()]
    if "option(LLAMA_BUILD_WEBUI" in text and missing:
        return ["-DLLAMA_BUILD_WEBUI=OFF"]
    return []


def build_source(
    src: Path,
    *,
    asan: bool = False,
    jobs: int | None = None,
    force: bool = False,
    log: Callable[[str], None] = print,
    flag: str = "--source",
) -> Path:
    """Build (or reuse) ``llama-server`` from any llama.cpp checkout ``src`` and return its path.

    The build is cached by :func:`tree_hash` of the tree, the CMake flags (the same portable flags
    as the pinned builds; ``asan`` adds the sanitizers) and the compiler: a tree with the same
    content as an earlier build (a copy, another checkout of the same commit, the pinned tree)
    reuses it. The tree itself is never written to (it is staged into the cache and built there).
    """
    src = check_tree(src, flag)
    args = cmake_args("shared", "asan" if asan else "plain") + _tree_args(src)
    cmake = _cmake()
    compiler = _compiler_id()
    log(f"[source] hashing {src}")
    digest = tree_hash(src)
    pinned = pinned_semantics(digest)
    if pinned is not None and not (asan and pinned == "master"):
        # the pinned tree itself (e.g. a copy of it): the pinned build of that semantics is this build
        instrumentation = "asan" if asan else "plain"
        log(f"[source] {src} is the pinned llama.cpp {PINNED_COMMIT} tree: using its {pinned} {instrumentation} "
            "build")  # fmt: skip
        return build_server(pinned, instrumentation, jobs=jobs, force=force, log=log)
    h = hashlib.sha256(f"tree {digest}\ncompiler {compiler}\n".encode())
    for a in args:
        h.update(f"arg {a}\n".encode())
    key = f"source-{h.hexdigest()[:16]}"
    servers = cache_root() / "llama-server"
    final = servers / key
    binary = final / BINARY
    if binary.is_file() and not force:
        return binary
    if not force:
        same = _find_build(digest, args, compiler)
        if same is not None:
            log(f"[source] the same tree and flags were built before ({same.parent.name}): reusing {same}")
            return same
    with file_lock(servers / f".{key}.lock"):
        if binary.is_file() and not force:
            return binary
        inferred = infer_semantics(src)
        info = {
            "flavour": None,  # build-info.json's key since the first release (older entries have only it)
            "build_name": None,
            "source": str(src),
            "semantics": inferred.semantics,
            "semantics_why": inferred.why,
            "asan": asan,
            "tree_sha256": digest,
            **({"registry": origin} if (origin := registry_origin(src)) else {}),  # an upstream build by name
        }
        return _build_locked("source", args, dict(walk_tree(src)), str(src), final, cmake, compiler, jobs, log, info)


def _build_locked(
    label: str,
    args: list[str],
    files: Mapping[str, Path | bytes],
    origin: str,
    final: Path,
    cmake: str,
    compiler: str,
    jobs: int | None,
    log: Callable[[str], None],
    info: Mapping[str, Any],
) -> Path:
    """Stage ``files``, configure, build and copy the binary and its libraries into ``final`` (the caller
    holds ``final``'s lock; the stage has its own)."""
    servers = final.parent
    key = final.name
    logs = servers / "logs"
    logs.mkdir(parents=True, exist_ok=True)
    log_path = logs / f"{key}.log"
    log_path.write_text(f"# llama-server build {key} ({label}) of {origin} started {time.ctime()}\n")
    for stale in servers.glob(f".build-{key}-*"):  # left by a killed build; we hold the key's lock
        shutil.rmtree(stale, ignore_errors=True)
    root = stage_root()
    launcher, env = ccache_setup()
    with file_lock(root / ".lock"):
        tmp = Path(tempfile.mkdtemp(prefix=f".build-{key}-", dir=servers))
        t0 = time.monotonic()
        try:
            src = root / "src"
            changed = sync_stage(files, src)
            log(f"[{label}] staged {origin} in {src} ({changed} file{'' if changed == 1 else 's'} changed since the "
                f"stage's last build)")  # fmt: skip
            build_dir = root / ("build-" + hashlib.sha256("\n".join(args).encode()).hexdigest()[:12])
            _forget_ui_assets(build_dir, src)
            ninja = _tool("ninja")
            gen = ["-G", "Ninja", f"-DCMAKE_MAKE_PROGRAM={ninja}"] if ninja else []
            log(f"[{label}] configuring with cmake in {build_dir} (log: {log_path})")
            try:
                run_logged([cmake, "-S", str(src), "-B", str(build_dir), *gen, *args, *launcher], log_path,
                           f"cmake configure ({label}) failed", env=env)  # fmt: skip
            except BuildError:
                shutil.rmtree(build_dir, ignore_errors=True)  # no half-configured cache for the next try
                raise
            if ninja and (build_dir / ".ninja_deps").exists():
                # ninja 1.13 never recovers from a truncated deps log (a build killed while writing it): every
                # later build recompiles all 144 objects (ninja-build/ninja#2703). Recompacting drops the torn
                # tail, so at worst this one build recompiles and the next ones only what changed.
                run_logged([ninja, "-C", str(build_dir), "-t", "recompact"], log_path,
                           f"ninja could not recompact its deps log in {build_dir}", env=env)  # fmt: skip
            n = jobs or min(os.cpu_count() or 1, 2)
            before = ccache_counts(env)
            log(f"[{label}] building {BINARY} and libllama with -j{n}" + (" through ccache" if launcher else "")
                + " (slow the first time)")  # fmt: skip
            run_logged([cmake, "--build", str(build_dir), "--target", BINARY, "-j", str(n)], log_path,
                       f"compiling llama-server ({label}) failed", env=env)  # fmt: skip
            after = ccache_counts(env)
            out = tmp / "out"
            out.mkdir()
            copy_artifacts(build_dir / "bin", out)
            gcov = keep_notes(build_dir, src, out) if is_coverage(args) else None
            shutil.copy2(log_path, out / "build.log")
            seconds = round(time.monotonic() - t0, 1)
            cc = None if before is None or after is None else {k: after[k] - before[k] for k in after}
            record = {**info, "cmake_args": args, "compiler": compiler, "seconds": seconds, "staged_changes": changed,
                      "ccache": cc, **({"coverage": gcov} if gcov else {})}  # fmt: skip
            (out / "build-info.json").write_text(json.dumps(record, indent=2) + "\n")
            if final.exists():  # --force: swap the old build out, then drop it
                os.rename(final, tmp / "old")
            os.rename(out, final)
            said = "" if cc is None else f"; ccache {cc['hits']} hits, {cc['misses']} misses"
            log(f"[{label}] built {final / BINARY} in {seconds:.0f}s ({changed} staged changes{said})")
            return final / BINARY
        except BuildError as e:
            tail = log_tail(log_path)
            raise BuildError(
                f"{e}; last lines: " + " | ".join(line.strip() for line in tail[-4:] if line.strip())
            ) from None
        finally:
            shutil.rmtree(tmp, ignore_errors=True)


@dataclass(frozen=True)
class ServerBuild:
    """A ``llama-server`` binary and what is known of it: where it came from, the semantics of its
    tree (None when unknown) and why, whether it is instrumented, how a replay program gets it again,
    and the directory of its shared libllama (None when it links libllama statically)."""

    binary: Path
    origin: str  # "build NAME" (a pinned build, by its :func:`build_name`), "source DIR", "binary PATH"
    semantics: str | None
    asan: bool
    replay_expr: str  # a Python expression giving the binary in a replay program
    replay_flags: str  # the gate's command-line flags that select it
    tree: Path | None = None
    pinned: bool = True  # built from the tree the model mirrors (0c1e570, with or without the patch)
    semantics_why: str = ""
    lib_dir: Path | None = None

    @property
    def label(self) -> str:
        return self.origin.split(" ", 1)[1] if self.by_name else self.origin

    @property
    def by_name(self) -> bool:
        """A build of the pinned tree, by the name the cache gives it (``--semantics``/``--asan``)."""
        return self.origin.startswith("build ")


def _lib_dir(binary: Path) -> Path | None:
    return binary.parent if (binary.parent / "libllama.so").exists() and links_libllama(binary) else None


def server_build(
    *,
    semantics: str | None = None,
    source: Path | None = None,
    binary: Path | None = None,
    asan: bool = False,
    log: Callable[[str], None] = print,
    flag: str = "--source",
) -> ServerBuild:
    """The binary the server backend runs: the pinned tree's build of ``semantics`` (``asan``: instrumented),
    a user's tree (built, cached) or a user's binary. Raises :class:`UsageError` (exit 2) for a bad tree or
    binary, :class:`BuildError` (exit 4) when the tree does not build."""
    if sum(x is not None for x in (semantics, source, binary)) != 1:
        raise UsageError("choose one of --semantics, --source DIR and --server-bin PATH")
    if binary is not None:
        path = binary.expanduser().resolve()
        if not path.is_file() or not os.access(path, os.X_OK):
            raise UsageError(f"--server-bin {binary}: not an executable file")
        sem, why, pinned = None, "", False
        info_path = path.parent / "build-info.json"  # ours, when the binary was built by this harness
        if info_path.is_file():
            with contextlib.suppress(OSError, ValueError, BuildError, UsageError):
                info = json.loads(info_path.read_text())
                sem = info.get("semantics")
                why = info.get("semantics_why") or "from its build-info.json"
                pinned = info.get("tree_sha256") in pinned_tree_hashes(log).values()
        instrumented = b"__asan_init" in path.read_bytes()
        return ServerBuild(path, f"binary {path}", sem, instrumented, f"Path({str(path)!r})",
                           f"--server-bin {shlex.quote(str(path))}", None, pinned, why, _lib_dir(path))  # fmt: skip
    if source is not None:
        path = build_source(source, asan=asan, log=log, flag=flag)
        tree = check_tree(source, flag)
        inferred: SemanticsInference = infer_semantics(tree)
        instrumented = b"__asan_init" in path.read_bytes()
        origin = registry_origin(tree)
        named = str(source) if origin is not None else str(tree)  # an upstream build replays by its name
        said = f" [{origin['package']}=={origin['version']}, sdist sha256 {origin['sha256']}]" if origin else ""
        return ServerBuild(path, f"source {tree}{said}", inferred.semantics, instrumented,
                           f"build_source(Path({named!r}){', asan=True' if asan else ''})",
                           f"{flag} {shlex.quote(named)}" + (" --asan" if asan else ""), tree, False,
                           inferred.why, _lib_dir(path))  # fmt: skip
    assert semantics is not None
    instrumentation = "asan" if asan else "plain"
    name = build_name(semantics, instrumentation)  # one line for asan with master
    path = build_server(semantics, instrumentation, log=log)
    flags = f"--semantics {semantics}" + (" --asan" if asan else "")
    expr = f"build_server({semantics!r}" + (", 'asan')" if asan else ")")
    return ServerBuild(path, f"build {name}", semantics, asan, expr, flags,
                       semantics_why=f"the pinned {semantics} build", lib_dir=_lib_dir(path))  # fmt: skip



def tree_of_build(build_dir: Path) -> Path | None:
    """The tree a harness build in ``build_dir`` was made from (its ``build-info.json``: a ``--source`` tree, or the
    pinned sdist's), None for a binary or library the harness did not build."""
    try:
        info = json.loads((build_dir / "build-info.json").read_text())
    except (OSError, ValueError):
        return None
    if info.get("source"):
        tree = Path(str(info["source"]))
        return tree if (tree / "include" / "llama.h").is_file() else None
    return sdist_source(lambda _m: None) if info.get("sdist") else None
