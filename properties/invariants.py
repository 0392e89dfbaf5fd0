"""The gate's properties (:data:`INVARIANTS`, one line each), each checked by a named function that raises
:class:`Violation` when broken.

Two kinds of checks:

* **State invariants** look at a :class:`~harness.model.server_context.ServerContext` at rest and need nothing
  else: ``accounting``, ``refcount``, ``checkpoint_lists``, ``draft_in_step``, plus
  ``immutability`` which compares against a :class:`Shadow` of what every holder saw before.
  :func:`check_state` runs them all; the state machine calls it after every step and the fault
  sweep uses it as its integrity check.
* **Operation post-conditions** compare a cache or slot before and after one operation:
  ``limit``, ``no_partial_entries``, ``transient_peak``, ``load_transfer``, ``no_prefix_entries``,
  ``checkpoint_lists`` (invalidation), ``busy_slot_untouched``, ``cleared_checkpoints``. :class:`Tracer` wraps the
  methods of one live server *instance* (so a mutant subclass cannot skip the check) and calls them.

Every check computes its expectation independently of the code under test: sizes are summed from
payload bytes, bytes are compared as themselves (never a payload's own digest), ratios are exact
(integers cross-multiplied).

Size: the registry of every property the gate checks, one short function each, sharing the tracer that records
what they compare.
"""

from __future__ import annotations

import hashlib
import itertools
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, NamedTuple

from harness.errors import PropertyFailure
from harness.model.cache import ServerPromptCache, ServerPromptCacheState, get_common_prefix
from harness.model.checkpoint import CheckpointList, CommonPromptCheckpoint
from harness.model.memory import (
    CHECKPOINT_HEADER_BYTES,
    ENTRY_HEADER_BYTES,
    LIST_NODE_BYTES,
    TOKEN_BYTES,
    OperationStats,
    Payload,
)
from harness.model.server_context import ServerContext, ServerSlot

__all__ = [
    "INVARIANTS",
    "Shadow",
    "Tracer",
    "Violation",
    "check_state",
]

# name -> one line, in the order of the issue; every entry is a property in the gate's report
INVARIANTS: dict[str, str] = {
    "limit": "size() <= limit_size after alloc/update and every step; n_tokens() within the token limit computed on "
    "entry",
    "accounting": "size()/n_tokens() equal the sums over entries; logical bytes >= physical unique bytes",
    "immutability": "a checkpoint payload never changes while anyone holds it",
    "refcount": "holder counts equal references; unreferenced payloads are released; no leaks",
    "no_partial_entries": "an allocation failure in a save leaves the cache as before minus documented evictions",
    "transient_peak": "a save's physical peak exceeds live bytes by at most S + value-owned spec + metadata",
    "load_transfer": "load leaves the cache unchanged or moves exactly one qualifying entry to the slot",
    "no_prefix_entries": "right after a successful alloc no entry's tokens are a prefix of another's",
    "checkpoint_lists": "ascending n_tokens, at most n_ctx_checkpoints, pos_max <= resume position",
    "busy_slot_untouched": "cache operations never touch a slot that is processing",
    "cleared_checkpoints": "a slot cleared (erase, failed load or restore, purge, idle or child slot) holds no tokens "
    "and no checkpoint",
    "draft_in_step": "a slot's target and draft memory describe exactly the slot's tokens",
    "restore_equivalence": "after a cache load, checkpoint restore or rollback the next logits equal a fresh "
    "evaluation's bit for bit (libllama backend)",
    "draft_recovery": "with the proposed draft-KV recovery on, a draft context without room fails no request",
    "native_fault": "a failed native allocation inside libllama's state calls or decode is reported or absorbed "
    "correctly, or is a listed finding (libllama backend)",
    # upstream's policy, computed in properties/policy.py (POLICY there holds the same lines)
    "load_choice": "load moves exactly the entry upstream's front-to-back f_keep/f_sim scan picks, or nothing",
    "alloc_eviction": "alloc evicts exactly the prefix entries, then the oldest needed to fit (or recovers)",
    "update_eviction": "update evicts exactly the oldest entries over the byte limit, then over the token limit",
    "checkpoint_policy": "create_checkpoint thins (only when full), caps, supersedes and appends as upstream",
    "restore_failure": "a failed cache load keeps the entry and clears the slot; a failed checkpoint restore aborts",
    "restore_bytes": "a restored state equals a fresh evaluation of its tokens byte for byte (synthetic backend)",
    # computed in properties/reuse.py: a shortfall is a counted registered finding, else a failure
    "reuse": "a request resumes from at least as many tokens as the best usable source held (its slot's "
    "prefix, the entry upstream's load would pick, a checkpoint)",
    # the machine families' own (properties/families.py): slot files, --cache-reuse and context shift, idle slots
    "slot_file_restore": "after a slot file restore answered 200 the slot holds the file's tokens and state and no "
    "checkpoint of another prompt",
    "no_partial_file": "no slot file is left partial by a save, but in the registered findings' exact shapes",
    "reuse_equivalence": "after --cache-reuse moved chunks the slot's memory is a fresh evaluation of the prompt's "
    "first cache_n tokens, every chunk in place",
    "context_shift": "a context shift keeps the first n_keep tokens and the tail after n_discard, drops the "
    "checkpoints, and leaves a fresh evaluation of the kept tokens",
    "stateless_not_cached": "an embedding or rerank slot's prompt is never saved to the cache as a completion's, "
    "but as the registered finding",
    # pinned to what upstream would do, computed apart from the model (properties/pinned.py, issue #50)
    "reuse_chunks": "--cache-reuse moves exactly the chunks upstream's loop takes (runs of at least N equal tokens "
    "from the common prefix), and cache_n counts them",
    "shift_timing": "a generating slot shifts its context exactly when n_tokens + 1 >= n_ctx (else its task ends "
    "with an error), never before",
    "slot_within_ctx": "after every step a slot's tokens and its sampled token fit its n_ctx; a prompt of n_ctx "
    "tokens or more is refused",
    "stateless_fresh": "an embedding or rerank task loads nothing, resumes from no cached prefix and leaves its "
    "slot as a prompt without generated tokens or checkpoints",
    "idle_pass": "the idle-slot pass saves every idle slot once, clears each with kv_unified (else changes none), "
    "and leaves the cache within its limit",
}


