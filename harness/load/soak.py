"""``python -m harness soak``: sustained load on a real ``llama-server`` with a small ``--cache-ram``.

For each model (the five fixtures models by default), two phases of equal length: faults off, then
the native shim (:class:`faults.native.RemoteShim`) preloaded into the server and armed every
:data:`FAULT_PERIOD_S` seconds to fail the next allocation of at least :data:`FAULT_MIN_SIZE`
bytes (a low rate: one failed large allocation every few seconds, among hundreds of requests).

Clients (:data:`N_CLIENTS` threads) send unique prompts and prompts that repeat an earlier one with
a new tail, without pause. A sampler reads, every second, the server's ``VmRSS`` and the last
``cache state`` line of its log (``-lv 4``; size and entry count, server-task.cpp:1894). Checked:

* RSS <= bound: the RSS once every slot has served a request (the model's base, slots and compute
  buffers included) + ``--cache-ram`` + :data:`RSS_SLACK_MIB` (allocator slack, HTTP threads, the
  slots' checkpoints); ``--rss-bound MIB`` replaces the bound; an ASan build has none of its own (its
  quarantine holds freed memory): every ASan, LSan or UBSan report in the phase's server logs fails it instead;
* the logged cache size never exceeds its logged limit;
* no crash and no request error with faults off; with faults on, a crash is counted with the
  failed allocation (a ``std::bad_alloc`` that terminates the server is a known finding:
  ``checkpoint-alloc-terminates``, ``decode-bad-alloc-terminates``), the server is restarted and
  the soak goes on; a fault trial *survived* when the server still answers afterwards;
* the first :data:`OUTPUT_CHECKS` responses of a phase equal a fresh cache-less server's, checked
  after the phase (:func:`harness.load.outputs.compare_output`), on every model: a greedy flip within
  the model's :data:`~harness.findings.BATCH_SHAPE_FLIP_GAP` (none for mamba) is counted as
  ``greedy-flip-on-cache-path`` (``cache_n`` > 0) or ``concurrent-output-divergence``; with faults on, a
  prompt reusing the tokens of a request answered "decode() failed" is ``decode-exception-keeps-slot-tokens``
  (:class:`harness.load.outputs.Divergences`); first of all, a difference the server's libllama trace
  locates (the reads behind its first wrong token depend on a decode that threw, or on a row decoded
  with its sliding window short: ``swa-restore-window-short``) is that finding's; any other difference
  fails, with the server's libllama trace (each server runs under it unless ``traces`` is off; kept only
  when an output failed) and the lines that replay and shrink it.

With ``memory_limit_mib`` (``--memory-limit``) the soaked server runs in a memory cgroup with that hard limit: an
OOM kill fails the run, with its request program (:mod:`harness.load.live`); the group's peak is reported.

Reported per model and phase: requests/s, p50/p99 latency, the RSS curve (one sample a second), the cache's
size and entries, evictions, fault trials and how many the server survived. Every loop is bounded by the
phase's deadline and :data:`MAX_REQUESTS`; servers are stopped on failure, killed at once on Ctrl-C.
"""

from __future__ import annotations

import random
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from faults.native import RemoteShim
from faults.sites import modules_beside
from fixtures.gguf import model_path
from harness.errors import ServerStartError, UsageError
from harness.findings import CONCURRENT_OUTPUT_DIVERGENCE, GREEDY_FLIP_ON_CACHE_PATH
from harness.interrupt import check, interrupted
from harness.load.clients import soak_prompt
from harness.load.live import LiveServer, oom_killed, rss_bytes
from harness.load.order import LOG_PREFIX, STATE_LINE
from harness.load.outputs import SHORT_WINDOW, Divergences, compare_output
from harness.load.soak_result import CACHE_RAM_MIB, PhaseResult, SoakSettings
from harness.load.stateless import server_args, stateless_clients
from harness.load.traced import ServerTrace
from harness.memlimit import MemoryCgroup
from harness.targets.llama_server import Launch, RequestFailed, ServerProcess, log_sanitizer_reports
from harness.trees.stage import asan_runtime

__all__ = ["CACHE_RAM_MIB", "FAULT_MIN_SIZE", "LiveServer", "PhaseResult", "SoakSettings", "soak", "soak_phase"]

