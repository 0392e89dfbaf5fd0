"""The gate's steps after the server backend's phases (``gate --backend server``): the short concurrent run
(:func:`server_concurrent_step`), the stateless tasks (:func:`server_stateless_step`), the generated
``--cache-reuse`` and context-shift programs (:func:`server_reuse_step`) and slot-file programs
(:func:`server_slot_files_step`).

The concurrent run:

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

The stateless step (:func:`harness.load.stateless.stateless_differential`): on ``llama`` with two slots, mixed
programs of completions, embeddings and reranks with the idle-slot cache on and with it off
(``--no-cache-idle-slots``), three of each, each on a fresh ``-lv 4`` server: the entries the stateless tasks left in
the cache (its last logged ``cache state``) against the model's (``stateless_not_cached``, counted per stateless
request; the registered finding ``idle-stateless-slot-cached`` is in the model's prediction), every entry
(``cache_entries``), each stateless task's lines of the log (``stateless_fresh``: no cache update when it took its
slot, no cached prefix, no checkpoint, its prompt alone held at release), and each completion against a fresh
cache-less server (``output``). Adds a few seconds.

The reuse step (:func:`harness.load.reuse_programs.run_model`, as ``python -m harness reuse`` runs it):
:data:`REUSE_EXAMPLES` programs on ``llama``, each a one-slot server with ``--cache-reuse N`` and
``--context-shift``: every ``cache_n`` against the model's chunk loop (``reuse_chunks``), every context shift's
moment and amounts in the log against the model's (``shift_timing``, ``context_shift``). Adds about five seconds.

The full-disk step (:func:`harness.experiments.full_disk.full_disk`): one ``llama`` server saving its slot into a
64 KiB tmpfs filled to every page of free space around the file's size: each file left held to ``no_partial_file``
(the registered ``slot-save-partial-file`` and ``slot-save-silent-truncation`` counted in their exact shapes). Root
only (it mounts the tmpfs); adds about a second.

The slot-file step (:func:`harness.load.slot_programs.run_model`, as ``python -m harness slot-files --differential``
runs it): :data:`SLOT_EXAMPLES` programs on ``jamba``, completions with ``save``, ``restore`` and ``erase``: each
restore's answer and the completion after it against the model and a fresh server (``slot_file_restore``), each
completion's ``cache_n`` against the best usable source (``reuse``); the registered finding
``slot-restore-drops-checkpoints`` is counted, not failed. Adds about five seconds.
"""

from __future__ import annotations

import functools
import shlex
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

from harness.backends.base import Failure, GateOptions, GateReport, MachineResult, Out, Skipped
from harness.backends.llama_server import ServerOptions
from harness.backends.llama_server.runner import MODEL_EXACT_SKIP
from harness.backends.llama_server.section import ServerSection
from harness.errors import HarnessError, Unavailable
from harness.experiments.full_disk import full_disk, full_disk_program
from harness.findings import (
    BUSY_SLOT_BY_ID,
    BUSY_SLOT_BY_ID_LIVELOCK,
    CONCURRENT_OUTPUT_DIVERGENCE,
    FINDINGS,
    SLOT_SAVE_PARTIAL_FILE,
    SLOT_SAVE_SILENT_TRUNCATION,
    KnownRow,
)
from harness.load.concurrent import ConcurrentResult, concurrent_configs, load_config, run_concurrent
from harness.load.edges import EDGES, edges_program, run_edge
from harness.load.generated import GeneratedFailure
from harness.load.reuse_programs import run_model as run_reuse_programs
from harness.load.slot_programs import run_model as run_slot_programs
from harness.load.stateless import stateless_differential
from harness.load.traced import ServerTrace
from harness.targets.llama_server import RequestFailed, ServerConfig, ServerStartError, sanitizer_reports
from properties.machine import MachineConfig

__all__ = [
    "N_TRACES",
    "REUSE_EXAMPLES",
    "SLOT_EXAMPLES",
    "STATELESS_RUNS",
    "Step",
    "against_base",
    "server_concurrent_step",
    "server_full_disk_step",
    "server_reuse_step",
    "server_slot_files_step",
    "server_stateless_step",
    "stateless_config",
    "stateless_program",
]

