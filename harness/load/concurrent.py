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
  (:func:`deferred_request`), and a cached prompt the server took into the busy slot ("found better
  prompt") must be one the model takes too (else a ``cache_load`` mismatch, before any busy-slot-by-id);
* a ``release`` of task T steps the model's slot to the end of its task; its ``n_prompt_cached``
  must equal the response's ``cache_n``.

Each slot is stepped on its own (:func:`step_slot`, one ``update_slots`` iteration restricted to
one slot): the cache is touched only when a task arrives, so the slots' relative progress between
two arrivals does not matter, except for a busy slot named by id, which the ``save`` line pins.
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

Size: one differential in the order it runs: the trace, the walk of the server's log that feeds the
model (each event kind reads the walk's state), the judging of every response and the runners; split,
each part would need the others' types and the walk's helpers.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from contextlib import nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fixtures.models import model_path
from harness.backends.llama_server.differential import ServerConfig
from harness.load.clients import BUSY, EMBED, Req, Sent, replay_program, run_clients
from harness.load.order import Event, parse_log, tasks
from harness.load.outputs import Divergences, compare_output
from harness.load.overlap import RssWatch, bound_violations, embedding_config, embedding_reqs
from harness.load.stateless import server_args
from harness.load.traced import ServerTrace
from harness.model.cache import f32, get_common_prefix
from harness.model.server_context import TASK_EMBEDDING, ServerContext, ServerSlot, SlotState
from harness.targets.libllama import close_server, make_llama_server
from harness.targets.llama_server import ServerProcess

__all__ = [
    "ConcurrentResult",
    "Unmodellable",
    "attach_trace",
    "concurrent_configs",
    "deferred_request",
    "judge",
    "replay",
    "run_trace",
    "scenario",
    "step_slot",
]

_COUNTS = (
    "requests",
    "interleavings",
    "busy_requests",
    "busy_hits",
    "busy_loads",
    "busy_load_disagreements",
    "busy_slot_by_id",
    "cache_n_mismatches",
    "load_mismatches",
    "output_mismatches",
    "near_tie_flips",
    "concurrent_divergences",
    "request_errors",
    "evictions",
    "seconds",
    "unfollowed_after_busy_hit",
    "busy_livelocks",
    "after_busy_hit",
    "embeddings",
    "stateless_cached",
    "bound_violations",
)
REQUEST_TIMEOUT_S = 15.0  # a request of this scenario takes well under a second; more is a hang
LIVELOCK_SPINS = 1000  # "superseding context checkpoint" lines of one trace that mean a spinning slot
_MAX_STEPS = 20_000  # model iterations for one slot to reach a length or finish its task


class Unmodellable(Exception):
    """The server's log and the responses cannot be lined up (a harness limit, reported, never a pass)."""


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


def step_slot(m: ServerContext, slot: ServerSlot) -> None:
    """One ``update_slots`` iteration (server-context.cpp:3140-3960) for ``slot`` alone."""
    if slot.state is SlotState.STARTED:
        m._start_prompt(slot)
    if slot.state is SlotState.PROCESSING_PROMPT:
        m._prompt_batch(slot)
    elif slot.state is SlotState.DONE_PROMPT:
        slot.state = SlotState.GENERATING
        m._finish_token(slot)
    elif slot.state is SlotState.GENERATING:
        m._generate(slot)


def _step_to(m: ServerContext, slot: ServerSlot, n_tokens: int) -> None:
    for _ in range(_MAX_STEPS):
        if slot.prompt.n_tokens() == n_tokens or not slot.is_processing():
            break
        step_slot(m, slot)
    if slot.prompt.n_tokens() != n_tokens:
        raise Unmodellable(f"the server saved busy slot {slot.id} at {n_tokens} tokens; the model's slot "
                           f"never holds that many ({slot.prompt.n_tokens()} now, {slot.state.value})")  # fmt: skip


def deferred_request(m: ServerContext, slot: ServerSlot, waiting: Sequence[Sent], window: Sequence[Event]) -> Sent:
    """Which of the requests waiting for busy ``slot`` a deferred selection is (its ``window`` of log lines).

    Several requests can name one busy slot, and the server retries each deferred one when a slot is
    released, so the earliest sent is not always the one selected. The cache lookup that follows the
    selection (``server_prompt_cache::load``, server-task.cpp:1799-1810) logs the slot's own
    ``f_keep``/``f_sim`` for the new prompt and each entry's length and common prefix with it: the
    request is the earliest sent whose prefixes with the model's slot and with a cached prompt (or the
    slot's, just saved) of each logged length are the logged ones. With no lookup logged, or none that
    fits, the earliest sent.
    """
    by_age = sorted(waiting, key=lambda x: x.t_send)
    logged = [(x.n, x.lcp) for x in window if x.kind == "entry"]
    base = next((x.how for x in window if x.kind == "lookup"), None)
    if base is None or m.prompt_cache is None:
        return by_age[0]
    mine = slot.prompt.tokens
    prompts = [st.prompt.tokens for st in m.prompt_cache.states]
    if mine and mine not in prompts:
        prompts.append(mine)  # the save just before the lookup ("already in the cache": skipped)
    for c in by_age:
        new = c.req.tokens
        lcp = get_common_prefix(mine, new)
        f_keep = f32(lcp / len(mine)) if mine else -1.0
        if f"f_keep = {f_keep:.3f}, f_sim = {f32(lcp / len(new)):.3f}" != base:
            continue
        # the save may have removed entries it contains (alloc, :1737) or evicted some: the logged ones must fit
        if all(any(len(p) == n and get_common_prefix(p, new) == k for p in prompts) for n, k in logged):
            return c
    return by_age[0]


def _finish(m: ServerContext, slot: ServerSlot) -> None:
    for _ in range(_MAX_STEPS):
        if not slot.is_processing():
            return
        step_slot(m, slot)
    raise Unmodellable(f"the model's slot {slot.id} did not finish its task in {_MAX_STEPS} steps")


@dataclass
class Check:
    """One response against the model's replay and a fresh server."""

    sent: Sent
    predicted_slot: int = -1
    predicted_cache_n: int = -1
    busy_hit: bool = False  # its slot was loaded or cleared while it processed (a busy slot named by id)
    output: str | None = None  # None: equal to a fresh server's; else where and by what gap it differs

    @property
    def ok(self) -> bool:
        return (self.sent.slot, self.sent.cache_n) == (self.predicted_slot, self.predicted_cache_n)

    def describe(self) -> str:
        return f"{self.sent.describe()}; model slot {self.predicted_slot} cache_n {self.predicted_cache_n}"


@dataclass
class ConcurrentResult:
    config: str
    requests: int = 0
    interleavings: int = 0  # launches while another task was in flight
    busy_requests: int = 0  # selections by id of a busy slot (the task deferred)
    busy_hits: int = 0  # requests whose slot was loaded or cleared by one (the server's log or the model says so)
    busy_loads: int = 0  # of the busy selections, those where the server took a cached prompt into the slot
    busy_load_disagreements: int = 0  # the model's load differs from the server's log, after busy-slot-by-id
    busy_slot_by_id: int = 0  # of those, outputs that differ from a fresh server's (the known finding)
    cache_n_mismatches: int = 0
    load_mismatches: int = 0  # a busy slot's load the model mispredicts (before any busy-slot-by-id)
    output_mismatches: int = 0
    near_tie_flips: int = 0  # greedy-flip-on-cache-path: a flip within BATCH_SHAPE_FLIP_GAP, cache_n > 0
    concurrent_divergences: int = 0  # concurrent-output-divergence: a flip within the bound, cache_n = 0
    request_errors: int = 0
    evictions: int = 0  # seen in the log (the model's count must agree)
    unmodellable: str | None = None
    after_busy_hit: int = 0  # cache_n predictions missed after busy-slot-by-id rewrote a slot (known)
    busy_livelocks: int = 0  # requests that hung on busy-slot-by-id-livelock (known)
    unfollowed_after_busy_hit: int = 0  # traces the model could not follow after busy-slot-by-id (known)
    notes: list[str] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)
    program: str = ""  # the timed trace that replays it, when something failed
    trace: str = ""  # the libllama trace of the first output mismatch and the lines that replay and shrink it
    busy_program: str = ""  # a trace that showed busy-slot-by-id, when one did
    seconds: float = 0.0
    embeddings: int = 0  # embedding requests the model replayed in the server's order (--embedding-clients)
    stateless_cached: int = 0  # cache entries the model saved from a slot an embedding left: idle-stateless-slot-cached
    bound_violations: int = 0  # the RSS or logged cache size past its bound (harness.load.overlap)
    rss_peak: int = 0  # bytes, the largest over the traces (with embedding clients)
    rss_bound: int = 0
    cache_max_mib: float = 0.0

    @property
    def mismatches(self) -> int:
        return (self.cache_n_mismatches + self.load_mismatches + self.output_mismatches + self.request_errors
                + self.bound_violations)  # fmt: skip

    def add(self, other: ConcurrentResult) -> None:
        for k in _COUNTS:
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.failures += other.failures
        self.notes += other.notes
        self.program = self.program or other.program
        self.trace = self.trace or other.trace
        self.busy_program = self.busy_program or other.busy_program
        self.unmodellable = self.unmodellable or other.unmodellable
        self.rss_peak, self.rss_bound = max(self.rss_peak, other.rss_peak), max(self.rss_bound, other.rss_bound)
        self.cache_max_mib = max(self.cache_max_mib, other.cache_max_mib)

    def as_dict(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["mismatches"] = self.mismatches
        return d


def _match(events: list[Event], sents: Sequence[Sent]) -> dict[int, Sent]:
    """Task id -> the request it answered: same slot, prompt length and tokens decoded (first sent wins)."""
    free = [s for s in sents if s.response is not None]
    out: dict[int, Sent] = {}
    for t in tasks(events).values():
        cands = [
            s
            for s in free
            if (s.embedding and t.n_decoded < 0 and len(s.req.tokens) == t.n_prompt)  # no eval line: an embedding
            or (not s.embedding and s.slot == t.slot
                and int(s.response["tokens_evaluated"]) == t.n_prompt  # type: ignore[index]
                and len(s.generated) == t.n_decoded)
        ]  # fmt: skip
        if not cands:
            raise Unmodellable(f"task {t.task} (slot {t.slot}, {t.n_prompt} prompt tokens, {t.n_decoded} decoded) "
                               "matches no response")  # fmt: skip
        s = min(cands, key=lambda x: x.t_send)
        out[t.task] = s
        free.remove(s)
    return out


def _busy_load_differs(res: ConcurrentResult, e: Event, server_load: Event | None, s: Sent) -> None:
    """The model mispredicts busy-slot-by-id's load into slot ``e.slot``: a mismatch, unless an earlier
    busy load already rewrote a processing slot (its wreckage is not followed)."""
    where = f"busy load at {e.t:.3f}s: the server"
    what = (f"{where} took a cached prompt into busy slot {e.slot} ({server_load.how}), the model kept its tokens"
            if server_load is not None else
            f"{where} kept busy slot {e.slot}'s tokens, the model took a cached prompt")  # fmt: skip
    if res.busy_hits:
        res.busy_load_disagreements += 1
        res.notes.append(f"{what} (after busy-slot-by-id)")
    else:
        res.load_mismatches += 1
        res.failures.append(f"{what}: {s.describe()}")


def _embedding(m: ServerContext, s: Sent, slot: int, res: ConcurrentResult, on_slot: dict[int, int],
               in_flight: set[int]) -> None:  # fmt: skip
    """The server launched embedding ``s`` on ``slot``: the model handles it there too (else a mismatch)."""
    if in_flight:
        res.interleavings += 1
    in_flight.add(s.index)
    r = m.handle_stateless(s.req.tokens, TASK_EMBEDDING)
    res.embeddings += 1
    if r.status != "launched" or r.slot != slot:
        if not (res.busy_hits or res.busy_loads):  # else busy-slot-by-id's wreckage (judge says so)
            res.cache_n_mismatches += 1
            res.failures.append(f"embedding slot: {s.describe()}: the server launched it on slot {slot}, the model "
                                f"{r.status} on slot {r.slot}")  # fmt: skip
        raise Unmodellable(f"the model launched embedding #{s.index} on slot {r.slot}, the server on {slot}")
    on_slot.pop(slot, None)


def replay_order(m: ServerContext, events: list[Event], sents: Sequence[Sent], res: ConcurrentResult) -> list[Check]:
    """Feed ``m`` the order in ``events``; one :class:`Check` per released task, in release order."""
    by_task = _match(events, sents)
    checks: dict[int, Check] = {}  # sent index -> check
    on_slot: dict[int, int] = {}  # model slot -> sent index of its task
    launched: set[int] = set()
    in_flight: set[int] = set()
    for i, e in enumerate(events):
        if e.kind == "select":
            server_load: Event | None = None
            later = [x for x in events[i + 1 :] if x.kind in ("select", "launch", "release")]
            nxt = later[0] if later else None
            deferred = nxt is None or nxt.kind != "launch" or nxt.slot != e.slot
            if not deferred:
                assert nxt is not None
                s = by_task[nxt.task]
                if s.embedding:
                    _embedding(m, s, nxt.slot, res, on_slot, in_flight)
                    continue
            else:
                if e.how != "id":
                    raise Unmodellable(f"a selection by {e.how} at {e.t:.3f}s with no launch")
                waiting = [x for x in sents if x.id_slot == e.slot and x.index not in launched and x.response]
                if not waiting:
                    raise Unmodellable(f"a deferred selection of slot {e.slot} at {e.t:.3f}s names no pending request")
                stop = events.index(nxt) if nxt is not None else len(events)
                window = events[i + 1 : stop]
                saves = [x for x in window if x.kind == "save"]
                # the server took a cached prompt into the busy slot: busy-slot-by-id rewrote it
                server_load = next((x for x in window if x.kind == "load"), None)
                if server_load is not None:
                    res.busy_loads += 1
                if saves and m.slots[e.slot].is_processing():
                    _step_to(m, m.slots[e.slot], saves[0].n)
                s = deferred_request(m, m.slots[e.slot], waiting, window)
                res.busy_requests += 1
            before = {sl.id: sl.prompt.tokens for sl in m.slots if sl.is_processing()}
            n_predict = len(s.generated) or s.req.n_predict
            r = m.handle_completion(s.req.tokens, id_slot=s.id_slot, n_predict=n_predict, forced=s.generated)
            rewritten = {sid for sid, toks in before.items() if m.slots[sid].prompt.tokens != toks}
            # (a deferred request the model launched is not a load question: it is unmodellable, below)
            if deferred and r.status != "launched" and (server_load is not None) != (e.slot in rewritten):
                _busy_load_differs(res, e, server_load, s)
                if server_load is not None:
                    rewritten.add(e.slot)  # the server's log is the fact what follows is judged by
            for sid in rewritten:
                if sid in on_slot:
                    hit = checks.setdefault(on_slot[sid], Check(sents[on_slot[sid]]))
                    if not hit.busy_hit:
                        hit.busy_hit = True
                        res.busy_hits += 1
            c = checks.setdefault(s.index, Check(s))
            c.predicted_slot = r.slot if r.status == "launched" else -1
            if deferred and r.status == "launched":
                c.predicted_slot = r.slot
                raise Unmodellable(f"the server deferred {s.describe()}; the model launched it on slot {r.slot}")
            if not deferred:
                if in_flight:
                    res.interleavings += 1
                launched.add(s.index)
                in_flight.add(s.index)
                if r.status == "launched":
                    on_slot[r.slot] = s.index
        elif e.kind == "release" and e.task in by_task and by_task[e.task].embedding:
            in_flight.discard(by_task[e.task].index)
            _finish(m, m.slots[e.slot])
        elif e.kind == "release" and e.task in by_task:
            s = by_task[e.task]
            c = checks.setdefault(s.index, Check(s))
            in_flight.discard(s.index)
            if c.predicted_slot >= 0:
                slot = m.slots[c.predicted_slot]
                _finish(m, slot)
                c.predicted_cache_n = slot.n_prompt_cached
                on_slot.pop(slot.id, None)
    return list(checks.values())


def run_trace(
    cfg: ServerConfig,
    binary: Path,
    semantics: str,
    reqs: Sequence[Req],
    fresh: ServerProcess,
    log_path: str | None = None,
    binary_expr: str = "build_server('pr')",
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
         "from harness.targets.llama_build import build_server, build_source",
         "from harness.backends.llama_server.differential import ServerConfig",
         "from harness.load.clients import Req",
         "from harness.load.concurrent import replay"],
        f"print(replay({cfg!r}, {binary_expr}, {semantics!r}, REQS))",
        reqs,
    )  # fmt: skip
    embeds = any(r.id_slot == EMBED for r in reqs)  # embedding clients: the server answers them, bounds held
    server = ServerProcess(
        binary, [*cfg.server_args(), *_extra_args(cfg, reqs), "-lv", "4"], model=model_path(cfg.arch),
        n_parallel=cfg.n_parallel, ctx_size=cfg.n_ctx, cache_ram=cfg.cache_ram_mib, ctx_checkpoints=cfg.ctx_checkpoints,
        kv_unified=cfg.kv_unified, log_path=log_path, request_timeout=REQUEST_TIMEOUT_S,
        env=traces.env(trace) if traces is not None else None,
    )  # fmt: skip
    with server:
        watch = RssWatch(server.pid) if embeds else None
        with watch or nullcontext():
            run = run_clients(server, reqs, timeout=4 * REQUEST_TIMEOUT_S)
    # after the server stopped: a slot is released (and logged) after its response went out
    log = server.log_path.read_text(errors="replace") if server.log_path else ""
    res = judge(cfg, semantics, log, run.sents, fresh, program)
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
    cfg: ServerConfig, semantics: str, log: str, sents: Sequence[Sent], fresh: ServerProcess, program: str
) -> ConcurrentResult:
    """Check one trace's responses against a new model fed the order in the server's ``log``."""
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
    events = parse_log(log)
    res.evictions = sum(e.kind == "evict" for e in events)
    m = make_llama_server(semantics, model_path(cfg.arch), params=cfg.params(), n_ctx=cfg.n_ctx, check_restores=False)
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
        if known == "greedy-flip-on-cache-path":
            res.near_tie_flips += 1
        elif known == "concurrent-output-divergence":
            res.concurrent_divergences += 1
        elif c.busy_hit or sources.explains(c.sent.req.tokens, c.sent.cache_n):
            # changed by busy-slot-by-id, or reused the state of a response it changed
            res.busy_slot_by_id += 1
            res.busy_program = res.busy_program or program
            sources.add(c.sent.req.tokens, c.sent.generated)
        else:
            res.output_mismatches += 1
            res.failures.append(f"output: {c.describe()}: {c.output}")
    if res.mismatches:
        res.program = program
    return res