N_CLIENTS = 3
RSS_SLACK_MIB = 32
FAULT_PERIOD_S = 3.0
FAULT_MIN_SIZE = 16 * 1024
OUTPUT_CHECKS = 1500  # the first responses of a phase, all checked against a fresh server afterwards
MAX_REQUESTS = 200_000
MAX_RESTARTS = 50
_SERVER_ARGS = ["-cms", "64", "-b", "256", "-ub", "64", "--no-warmup", "-lv", "4"]
_ERRORS_DOCUMENTED = ("Context size has been exceeded", "Invalid input batch", "failed to process speculative batch")


def soak_phase(
    binary: Path,
    arch: str,
    st: SoakSettings,
    *,
    faults: bool,
    log_dir: str,
    out: Callable[[str], None] = print,
    traces: ServerTrace | None = None,
) -> PhaseResult:
    """One model, one phase (faults off or on); see the module docstring for what is checked.
    ``traces``: each server of the phase under the libllama trace, kept when one of its outputs failed."""
    res = PhaseResult(arch, faults, asan=asan_runtime(binary) is not None)
    shim = RemoteShim(tempfile.mkdtemp(prefix="soak-shim-", dir=log_dir)) if faults else None
    n_log = 0
    cg: MemoryCgroup | None = None
    if st.memory_limit_mib is not None:
        res.memory_limit_bytes = st.memory_limit_mib << 20
        cg = MemoryCgroup(limit_bytes=res.memory_limit_bytes, tag=f"soak-{arch}-{'faults' if faults else 'off'}")
        cg.create()
    trace_files: list[Path | None] = []
    logs: list[Path] = []  # every server's log of the phase (the fresh server's last), read for sanitizer reports
    extra = server_args(arch) if st.embedding_clients else ()

    def make() -> ServerProcess:
        nonlocal n_log
        n_log += 1
        name = f"soak-{arch}-{'faults' if faults else 'off'}-{n_log}"
        logs.append(Path(f"{log_dir}/{name}.log"))
        trace = traces.path(name) if traces is not None else None
        trace_files.append(trace)
        base = shim.env() if shim else None
        launch = Launch(model=model_path(arch), n_parallel=st.n_parallel, ctx_size=2048, cache_ram=st.cache_ram_mib,
                        ctx_checkpoints=4, args=[*_SERVER_ARGS, *extra])  # fmt: skip
        return ServerProcess(binary, launch, env=traces.env(trace, base) if traces is not None else base,
                             log_path=f"{log_dir}/{name}.log", preexec=None if cg is None else cg.preexec)  # fmt: skip

    try:  # the group goes with the phase, whatever fails before the phase's own clean-up is in place
        live = LiveServer(make, cg)
        fresh = ServerProcess(binary, Launch(model=model_path(arch), n_parallel=1, ctx_size=2048, cache_ram=0,
                                             ctx_checkpoints=4, args=[*_SERVER_ARGS[:-2], *extra]),
                              log_path=f"{log_dir}/soak-{arch}-fresh.log")  # fmt: skip
    except BaseException:
        if cg is not None:
            cg.remove()
        raise
    res.cache_limit_mib = float(st.cache_ram_mib)
    try:
        try:
            live.server.start()
        except ServerStartError as e:
            if cg is not None and st.memory_limit_mib is not None:
                raise UsageError(f"--memory-limit {st.memory_limit_mib}: llama-server ({arch}) does not start "
                                 f"under it ({e}); a larger limit") from None  # fmt: skip
            raise
        fresh.start()
        _run(live, shim, st, res, out)
        if cg is not None:
            res.cgroup_peak_bytes = cg.peak()
            res.oom_kills = cg.oom_kills()
        live.server.stop()
        failed_on = _check_outputs(fresh, res, trace_files)
        fresh.stop()
        check_sanitizer_reports([*logs, Path(f"{log_dir}/soak-{arch}-fresh.log")], res)
        if traces is not None:  # server k's trace is kept when one of its outputs failed ("output (server k)")
            res.traces = [t for k, f in enumerate(trace_files, 1) if (t := traces.settle(f, k in failed_on))]
    finally:
        try:
            live.server.stop()
        finally:
            try:
                fresh.stop()
            finally:
                if cg is not None:
                    cg.remove()
    return res


