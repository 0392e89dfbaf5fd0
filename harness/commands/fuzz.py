"""``python -m harness fuzz``: a local fuzzing campaign over every machine of the chosen backends.

    python -m harness fuzz [--minutes N | --examples N] [--workers K] [--backend NAME ...]
                           [--db DIR|redis://HOST:PORT/N] [--semantics shared|master] [--mutant NAME]
                           [--machine PATTERN ...] [--no-target] [--json PATH] [--plain] [--interval S]

The machines of the backends (default ``synthetic``) are spread over ``K`` worker processes, each
running its machines round-robin until the budget is spent (``--minutes``, default 10, or
``--examples`` per machine); a failure does not stop the campaign: each distinct failure is shrunk,
saved in the example database and printed once, with its program and the line that replays it.
The database (default ``.hypothesis/campaign``) may be a Redis server shared by several machines:
each campaign replays what the others found first. A live view on a terminal (``--plain``: a line
per ``--interval`` seconds, as in a pipe). ``--mutant NAME`` runs the synthetic machines on a
deliberately broken cache (``python -m harness mutants --list``). ``--no-target`` turns Hypothesis'
target phase off (the ``hypothesis.target`` guidance toward cache pressure; on by default).

Exit: 0 nothing failing, 1 a failure found (or replayed from the database and still failing),
2 bad input (before any work), 3 a worker died (its stderr's last lines are printed), 130 Ctrl-C
(after the summary; no worker left running).
"""

from __future__ import annotations

import argparse
import sys

from harness.backends import BACKENDS
from harness.campaign.engine import run_campaign
from harness.campaign.machines import Plan
from harness.campaign.view import LiveView, PlainView
from harness.commands.common import SEMANTICS
from harness.errors import EXIT_CRASH, EXIT_FAILED, EXIT_INTERRUPTED, EXIT_OK, UsageError

__all__ = ["DEFAULT_DB", "add_arguments", "run"]

DEFAULT_DB = ".hypothesis/campaign"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    budget = parser.add_mutually_exclusive_group()
    budget.add_argument("--minutes", type=float, help="time budget (default 10)")
    budget.add_argument("--examples", type=int, help="examples per machine instead of a time budget")
    parser.add_argument("--workers", type=int, default=2, help="worker processes (default 2)")
    parser.add_argument(
        "--backend", action="append", choices=list(BACKENDS), help="a backend to fuzz (repeatable; default synthetic)"
    )
    parser.add_argument("--arch", nargs="+", metavar="NAME", help="llama backend: the fixtures models (default all)")
    parser.add_argument("--semantics", choices=SEMANTICS, default="shared", help="shared (PR #27451) or master")
    parser.add_argument("--mutant", metavar="NAME", help="run the synthetic machines on this mutant")
    parser.add_argument(
        "--machine", action="append", metavar="PATTERN", help="only machines whose name matches (fnmatch)"
    )
    parser.add_argument("--db", default=DEFAULT_DB, help=f"DIR or redis://HOST:PORT/N (default {DEFAULT_DB})")
    parser.add_argument("--no-target", action="store_true", help="without Hypothesis' target phase")
    parser.add_argument("--json", metavar="PATH", help="the campaign report, rewritten at every failure")
    parser.add_argument("--plain", action="store_true", help="a line per interval even on a terminal")
    parser.add_argument("--interval", type=float, default=10.0, help="seconds between view updates (default 10)")


def run(args: argparse.Namespace) -> int:
    if args.workers < 1:
        raise UsageError("--workers must be >= 1")
    if args.examples is not None and args.examples < 1:
        raise UsageError("--examples must be >= 1")
    if args.minutes is not None and args.minutes <= 0:
        raise UsageError("--minutes must be > 0")
    if args.interval <= 0:
        raise UsageError("--interval must be > 0")
    plan = Plan(
        tuple(dict.fromkeys(args.backend or ["synthetic"])),
        args.semantics,
        args.mutant,
        tuple(args.arch) if args.arch else None,
        not args.no_target,
        tuple(args.machine) if args.machine else None,
    )
    view = LiveView() if sys.stdout.isatty() and not args.plain else PlainView(lambda s: print(s, flush=True))
    minutes = args.minutes if args.examples is None else None
    state = run_campaign(
        plan,
        args.db,
        view,
        workers=args.workers,
        minutes=10.0 if minutes is None and args.examples is None else minutes,
        examples=args.examples,
        json_path=args.json,
        interval=args.interval,
    )
    if state.interrupted:
        return EXIT_INTERRUPTED
    if state.broken_workers:
        return EXIT_CRASH
    failing = bool(state.failures) or any(v.failing for v in state.replayed)
    return EXIT_FAILED if failing else EXIT_OK