N_TRACES = 2
# generated --cache-reuse programs (about 10 s; once n_keep and n_discard were drawn, 20 missed reuse-chunk on seed 0)
REUSE_EXAMPLES = 40
SLOT_EXAMPLES = 20  # generated slot-file programs (about 5 s)
STATELESS_RUNS = 3  # mixed programs per idle-slot setting (each on a fresh server: about half a second)


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


def _tested(report: GateReport) -> tuple[dict[str, Any], Path, str] | None:
    """The server section, the binary the server backend tested and its semantics; None when the backend did
    not get as far as a binary (nothing to run)."""
    server = report.sections.get("server")
    section = server.figures if isinstance(server, ServerSection) else None
    if not section or not section.get("binary"):
        return None
    return section, Path(section["binary"]), str(section["semantics"])


Step = Callable[[GateReport, GateOptions, Out], None]


def against_base(step: Step) -> Step:
    """``step`` as a change run (``--base``) judges it: a failure it files on TREE is the change's only where BASE
    holds. The step runs again on BASE's binary (a scratch report; its lines are not printed) and each failure of
    TREE whose property BASE fails too becomes upstream drift: printed, kept in the server section's ``step_drift`` and
    not failing the gate. Without a base, or when the step found nothing, it is ``step`` as it is."""

    @functools.wraps(step)
    def judged(report: GateReport, opts: GateOptions, out: Out) -> None:
        before = len(report.machines)
        step(report, opts, out)
        tested = _tested(report)
        found = [i for i in range(before, len(report.machines)) if report.machines[i].failure is not None]
        if tested is None or not found or not tested[0].get("base_binary"):
            return
        section = tested[0]
        scratch = GateReport(str(section["base_semantics"]), report.backend, report.profile, report.seed,
                             report.commit)  # fmt: skip
        scratch.sections["server"] = ServerSection({**section, "binary": section["base_binary"],
                                                    "semantics": section["base_semantics"],
                                                    "pinned": section.get("base_pinned", False)})  # fmt: skip
        try:
            step(scratch, opts, lambda _line: None)
        except HarnessError as e:  # BASE could not run it: TREE's failures stand as the change's
            out(f"  {step.__name__} on BASE did not run ({e}): TREE's failures are kept as the change's")
            return
        on_base = {f.property for f in scratch.failures}
        for i in found:
            m = report.machines[i]
            assert m.failure is not None
            if m.failure.property in on_base:
                section.setdefault("step_drift", []).append(
                    {"step": step.__name__, "property": m.failure.property, "message": m.failure.message}
                )
                out(f"  upstream drift (BASE fails {m.failure.property} too; reported, not failing): "
                    f"{m.failure.message}")  # fmt: skip
                report.machines[i] = replace(m, failure=None)

    return judged


def stateless_config(idle: bool) -> ServerConfig:
    """The stateless step's configuration: llama on two slots, the idle-slot pass on or off."""
    return replace(load_config("llama", 2, False), cache_idle_slots=idle)


def stateless_program(binary: Path, semantics: str, seed: int, idle: bool) -> str:
    """The stateless step's run of one configuration as a program to paste into ``python`` (repository root)."""
    return "\n".join([
        "from pathlib import Path",
        "from harness.load.gate_step import stateless_config",
        "from harness.load.stateless import stateless_differential",
        f"d = stateless_differential(stateless_config({idle}), Path({str(binary)!r}), {semantics!r}, {seed}, "
        f"{STATELESS_RUNS})",
        "print('\\n'.join(d.problems) or 'the cache held what the model predicts')",
    ])  # fmt: skip