def _extra_args(cfg: ServerConfig, reqs: Sequence[Req]) -> tuple[str, ...]:
    """The flags that make the server answer the trace's embedding requests, if it has any."""
    return server_args(cfg.arch) if any(r.id_slot == EMBED for r in reqs) else ()


def fresh_server(cfg: ServerConfig, binary: Path, log_path: str | None = None, extra: Sequence[str] = ()
                 ) -> ServerProcess:  # fmt: skip
    """A single-slot server without cache, for the outputs (started by the caller); ``extra``: the traced server's
    flags for embeddings (:func:`_extra_args`)."""
    return ServerProcess(binary, [*cfg.server_args(), *extra], model=model_path(cfg.arch), n_parallel=1,
                         ctx_size=cfg.n_ctx, cache_ram=0, ctx_checkpoints=cfg.ctx_checkpoints,
                         log_path=log_path)  # fmt: skip


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
    binary_expr: str = "build_server('pr')",
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
    with fresh_server(cfg, binary, extra=_extra_args(cfg, reqs)) as fresh:
        r = run_trace(cfg, binary, semantics, reqs, fresh)
    lines = [f"{r.requests} requests, {r.interleavings} interleaved, {r.busy_requests} named a busy slot, "
             f"{r.busy_slot_by_id} outputs changed by busy-slot-by-id, {r.mismatches} mismatches"]  # fmt: skip
    if r.unmodellable:
        lines.append(f"not modellable: {r.unmodellable}")
    return "\n".join(lines + r.failures)