class Violation(PropertyFailure):
    """A property of the model's machines does not hold: ``name`` is its key in :data:`INVARIANTS`.

    The model or the state under it broke the property: read the shrunk program the failure prints, replay it
    with its replay line, and fix the code it names (or, for a suspected upstream bug, register it in
    :mod:`harness.findings` and give the machine the condition that shows it). A crash of the modelled server
    is :class:`~harness.errors.TargetCrash` instead."""


def _fail(name: str, message: str) -> None:
    raise Violation(name, message)


Bytes3 = tuple[bytes | None, bytes | None, bytes | None]


def _ckpt_bytes(c: CommonPromptCheckpoint) -> Bytes3:
    """A checkpoint's payload bytes (target, draft, spec): the ``bytes`` objects themselves.

    ``bytes`` are immutable, so bytes rewritten are a new object, and two of these compare by
    content (an object compared with itself is equal at once): no digest is needed to see a change.
    A payload that holds a mutable buffer is snapshotted, as it could change under the same object.
    ``Payload.data`` raises on a released payload (use after free).
    """
    t, d, s = c.data_tgt, c.data_dft, c.data_spec  # three names, not a generator: ~20 calls a step
    # each: the bytes, or a snapshot of a mutable buffer (inline, not a helper: ~26k calls a gate run)
    return (
        None if t is None else (b if type(b := t.data) is bytes else bytes(b)),
        None if d is None else (b if type(b := d.data) is bytes else bytes(b)),
        None if s is None else (b if type(b := s.data) is bytes else bytes(b)),
    )


def _digests(b: Bytes3) -> tuple[str | None, ...]:
    """The bytes named in a failure message: a short digest each."""
    return tuple(None if x is None else hashlib.blake2b(x, digest_size=12).hexdigest() for x in b)


Holder = tuple[str, int, int]  # ("cache", entry, index) | ("slot", slot id, index) | ("spec", slot id, -1)


# (server, its holders) while :func:`run_checks` runs: the checks of one step share one walk (they
# change nothing); outside it every call walks afresh
_WALK: list[Any] = [None, None]


def _holders(server: ServerContext) -> list[tuple[Holder, CommonPromptCheckpoint]]:
    """Every checkpoint alive, with who holds it (:func:`_where` names it: only a failure needs the name)."""
    if _WALK[0] is server and _WALK[1] is not None:
        return _WALK[1]  # type: ignore[no-any-return]
    out: list[tuple[Holder, CommonPromptCheckpoint]] = []
    cache = server.prompt_cache
    if cache is not None:
        for i, e in enumerate(cache.states):
            for j, c in enumerate(e.prompt.checkpoints.items):
                out.append((("cache", i, j), c))
    for s in server.slots:
        for j, c in enumerate(s.prompt.checkpoints.items):
            out.append((("slot", s.id, j), c))
        out.append((("spec", s.id, -1), s.spec_ckpt))
    if _WALK[0] is server:
        _WALK[1] = out
    return out


def _where(h: Holder) -> str:
    kind, a, b = h
    if kind == "spec":
        return f"slot{a}.spec_ckpt"
    return f"cache[{a}].ckpt[{b}]" if kind == "cache" else f"slot{a}.ckpt[{b}]"


