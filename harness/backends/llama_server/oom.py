"""PR #27451's scenario at the size users hit it: GiB-scale checkpoints saved under a real memory limit.

One run (:func:`run_oom`) is one ``llama-server`` build under one kind of limit:

1. The server starts on a ``mamba2-cN`` model (:data:`fixtures.gguf.BIG_SPECS`: one checkpoint of N MiB),
   one slot, ``--ctx-checkpoints K``, ``-lv 4`` (the log says every checkpoint's size, the save's state size
   and how long it took). The weights are mapped from the file (11-90 MB: page cache, which the kernel
   reclaims before it OOM-kills, and which the baseline leaves out).
   In ``cgroup`` mode it runs inside a :class:`~harness.memlimit.MemoryCgroup` from its first
   instruction, capped at a ceiling that only protects the host until the limit is set.
2. A 16-token prompt, then extensions of 16 tokens each on the same slot: two checkpoints a request
   (``-ub 8``: the server makes them 12 and 4 tokens before a prompt's end), until the slot holds K. Their
   size C1 and total C are read from the server's log; the state S the save allocates is one C1 (a pure
   recurrent model's sequence state is what its checkpoint holds), confirmed afterwards by the log's
   ``total state size``.
3. The baseline is measured (``cgroup``: the group's usage without reclaimable page cache; ``rlimit``: the
   server's ``VmSize``) and the limit set to ``baseline + S + headroom * C`` (headroom 1/2 by default): the
   PR's save needs S more, master's S + C. The cgroup's peak and the server's VmHWM are reset.
4. A 4-token prompt that shares nothing takes the slot: the server saves the slot's prompt into the RAM
   cache (``--cache-ram`` sized so the entry fits logically). Then a request that extends the saved prompt
   must resume from the cache (``timings.cache_n``), under the same limit.

What is recorded is observed, never inferred: the OOM kills in the cgroup's counters and the server's exit
signal; a ``std::bad_alloc`` caught (the log's ``failed to allocate memory for prompt cache state``) or
escaping (``terminate called after throwing an instance of 'std::bad_alloc'``, SIGABRT); the peaks; the
save's time (the request's wall time and the server's own ``prompt cache update took``); ``cache_n``.
"""

from __future__ import annotations

import contextlib
import re
import signal
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from fixtures.gguf import BIG_SPECS, checkpoint_model_name, model_path
from harness.errors import RequestFailed, UsageError
from harness.memlimit import MemoryCgroup, address_space, cgroup_support, limit_address_space
from harness.targets.llama_server import Launch, ServerProcess, Timeouts, proc_status

__all__ = ["MODES", "OomRun", "OomSettings", "expected", "gate_check", "run_oom"]

MODES = ("cgroup", "rlimit", "none")  # none: the cgroup's ceiling only, to see the whole save's peak and time
MIB = 1 << 20

_CREATED = re.compile(r"created context checkpoint (\d+) of (\d+) .*size = ([\d.]+) MiB")
_SAVING = re.compile(r"saving prompt with length (\d+), total state size = ([\d.]+) MiB")
_UPDATE = re.compile(r"prompt cache update took ([\d.]+) ms")
_CAUGHT = "failed to allocate memory for prompt cache state"
_ESCAPED = "terminate called after throwing an instance of"
_FOUND = "found better prompt"


