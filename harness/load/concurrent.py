"""The concurrent differential: K clients against one ``llama-server``, the model fed the server's order.

The server's slot scheduling under overlapping requests is not predictable from the requests alone
(it depends on when each HTTP request reaches the main loop), so the model does not guess it: it
replays the order the server took, read from the server's log (:mod:`harness.load.order`), and
must then predict every response's slot and ``timings.cache_n``:

* a ``select`` line followed by the ``launch`` of task T is one :meth:`ServerContext.handle_completion`
  of the request T answered (matched by slot, prompt length and tokens decoded); the model must
  launch it on the same slot;
* a ``select`` by id with no launch is a request naming a busy slot: upstream still runs the cache
  update on that slot (``get_available_slot``, server-context.cpp:1532-1633) and defers the task
  (:2391); the ``save`` line gives the busy slot's length at that moment, the model's slot is
  stepped to that length first, then the model handles the same request (and defers it too); which
  of several requests waiting for that slot it is, the cache lookup logged after it says
  (:func:`~harness.load.order_replay.deferred_request`), and a cached prompt the server took into the
  busy slot ("found better prompt") must be one the model takes too (else a ``cache_load`` mismatch,
  before any busy-slot-by-id);
* a ``release`` of task T steps the model's slot to the end of its task; its ``n_prompt_cached``
  must equal the response's ``cache_n``.

Each slot is stepped on its own (:func:`~harness.load.order_replay.step_slot`, one ``update_slots``
iteration restricted to one slot): the cache is touched only when a task arrives, so the slots' relative
progress between two arrivals does not matter, except for a busy slot named by id, which the ``save`` line pins.
With ``-b`` equal to ``-c`` a slot's prompt is cut only at the near-end checkpoint positions, as in
the model, so checkpoints land where the model puts them however the server packs its batches.

Every response's tokens are also compared with a fresh single-slot server without cache
(:func:`harness.backends.llama_server.check_output`). A response whose slot the model saw loaded or
cleared while it was processing (a busy slot named by id) is the known finding ``busy-slot-by-id``
when its output differs; a greedy flip within the model's :data:`~harness.findings.BATCH_SHAPE_FLIP_GAP` is
``concurrent-output-divergence`` or ``greedy-flip-on-cache-path`` (:class:`~harness.load.outputs.Divergences`,
on every model); any other difference is a mismatch and prints the timed request trace that replays
it (:func:`replay`) and, when the server ran under the libllama trace (``traces``), the trace file
and the lines that replay and shrink it.

The walk of the server's log that feeds the model is :mod:`harness.load.order_replay`; this module
runs the traces and judges every response.
"""

from __future__ import annotations

import random
import tempfile
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from pathlib import Path

from fixtures.gguf import model_path
from harness.backends.llama_server.probe import ensure_form
from harness.findings import CONCURRENT_OUTPUT_DIVERGENCE, GREEDY_FLIP_ON_CACHE_PATH
from harness.load.clients import BUSY, EMBED, Req, Sent, replay_program, run_clients
from harness.load.order import parse_log
from harness.load.order_replay import Check, ConcurrentResult, Unmodellable, replay_order
from harness.load.outputs import Divergences, compare_output
from harness.load.overlap import RssWatch, bound_violations, embedding_config, embedding_reqs
from harness.load.stateless import server_args
from harness.load.traced import ServerTrace
from harness.targets.libllama import close_server, make_llama_server
from harness.targets.llama_server import Launch, ServerConfig, ServerProcess, Timeouts
from harness.targets.server_log import busy_slot_touches
from harness.trees.switches import switches_of_binary

__all__ = [
    "ConcurrentResult",
    "attach_trace",
    "concurrent_configs",
    "fresh_server",
    "judge",
    "load_config",
    "replay",
    "run_concurrent",
    "run_trace",
    "scenario",
]

