"""The findings x history table: every registered finding on a spread of builds, present, absent, skipped (with
why) or not applicable (and why), as Markdown for ``docs/findings.md`` and each finding's report text.

A finding is applicable when its reproducer takes a ``llama-server`` binary or a layer shows it on a build's own
libllama (:func:`~harness.history.checks.finding_check`); the others say why not: the model's own findings are about
the model's logic and shown on the real server by another one, llama-cpp-python's are about its package, not
llama.cpp's history.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from harness.findings import FINDINGS, Finding
from harness.history.bisect import Tested
from harness.history.checks import ABSENT, PRESENT, SKIPPED, Check, finding_check
from harness.history.points import Point
from harness.interrupt import check as check_interrupt
from properties.run import commit

__all__ = ["HistoryRow", "all_findings", "markdown", "not_applicable", "record", "scan", "since_line"]

_MARK = {PRESENT: "present", ABSENT: "absent", SKIPPED: "skipped"}


def not_applicable(f: Finding) -> str | None:
    """Why ``history`` cannot test ``f`` on other builds (None: it can)."""
    if finding_check(f) is not None:
        return None
    if f.reproducer is None:
        return "no standalone reproducer"
    return {
        "synthetic": "the model's own finding; its reproducer drives the pinned build",
        "llama-cpp-python-cache": "llama-cpp-python's own cache, not llama.cpp's history",
    }.get(f.backend, "its reproducer drives the pinned build only (it takes no llama-server binary)")


@dataclass
class HistoryRow:
    """One finding on the points of a spread: a :class:`Tested` per point, or why none applies."""

    finding: Finding
    cells: dict[str, Tested] = field(default_factory=dict)
    why_not: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"id": self.finding.id, "title": self.finding.title, "not_applicable": self.why_not,
                "builds": {k: t.to_json() for k, t in self.cells.items()}}  # fmt: skip


def scan(points: Sequence[Point], findings: Sequence[Finding], test: Callable[[Check, Point], Tested],
         progress: Callable[[str], None], rows: list[HistoryRow]) -> list[HistoryRow]:  # fmt: skip
    """Every finding on every point (build by build, so each build is compiled once); ``rows`` is filled as it goes,
    so a caller that catches Ctrl-C keeps the cells so far."""
    rows[:] = [HistoryRow(f, why_not=not_applicable(f)) for f in findings]
    live = [r for r in rows if r.why_not is None]
    for k, p in enumerate(points, 1):
        for r in live:
            check_interrupt()
            progress(f"history: {p.label} ({k} of {len(points)}): {r.finding.id}")
            check = finding_check(r.finding)
            assert check is not None  # live rows have one
            t = test(check, p)
            r.cells[p.label] = t
            progress(f"history: {p.label}: {r.finding.id} {t.verdict.state} ({t.build}): {t.verdict.why[:160]}")
    return rows


def since_line(row: HistoryRow, points: Sequence[Point]) -> str:
    """One line for a finding's report: the builds it was seen on, and where it changed between two tested ones."""
    if row.why_not is not None:
        return f"not tested on other builds: {row.why_not}"
    seen = [(p, row.cells[p.label].verdict.state) for p in points if p.label in row.cells]
    if not seen:
        return "no build tested yet"
    present = [p.label for p, s in seen if s == PRESENT]
    absent = [p.label for p, s in seen if s == ABSENT]
    changes = [f"{'fixed' if a == PRESENT else 'introduced'} between {p.label} and {q.label}"
               for (p, a), (q, b) in zip([x for x in seen if x[1] != SKIPPED], [x for x in seen if x[1] != SKIPPED][1:],
                                         strict=False) if a != b]  # fmt: skip
    parts = [f"present on {', '.join(present)}" if present else "present on none tested",
             f"absent on {', '.join(absent)}" if absent else ""]  # fmt: skip
    return "; ".join(x for x in [*parts, *changes] if x)


def markdown(rows: Sequence[HistoryRow], points: Sequence[Point]) -> str:
    """The table: a row per finding, a column per build; then why each skipped cell was skipped."""
    head = "| finding | " + " | ".join(p.label for p in points) + " |"
    lines = [head, "|" + "---|" * (len(points) + 1)]
    notes: list[str] = []
    for r in rows:
        if r.why_not is not None:
            lines.append(f"| `{r.finding.id}` | " + " | ".join("n/a" for _ in points) + " |")
            continue
        cells = []
        for p in points:
            t = r.cells.get(p.label)
            cells.append("-" if t is None else _MARK[t.verdict.state])
            if t is not None and t.verdict.state == SKIPPED:
                notes.append(f"- `{r.finding.id}` at {p.label}: {t.verdict.why}")
        lines.append(f"| `{r.finding.id}` | " + " | ".join(cells) + " |")
    na = [f"- `{r.finding.id}`: {r.why_not}" for r in rows if r.why_not is not None]
    return "\n".join([*lines, "", *(["Skipped cells:", *notes, ""] if notes else []), "Not applicable:", *na, ""])


def all_findings() -> list[Finding]:
    return list(FINDINGS.values())


def record(rows: Sequence[HistoryRow], points: Sequence[Point], command: str) -> dict[str, Any]:
    """What :data:`~harness.findings.HISTORY_PATH` keeps of a table: the line each report prints, each build's
    state and why, when, with which harness commit and command."""
    return {
        "measured": datetime.now(UTC).strftime("%Y-%m-%d"),
        "commit": commit(),
        "command": command,
        "points": [p.label for p in points],
        "findings": {
            r.finding.id: {"line": since_line(r, points),
                           "builds": {k: {"state": t.verdict.state, "why": t.verdict.why} for k, t in r.cells.items()}}
            for r in rows if r.why_not is None
        },
        "not_applicable": {r.finding.id: r.why_not for r in rows if r.why_not is not None},
    }  # fmt: skip
