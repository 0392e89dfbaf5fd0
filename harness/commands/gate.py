"""``python -m harness gate``: the stateful properties as a CI gate, on one or more backends.

A run prints every parameter it derived from its seed first (semantics, backend, profile, seed,
commit, machines and their budgets), then one line per machine, then one line per property, then
the known findings, and ends with ``PASS``/``FAIL``. A failure prints the property, the shrunk
program (faults included as steps) ready to paste into ``python``, and one line that replays it.

The ``ci`` profile is deterministic for a seed (the example database is off). The ``fuzz`` profile
runs more machines and many more examples, and keeps Hypothesis' example database in
``.hypothesis/gate`` (or ``--db``) so a failure found once is replayed first.

One word for the master/PR axis: ``--semantics shared|master`` (``shared`` is PR #27451). The
older ``--variant`` and ``--flavour pr|master|asan`` are still accepted, with a one-line note.
Exit codes: see :mod:`harness.errors` (0 pass, 1 a property failed, 2 usage, 3 the target crashed).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from harness.backends import BACKENDS, DEFAULT_BACKENDS
from harness.backends.base import Backend, Ended, GateOptions, GateReport, Option
from harness.errors import (
    EXIT_CRASH,
    EXIT_FAILED,
    EXIT_INTERRUPTED,
    EXIT_OK,
    EXIT_SKIPPED,
    EXIT_USAGE,
    HarnessError,
    HarnessLimit,
    UsageError,
)
from harness.load.gate_step import (
    against_base,
    server_concurrent_step,
    server_edges_step,
    server_full_disk_step,
    server_reuse_step,
    server_slot_files_step,
    server_stateless_step,
)
from properties.run import PROFILES, commit

__all__ = ["FOLLOW_UPS", "add_arguments", "options_from_args", "run", "run_gate"]

# work built on a backend that runs right after it in a gate run; it sits on a floor above the
# backends (harness.load), so it is listed here rather than called from the backend itself
FOLLOW_UPS: dict[str, tuple[Callable[[GateReport, GateOptions, Callable[[str], None]], None], ...]] = {
    # the short concurrent run (issue 16); stateless tasks (stateless_not_cached, stateless_fresh on the server);
    # --cache-reuse and context-shift programs (reuse_chunks, shift_timing, context_shift); slot-file programs
    # (slot_file_restore); a slot save into a full disk at every free-space boundary (no_partial_file); requests at
    # the edges of the slot actions and the cache (harness.load.edges, each case under its property)
    # (each judged against BASE in a change run: a failure BASE shows too is upstream drift)
    "server": tuple(against_base(step) for step in (server_concurrent_step, server_stateless_step, server_reuse_step,
                                                    server_slot_files_step, server_full_disk_step,
                                                    server_edges_step)),
}

SEMANTICS = ("shared", "master")


def _backend_options() -> dict[str, tuple[Option, list[str]]]:
    """Every backend's declared options by field, each with the backends that read it (in BACKENDS' order)."""
    out: dict[str, tuple[Option, list[str]]] = {}
    for name, backend in BACKENDS.items():
        for o in backend.options:
            out.setdefault(o.field, (o, []))[1].append(name)
    return out


def run_gate(
    opts: GateOptions,
    backends: Sequence[str | Backend],
    out: Callable[[str], None] = print,
    report: GateReport | None = None,
) -> GateReport:
    """Run the gate on ``backends`` (names in :data:`BACKENDS`, or instances) and return its report;
    ``out`` receives the human-readable lines. A ``report`` given is filled as the run goes, so a caller
    still holds what was found when an error or Ctrl-C ends the run early."""
    runners = [BACKENDS[b] if isinstance(b, str) else b for b in backends]
    if report is None:
        report = new_report(opts, runners)
    for b in runners:
        try:
            b.run(report, opts, out)
        except HarnessLimit as e:  # this backend cannot run on this tree: the others still do
            report.skip(f"{b.name} backend", str(e))
            out(f"  [skip] {b.name} backend: {e}")
            continue
        for step in FOLLOW_UPS.get(b.name, ()):
            step(report, opts, out)
    report.print_to(out)
    return report


def new_report(opts: GateOptions, runners: Sequence[Backend]) -> GateReport:
    return GateReport(opts.semantics, "+".join(b.name for b in runners), opts.profile, opts.seed, commit())


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--semantics",
        choices=SEMANTICS,
        help="master or shared (PR #27451) semantics; on the server backend also which build runs (default shared)",
    )
    parser.add_argument("--variant", choices=SEMANTICS, help=argparse.SUPPRESS)  # deprecated: --semantics
    parser.add_argument("--flavour", choices=["master", "pr", "asan"], help=argparse.SUPPRESS)  # deprecated
    parser.add_argument(
        "--backend",
        choices=list(BACKENDS),
        help="run one backend (default: " + " and ".join(DEFAULT_BACKENDS) + ")",
    )
    parser.add_argument("--profile", default="ci", choices=sorted(PROFILES))
    parser.add_argument("--seed", type=int, default=0, help="Hypothesis seed (default 0)")
    parser.add_argument("--db", metavar="DIR", help="example database directory (fuzz profile)")
    parser.add_argument("--max-examples", type=int, help="override the profile's examples per machine")
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON")
    parser.add_argument("--junit", metavar="PATH", help="write a JUnit XML report")
    groups: dict[str, argparse._ArgumentGroup] = {}
    for option, readers in _backend_options().values():  # each backend's own, under its name (--help)
        title = " and ".join(readers) + (" backends" if len(readers) > 1 else " backend")
        group = groups.setdefault(title, parser.add_argument_group(title))
        group.add_argument(option.flag, dest=option.field, **option.kwargs)


def _semantics(args: argparse.Namespace, warn: Callable[[str], None]) -> tuple[str | None, bool]:
    """The semantics asked for (None when left to the default) and --asan, old spellings folded in."""
    semantics: str | None = args.semantics
    asan: bool = args.asan
    if args.variant is not None:
        warn(f"note: --variant is deprecated; use --semantics {args.variant}")
        if semantics is not None and semantics != args.variant:
            raise UsageError(f"--variant {args.variant} contradicts --semantics {semantics}; use --semantics only")
        semantics = args.variant
    if args.flavour is not None:
        new = {"pr": "--semantics shared", "master": "--semantics master", "asan": "--asan"}[args.flavour]
        warn(f"note: --flavour is deprecated; use {new}")
        implied = "master" if args.flavour == "master" else "shared"
        if semantics is not None and semantics != implied:
            raise UsageError(f"--flavour {args.flavour} contradicts --semantics {semantics}; use --semantics only")
        semantics = implied
        asan = asan or args.flavour == "asan"
    return semantics, asan


def options_from_args(args: argparse.Namespace, warn: Callable[[str], None]) -> tuple[GateOptions, list[str]]:
    """Check the flags against the backends they apply to; a flag no selected backend reads is an error."""
    if args.max_examples is not None and args.max_examples < 1:
        raise UsageError("--max-examples must be >= 1")
    backends = [args.backend] if args.backend else list(DEFAULT_BACKENDS)
    semantics, args.asan = _semantics(args, warn)  # --flavour asan folded in
    declared = _backend_options()
    values = {f: _value(getattr(args, f)) for f in declared}
    own = {name: _own_options(b, values) for name, b in BACKENDS.items()}  # each checks its own values (--arch)
    for field, (option, readers) in declared.items():
        if values[field] not in (None, False) and not any(b in readers for b in backends):
            raise UsageError(f"{option.flag} applies to the {readers[0]} backend; add --backend {readers[0]}")
    if semantics is not None and not any(BACKENDS[b].semantics_axis for b in backends):
        raise UsageError(
            f"--semantics does not apply to the {' and '.join(backends)} backend (no master/PR axis); drop it"
        )
    opts = GateOptions(
        semantics=semantics or "shared",
        semantics_given=semantics is not None,
        profile=args.profile,
        seed=args.seed,
        db=args.db,
        max_examples=args.max_examples,
        backends={name: o for name, o in own.items() if o is not None},
    )
    return opts, backends


def _own_options(backend: Backend, values: Mapping[str, Any]) -> object | None:
    """The backend's ``options_type`` filled from the parsed flags (by field; a None left to the default): the
    type's own checks (``--arch``) raise :class:`~harness.errors.UsageError`."""
    if backend.options_type is None:
        return None
    given = {o.field: values[o.field] for o in backend.options if values.get(o.field) is not None}
    options: object = backend.options_type(**given)
    return options