def server_stateless_step(report: GateReport, opts: GateOptions, out: Out) -> None:
    """Run the stateless tasks' differential (idle-slot cache on, then off) on the binary the server backend just
    tested: ``stateless_not_cached`` and ``stateless_fresh`` counted on the server."""
    tested = _tested(report)
    if tested is None:
        return
    section, binary, semantics = tested
    skipped = report.sections.get("skipped")
    if isinstance(skipped, Skipped) and MODEL_EXACT_SKIP in skipped.why:  # the model cannot read this tree's cache
        why = "the model cannot read this tree's prompt cache: its prediction of the entries means nothing there"
        report.skip("server backend: stateless step", why)
        out(f"  [skip] stateless step: {why}")
        return
    replay = _replay(opts, semantics)
    figures: dict[str, Any] = {}
    with tempfile.TemporaryDirectory(prefix="server-stateless-") as logs:
        for idle in (True, False):
            t0 = time.perf_counter()
            program = stateless_program(binary, semantics, opts.seed, idle)
            try:
                d = stateless_differential(stateless_config(idle), binary, semantics, opts.seed, STATELESS_RUNS,
                                           log_dir=logs)  # fmt: skip
            except ServerStartError as e:
                _cannot_start(report, section, out, "stateless step", "--rerank", e)
                break
            except RequestFailed as e:  # the fresh reference server, asked for an output
                f = Failure("http_error" if e.alive else "server_crash", "violation" if e.alive else "crash",
                            f"the stateless step's fresh server: {e.describe()}", program, replay,
                            "server-stateless", 0)  # fmt: skip
                report.machines.append(MachineResult(MachineConfig(semantics), 0.0, f, Counter(), Counter(), []))
                break
            figures[d.config] = d.as_dict()
            out(f"  [{'FAIL' if d.problems else 'ok  '}] stateless {d.config:<20} {d.requests} mixed requests, "
                f"{d.stateless_requests} embeddings/reranks; {d.stateless_entries} cache entries from them (model "
                f"{d.predicted_entries}: idle-stateless-slot-cached) {time.perf_counter() - t0:5.1f}s")  # fmt: skip
            failure = None
            if d.failed is not None:
                failure = Failure(d.failed, "violation", f"{d.config}: {d.problems[0]}", program, replay,
                                  f"server-stateless-{d.config}", d.requests)  # fmt: skip
                for p in d.problems[:3]:
                    out(f"      {p}")
                out("  the program that replays it:\n    " + program.replace("\n", "\n    "))
            checked = Counter({"stateless_not_cached": d.stateless_requests, "stateless_fresh": d.fresh_checked,
                               "output": d.requests - d.stateless_requests})  # fmt: skip
            report.machines.append(
                MachineResult(MachineConfig(semantics), time.perf_counter() - t0, failure, checked, Counter(), [])
            )
    section["stateless"] = figures


def _cannot_start(report: GateReport, section: dict[str, Any], out: Out, step: str, flags: str,
                  e: ServerStartError) -> None:  # fmt: skip
    """A step's server that did not start: the environment's failure on a pinned build (raised), a skip with its
    reason on another tree (a check that cannot run on a tree is never the verdict)."""
    if section.get("pinned"):
        raise e
    why = f"its llama-server ({flags}) did not start on this tree's build: {e}"
    report.skip(f"server backend: {step}", why)
    out(f"  [skip] {step}: {why}")


def _generated_failure(found: GeneratedFailure | None, arch: str, machine: str, replay: str,
                       out: Out) -> Failure | None:  # fmt: skip
    """A generated step's shrunk failure as the gate files it (a dead server is a crash: exit 3), its program
    printed; None when it found none."""
    if found is None:
        return None
    kind = "crash" if found.name == "server_crash" else "violation"
    out("  the shrunk program that replays it:\n    " + found.program.replace("\n", "\n    "))
    return Failure(found.name, kind, f"{arch}: {found.message}", found.program, replay, machine,
                   found.program.count("r.request("))  # fmt: skip


def server_reuse_step(report: GateReport, opts: GateOptions, out: Out) -> None:
    """Run the generated ``--cache-reuse`` and context-shift programs (:mod:`harness.load.reuse_programs`) on the
    binary the server backend just tested: ``reuse_chunks``, ``shift_timing`` and ``context_shift`` counted on the
    server; a failure is shrunk and printed as a program that replays it on that binary."""
    tested = _tested(report)
    if tested is None:
        return
    section, binary, semantics = tested
    t0 = time.perf_counter()  # the programs run without a prompt cache (--cache-ram 0): a replaced one runs them too
    try:
        fig = run_reuse_programs("llama", binary, examples=REUSE_EXAMPLES, seed=opts.seed,
                                 binary_expr=f"Path({str(binary)!r})")  # fmt: skip
    except ServerStartError as e:
        _cannot_start(report, section, out, "reuse step", "--cache-reuse, --context-shift", e)
        return
    section["reuse"] = fig.to_json()
    out(f"  [{'FAIL' if fig.failure else 'ok  '}] reuse llama {fig.examples} programs, {fig.requests} requests, "
        f"{fig.chunks_moved} chunks moved, {fig.shifts} context shifts; {fig.compared} outputs compared "
        f"{time.perf_counter() - t0:5.1f}s")  # fmt: skip
    failure = _generated_failure(fig.failure, "llama", "server-reuse-llama", _replay(opts, semantics), out)
    checked = Counter({"reuse_chunks": fig.requests, "shift_timing": fig.shift_checks, "context_shift": fig.shifts,
                       "output": fig.compared})  # fmt: skip
    report.machines.append(
        MachineResult(MachineConfig(semantics), time.perf_counter() - t0, failure, checked, Counter(), [])
    )