def _references(server: ServerContext) -> tuple[dict[int, int], dict[int, Payload]]:
    """How many holders reference each payload (by identity), and the payloads themselves.

    Plain dicts, not a Counter: its ``__missing__`` is a Python call per new payload, every step."""
    refs: dict[int, int] = {}
    objs: dict[int, Payload] = {}
    for _, c in _holders(server):
        for p in (c.data_tgt, c.data_dft, c.data_spec):  # CommonPromptCheckpoint.payloads(), without its list
            if p is not None:
                k = p.ident
                refs[k] = refs.get(k, 0) + 1
                objs[k] = p
    if server.prompt_cache is not None:
        for e in server.prompt_cache.states:
            for q in (e.data.main, e.data.drft):
                if q is not None:
                    k = q.ident
                    refs[k] = refs.get(k, 0) + 1
                    objs[k] = q
    return refs, objs


# ---- state invariants ---------------------------------------------------------------------


def check_accounting(server: ServerContext) -> None:
    """``size()`` and ``n_tokens()`` are the sums over entries; logical >= physical.

    Guards ``--cache-ram``: the limit is only as good as the size it is compared with. A size()
    that forgets checkpoints (the bug #25070 fixed) lets the cache hold more than configured. The
    logical charge counts a shared payload once per holder, so it may exceed the physical bytes of
    the cache's unique payloads (PR: conservative) but never fall below them.
    """
    cache = server.prompt_cache
    if cache is None:
        return
    expect_size = 0
    expect_tokens = 0
    unique: dict[int, int] = {}
    for i, e in enumerate(cache.states):
        entry = 0
        for p in (e.data.main, e.data.drft):  # ServerPromptCacheState.payloads(), in one walk
            if p is not None:
                entry += p.nbytes
                unique[p.ident] = p.nbytes
        for c in e.prompt.checkpoints.items:
            for p in (c.data_tgt, c.data_dft, c.data_spec):
                if p is not None:
                    entry += p.nbytes
                    unique[p.ident] = p.nbytes
        if e.size() != entry:
            _fail("accounting", f"cache[{i}].size() = {e.size()}, its payloads hold {entry} bytes")
        expect_size += entry
        expect_tokens += len(e.prompt.tokens)
    if cache.size() != expect_size:
        _fail("accounting", f"size() = {cache.size()}, sum over entries = {expect_size}")
    if cache.n_tokens() != expect_tokens:
        _fail("accounting", f"n_tokens() = {cache.n_tokens()}, sum over entries = {expect_tokens}")
    physical = sum(unique.values())
    if expect_size < physical:
        _fail("accounting", f"logical {expect_size} < physical unique {physical}")


def check_refcount(server: ServerContext) -> None:
    """Each payload's holder count equals its references; nothing unreferenced stays alive.

    Guards the PR's ownership model: a shared payload freed while a cache entry still points at it
    is a use-after-free, and one kept alive after its last holder is gone is a leak that
    ``--cache-ram`` cannot see.
    """
    refs, objs = _references(server)
    ledger = server.host.ledger
    for ident, n in refs.items():
        p = objs[ident]
        if p.released:
            _fail("refcount", f"payload #{ident} is referenced {n}x but was released (use after free)")
        if p.holders != n:
            _fail("refcount", f"payload #{ident} has holders={p.holders}, referenced {n}x")
    leaked = []
    live = 0
    for i, p in ledger.live.items():  # one pass for both
        live += p.nbytes
        if i not in refs:
            leaked.append(p)
    if leaked:
        _fail("refcount", f"{len(leaked)} payload(s) alive with no holder: {leaked[:3]}")
    if live != ledger.live_bytes:
        _fail("refcount", f"ledger live_bytes = {ledger.live_bytes}, live payloads hold {live}")


def _check_list(
    where: Holder, cps: CheckpointList, cap: int, excuse_swa_resume: bool, resumes: dict[int, int] | None = None
) -> None:
    """One list; ``where`` is ("cache", entry, -1) or ("slot", id, -1), named only on a failure."""
    prev: CommonPromptCheckpoint | None = None
    for c in cps.items:
        if prev is not None and c.n_tokens <= prev.n_tokens:
            # known upstream finding "swa-checkpoint-order": a checkpoint with pos_max == pos_next
            # survives the invalidation (it erases only pos_max > pos_next), so (a) after an SWA
            # checkpoint restore the slot resumes at pos_max = n_tokens - 1 and the next checkpoint
            # is created at or above prev.pos_max, or (b) the request was exactly pos_next tokens
            # long, [TAG_PROMPT_LOGITS] decremented n_past and c, made by that task, sits at
            # pos_next - 1 = prev.pos_max - 1
            quirk = prev.n_tokens > c.n_tokens >= prev.pos_max or (
                resumes is not None and resumes.get(c.id_task) == prev.pos_max and c.n_tokens == prev.pos_max - 1
            )
            if not (excuse_swa_resume and quirk):
                order = f"n_tokens not ascending ({prev.n_tokens} then {c.n_tokens})"
                _fail("checkpoint_lists", f"{_list_name(where)}: {order}")
        prev = c
    if cap > 0 and len(cps.items) > cap:  # the list's own len: no __len__ call (~27k a gate run on np3)
        _fail("checkpoint_lists", f"{_list_name(where)}: {len(cps)} checkpoints > n_ctx_checkpoints = {cap}")


