"""The server backend's memory properties: a save's RSS peak with MiBs of checkpoints, and native faults in it.

* :func:`save_peak`: VmHWM around one save of a slot with ~16 MiB of checkpoints (``mamba-big``),
  beside the model's predicted transient peak, and master against pr when both are built.
* :func:`save_fault`: the native shim preloaded into the server fails the Nth large allocation of
  the request that saves the slot; the model, armed the same way, predicts where it must end.
* :func:`memory_and_faults` runs both for the gate and files their rows, then the same save with 4 checkpoints
  of 64 MiB under a real memory limit (:func:`harness.backends.llama_server.oom.gate_check`).
"""

from __future__ import annotations

import re
import signal
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from faults.native import RemoteShim
from faults.sites import Observation, modules_beside
from harness.backends.llama_server.differential import Differential, ServerMismatch
from harness.backends.llama_server.oom import gate_check
from harness.errors import BadAlloc
from harness.findings import CHECKPOINT_ALLOC_TERMINATES, KnownRow
from harness.model.sites import upstream
from harness.targets.llama_server import RequestFailed, ServerConfig, proc_status
from harness.trees.build import build_name, cached_binary

__all__ = ["DIVERGING", "FaultTrial", "memory_and_faults", "save_fault", "save_peak"]


def _big_cfg() -> ServerConfig:
    return ServerConfig(
        "mamba-big",
        n_parallel=1,
        cache_ram_mib=512,
        ctx_checkpoints=16,
        checkpoint_min_step=16,
        n_ctx=4096,
        n_batch=256,
        n_ubatch=64,
    )


def _build_up(d: Differential, n_extend: int) -> None:
    """A 600-token prompt extended ``n_extend`` times on slot 0: many checkpoints of ~1 MiB each."""
    base = [3 + (i * 7) % 250 for i in range(600)]
    ext = [3 + (i * 11) % 250 for i in range(40 * n_extend)]
    for k in range(n_extend):
        row = d.request(base + ext[: 40 * k], 1)
        if not row.ok:
            raise ServerMismatch("cache_n", row.describe(), d.program())


DIVERGING = [200 + (i * 3) % 50 for i in range(300)]


def save_peak(binary: Path, semantics: str, *, n_extend: int = 8, log_dir: str | None = None) -> dict[str, int]:
    """RSS high-water mark of a real server around one prompt save with MiBs of checkpoints.

    ``mamba-big`` (about 1 MiB of recurrent state per sequence) on one slot: a 600-token prompt
    extended ``n_extend`` times leaves the slot with many checkpoints, then a different prompt makes
    the server save the slot to the cache. VmHWM is reset (``5 > /proc/PID/clear_refs``) right
    before that request. The model, fed the same requests, gives its predicted peak for the save.
    """
    with Differential(_big_cfg(), binary, semantics, log_dir) as d:
        _build_up(d, n_extend)
        slot = d.model.slots[0]
        checkpoint_bytes = sum(c.size() for c in slot.prompt.checkpoints)
        saves: list[tuple[int, int]] = []
        orig = slot.prompt_save

        def traced(cache: Any) -> bool:
            ok = orig(cache)
            op = d.model.host.last_op
            if op is not None:
                saves.append((op.peak_excess, op.state_bytes))
            return ok

        slot.prompt_save = traced  # type: ignore[method-assign,assignment]
        pid = d.server.pid
        with open(f"/proc/{pid}/clear_refs", "w") as f:
            f.write("5")
        rss0 = proc_status(pid)["VmRSS"]
        row = d.request(DIVERGING, 1)
        if not row.ok:
            raise ServerMismatch("cache_n", row.describe(), d.program())
        hwm = proc_status(pid)["VmHWM"]
        model_peak, state_bytes = saves[0] if saves else (0, 0)
        return {
            "rss_peak_bytes": hwm - rss0,
            "model_peak_bytes": model_peak,
            "checkpoint_bytes": checkpoint_bytes,
            "state_bytes": state_bytes,
            "n_checkpoints": len(d.model.prompt_cache.states[-1].prompt.checkpoints) if d.model.prompt_cache else 0,
        }