def server_slot_files_step(report: GateReport, opts: GateOptions, out: Out) -> None:
    """Run the generated slot-file programs (:mod:`harness.load.slot_programs`) on ``jamba`` (a hybrid: what a
    restore leaves of the slot's checkpoints matters) on the binary the server backend just tested:
    ``slot_file_restore`` (each restore's answer, then the slot, ``cache_n`` and output of the completion after it)
    and ``reuse`` counted on the server."""
    tested = _tested(report)
    if tested is None:
        return
    section, binary, semantics = tested
    t0 = time.perf_counter()  # the programs run without a prompt cache (--cache-ram 0)
    try:
        fig = run_slot_programs("jamba", binary, examples=SLOT_EXAMPLES, seed=opts.seed,
                                binary_expr=f"Path({str(binary)!r})")  # fmt: skip
    except ServerStartError as e:
        _cannot_start(report, section, out, "slot-file step", "--slot-save-path", e)
        return
    section["slot_files"] = fig.to_json()
    found = ", ".join(f"{k} {v}" for k, v in sorted(fig.findings.items())) or "none"
    out(f"  [{'FAIL' if fig.failure else 'ok  '}] slot files jamba {fig.examples} programs, {fig.requests} requests, "
        f"{fig.actions} slot actions ({fig.restores} restores), {fig.compared} outputs compared; findings: {found} "
        f"{time.perf_counter() - t0:5.1f}s")  # fmt: skip
    failure = _generated_failure(fig.failure, "jamba", "server-slot-files-jamba", _replay(opts, semantics), out)
    checked = Counter({"slot_file_restore": fig.restore_checks, "reuse": fig.requests, "output": fig.compared})
    report.machines.append(
        MachineResult(MachineConfig(semantics), time.perf_counter() - t0, failure, checked, Counter(), [])
    )


def server_full_disk_step(report: GateReport, opts: GateOptions, out: Out) -> None:
    """Save a slot at every page of free space of a full tmpfs (:func:`harness.experiments.full_disk.full_disk`) on
    the binary the server backend just tested: ``no_partial_file`` counted per save on the server, the registered
    findings ``slot-save-partial-file`` and ``slot-save-silent-truncation`` reported in their exact shapes. It mounts
    a tmpfs: without root it is skipped with that reason (a limit of this host, never the verdict)."""
    tested = _tested(report)
    if tested is None:
        return
    section, binary, semantics = tested
    t0 = time.perf_counter()
    program = full_disk_program(f"Path({str(binary)!r})")
    try:
        with tempfile.TemporaryDirectory(prefix="server-full-disk-") as logs:
            d = full_disk(binary, log_dir=logs)
    except Unavailable as e:
        report.skip("server backend: full-disk step", str(e))
        out(f"  [skip] full-disk step (no_partial_file): {e}")
        return
    except ServerStartError as e:
        _cannot_start(report, section, out, "full-disk step", "--slot-save-path", e)
        return
    except RequestFailed as e:  # a save that killed or hung the server
        f = Failure("server_crash" if not e.alive else "hang", "crash" if not e.alive else "violation",
                    f"the full-disk step's server, on a save: {e.describe()}", program, _replay(opts, semantics),
                    "server-full-disk-llama", 0)  # fmt: skip
        report.machines.append(MachineResult(MachineConfig(semantics), time.perf_counter() - t0, f, Counter(),
                                             Counter(), []))  # fmt: skip
        return
    section["full_disk"] = d.to_json()
    found = ", ".join(f"{k} {v}" for k, v in sorted(d.findings.items())) or "none"
    out(f"  [{'FAIL' if d.problems or d.died else 'ok  '}] full disk llama: a {d.file_size}-byte slot save at "
        f"{d.checked} free-space boundaries; findings: {found} {time.perf_counter() - t0:5.1f}s")  # fmt: skip
    failure = None
    dead = "" if d.died is None else f"; then the server died on that save: {d.died.describe()}"
    kind = "violation" if d.died is None or d.died.alive else "crash"
    if d.problems:  # a partial file, also one its server died writing (the property, then how it ended)
        failure = Failure("no_partial_file", kind, f"llama: {d.problems[0]}{dead}", program,
                          _replay(opts, semantics), "server-full-disk-llama", d.checked)  # fmt: skip
    elif d.died is not None:
        failure = Failure("server_crash" if kind == "crash" else "hang", kind, f"llama: {dead[2:]}", program,
                          _replay(opts, semantics), "server-full-disk-llama", d.checked)  # fmt: skip
    if failure is not None:
        for p in [*d.problems[:3], *([dead[2:]] if dead else [])]:
            out(f"      {p}")
        out("  the program that replays it (as root):\n    " + program.replace("\n", "\n    "))
    for finding in (SLOT_SAVE_PARTIAL_FILE, SLOT_SAVE_SILENT_TRUNCATION):
        n = d.findings[finding.id]
        report.known.append(KnownRow(finding, "server-full-disk-llama", "reproduced" if n else "not-reproduced",
                                     count=n))  # fmt: skip
    report.machines.append(MachineResult(MachineConfig(semantics), time.perf_counter() - t0, failure,
                                         Counter({"no_partial_file": d.checked}), Counter(), []))  # fmt: skip


