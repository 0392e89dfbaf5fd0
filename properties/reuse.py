"""The ``reuse`` property: after every request the prompt resumed from at least the best usable source.

The other properties check that what a request reuses is right; this one checks that what *could* be
reused *is*. For each completion the model launches, :class:`ReuseTracer` records, just before
``get_available_slot`` (S-C.cpp:1528-1637 at 0c1e570; ``S-C.cpp`` = tools/server/server-context.cpp,
``S-T.cpp`` = tools/server/server-task.cpp) runs, what the slot it then selects held and what the RAM
prompt cache held, and computes **the best usable source**:

* the selected slot's own prompt, as far as its memory can resume it (:func:`resume_point`: the
  longest common prefix, then for memory that cannot be rolled back (recurrent, hybrid, SWA) only at
  a checkpoint or the exact end, S-C.cpp:3271-3388, with [TAG_PROMPT_LOGITS] at :3383-3388);
* the cache entry upstream's own ``server_prompt_cache::load`` would pick with that slot's prompt as the
  base (S-T.cpp:1793-1823: ``f_keep < 0.25`` skipped, strictly better on both ``f_keep`` and
  ``f_sim``; recomputed by :func:`properties.policy.expected_load_choice`), resumed the same way
  from the entry's tokens, checkpoints and the memory it restores (the ``pos_min`` its saved state
  restores, see SWA below);
* a checkpoint, as part of either (the search in :func:`resume_point`).

SWA: an entry's memory is the state ``llama_state_seq_get_data`` wrote, not the slot's memory when it was
saved. The SWA KV cache drops a masked cell only when a later ubatch takes its room (``find_slot``,
src/llama-kv-cache.cpp:1040-1060), so a live slot may hold cells older than the window; the state write
skips every cell that is SWA-masked against the sequence's ``pos_max`` (src/llama-kv-cache.cpp:2092-2097;
``LLAMA_SWA_TYPE_STANDARD``: masked when ``pos_max - pos >= n_swa``, src/llama-hparams.h:482-487), so the
loaded entry's ``pos_min`` is ``max(pos_min, pos_max - n_swa + 1)`` (:func:`restored_pos_min`), which then
bounds its resume (S-C.cpp:3280-3366). The server gate on gemma2
(``gemma2-np2-kvs``, seed 0) showed it: entry 1 (588 tokens, saved at ``pos_min`` 332, ``pos_max`` 587)
restores ``pos_min`` 572 >= ``pos_min_thold`` 530, so the checkpoint search gives 517, not the common prefix
546; the model and the real server both resumed 517.

After the request's prompt processing starts (``_start_prompt``) the tokens it resumed from are
``n_prompt_cached`` (the server's ``timings.cache_n``, S-C.cpp:3390). A shortfall (best usable minus
resumed) is never a silent pass: it is the registered finding whose exact condition holds, counted
with the tokens it recomputed, or a :class:`~properties.invariants.Violation` of ``reuse``:

* ``id-slot-empty-skips-cache`` (the reported case (a)): the request named an empty slot with
  ``id_slot``; the similarity scan skips an empty slot (S-C.cpp:1557-1560), ``ret`` is the named slot
  (:1533-1538), ``f_keep = (0 * n) / 0`` is NaN (:1579) and ``NaN < 0.5f`` is false (:1587): no
  ``prompt_load`` (:1620-1633), the cache is never asked;
* ``similar-slot-skips-better-entry`` (the reported case (b)): the slot was chosen by similarity with
  ``f_keep >= 0.5`` (:1579-1589), so the cache is not asked either, although ``load`` would have
  picked an entry that resumes further.

* ``save-evicts-better-entry`` (found by this property): the cache was asked, but the slot's own
  ``prompt_save`` (:1628, before ``prompt_load`` at :1630) evicted the entry ``load`` would have picked
  (S-T.cpp:1750-1758);
* ``load-picks-unresumable-entry`` (found by this property): the cache was asked and ``load`` moved in
  an entry with a longer raw prefix that the memory resumes from less far than the slot's own prompt
  (recurrent/hybrid/SWA: no checkpoint at or below the divergence).

A slot chosen by LRU (the reported case (c)) always saves and loads (:1594-1633): if an entry beats
it, the entry is loaded; if none does, the slot keeps its old tokens (and the cache a copy of them),
and the request resumes from their common prefix, which is then the best there was: no shortfall.

The server backend's differential (``harness/backends/llama_server/differential.py``) runs this tracer on
its model (``strict=False``): each row carries the best usable source and the finding, and a server
``cache_n`` below it that no finding explains fails ``reuse``.

Excused: a request whose cache load or state read failed (a fault; ``restore_failure`` judges it),
one that named a busy slot (known finding ``busy-slot-by-id``), and ``cache_prompt: false``.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from harness.model.server_context import STATELESS_TASKS, ServerContext, ServerSlot, SlotState, Task
from properties.invariants import Violation, unwrap, wrap_timed
from properties.policy import expected_load_choice

__all__ = [
    "REUSE_FINDINGS",
    "Ckpt",
    "ReuseTracer",
    "Shortfall",
    "Source",
    "restored_pos_min",
    "resume_point",
]

Tokens = tuple[int, ...]

#: the registered findings (harness/findings/) a shortfall may be, by the condition that makes it
REUSE_FINDINGS = (
    "id-slot-empty-skips-cache",
    "similar-slot-skips-better-entry",
    "save-evicts-better-entry",
    "load-picks-unresumable-entry",
)


class Ckpt(NamedTuple):
    """A checkpoint's position fields (``common_prompt_checkpoint``)."""

    n_tokens: int
    pos_min: int
    pos_max: int