@dataclass(frozen=True)
class OomSettings:
    """One scenario: K checkpoints of ``size_mib`` each, under a limit of ``baseline + S + headroom * C``."""

    checkpoints: int = 4
    size_mib: int = 128
    mode: str = "cgroup"  # or "rlimit", or "none" (no limit: the save's whole peak and time)
    headroom: float = 0.5  # of C, above baseline + S
    ceiling_gib: float = 10.0  # the cgroup's limit until the real one is set: the host is shared
    n_ubatch: int = 8
    extend: int = 16  # tokens per build-up request
    request_timeout: float = 900.0

    def check(self) -> None:
        if self.mode not in MODES:
            raise UsageError(f"--mode {self.mode}: choose one of {', '.join(MODES)}")
        if self.size_mib not in _SIZES:
            raise UsageError(f"--size {self.size_mib}: choose one of {', '.join(map(str, _SIZES))} (MiB)")
        if self.checkpoints < 2:
            raise UsageError("--checkpoints must be at least 2 (the PR's save must fit where master's does not)")
        if not 0.0 < self.headroom < 1.0:
            raise UsageError("--headroom must be between 0 and 1 (a fraction of C above baseline + S)")
        if self.headroom * self.checkpoints <= 1.0:
            # the request after the save saves the 4-token prompt's state too: the PR briefly holds 2 S
            raise UsageError(
                f"--headroom {self.headroom:g} x {self.checkpoints} checkpoints leaves no room for the next "
                "request's own save (one more S): more checkpoints or more headroom"
            )
        need = (self.checkpoints + 4) * self.size_mib * MIB
        if need > self.ceiling_gib * (1 << 30):
            raise UsageError(
                f"{self.checkpoints} checkpoints of {self.size_mib} MiB need about {need / (1 << 30):.1f} GiB, "
                f"over the {self.ceiling_gib} GiB ceiling; fewer or smaller checkpoints, or --ceiling-gib"
            )


_SIZES = tuple(int(n.removeprefix("mamba2-c")) for n in BIG_SPECS if n.startswith("mamba2-c"))


@dataclass
class OomRun:
    """What one build did under one limit."""

    build: str
    semantics: str
    mode: str
    model: str
    n_checkpoints: int = 0
    checkpoint_mib_log: float = 0.0  # one checkpoint's size, as the server logged it
    c_bytes: int = 0  # the slot's checkpoints, from the log
    s_bytes: int = 0  # the state the save allocates (one checkpoint's size; confirmed by s_log_bytes)
    s_log_bytes: int | None = None  # "total state size" of the save, from the log
    baseline_bytes: int = 0  # cgroup: usage without page cache; rlimit: VmSize
    limit_bytes: int = 0
    derivation: str = ""
    build_up_s: float = 0.0
    tokens_per_s: float = 0.0
    save_wall_s: float | None = None
    save_update_ms: float | None = None  # the server's own "prompt cache update took"
    save_answered: bool = False
    alive_after_save: bool = False
    exit_code: int | None = None
    exit_signal: str | None = None
    oom_kills: int | None = None
    failcnt: int | None = None
    peak_bytes: int | None = None  # cgroup peak during the save (absolute)
    peak_above_baseline: int | None = None
    vmhwm_above_rss: int | None = None  # VmHWM - VmRSS before the save (survivors only)
    bad_alloc: str = "none"  # "none", "caught", "escaped"
    outcome: str = ""  # "survived", "oom-killed", "aborted", "recovered", "died"
    resumed: bool | None = None
    cache_n: int | None = None
    resume_prompt: int = 0
    log_path: str = ""
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


def expected(semantics: str, mode: str) -> str:
    """What PR #27451 says happens at ``baseline + S + C/2``: the PR's save fits; master's deep copy of the
    checkpoints does not (killed by the OOM killer in a cgroup; its bad_alloc escapes under RLIMIT_AS)."""
    if semantics == "shared" or mode == "none":
        return "survived"
    return "oom-killed" if mode == "cgroup" else "aborted"


def _prompt(n: int, seed: int) -> list[int]:
    return [3 + (i * seed + seed) % 250 for i in range(n)]


@contextlib.contextmanager
def _group(st: OomSettings, tag: str) -> Iterator[MemoryCgroup | None]:
    if st.mode == "rlimit":
        yield None
        return
    with MemoryCgroup(limit_bytes=int(st.ceiling_gib * (1 << 30)), tag=tag) as cg:
        yield cg


def _signal_name(rc: int | None) -> str | None:
    if rc is None or rc >= 0:
        return None
    try:
        return signal.Signals(-rc).name
    except ValueError:
        return f"signal {-rc}"


