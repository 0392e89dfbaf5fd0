"""``python -m harness <command>``: the one entry point (also the ``prompt-cache-harness`` script).

Each command lives in the package that owns it and exposes ``add_arguments(parser)`` and
``run(args) -> int``; this module only lists them, parses the command line and maps failures to
exit codes. The codes are the same for every command:

====  ==========================================================================
0     everything checked passed
1     a property or trial failed (the output ends with how to replay it)
2     usage or environment error (bad flag, missing file, port in use): one line
3     the target crashed (an exception escaped the server model, or a child died)
130   interrupted (Ctrl-C); children are cleaned up, findings so far are printed
====  ==========================================================================
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence
from typing import Protocol, cast

__all__ = ["EXIT_CRASH", "EXIT_FAILED", "EXIT_INTERRUPTED", "EXIT_OK", "EXIT_USAGE", "UsageError", "main"]

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_CRASH = 3
EXIT_INTERRUPTED = 130


class UsageError(Exception):
    """A bad flag, file or environment: printed as one line, exit code 2."""


class _Command(Protocol):
    def add_arguments(self, parser: argparse.ArgumentParser) -> None: ...

    def run(self, args: argparse.Namespace) -> int: ...


# name -> (module, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "gate": ("properties.gate", "run the stateful properties (the CI gate)"),
    "mutants": ("properties.mutants_cmd", "run the gate against every mutant; all must be killed"),
    "sweep": ("faults.sweep", "SQLite-style allocation-failure sweep over canonical scenarios"),
    "rlimit": ("faults.rlimit", "the seed's save under a real address-space limit, both semantics"),
    "demo": ("harness.demo", "print the seed's central claim on the ledger (master vs shared)"),
    "build-server": ("harness.llama_server", "build llama-server from the llama-cpp-python sdist (cached)"),
}


def _load(name: str) -> _Command:
    module, _ = COMMANDS[name]
    return cast(_Command, importlib.import_module(module))


def build_parser() -> tuple[argparse.ArgumentParser, dict[str, argparse.ArgumentParser]]:
    parser = argparse.ArgumentParser(
        prog="python -m harness",
        description="Fault-injection and property-testing harness for llama-server's prompt cache.",
        epilog="exit codes: 0 pass, 1 property failed, 2 usage/environment error, 3 target crashed",
    )
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    subs = {name: sub.add_parser(name, help=help_, description=help_) for name, (_, help_) in COMMANDS.items()}
    return parser, subs


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser, subs = build_parser()
    # load only the command asked for, so --help stays fast and one broken module cannot hide others
    name = next((a for a in argv if not a.startswith("-")), None)
    if name in COMMANDS:
        try:
            _load(name).add_arguments(subs[name])
        except ImportError as e:
            print(f"error: command {name!r} is not available: {e}", file=sys.stderr)
            return EXIT_USAGE
    args = parser.parse_args(argv)
    if not getattr(args, "command", None):
        parser.print_help()
        return EXIT_USAGE
    try:
        return _load(args.command).run(args)
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
