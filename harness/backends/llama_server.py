"""The gate's ``server`` backend: a real ``llama-server`` against the reference model, request by request.

:class:`Differential` starts one ``llama-server`` (:class:`harness.targets.llama_server.ServerProcess`, on
127.0.0.1) and one reference model on real libllama contexts of the same tiny model with the same
parameters (:func:`harness.targets.libllama.make_llama_server`). Each completion request (token ids,
temperature 0, ``cache_prompt``, ``ignore_eos``, ``return_tokens``) goes to the server first; the
model is then fed the same request with the tokens the server generated (``Task.forced``), picks
its own slot, and predicts the slot, ``timings.cache_n`` (prompt tokens reused from the slot, a
cache load or a checkpoint) and the evictions the server logs. Any difference is a mismatch,
reported with the request sequence as a script that replays it.

What :func:`run_server_backend` runs (``python -m harness gate --backend server --flavour F``):

* :func:`server_machine`: Hypothesis drives prompts that share, extend and diverge from what the
  slots and the cache hold, on all five models, unified and per-slot KV, and with a draft model;
  every generation is also compared with a fresh single-slot server without cache
  (:func:`check_output`).
* :func:`eviction` (``--cache-ram 1``, entries with shared checkpoints) and :func:`full_context`.
* :func:`save_peak`: VmHWM around one save of a slot with ~16 MiB of checkpoints (``mamba-big``),
  beside the model's predicted transient peak, and master against pr when both are built.
* :func:`save_fault`: the native shim preloaded into the server fails the Nth large allocation of
  the request that saves the slot; the model, armed the same way, predicts where it must end.
* The ``asan`` flavour runs the differential and fails on any ASan/UBSan report in the logs.

Deviations: requests are sent one at a time (a request completes before the next), so the
server's slot scheduling is deterministic; child tasks (``n_cmpl``) are not used; a failing
example is not shrunk (each step is a real request), the full request sequence is printed instead.

Size: the server backend's scenarios (the differential machine, eviction, full context, the save's RSS peak
and its native faults) all drive one :class:`Differential` and read the same server logs, so they live with
it; ``server_machine`` builds the Hypothesis machine class over that state and ``run_server_backend`` runs the
phases in order and files each row. The next split is ``save_peak``/``save_fault`` into a faults module of
their own.
"""

from __future__ import annotations

import itertools
import os
import tempfile
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from faults.native import build_shim
from fixtures.models import draft_path, model_path
from harness.backends.base import Backend, Failure, GateOptions, GateReport, MachineResult, Out
from harness.errors import BadAlloc, PropertyFailure, ServerStartError, UsageError
from harness.model.server_context import ServerParams
from harness.targets.libllama import close_server, make_llama_server
from harness.targets.llama_build import (
    PINNED_COMMIT,
    BuildError,
    ServerBuild,
    cached_binary,
    pinned_status,
    server_build,
)
from harness.targets.llama_server import ServerProcess, proc_status
from properties.machine import MachineConfig
from properties.run import run_seeded

__all__ = ["Differential", "Row", "ServerBackend", "ServerConfig", "run_server_backend"]


@dataclass(frozen=True)
class ServerConfig:
    """One server configuration: the model and the flags that matter to the prompt cache."""

    arch: str
    n_parallel: int = 2
    kv_unified: bool = False
    cache_ram_mib: int = 1
    ctx_checkpoints: int = 4
    checkpoint_min_step: int = 64
    n_ctx: int = 2048
    n_batch: int = 256
    n_ubatch: int = 64
    draft: bool = False
    log_verbosity: int | None = None  # ``-lv``: 4 logs the prompt cache's trace lines (server-task.cpp:1799)

    @property
    def name(self) -> str:
        parts = [self.arch, f"np{self.n_parallel}", "kvu" if self.kv_unified else "kvs"]
        if self.draft:
            parts.append("draft")
        return "-".join(parts)

    def server_args(self) -> list[str]:
        return [
            "-cms",
            str(self.checkpoint_min_step),
            "-b",
            str(self.n_batch),
            "-ub",
            str(self.n_ubatch),
            "--no-warmup",
            *(() if self.log_verbosity is None else ("-lv", str(self.log_verbosity))),
        ]

    def params(self) -> ServerParams:
        return ServerParams(
            n_slots=self.n_parallel,
            cache_ram=self.cache_ram_mib,
            cache_ram_unit=1 << 20,
            n_ctx_checkpoints=self.ctx_checkpoints,
            checkpoint_min_step=self.checkpoint_min_step,
            kv_unified=self.kv_unified,
            n_batch=self.n_batch,
            n_ubatch=self.n_ubatch,
            n_draft_max=16 if self.draft else 0,
        )