def _list_name(h: Holder) -> str:
    return f"cache[{h[1]}]" if h[0] == "cache" else f"slot{h[1]}"


def check_checkpoint_lists(server: ServerContext, *, excuse_swa_resume: bool = False) -> None:
    """Checkpoint lists are ascending in ``n_tokens`` and no longer than ``n_ctx_checkpoints``.

    The restore search walks the list newest to oldest and takes the first usable one, and the cap
    evicts from the front; both rely on the order, and the cap is the only bound on per-slot
    checkpoint memory. ``excuse_swa_resume`` tolerates exactly the upstream pattern of the known
    finding ``swa-checkpoint-order`` so that the gate's main runs can explore past it.
    """
    cap = server.params.n_ctx_checkpoints
    resumes = getattr(server, "prompt_logits_resumes", None)
    if server.prompt_cache is not None:
        for i, e in enumerate(server.prompt_cache.states):
            _check_list(("cache", i, -1), e.prompt.checkpoints, cap, excuse_swa_resume, resumes)
    for s in server.slots:
        _check_list(("slot", s.id, -1), s.prompt.checkpoints, cap, excuse_swa_resume, resumes)


def _stale_prefix_explains(ctx: Any, seq: int, tokens: tuple[int, ...], stale: list[tuple[int, ...]]) -> bool:
    """Every memory component holds ``tokens``, or ``tokens`` with its first ``len(P)`` replaced by
    one prefix ``P`` that a stale checkpoint restore put there (``ServerContext.stale_restores``)."""
    comps = getattr(ctx, "seq_component_tokens", None)
    if comps is None:
        return False
    hists = comps(seq)
    for p in set(stale):
        m = min(len(p), len(tokens))
        if p[:m] == tokens[:m]:
            continue
        if all(h == tokens or (len(h) == len(tokens) and h[:m] == p[:m] and h[m:] == tokens[m:]) for h in hists):
            return True
    return False


def check_draft_in_step(server: ServerContext, *, excuse_stale_checkpoint: bool = False) -> None:
    """Each slot's target (and draft) memory describes exactly the slot's tokens.

    Guards every restore path: a cache load, a checkpoint restore, a speculative rollback and each
    failure recovery must leave target and draft at the same tokens as ``slot.prompt.tokens``;
    otherwise the next decode continues from a state that does not match the text.

    ``excuse_stale_checkpoint`` tolerates exactly the state of the known finding
    ``stale-checkpoint-after-miss``: the memory differs from the slot's tokens only in a prefix
    that a restored checkpoint, taken for another prompt, put there.
    """
    stale = getattr(server, "stale_restores", None) or []
    for s in server.slots:
        for ctx in (server.ctx_tgt, server.ctx_dft):
            if ctx is None:
                continue
            got = ctx.seq_tokens(s.id)
            if got != s.prompt.tokens:
                if excuse_stale_checkpoint and stale and _stale_prefix_explains(ctx, s.id, s.prompt.tokens, stale):
                    continue
                _fail(
                    "draft_in_step",
                    f"slot{s.id}: {ctx.name} memory describes {_short(got)}, slot tokens are {_short(s.prompt.tokens)}",
                )


def check_restore_equivalence(server: ServerContext) -> None:
    """No decode after a restore produced logits that differ from a fresh evaluation (real state only).

    The libllama provider compares, at the first decode after every successful ``set_data`` or
    truncating ``seq_rm``, the logits with those of the same token history decoded from scratch in
    a fresh context; synthetic providers have no logits and nothing to report.
    """
    for ctx in (server.ctx_tgt, server.ctx_dft):
        mismatches = getattr(ctx, "mismatches", None)
        if mismatches:
            _fail("restore_equivalence", mismatches[0].line())


def check_draft_recovery(server: ServerContext) -> None:
    """With ``ServerParams.draft_recovery``, no request fails because the draft context is full.

    ``draft_in_step`` checks, beside it, that the recovered slots' target and draft agree.
    """
    for slot_id, msg in server.errors:
        if msg == "failed to process speculative batch":
            _fail("draft_recovery", f"slot{slot_id}: the request failed with {msg!r} despite the recovery")


