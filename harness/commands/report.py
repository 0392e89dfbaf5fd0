"""``python -m harness report``: the memory report, one self-contained HTML page and ``report.json``.

Master against PR #27451 (shared checkpoints), each on the model's ledger, libllama under memray and a
real llama-server (VmHWM/RSS): a save's transient peak against the number and the size of the
checkpoints with the theory line beside it, the logical ``--cache-ram`` charge against physical bytes,
the PR's per-update allocation cost, the breakdown of the server's peak, the fault sweep, the mutation
matrix, the known findings and the environment. The work is :mod:`harness.report.stages`; this module
parses the flags. Exit 0 when every stage ran, 1 when a stage failed (the page says which), 2 on bad
input, 4 when a build failed.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from harness.commands.common import add_server_options, resolve_servers
from harness.commands.mutants import kill
from harness.errors import EXIT_FAILED, EXIT_OK, UsageError
from harness.report.stages import SEMS, Options, build_report, command_line

__all__ = ["add_arguments", "run"]

BACKENDS = ("llama", "server")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", metavar="DIR", default="report", help="where the page, report.json and captures go")
    parser.add_argument("--backend", action="append", choices=BACKENDS,
                        help="measured layers besides the model's ledger (repeatable; default both)")  # fmt: skip
    add_server_options(parser, several="replace")  # --source or --server-bin stands for a side, --semantics which
    parser.add_argument("--quick", action="store_true", help="fewer points, one rep, one mutant (CI: ~3 minutes)")
    parser.add_argument("--reps", type=int, default=None, help="repetitions per point (default 1 quick, 3 full)")
    parser.add_argument("--budget", type=float, default=None, metavar="SECONDS",
                        help="skip the stages that would start after this (default 300 quick, 7200 full)")  # fmt: skip
    parser.add_argument("--mutants-json", metavar="PATH", help="the matrix from `python -m harness mutants --json`")


def run(args: argparse.Namespace) -> int:
    reps = args.reps if args.reps is not None else (1 if args.quick else 3)
    if reps < 1:
        raise UsageError(f"--reps must be at least 1, got {reps}")
    budget = args.budget if args.budget is not None else (300.0 if args.quick else 7200.0)
    opts = Options(
        out=Path(args.out),
        quick=args.quick,
        backends=tuple(args.backend or BACKENDS),
        servers=tuple(resolve_servers(args, "replace", SEMS)),
        budget=budget,
        reps=reps,
        mutants_json=Path(args.mutants_json) if args.mutants_json else None,
        command=command_line(sys.argv[2:] if sys.argv[1:2] == ["report"] else sys.argv[1:]),
        kill=kill,
    )
    try:
        opts.out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"--out {opts.out}: {e.strerror}") from None
    report = build_report(opts, progress=lambda m: print(m, flush=True))
    for line in report["summary"]:
        print(line)
    failed = [s["name"] for s in report["stages"] if s["status"] == "failed"]
    print(f"report: {opts.out / 'report.html'} and report.json in {report['seconds']:.0f} s"
          + (f"; failed stages: {', '.join(failed)}" if failed else ""))  # fmt: skip
    if failed:
        print(f"replay: {opts.command}")
    return EXIT_FAILED if failed else EXIT_OK
