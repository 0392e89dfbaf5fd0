"""``python -m harness replay [--db DIR|redis://HOST:PORT/N] [--id ID ...] [--json PATH]``.

Re-runs every failure a campaign's example database holds (or the ones named by ``--id``), on its
saved example only, and prints each one's program and verdict: ``still failing``, ``failing
differently``, ``fixed``, ``no saved example`` or ``not replayed`` (:mod:`harness.campaign.replay`).
The database is only read. Exit 1 when any failure still fails, 0 when none does, 2 on bad input.
"""

from __future__ import annotations

import argparse
import json

from harness.campaign.replay import replay_records
from harness.campaign.store import failures, open_db
from harness.commands.fuzz import DEFAULT_DB
from harness.errors import EXIT_FAILED, EXIT_OK, UsageError

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--db", default=DEFAULT_DB, help=f"DIR or redis://HOST:PORT/N (default {DEFAULT_DB})")
    parser.add_argument("--id", action="append", metavar="ID", help="replay only this failure (repeatable)")
    parser.add_argument("--json", metavar="PATH", help="write the verdicts as JSON")


def run(args: argparse.Namespace) -> int:
    db = open_db(args.db)
    records = failures(db)
    if args.id:
        unknown = sorted(set(args.id) - {r.id for r in records})
        if unknown:
            raise UsageError(f"no failure {', '.join(unknown)} in {args.db} ({len(records)} recorded)")
        records = [r for r in records if r.id in args.id]
    print(f"replay: {len(records)} failure(s) in {args.db}")
    verdicts = replay_records(db, records, print)
    counts: dict[str, int] = {}
    for v in verdicts:
        counts[v.verdict] = counts.get(v.verdict, 0) + 1
    print(", ".join(f"{n} {k}" for k, n in counts.items()) or "the database holds no failure")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"db": args.db, "failures": [v.to_json(args.db) for v in verdicts]}, f, indent=2)
    return EXIT_FAILED if any(v.failing for v in verdicts) else EXIT_OK