@dataclass
class Shadow:
    """What each live checkpoint's payload bytes were when last seen, for ``immutability``."""

    seen: dict[int, tuple[CommonPromptCheckpoint, Bytes3, Holder]] = field(default_factory=dict)

    def expect_update(self, ckpt: CommonPromptCheckpoint) -> None:
        """The owner rewrote this checkpoint on purpose: its new bytes become the expectation."""
        self.seen.pop(id(ckpt), None)

    def check(self, server: ServerContext) -> None:
        """A checkpoint's bytes never change while anyone holds it (``immutability``).

        Guards the PR's snapshot semantics: when a slot and a cache entry share a payload, a slot
        that rewrites its checkpoint in place would silently change the cache entry's snapshot,
        and a later restore from the cache would resume from the wrong state.
        """
        seen = self.seen
        now_seen: dict[int, tuple[CommonPromptCheckpoint, Bytes3, Holder]] = {}
        for h, c in _holders(server):
            if h[0] == "spec":
                continue  # the owner updates spec_ckpt in place by design; it is never shared
            now = _ckpt_bytes(c)
            key = id(c)
            prev = seen.get(key)
            if prev is not None and prev[0] is c and prev[1] != now:
                was, got = _digests(prev[1]), _digests(now)
                _fail("immutability", f"{_where(h)} ({c}) changed bytes while held (was {was}, now {got})")
            now_seen[key] = (c, now, h)
        self.seen = now_seen  # the checkpoints no longer held are forgotten


def check_state(server: ServerContext, shadow: Shadow | None = None) -> None:
    """All state invariants; raise the first :class:`Violation`."""
    check_accounting(server)
    check_refcount(server)
    check_checkpoint_lists(server)
    check_draft_in_step(server)
    if shadow is not None:
        shadow.check(server)


def clear_all(server: ServerContext) -> None:
    """Clear every slot and the cache, then physical live bytes must be 0 (``refcount``)."""
    for s in server.slots:
        s.prompt_clear()
        s.spec_ckpt.clear()
    cache = server.prompt_cache
    if cache is not None:
        while cache.states:
            cache._pop_front()
    if server.host.ledger.live_bytes != 0:
        _fail(
            "refcount",
            f"with every slot and the cache cleared, {server.host.ledger.live_bytes} bytes are still live: "
            f"{list(server.host.ledger.live.values())[:3]}",
        )


# ---- operation post-conditions ------------------------------------------------------------


class EntryView(NamedTuple):
    """An entry as it was: identity, tokens, checkpoints (held, compared by identity) with their bytes
    (:func:`_ckpt_bytes`), data identities. Compared field by field, as a tuple.

    The checkpoint objects themselves are kept, not their id(): a checkpoint freed meanwhile could
    hand its id() to a new one, and the views would compare equal although the list changed.
    """

    entry: ServerPromptCacheState  # compared by identity (a dataclass with eq=False)
    tokens: tuple[int, ...]
    ckpts: tuple[tuple[CommonPromptCheckpoint, Bytes3], ...]
    data: tuple[int | None, int | None]


def _view(e: ServerPromptCacheState) -> EntryView:
    main, drft = e.data.main, e.data.drft
    return EntryView(
        e,
        e.prompt.tokens,
        tuple([(c, _ckpt_bytes(c)) for c in e.prompt.checkpoints.items]),
        (None if main is None else main.ident, None if drft is None else drft.ident),
    )


SlotView = tuple[tuple[int, ...], tuple[tuple[CommonPromptCheckpoint, Bytes3], ...]]


def _slot_view(s: ServerSlot) -> SlotView:
    """A slot as it was; its checkpoints held (compared by identity), as in :class:`EntryView`."""
    return s.prompt.tokens, tuple([(c, _ckpt_bytes(c)) for c in s.prompt.checkpoints.items])


def _short(t: Any) -> str:
    if not isinstance(t, tuple):
        return repr(t)
    return repr(t) if len(t) <= 8 else f"({len(t)} tokens ending {t[-4:]})"


# one wrapping in TIMING_SAMPLE of each operation (per class, method and label, over every instance: a
# machine makes a new server per example) is timed, and its seconds count TIMING_SAMPLE times. The others
# are the bare post-condition: timing every call cost 3% of a machine's CPU (two more frames and
# four clock reads around each of ~36k operations on np3, and a third closure per wrapping)
TIMING_SAMPLE = 4
_TICKS: dict[tuple[str, str, str], list[int]] = {}


