"""Feeding the reference model the order a concurrent llama-server took (the walk of its log).

:func:`replay_order` walks the events read from the server's log (:mod:`harness.load.order`) and
replays each on a :class:`~harness.model.server_context.ServerContext`: a launch is one
``handle_completion`` (or ``handle_stateless`` for an embedding) on the server's slot, a deferred
selection of a busy slot by id steps the model's slot to the length the server saved it at
(:func:`deferred_request` says which waiting request it was), a release finishes the slot's task.
It returns one :class:`Check` per released task, and counts what it saw in a :class:`ConcurrentResult`,
which :mod:`harness.load.concurrent` then judges against the responses and a fresh server.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from harness.load.clients import Sent
from harness.load.order import Event, tasks
from harness.model.cache import f32, get_common_prefix
from harness.model.server_context import TASK_EMBEDDING, ServerContext, ServerSlot, SlotState

__all__ = ["Check", "ConcurrentResult", "Unmodellable", "deferred_request", "replay_order", "step_slot"]

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
    "busy_checked",
    "busy_touches",
)
_MAX_STEPS = 20_000  # model iterations for one slot to reach a length or finish its task


class Unmodellable(Exception):
    """The server's log and the responses cannot be lined up (a harness limit, reported, never a pass)."""


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
    located: dict[str, int] = field(default_factory=dict)  # outputs the libllama trace located, per finding
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
    busy_checked: int = 0  # idle-pass saves and by-id selections of a processing slot held to busy_slot_untouched
    busy_touches: int = 0  # a processing slot touched otherwise than by busy-slot-by-id (the log says so)
    rss_peak: int = 0  # bytes, the largest over the traces (with embedding clients)
    rss_bound: int = 0
    cache_max_mib: float = 0.0

    @property
    def mismatches(self) -> int:
        return (self.cache_n_mismatches + self.load_mismatches + self.output_mismatches + self.request_errors
                + self.bound_violations + self.busy_touches)  # fmt: skip

    def add(self, other: ConcurrentResult) -> None:
        for k in _COUNTS:
            setattr(self, k, getattr(self, k) + getattr(other, k))
        self.failures += other.failures
        self.notes += other.notes
        self.program = self.program or other.program
        self.trace = self.trace or other.trace
        self.busy_program = self.busy_program or other.busy_program
        self.unmodellable = self.unmodellable or other.unmodellable
        for k, n in other.located.items():
            self.located[k] = self.located.get(k, 0) + n
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
