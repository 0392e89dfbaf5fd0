"""The gate's short concurrent run: ``gate --backend server`` runs it after the server backend's phases.

Two configurations (:func:`~harness.load.concurrent.concurrent_configs` ``short``): ``llama`` on two
slots with per-slot KV and ``mamba`` on three slots with unified KV, two seeded traces each of K
clients x 4 overlapping requests (some naming a busy slot). Every response's slot and ``cache_n``
must match the model fed the server's order; outputs are compared with a fresh server, strictly on
every model: a divergence fails unless a located finding's exact condition explains it
(``concurrent-output-divergence`` within the model's measured batch-shape bound,
:data:`harness.findings.BATCH_SHAPE_FLIP_GAP`; ``busy-slot-by-id``). Each server runs under the libllama
trace (``harness/trace/trace.c``): the trace of a server whose output failed is kept and printed with the
lines that replay and shrink it (``python -m harness trace replay|shrink``), beside the timed requests.
Adds about half a minute to the server gate. The
figures go to the server section's ``concurrent`` (``report.sections["server"]``); the known findings
``busy-slot-by-id`` (with the trace that showed it), ``busy-slot-by-id-livelock`` (a request hung: costs the request
timeout, 15 s) and ``concurrent-output-divergence`` are reported, not failed.
"""

from __future__ import annotations

import shlex
import tempfile
import time
from collections import Counter
from pathlib import Path

from harness.backends.base import Failure, GateOptions, GateReport, MachineResult, Out
from harness.backends.llama_server import ServerOptions
from harness.backends.llama_server.section import ServerSection
from harness.findings import BUSY_SLOT_BY_ID, BUSY_SLOT_BY_ID_LIVELOCK, CONCURRENT_OUTPUT_DIVERGENCE, KnownRow
from harness.load.concurrent import ConcurrentResult, concurrent_configs, run_concurrent
from harness.load.traced import ServerTrace
from harness.targets.llama_server import sanitizer_reports
from properties.machine import MachineConfig

__all__ = ["N_TRACES", "server_concurrent_step"]

N_TRACES = 2


def _replay(opts: GateOptions, semantics: str) -> str:
    line = "python -m harness gate --backend server"
    own = opts.of(ServerOptions)
    if own.server_bin is not None:
        line += f" --server-bin {shlex.quote(str(own.server_bin))}"
    elif own.source is not None:
        line += f" --source {shlex.quote(str(own.source))}"
    if own.asan:
        line += " --asan"
    return line + f" --semantics {semantics} --seed {opts.seed}"


def server_concurrent_step(report: GateReport, opts: GateOptions, out: Out) -> None:
    """Run the short concurrent differential on the binary the server backend just tested."""
    server = report.sections.get("server")
    section = server.figures if isinstance(server, ServerSection) else None
    if not section or not section.get("binary"):
        return  # the server backend did not get as far as a binary: nothing to run
    binary = Path(section["binary"])
    semantics = str(section["semantics"])
    replay = _replay(opts, semantics)
    total = ConcurrentResult("concurrent")
    traces = ServerTrace(binary)  # a failed output's trace is kept (harness-traces-*), the others deleted
    if traces.note is not None:
        out(f"  concurrent: no libllama trace: {traces.note}")
    with tempfile.TemporaryDirectory(prefix="server-concurrent-") as logs:
        for cfg in concurrent_configs(short=True):
            t0 = time.perf_counter()
            r = run_concurrent(cfg, binary, semantics, opts.seed, N_TRACES, log_dir=logs,
                               binary_expr=f"Path({str(binary)!r})", out=out, traces=traces)  # fmt: skip
            total.add(r)
            ok = not r.mismatches and r.unmodellable is None
            out(
                f"  [{'ok  ' if ok else 'FAIL'}] concurrent {cfg.name:<14} {r.requests} requests by "
                f"{min(4, cfg.n_parallel + 1)} clients, {r.interleavings} interleaved, {r.busy_requests} named a busy "
                f"slot ({r.busy_slot_by_id} answers changed: busy-slot-by-id, {r.after_busy_hit} cache_n after it), "
                f"{r.concurrent_divergences} "
                f"concurrent-output-divergence, {r.busy_livelocks} hung (busy-slot-by-id-livelock), "
                f"{r.unfollowed_after_busy_hit} traces not followed after busy-slot-by-id, "
                f"{r.near_tie_flips} near-ties, "
                + "".join(f"{n} {k} (located in the trace), " for k, n in sorted(r.located.items()))
                + f"{r.mismatches} mismatches {time.perf_counter() - t0:5.1f}s"
            )
            failure = None
            if r.unmodellable is not None:
                failure = Failure("concurrent_order", "error", f"{cfg.name}: {r.unmodellable}", "", replay,
                                  f"server-concurrent-{cfg.name}", 0)  # fmt: skip
            elif r.mismatches:
                prop = ("cache_n" if r.cache_n_mismatches else "cache_load" if r.load_mismatches
                        else "output" if r.output_mismatches else "request_error")  # fmt: skip
                message = f"{cfg.name}: {r.failures[0]}" + (f"; {r.trace}" if r.trace else "")
                failure = Failure(prop, "violation", message, r.program, replay,
                                  f"server-concurrent-{cfg.name}", r.program.count("Req("))  # fmt: skip
                out("  the timed requests that replay it:\n    " + r.program.replace("\n", "\n    "))
                if r.trace:
                    out(f"  {r.trace}")
            checked = Counter({"cache_n": r.requests, "output": r.requests})
            report.machines.append(
                MachineResult(MachineConfig(semantics), time.perf_counter() - t0, failure, checked, Counter(), [])
            )
        reports = sanitizer_reports(logs)
    traces.close()
    for rep in reports[:5]:
        f = Failure("sanitizer", "crash", rep, "", replay, "server-concurrent-asan", 0)
        report.machines.append(MachineResult(MachineConfig(semantics), 0.0, f, Counter(), Counter(), []))
    section["concurrent"] = {k: v for k, v in total.as_dict().items() if k not in ("program", "busy_program")}
    section["concurrent"]["sanitizer_reports"] = len(reports)
    section["concurrent"]["traces_kept"] = [str(p) for p in traces.kept]
    section["concurrent"]["traced"] = traces.enabled
    machine = f"llama-server {section.get('build_name', binary)}, concurrent clients"
    busy = BUSY_SLOT_BY_ID
    status = "reproduced" if total.busy_slot_by_id else "not-reproduced"
    program = total.busy_program or None  # the trace that showed it, when it showed
    report.known.append(KnownRow(busy, machine, status, count=total.busy_slot_by_id, program=program))
    live = BUSY_SLOT_BY_ID_LIVELOCK
    status = "reproduced" if total.busy_livelocks else "not-reproduced"
    report.known.append(KnownRow(live, machine, status, count=total.busy_livelocks))
    conc = CONCURRENT_OUTPUT_DIVERGENCE
    status = "reproduced" if total.concurrent_divergences else "not-reproduced"
    report.known.append(KnownRow(conc, machine, status, count=total.concurrent_divergences))