REQUEST_TIMEOUT_S = 15.0  # a request of this scenario takes well under a second; more is a hang
LIVELOCK_SPINS = 1000  # "superseding context checkpoint" lines of one trace that mean a spinning slot


def load_config(arch: str, n_parallel: int, kv_unified: bool, cache_ram_mib: int = 8) -> ServerConfig:
    """A concurrent configuration: ``-b`` = ``-c`` so only the near-end rule cuts a prompt (see above)."""
    return ServerConfig(arch, n_parallel=n_parallel, kv_unified=kv_unified, cache_ram_mib=cache_ram_mib,
                        ctx_checkpoints=4, checkpoint_min_step=64, n_ctx=2048, n_batch=2048, n_ubatch=64)  # fmt: skip


def concurrent_configs(short: bool) -> list[ServerConfig]:
    """The gate's short run (two configurations) or the full sweep (five models, -np 2..4, both KV modes)."""
    if short:
        return [load_config("llama", 2, False), load_config("mamba", 3, True)]
    return [
        load_config("llama", 2, False),
        load_config("llama", 4, True),
        load_config("jamba", 3, True),
        load_config("jamba", 2, False),
        load_config("mamba", 3, True),
        load_config("mamba", 4, False),
        load_config("lfm2", 4, True),
        load_config("gemma2", 2, False),
        # not gemma2 with unified KV: which sliding-window cells of a slot survive depends on how the server
        # interleaves the slots' batches in the shared cells, which the per-slot replay cannot follow
        load_config("gemma2", 3, False),
    ]