class Source(NamedTuple):
    """What a request could resume from: tokens, their checkpoints, the memory's ``seq_pos_min``."""

    tokens: Tokens
    ckpts: tuple[Ckpt, ...]
    pos_min: int


def _lcp(a: Tokens, b: Tokens) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def resume_point(src: Source, new: Tokens, n_swa: int) -> int:
    """The tokens of ``new`` a slot holding ``src`` resumes from (``n_prompt_cached``), S-C.cpp:3271-3390.

    ``n_past`` = the common prefix (:3271 for text tokens); ``pos_min_thold = max(0, pos_next - n_swa -
    (has_new_tokens ? 0 : 1))`` (:3278); if ``0 < n_past <= n_tokens`` and the memory's ``pos_min >=
    pos_min_thold`` (it cannot be cut back there: recurrent state, an SWA window) the newest checkpoint
    with ``pos_max <= pos_next`` and ``pos_min < pos_min_thold || pos_min == 0`` (:3331-3344) gives
    ``pos_next = min(pos_next, max(pos_min + 1, pos_max))``, ``n_past = min(pos_next, n_tokens)``
    (:3354-3356), none gives 0 (:3364-3366); finally [TAG_PROMPT_LOGITS] (:3383-3388).
    """
    n_past = _lcp(src.tokens, new)
    pos_next = n_past
    has_new = n_past < len(new)
    thold = max(0, pos_next - n_swa - (0 if has_new else 1))
    if 0 < n_past <= len(src.tokens) and src.pos_min >= thold:
        for c in reversed(src.ckpts):
            if c.pos_max > pos_next:
                continue
            if c.pos_min < thold or c.pos_min == 0:
                pos_next = min(pos_next, max(c.pos_min + 1, c.pos_max))
                n_past = min(pos_next, c.n_tokens)
                break
        else:
            n_past = 0
    if n_past == len(new) and n_past > 0:
        n_past -= 1
    return n_past


def restored_pos_min(pos_min: int, pos_max: int, n_swa: int) -> int:
    """``seq_pos_min`` after a full state of a sequence with ``pos_min``/``pos_max`` is written and read back.

    ``llama_kv_cache::state_write`` leaves out the cells that are SWA-masked against ``cells.seq_pos_max``
    (src/llama-kv-cache.cpp:2092-2097 at 0c1e570); for ``LLAMA_SWA_TYPE_STANDARD`` (gemma2, the fixtures'
    SWA model) a cell at ``p`` is masked when ``pos_max - p >= n_swa`` (src/llama-hparams.h:482-487). The
    iSWA memory's ``seq_pos_min`` is its SWA cache's (src/llama-kv-cache-iswa.cpp:142-145). Without a window
    (``n_swa`` 0) or for an empty sequence, nothing is left out.
    """
    if n_swa <= 0 or pos_min < 0:
        return pos_min
    return max(pos_min, pos_max - n_swa + 1)