def wrap_timed(
    obj: Any,
    name: str,
    post: Callable[..., Any],
    bound: tuple[Any, ...],
    seconds: dict[str, float],
    label: str,
) -> None:
    """Replace ``obj.name`` by ``partial(post, *bound, original)``: the post-condition, called with the
    original method and then the operation's arguments. The time spent outside the original is charged
    to ``seconds[label]``, the post-condition that the wrapper checks (the tracers' one wrapping).

    A ``functools.partial`` of the tracer's own function, not a closure made per wrapping: an example
    wraps ~16 methods, and each closure with its cells was five objects the collector tracks and
    promotes while the example runs; a partial is two.

    The post-condition always runs; one wrapping in :data:`TIMING_SAMPLE` of each operation is timed, and
    counts :data:`TIMING_SAMPLE` times: ``seconds`` is an estimate.
    """
    original = getattr(obj, name)
    tick = _TICKS.setdefault((type(obj).__qualname__, name, label), [0])
    tick[0] += 1
    if tick[0] % TIMING_SAMPLE:
        setattr(obj, name, partial(post, *bound, original))
        return
    inner_time = [0.0]

    def timed_inner(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return original(*a, **kw)
        finally:
            inner_time[0] += time.perf_counter() - t0

    wrapped = partial(post, *bound, timed_inner)

    def outer(*a: Any, **kw: Any) -> Any:
        t0 = time.perf_counter()
        before = inner_time[0]
        try:
            return wrapped(*a, **kw)
        finally:
            seconds[label] += TIMING_SAMPLE * ((time.perf_counter() - t0) - (inner_time[0] - before))

    setattr(obj, name, outer)


def unwrap(wrapped: Sequence[tuple[Any, str]]) -> None:
    """Remove the wrappers :func:`wrap_timed` set on instances (the class's method shows again)."""
    for obj, name in wrapped:
        vars(obj).pop(name, None)  # two tracers may wrap one method: the outer wrapper is the attribute


def release(server: ServerContext, *tracers: Any) -> None:
    """After an example: cut the reference cycles of ``server`` so that reference counting frees it.

    The wrappers (partials of the tracers, which hold the server, set on the server's own objects) and
    the slots' back-references make the whole server a cycle, which only a collection of the generation
    it reached frees: the few hundred objects of an example live through a few collections and reach
    the oldest generation, adding a full collection (~70 ms on the bench's heap) every ~100 examples.
    The server is not usable after.
    """
    for t in tracers:
        t.unwrap()
    server.slots.clear()  # ServerSlot.server points back at the server


_STEPS = [0]  # run_checks calls over every machine


def run_checks(checks: Sequence[tuple[str, Callable[[Any], None]]], server: Any, seconds: Counter[str]) -> None:
    """Run every check on ``server``; one call in :data:`TIMING_SAMPLE` (over all machines) is timed,
    each check's seconds counting that many times (two clock reads and a Counter update per check
    and step were ~1% of a machine's CPU). The checks change nothing, so they share one walk of the
    holders (:func:`_holders`), charged to the first that asks."""
    _STEPS[0] += 1
    _WALK[0], _WALK[1] = server, None  # the first check that walks the holders builds the list
    try:
        if _STEPS[0] % TIMING_SAMPLE:
            for _, check in checks:
                check(server)
            return
        for name, check in checks:
            t0 = time.perf_counter()
            check(server)
            seconds[name] += TIMING_SAMPLE * (time.perf_counter() - t0)  # type: ignore[assignment]
    finally:
        _WALK[0] = _WALK[1] = None


# which property each wrapped method's post-condition belongs to (for the timing report)
_WRAPPED_CHECK = {
    "alloc": "no_partial_entries",
    "load": "load_transfer",
    "update": "limit",
    "prompt_save": "transient_peak",
    "_start_prompt": "checkpoint_lists",
    "handle_completion": "busy_slot_untouched",
    "prompt_clear": "cleared_checkpoints",
}


class Tracer:
    """Wraps one server instance's cache and slot operations with their post-conditions.

    ``findings`` collects the values the report shows (``transient_peak`` ratios for ``master``).
    ``strict_peak``: fail the ``transient_peak`` property (True), or only record figures.
    ``wrap=False`` wraps nothing: no post-condition runs (the bench prices them that way).
    """

    def __init__(
        self, server: ServerContext, *, strict_peak: bool = True, shadow: Shadow | None = None, wrap: bool = True
    ) -> None:
        self.server = server
        self.strict_peak = strict_peak
        self.shadow = shadow
        self.peaks: list[tuple[int, int, int]] = []  # (peak excess, bound, S) per save
        self.checked: Counter[str] = Counter()
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.wrapped: list[tuple[Any, str]] = []  # (instance, method name) replaced by a wrapper
        if not wrap:
            return
        cache = server.prompt_cache
        cls = type(self)
        if cache is not None:
            self._wrap(cache, "alloc", cls._alloc)
            self._wrap(cache, "load", cls._load)
            self._wrap(cache, "update", cls._update)
        for s in server.slots:
            self._wrap(s, "prompt_save", cls._save, s)
            self._wrap(s, "prompt_clear", cls._clear, s)
        self._wrap(server, "_start_prompt", cls._start_prompt)
        self._wrap(server, "handle_completion", cls._handle)

    def _wrap(self, obj: Any, name: str, post: Callable[..., Any], *extra: Any) -> None:
        """``obj.name`` becomes ``post(self, *extra, original, *args)`` (:func:`wrap_timed`)."""
        wrap_timed(obj, name, post, (self, *extra), self.seconds, _WRAPPED_CHECK[name])
        self.wrapped.append((obj, name))

    def unwrap(self) -> None:
        """Give the instances their own methods back (:func:`release`)."""
        unwrap(self.wrapped)

    # limit + no_prefix_entries + no_partial_entries
    def _alloc(self, inner: Callable[..., Any], prompt: Any, size_tgt: int, size_dft: int) -> Any:
        server = self.server
        cache = server.prompt_cache
        assert cache is not None
        seam = server.host.seam
        armed = seam.armed  # unarmed, no allocation can fail: nothing to compare the cache with
        before = [_view(e) for e in cache.states] if armed else []
        size_before = cache.size() if armed else 0
        limit_before = cache.limit_size
        fired_before = seam.fired
        res = inner(prompt, size_tgt, size_dft)
        fired = seam.fired > fired_before
        if res is not None:
            self.checked["limit"] += 1
            if cache.limit_size > 0 and cache.size() > cache.limit_size:
                _fail("limit", f"after alloc size() = {cache.size()} > limit_size = {cache.limit_size}")
            self.checked["no_prefix_entries"] += 1
            toks = [e.prompt.tokens for e in cache.states]
            # in sorted order everything between a and a longer b that starts with a starts with a too:
            # a prefix pair exists iff two neighbours are one; then the pair is named by index
            srt = sorted(toks)
            if any(b[: len(a)] == a for a, b in itertools.pairwise(srt)):
                for i, a in enumerate(toks):
                    for j, b in enumerate(toks):
                        if i != j and len(a) <= len(b) and b[: len(a)] == a:
                            _fail(
                                "no_prefix_entries",
                                f"entry {i} ({_short(a)}) is a prefix of entry {j} ({_short(b)})",
                            )
        if fired:
            self.checked["no_partial_entries"] += 1
            if res is not None:
                _fail("no_partial_entries", "alloc returned an entry although an allocation failed inside it")
            after = [_view(e) for e in cache.states]
            old_ids = {id(v.entry): v for v in before}
            idx = [list(old_ids).index(id(v.entry)) if id(v.entry) in old_ids else -1 for v in after]
            for v, i in zip(after, idx, strict=True):
                if i < 0:
                    _fail("no_partial_entries", f"a new entry ({_short(v.tokens)}) survived a failed allocation")
                if old_ids[id(v.entry)] != v:
                    _fail("no_partial_entries", f"entry {_short(v.tokens)} changed during a failed allocation")
            if idx != sorted(idx):
                _fail("no_partial_entries", "entries were reordered by a failed allocation")
            cap = max(1, int(0.4 * size_before))
            if cache.limit_size != limit_before and cache.limit_size > cap:
                _fail("no_partial_entries", f"limit_size became {cache.limit_size}, above max(1, 0.4*size) = {cap}")
        return res

    def _save(self, slot: ServerSlot, inner: Callable[..., Any], cache: ServerPromptCache) -> Any:
        server = self.server
        seam = server.host.seam
        before = _slot_view(slot) if seam.armed else None  # unarmed, no allocation can fail
        fired_before = seam.fired
        last_before = server.host.last_op
        res = inner(cache)
        if seam.fired > fired_before and _slot_view(slot) != before:
            _fail("no_partial_entries", f"slot{slot.id} changed during a save that failed to allocate")
        op = server.host.last_op  # the save's own operation (an empty prompt opens none)
        if op is not None and op is not last_before and op.name == "save":
            self._check_peak(op)
        return res

    def _clear(self, slot: ServerSlot, inner: Callable[..., Any]) -> Any:
        """``cleared_checkpoints``: ``server_slot::prompt_clear`` (server-context.cpp:293) leaves nothing."""
        res = inner()
        self.checked["cleared_checkpoints"] += 1
        if slot.prompt.tokens or len(slot.prompt.checkpoints):
            _fail("cleared_checkpoints", f"slot{slot.id} holds {len(slot.prompt.tokens)} tokens and "
                  f"{len(slot.prompt.checkpoints)} checkpoints after prompt_clear")  # fmt: skip
        return res

    def _check_peak(self, op: OperationStats) -> None:
        """``transient_peak``: bound = S + value-owned spec bytes; metadata within its own bound."""
        self.checked["transient_peak"] += 1
        bound = op.state_bytes + op.spec_bytes
        self.peaks.append((op.peak_excess, bound, op.state_bytes))
        meta_bound = (
            TOKEN_BYTES * op.n_tokens
            + (LIST_NODE_BYTES + CHECKPOINT_HEADER_BYTES) * op.n_checkpoints
            + LIST_NODE_BYTES
            + ENTRY_HEADER_BYTES
        )
        if not self.strict_peak:
            return
        if op.peak_excess > bound:
            _fail(
                "transient_peak",
                f"save peak exceeded live bytes by {op.peak_excess} > S + spec = {bound} "
                f"(S = {op.state_bytes}; the excess {op.peak_excess - bound} is copied checkpoint payload)",
            )
        if op.meta_bytes > meta_bound:
            _fail("transient_peak", f"save allocated {op.meta_bytes} metadata bytes > bound {meta_bound}")

    # limit (bytes and tokens) after update
    def _update(self, inner: Callable[..., Any]) -> Any:
        server = self.server
        cache = server.prompt_cache
        assert cache is not None
        # the token limit as update() computes it on entry, after its byte-limit pass (without a byte
        # limit, the token limit itself: no size is read)
        if cache.limit_size > 0:
            sizes = [(e.size(), len(e.prompt.tokens)) for e in cache.states]
            total_b, total_n, first = sum(b for b, _ in sizes), sum(n for _, n in sizes), 0
            while first < len(sizes) and total_b > cache.limit_size:
                total_b -= sizes[first][0]
                total_n -= sizes[first][1]
                first += 1
            # size per token = max(1, B / max(1, N)) exactly; limit_size / spt in integers (floor, as int())
            n_div = max(1, total_n)
            per = cache.limit_size if total_b <= n_div else cache.limit_size * n_div // total_b
            limit_cur = max(cache.limit_tokens, per)
        else:
            limit_cur = cache.limit_tokens
        res = inner()
        self.checked["limit"] += 1
        if cache.limit_size > 0 and cache.size() > cache.limit_size:
            _fail("limit", f"after update size() = {cache.size()} > limit_size = {cache.limit_size}")
        # upstream computes in float: allow one token per 2**22 of rounding
        if cache.limit_tokens > 0 and cache.n_tokens() > limit_cur + 1 + limit_cur // (1 << 22):
            _fail("limit", f"after update n_tokens() = {cache.n_tokens()} > token limit {limit_cur}")
        return res

    # load_transfer
    def _load(
        self,
        inner: Callable[..., Any],
        prompt: Any,
        tokens_new: tuple[int, ...],
        ctx_tgt: Any,
        ctx_dft: Any,
        id_slot: int,
    ) -> Any:
        server = self.server
        cache = server.prompt_cache
        assert cache is not None
        before = [_view(e) for e in cache.states]
        slot_tokens = prompt.tokens
        res = inner(prompt, tokens_new, ctx_tgt, ctx_dft, id_slot)
        self.checked["load_transfer"] += 1
        after = [_view(e) for e in cache.states]
        if after == before:
            return res
        if not res:
            _fail("load_transfer", "load failed and left the cache changed (an entry lost part of its state)")
        gone = [v for v in before if all(v.entry is not a.entry for a in after)]
        if len(gone) != 1 or [v for v in before if v not in gone] != after:
            _fail("load_transfer", f"load removed {len(gone)} entries or changed the others")
        e = gone[0]
        if prompt.tokens != e.tokens:
            _fail("load_transfer", "the slot did not receive the chosen entry's tokens")
        if [id(c) for c in prompt.checkpoints] != [id(c) for c, _ in e.ckpts]:  # e.ckpts: held, see EntryView
            _fail("load_transfer", "the slot's checkpoints are not the entry's (copied, not moved)")
        lcp_slot = get_common_prefix(slot_tokens, tokens_new)
        lcp = get_common_prefix(e.tokens, tokens_new)
        # exact rationals, cross-multiplied: f_keep = lcp / |entry|, f_keep_slot = lcp_slot / |slot| (-1
        # for an empty slot), f_sim = lcp / |new| (the same denominator for entry and slot)
        n_e, n_s = len(e.tokens), len(slot_tokens)
        if 4 * lcp < n_e:
            _fail("load_transfer", f"chosen entry has f_keep = {lcp / n_e:.3f} < 0.25")
        if not ((not slot_tokens or lcp * n_s > lcp_slot * n_e) and lcp > lcp_slot):
            _fail("load_transfer", "chosen entry does not beat the slot on both f_keep and f_sim")
        return res

    # checkpoint_lists: invalidation against the resume position
    def _start_prompt(self, inner: Callable[..., Any], slot: ServerSlot) -> Any:
        res = inner(slot)
        if slot.is_processing():
            self.checked["checkpoint_lists"] += 1
            for c in slot.prompt.checkpoints.items:
                if c.pos_max > slot.pos_next:
                    _fail(
                        "checkpoint_lists",
                        f"slot{slot.id}: checkpoint pos_max {c.pos_max} > resume position {slot.pos_next}",
                    )
        return res

    # busy_slot_untouched
    def _handle(self, inner: Callable[..., Any], *a: Any, **kw: Any) -> Any:
        server = self.server
        res = inner(*a, **kw)
        self.checked["busy_slot_untouched"] += 1
        for ev in server.events:
            if ev.slot_processing:
                _fail("busy_slot_untouched", f"prompt_{ev.op} ran on slot{ev.slot} while it was processing")
        return res