def _log_text(d: Differential) -> str:
    return d.server.log_path.read_text(errors="replace") if d.server.log_path else ""


@dataclass
class FaultTrial:
    """One native fault in a real server's save, as seen and as the model predicted it.

    ``observed`` is how the request ended (``skipped``, ``crash``, ``completed``, ``wrong-after-skip``) and
    ``seen`` what the shim saw: where the allocation that failed was made, from the call stack it wrote at
    that moment, and a fatal signal's own stack (:mod:`faults.sites`); ``how`` is how the server took it.
    The trial agrees with the model only when the outcome and the site agree
    (:data:`harness.model.sites.SITES` maps the model's site names to the upstream functions).
    """

    build: str  # which llama-server: pr, master, or the user's tree/binary
    nth: int
    predicted: str  # "skipped" (bad_alloc caught, no entry), "crash" (bad_alloc escapes), "completed"
    predicted_site: str  # the model's site name (alloc.state_tgt, ckpt_copy.tgt, ...), "-": none fails
    observed: str
    detail: str = ""
    seen: Observation = field(default_factory=Observation)
    how: str = ""  # how the server took the fault: "... SIGABRT in ...; terminate called after ...", "caught: ..."

    @property
    def observed_site(self) -> str:
        """``file:function`` or ``library:function`` of the failed allocation (``-``: none failed)."""
        return self.seen.fault()

    @property
    def site_agrees(self) -> bool:
        return self.seen.agrees_with(self.predicted_site)

    @property
    def ok(self) -> bool:
        return self.predicted == self.observed and self.site_agrees

    def predicted_where(self) -> str:
        """``ckpt_copy.tgt`` with the upstream function it mirrors and its line at 0c1e570."""
        up = upstream(self.predicted_site)
        return self.predicted_site if up is None else f"{self.predicted_site} ({up.function}, {up.where})"

    def message(self) -> str:
        """``observed: <site> (<how it died>); model predicted: <outcome> at <site>``."""
        return (
            f"observed: {self.observed_site} ({self.observed}: {self.how}); "
            f"model predicted: {self.predicted} at {self.predicted_where()}"
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "build": self.build,
            "nth": self.nth,
            "predicted": self.predicted,
            "predicted_site": self.predicted_site,
            "observed": self.observed,
            "observed_site": self.observed_site,
            "site_agrees": self.site_agrees,
            "ok": self.ok,
            "how": self.how,
            "detail": self.detail,
            "message": self.message(),
            "died_of": self.seen.signal,
            "died_in": None if self.seen.died_at is None else str(self.seen.died_at),
            "stack": self.seen.frames,
        }