@dataclass(frozen=True)
class Shortfall:
    """One request that resumed from fewer tokens than the best usable source held."""

    finding: str | None  # the registered finding whose condition holds; None: a failure of ``reuse``
    task: int
    slot: int
    n_prompt: int
    best: int  # tokens the best usable source held
    resumed: int  # n_prompt_cached
    source: str  # "entry i" | "slot"
    f_keep: float  # the gate's f_keep (S-C.cpp:1579), NaN for an empty slot

    @property
    def recomputed(self) -> int:
        return self.best - self.resumed

    def line(self) -> str:
        return (
            f"task {self.task} on slot{self.slot}: resumed {self.resumed} of {self.n_prompt} prompt tokens, the best "
            f"usable source ({self.source}) held {self.best}: {self.recomputed} recomputed (f_keep = {self.f_keep:.3f})"
        )


@dataclass
class _Pending:
    best: int
    source: str
    own_empty: bool
    loaded: bool
    f_keep: float
    excused: bool
    own_usable: int  # what the slot's own prompt resumes
    evicted: bool  # the best entry was gone when prompt_load ran (the slot's own save evicted it)


def _ckpts(cps: Any) -> tuple[Ckpt, ...]:
    return tuple(Ckpt(c.n_tokens, c.pos_min, c.pos_max) for c in cps)


