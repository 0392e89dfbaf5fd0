"""The ``coverage`` build of llama-server: gcov instrumentation, its notes kept with the build, counters per run.

``build-server --coverage`` compiles the ``pr`` source (the pinned tree with PR #27451) with ``--coverage``
at ``-O0`` (so a line's count is the line's, not a neighbour's the optimiser merged it into), for the C, C++
and link steps: ``llama-server``, ``libllama.so``, ``libggml*.so`` and ``libmtmd.so`` each write their own
counters. GCC names every counter file after the object file it compiled, inside the stage's build
directory (:mod:`harness.trees.stage`), and the stage is rewritten by the next build of another
tree: so :func:`keep_notes` copies each ``.gcno`` (the compile-time half of gcov's data) and the compiled
sources into the cache entry, ``<key>/gcov/notes`` and ``<key>/gcov/src``, and records the build directory.

A server writes its ``.gcda`` counters when it exits cleanly (``exit``/return from ``main``: llama-server does
on SIGTERM/SIGINT, ``tools/server/server.cpp:28`` at 0c1e570); a server killed or crashed writes none.
:func:`gcov_env` sends them into a run's own directory (``GCOV_PREFIX``, ``GCOV_PREFIX_STRIP`` = the depth of
the build directory), never into the cache: several servers of one run add up in the same files (libgcov
merges into a counter file that already exists).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.errors import BuildError, UsageError
from harness.trees.stage import stage_root

__all__ = [
    "COVERAGE_FLAGS",
    "NOTES",
    "SERVER_EXITS_ENV",
    "SOURCES",
    "coverage_cmake_args",
    "gcov_env",
    "is_coverage",
    "keep_notes",
]

COVERAGE_FLAGS = "--coverage"
NOTES = "gcov/notes"  # in a cache entry: the .gcno files, at their path under the build directory
SOURCES = "gcov/src"  # in a cache entry: the compiled tree's sources, at their path in the tree
# when set (a coverage run), ServerProcess.stop appends "pid exit-code" of each server it stopped to this file:
# a server that did not exit 0 wrote no counters
SERVER_EXITS_ENV = "PROMPT_CACHE_SERVER_EXITS"
_SOURCE = re.compile(r".*\.(c|cc|cpp|cxx|h|hh|hpp|inc)$")


def coverage_cmake_args() -> list[str]:
    """Added to the base arguments for the ``coverage`` build: ``--coverage`` on compile and link, ``-O0``,
    and the source names the notes record made relative to the tree's root (:func:`_prefix_maps`)."""
    flags = f"{COVERAGE_FLAGS} {_prefix_maps()}"
    return [
        f"-DCMAKE_C_FLAGS={flags}",
        f"-DCMAKE_CXX_FLAGS={flags}",
        # Release's -O3 merges and moves lines; -O0 keeps one count per source line (and compiles faster)
        "-DCMAKE_C_FLAGS_RELEASE=-O0 -DNDEBUG",
        "-DCMAKE_CXX_FLAGS_RELEASE=-O0 -DNDEBUG",
        f"-DCMAKE_EXE_LINKER_FLAGS={COVERAGE_FLAGS}",
        f"-DCMAKE_SHARED_LINKER_FLAGS={COVERAGE_FLAGS}",
    ]


def _prefix_maps() -> str:
    """GCC records each source in the notes by the name it compiled it under: the stage's absolute path (a
    unity file of libllama includes its sources by it; a build without ccache) or, through ccache, the path
    relative to the build directory (``CCACHE_BASEDIR`` rewrites ``/stage/src/x`` into ``../src/x``). Both are
    mapped to ``./x`` (``-fprofile-prefix-map``, GCC 12): gcov then reads the sources relative to the
    directory it runs in, a run's copy of the entry's sources, never the stage a later build rewrites."""
    return f"-fprofile-prefix-map={stage_root() / 'src'}=. -fprofile-prefix-map=../src=."


def is_coverage(args: Sequence[str]) -> bool:
    flags = "-DCMAKE_CXX_FLAGS="
    return any(a.startswith(flags) and COVERAGE_FLAGS in a.removeprefix(flags).split() for a in args)


def keep_notes(build_dir: Path, stage_src: Path, out: Path) -> dict[str, Any]:
    """Copy the build's ``.gcno`` files and the staged sources into the cache entry ``out``; what
    ``build-info.json`` records of them (the build directory the counters are named after)."""
    notes = out / NOTES
    n = 0
    for dirpath, _, names in os.walk(build_dir):
        for name in names:
            if name.endswith(".gcno"):
                src = Path(dirpath) / name
                dest = notes / src.relative_to(build_dir)
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest)
                n += 1
    if n == 0:
        raise BuildError(f"the coverage build wrote no .gcno files under {build_dir}")
    sources = out / SOURCES
    for dirpath, dirs, names in os.walk(stage_src):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in names:
            if _SOURCE.match(name):
                src = Path(dirpath) / name
                dest = sources / src.relative_to(stage_src)
                dest.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, dest)
    return {"build_dir": str(build_dir), "stage_src": str(stage_src), "notes": n}


def gcov_env(entry: Path, run_dir: Path) -> dict[str, str]:
    """The environment that makes a server of the coverage build in ``entry`` write its counters under
    ``run_dir`` (at their path under the build directory). Raises :class:`UsageError` for a build that is not
    a coverage build."""
    try:
        info = json.loads((entry / "build-info.json").read_text())
        build_dir = Path(info["coverage"]["build_dir"])
    except (OSError, ValueError, KeyError, TypeError):
        raise UsageError(f"{entry} is not a coverage build of this harness (python -m harness build-server "
                         "--coverage)") from None  # fmt: skip
    return {"GCOV_PREFIX": str(run_dir), "GCOV_PREFIX_STRIP": str(len(build_dir.parts) - 1)}