@dataclass
class Row:
    """One request and what the server and the model made of it."""

    tokens: tuple[int, ...]
    n_predict: int
    slot: int
    cache_n: int
    predicted_slot: int
    predicted_cache_n: int
    generated: tuple[int, ...]
    evictions: int = 0  # "removing oldest entry" lines in the server's log so far
    predicted_evictions: int = 0
    draft_n: int = 0  # tokens the server's draft model proposed (timings.draft_n)

    @property
    def ok(self) -> bool:
        return (self.slot, self.cache_n, self.evictions) == (
            self.predicted_slot,
            self.predicted_cache_n,
            self.predicted_evictions,
        )

    def describe(self) -> str:
        return (
            f"prompt of {len(self.tokens)} tokens (…{list(self.tokens[-4:])}): server slot {self.slot} cache_n "
            f"{self.cache_n} evictions {self.evictions}, model slot {self.predicted_slot} cache_n "
            f"{self.predicted_cache_n} evictions {self.predicted_evictions}"
        )


@dataclass
class Differential:
    """A live server and the reference model, fed the same requests."""

    cfg: ServerConfig
    binary: Path
    semantics: str = "shared"
    log_dir: str | None = None
    rows: list[Row] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    binary_expr: str = "build_server('pr')"  # only for the replay program: how to get the binary again
    _sent: int = field(default=0, init=False, repr=False)  # requests answered: the log's releases to wait for

    def __post_init__(self) -> None:
        self.model_file = model_path(self.cfg.arch)
        self.server = ServerProcess(
            self.binary,
            self.cfg.server_args(),
            model=self.model_file,
            draft=draft_path() if self.cfg.draft else None,
            n_parallel=self.cfg.n_parallel,
            ctx_size=self.cfg.n_ctx,
            cache_ram=self.cfg.cache_ram_mib,
            ctx_checkpoints=self.cfg.ctx_checkpoints,
            kv_unified=self.cfg.kv_unified,
            log_path=None if self.log_dir is None else _unique_log(self.log_dir, self.cfg.name),
            env=self.env,
        )
        self.model = make_llama_server(
            self.semantics,
            self.model_file,
            draft_model=draft_path() if self.cfg.draft else None,
            params=self.cfg.params(),
            n_ctx=self.cfg.n_ctx,
            check_restores=False,
        )

    def __enter__(self) -> Differential:
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.server.stop()
        finally:
            close_server(self.model)

    def request(self, tokens: Sequence[int], n_predict: int) -> Row:
        toks = tuple(int(t) for t in tokens)
        r = self.server.completion(list(toks), n_predict, ignore_eos=True, return_tokens=True)
        slot = int(r["id_slot"])
        cache_n = int(r["timings"]["cache_n"])
        generated = tuple(int(t) for t in r.get("tokens") or ())
        res = self.model.handle_completion(toks, n_predict=n_predict, forced=generated)
        self.model.run_until_idle()
        predicted_slot = res.slot
        predicted = self.model.slots[predicted_slot].n_prompt_cached if predicted_slot >= 0 else -1
        self._sent += 1
        log = self.server.log_through(self._sent)  # written by a worker thread: wait for this release
        cache = self.model.prompt_cache
        row = Row(
            toks,
            n_predict,
            slot,
            cache_n,
            predicted_slot,
            predicted,
            generated,
            log.count("removing oldest entry"),
            cache.evictions if cache is not None else 0,
            int(r["timings"].get("draft_n", 0)),
        )
        self.rows.append(row)
        return row

    def program(self) -> str:
        """The request sequence so far, as a script that replays it against the same configuration."""
        lines = [
            "from pathlib import Path",
            "from harness.targets.llama_build import build_server, build_source",
            "from harness.backends.llama_server import Differential, ServerConfig",
            f"with Differential({self.cfg!r}, {self.binary_expr}, {self.semantics!r}) as d:",
        ]
        for row in self.rows:
            lines.append(f"    print(d.request({list(row.tokens)!r}, {row.n_predict}).describe())")
        return "\n".join(lines)