class ReuseTracer:
    """Wraps one live server's ``get_available_slot``, ``prompt_save``/``prompt_load`` and ``_start_prompt``.

    ``counts`` (shared by a machine class: the campaign and the gate read it) gets, per registered
    finding, ``id`` += occurrences and ``id:tokens`` += tokens recomputed; ``shortfalls`` lists this
    server's. ``strict``: an unmatched shortfall raises ``Violation("reuse")`` (else it is only listed).
    """

    def __init__(self, server: ServerContext, counts: Counter[str] | None = None, *, strict: bool = True) -> None:
        self.server = server
        self.counts: Counter[str] = counts if counts is not None else Counter()
        self.strict = strict
        self.shortfalls: list[Shortfall] = []
        self.checked = 0
        self.seconds: Counter[str] = Counter()
        self.wrapped: list[tuple[Any, str]] = []
        self._saved_pos_min: dict[int, tuple[Any, int]] = {}  # id(entry) -> (entry, pos_min when saved)
        self._pending: dict[int, _Pending] = {}  # task id -> what it should resume from
        self._load_failed: set[int] = set()  # slots whose prompt_load returned False since the selection
        self._at_load: set[int] = set()  # id() of the entries the last prompt_load saw
        self.best_of: dict[int, int] = {}  # task id -> tokens the best usable source held (each task checked)
        self.finding_of: dict[int, str] = {}  # task id -> the registered finding its shortfall is
        cls = type(self)
        self._wrap(server, "get_available_slot", cls._select)
        self._wrap(server, "_start_prompt", cls._start)
        for s in server.slots:
            self._wrap(s, "prompt_save", cls._save, s)
            self._wrap(s, "prompt_load", cls._load, s)

    def _wrap(self, obj: Any, name: str, post: Callable[..., Any], *extra: Any) -> None:
        wrap_timed(obj, name, post, (self, *extra), self.seconds, "reuse")  # type: ignore[arg-type]
        self.wrapped.append((obj, name))

    def unwrap(self) -> None:
        unwrap(self.wrapped)

    # ---- what the cache entries can restore ----------------------------------------------

    def _save(self, slot: ServerSlot, inner: Callable[..., Any], cache: Any) -> Any:
        ctx = self.server.ctx_tgt  # the memory the entry restores: its state as written (see the note on SWA)
        pos_min = restored_pos_min(ctx.memory_seq_pos_min(slot.id), ctx.memory_seq_pos_max(slot.id), self.server.n_swa)
        res = inner(cache)
        if res:  # the new entry is the list's last (S-T.cpp:1779-1788)
            e = cache.states[-1]
            self._saved_pos_min[id(e)] = (e, pos_min)
        return res

    def _load(self, slot: ServerSlot, inner: Callable[..., Any], cache: Any, tokens: Tokens) -> Any:
        self._at_load = {id(e) for e in cache.states}  # after the save (its evictions), before the load
        res = inner(cache, tokens)
        if not res:
            self._load_failed.add(slot.id)
        return res

    def _entry_source(self, e: Any) -> Source | None:
        held = self._saved_pos_min.get(id(e))
        if held is None or held[0] is not e:
            return None  # not saved under this tracer: unknown memory, not counted as a source
        return Source(e.prompt.tokens, _ckpts(e.prompt.checkpoints), held[1])

    # ---- the request -----------------------------------------------------------------------

    def _select(self, inner: Callable[..., Any], task: Task) -> Any:
        server = self.server
        ctx = server.ctx_tgt
        own = {s.id: Source(s.prompt.tokens, _ckpts(s.prompt.checkpoints), ctx.memory_seq_pos_min(s.id))
               for s in server.slots}  # fmt: skip
        busy = {s.id for s in server.slots if s.is_processing()}
        cache = server.prompt_cache
        objs = list(cache.states) if cache is not None else []
        entries = [self._entry_source(e) for e in objs]
        fired = server.host.seam.fired
        self._load_failed.clear()
        self._at_load = set()
        ret = inner(task)
        if ret is None or ret.id in busy or not task.cache_prompt or task.type in STATELESS_TASKS:
            return ret  # an embedding/rerank resumes nothing by design (is_stateless_task, server-context.cpp:3196)
        src = own[ret.id]
        new = task.tokens
        n_swa = server.n_swa
        own_usable = resume_point(src, new, n_swa)
        best, where, evicted = own_usable, "slot", False
        held = [(i, e) for i, e in enumerate(entries) if e is not None]
        pick = expected_load_choice(src.tokens, new, [e.tokens for _, e in held]) if cache is not None else None
        if pick is not None:
            i, e = held[pick]
            r = resume_point(e, new, n_swa)
            if r > best:
                best, where = r, f"entry {i}"
                evicted = id(objs[i]) not in self._at_load
        loaded = any(ev.op == "load" and ev.slot == ret.id for ev in server.events)
        lcp = _lcp(src.tokens, new)
        f_keep = lcp / len(src.tokens) if src.tokens else float("nan")
        excused = server.host.seam.fired != fired or ret.id in self._load_failed
        self._pending[task.id] = _Pending(best, where, not src.tokens, loaded, f_keep, excused, own_usable, evicted)
        return ret

    def _start(self, inner: Callable[..., Any], slot: ServerSlot) -> Any:
        task = slot.task
        p = self._pending.pop(task.id, None) if task is not None else None
        res = inner(slot)
        if p is None or task is None or p.excused or slot.state is not SlotState.PROCESSING_PROMPT:
            return res
        self.checked += 1
        self.best_of[task.id] = p.best
        resumed = slot.n_prompt_cached
        if resumed >= p.best:
            return res
        fid: str | None = None
        if not p.loaded and p.own_empty and task.id_slot != -1:
            fid = "id-slot-empty-skips-cache"
        elif not p.loaded and not p.own_empty and p.f_keep >= 0.5:
            fid = "similar-slot-skips-better-entry"
        elif p.loaded and p.evicted:
            fid = "save-evicts-better-entry"
        elif p.loaded and resumed < p.own_usable:
            fid = "load-picks-unresumable-entry"
        sf = Shortfall(fid, task.id, slot.id, len(task.tokens), p.best, resumed, p.source, p.f_keep)
        self.shortfalls.append(sf)
        if fid is None:
            if self.strict:
                raise Violation("reuse", sf.line())
            return res
        self.finding_of[task.id] = fid
        self.counts[fid] += 1
        self.counts[fid + ":tokens"] += sf.recomputed
        return res


def finding_counts(counts: Counter[str]) -> dict[str, dict[str, int]]:
    """``{finding: {"requests": n, "tokens_recomputed": t}}`` from a tracer's ``counts``."""
    return {
        fid: {"requests": counts[fid], "tokens_recomputed": counts[fid + ":tokens"]}
        for fid in REUSE_FINDINGS
        if counts[fid]
    }


def describe(shortfalls: Sequence[Shortfall]) -> list[str]:
    return [s.line() for s in shortfalls]