def save_fault(
    binary: Path, label: str, semantics: str, nth: int, *, n_extend: int = 3, log_dir: str | None = None
) -> FaultTrial:
    """Fail the ``nth`` large (>= 512 KiB) native allocation of the request that saves a slot to the cache.

    The native shim is preloaded into the server and armed through ``FAULTSHIM_ARM_FILE`` and SIGUSR2
    right before the request (:class:`~faults.native.RemoteShim`); the model's seam is armed the same way
    (``min_size``) for the same request and predicts where it must end: ``skipped`` (the save's bad_alloc
    handler caught it), ``crash`` (std::bad_alloc escaped: the server dies) or ``completed`` (fewer large
    allocations), and at which of its sites. Where the server's allocation failed is read from the stack
    the shim wrote when it failed it. After a ``skipped`` save the server must keep serving: a later
    request is checked too.
    """
    min_size = 512 * 1024
    with tempfile.TemporaryDirectory(prefix="save-fault-") as tmp:
        shim = RemoteShim(tmp)
        with Differential(_big_cfg(), binary, semantics, log_dir, env=shim.env()) as d:
            _build_up(d, n_extend)
            # the real server, armed right before the request
            pid = d.server.pid
            shim.arm(pid, nth, min_size=min_size)
            generated: tuple[int, ...] = ()
            try:
                r = d.server.completion(DIVERGING, 1, ignore_eos=True, return_tokens=True)
                generated = tuple(int(t) for t in r.get("tokens") or ())
                answered = True
            except RequestFailed:
                answered = False
            if not answered:  # a dying server closes the connection first: let it finish dying
                deadline = time.monotonic() + 10
                while d.server.running() and time.monotonic() < deadline:
                    time.sleep(0.05)
            alive = d.server.running()
            if alive:
                shim.disarm(pid)
            seen = shim.observe(modules_beside(binary))
            # the model's prediction, on the same request with the seam armed the same way
            m = d.model
            m.host.seam.arm(nth, min_size=min_size)
            try:
                res = m.handle_completion(tuple(DIVERGING), n_predict=1, forced=generated)
                m.run_until_idle()
                fired = list(m.host.seam.fired_sites)
                predicted = "skipped" if fired else "completed"
            except BadAlloc as e:
                predicted, fired, res = "crash", [e.site], None
            finally:
                m.host.seam.disarm()
            site = fired[0] if fired else "-"
            log = _log_text(d)
            if not alive or not answered:
                observed = "crash"
            elif "failed to allocate memory for prompt cache state" in log:
                observed = "skipped"
            else:
                observed = "completed"
            detail = f"server {'alive' if alive else 'dead'}, request {'answered' if answered else 'failed'}"
            how = _how(observed, seen, log)
            if not alive and d.server.proc is not None and d.server.proc.returncode is not None:
                rc = d.server.proc.returncode
                detail += f" (exit {rc}{' = SIGABRT' if rc == -signal.SIGABRT else ''})"
                if terminated := _terminate(_log_text(d)):
                    detail += ": " + terminated
            if observed == "skipped" and res is not None:
                # it keeps serving, and what it serves still equals a fresh server's
                later = d.request([3 + (i * 7) % 250 for i in range(600)] + [11, 12, 13], 2)
                detail += f"; a later request: {later.describe()}"
                if not later.ok:
                    observed = "wrong-after-skip"
            return FaultTrial(label, nth, predicted, site, observed, detail, seen, how)


def _terminate(log: str) -> str:
    """``terminate called after throwing an instance of 'std::bad_alloc'`` from a server's log, whose other
    threads may write into the middle of that line (then libstdc++'s ``what():`` line names it), or a
    ``GGML_ASSERT``/``GGML_ABORT`` line; "" when the log says neither."""
    if "terminate called after throwing an instance of" in log:
        tail = log[log.index("terminate called after throwing an instance of") :]
        m = re.search(r"instance of '([\w:<>, ]+)'", tail)
        w = re.search(r"^\s*what\(\):\s*(.+)$", tail, re.M)
        name = m[1] if m else (w[1].strip() if w else "?")
        return f"terminate called after throwing an instance of '{name}'"
    return next((ln.strip() for ln in log.splitlines() if "GGML_ASSERT" in ln or "GGML_ABORT" in ln), "")


def _how(observed: str, seen: Observation, log: str) -> str:
    """How the server took the fault, in a few words: the allocation, then what became of it."""
    what = seen.describe()
    if observed == "crash":
        line = _terminate(log)
        return what + (f"; {line}" if line else "; the server died")
    if observed == "skipped":
        return what + "; caught: the save was skipped (failed to allocate memory for prompt cache state)"
    return what + ("; the request completed" if observed == "completed" else "; a later request went wrong")