def server_edges_step(report: GateReport, opts: GateOptions, out: Out) -> None:
    """Run the edge cases (:data:`harness.load.edges.EDGES`: the requests the generated programs never send) on the
    binary the server backend just tested, each case counted under its property, a registered finding it meets by
    its exact condition counted as known; a case that fails is printed with the code that runs it again, as a crash
    when one of its servers died."""
    tested = _tested(report)
    if tested is None:
        return
    section, binary, semantics = tested
    rows = []
    with tempfile.TemporaryDirectory(prefix="server-edges-") as logs:
        for edge in EDGES:
            t0 = time.perf_counter()
            try:
                res = run_edge(edge, binary, Path(logs))
            except ServerStartError as e:
                _cannot_start(report, section, out, f"edge case {edge.name}", edge.reaches, e)
                continue
            rows.append(res.to_json())
            seen = "; ".join(res.seen)
            out(f"  [{'FAIL' if res.problems else 'ok  '}] edge {edge.name}: {res.checked} {edge.prop} checks"
                f"{f' ({seen})' if seen else ''} {time.perf_counter() - t0:5.1f}s")  # fmt: skip
            failure = None
            if res.problems:
                program = edges_program(f"Path({str(binary)!r})", edge.name)
                for p in res.problems[:3]:
                    out(f"      {p}")
                out("  the program that replays it:\n    " + program.replace("\n", "\n    "))
                kind = "crash" if res.died else "violation"
                failure = Failure(edge.prop, kind, f"edge {edge.name}: {res.problems[0]}", program,
                                  _replay(opts, semantics), f"server-edge-{edge.name}", res.checked)  # fmt: skip
            for found, n in sorted(res.findings.items()):
                report.known.append(KnownRow(FINDINGS[found], f"server-edge-{edge.name}", "reproduced", count=n))
            report.machines.append(MachineResult(MachineConfig(semantics), time.perf_counter() - t0, failure,
                                                 Counter({edge.prop: res.checked}), Counter(), []))  # fmt: skip
    section["edges"] = rows


def server_concurrent_step(report: GateReport, opts: GateOptions, out: Out) -> None:
    """Run the short concurrent differential on the binary the server backend just tested."""
    tested = _tested(report)
    if tested is None:
        return
    section, binary, semantics = tested
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
                prop = ("busy_slot_untouched" if r.busy_touches else "cache_n" if r.cache_n_mismatches
                        else "cache_load" if r.load_mismatches else "output" if r.output_mismatches
                        else "request_error")  # fmt: skip
                first = next((f for f in r.failures if f.startswith(prop)), r.failures[0])
                message = f"{cfg.name}: {first}" + (f"; {r.trace}" if r.trace else "")
                failure = Failure(prop, "violation", message, r.program, replay,
                                  f"server-concurrent-{cfg.name}", r.program.count("Req("))  # fmt: skip
                out("  the timed requests that replay it:\n    " + r.program.replace("\n", "\n    "))
                if r.trace:
                    out(f"  {r.trace}")
            checked = Counter({"cache_n": r.requests, "output": r.requests, "busy_slot_untouched": r.busy_checked})
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
