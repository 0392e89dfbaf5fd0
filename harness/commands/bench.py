"""``python -m harness bench``: the performance table, measured side by side in one run (issue 17).

Runs the cases of :mod:`harness.bench.cases` (all, or ``--only NAME``, repeatable), prints one
table with each figure's median, min..max over its repetitions, its goal and whether the goal is met,
writes every figure with its inputs as JSON (``--json PATH``, default ``artifacts/bench.json``) and the
table as markdown (``--md PATH``, default ``artifacts/bench.md``; ``docs/bench.md`` is the last full
run, replaced only when named). ``--quick`` is the tiny budget of the test (a few examples, one
repetition, the gate case skipped): its figures say nothing about speed.
``--merge JSON`` adds the cases of an earlier run that this one did not run (the long ones can run
apart, in another process). ``--compare OLD.json`` prints each figure's ratio against an earlier
run and flags the regressions beyond the noise the two runs measured; with regressions it exits 1.

A missed goal is printed (``MISSED``) but does not fail the command: the bench measures, the gate judges.
"""

from __future__ import annotations

import argparse
import json
import os

from harness.bench import builds as bench_builds  # noqa: F401  (registers the cases)
from harness.bench import cases as bench_cases  # noqa: F401
from harness.bench import oom as bench_oom  # noqa: F401
from harness.bench.framework import CASES, compare, load_json, run_bench, table
from harness.errors import EXIT_FAILED, EXIT_OK, UsageError
from properties.run import commit

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--only", action="append", metavar="NAME", help=f"run only this case: {', '.join(sorted(CASES))}"
    )
    parser.add_argument("--quick", action="store_true", help="tiny budget (for the test): figures mean nothing")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--reps", type=int, metavar="N", help="repetitions of every case (default: each case's own)")
    parser.add_argument("--json", metavar="PATH", default=os.path.join("artifacts", "bench.json"))
    parser.add_argument(
        "--md", metavar="PATH", default=os.path.join("artifacts", "bench.md"),
        help="markdown table (docs/bench.md holds the last full run: --md docs/bench.md to replace it)",
    )  # fmt: skip
    parser.add_argument("--compare", metavar="OLD.json", help="ratios against an earlier run; regressions exit 1")
    parser.add_argument(
        "--merge",
        action="append",
        metavar="JSON",
        help="also take the cases of an earlier run (repeatable; the cases run now win): long cases run apart",
    )
    parser.add_argument("--list", action="store_true", help="list the cases and exit")


def _write(path: str, text: str) -> None:
    try:
        if os.path.dirname(path):
            os.makedirs(os.path.dirname(path), exist_ok=True)
        with open(path, "w") as f:
            f.write(text)
    except OSError as e:
        raise UsageError(f"cannot write {path}: {e.strerror or e}") from None


def _markdown(doc: dict[str, object]) -> str:
    m = doc["machine"]
    cases = doc["cases"]
    assert isinstance(m, dict) and isinstance(cases, dict)
    origins = [f"`{name}` ({entry['from']})" for name, entry in cases.items() if "from" in entry]
    merged = f"\nCases measured in separate runs and merged (`--merge`): {', '.join(origins)}.\n" if origins else ""
    return (
        "# Bench\n\n"
        f"`python -m harness bench{' --quick' if doc['quick'] else ''}` at commit `{doc['commit']}`, "
        f"seed {doc['seed']}, started {doc['started']}, on {m['cpus']} CPUs ({m.get('cpu', 'CPU not recorded')}, "
        f"Python {m['python']}); "
        f"load average {m['loadavg_start']} at the start, {m['loadavg_end']} at the end.\n\n"
        "Ratios are measured interleaved in one run (the exploration ratio in CPU seconds of its arms, "
        "children that take turns on one CPU), so they hold on a loaded machine; absolute rates and times do "
        "not. A ratio still depends on the CPU model: `--compare` calls nothing a regression across two. "
        "The JSON beside this table (`--json`) has every figure's samples and inputs.\n\n"
        + table(doc, markdown=True)
        + "\n"
        + merged
    )


def run(args: argparse.Namespace) -> int:
    if args.list:
        for name, case in CASES.items():
            when = " (only when named: --only NAME)" if case.named_only else ""
            when = when or (" (full bench only)" if case.full_only else "")
            print(f"{name:<12} {case.title}{when}")
        return EXIT_OK
    old = load_json(args.compare) if args.compare else None  # a bad OLD.json fails before the run
    merged = [load_json(p) for p in args.merge or []]
    if args.reps is not None and args.reps < 1:
        raise UsageError(f"--reps must be >= 1, got {args.reps}")
    doc = run_bench(commit(), args.only, quick=args.quick, seed=args.seed, reps=args.reps)
    for m in merged:
        for name, entry in m["cases"].items():
            if name not in doc["cases"]:
                origin = f"commit {m.get('commit', '?')}, started {m.get('started', '?')}"
                doc["cases"][name] = {**entry, "from": entry.get("from", origin)}  # a merged case keeps its origin
    print(table(doc, markdown=False))
    _write(args.json, json.dumps(doc, indent=2) + "\n")
    if args.md:
        _write(args.md, _markdown(doc))
    print(f"wrote {args.json}" + (f" and {args.md}" if args.md else ""))
    if old is None:
        return EXIT_OK
    lines, regressions = compare(old, doc)
    print(f"against {args.compare} (commit {old.get('commit', '?')}): new/old, > 1 is better")
    for line in lines:
        print(line)
    if regressions:
        print(f"{len(regressions)} regression(s) beyond the noise: {', '.join(regressions)}")
        return EXIT_FAILED
    print("no regression beyond the noise")
    return EXIT_OK
