"""``python -m harness build-server``: build llama-server, cached by a hash of the source tree and flags.

Without ``--source`` it builds the pinned tree (llama.cpp 0c1e570 from the llama-cpp-python 0.3.36
sdist): ``--semantics shared`` (default) with ``fixtures/pr-27451.patch`` applied, ``--semantics
master`` as vendored; ``--asan`` adds AddressSanitizer and UBSan (PR semantics); ``--coverage`` builds the
PR semantics with gcov instrumentation at ``-O0`` (``python -m harness coverage`` runs it). With ``--source DIR``
it builds any llama.cpp checkout, never writing into it; a tree with the same content as an earlier
build reuses that build. Prints the binary's path; exit 2 on a usage error, 4 when the build fails.
``--export DIR`` writes the pinned tree (with or without the patch) into ``DIR`` instead, without building.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness.commands.common import SEMANTICS
from harness.errors import UsageError
from harness.trees.build import build_server, build_source
from harness.trees.pinned import export_pinned

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--source",
        metavar="DIR",
        type=Path,
        help="build this llama.cpp tree instead of the pinned one (cached by the tree's content)",
    )
    parser.add_argument(
        "--semantics",
        choices=SEMANTICS,
        help="the pinned tree with PR #27451 (shared, default) or as vendored (master); not with --source",
    )
    parser.add_argument("--asan", action="store_true", help="build with AddressSanitizer and UBSan")
    parser.add_argument("--coverage", action="store_true",
                        help="gcov instrumentation, -O0, PR semantics (for python -m harness coverage)")
    parser.add_argument("--flavour", choices=["master", "pr", "asan"], help=argparse.SUPPRESS)  # deprecated
    parser.add_argument("--jobs", "-j", type=int, default=None, help="parallel compile jobs (default: min(cpus, 2))")
    parser.add_argument("--force", action="store_true", help="rebuild even if a cached binary exists")
    parser.add_argument("--export", metavar="DIR", type=Path,
                        help="write the pinned tree (with PR #27451 for --semantics shared) into DIR instead of "
                        "building: a tree for --source/--base, or to start a change from")


def _build(args: argparse.Namespace) -> tuple[str, str]:
    """The semantics and the instrumentation asked for."""
    if args.flavour is not None:
        new = {"pr": "--semantics shared", "master": "--semantics master", "asan": "--asan"}[args.flavour]
        print(f"note: --flavour is deprecated; use {new}", file=sys.stderr)
        if args.semantics is not None or args.asan:
            raise UsageError("--flavour is the old spelling of --semantics/--asan; use those only")
        return ("master" if args.flavour == "master" else "shared"), ("asan" if args.flavour == "asan" else "plain")
    if args.asan and args.semantics == "master":
        raise UsageError("--asan builds the PR semantics only; drop --semantics master or --asan")
    if args.coverage and (args.asan or args.semantics == "master" or args.source is not None):
        raise UsageError("--coverage builds the pinned tree with PR semantics only; drop --asan, --semantics master "
                         "and --source")  # fmt: skip
    return (args.semantics or "shared"), ("coverage" if args.coverage else "asan" if args.asan else "plain")


def run(args: argparse.Namespace) -> int:
    if args.jobs is not None and args.jobs < 1:
        raise UsageError("--jobs must be >= 1")

    def log(m: str) -> None:
        print(m, file=sys.stderr)

    if args.export is not None:
        if args.source is not None or args.asan or args.coverage:
            raise UsageError("--export writes the pinned tree; it takes --semantics only")
        print(export_pinned(_build(args)[0] == "shared", args.export, log))
        return 0
    if args.source is not None:
        _build(args)  # --coverage with --source: one line
        if args.semantics is not None or args.flavour is not None:
            raise UsageError("--semantics picks the pinned tree's build; with --source the tree is what it is")
        path = build_source(args.source, asan=args.asan, jobs=args.jobs, force=args.force, log=log)
    else:
        path = build_server(*_build(args), jobs=args.jobs, force=args.force, log=log)
    print(path)
    return 0
