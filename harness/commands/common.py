"""What several commands share: the one spelling of the master/PR axis on the command line."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from harness.errors import UsageError

__all__ = ["SEMANTICS", "add_semantics", "models_of", "semantics_of"]

SEMANTICS = ("shared", "master")


def add_semantics(parser: argparse.ArgumentParser) -> None:
    """``--semantics shared|master`` (``shared`` is PR #27451), and the deprecated ``--variant``."""
    parser.add_argument("--semantics", choices=SEMANTICS, help="shared (PR #27451) or master (default shared)")
    parser.add_argument("--variant", choices=SEMANTICS, help=argparse.SUPPRESS)


def semantics_of(args: argparse.Namespace) -> str:
    """The semantics asked for; ``--variant`` still works, with a one-line note on stderr."""
    if args.variant is not None:
        print(f"note: --variant is deprecated; use --semantics {args.variant}", file=sys.stderr)
        if args.semantics is not None and args.semantics != args.variant:
            raise UsageError(f"--variant {args.variant} contradicts --semantics {args.semantics}; use --semantics")
        return str(args.variant)
    return str(args.semantics or "shared")


def models_of(text: str, known: Sequence[str]) -> tuple[str, ...]:
    """``--models A,B``: the models named, each one of ``known`` (else one line, exit 2)."""
    archs = tuple(a for a in text.split(",") if a)
    bad = [a for a in archs if a not in known]
    if bad or not archs:
        raise UsageError(f"--models: unknown model {','.join(bad) or text!r} (choose from {','.join(known)})")
    return archs