def memory_and_faults(
    report: Any,
    section: dict[str, Any],
    label: str,
    semantics: str,
    binary: Path,
    logs: str,
    fail: Callable[[str, str, str, str, str], None],
    out: Callable[[str], None],
    other: tuple[str, Path, str] | None = None,
) -> Counter[str]:
    """VmHWM around a save with ~16 MiB of checkpoints, and native faults during a save. ``other`` (label,
    binary, semantics) is measured beside it; by default the pinned build of the other semantics, if built. The
    checks it made, by property (the server backend's table counts them)."""
    mem = save_peak(binary, semantics, log_dir=logs)
    section["rss_peak_bytes"] = mem["rss_peak_bytes"]
    section["memory"] = {label: mem}
    if other is None:
        other_sem = "shared" if semantics == "master" else "master"
        other_bin = cached_binary(other_sem)
        other = None if other_bin is None else (build_name(other_sem), other_bin, other_sem)
    if other is not None:
        section["memory"][other[0]] = save_peak(other[1], other[2], log_dir=logs)
    m = section["memory"]
    line = (
        f"  save with {mem['n_checkpoints']} checkpoints (C = {mem['checkpoint_bytes']} B, "
        f"S = {mem['state_bytes']} B): "
        + ", ".join(f"{k} RSS peak {v['rss_peak_bytes']} B (model {v['model_peak_bytes']} B)" for k, v in m.items())
    )
    if other is not None and {semantics, other[2]} == {"shared", "master"}:
        pr_key, master_key = (label, other[0]) if semantics == "shared" else (other[0], label)
        if m[pr_key]["rss_peak_bytes"] > 0:
            ratio = m[master_key]["rss_peak_bytes"] / m[pr_key]["rss_peak_bytes"]
            section["rss_ratio_master_over_pr"] = round(ratio, 2)
            line += f"; master/pr = {section['rss_ratio_master_over_pr']}"
    out(line)
    bound = mem["state_bytes"] + mem["checkpoint_bytes"] // 2
    checked: Counter[str] = Counter({"transient_peak": 1})
    if mem["rss_peak_bytes"] > bound:
        fail(
            "transient_peak",
            "violation",
            f"llama-server {label}: RSS high-water mark of one save {mem['rss_peak_bytes']} B > S + C/2 = {bound} B "
            f"(the model predicts {mem['model_peak_bytes']} B)"
            + ("; PR #27451: master deep-copies the checkpoints on insert" if semantics == "master" else ""),
            "",
            "server-memory",
        )
    checked += fault_trials(report, section, label, semantics, binary, logs, fail, out)
    return checked + gate_check(section, label, semantics, binary, logs, fail, out)


def fault_trials(
    report: Any,
    section: dict[str, Any],
    label: str,
    semantics: str,
    binary: Path,
    logs: str,
    fail: Callable[[str, str, str, str, str], None],
    out: Callable[[str], None],
) -> Counter[str]:
    """Native faults: the nth large allocation of the request that saves the slot, for n = 1, 2, 3."""
    out_of_scope: list[str] = []
    checked: Counter[str] = Counter()
    for nth in (1, 2, 3):
        t = save_fault(binary, label, semantics, nth, log_dir=logs)
        checked.update(("native_fault", "no_partial_entries"))
        section["fault_trials"] += 1
        section["server_crashes"] += t.observed == "crash"
        section.setdefault("faults", []).append(t.to_json())
        status = "ok  " if t.ok else "FAIL"
        out(f"  [{status}] fault: large allocation #{nth} of a save -> {t.message()} [{t.detail}]")
        if not t.ok:
            fail("native_fault", "violation", f"llama-server {label} nth={nth}: {t.message()}", "",
                 "server-faults")  # fmt: skip
        elif t.observed == "crash" and t.predicted_site.startswith("ckpt."):
            out_of_scope.append(f"{label} nth={nth}: {t.message()}")
        elif t.observed == "crash" and t.predicted_site.startswith("ckpt_copy"):
            fail(
                "no_partial_entries",
                "crash",
                f"llama-server {label}: std::bad_alloc in the checkpoint deep copy escapes server_prompt_cache::alloc "
                f"and terminates the server (PR #27451: the try must cover the whole entry construction); "
                f"{t.message()} [{t.detail}]",
                "",
                "server-faults",
            )
    report.known.append(
        KnownRow(
            CHECKPOINT_ALLOC_TERMINATES,
            f"llama-server {label}, native faults",
            "reproduced" if out_of_scope else "not-reproduced",
            count=len(out_of_scope),
            message="; ".join(out_of_scope) if out_of_scope else None,
        )
    )
    return checked
