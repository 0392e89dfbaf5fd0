"""``python -m harness concurrent``: the concurrent differential's figures on one llama-server build.

K clients (one more than the slots, at most 4) send overlapping requests that share, extend and
diverge, some naming a busy slot by ``id_slot``, to ``-np`` 2..4 servers with unified and per-slot
KV on the five models (:func:`harness.load.concurrent.concurrent_configs`); the model replays the
order the server took and must predict every slot and ``cache_n``; outputs are compared with a
fresh cache-less server, on every model: only a greedy flip within the model's batch-shape bound
(:data:`harness.findings.BATCH_SHAPE_FLIP_GAP`, none for mamba) is excused, as ``concurrent-output-divergence`` or
``greedy-flip-on-cache-path``. Each server runs under the libllama trace (``--no-trace`` without); the
trace of a run with an output mismatch is kept (``--trace-dir``) and printed with the lines that replay
and shrink it. ``--traces N`` seeded traces per configuration. Prints one line per
configuration and, for a mismatch, the timed requests that replay it; ``--json PATH`` writes the
figures (requests, interleavings, busy-slot requests, answers changed by ``busy-slot-by-id``,
``concurrent-output-divergence``, mismatches).

``--embedding-clients N`` adds N clients sending ``/embeddings`` to every trace, overlapping the completions
(:mod:`harness.load.overlap`: the server also answers embeddings, ``-ub`` = ``-b``; the model replays each embedding
in the server's order on the slot the server chose, so every completion's ``cache_n`` is still predicted; the
server's RSS and logged cache size held under their bounds, as in the soak), and per configuration N clients each
sending a mixed program of 24 requests one at a time (completions, ``/embeddings``, ``/rerank``;
:func:`harness.load.stateless.stateless_differential`) to a fresh server that also answers the stateless endpoints:
the cache entries it ends with must be the model's (those stateless tasks left are the known finding
``idle-stateless-slot-cached``, counted), the completions a fresh server's.

Exit 0 when nothing mismatched, 1 on a mismatch or an order the model could not follow, 2 on a
usage error, 4 when the build fails. The gate's short run is :mod:`harness.load.gate_step`.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from harness.backends.llama_server.probe import probe
from harness.commands.common import add_server_options, resolve_server
from harness.errors import EXIT_FAILED, EXIT_OK, UsageError
from harness.load.concurrent import ConcurrentResult, concurrent_configs, run_concurrent
from harness.load.stateless import stateless_differential
from harness.load.traced import ServerTrace
from harness.targets.llama_server import ServerConfig, sanitizer_reports

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_server_options(parser)
    parser.add_argument("--traces", type=int, default=3, help="seeded traces per configuration (default 3)")
    parser.add_argument("--short", action="store_true", help="only the gate's two configurations")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    parser.add_argument("--trace-dir", metavar="DIR", type=Path,
                        help="where a failed output's libllama trace is kept (default: a new harness-traces-* "
                             "directory in the temporary directory, removed when nothing failed)")
    parser.add_argument("--no-trace", action="store_true", help="run the servers without the libllama trace")
    parser.add_argument("--keep-traces", action="store_true", help="keep every server's trace (to measure)")
    parser.add_argument("--embedding-clients", type=int, default=0, metavar="N",
                        help="N embedding clients in every trace, overlapping the completions (RSS and cache size "
                        "bounded), and per configuration N clients sending completions, embeddings and reranks one at "
                        "a time to a fresh server; its cache entries checked against the model's (0)")  # fmt: skip


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.traces <= 1000:
        raise UsageError("--traces must be between 1 and 1000")
    if not 0 <= args.embedding_clients <= 100:
        raise UsageError("--embedding-clients must be between 0 and 100")

    def log(m: str) -> None:
        print("  build: " + m, file=sys.stderr)

    build = resolve_server(args, log)
    print("  " + probe(build.binary, log=log).line(), file=sys.stderr)  # the request form its version answers
    semantics = build.semantics or (args.semantics or "shared")
    print(f"concurrent: build={build.origin} semantics={semantics} traces={args.traces} seed={args.seed} "
          "(shared machine: timings vary, the order is read from the server's log)")  # fmt: skip
    rows: dict[str, dict[str, object]] = {}
    total = ConcurrentResult("all")
    shown = False  # the first failing configuration's replay program only (the JSON has every one)
    stateless_problems = 0
    traces = ServerTrace(build.binary, args.trace_dir, enabled=not args.no_trace, keep_all=args.keep_traces)
    if traces.note is not None and not args.no_trace:
        print(f"  no libllama trace: {traces.note}", file=sys.stderr)
    with tempfile.TemporaryDirectory(prefix="concurrent-") as logs:
        for cfg in concurrent_configs(short=args.short):
            r = run_concurrent(cfg, build.binary, semantics, args.seed, args.traces, log_dir=logs,
                               binary_expr=build.replay_expr, traces=traces,
                               embedding_clients=args.embedding_clients)  # fmt: skip
            total.add(r)
            shown = _print_config(cfg.name, r, shown, args.embedding_clients)
            rows[cfg.name] = r.as_dict()
            if args.embedding_clients:
                stateless_problems += _stateless(cfg, build.binary, semantics, args, logs, rows[cfg.name])
        reports = sanitizer_reports(logs)
    traces.close()
    for rep in reports[:5]:
        print(f"  sanitizer: {rep}")
    figures = {k: v for k, v in total.as_dict().items() if k not in ("program", "busy_program", "config")}
    figures["sanitizer_reports"] = len(reports)
    if args.json:
        doc = {"command": "concurrent", "build": build.origin, "semantics": semantics, "asan": build.asan,
               "traces": args.traces, "seed": args.seed, "total": figures, "configs": rows}  # fmt: skip
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    failed = total.mismatches > 0 or total.unmodellable is not None or reports or stateless_problems
    print(("FAIL" if failed else "PASS") + f": {total.requests} requests, {total.interleavings} interleaved, "
          f"{total.busy_requests} named a busy slot, {total.busy_slot_by_id} busy-slot-by-id, "
          f"{total.concurrent_divergences} concurrent-output-divergence, {total.mismatches} mismatches")  # fmt: skip
    return EXIT_FAILED if failed else EXIT_OK


def _print_config(name: str, r: ConcurrentResult, shown: bool, clients: int) -> bool:
    """One configuration's line, its notes and failures; the replay program unless one was ``shown``: whether
    one has been now."""
    bad = r.mismatches or r.unmodellable
    print(
        f"  [{'FAIL' if bad else 'ok  '}] {name:<16} {r.requests:>4} requests, {r.interleavings:>3} "
        f"interleaved, {r.busy_requests:>3} named a busy slot, {r.busy_slot_by_id} answers changed "
        f"(busy-slot-by-id, {r.after_busy_hit} cache_n after it), {r.busy_livelocks} hung "
        f"(busy-slot-by-id-livelock), "
        f"{r.concurrent_divergences} "
        f"concurrent-output-divergence, {r.near_tie_flips} "
        f"greedy-flip-on-cache-path, "
        + "".join(f"{n} {k} (located in the trace), " for k, n in sorted(r.located.items()))
        + f"{r.mismatches} mismatches {r.seconds:6.1f}s"
    )
    _overlap_line(r, clients)
    if r.unmodellable:
        print(f"      order not followed: {r.unmodellable}")
    for n in r.notes[:3]:
        print(f"      {n}")
    for f in r.failures[:3]:
        print(f"      {f}")
    if r.trace:
        print(f"      {r.trace}")
    if r.program and not shown:
        print("      the timed requests that replay it:\n        " + r.program.replace("\n", "\n        "))
    return shown or bool(r.program)


def _overlap_line(r: ConcurrentResult, clients: int) -> None:
    """The figures of the embedding clients that overlapped the completions, and the bounds (if there were any)."""
    if clients:
        print(f"      {r.embeddings} embeddings overlapping (idle-stateless-slot-cached: {r.stateless_cached} "
              f"entries); RSS peak {r.rss_peak >> 20} MiB (bound {r.rss_bound >> 20}), cache peak "
              f"{r.cache_max_mib:.3f} MiB; {r.bound_violations} bounds broken")  # fmt: skip


def _stateless(cfg: ServerConfig, binary: Path, semantics: str, args: argparse.Namespace, logs: str,
               row: dict[str, object]) -> int:  # fmt: skip
    """The mixed stateless differential on ``cfg``: one line, its figures in ``row``; the problems found."""
    d = stateless_differential(cfg, binary, semantics, args.seed, args.embedding_clients, log_dir=logs)
    row["stateless"] = d.as_dict()
    print(
        f"  [{'FAIL' if d.problems else 'ok  '}] {cfg.name:<16} {d.requests:>4} mixed requests, {d.stateless_requests} "
        f"embeddings/reranks; {d.stateless_entries} cache entries from them ({d.stateless_mib:.3f} MiB; model "
        f"{d.predicted_entries}: idle-stateless-slot-cached), RSS +{d.rss_growth >> 10} KiB"
    )
    for p in d.problems[:3]:
        print(f"      {p}")
    return len(d.problems)
