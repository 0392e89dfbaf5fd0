"""``python -m harness <command>``: the one entry point (also the ``prompt-cache-harness`` script).

The commands are the modules of :mod:`harness.commands`, imported here directly; this module only
lists them, parses the command line and maps errors to exit codes. Any
:class:`~harness.errors.HarnessError` that escapes a command is printed as one line and ends the
run with the exit code it carries (the table is in :mod:`harness.errors`). Every command runs inside
:func:`harness.interrupt.guard`: Ctrl-C (or SIGTERM) exits 130 after the children are cleaned up, a
second Ctrl-C at once.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from types import ModuleType

from harness.commands import (
    bench,
    build_server,
    concurrent,
    contract,
    coverage,
    demo,
    fuzz,
    gate,
    history,
    mutants,
    native,
    oom,
    replay,
    report,
    reuse,
    rlimit,
    slot_files,
    soak,
    sweep,
    trace,
)
from harness.errors import EXIT_INTERRUPTED, EXIT_USAGE, HarnessError
from harness.interrupt import guard, interrupted

__all__ = ["COMMANDS", "build_parser", "main"]

# name -> (module, one-line help)
COMMANDS: dict[str, tuple[ModuleType, str]] = {
    "gate": (gate, "run the stateful properties on one or more backends (the CI gate)"),
    "mutants": (mutants, "run the gate against every mutant; all must be killed"),
    "sweep": (sweep, "SQLite-style allocation-failure sweep over canonical scenarios"),
    "rlimit": (rlimit, "the seed's save under a real address-space limit, both semantics"),
    "contract": (contract, "libllama's memory API against its contract on the five models (findings reported)"),
    "native": (native, "native malloc failures inside libllama's state calls and decode, one case each"),
    "fuzz": (fuzz, "a local fuzzing campaign: every machine of the backends, K workers, a time budget"),
    "replay": (replay, "re-run every failure a campaign's database holds: program and verdict"),
    "build-server": (build_server, "build llama-server from the llama-cpp-python sdist (cached)"),
    "concurrent": (concurrent, "K clients against a real llama-server; the model replays the order it took"),
    "oom": (oom, "big checkpoints saved under a real memory limit (cgroup, RLIMIT_AS): master killed, PR survives"),
    "soak": (soak, "sustained load on a real llama-server: RSS, cache size and outputs under a small --cache-ram"),
    "demo": (demo, "print the seed's central claim on the ledger (master vs shared)"),
    "report": (report, "the memory report: one self-contained HTML page and report.json, master vs PR"),
    "slot-files": (slot_files, "hostile slot file names against a real llama-server; nothing may escape the save dir"),
    "reuse": (reuse, "generated --cache-reuse and context-shift programs on a real llama-server against the model"),
    "trace": (trace, "trace llama-server's libllama calls, replay them in one process, shrink a divergence"),
    "coverage": (coverage, "line and branch coverage of the C++ under test (gcov build): gate, concurrent, soak, fuzz"),
    "history": (history, "bisect a finding, program or property over upstream's builds; the findings x history table"),
    "bench": (bench, "the performance table: speed ratios with goals, as JSON and docs/bench.md"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m harness",
        description="Fault-injection and property-testing harness for llama-server's prompt cache.",
        epilog="exit codes: 0 pass, 1 property failed, 2 usage/environment error, 3 target crashed, "
        "4 build failed, 5 no memory limit can be set here (oom), 130 interrupted",
    )
    sub = parser.add_subparsers(dest="command", metavar="<command>")
    for name, (module, help_) in COMMANDS.items():
        module.add_arguments(sub.add_parser(name, help=help_, description=help_))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    try:
        with guard():  # from the parsing on: a Ctrl-C anywhere is this one exit
            parser = build_parser()
            args = parser.parse_args(list(sys.argv[1:] if argv is None else argv))
            if not getattr(args, "command", None):
                parser.print_help()
                return EXIT_USAGE
            run: Callable[[argparse.Namespace], int] = COMMANDS[args.command][0].run
            rc = run(args)
            return EXIT_INTERRUPTED if interrupted() else rc  # a Ctrl-C held through the end still counts
    except HarnessError as e:
        print(f"error: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return EXIT_INTERRUPTED
