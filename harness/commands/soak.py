"""``python -m harness soak``: sustained unique and repeating prompts against a small ``--cache-ram``.

``--minutes N`` is the whole run: each model gets two phases of equal length (faults off, then the
native shim failing one large allocation every few seconds). What is sampled and checked is in
:mod:`harness.load.soak`. ``--json PATH`` writes every phase's figures (requests/s, p50/p99
latency, the RSS curve, cache size and entries, evictions, fault trials survived). Every server runs
under the libllama trace (``harness/trace/trace.c``; ``--no-trace`` without, and without under ``--memory-limit``,
whose cgroup would be charged for the trace file's page cache): the trace of a server that gave
an output no known finding explains is kept beside the server logs and printed with the lines that
replay and shrink it (``python -m harness trace replay|shrink``). ``--embedding-clients N`` adds N clients
sending ``/embeddings`` and ``/rerank`` requests to the same servers (started with ``--rerank``; mean-pooled
embeddings only on lfm2: :mod:`harness.load.stateless`), under the same bounds.

Exit 0 when every bound held, 1 when one broke (RSS over its bound, the logged cache over its
limit, a crash or a request error with faults off, an OOM kill under ``--memory-limit MIB`` (the server in a
memory cgroup; the requests that led to it written beside its log), an output unlike a fresh server's, a
sanitizer report from an ASan build given by ``--server-bin``, which has no RSS bound of its own), 2 on a
usage error, 4 when llama-server does not build, 5 when ``--memory-limit`` finds no memory cgroup to make.
The figures come from a shared host: compare
runs made on the same host only.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

from fixtures.gguf import ARCHS
from harness.backends.llama_server.probe import probe
from harness.commands.common import add_server_options, resolve_server
from harness.errors import EXIT_FAILED, EXIT_OK, UsageError
from harness.load.soak import CACHE_RAM_MIB, SoakSettings, soak
from harness.load.traced import ServerTrace
from harness.memlimit import MemoryCgroup, cgroup_support
from harness.trees.build import ServerBuild

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--minutes", type=float, required=True, help="the whole run, split over models and phases")
    add_server_options(parser, asan=False)
    parser.add_argument("--arch", nargs="+", metavar="NAME", help="the fixtures models (default: all five)")
    parser.add_argument("--cache-ram", type=int, default=CACHE_RAM_MIB, metavar="MIB",
                        help=f"the server's --cache-ram (default {CACHE_RAM_MIB})")  # fmt: skip
    parser.add_argument("--rss-bound", type=float, metavar="MIB",
                        help="a fixed RSS bound instead of base + cache-ram + slack")  # fmt: skip
    parser.add_argument("--memory-limit", type=int, metavar="MIB",
                        help="run the soaked server in a memory cgroup with this hard limit: an OOM kill fails the "
                        "run, with the requests that led to it")  # fmt: skip
    parser.add_argument("--embedding-clients", type=int, default=0, metavar="N",
                        help="N more clients sending /embeddings and /rerank requests (the servers get --rerank); "
                        "the same bounds hold (default 0)")  # fmt: skip
    parser.add_argument("--seed", type=int, default=0, help="the clients' prompts (default 0)")
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    parser.add_argument("--no-trace", action="store_true",
                        help="run the servers without the libllama trace (kept for a failed output otherwise)")


def _check(args: argparse.Namespace) -> list[str]:
    """The flags' checks (one line each); the models to soak."""
    if args.minutes <= 0 or args.minutes > 24 * 60:
        raise UsageError("--minutes must be > 0 and at most a day")
    if args.source is not None and args.semantics is not None:
        raise UsageError("--semantics picks the pinned tree's build; with --source the tree is what it is")
    archs = args.arch or list(ARCHS)
    bad = [a for a in archs if a not in ARCHS]
    if bad:
        raise UsageError(f"unknown --arch {', '.join(bad)}; choose from {', '.join(ARCHS)}")
    if not 0 <= args.embedding_clients <= 16:
        raise UsageError("--embedding-clients must be between 0 and 16")
    if args.cache_ram < 1:
        raise UsageError("--cache-ram must be >= 1 MiB (0 disables the cache: nothing to soak)")
    if args.memory_limit is not None:
        if args.memory_limit < 8:
            raise UsageError("--memory-limit must be >= 8 MiB (llama-server itself needs more)")
        if cgroup_support() is None:
            MemoryCgroup().create()  # raises the one line saying why no memory cgroup can be made here (exit 5)
    return archs