def scenario(seed: int, n_clients: int, n_slots: int, per_client: int, n_ctx_slot: int, busy: bool = True) -> list[Req]:
    """Overlapping requests that share, extend and diverge, long ones, and ones naming a busy slot.

    ``n_predict`` differs between requests of a trace, so a response is matched to its task by
    (slot, prompt length, tokens decoded). Client 0 keeps long generations going so that slots are busy.
    ``busy`` False: no request names a slot (a clean trace: every mismatch in it fails).
    """
    rng = random.Random(seed)
    bases = [tuple(3 + rng.randrange(250) for _ in range(rng.choice((40, 96, 160, 200)))) for _ in range(3)]
    sent: list[tuple[int, ...]] = list(bases)
    reqs: list[Req] = []
    idx = 0
    for c in range(n_clients):
        prev: tuple[int, ...] = rng.choice(bases)
        for j in range(per_client):
            kinds = ("share", "extend", "diverge", "repeat") + (("busy", "busy") if busy else ())
            kind = "long" if c == 0 else rng.choice(kinds)
            new = tuple(3 + rng.randrange(250) for _ in range(rng.choice((1, 8, 24, 64))))
            n_predict = 2 + idx
            if kind == "long":
                tokens = rng.choice(bases)[: rng.choice((8, 32))] + new
                n_predict = 150 + idx
            elif kind == "extend":
                tokens = prev + new
            elif kind == "diverge":
                tokens = prev[: len(prev) // 2] + new
            elif kind == "repeat":
                tokens = rng.choice(sent)
            else:  # share, busy: a base's prefix (likely in the cache) and a new tail
                base = rng.choice(bases)
                tokens = base[: len(base) * rng.choice((1, 2, 3, 4)) // 4] + new
            tokens = tokens[-(n_ctx_slot - n_predict - 8) :] or (1,)
            at = round(0.004 * c + (rng.uniform(0.0, 0.03) if j else 0.0), 4)
            reqs.append(Req(c, at, tokens, n_predict, BUSY if kind == "busy" else -1))
            sent.append(tokens)
            prev = tokens
            idx += 1
    return reqs


def run_trace(
    cfg: ServerConfig,
    binary: Path,
    semantics: str,
    reqs: Sequence[Req],
    fresh: ServerProcess,
    log_path: str | None = None,
    binary_expr: str = "build_server('shared')",
    traces: ServerTrace | None = None,
    name: str = "run",
) -> ConcurrentResult:
    """Run one trace on a new server, replay its order on a new model, check every response.

    With ``traces`` the server runs under the libllama trace (``traces.path(name)``), kept with the
    lines that replay and shrink it when an output mismatched (``res.trace``), else deleted."""
    t0 = time.perf_counter()
    trace = traces.path(name) if traces is not None else None
    program = replay_program(
        ["from pathlib import Path",
         "from harness.trees.build import build_server, build_source",
         "from harness.targets.llama_server import ServerConfig",
         "from harness.load.clients import Req",
         "from harness.load.concurrent import replay"],
        f"print(replay({cfg!r}, {binary_expr}, {semantics!r}, REQS))",
        reqs,
    )  # fmt: skip
    embeds = any(r.id_slot == EMBED for r in reqs)  # embedding clients: the server answers them, bounds held
    server = ServerProcess(
        binary,
        Launch(
            model=model_path(cfg.arch),
            n_parallel=cfg.n_parallel,
            ctx_size=cfg.n_ctx,
            cache_ram=cfg.cache_ram_mib,
            ctx_checkpoints=cfg.ctx_checkpoints,
            kv_unified=cfg.kv_unified,
            args=[*cfg.server_args(), *_extra_args(cfg, reqs), "-lv", "4"],
        ),
        log_path=log_path,
        env=traces.env(trace) if traces is not None else None,
        timeouts=Timeouts(request=REQUEST_TIMEOUT_S),
    )  # fmt: skip
    with server:
        watch = RssWatch(server.pid) if embeds else None
        with watch or nullcontext():
            run = run_clients(server, reqs, timeout=4 * REQUEST_TIMEOUT_S)
    # after the server stopped: a slot is released (and logged) after its response went out
    log = server.log_path.read_text(errors="replace") if server.log_path else ""
    res = judge(cfg, semantics, log, run.sents, fresh, program, trace)
    if watch is not None:
        broke, res.cache_max_mib = bound_violations(watch, cfg.cache_ram_mib, log)
        res.rss_peak, res.rss_bound = watch.peak, watch.bound(cfg.cache_ram_mib)
        res.bound_violations += len(broke)
        res.failures += broke
        res.program = program if res.mismatches else res.program
    if traces is not None:
        attach_trace(res, traces, trace)
    res.seconds = time.perf_counter() - t0
    return res


def attach_trace(res: ConcurrentResult, traces: ServerTrace, trace: Path | None) -> None:
    """Keep the server's libllama trace when an output mismatched (else delete it); each output failure
    then names the trace and the lines that replay and shrink it."""
    kept = traces.settle(trace, res.output_mismatches > 0)
    if kept is not None:
        res.trace = kept
        res.failures = [f"{f}; {kept}" if f.startswith("output:") else f for f in res.failures]


def judge(
    cfg: ServerConfig,
    semantics: str,
    log: str,
    sents: Sequence[Sent],
    fresh: ServerProcess,
    program: str,
    trace: Path | None = None,
) -> ConcurrentResult:
    """Check one trace's responses against a new model fed the order in the server's ``log``; an output
    difference the server's libllama ``trace`` locates is that finding's (:meth:`Divergences.located`)."""
    res = ConcurrentResult(cfg.name)
    res.requests = len(sents)
    # busy-slot-by-id-livelock: a slot loaded mid-prompt with a longer prompt re-creates one checkpoint
    # forever; its request (and the one that named the slot) time out
    livelock = log.count("superseding context checkpoint") > LIVELOCK_SPINS and "found better prompt" in log
    for s in sents:
        if s.error is not None and livelock and ("timed out" in s.error or s.error.startswith("not sent")):
            res.busy_livelocks += 1
            res.notes.append(f"busy-slot-by-id-livelock: {s.describe()}")
        elif s.error is not None:
            res.request_errors += 1
            res.failures.append(f"request error: {s.describe()}")
    if res.busy_livelocks:
        res.busy_program = res.busy_program or program
    saves, by_id, touches = busy_slot_touches(log)  # the log alone: no processing slot saved by the idle pass
    res.busy_checked, res.busy_touches = saves + by_id, len(touches)
    res.failures += [f"busy_slot_untouched: {t}" for t in touches]
    events = parse_log(log)
    res.evictions = sum(e.kind == "evict" for e in events)
    params = cfg.params(switches_of_binary(fresh.binary))  # the model follows the tree's upstream changes
    m = make_llama_server(semantics, model_path(cfg.arch), params=params, n_ctx=cfg.n_ctx, check_restores=False)
    try:
        try:
            checks = replay_order(m, events, sents, res)
        except Unmodellable as e:
            if res.busy_hits or res.busy_loads or res.busy_livelocks:
                # busy-slot-by-id rewrote a processing slot first (mid-prompt, the prompt then goes on
                # from the loaded tokens; the server's log or the model says so): what follows is that
                # finding's wreckage, not followed further
                res.unfollowed_after_busy_hit += 1
                res.notes.append(f"order not followed after busy-slot-by-id: {e}")
            else:
                res.unmodellable = str(e)
            checks = []
        predicted_evictions = m.prompt_cache.evictions if m.prompt_cache is not None else 0
        res.stateless_cached = len(m.stateless_saves)
    finally:
        close_server(m)
    if checks and predicted_evictions != res.evictions:
        res.cache_n_mismatches += 1
        res.failures.append(f"evictions: the log shows {res.evictions}, the model predicts {predicted_evictions}")
    _judge_responses(cfg, checks, fresh, program, trace, res)
    if res.mismatches:
        res.program = program
    return res


def _judge_responses(cfg: ServerConfig, checks: Sequence[Check], fresh: ServerProcess, program: str,
                     trace: Path | None, res: ConcurrentResult) -> None:  # fmt: skip
    """Each response's ``cache_n`` against the model's, and its output against ``fresh``'s, in send order."""
    sources = Divergences(cfg.arch)
    after_hit = False  # busy-slot-by-id rewrote a processing slot: what follows is its wreckage
    for c in sorted(checks, key=lambda x: x.sent.t_send):
        if c.sent.response is None:
            continue
        after_hit = after_hit or c.busy_hit
        if not c.ok and after_hit:
            res.after_busy_hit += 1
            res.notes.append(f"cache_n after busy-slot-by-id: {c.describe()}")
        elif not c.ok:
            res.cache_n_mismatches += 1
            res.failures.append(f"cache_n: {c.describe()}")
        diff = compare_output(fresh, c.sent.req.tokens, c.sent.generated, cfg.arch) if c.sent.generated else None
        c.output = diff.describe() if diff is not None else None
        known = Divergences.batch_shape(diff, c.sent.cache_n) if diff is not None else None
        if diff is None:
            continue
        located = sources.located(diff, trace)
        if located is not None:  # the server's libllama trace shows its condition behind the first wrong token
            res.located[located] = res.located.get(located, 0) + 1
            sources.add(c.sent.req.tokens, c.sent.generated)
        elif known == GREEDY_FLIP_ON_CACHE_PATH.id:
            res.near_tie_flips += 1
        elif known == CONCURRENT_OUTPUT_DIVERGENCE.id:
            res.concurrent_divergences += 1
        elif c.busy_hit or sources.explains(c.sent.req.tokens, c.sent.cache_n):
            # changed by busy-slot-by-id, or reused the state of a response it changed
            res.busy_slot_by_id += 1
            res.busy_program = res.busy_program or program
            sources.add(c.sent.req.tokens, c.sent.generated)
        else:
            res.output_mismatches += 1
            res.failures.append(f"output: {c.describe()}: {c.output}")


def _extra_args(cfg: ServerConfig, reqs: Sequence[Req]) -> tuple[str, ...]:
    """The flags that make the server answer the trace's embedding requests, if it has any."""
    return server_args(cfg.arch) if any(r.id_slot == EMBED for r in reqs) else ()


def fresh_server(cfg: ServerConfig, binary: Path, log_path: str | None = None, extra: Sequence[str] = ()
                 ) -> ServerProcess:  # fmt: skip
    """A single-slot server without cache, for the outputs (started by the caller); ``extra``: the traced server's
    flags for embeddings (:func:`_extra_args`)."""
    return ServerProcess(
        binary,
        Launch(
            model=model_path(cfg.arch),
            n_parallel=1,
            ctx_size=cfg.n_ctx,
            cache_ram=0,
            ctx_checkpoints=cfg.ctx_checkpoints,
            args=[*cfg.server_args(), *extra],
        ),
        log_path=log_path,
    )  # fmt: skip


def run_concurrent(
    cfg: ServerConfig,
    binary: Path,
    semantics: str,
    seed: int,
    n_traces: int,
    *,
    n_clients: int | None = None,
    per_client: int = 4,
    log_dir: str | None = None,
    binary_expr: str = "build_server('shared')",
    out: Callable[[str], None] = print,
    traces: ServerTrace | None = None,
    embedding_clients: int = 0,
) -> ConcurrentResult:
    """``n_traces`` seeded traces on ``cfg``; K = ``n_clients`` (default: one more than the slots, at most 4);
    ``traces``: each server under the libllama trace (:meth:`run_trace`); ``embedding_clients``: that many more
    clients sending embeddings in every trace (:mod:`harness.load.overlap`; ``-ub`` then equals ``-b``)."""
    k = n_clients or min(4, cfg.n_parallel + 1)
    total = ConcurrentResult(cfg.name)
    n_ctx_slot = cfg.n_ctx if cfg.kv_unified else cfg.n_ctx // cfg.n_parallel
    n_ctx_slot = min(n_ctx_slot, cfg.n_ctx // cfg.n_parallel + 128)  # leave unified KV room for every slot
    if embedding_clients:
        cfg = embedding_config(cfg)
    extra = server_args(cfg.arch) if embedding_clients else ()
    with fresh_server(cfg, binary, None if log_dir is None else f"{log_dir}/{cfg.name}-fresh.log", extra) as fresh:
        for t in range(n_traces):
            # even traces are clean (no request names a slot), odd ones name busy slots
            reqs = scenario(seed * 1000 + t, k, cfg.n_parallel, per_client, n_ctx_slot, busy=t % 2 == 1)
            reqs += embedding_reqs(seed * 1000 + t, k, embedding_clients, 2 * per_client) if embedding_clients else []
            log = None if log_dir is None else f"{log_dir}/{cfg.name}-trace{t}.log"
            r = run_trace(cfg, binary, semantics, reqs, fresh, log, binary_expr, traces, f"{cfg.name}-trace{t}")
            total.add(r)
    return total


def replay(cfg: ServerConfig, binary: Path, semantics: str, reqs: Sequence[Req]) -> str:
    """Send ``reqs`` again with their timing and check them; the figures and each failure, as text."""
    ensure_form(binary)  # pasted into a new process: the request form its run used
    with fresh_server(cfg, binary, extra=_extra_args(cfg, reqs)) as fresh, \
            tempfile.TemporaryDirectory(prefix="harness-replay-") as logs:  # the log's order and checks, as the run's
        r = run_trace(cfg, binary, semantics, reqs, fresh, log_path=f"{logs}/replay.log")
    lines = [f"{r.requests} requests, {r.interleavings} interleaved, {r.busy_requests} named a busy slot, "
             f"{r.busy_slot_by_id} outputs changed by busy-slot-by-id, {r.mismatches} mismatches"]  # fmt: skip
    if r.unmodellable:
        lines.append(f"not modellable: {r.unmodellable}")
    return "\n".join(lines + r.failures)