def _value(v: Any) -> Any:
    return tuple(v) if isinstance(v, list) else v  # the options are frozen: --arch's list as a tuple


def run(args: argparse.Namespace) -> int:
    _writable(args.json)
    _writable(args.junit)
    opts, backends = options_from_args(args, lambda line: print(line, file=sys.stderr))
    report = new_report(opts, [BACKENDS[b] for b in backends])
    ended: BaseException | None = None
    try:
        run_gate(opts, backends, report=report)
    except BaseException as e:  # a HarnessError, Ctrl-C, or a defect of the harness (its traceback follows)
        ended = e
        raise
    finally:
        # the JSON (and JUnit) is written on every exit: what was found before an error or Ctrl-C is kept, and
        # a run that did not end says passed: false
        if ended is not None:
            what = "interrupted" if isinstance(ended, KeyboardInterrupt) else str(ended)
            if not isinstance(ended, (HarnessError, KeyboardInterrupt)):
                what = f"harness defect: {type(ended).__name__}: {ended}"
            code = EXIT_INTERRUPTED if isinstance(ended, KeyboardInterrupt) else getattr(ended, "exit_code", 1)
            report.sections["ended"] = Ended(what, code)
            if report.failures:
                report.print_to(print)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**report.to_json(), **({"passed": False} if ended is not None else {})}, f, indent=2)
        if args.junit:
            report.write_junit(args.junit)
        sys.stdout.flush()
    if report.passed:
        return EXIT_SKIPPED if "skipped" in report.sections else EXIT_OK
    if any(f.kind == "crash" for f in report.failures):
        return EXIT_CRASH
    return EXIT_FAILED if report.failures else EXIT_USAGE


def _writable(path: str | None) -> None:
    if path is None:
        return
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d) or not os.access(d, os.W_OK):
        raise UsageError(f"cannot write {path!r}: directory {d!r} does not exist or is not writable")
