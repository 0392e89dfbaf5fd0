"""The bench's build case (``--only builds``): how long the second of two near-identical trees takes to build.

A contributor's branch and its base share nearly every file. Each build stages its tree into the one stage
of :mod:`harness.trees.stage` and compiles through ccache, so the second tree recompiles only what
differs. Measured in a child with a cache of its own (``XDG_CACHE_HOME`` a fresh directory, holding only a
copy of the extracted sdist, so nothing is downloaded): a cold build of the pinned tree with our patch, then

* ``near-identical``: the same tree with one line of ``tools/server/server-task.cpp`` changed (a cache-load
  threshold), the shape of a branch that touches one source file;
* ``the patch's base``: the pinned tree without the patch. The patch changes ``common/common.h``, which every
  file of ``common/`` and of the server includes, so those recompile whatever caches there are: the shape of
  PR #27451's own branch (5c7018ed7 also changes common/common.h).

Each second build's time over the first's, against the goal of the issue that asked for it (at most 0.15).
Only when named: a cold build is a quarter of an hour on two cores.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
from pathlib import Path

from harness.bench.framework import Budget, Figure, figure, register
from harness.child import run_child
from harness.errors import UsageError
from harness.trees.pinned import export_pinned, sdist_source

__all__ = ["EDIT", "builds"]

EDIT = ("tools/server/server-task.cpp", "if (f_keep_cur < 0.25f) {", "if (f_keep_cur < 0.75f) {")
"""The near-identical tree's one-line change (upstream 0c1e570, tools/server/server-task.cpp:1814)."""


def _build(tree: Path, cache: Path) -> dict[str, float]:
    """Build ``tree`` with the cache in ``cache``; its wall time and what its build-info says."""
    env = {**os.environ, "XDG_CACHE_HOME": str(cache)}
    r = run_child([sys.executable, "-m", "harness", "build-server", "--source", str(tree)], env=env, timeout=3 * 3600)
    if r.crashed or r.returncode != 0:
        tail = (r.stdout + r.stderr).strip().splitlines()[-3:]
        raise UsageError(f"building {tree} failed ({r.describe()}): {' | '.join(tail)}")
    info = json.loads((Path(r.stdout.strip().splitlines()[-1]).parent / "build-info.json").read_text())
    cc = info.get("ccache") or {}
    return {"seconds": r.elapsed, "staged": info.get("staged_changes", -1), "hits": cc.get("hits", -1),
            "misses": cc.get("misses", -1)}  # fmt: skip


@register("builds", "the second of two near-identical llama.cpp trees: its build time against the first's",
          full_only=True, named_only=True)  # fmt: skip
def builds(b: Budget) -> list[Figure]:
    figures: list[Figure] = []
    with tempfile.TemporaryDirectory(prefix="bench-builds-") as tmp:
        root = Path(tmp)
        cache = root / "cache"
        sdist = sdist_source().parents[1]
        shutil.copytree(sdist, cache / "prompt-cache-harness" / "sdist" / sdist.name, symlinks=True)
        pr = export_pinned(True, root / "pr")
        near = export_pinned(True, root / "near")
        rel, old, new = EDIT
        text = (near / rel).read_text()
        if text.count(old) != 1:
            raise UsageError(f"{rel} no longer holds {old!r}: the bench's edit does not apply")
        (near / rel).write_text(text.replace(old, new))
        base = export_pinned(False, root / "base")
        b.out("  builds: a cold build of the pinned tree with the PR patch (about 15 minutes on 2 cores)")
        first = _build(pr, cache)
        b.out(f"  builds: first {first['seconds']:.0f}s ({first['misses']} ccache misses)")
        for name, tree in (("near-identical", near), ("the patch's base", base)):
            second = _build(tree, cache)
            ratio = second["seconds"] / first["seconds"]
            b.out(f"  builds: {name} {second['seconds']:.0f}s = {ratio:.3f} of the first ({second['staged']} files "
                  f"staged, ccache {second['hits']} hits, {second['misses']} misses)")  # fmt: skip
            figures.append(figure(f"second build, {name} / first", "ratio", [ratio], better="lower",
                                  goal=("<=", 0.15), first_s=round(first["seconds"], 1),
                                  second_s=round(second["seconds"], 1), staged=second["staged"],
                                  ccache_hits=second["hits"], ccache_misses=second["misses"]))  # fmt: skip
        figures.append(figure("first build, cold", "s", [first["seconds"]], better="lower",
                              ccache_misses=first["misses"]))  # fmt: skip
    return figures