def _replay_line(args: argparse.Namespace, archs: list[str]) -> str:
    origin = (f"--server-bin {args.server_bin} " if args.server_bin else f"--source {args.source} " if args.source
              else f"--semantics {args.semantics or 'shared'} ")  # fmt: skip
    return (f"python -m harness soak --minutes {args.minutes} " + origin
            + f"--arch {' '.join(archs)} --cache-ram {args.cache_ram} --seed {args.seed}"
            + (f" --rss-bound {args.rss_bound}" if args.rss_bound is not None else "")
            + (f" --memory-limit {args.memory_limit}" if args.memory_limit is not None else "")
            + (f" --embedding-clients {args.embedding_clients}" if args.embedding_clients else ""))  # fmt: skip


def _build(args: argparse.Namespace) -> ServerBuild:
    """The binary to soak (``--server-bin``, ``--source`` or a pinned build), probed for its request form."""

    def log(m: str) -> None:
        print("  build: " + m, file=sys.stderr)

    build = resolve_server(args, log)
    print("  " + probe(build.binary, log=log).line(), file=sys.stderr)  # the request form its version answers
    return build


def run(args: argparse.Namespace) -> int:
    archs = _check(args)

    build = _build(args)
    per_phase = args.minutes * 60 / (2 * len(archs))
    st = SoakSettings(per_phase, cache_ram_mib=args.cache_ram, rss_bound_mib=args.rss_bound, seed=args.seed,
                      memory_limit_mib=args.memory_limit, embedding_clients=args.embedding_clients)  # fmt: skip
    print(f"soak: build={build.origin} models={','.join(archs)} {per_phase:.0f}s per phase (faults off, then on), "
          f"--cache-ram {args.cache_ram} MiB, seed {args.seed}"
          + (f", in a memory cgroup limited to {args.memory_limit} MiB" if args.memory_limit else "")
          + "; shared machine: figures are relative")  # fmt: skip
    logs = tempfile.mkdtemp(prefix="soak-")  # kept when a bound broke: the server logs say what happened
    failed = True
    written = False
    try:
        # Under a memory limit the trace file's page cache would be charged to the server's cgroup: the limit
        # would then measure the trace's writes (and a busy disk's writeback), not the server.
        tracing = not args.no_trace and args.memory_limit is None
        traces = ServerTrace(build.binary, Path(logs) / "traces", enabled=tracing)
        if args.memory_limit is not None and not args.no_trace:
            print("  no libllama trace under --memory-limit: its file's page cache would count against the "
                  "server's cgroup", file=sys.stderr)  # fmt: skip
        elif traces.note is not None and tracing:
            print(f"  no libllama trace: {traces.note}", file=sys.stderr)
        results = soak(build.binary, archs, st, logs, traces=traces)
        violations = [f"{r.arch} faults {'on' if r.faults else 'off'}: {v}" for r in results for v in r.violations]
        violations.sort(key=lambda v: "OOM-killed" not in v)  # the kill first, before its clients' broken requests
        report = {
            "command": "soak",
            "build": build.origin,
            "binary": str(build.binary),
            "semantics": build.semantics,
            "minutes": args.minutes,
            "cache_ram_mib": args.cache_ram,
            "seed": args.seed,
            "phases": [r.summary() for r in results],
            "requests": sum(r.requests for r in results),
            "fault_trials": sum(r.fault_trials for r in results),
            "fault_survived": sum(r.fault_survived for r in results),
            "memory_limit_mib": args.memory_limit,
            "oom_kills": sum(r.oom_kills for r in results),
            "oom_programs": [p for r in results for p in r.oom_programs],
            "crashes_under_faults": sum(r.crashes for r in results if r.faults),
            "violations": violations,
            "passed": not violations,
        }
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
            written = True
        failed = bool(violations)
        if violations:
            print(f"FAIL: {len(violations)} violations; first: {violations[0]}")
            print(f"--- replay ---\n{_replay_line(args, archs)}")
            return EXIT_FAILED
        print(f"PASS: {report['requests']} requests, {report['fault_trials']} fault trials, "
              f"{report['fault_survived']} survived")  # fmt: skip
        return EXIT_OK
    except BaseException as e:  # an error or Ctrl-C before the figures: the JSON still says the run did not pass
        if args.json and not written:
            error = str(e) or type(e).__name__
            Path(args.json).write_text(json.dumps({"command": "soak", "build": build.origin, "passed": False,
                                                   "error": error, "logs": logs}, indent=1) + "\n")  # fmt: skip
        raise
    finally:
        if failed:  # a broken bound, an error or Ctrl-C: say where the servers' logs are
            print(f"server logs kept in {logs}", file=sys.stderr)
        else:
            shutil.rmtree(logs, ignore_errors=True)
