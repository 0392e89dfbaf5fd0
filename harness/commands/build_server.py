"""``python -m harness build-server``: build llama-server (cached by a hash of the source and flags)."""

from __future__ import annotations

import argparse
import sys

from harness.errors import EXIT_BUILD_FAILED, BuildError, UsageError
from harness.targets.llama_server import FLAVOURS, build_server

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--flavour",
        choices=FLAVOURS,
        default="pr",
        help="master: vendored tree; pr: + fixtures/pr-27451.patch; asan: the pr source with ASan+UBSan (default: pr)",
    )
    parser.add_argument("--jobs", "-j", type=int, default=None, help="parallel compile jobs (default: min(cpus, 2))")
    parser.add_argument("--force", action="store_true", help="rebuild even if a cached binary exists")


def run(args: argparse.Namespace) -> int:
    if args.jobs is not None and args.jobs < 1:
        raise UsageError("--jobs must be >= 1")
    try:
        path = build_server(args.flavour, jobs=args.jobs, force=args.force, log=lambda m: print(m, file=sys.stderr))
    except BuildError as e:
        print(f"error: build failed: {e}", file=sys.stderr)
        return EXIT_BUILD_FAILED
    print(path)
    return 0