def _warm_up(live: LiveServer, st: SoakSettings, res: PhaseResult) -> None:
    """One request per slot at once, so the slots and compute buffers are in the base RSS."""
    threads = [
        threading.Thread(target=lambda k=k: live.server.completion([3 + k] * 64, 4, ignore_eos=True), daemon=True)
        for k in range(st.n_parallel)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    res.rss_base = rss_bytes(live.server.pid)
    if st.rss_bound_mib is not None:
        res.rss_bound = int(st.rss_bound_mib * (1 << 20))
    elif not res.asan:  # ASan's quarantine (256 MiB) and shadow grow with the freed memory it holds: no bound
        res.rss_bound = res.rss_base + (st.cache_ram_mib + RSS_SLACK_MIB) * (1 << 20)


def _check_outputs(fresh: ServerProcess, res: PhaseResult, trace_files: Sequence[Path | None] = ()) -> set[int]:
    """Every recorded response against the fresh server, in the order they were sent; the servers
    (1, 2, ... counting restarts) that gave an output no known finding explains. ``trace_files``:
    server k's libllama trace at k - 1 (None: not traced), where a difference is located first."""
    known = Divergences(res.arch)
    for toks in res.decode_failed:
        known.failed_decode(toks)
    failed_on: set[int] = set()
    for at, toks, gen, cache_n, slot, server in sorted(res.responses):
        if not gen:
            continue
        diff = compare_output(fresh, toks, gen, res.arch)
        res.output_checks += 1
        if diff is None:
            continue
        trace = trace_files[server - 1] if 0 < server <= len(trace_files) else None
        flip = Divergences.batch_shape(diff, cache_n)
        located = known.located(diff, trace)
        if located is not None:  # the trace shows the finding's condition behind the first wrong token
            if located == SHORT_WINDOW:
                res.short_window_divergences += 1
            else:
                res.decode_failure_divergences += 1
            known.add(toks, gen)
        elif flip == GREEDY_FLIP_ON_CACHE_PATH.id:
            res.near_tie_flips += 1
        elif flip == CONCURRENT_OUTPUT_DIVERGENCE.id:
            res.concurrent_divergences += 1
        elif known.explains(toks, cache_n):  # reused a failed decode's tokens, or a response it changed
            res.decode_failure_divergences += 1
            known.add(toks, gen)
        else:
            failed_on.add(server)
            before = [f for f in res.fault_times if f <= at]
            when = f"sent at {at:.1f}s, " + (f"after the fault at {before[-1]:.1f}s" if before else "before any fault")
            res.violations.append(f"output (server {server}): {diff.describe()} (slot {slot}, cache_n {cache_n}; "
                                  f"{when})")  # fmt: skip
    return failed_on


def _run(
    live: LiveServer, shim: RemoteShim | None, st: SoakSettings, res: PhaseResult, out: Callable[[str], None]
) -> None:
    _warm_up(live, st, res)
    t0 = time.monotonic()
    deadline = t0 + st.seconds
    stop = threading.Event()
    lock = threading.Lock()
    armed = threading.Event()

    def client(k: int) -> None:
        rng = random.Random(st.seed * 100 + k)
        pool: list[tuple[int, ...]] = []
        while not stop.is_set() and time.monotonic() < deadline and res.requests < MAX_REQUESTS:
            toks = soak_prompt(rng, pool, 900)
            n_predict = rng.choice((2, 4, 8, 16))
            gen, t = live.generation, time.monotonic()
            live.program.append((round(t - t0, 3), k, toks, n_predict))
            try:
                r = live.server.completion(list(toks), n_predict, ignore_eos=True, return_tokens=True)
            except RequestFailed as e:
                if e.kind != "http":
                    with lock:
                        res.requests += 1
                        res.errors += 1
                        if shim is not None:
                            res.fault_errors += 1
                        elif not live.in_crash(gen):
                            res.violations.append(f"request failed with faults off: {e}")
                    time.sleep(0.05)  # the sampler notices a dead server and restarts it
                    continue
                body = e.message
                with lock:
                    res.requests += 1
                    res.errors += 1
                    if "decode() failed" in body:  # the slot may keep these tokens unevaluated (a known finding)
                        res.decode_failed.append(toks)
                    if (
                        armed.is_set()
                        or live.in_crash(gen)
                        or (shim is not None and any(d in body for d in _ERRORS_DOCUMENTED))
                    ):
                        res.fault_errors += 1
                    else:
                        res.violations.append(f"request error with faults off: {e}")
                continue
            dt = time.monotonic() - t
            with lock:
                res.requests += 1
                res.latencies.append(dt)
                if len(res.responses) < OUTPUT_CHECKS:
                    res.responses.append((t - t0, toks, tuple(int(x) for x in r.get("tokens") or ()),
                                          int(r["timings"]["cache_n"]), int(r["id_slot"]), gen + 1))  # fmt: skip

    threads = [threading.Thread(target=client, args=(k,), daemon=True) for k in range(N_CLIENTS)]
    for t in threads:
        t.start()
    threads += stateless_clients(live, st.embedding_clients, st.seed, stop, deadline, res)
    next_fault = t0 + FAULT_PERIOD_S
    try:
        while time.monotonic() < deadline and not stop.is_set():
            time.sleep(1.0)
            check()  # a Ctrl-C Python swallowed in a finalizer still ends the phase
            _sample(live, res, t0)
            if not live.server.running():
                _crashed(live, shim, res, out)
                if res.crashes > MAX_RESTARTS or shim is None:
                    stop.set()
                    break
                continue
            if shim is not None and time.monotonic() >= next_fault:
                _fault_trial(live, shim, res, armed, t0)
                next_fault = time.monotonic() + FAULT_PERIOD_S
    finally:
        stop.set()
        if interrupted():  # the clients' requests end with the server, not after their timeouts
            live.server.stop()
        for t in threads:
            t.join(live.server.request_timeout)
    res.seconds = time.monotonic() - t0


def check_sanitizer_reports(logs: Sequence[Path], res: PhaseResult) -> None:
    """The first line of every ASan, LSan or UBSan report in the phase's server logs: each one a violation."""
    for log in logs:
        for report in log_sanitizer_reports(log):
            res.sanitizer_reports.append(report)
            res.violations.append(f"sanitizer report in {log.parent}/{report}")


def _sample(live: LiveServer, res: PhaseResult, t0: float) -> None:
    rss = rss_bytes(live.server.pid) if live.server.running() else 0
    mib, entries = (res.rss_curve[-1][2], res.rss_curve[-1][3]) if res.rss_curve else (0.0, 0)
    for line in live.new_log().splitlines():
        if "removing oldest entry" in line:
            res.evictions += 1
        m = LOG_PREFIX.match(line)
        s = STATE_LINE.search(m.group(9)) if m else None
        if s:
            entries, mib, limit = int(s.group(1)), float(s.group(2)), float(s.group(3))
            if mib > limit + 1e-3:
                res.violations.append(f"the logged cache size {mib} MiB exceeds its limit {limit} MiB")
    t = time.monotonic() - t0
    res.rss_curve.append((t, rss, mib, entries))
    if res.rss_bound and rss > res.rss_bound:
        res.violations.append(
            f"RSS {rss} B at {t:.0f}s exceeds the bound {res.rss_bound} B (base {res.rss_base} B + cache-ram + "
            f"{RSS_SLACK_MIB} MiB)"
        )


def _crashed(live: LiveServer, shim: RemoteShim | None, res: PhaseResult, out: Callable[[str], None]) -> None:
    proc = live.server.proc
    rc = proc.returncode if proc is not None else None
    oom = oom_killed(live, rc, res)
    if oom is not None:
        res.crashes += 1
        res.crash_details.append(oom)
        out(f"    {oom}" + ("; restarting" if shim is not None else ""))
        if shim is not None:
            try:
                live.restart()
            except ServerStartError as e:
                res.violations.append(f"the server could not be restarted: {e}")
        return
    log = live.server.log_path.read_text(errors="replace") if live.server.log_path else ""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    what = next((ln for ln in lines if "terminate called" in ln or "GGML_ASSERT" in ln), "")
    if not what:  # no message of its own: the log's last lines and the top of the shim's C stack
        frames = [ln.strip() for ln in (shim.stacks() if shim else "").splitlines() if "(" in ln][:4]
        what = "no message; log ends: " + " | ".join(lines[-2:]) + ("; stack: " + " < ".join(frames) if frames else "")
    res.crashes += 1
    if shim is not None:  # where the allocation armed last failed, from the stack the shim wrote then
        seen = shim.observe(modules_beside(live.server.binary))
        what += f"; {seen.describe()}" + (f" at {seen.fault()}" if seen.failed else "")
    detail = f"exit {rc}: {what} (log {live.server.log_path})"
    res.crash_details.append(detail)
    if shim is None:
        res.violations.append(f"llama-server died with faults off: {detail}")
        return
    out(f"    crash under a fault: {detail}; restarting")
    try:
        live.restart()
    except ServerStartError as e:
        res.violations.append(f"the server could not be restarted: {e}")


def _fault_trial(live: LiveServer, shim: RemoteShim, res: PhaseResult, armed: threading.Event, t0: float) -> None:
    """Fail the server's next allocation of >= FAULT_MIN_SIZE bytes within one second; survived if
    it still answers a request afterwards."""
    pid = live.server.pid
    at = time.monotonic() - t0
    try:
        armed.set()
        shim.arm(pid, 1, min_size=FAULT_MIN_SIZE)
        time.sleep(1.0)
        fired = shim.disarm(pid, timeout=2.0) if live.server.running() else 1
    except ProcessLookupError:
        fired = 1
    finally:
        armed.clear()
    if not fired:
        return
    res.fault_trials += 1
    res.fault_times.append(at)
    res.fault_sites.append(shim.observe(modules_beside(live.server.binary)).fault())
    try:
        live.server.completion([5, 6, 7, 8], 2, ignore_eos=True)
        res.fault_survived += live.server.running()
    except RequestFailed:
        pass


def soak(
    binary: Path,
    archs: Sequence[str],
    st: SoakSettings,
    log_dir: str,
    out: Callable[[str], None] = print,
    traces: ServerTrace | None = None,
) -> list[PhaseResult]:
    """Every model, faults off then on; one line per phase (``traces``: see :func:`soak_phase`)."""
    results = []
    for arch in archs:
        for faults in (False, True):
            r = soak_phase(binary, arch, st, faults=faults, log_dir=log_dir, out=out, traces=traces)
            s = r.summary()
            status = "FAIL" if r.violations else "ok  "
            mib = {k: s[k] >> 20 for k in ("rss_max_bytes", "rss_base_bytes", "rss_bound_bytes")}
            line = (
                f"  [{status}] {arch:<7} faults {'on ' if faults else 'off'} {s['requests']:>6} requests "
                f"{s['requests_per_s']:>7} req/s p50 {s['p50_ms']} ms p99 {s['p99_ms']} ms; RSS max "
                f"{mib['rss_max_bytes']} MiB (base {mib['rss_base_bytes']}, bound "
                f"{mib['rss_bound_bytes'] if r.rss_bound else 'none: ASan'}); "
                f"cache max {s['cache_max_mib']:.2f}/{s['cache_limit_mib']:.0f} MiB {s['cache_max_entries']} "
                f"entries, {s['evictions']} evictions; {s['output_checks']} outputs checked "
                f"({r.concurrent_divergences} concurrent-output-divergence, {r.near_tie_flips} "
                f"greedy-flip-on-cache-path)"
            )
            if st.embedding_clients:
                line += f"; {r.stateless.embeddings} embeddings, {r.stateless.reranks} reranks besides"
            if r.memory_limit_bytes is not None:
                peak = (r.cgroup_peak_bytes or 0) >> 20
                line += f"; limit {r.memory_limit_bytes >> 20} MiB, cgroup peak {peak} MiB, {r.oom_kills} OOM kills"
            if faults:
                line += f"; faults: {r.fault_trials} trials, {r.fault_survived} survived, {r.crashes} crashes"
                if r.asan and not r.fault_trials:
                    line += " (ASan's malloc comes before the shim's: no allocation fault fires on an ASan build)"
                if r.decode_failure_divergences:
                    line += f"; {r.decode_failure_divergences} outputs by decode-exception-keeps-slot-tokens"
            if r.asan:
                line += f"; {len(r.sanitizer_reports)} sanitizer reports"
            if r.short_window_divergences:
                line += f"; {r.short_window_divergences} outputs by swa-restore-window-short (located in the trace)"
            out(line)
            for v in r.violations[:3]:
                out(f"      {v}")
            for t in r.traces[:3]:
                out(f"      {t}")
            results.append(r)
    return results