def run_oom(
    binary: Path,
    build: str,
    semantics: str,
    st: OomSettings,
    log_dir: Path,
    progress: Callable[[str], None] = lambda _m: None,
) -> OomRun:
    """The scenario on one build under one limit (module docstring); never raises for the server's death."""
    st.check()
    name = checkpoint_model_name(st.size_mib)
    spec = BIG_SPECS[name]
    run = OomRun(build, semantics, st.mode, name)
    t0 = time.monotonic()
    model = model_path(name)
    if time.monotonic() - t0 > 1:
        progress(f"generated {name} ({model.stat().st_size / MIB:.0f} MiB file) in {time.monotonic() - t0:.1f} s")
    s_est = spec.state_bytes
    cache_ram_mib = -(-((st.checkpoints + 3) * s_est) // MIB) + 64  # the entry (S + C) and the next one (S) fit
    slug = re.sub(r"[^A-Za-z0-9_.]+", "_", build).strip("_")[-40:]  # "source /path/to/tree": a file name
    log = log_dir / f"oom-{slug}-{st.mode}-{st.size_mib}x{st.checkpoints}.log"
    run.log_path = str(log)
    args = ["-cms", "4", "-b", "64", "-ub", str(st.n_ubatch), "--no-warmup", "-lv", "4"]
    with _group(st, f"{slug}-{st.mode}") as cg:
        srv = ServerProcess(
            binary,
            Launch(
                model=model,
                n_parallel=1,
                ctx_size=1024,
                cache_ram=cache_ram_mib,
                ctx_checkpoints=st.checkpoints,
                threads=1,
                args=args,
            ),
            log_path=log,
            preexec=None if cg is None else cg.preexec,
            timeouts=Timeouts(request=st.request_timeout),
        )
        with srv:
            saved, releases = _build_up(srv, st, run, progress)
            _limit(srv, cg, st, run, s_est)
            progress(f"{build} {st.mode}: {run.derivation}")
            _save(srv, cg, run, releases + 1, progress)
            if run.alive_after_save:
                _resume(srv, run, saved, releases + 2)
            if cg is not None:
                c = cg.counters()
                run.oom_kills, run.failcnt = c.oom_kills, c.failcnt
            alive = srv.running()
        rc = srv.proc.returncode if srv.proc is not None and not alive else None
        if rc is not None:
            run.exit_code, run.exit_signal = rc, _signal_name(rc)
    _classify(run, log.read_text(errors="replace"))
    return run


def _log(srv: ServerProcess) -> str:
    return srv.log_path.read_text(errors="replace") if srv.log_path else ""


def _build_up(
    srv: ServerProcess, st: OomSettings, run: OomRun, progress: Callable[[str], None]
) -> tuple[list[int], int]:
    """Extend one prompt on slot 0 until the server's log says the slot holds K checkpoints; the prompt the
    slot holds then (the one the save puts into the cache) and the requests made."""
    tokens = _prompt(16, 7)
    releases = 0
    t0 = time.monotonic()
    n_tokens = 0
    for k in range(st.checkpoints + 2):
        if k:
            tokens = tokens + _prompt(st.extend, 11 + k)
        r = srv.completion(tokens, 1, ignore_eos=True)
        releases += 1
        n_tokens += int(r.get("timings", {}).get("prompt_n", 0))
        created = _CREATED.findall(srv.log_through(releases))
        if created:
            have, _, mib = created[-1]
            run.n_checkpoints, run.checkpoint_mib_log = int(have), float(mib)
            progress(f"{run.build} {st.mode}: request {k + 1}: {have} checkpoints of {mib} MiB in the slot")
        if run.n_checkpoints >= st.checkpoints:
            break
    run.build_up_s = time.monotonic() - t0
    run.tokens_per_s = n_tokens / run.build_up_s if run.build_up_s else 0.0
    run.resume_prompt = len(tokens)
    run.notes.append(f"build-up: {n_tokens} prompt tokens in {run.build_up_s:.1f} s")
    if run.n_checkpoints < st.checkpoints:
        raise UsageError(
            f"llama-server {run.build}: the slot holds {run.n_checkpoints} checkpoints, not {st.checkpoints}, "
            f"after {st.checkpoints + 2} requests; log: {srv.log_path}"
        )
    run.c_bytes = round(run.n_checkpoints * run.checkpoint_mib_log * MIB)
    return tokens, releases


def _limit(srv: ServerProcess, cg: MemoryCgroup | None, st: OomSettings, run: OomRun, s_est: int) -> None:
    """The limit: baseline + S + headroom * C, with S the checkpoint's logged size (the model's state size
    when the log rounds it away)."""
    s = round(run.checkpoint_mib_log * MIB) or s_est
    run.s_bytes = s
    extra = s + int(st.headroom * run.c_bytes)
    if cg is not None:
        run.baseline_bytes = cg.anon_bytes()
        what = "cgroup usage without page cache"
        run.limit_bytes = run.baseline_bytes + extra
        if st.mode == "none":  # measure only: the ceiling stays
            run.limit_bytes = cg.limit() or 0
            run.derivation = (
                f"no limit but the ceiling {run.limit_bytes / MIB:.0f} MiB; baseline {run.baseline_bytes / MIB:.0f}"
                f" MiB ({what}), S {s / MIB:.1f} MiB, C {run.c_bytes / MIB:.1f} MiB"
            )
            cg.reset_peak()
            return
        cg.set_limit(run.limit_bytes)
        cg.reset_peak()
    else:
        run.baseline_bytes = address_space(srv.pid)
        what = "VmSize"
        run.limit_bytes = run.baseline_bytes + extra
        limit_address_space(srv.pid, run.limit_bytes)
    run.derivation = (
        f"limit = baseline {run.baseline_bytes / MIB:.0f} MiB ({what}) + S {s / MIB:.1f} MiB + "
        f"{st.headroom:g} x C {run.c_bytes / MIB:.1f} MiB = {run.limit_bytes / MIB:.0f} MiB "
        f"(the PR's save needs S more, master's S + C = {(s + run.c_bytes) / MIB:.0f} MiB)"
    )


def _save(
    srv: ServerProcess, cg: MemoryCgroup | None, run: OomRun, releases: int, progress: Callable[[str], None]
) -> None:
    """A prompt that shares nothing takes the slot: the slot's prompt is saved into the RAM cache."""
    pid = srv.pid
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")
    rss0 = proc_status(pid)["VmRSS"]
    usage0 = cg.usage() if cg is not None else 0
    offset = len(_log(srv))  # what the build-up logged: the save's lines come after
    t0 = time.monotonic()
    try:
        srv.completion(_prompt(4, 97), 1, ignore_eos=True)
        run.save_answered = True
    except RequestFailed as e:
        run.notes.append(f"save request: {e.describe()}")
    run.save_wall_s = time.monotonic() - t0
    run.alive_after_save = srv.running()
    if run.alive_after_save:
        run.vmhwm_above_rss = proc_status(pid)["VmHWM"] - rss0
    if cg is not None:
        run.peak_bytes = cg.peak()
        run.peak_above_baseline = run.peak_bytes - usage0
    text = (srv.log_through(releases) if run.alive_after_save else _log(srv))[offset:]
    if m := _UPDATE.search(text):
        run.save_update_ms = float(m[1])
    if m := _SAVING.search(text):
        run.s_log_bytes = round(float(m[2]) * MIB)
    progress(
        f"{run.build} {run.mode}: save {'answered' if run.save_answered else 'not answered'} in "
        f"{run.save_wall_s:.1f} s, server {'alive' if run.alive_after_save else 'dead'}"
    )


def _resume(srv: ServerProcess, run: OomRun, saved: list[int], releases: int) -> None:
    """A request extending the saved prompt: does it start from the cache entry (``cache_n``)?"""
    n_found = _log(srv).count(_FOUND)
    try:
        r = srv.completion([*saved, 11, 12, 13], 1, ignore_eos=True)
    except RequestFailed as e:
        run.notes.append(f"resume request: {e.describe()}")
        run.resumed = False
        return
    run.cache_n = int(r.get("timings", {}).get("cache_n", 0))
    found = srv.log_through(releases).count(_FOUND) > n_found
    run.resumed = found and run.cache_n > 0


def _classify(run: OomRun, log: str) -> None:
    if _CAUGHT in log:
        run.bad_alloc = "caught"
    if _ESCAPED in log:
        run.bad_alloc = "escaped"
    if run.exit_code is None and run.alive_after_save:
        run.outcome = "recovered" if run.bad_alloc == "caught" else "survived"
    elif run.exit_signal == "SIGKILL" and run.oom_kills:
        run.outcome = "oom-killed"
    elif run.exit_signal == "SIGABRT" and run.bad_alloc == "escaped":
        run.outcome = "aborted"
    else:
        run.outcome = "died"
        run.notes.append(f"died: exit {run.exit_code} ({run.exit_signal}), oom_kills {run.oom_kills}")


def gate_check(
    section: dict[str, Any],
    label: str,
    semantics: str,
    binary: Path,
    logs: str,
    fail: Callable[[str, str, str, str, str], None],
    out: Callable[[str], None],
) -> Counter[str]:
    """The server gate's check: 4 checkpoints of 64 MiB saved under ``baseline + S + C/2`` in a memory cgroup
    (when one can be made here; else one line says so) and under RLIMIT_AS. The property is the PR's: the save
    fits and the next request resumes from the cache. Master breaks it as the PR says: OOM-killed in the cgroup
    (``transient_peak``: its save carries the checkpoint copy), aborted under RLIMIT_AS (``no_partial_entries``:
    the copy's bad_alloc escapes ``server_prompt_cache::alloc``)."""
    modes = ["cgroup", "rlimit"]
    if cgroup_support() is None:
        modes = ["rlimit"]
        out("  [skip] oom in a memory cgroup: no writable cgroup v1 memory nor v2 memory controller here")
    section["oom"] = {}
    checked: Counter[str] = Counter()
    for mode in modes:
        r = run_oom(binary, label, semantics, OomSettings(checkpoints=4, size_mib=64, mode=mode), Path(logs))
        section["oom"][mode] = r.to_json()
        ok = r.outcome == "survived" and bool(r.resumed)
        # each limit holds the save to both: it fits (transient_peak) and no bad_alloc escapes (no_partial_entries)
        checked.update(("transient_peak", "no_partial_entries"))
        what = (
            f"oom ({mode}): {r.n_checkpoints} checkpoints of {r.checkpoint_mib_log} MiB, limit baseline + S + C/2 "
            f"= {r.limit_bytes / MIB:.0f} MiB: {r.outcome}"
            + (
                f" ({r.exit_signal}" + ("" if r.oom_kills is None else f", oom_kill {r.oom_kills}") + ")"
                if r.exit_signal
                else ""
            )
            + ("" if r.resumed is None else f", next request cache_n {r.cache_n}")
        )
        out(f"  [{'ok  ' if ok else 'FAIL'}] {what}")
        if ok:
            continue
        if r.outcome == "oom-killed":
            prop, kind = "transient_peak", "crash"
            why = "its save needs more than S above the baseline (PR #27451: master deep-copies the checkpoints)"
        elif r.outcome == "aborted":
            prop, kind = "no_partial_entries", "crash"
            why = ("a std::bad_alloc escaped during the save and terminated the server (its log's 'terminate called' "
                   "line, SIGABRT; where it was thrown is not observed here: PR #27451 widens alloc's try to the "
                   "whole entry)")
        elif r.outcome == "survived":
            prop, kind, why = "cache_n", "violation", "the next request did not resume from the cache entry"
        elif r.outcome == "recovered":
            prop, kind, why = "transient_peak", "violation", "the save met a bad_alloc though S fits under the limit"
        else:
            prop, kind, why = "server", "crash", "; ".join(r.notes)
        fail(prop, kind, f"llama-server {label} {what}: {why} (log: {r.log_path})", "", "server-oom")
    return checked
