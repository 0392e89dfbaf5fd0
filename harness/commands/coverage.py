"""``python -m harness coverage --run gate|concurrent|soak|fuzz|slot-files|slot-names|reuse``: what the workloads
reach of the C++ under test.

Builds (or reuses) the ``coverage`` llama-server (``build-server --coverage``: the pinned tree with PR #27451,
gcov at ``-O0``), runs each workload on it with its counters sent into ``OUT/run/<workload>/gcda`` (never into
the cache; the servers of one workload add up), then gcovr over them: per workload and all together, one row
per function of :data:`~harness.coverage.functions.TARGETS`: lines and branches reached of the total
(throw and unreachable branches excluded), and every block of lines never reached with its reason
(``unexplained`` when the table has none). Writes ``OUT/coverage.json`` (rows, blocks, servers),
``OUT/coverage.html`` with a page per source file (gcovr ``--html-details``), and ``OUT/gcovr-*.json``.

The workloads: ``gate`` the server gate (``--semantics shared``, with its short concurrent run); ``concurrent``
(``--short`` with ``--quick``); ``soak`` for ``--minutes``; ``fuzz`` a campaign on the server backend for
``--minutes``, one worker, which counts the lines its servers reached as it goes (``lines 946/1856 (+14)`` in its
status lines: :mod:`harness.coverage.live`); ``slot-files`` the slot save/restore/erase differential
(``slot-files --differential``: completions between the actions, ten generated programs per model, then a full
tmpfs, whose truncated restore aborts one server); ``slot-names`` the hostile file names (``slot-files``: the
explicit list and ten generated names); ``reuse`` the generated ``--cache-reuse`` and context-shift programs
(``reuse``). A server writes its counters when it exits cleanly (SIGTERM); one killed or crashed (a planted fault,
an abort) writes none: each workload's line says how many servers that was. A workload that fails still counts: its
exit code is printed, and the command exits 0 once the report is written; 2 when gcovr or gcov is missing or no
server wrote counters, 4 when the coverage build fails.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

from harness.backends.llama_server.campaign import SERVER_BIN_ENV
from harness.commands import concurrent, fuzz, gate, reuse, slot_files, soak
from harness.coverage.gcovr import CoverageRun, gcovr_report
from harness.coverage.live import COVERAGE_RUN_ENV
from harness.coverage.report import print_report, write_report
from harness.errors import EXIT_OK, HarnessError, UsageError
from harness.trees.build import build_server

__all__ = ["WORKLOADS", "add_arguments", "run"]

WORKLOADS = ("gate", "concurrent", "soak", "fuzz", "slot-files", "slot-names", "reuse")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--run", nargs="+", choices=WORKLOADS, required=True, metavar="WORKLOAD",
                        help=f"the workloads, one or more of {', '.join(WORKLOADS)}")  # fmt: skip
    parser.add_argument("--out", metavar="DIR", type=Path, default=Path("coverage"),
                        help="where coverage.json, coverage.html and the run's counters go (default ./coverage)")
    parser.add_argument("--minutes", type=float, default=1.5, help="soak and fuzz: their length (default 1.5)")
    parser.add_argument("--quick", action="store_true", help="concurrent: only the gate's two configurations")
    parser.add_argument("--seed", type=int, default=0, help="the workloads' seed (default 0)")
    parser.add_argument("--report-only", action="store_true",
                        help="run nothing: report again on the counters an earlier run left in OUT/run")
    parser.add_argument("--top", type=int, default=15, help="unexplained blocks printed (default 15; all in the JSON)")


def _argv(workload: str, binary: Path, args: argparse.Namespace, run: CoverageRun) -> list[str]:
    seed = ["--seed", str(args.seed)]
    if workload == "gate":
        return ["--backend", "server", "--server-bin", str(binary), "--semantics", "shared", *seed]
    if workload == "concurrent":
        return ["--server-bin", str(binary), "--traces", "1", *(["--short"] if args.quick else []), *seed]
    if workload == "soak":
        return ["--server-bin", str(binary), "--minutes", str(args.minutes), *seed]
    if workload == "slot-files":
        return ["--server-bin", str(binary), "--differential", "--examples", "10", *seed]
    if workload == "slot-names":
        return ["--server-bin", str(binary), "--examples", "10", *seed]
    if workload == "reuse":
        return ["--server-bin", str(binary), *seed]
    db = str(run.root / "fuzz-db")
    return ["--backend", "server", "--minutes", str(args.minutes), "--workers", "1", "--plain", "--db", db]


@contextmanager
def _environ(env: dict[str, str]) -> Iterator[None]:
    """The workload's servers (and a campaign's workers) inherit these."""
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _run_workload(module: ModuleType, argv: Sequence[str]) -> tuple[int, str]:
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    try:
        return int(module.run(parser.parse_args(list(argv)))), ""
    except HarnessError as e:  # the counters of the servers it ran still count
        return e.exit_code, str(e)


def run(args: argparse.Namespace) -> int:
    if args.minutes <= 0:
        raise UsageError("--minutes must be > 0")
    if args.top < 0:
        raise UsageError("--top must be >= 0")
    workloads = list(dict.fromkeys(args.run))
    binary = build_server("shared", "coverage", log=lambda m: print("  build: " + m, file=sys.stderr))
    out: Path = args.out
    run_ = CoverageRun.create(out / "run", binary)
    modules = {"gate": gate, "concurrent": concurrent, "soak": soak, "fuzz": fuzz, "slot-files": slot_files,
               "slot-names": slot_files, "reuse": reuse}
    exits: dict[str, tuple[int, str]] = {w: (-1, "not run (--report-only)") for w in workloads}
    for w in [] if args.report_only else workloads:
        argv = _argv(w, binary, args, run_)
        command = "slot-files" if w == "slot-names" else w  # the workload's harness command
        print(f"coverage: running {w}: python -m harness {command} {' '.join(argv)}", flush=True)
        run_.reset(w)
        fuzz_env = {SERVER_BIN_ENV: str(binary), COVERAGE_RUN_ENV: f"{run_.root}{os.pathsep}{w}"}
        env = {**run_.env(w), **(fuzz_env if w == "fuzz" else {})}
        with _environ(env):
            exits[w] = _run_workload(modules[w], argv)
        print(f"coverage: {w} exited {exits[w][0]}" + (f" ({exits[w][1]})" if exits[w][1] else ""), flush=True)
    counted = [w for w in workloads if w in run_.workloads()]
    if not counted:
        raise UsageError("no server of the coverage build exited cleanly: no counters to report")
    print(f"coverage: gcovr over {', '.join(counted)} (a minute or more each)", flush=True)
    docs = {"all": gcovr_report(run_, counted, out / "gcovr-all.json", html=out / "coverage.html")}
    for w in counted:
        docs[w] = docs["all"] if len(counted) == 1 else gcovr_report(run_, [w], out / f"gcovr-{w}.json")
    report = write_report(run_, docs, exits, out / "coverage.json")
    print_report(report, top=args.top)
    print(f"coverage: {out / 'coverage.json'}, {out / 'coverage.html'}")
    return EXIT_OK