NEAR_TIE_LOGPROB = 0.02  # greedy choices closer than this flip with the cache path's rounding


def check_output(fresh: ServerProcess, row: Row) -> str | None:
    """Compare a completion with a fresh server's; None if equal, "near-tie", or what differs.

    A prompt served partly from a slot, a cache entry or a checkpoint is evaluated in other batch
    shapes and cell layouts than from scratch, which moves logits in the last bits (the finding
    ``kv-layout-dependent-logits`` and its batch-shape twin). Where the fresh server's two best
    tokens are within :data:`NEAR_TIE_LOGPROB` and the cached path took the second, the greedy
    choice flipped on a tie: ``"near-tie"`` (the known finding ``greedy-flip-on-cache-path``).
    """
    r = fresh.completion(list(row.tokens), row.n_predict, ignore_eos=True, return_tokens=True, cache_prompt=False,
                         n_probs=2)  # fmt: skip
    want = tuple(int(t) for t in r.get("tokens") or ())
    if want == row.generated:
        return None
    i = next((k for k, (a, b) in enumerate(zip(want, row.generated, strict=False)) if a != b), None)
    probs = r.get("completion_probabilities") or []
    # the server withholds the entries of tokens that end inside a UTF-8 sequence: align by id
    ids = [int(p["id"]) for p in probs]
    offset = next((o for o in range(len(want) - len(ids) + 1) if list(want[o : o + len(ids)]) == ids), None)
    if i is not None and offset is not None and 0 <= i - offset < len(probs):
        top = probs[i - offset].get("top_logprobs") or []
        if len(top) >= 2 and int(top[1]["id"]) == row.generated[i]:
            gap = float(top[0]["logprob"]) - float(top[1]["logprob"])
            if gap < NEAR_TIE_LOGPROB:
                return "near-tie"
    return f"{row.describe()}: generated {list(row.generated)}, a fresh server generates {list(want)}"


class ServerMismatch(PropertyFailure):
    """The server and the model disagree; ``name`` is the property, ``program`` replays it."""

    def __init__(self, name: str, message: str, program: str) -> None:
        super().__init__(name, message)
        self.program = program


@dataclass
class MachineStats:
    requests: int = 0
    cache_hits: int = 0  # cache_n > 0
    output_checks: int = 0
    evictions: int = 0  # predicted by the model and seen in the server's log, request by request
    cache_loads: int = 0
    near_tie_flips: int = 0  # the known finding greedy-flip-on-cache-path
    drafted: int = 0  # draft tokens the server proposed (speculative configurations)


