"""Line and branch coverage of the C++ under test, from a run of the ``coverage`` build, through gcovr.

A coverage run is a directory (:class:`CoverageRun`): ``src/`` (links to the build's sources, the directory gcov
runs in), one directory per workload whose ``gcda/`` receives the counters of every server that workload
started (:meth:`CoverageRun.env`; :mod:`harness.trees.gcov`), and ``servers.txt``, one line per
server stopped (its exit code: a server killed or crashed wrote no counters, and the report says how many).

:func:`gcovr_report` runs gcovr (its own ``--json``: files, lines with their function and branches; optionally
``--html-details``) over some workloads' counters; :func:`function_rows` turns that into one row per function
of :data:`~harness.coverage.functions.TARGETS` (a lambda counts with the function it is in), and
:func:`unreached_blocks` into the blocks of lines never reached, each with its reason. :func:`reached_lines` is
the campaign's hook: the set of ``(file, line)`` of the targets a run directory's counters reached, from gcov's
own JSON of the target objects only (:func:`gcov_doc`, seconds where gcovr takes a minute).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from harness.child import run_child
from harness.coverage.branches import UNEXPLAINED as BRANCH_UNEXPLAINED
from harness.coverage.branches import Untaken, branch_reason
from harness.coverage.functions import TARGETS, Target, reason_for
from harness.errors import Unavailable, UsageError
from harness.trees.gcov import NOTES, SERVER_EXITS_ENV, SOURCES, gcov_env

__all__ = [
    "SERVER_EXITS_ENV",
    "Block",
    "CoverageRun",
    "Row",
    "function_rows",
    "gcov_doc",
    "gcovr_report",
    "reached_lines",
    "statement_at",
    "target_reach",
    "unreached_blocks",
    "untaken_branches",
]

RUN_INFO = "coverage-run.json"
_FILES = sorted({t.file for t in TARGETS})


@dataclass
class CoverageRun:
    """A run directory for the coverage build whose cache entry is ``entry`` (the binary's directory)."""

    root: Path
    entry: Path

    @classmethod
    def create(cls, root: Path, binary: Path) -> CoverageRun:
        entry = binary.resolve().parent
        if not (entry / SOURCES).is_dir() or not (entry / NOTES).is_dir():
            raise UsageError(f"{binary} is not a coverage build (no {SOURCES}/ beside it): python -m harness "
                             "build-server --coverage")  # fmt: skip
        root.mkdir(parents=True, exist_ok=True)
        src = root / "src"
        if not src.is_dir():  # a real directory (gcov writes its .gcov files here) of links to the sources
            src.mkdir()
            for p in sorted((entry / SOURCES).iterdir()):
                os.symlink(p, src / p.name)
        (root / RUN_INFO).write_text(json.dumps({"entry": str(entry)}) + "\n")
        return cls(root, entry)

    @classmethod
    def open(cls, root: Path) -> CoverageRun:
        try:
            entry = Path(json.loads((root / RUN_INFO).read_text())["entry"])
        except (OSError, ValueError, KeyError, TypeError):
            raise UsageError(f"{root} is not a coverage run directory (no {RUN_INFO})") from None
        return cls(root, entry)

    def gcda(self, workload: str) -> Path:
        return self.root / workload / "gcda"

    def reset(self, workload: str) -> None:
        """Forget a workload's counters of an earlier run into this directory (libgcov would add to them)."""
        shutil.rmtree(self.root / workload, ignore_errors=True)

    def env(self, workload: str) -> dict[str, str]:
        """What a workload's servers need in their environment to count into this run."""
        self.gcda(workload).mkdir(parents=True, exist_ok=True)
        exits = str(self.root / workload / "servers.txt")
        return {**gcov_env(self.entry, self.gcda(workload)), SERVER_EXITS_ENV: exits}

    def workloads(self) -> list[str]:
        return sorted(p.parent.name for p in self.root.glob("*/gcda") if any(p.rglob("*.gcda")))

    def servers(self, workload: str) -> tuple[int, list[str]]:
        """How many servers stopped cleanly (exit 0), and how the others ended (no counters from them)."""
        try:
            lines = (self.root / workload / "servers.txt").read_text().split("\n")
        except OSError:
            return 0, []
        codes = [line.split()[1] for line in lines if len(line.split()) >= 2]
        return sum(c == "0" for c in codes), [c for c in codes if c != "0"]

    def pair_notes(self, workload: str) -> int:
        """Put each counter file's ``.gcno`` beside it (gcov reads them in pairs); the number of pairs."""
        notes, n = self.entry / NOTES, 0
        gcda = self.gcda(workload)
        for data in gcda.rglob("*.gcda"):
            note = notes / data.relative_to(gcda).with_suffix(".gcno")
            if note.is_file():
                shutil.copy2(note, data.with_suffix(".gcno"))
                n += 1
        return n


def _gcovr() -> list[str]:
    if shutil.which("gcov") is None:
        raise Unavailable("gcov is not installed (it comes with gcc)")
    try:
        import gcovr  # noqa: F401 - only whether it is installed
    except ImportError:
        raise Unavailable("gcovr is not installed: python -m pip install gcovr (it is in the test extras)") from None
    return [sys.executable, "-m", "gcovr"]


def gcovr_report(run: CoverageRun, workloads: Sequence[str], json_path: Path, html: Path | None = None) -> Any:
    """gcovr's JSON over ``workloads``' counters (merged), the target files only; the HTML pages too."""
    gcovr = _gcovr()
    dirs = [str(run.gcda(w)) for w in workloads if run.pair_notes(w)]
    if not dirs:
        raise UsageError(f"no counters in {run.root} for {', '.join(workloads)}: no server of the coverage build "
                         "exited cleanly")  # fmt: skip
    src = str(run.root / "src")
    argv = [*gcovr, "--root", src, "--gcov-object-directory", src, "-j", "2",
            "--exclude-throw-branches", "--exclude-unreachable-branches", "--merge-mode-functions", "separate",
            "--gcov-ignore-parse-errors", "suspicious_hits.warn_once_per_file",
            # a filter matches the file's real path (the entry's source) relative to the working directory
            *[a for f in _FILES for a in ("--filter", "(.*/)?" + re.escape(f) + "$")],
            "--json", str(json_path), *dirs]  # fmt: skip
    if html is not None:
        argv += ["--html-details", str(html), "--html-title", "llama-server: the prompt cache under test"]
    res = run_child(argv, timeout=1800)
    if res.crashed or res.returncode != 0 or not json_path.is_file():
        tail = " | ".join(line.strip() for line in res.stderr.splitlines()[-3:] if line.strip())
        raise Unavailable(f"gcovr failed ({res.describe()}): {tail}")
    return json.loads(json_path.read_text())


# --------------------------------------------------------------------------------------------
# per function
# --------------------------------------------------------------------------------------------


@dataclass
class Row:
    target: str
    function: str
    file: str
    first: int
    lines_reached: int = 0
    lines_total: int = 0
    branches_reached: int = 0
    branches_total: int = 0

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def _name(line: dict[str, Any]) -> str:
    """A line's function as gcov demangles it, less the ``auto `` a lambda's name starts with."""
    return str(line.get("function_name") or "?").removeprefix("auto ")


def _short(name: str) -> str:
    """``server_prompt_cache::load(server_prompt&, ...)::{lambda...}`` -> ``server_prompt_cache::load``."""
    return name.split("(", 1)[0]


def _code_lines(doc: Any) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for f in doc.get("files", []):
        lines = [ln for ln in f.get("lines", []) if not ln.get("gcovr/noncode") and not ln.get("gcovr/excluded")]
        out[f["file"]] = sorted(lines, key=lambda ln: ln["line_number"])
    return out


def _source(run: CoverageRun, file: str) -> list[str]:
    try:
        return (run.root / "src" / file).read_text(errors="replace").split("\n")
    except OSError:
        return []


def _selected(run: CoverageRun, t: Target, lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The lines of ``t``: of the functions it names, within its region when it has one."""
    mine = [ln for ln in lines if re.search(t.function, _name(ln))]
    if t.start is None or not mine:
        return mine
    text = _source(run, t.file)
    lo, hi = mine[0]["line_number"], mine[-1]["line_number"]
    start = next((n for n in range(lo, hi + 1) if n <= len(text) and re.search(t.start, text[n - 1])), None)
    if start is None:
        return []
    end = next((n for n in range(start + 1, hi + 1) if n <= len(text) and re.search(t.end or "$^", text[n - 1])), hi)
    return [ln for ln in mine if start <= ln["line_number"] <= end]


def function_rows(run: CoverageRun, doc: Any) -> list[Row]:
    """One row per function (or region) of :data:`TARGETS`; a target nothing matched is a row of zeros."""
    files = _code_lines(doc)
    rows: list[Row] = []
    for t in TARGETS:
        lines = _selected(run, t, files.get(t.file, []))
        if t.start is not None or not lines:
            groups = {t.label: lines}
        else:
            groups = {}
            for ln in lines:
                groups.setdefault(_short(_name(ln)), []).append(ln)
        for name, group in groups.items():
            row = Row(t.label, name, t.file, group[0]["line_number"] if group else 0)
            for ln in group:
                row.lines_total += 1
                row.lines_reached += ln.get("count", 0) > 0
                for b in ln.get("branches", []):
                    row.branches_total += 1
                    row.branches_reached += b.get("count", 0) > 0
            rows.append(row)
    return rows


@dataclass(frozen=True)
class Block:
    """Consecutive code lines of one function that nothing reached, and why."""

    target: str
    function: str
    file: str
    first: int
    last: int
    lines: int
    reason: str
    text: str

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


def unreached_blocks(run: CoverageRun, doc: Any) -> list[Block]:
    """Every block of never-reached lines of the targets, with its reason (``unexplained`` when none fits)."""
    files = _code_lines(doc)
    entered = {(f, _name(ln)) for f, lines in files.items() for ln in lines if ln.get("count", 0) > 0}
    seen: set[tuple[str, int]] = set()
    blocks: list[Block] = []
    for t in TARGETS:
        text = _source(run, t.file)
        groups: list[list[dict[str, Any]]] = [[]]
        prev_fn = None
        for ln in _selected(run, t, files.get(t.file, [])):
            key = (t.file, ln["line_number"])
            if ln.get("count", 0) > 0 or key in seen or _name(ln) != prev_fn:
                groups.append([])  # a reached line or another function ends a block
            prev_fn = _name(ln)
            if ln.get("count", 0) == 0 and key not in seen:
                seen.add(key)
                groups[-1].append(ln)
        for g in (g for g in groups if g):
            first, last = g[0]["line_number"], g[-1]["line_number"]
            body = "\n".join(text[first - 1 : last])
            fn = _name(g[0])
            why = reason_for(body, fn, (t.file, fn) in entered, "\n".join(text[max(0, first - 3) : first - 1]) + "\n")
            blocks.append(Block(t.label, _short(fn), t.file, first, last, len(g), why, body))
    return blocks


def statement_at(text: list[str], n: int) -> str:
    """Line ``n`` and, while its parentheses are open, the lines after it: the statement a branch's line starts."""
    out, depth = [], 0
    for line in text[n - 1 : n + 5]:
        out.append(line)
        depth += line.count("(") - line.count(")")
        if depth <= 0:
            break
    return "\n".join(out)


def untaken_branches(run: CoverageRun, doc: Any) -> list[Untaken]:
    """Every reached line of the targets with a branch outcome never taken, with its reason
    (:data:`~harness.coverage.branches.BRANCH_REASONS`; ``unexplained`` when none fits)."""
    files = _code_lines(doc)
    seen: set[tuple[str, int]] = set()
    out: list[Untaken] = []
    for t in TARGETS:
        text = _source(run, t.file)
        for ln in _selected(run, t, files.get(t.file, [])):
            n = ln["line_number"]
            branches = ln.get("branches", [])
            untaken = sum(b.get("count", 0) == 0 for b in branches)
            if ln.get("count", 0) == 0 or not untaken or (t.file, n) in seen:
                continue  # an unreached line's branches are its block's (unreached_blocks)
            seen.add((t.file, n))
            stmt = statement_at(text, n) if n <= len(text) else ""
            why = branch_reason(stmt, _name(ln))
            out.append(Untaken(t.label, _short(_name(ln)), t.file, n, untaken, len(branches), stmt.strip(),
                               BRANCH_UNEXPLAINED if why is None else why.reason,
                               why is not None and why.reachable))  # fmt: skip
    return out


def _target_objects(run: CoverageRun, workload: str) -> list[Path]:
    """The counter files of the objects the target files are compiled in (``server-context.cpp.gcda`` ...),
    each with its ``.gcno`` put beside it."""
    names = {Path(f).name + ".gcda" for f in _FILES if not f.endswith(".h")}
    gcda, notes, out = run.gcda(workload), run.entry / NOTES, []
    for data in sorted(p for p in gcda.rglob("*.gcda") if p.name in names):
        note, beside = notes / data.relative_to(gcda).with_suffix(".gcno"), data.with_suffix(".gcno")
        if note.is_file():
            if not beside.is_file():
                shutil.copy2(note, beside)
            out.append(data)
    return out


def gcov_doc(run: CoverageRun, workloads: Sequence[str]) -> Any:
    """The target files' lines, as gcovr's JSON has them, from gcov's own JSON of the target objects alone:
    about a second an object where gcovr over every counter file takes a minute (the campaign's bounded reads).
    A line counted in several objects or workloads (an inline function of a header) adds up. None when gcov
    failed (a counter file being written as it read it): the caller keeps its last reading."""
    if shutil.which("gcov") is None:
        raise Unavailable("gcov is not installed (it comes with gcc)")
    data = [str(p) for w in workloads for p in _target_objects(run, w)]
    if not data:
        return {"files": []}
    res = run_child(["gcov", "--json-format", "--stdout", "--demangled-names", *data], timeout=300)
    if res.crashed or res.returncode != 0:
        return None
    merged: dict[str, dict[int, dict[str, Any]]] = {f: {} for f in _FILES}
    for text in res.stdout.splitlines():
        try:
            doc = json.loads(text) if text.startswith("{") else {}
        except ValueError:
            return None
        for f in doc.get("files", []):
            lines = merged.get(f.get("file", ""))
            # a line names its function mangled (gcc 12 demangles only the function list)
            names = {fn.get("name"): fn.get("demangled_name") for fn in f.get("functions", [])}
            for ln in f.get("lines", []) if lines is not None else []:
                name = ln.get("function_name")
                had = lines.setdefault(  # type: ignore[union-attr]
                    ln["line_number"], {**ln, "count": 0, "function_name": names.get(name) or name}
                )
                had["count"] += ln.get("count", 0)
    return {"files": [{"file": f, "lines": list(lines.values())} for f, lines in merged.items() if lines]}


def target_reach(run: CoverageRun, doc: Any) -> tuple[set[tuple[str, int]], int]:
    """The ``(file, line)`` of :data:`TARGETS` that ``doc`` reached, and how many lines the targets have."""
    files, reached, total = _code_lines(doc), set(), 0
    for t in TARGETS:
        for ln in _selected(run, t, files.get(t.file, [])):
            total += 1
            if ln.get("count", 0) > 0:
                reached.add((t.file, ln["line_number"]))
    return reached, total


def reached_lines(run_dir: Path, workloads: Iterable[str] | None = None) -> set[tuple[str, int]]:
    """The ``(file, line)`` of the targets that the counters in ``run_dir`` reached (every workload unless
    named), read with gcov from the target objects' counters (:func:`gcov_doc`): a campaign counts the new ones
    as progress (:mod:`harness.coverage.live`). Empty when gcov could not read them."""
    run = CoverageRun.open(run_dir)
    names = list(workloads) if workloads is not None else run.workloads()
    doc = gcov_doc(run, names) if names else None
    return set() if doc is None else target_reach(run, doc)[0]
