"""``python -m harness mutants``: the gate against every mutant; each one must be killed.

For each mutant the machine of its own configuration runs first, then the gate's other machines
until one fails; if none does, the same machines run again with the next two seeds. A mutant is
killed when any property fails on it; the report names the property
(``by``), the time, and the number of steps of the shrunk program. Exit 0 only if every mutant is
killed; a surviving mutant is a property that does not guard what it claims (exit 1). The machines tried are the
gate's whole list, the machine families' included (:func:`properties.mutants.kill_configs`). ``--list`` also names
the families' mutants (:data:`properties.families.FAMILY_MUTANTS`), which ``--only NAME`` runs (their own machine
first) and ``fuzz --mutant`` plants.
"""

from __future__ import annotations

import argparse
import json

from harness.errors import EXIT_FAILED, EXIT_OK, UsageError
from properties.families import FAMILY_MUTANTS
from properties.mutants import MUTANTS, expected, kill

__all__ = ["add_arguments", "kill", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--only", action="append", metavar="NAME", help="run only this mutant (repeatable)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-examples", type=int, default=300)
    parser.add_argument("--json", metavar="PATH", help="write {'mutants': [...]} as JSON")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")


def run(args: argparse.Namespace) -> int:
    if args.list:
        for name, m in MUTANTS.items():
            print(f"{name:<28} kills: {m.kills:<20} {m.what}")
        for name, (family, kills, _, _) in FAMILY_MUTANTS.items():  # run by --only NAME and fuzz --mutant
            print(f"{name:<28} kills: {kills:<20} (the {family} machines first: --only {name})")
        return EXIT_OK
    names = args.only or list(MUTANTS)
    unknown = [n for n in names if n not in MUTANTS and n not in FAMILY_MUTANTS]  # --only NAME: a family's too
    if unknown:
        raise UsageError(f"unknown mutant(s) {', '.join(unknown)}; see --list")
    print(f"mutants: {len(names)} seed={args.seed} max_examples={args.max_examples}")
    rows = []
    for name in names:
        row = kill(name, seed=args.seed, max_examples=args.max_examples)
        rows.append(row)
        if row["killed"]:
            ok = row["by"] == row["expected"] or row["by"] in expected(name)[1]
            note = "" if ok else f" (expected {row['expected']})"
            print(f"  [killed  ] {name:<28} by {row['by']:<20} {row['steps']:>3} steps {row['seconds']:6.1f}s "
                  f"(found in {row['detect_seconds']:.1f}s, shrunk in {row['shrink_seconds']:.1f}s){note}")  # fmt: skip
        else:
            print(f"  [SURVIVED] {name:<28} expected {row['expected']}  {row['seconds']:6.1f}s")
    survivors = [r["name"] for r in rows if not r["killed"]]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"mutants": rows}, f, indent=2)
    print(
        f"{len(rows) - len(survivors)}/{len(rows)} killed"
        + (f"; survived: {', '.join(survivors)}" if survivors else "")
    )
    return EXIT_OK if not survivors else EXIT_FAILED