def server_machine(
    cfg: ServerConfig,
    binary: Path,
    semantics: str,
    stats: MachineStats,
    log_dir: str | None,
    binary_expr: str = "build_server('pr')",
) -> type:
    """A Hypothesis state machine class driving ``cfg`` on ``binary`` against the model in ``semantics``."""

    class ServerMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.d = Differential(cfg, binary, semantics, log_dir, binary_expr=binary_expr)
            self.d.__enter__()
            self.fresh = ServerProcess(
                binary,
                cfg.server_args(),
                model=model_path(cfg.arch),
                n_parallel=1,
                ctx_size=cfg.n_ctx,
                cache_ram=0,
                ctx_checkpoints=cfg.ctx_checkpoints,
                log_path=None if log_dir is None else _unique_log(log_dir, f"{cfg.name}-fresh"),
            )
            self.fresh.start()
            self.sent: list[tuple[int, ...]] = []

        def teardown(self) -> None:
            cache = self.d.model.prompt_cache
            if cache is not None:
                stats.evictions += cache.evictions
                stats.cache_loads += cache.loads
            try:
                self.fresh.stop()
            finally:
                self.d.close()

        def _bases(self) -> list[tuple[int, ...]]:
            m = self.d.model
            out = [s.prompt.tokens for s in m.slots]
            if m.prompt_cache is not None:
                out += [e.prompt.tokens for e in m.prompt_cache.states]
            return out + self.sent

        @rule(
            source=st.integers(0, 7),
            keep=st.integers(0, 24),
            n_new=st.sampled_from([0, 1, 8, 40, 120, 300, 700]),
            seed=st.integers(0, 255),
            n_predict=st.integers(1, 6),
        )
        def request(self, source: int, keep: int, n_new: int, seed: int, n_predict: int) -> None:
            """A prompt: 0-100 % (in 24ths) of a slot's, a cache entry's or an earlier prompt, then new tokens."""
            bases = self._bases()
            base = bases[source % len(bases)] if bases else ()
            head = base[: len(base) * keep // 24]
            new = tuple(3 + (seed * 31 + i * 17) % 256 for i in range(n_new))
            tokens = (head + new)[-(cfg.n_ctx // cfg.n_parallel - 16) :] or (1,)
            row = self.d.request(tokens, n_predict)
            self.sent.append(tokens)
            stats.requests += 1
            stats.cache_hits += row.cache_n > 0
            stats.drafted += row.draft_n
            if not row.ok:
                raise ServerMismatch("cache_n", row.describe(), self.d.program())
            problem = check_output(self.fresh, row)
            stats.output_checks += 1
            if problem == "near-tie":
                stats.near_tie_flips += 1
            elif problem is not None:
                raise ServerMismatch("output", problem, self.d.program())

        @precondition(lambda self: len(self.sent) > 0)
        @rule(i=st.integers(0, 50))
        def repeat(self, i: int) -> None:
            """Send an earlier prompt again (a cache hit or a slot hit)."""
            tokens = self.sent[i % len(self.sent)]
            row = self.d.request(tokens, 2)
            stats.requests += 1
            stats.cache_hits += row.cache_n > 0
            if not row.ok:
                raise ServerMismatch("cache_n", row.describe(), self.d.program())

    ServerMachine.__name__ = f"Server_{cfg.name.replace('-', '_')}"
    return ServerMachine


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
    build: str  # which llama-server: pr, master, or the user's tree/binary
    nth: int
    predicted: str  # "skipped" (bad_alloc caught, no entry), "crash" (bad_alloc escapes), "completed"
    predicted_site: str
    observed: str
    detail: str = ""

    @property
    def ok(self) -> bool:
        return self.predicted == self.observed


def save_fault(
    binary: Path, label: str, semantics: str, nth: int, *, n_extend: int = 3, log_dir: str | None = None
) -> FaultTrial:
    """Fail the ``nth`` large (>= 512 KiB) native allocation of the request that saves a slot to the cache.

    The native shim is preloaded into the server and armed through ``FAULTSHIM_ARM_FILE`` and SIGUSR2
    right before the request; the model's seam is armed the same way (``min_size``) for the same
    request and predicts where it must end: ``skipped`` (the save's bad_alloc handler caught it),
    ``crash`` (std::bad_alloc escaped: the server dies) or ``completed`` (fewer large allocations).
    After a ``skipped`` save the server must keep serving: a later request is checked too.
    """
    import signal
    import tempfile
    import urllib.error

    min_size = 512 * 1024
    with tempfile.TemporaryDirectory(prefix="save-fault-") as tmp:
        arm = os.path.join(tmp, "arm")
        env = {
            "LD_PRELOAD": str(build_shim()),
            "FAULTSHIM_ARM_FILE": arm,
            "FAULTS_STACKS": os.path.join(tmp, "st"),
            "GGML_NO_BACKTRACE": "1",  # ggml would attach gdb to the dying server: seconds per crash
        }
        with Differential(_big_cfg(), binary, semantics, log_dir, env=env) as d:
            _build_up(d, n_extend)
            # the real server, armed right before the request
            with open(arm, "w") as f:
                f.write(f"{nth} 0 {min_size}\n")
            pid = d.server.pid
            os.kill(pid, signal.SIGUSR2)
            generated: tuple[int, ...] = ()
            try:
                r = d.server.completion(DIVERGING, 1, ignore_eos=True, return_tokens=True)
                generated = tuple(int(t) for t in r.get("tokens") or ())
                answered = True
            except (urllib.error.URLError, ConnectionError, OSError):
                answered = False
            if not answered:  # a dying server closes the connection first: let it finish dying
                deadline = time.monotonic() + 10
                while d.server.running() and time.monotonic() < deadline:
                    time.sleep(0.05)
            alive = d.server.running()
            if alive:
                with open(arm, "w") as f:
                    f.write("0 0 0\n")
                os.kill(pid, signal.SIGUSR2)
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
            if not alive and d.server.proc is not None and d.server.proc.returncode is not None:
                rc = d.server.proc.returncode
                detail += f" (exit {rc}{' = SIGABRT' if rc == -signal.SIGABRT else ''})"
                if "terminate called after throwing" in (log := _log_text(d)):
                    detail += ": " + log[log.index("terminate called after throwing") :].splitlines()[0]
            if observed == "skipped" and res is not None:
                # it keeps serving, and what it serves still equals a fresh server's
                later = d.request([3 + (i * 7) % 250 for i in range(600)] + [11, 12, 13], 2)
                detail += f"; a later request: {later.describe()}"
                if not later.ok:
                    observed = "wrong-after-skip"
            return FaultTrial(label, nth, predicted, site, observed, detail)


SERVER_PROFILES: dict[str, dict[str, int]] = {
    "ci": {"max_examples": 12, "steps": 10},
    "fuzz": {"max_examples": 100, "steps": 25},
}


def server_configs() -> list[ServerConfig]:
    """The differential's configurations: every memory kind, unified and per-slot KV."""
    return [
        ServerConfig("llama"),
        ServerConfig("jamba", kv_unified=True),
        ServerConfig("mamba"),
        ServerConfig("lfm2", kv_unified=True),
        ServerConfig("gemma2"),
        # speculative: target + draft restored together from the cache and from checkpoints
        ServerConfig("llama", draft=True),
        ServerConfig("jamba", draft=True, kv_unified=True),
    ]


def full_context(binary: Path, semantics: str, log_dir: str | None) -> list[Row]:
    """One slot at the model's full context (1024): a prompt that fills it, reused, then diverging."""
    cfg = ServerConfig("jamba", n_parallel=1, n_ctx=1024, cache_ram_mib=8)
    a = [3 + (i * 7) % 250 for i in range(1016)]
    b = [3 + (i * 5) % 250 for i in range(900)]
    with Differential(cfg, binary, semantics, log_dir) as d:
        for toks in (a, [*a[:1000], 9, 9, 9, 9, 9, 9], b, a[:1010]):
            row = d.request(toks, 2)
            if not row.ok:
                raise ServerMismatch("cache_n", row.describe(), d.program())
        return d.rows


def eviction(binary: Path, semantics: str, log_dir: str | None) -> list[Row]:
    """Evictions under --cache-ram 1 with checkpoint storage shared between slots and entries (jamba).

    Eight distinct 900-token prompts through two slots overflow the 1 MiB cache several times;
    then the first and the last ones come back (an evicted entry: a miss; a surviving one: a
    load with its checkpoints). The model must predict every slot, ``cache_n`` and eviction.
    """
    cfg = ServerConfig("jamba", cache_ram_mib=1, ctx_checkpoints=4)
    prompts = [[3 + (k * 29 + i * 7) % 250 for i in range(900)] for k in range(8)]
    with Differential(cfg, binary, semantics, log_dir) as d:
        for toks in (*prompts, prompts[0] + [9, 9], prompts[-1] + [9, 9], prompts[-3] + [8] * 10):
            row = d.request(toks, 2)
            if not row.ok:
                raise ServerMismatch("cache_n", row.describe(), d.program())
        return d.rows


_LOG_SEQ = itertools.count()


def _unique_log(log_dir: str, stem: str) -> str:
    """One log file per server started (a server's log is scanned for sanitizer reports after it exits)."""
    return os.path.join(log_dir, f"{stem}-{next(_LOG_SEQ):05d}.log")


SANITIZER_MARKERS = ("ERROR: AddressSanitizer", "ERROR: LeakSanitizer", "runtime error:")


def sanitizer_reports(log_dir: str) -> list[str]:
    """The first line of every ASan, LSan or UBSan report in the server logs under ``log_dir``."""
    reports = []
    for name in sorted(os.listdir(log_dir)):
        text = Path(log_dir, name).read_text(errors="replace")
        for marker in SANITIZER_MARKERS:
            at = text.find(marker)
            while at >= 0:
                reports.append(f"{name}: {text[at:].splitlines()[0]}")
                at = text.find(marker, at + 1)
    return reports


class ServerBackend(Backend):
    name = "server"
    flags = frozenset({"asan", "source", "server_bin"})

    def run(self, report: GateReport, opts: GateOptions, out: Out) -> None:
        log = lambda m: out("  build: " + m)  # noqa: E731
        try:
            if opts.source is not None and opts.server_bin is not None:
                raise UsageError("--source and --server-bin both name the server to test; give one")
            if opts.server_bin is not None:
                if opts.asan:
                    raise UsageError("--asan builds llama-server; a --server-bin runs as built (sanitizers detected)")
                build = server_build(binary=opts.server_bin, log=log)
            elif opts.source is not None:
                build = server_build(source=opts.source, asan=opts.asan, log=log)
            else:
                if opts.asan and opts.semantics == "master":
                    raise UsageError("--asan builds the PR semantics only; drop --semantics master or --asan")
                flavour = "asan" if opts.asan else ("master" if opts.semantics == "master" else "pr")
                build = server_build(flavour=flavour, log=log)
        except BuildError as e:
            raise BuildError(f"llama-server could not be built: {e}") from None
        semantics, how = _semantics_for(build, opts)
        report.variant = semantics
        run_server_backend(report, build, semantics, opts.profile, opts.seed, opts.max_examples, out, how)


def _semantics_for(build: ServerBuild, opts: GateOptions) -> tuple[str, str]:
    """The semantics the model runs in (``--semantics`` if given, else the one the tree shows) and why."""
    if opts.semantics_given:
        how = "from --semantics"
        if build.semantics is not None and build.semantics != opts.semantics:
            how += (
                f"; note: the build's common_prompt_checkpoint looks like {build.semantics}: "
                "expect the differential to diverge"
            )
        return opts.semantics, how
    if build.semantics is None:
        what = "binary" if build.tree is None else "tree"
        raise UsageError(
            f"cannot tell the semantics of the {what} {build.label} (no common_prompt_checkpoint found): "
            "pass --semantics shared (PR #27451) or --semantics master"
        )
    how = "inferred from the tree's common_prompt_checkpoint" if build.tree is not None else "from its build-info.json"
    if build.origin.startswith("flavour "):
        how = f"the {build.label} build"
    return build.semantics, how + "; --semantics overrides"


def run_server_backend(
    report: GateReport,
    build: ServerBuild,
    semantics: str,
    profile: str,
    seed: int,
    max_examples: int | None,
    out: Out,
    how: str = "",
) -> None:
    """``gate --backend server``: differential machines, full context, memory, faults, sanitizers."""
    replay = f"python -m harness gate --backend server {build.replay_flags}"
    if not build.origin.startswith("flavour "):
        replay += f" --semantics {semantics}"
    replay += f" --profile {profile} --seed {seed}"
    label = build.label
    binary = build.binary
    out(f"gate: backend=server build={build.origin} semantics={semantics} profile={profile} seed={seed} "
        f"commit={report.commit}")  # fmt: skip
    out(f"  binary {binary}" + (" (AddressSanitizer)" if build.asan else ""))
    if how:
        out(f"  semantics {semantics}: {how}")
    pinned = build.pinned
    if build.tree is not None:
        pinned, line = pinned_status(build.tree)
        out("  " + line)
    elif not pinned:
        out(f"  the binary's source is unknown; the model is pinned to llama.cpp {PINNED_COMMIT}")
    elif not build.origin.startswith("flavour "):
        out(f"  the binary's build-info.json says it was built from llama.cpp {PINNED_COMMIT}, the pinned tree")
    if build.origin == "flavour asan" and not build.asan:
        raise UsageError(
            f"{binary} is not built with AddressSanitizer; "
            "rebuild: python -m harness build-server --flavour asan --force"
        )
    section: dict[str, Any] = {
        "flavour": label,
        "build": build.origin,
        "binary": str(binary),
        "semantics": semantics,
        "pinned": pinned,
        "requests": 0,
        "cache_n_mismatches": 0,
        "output_mismatches": 0,
        "rss_peak_bytes": None,
        "fault_trials": 0,
        "server_crashes": 0,
        "near_tie_flips": 0,
        "evictions": 0,
        "cache_loads": 0,
        "sanitizer_reports": 0,
    }
    report.extra["server"] = section

    first = True

    def fail(prop: str, kind: str, message: str, program: str, machine: str) -> None:
        nonlocal first
        if not pinned:
            message += (
                f" [the model is pinned to llama.cpp {PINNED_COMMIT} and this {'tree' if build.tree else 'binary'} "
                "is not that tree: the divergence is either your change or upstream moving on since]"
            )
            if first and program:
                out(f"  first divergence ({prop} in {machine}): {message}")
                out("  requests that replay it:\n    " + program.replace("\n", "\n    "))
        first = False
        f = Failure(prop, kind, message, program, replay, machine, program.count("d.request("))
        report.machines.append(MachineResult(MachineConfig(semantics), 0.0, f, Counter(), Counter(), []))

    sp = SERVER_PROFILES[profile]
    hs = settings(
        max_examples=max_examples or sp["max_examples"],
        stateful_step_count=sp["steps"],
        deadline=None,
        database=None,
        derandomize=False,
        suppress_health_check=list(HealthCheck),
        # each step is a real request on a real server: no shrinking; the printed program is the
        # full request sequence of the failing example, which replays as it is
        phases=[Phase.explicit, Phase.generate],
        print_blob=False,
    )
    with tempfile.TemporaryDirectory(prefix="server-gate-") as logs:
        if build.asan:
            # leaks are reported at exit, into the server's log
            os.environ.setdefault("ASAN_OPTIONS", "detect_leaks=1:abort_on_error=0")
        try:
            for cfg in server_configs():
                stats = MachineStats()
                t0 = time.perf_counter()
                cls = server_machine(cfg, binary, semantics, stats, logs, build.replay_expr)
                status = "ok  "
                try:
                    run_seeded(cls, hs, seed)
                except ServerMismatch as e:
                    status = "FAIL"
                    section["cache_n_mismatches" if e.name == "cache_n" else "output_mismatches"] += 1
                    fail(e.name, "violation", e.message, e.program, f"server-{cfg.name}")
                except ServerStartError as e:
                    status = "FAIL"
                    section["server_crashes"] += 1
                    fail("server", "crash", str(e), "", f"server-{cfg.name}")
                for k in ("requests", "near_tie_flips", "evictions", "cache_loads"):
                    section[k] += getattr(stats, k)
                checked = Counter({"cache_n": stats.requests, "output": stats.output_checks})
                report.machines.append(
                    MachineResult(MachineConfig(semantics), time.perf_counter() - t0, None, checked, Counter(), [])
                )
                out(
                    f"  [{status}] {cfg.name:<20} {stats.requests:>4} requests ({stats.cache_hits} reused a prefix, "
                    f"{stats.cache_loads} cache loads, {stats.evictions} evictions), {stats.output_checks} outputs "
                    f"checked against a fresh server"
                    + (f", {stats.drafted} draft tokens" if cfg.draft else "")
                    + f" {time.perf_counter() - t0:5.1f}s"
                )
            rows = eviction(binary, semantics, logs)
            section["requests"] += len(rows)
            section["evictions"] += rows[-1].evictions
            out(
                f"  [ok  ] eviction: jamba --cache-ram 1, {len(rows)} requests, {rows[-1].evictions} evictions "
                f"seen in the log and predicted, cache_n {[r.cache_n for r in rows[-3:]]} for the returning prompts"
            )
            rows = full_context(binary, semantics, logs)
            section["requests"] += len(rows)
            out(f"  [ok  ] full context: jamba n_ctx=1024, {len(rows)} requests, cache_n " + ", ".join(
                str(r.cache_n) for r in rows))  # fmt: skip
        except ServerMismatch as e:
            section["cache_n_mismatches"] += 1
            fail(e.name, "violation", e.message, e.program, "server-full-context")
        if not build.asan:
            _memory_and_faults(report, section, label, semantics, binary, logs, fail, out)
        reports = sanitizer_reports(logs)
        section["sanitizer_reports"] = len(reports)
        for r in reports[:5]:
            fail("sanitizer", "crash", r, "", "server-asan")
        if build.asan:
            out(f"  [{'ok  ' if not reports else 'FAIL'}] sanitizers: {len(reports)} ASan/UBSan reports in the logs")
    report.known.append(
        {
            "id": "greedy-flip-on-cache-path",
            "title": "a prompt served partly from a slot, the cache or a checkpoint is evaluated in other batch "
            "shapes and cell layouts than from scratch; where the two best tokens are within "
            f"{NEAR_TIE_LOGPROB} logprob the greedy choice can differ from a fresh server's "
            "(the same root cause as kv-layout-dependent-logits)",
            "machine": f"llama-server {label}",
            "reproducer": "fixtures/findings/kv_layout_logits.py",
            "status": "reproduced" if section["near_tie_flips"] else "not-reproduced",
            "count": section["near_tie_flips"],
        }
    )


def _memory_and_faults(
    report: Any,
    section: dict[str, Any],
    label: str,
    semantics: str,
    binary: Path,
    logs: str,
    fail: Callable[[str, str, str, str, str], None],
    out: Callable[[str], None],
) -> None:
    """VmHWM around a save with ~16 MiB of checkpoints, and native faults during a save."""
    mem = save_peak(binary, semantics, log_dir=logs)
    section["rss_peak_bytes"] = mem["rss_peak_bytes"]
    section["memory"] = {label: mem}
    other = "pr" if semantics == "master" else "master"  # the pinned build of the other semantics, if built
    other_bin = cached_binary(other)
    if other_bin is not None:
        section["memory"][other] = save_peak(other_bin, "master" if other == "master" else "shared", log_dir=logs)
    m = section["memory"]
    line = (
        f"  save with {mem['n_checkpoints']} checkpoints (C = {mem['checkpoint_bytes']} B, "
        f"S = {mem['state_bytes']} B): "
        + ", ".join(f"{k} RSS peak {v['rss_peak_bytes']} B (model {v['model_peak_bytes']} B)" for k, v in m.items())
    )
    pr_key, master_key = (label, other) if semantics == "shared" else (other, label)
    if master_key in m and pr_key in m and m[pr_key]["rss_peak_bytes"] > 0:
        section["rss_ratio_master_over_pr"] = round(m[master_key]["rss_peak_bytes"] / m[pr_key]["rss_peak_bytes"], 2)
        line += f"; master/pr = {section['rss_ratio_master_over_pr']}"
    out(line)
    bound = mem["state_bytes"] + mem["checkpoint_bytes"] // 2
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
    # native faults: the nth large allocation of the request that saves the slot
    out_of_scope: list[str] = []
    for nth in (1, 2, 3):
        t = save_fault(binary, label, semantics, nth, log_dir=logs)
        section["fault_trials"] += 1
        section["server_crashes"] += t.observed == "crash"
        section.setdefault("faults", []).append(t.__dict__)
        status = "ok  " if t.ok else "FAIL"
        out(
            f"  [{status}] fault: large allocation #{nth} of a save -> model {t.predicted} at {t.predicted_site}, "
            f"server {t.observed} ({t.detail})"
        )
        if not t.ok:
            fail("native_fault", "violation", f"{label} nth={nth}: model {t.predicted}, server {t.observed}", "",
                 "server-faults")  # fmt: skip
        elif t.observed == "crash" and t.predicted_site.startswith("ckpt."):
            out_of_scope.append(f"{label} nth={nth} at {t.predicted_site}")
        elif t.observed == "crash" and t.predicted_site.startswith("ckpt_copy"):
            fail(
                "no_partial_entries",
                "crash",
                f"llama-server {label}: std::bad_alloc in the checkpoint deep copy at {t.predicted_site} escapes "
                "server_prompt_cache::alloc and terminates the server (PR #27451: the try must cover the whole entry "
                f"construction) [{t.detail}]",
                "",
                "server-faults",
            )
    report.known.append(
        {
            "id": "checkpoint-alloc-terminates",
            "title": "a std::bad_alloc while creating a context checkpoint (common_prompt_checkpoint::update_tgt, "
            "outside any try in update_slots) terminates llama-server, with or without PR #27451 (out of its scope)",
            "machine": f"llama-server {label}, native faults",
            "status": "reproduced" if out_of_scope else "not-reproduced",
            "count": len(out_of_scope),
            **({"message": "; ".join(out_of_scope)} if out_of_scope else {}),
        }
    )
