"""Upstream's POLICY as properties: which entry a load picks, which entries are evicted, how
checkpoints are thinned, what a failed restore leaves behind, and what a restore puts in memory.

The safety properties in :mod:`properties.invariants` accept any cache that stays within its limits
and keeps its books; these ones accept only the cache upstream implements. Each check re-derives
the expected choice from upstream's rules, written down here from the vendored source (llama.cpp
0c1e570, llama-cpp-python 0.3.36; ``S-T.cpp`` = tools/server/server-task.cpp, ``S-C.cpp`` =
tools/server/server-context.cpp, ``c.cpp`` = common/common.cpp), and never calls the model's
functions to do so: prefixes, sizes (summed from payload bytes), float rounding and the scans are
computed here.

=====================  ===========================================================================
property               what is computed
=====================  ===========================================================================
``load_choice``        the entry ``load`` moves into the slot: upstream's front-to-back scan
                       (S-T.cpp:1793-1823): skip ``f_keep < 0.25``; take an entry only if it beats
                       the best so far on both ``f_keep`` and ``f_sim`` (strict, in binary32); the
                       slot is the initial best (``f_keep = -1`` when empty). None: nothing moves.
``alloc_eviction``     the entries left after ``alloc`` (S-T.cpp:1711-1791): contained prompt or
                       over-limit entry: none removed; else every entry that is a prefix of the new
                       prompt, then oldest-first while ``size() + need > limit_size``; a failed
                       allocation: ``limit_size = max(1, (size_t)(0.4 * size()))`` then ``update()``.
``update_eviction``    the entries left after ``update`` (S-T.cpp:1870-1892): oldest-first while
                       ``size() > limit_size`` (if set); then ``limit_tokens_cur`` in binary32 and
                       oldest-first while ``n_tokens() > limit_tokens_cur``; exactly those, no more.
``checkpoint_policy``  the list after ``create_checkpoint`` (S-C.cpp:2290-2345): min-step thinning
                       only while the list is full (``size()+1 >= n_ctx_checkpoints``), sparing the
                       current task's; then the count cap from the front; a checkpoint at the same
                       ``n_tokens`` is superseded; the new one is appended. And the creation gate
                       (S-C.cpp:3567, 3585-3590, 3605-3609) held when it was called.
``restore_failure``    a cache load whose restore fails (S-T.cpp:1832-1836) leaves every entry in
                       place and the caller clears the slot (S-C.cpp:1630-1632, 293-296); a
                       checkpoint restore that fails aborts the server (c.cpp:2335-2338, 2353-2356).
``restore_bytes``      synthetic backend: right after a cache load or a checkpoint restore the
                       restored state equals, byte for byte, a fresh evaluation of the tokens it
                       stands for (or, when the saved state itself was not canonical, the saved
                       bytes).
=====================  ===========================================================================

:class:`PolicyTracer` wraps one live server's operations (outside :class:`~properties.invariants.Tracer`,
so a safety property that is broken is reported by its own name first).

Size: each policy property recomputes one of upstream's choices (load, evictions, token limit, checkpoint
thinning, failed restores, restored bytes) independently of the model; they share one tracer.
"""

from __future__ import annotations

import struct
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any, NamedTuple

from harness.errors import GgmlAbort
from harness.model.provider import STATE_SEQ_FLAGS_NONE, STATE_SEQ_FLAGS_PARTIAL_ONLY, SyntheticProvider
from harness.model.server_context import ServerContext
from properties.invariants import INVARIANTS, Violation, unwrap, wrap_timed

__all__ = [
    "POLICY",
    "ExpectedAbort",
    "PolicyTracer",
    "expected_alloc",
    "expected_checkpoints",
    "expected_load_choice",
    "expected_update",
]

Tokens = tuple[int, ...]

# the policy properties, described in INVARIANTS (the gate's list of properties) with the others
POLICY: dict[str, str] = {
    k: INVARIANTS[k]
    for k in (
        "load_choice",
        "alloc_eviction",
        "update_eviction",
        "checkpoint_policy",
        "restore_failure",
        "restore_bytes",
    )
}


class ExpectedAbort(GgmlAbort):
    """The modelled server aborted where upstream aborts (a failed checkpoint restore)."""


def _fail(name: str, message: str) -> None:
    raise Violation(name, message)


def _f32(x: float) -> float:
    """IEEE binary32 rounding (a C++ ``float``); float division rounded once from double is exact."""
    return _F32.unpack(_F32.pack(x))[0]  # type: ignore[no-any-return]


_F32 = struct.Struct("<f")
_F32_EXACT = 1 << 24  # every integer below it is exact in binary32 (a 24-bit significand)


def _lcp(a: Tokens, b: Tokens) -> int:
    """``server_tokens::get_common_prefix`` for text tokens (server-common.cpp:697)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# ---- the expected choices -----------------------------------------------------------------


def expected_load_choice(slot_tokens: Tokens, tokens_new: Tokens, entries: Sequence[Tokens]) -> int | None:
    """Index of the entry upstream's ``load`` scan picks (S-T.cpp:1794-1823), or None.

    ``f_keep_best = lcp/len(slot)`` or -1 for an empty slot (:1796), ``f_sim_best = lcp/len(new)``
    (:1797); per entry, front to back: skip ``f_keep < 0.25f`` (:1813), take it if
    ``f_keep_best < f_keep && f_sim_best < f_sim`` (:1817) and raise both bests (:1818-1819).
    An empty entry (never made: prompt_save returns early, S-C.cpp:259) divides 0/0: NaN is never
    taken.
    """
    lcp0 = _lcp(slot_tokens, tokens_new)
    keep_best = _f32(lcp0 / len(slot_tokens)) if slot_tokens else -1.0
    sim_best = _f32(lcp0 / len(tokens_new))
    best: int | None = None
    for i, t in enumerate(entries):
        if not t:
            continue
        lcp = _lcp(t, tokens_new)
        keep = _f32(lcp / len(t))
        sim = _f32(lcp / len(tokens_new))
        if keep < 0.25:
            continue
        if keep_best < keep and sim_best < sim:
            keep_best, sim_best, best = keep, sim, i
    return best


def expected_update(
    entries: Sequence[tuple[int, int]], limit_size: int, limit_tokens: int, alive: Sequence[int] | None = None
) -> list[int]:
    """Indices of ``entries`` (``(n_tokens, bytes)``, front = oldest) that ``update`` keeps (S-T.cpp:1870-1892).

    Byte pass (:1871-1877): pop the front while ``size() > limit_size`` (if ``limit_size > 0``).
    ``size_per_token = max(1.0f, float(size()) / max(1, n_tokens()))`` (:1880);
    ``limit_tokens_cur = limit_size > 0 ? max(limit_tokens, (size_t)(limit_size / spt)) : limit_tokens``
    (:1883), computed once; token pass (:1885-1891): pop the front while ``n_tokens() > cur``.
    """
    return _update_passes(entries, limit_size, limit_tokens, alive)[0]


def _update_passes(
    entries: Sequence[tuple[int, int]], limit_size: int, limit_tokens: int, alive: Sequence[int] | None = None
) -> tuple[list[int], int]:
    """:func:`expected_update`'s survivors, and how many entries its byte pass alone pops (the branch
    the check exercised, without a second computation)."""
    keep = list(range(len(entries))) if alive is None else list(alive)
    size = sum(entries[i][1] for i in keep)  # size() and n_tokens() of the kept entries, kept current
    n_tokens = sum(entries[i][0] for i in keep)
    first = 0  # keep[first:] survive: popping the front is advancing first
    if limit_size > 0:
        while first < len(keep) and size > limit_size:
            size -= entries[keep[first]][1]
            n_tokens -= entries[keep[first]][0]
            first += 1
    by_bytes = first
    # f32 of an integer below 2**24 is its float (exact in binary32): two roundings a pass, not four
    n_div = max(1, n_tokens)
    f_size = float(size) if size < _F32_EXACT else _f32(float(size))
    spt = max(1.0, _f32(f_size / (float(n_div) if n_div < _F32_EXACT else _f32(float(n_div)))))
    if limit_size > 0:
        f_limit = float(limit_size) if limit_size < _F32_EXACT else _f32(float(limit_size))
        cur = max(limit_tokens, int(_f32(f_limit / spt)))
    else:
        cur = limit_tokens
    if limit_tokens > 0:
        while first < len(keep) and n_tokens > cur:
            size -= entries[keep[first]][1]
            n_tokens -= entries[keep[first]][0]
            first += 1
    return keep[first:], by_bytes


@dataclass(frozen=True)
class AllocPlan:
    """What ``alloc`` should do: ``insert`` (append after ``survivors``) or return None with ``survivors``."""

    outcome: str  # "contained" | "over-limit" | "insert"
    survivors: list[int]
    recovered_limit: int  # limit_size after the bad_alloc recovery
    entries: Sequence[tuple[Tokens, int]] = ()  # (tokens, bytes) per entry, for :attr:`recovered`
    limit_tokens: int = 0

    @cached_property
    def recovered(self) -> list[int]:
        """Survivors of the bad_alloc recovery (limit reduction + update). Computed when asked: only a
        save whose allocation failed reads it (on np3 no save can fail, and 1.8k allocs a gate run
        computed it for nothing)."""
        if self.outcome != "insert":
            return self.survivors
        sizes = [(len(t), b) for t, b in self.entries]
        return expected_update(sizes, self.recovered_limit, self.limit_tokens, self.survivors)


def expected_alloc(
    entries: Sequence[tuple[Tokens, int]], prompt: Tokens, need: int, limit_size: int, limit_tokens: int
) -> AllocPlan:
    """The entries ``alloc`` keeps (S-T.cpp:1711-1791), with and without a failed allocation.

    :1713-1720 any entry with ``lcp == len(prompt)``: None, nothing changes. :1730-1735
    ``limit_size > 0 && need > limit_size``: None, nothing changes. :1737-1748 erase every entry
    with ``lcp == len(entry)``. :1750-1758 pop the front while ``size() + need > limit_size``.
    :1767-1776 on ``bad_alloc``: ``limit_size = max<size_t>(1, 0.4*size())`` and ``update()``.
    """
    everyone = list(range(len(entries)))
    lcps = [_lcp(t, prompt) for t, _ in entries]  # each entry's, once: both scans read it
    n_prompt = len(prompt)
    if n_prompt in lcps:
        return AllocPlan("contained", everyone, limit_size)
    if limit_size > 0 and need > limit_size:
        return AllocPlan("over-limit", everyone, limit_size)
    keep = [i for i, (t, _) in enumerate(entries) if lcps[i] != len(t)]
    size = sum(entries[i][1] for i in keep)
    if limit_size > 0:
        first = 0
        while first < len(keep) and size + need > limit_size:
            size -= entries[keep[first]][1]
            first += 1
        keep = keep[first:]
    reduced = max(1, int(0.4 * size))
    return AllocPlan("insert", keep, reduced, entries, limit_tokens)


class CkptView(NamedTuple):
    """A checkpoint as create_checkpoint's rules see it."""

    ident: int
    n_tokens: int
    id_task: int


def expected_checkpoints(
    before: Sequence[CkptView], id_task: int, n_ctx_checkpoints: int, min_step: int, n_tokens_new: int
) -> list[int]:
    """Identities of the old checkpoints ``create_checkpoint`` keeps, in order (S-C.cpp:2290-2330).

    :2296-2310 walk front to back while ``size() + 1 >= n_ctx_checkpoints`` (re-evaluated after each
    erase): erase ``it`` if ``it.id_task != id_task && last >= 0 && it.n_tokens <= last + min_step``,
    else ``last = it.n_tokens``. :2312-2319 pop the front while ``size() >= n_ctx_checkpoints``.
    :2322-2332 erase every checkpoint with ``n_tokens == n_tokens_new``. Then one is appended.
    """
    items = list(before)
    last = -1
    i = 0
    while len(items) + 1 >= n_ctx_checkpoints and i < len(items):
        it = items[i]
        if it.id_task != id_task and last >= 0 and it.n_tokens <= last + min_step:
            del items[i]
            continue
        last = it.n_tokens
        i += 1
    while len(items) >= n_ctx_checkpoints:
        del items[0]
    return [c.ident for c in items if c.n_tokens != n_tokens_new]


def _short(t: Tokens) -> str:
    return repr(t) if len(t) <= 8 else f"({len(t)} tokens ending {t[-4:]})"


def _payload_bytes(obj: Any) -> int:
    n = 0
    for p in obj:
        if p is not None:
            n += p.nbytes
    return n


def _entry_bytes(e: Any) -> int:
    """``server_prompt_cache_state::size()`` (S-T.h:601) summed from the payloads themselves."""
    n = _payload_bytes((e.data.main, e.data.drft))
    for c in e.prompt.checkpoints.items:
        n += _payload_bytes((c.data_tgt, c.data_dft, c.data_spec))
    return n


# fresh_state's results: a pure function of the model's parameters, the tokens and the flags (~700
# calls a gate run on np3, a new provider and a decode each; two in three repeat one seen before)
_FRESH: dict[tuple[Any, ...], bytes] = {}


def fresh_state(ctx: SyntheticProvider, tokens: Tokens, flags: int) -> bytes:
    """The state a fresh context of the same model holds after evaluating ``tokens`` from scratch.

    Remembered in this process (up to 4096 states, then all forgotten at once): the bytes are
    immutable and fixed by the key, so a remembered state is the state computed again."""
    key = (ctx.kind, ctx.kv_bpt, ctx.rs_bytes, ctx.window, ctx.seed, tuple(tokens), flags)
    state = _FRESH.get(key)
    if state is None:
        if len(_FRESH) >= 4096:
            _FRESH.clear()
        state = _FRESH[key] = _fresh_state(ctx, tokens, flags)
    return state


def _fresh_state(ctx: SyntheticProvider, tokens: Tokens, flags: int) -> bytes:
    fresh = SyntheticProvider(
        ctx.kind,
        name="fresh",
        n_seq=1,
        n_ctx=max(1, 2 * len(tokens) + 1),
        kv_bytes_per_token=ctx.kv_bpt,
        rs_bytes=ctx.rs_bytes,
        window=ctx.window,
        seed=ctx.seed,
    )
    if tokens and fresh.decode(0, tokens, 0) != 0:
        raise RuntimeError("a fresh context could not evaluate the tokens")
    return fresh.state_seq_get_data_ext(0, flags)


@dataclass
class _Restore:
    ctx: str
    seq: int
    flags: int
    ok: bool
    state: bytes | None  # the sequence's state right after a successful read (synthetic only)


class PolicyTracer:
    """Wraps one server instance's cache, checkpoint and slot-selection operations with the policy checks.

    ``checked`` counts checks per property; ``branches`` counts which upstream branch each check
    exercised (``update_eviction:tokens`` ...), to show that every rule is reached.
    """

    def __init__(self, server: ServerContext, *, excuse_stale: bool = True, wrap: bool = True) -> None:
        self.server = server
        self.excuse_stale = excuse_stale
        self.checked: Counter[str] = Counter()
        self.branches: Counter[str] = Counter()
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self._restores: list[_Restore] = []
        # read the state back after each restore only while _start_prompt will check it: the restores of
        # the speculative rounds and of cache loads (~3.9k a gate run on hybrid_draft) are not read
        self._want_state = False
        self._failed_load_prompt: Any = None
        self.synthetic = isinstance(server.ctx_tgt, SyntheticProvider)
        self.wrapped: list[tuple[Any, str]] = []  # (instance, method name) replaced by a wrapper
        if not wrap:  # no check runs (the bench prices them that way)
            return
        cache = server.prompt_cache
        cls = type(self)
        if cache is not None:
            self._wrap(cache, "load", cls._load, "load_choice")
            self._wrap(cache, "alloc", cls._alloc, "alloc_eviction")
            self._wrap(cache, "update", cls._update, "update_eviction")
        self._wrap(server, "create_checkpoint", cls._create_checkpoint, "checkpoint_policy")
        self._wrap(server, "_start_prompt", cls._start_prompt, "restore_failure")
        self._wrap(server, "get_available_slot", cls._get_available_slot, "restore_failure")
        for ctx in (server.ctx_tgt, server.ctx_dft):
            if ctx is not None:
                self._wrap(ctx, "state_seq_set_data_ext", cls._set_data, "restore_bytes", ctx)

    def _wrap(self, obj: Any, name: str, post: Callable[..., Any], label: str, *extra: Any) -> None:
        """``obj.name`` becomes ``post(self, *extra, original, *args)`` (:func:`wrap_timed`)."""
        wrap_timed(obj, name, post, (self, *extra), self.seconds, label)
        self.wrapped.append((obj, name))

    def unwrap(self) -> None:
        """Give the instances their own methods back (:func:`properties.invariants.release`)."""
        unwrap(self.wrapped)

    # ---- restores as libllama sees them ------------------------------------------------------

    def _set_data(self, ctx: Any, inner: Callable[..., Any], seq: int, data: bytes, flags: int) -> int:
        n = int(inner(seq, data, flags))
        ok = n == len(data)
        state = ctx.state_seq_get_data_ext(seq, flags) if ok and self._want_state else None
        self._restores.append(_Restore(ctx.name, seq, flags, ok, state))
        return n

    def _check_bytes(
        self,
        what: str,
        ctx: Any,
        seq: int,
        got: bytes | None,
        tokens: Tokens,
        saved: bytes,
        flags: int,
        resume: int | None = None,
    ) -> None:
        """``restore_bytes``: the restored state is a fresh evaluation of the tokens it stands for.

        Every restored memory component must hold the slot's tokens: all of them after a cache
        load, the first ``resume`` after a checkpoint restore (upstream truncates to the resume
        point right after it, S-C.cpp:3345-3346, 3384-3390). Its bytes must be a fresh evaluation of
        the history the saved state holds or, when the saved state itself was not canonical (the
        synthetic SWA window after a truncation keeps fewer cells than a fresh evaluation), the
        saved bytes exactly.
        """
        if not self.synthetic or got is None:
            return
        self.checked["restore_bytes"] += 1
        n = len(tokens) if resume is None else resume
        parsed = ctx._parse(got, flags) if got else None  # the histories the restored components hold
        hists = [h for _, h, _ in parsed or []]
        bad = [h for h in hists if len(h) < n or h[:n] != tokens[:n] or (resume is None and h != tokens)]
        stale = self.server.stale_restores[-1:] if self.excuse_stale and resume is not None else []
        if parsed and bad and stale and all(h[: len(stale[0])] == stale[0] for h in bad):
            # exactly the known finding stale-checkpoint-after-miss: the restored checkpoint was made
            # for another prompt and the model recorded it as such (strict machines do not excuse it)
            self.branches["restore_bytes:stale-checkpoint-after-miss"] += 1
            return
        if not parsed or bad:
            _fail(
                "restore_bytes",
                f"{what}: {ctx.name} slot{seq} holds {[_short(h) for h in hists] if parsed else 'no valid state'} "
                f"after the restore; the slot resumes from {_short(tokens[:n])}",
            )
        saved_hists = {h for _, h, _ in ctx._parse(saved, flags) or []}
        own = next(iter(saved_hists)) if len(saved_hists) == 1 else tokens
        fresh = fresh_state(ctx, own, flags)
        if saved == fresh:
            self.branches["restore_bytes:fresh"] += 1
            if got != fresh:
                _fail(
                    "restore_bytes",
                    f"{what}: {ctx.name} state after the restore is not a fresh evaluation "
                    f"of the {len(own)} tokens it stands for",
                )
        else:
            self.branches["restore_bytes:as-saved"] += 1
            if got != saved:
                _fail("restore_bytes", f"{what}: {ctx.name} state after the restore differs from the saved bytes")

    # ---- load ------------------------------------------------------------------------------

    def _load(
        self, inner: Callable[..., Any], prompt: Any, tokens_new: Tokens, ctx_tgt: Any, ctx_dft: Any, id_slot: int
    ) -> Any:
        server = self.server
        cache = server.prompt_cache
        assert cache is not None
        before = list(cache.states)
        toks = [e.prompt.tokens for e in before]
        slot_tokens = prompt.tokens
        pick = expected_load_choice(slot_tokens, tokens_new, toks)
        saved: tuple[bytes, bytes | None] | None = None
        if pick is not None:
            e = before[pick]
            main, drft = e.data.main, e.data.drft
            saved = (main.data if main is not None else b"", drft.data if drft is not None else None)
        self._restores.clear()
        res = inner(prompt, tokens_new, ctx_tgt, ctx_dft, id_slot)
        after = list(cache.states)
        self.checked["load_choice"] += 1
        if pick is None:
            self.branches["load_choice:none"] += 1
            if after != before or prompt.tokens != slot_tokens or res is not True:
                _fail(
                    "load_choice",
                    "no entry beats the slot on f_keep and f_sim (S-T.cpp:1817), yet the load moved one or failed",
                )
            return res
        if not res:
            # restore_failure: the entry whose restore failed stays, and so does every other
            self.checked["restore_failure"] += 1
            self.branches["restore_failure:load"] += 1
            if after != before:
                _fail(
                    "restore_failure",
                    "a failed load changed the cache's entries (S-T.cpp:1832-1836 returns before erasing)",
                )
            self._failed_load_prompt = prompt
            return res
        self.branches["load_choice:entry"] += 1
        want = [e for i, e in enumerate(before) if i != pick]
        if after != want or prompt.tokens != toks[pick]:
            got = next((i for i, e in enumerate(before) if e not in after), None)
            _fail(
                "load_choice",
                f"load took entry {got} of {len(before)}; upstream's scan (S-T.cpp:1803-1823) "
                f"picks entry {pick} ({len(toks[pick])} tokens)",
            )
        assert saved is not None
        # the memory now: nothing runs between the restore and the end of load
        for ctx, data in ((ctx_tgt, saved[0]), (ctx_dft, saved[1])):
            if ctx is None or data is None or not self.synthetic:
                continue
            now = ctx.state_seq_get_data_ext(id_slot, STATE_SEQ_FLAGS_NONE)
            self._check_bytes("cache load", ctx, id_slot, now, prompt.tokens, data, STATE_SEQ_FLAGS_NONE)
        return res

    def _get_available_slot(self, inner: Callable[..., Any], task: Any) -> Any:
        server = self.server
        self._failed_load_prompt = None
        ret = inner(task)
        failed, self._failed_load_prompt = self._failed_load_prompt, None
        if failed is not None and ret is not None and ret.prompt is failed:
            # S-C.cpp:1630-1632: if (!prompt_load(...)) prompt_clear(): seq_rm all, tokens and checkpoints
            self.checked["restore_failure"] += 1
            left = server.ctx_tgt.seq_tokens(ret.id)
            if ret.prompt.tokens or len(ret.prompt.checkpoints) or left != ():
                _fail(
                    "restore_failure",
                    f"slot{ret.id} after a failed cache load holds {len(ret.prompt.tokens)} "
                    f"tokens, {len(ret.prompt.checkpoints)} checkpoints, memory of "
                    f"{None if left is None else len(left)} tokens; upstream clears it (S-C.cpp:1630-1632)",
                )
        return ret

    # ---- alloc / update --------------------------------------------------------------------

    def _alloc(self, inner: Callable[..., Any], prompt: Any, size_tgt: int, size_dft: int) -> Any:
        server = self.server
        cache = server.prompt_cache
        assert cache is not None
        before = list(cache.states)
        entries = [(e.prompt.tokens, _entry_bytes(e)) for e in before]
        need = size_tgt + size_dft
        for c in prompt.checkpoints.items:
            need += _payload_bytes((c.data_tgt, c.data_dft, c.data_spec))
        plan = expected_alloc(entries, prompt.tokens, need, cache.limit_size, cache.limit_tokens)
        fired = server.host.seam.fired
        res = inner(prompt, size_tgt, size_dft)
        after = list(cache.states)
        self.checked["alloc_eviction"] += 1
        if plan.outcome != "insert":
            self.branches["alloc_eviction:" + plan.outcome] += 1
            if res is not None or after != before:
                _fail(
                    "alloc_eviction",
                    f"{plan.outcome} prompt: upstream returns before touching the cache (S-T.cpp:1713-1735)",
                )
            return res
        if server.host.seam.fired > fired and res is None:
            self.branches["alloc_eviction:recovered"] += 1
            want = [before[i] for i in plan.recovered]
            if after != want or cache.limit_size != plan.recovered_limit:
                _fail(
                    "alloc_eviction",
                    f"after a failed allocation {len(after)} entries remain, limit "
                    f"{cache.limit_size}; upstream keeps {len(want)} with limit {plan.recovered_limit} "
                    "(S-T.cpp:1767-1776)",
                )
            return res
        if res is None:
            _fail("alloc_eviction", "alloc returned no entry although it fits and no allocation failed")
        n_evicted = len(before) - len(plan.survivors)
        self.branches["alloc_eviction:evicted" if n_evicted else "alloc_eviction:kept"] += 1
        want = [before[i] for i in plan.survivors]
        if after[:-1] != want or after[-1] in before or after[-1].prompt.tokens != prompt.tokens:
            kept = [before.index(e) for e in after if e in before]
            _fail(
                "alloc_eviction",
                f"alloc kept entries {kept} of {len(before)} and appended "
                f"{'a new entry' if after and after[-1] not in before else 'nothing'}; upstream keeps "
                f"{plan.survivors} then appends (S-T.cpp:1737-1758, 1779)",
            )
        return res

    def _update(self, inner: Callable[..., Any]) -> Any:
        server = self.server
        cache = server.prompt_cache
        assert cache is not None
        before = list(cache.states)
        sizes = [(len(e.prompt.tokens), _entry_bytes(e)) for e in before]
        keep, n_by_bytes = _update_passes(sizes, cache.limit_size, cache.limit_tokens)
        res = inner()
        after = list(cache.states)
        self.checked["update_eviction"] += 1
        if n_by_bytes > 0:
            self.branches["update_eviction:bytes"] += 1
        if len(keep) < len(before) - n_by_bytes:
            self.branches["update_eviction:tokens" + ("" if cache.limit_size > 0 else "-only")] += 1
        want = [before[i] for i in keep]
        if after != want:
            kept = [before.index(e) if e in before else -1 for e in after]
            _fail(
                "update_eviction",
                f"update kept entries {kept} of {len(before)}; upstream keeps {keep} "
                f"(limit_size {cache.limit_size}, limit_tokens {cache.limit_tokens}; S-T.cpp:1870-1892)",
            )
        return res

    # ---- checkpoints -----------------------------------------------------------------------

    def _create_checkpoint(
        self, inner: Callable[..., Any], slot: Any, n_tokens_cur: int, pos_min: int, pos_max: int
    ) -> Any:
        server = self.server
        p = server.params
        assert slot.task is not None
        # The old checkpoints are held (``olds``) until the check is done: create_checkpoint frees
        # the ones it erases before it allocates the new one, and CPython may give the new object
        # the id() of a freed one; compared by id() alone, a correct list then looked like an old
        # checkpoint kept in place of the new one ("kept n_tokens [] of [1, 2]"), depending on
        # the allocator's history, i.e. on which tests ran before.
        olds = list(slot.prompt.checkpoints.items)
        before = [CkptView(id(c), c.n_tokens, c.id_task) for c in olds]
        n_after = slot.prompt.n_tokens()
        n_start = n_after - n_tokens_cur
        n_new = n_after - n_tokens_cur
        n_task = len(slot.task.tokens)
        near_end = n_task < n_after + p.n_ubatch  # S-C.cpp:3567
        keep = expected_checkpoints(before, slot.task.id, p.n_ctx_checkpoints, p.checkpoint_min_step, n_new)
        res = inner(slot, n_tokens_cur, pos_min, pos_max)
        self.checked["checkpoint_policy"] += 1
        after = list(slot.prompt.checkpoints.items)
        if len(after) > p.n_ctx_checkpoints > 0:
            _fail(
                "checkpoint_lists",
                f"slot{slot.id}: {len(after)} checkpoints > n_ctx_checkpoints = {p.n_ctx_checkpoints}",
            )
        # the creation gate (text prompts: no user-message spans, no mtmd)
        if not (n_after == n_task or near_end):
            _fail("checkpoint_policy", f"checkpoint at {n_new} mid-prompt, not near its end (S-C.cpp:3585-3590)")
        if before and not (near_end or n_start > before[-1].n_tokens + p.checkpoint_min_step):
            _fail(
                "checkpoint_policy",
                f"checkpoint at {n_new} within min-step of {before[-1].n_tokens} (S-C.cpp:3605-3609)",
            )
        thinned = len(before) - len(keep) - sum(1 for c in before if c.n_tokens == n_new)
        self.branches["checkpoint_policy:thinned" if thinned > 0 else "checkpoint_policy:appended"] += 1
        if any(c.n_tokens == n_new for c in before):
            self.branches["checkpoint_policy:superseded"] += 1
        new = after[-1] if after else None
        if [id(c) for c in after[:-1]] != keep or new is None or any(new is c for c in olds):
            _fail(
                "checkpoint_policy",
                f"slot{slot.id}: kept n_tokens "
                f"{[c.n_tokens for c in after[:-1]]} of {[c.n_tokens for c in before]}; upstream keeps "
                f"{[c.n_tokens for c in before if c.ident in keep]} then appends {n_new} (S-C.cpp:2290-2345)",
            )
        assert new is not None
        if (new.n_tokens, new.id_task, new.pos_min, new.pos_max) != (n_new, slot.task.id, pos_min, pos_max):
            _fail(
                "checkpoint_policy",
                f"new checkpoint {new} is not (n_tokens={n_new}, task={slot.task.id}, pos=[{pos_min},{pos_max}])",
            )
        return res

    def _expected_restore(self, slot: Any) -> Any:
        """The checkpoint _start_prompt restores (S-C.cpp:3284-3353), or None (no search or none found)."""
        server = self.server
        task = slot.task
        tokens = slot.prompt.tokens
        n_past = _lcp(tokens, task.tokens) if task.cache_prompt else 0
        pos_next = n_past
        has_new = n_past < len(task.tokens)
        thold = max(0, pos_next - server.n_swa - (0 if has_new else 1))
        if not (0 < n_past <= len(tokens)) or len(task.tokens) >= server.slot_n_ctx:
            return None
        if server.ctx_tgt.memory_seq_pos_min(slot.id) < thold:
            return None
        for c in reversed(slot.prompt.checkpoints.items):
            if c.pos_max > pos_next:
                continue
            if c.pos_min < thold or c.pos_min == 0:
                return c
        return None

    def _start_prompt(self, inner: Callable[..., Any], slot: Any) -> Any:
        server = self.server
        ckpt = self._expected_restore(slot)
        tokens = slot.prompt.tokens
        saved = None
        n_ckpt = 0
        if ckpt is not None:
            saved = (
                ckpt.data_tgt.data if ckpt.data_tgt is not None else None,
                ckpt.data_dft.data if ckpt.data_dft is not None else None,
            )
            n_ckpt = ckpt.n_tokens
        self._restores.clear()
        self._want_state = ckpt is not None and self.synthetic
        try:
            res = inner(slot)
        except GgmlAbort as e:
            if any(not r.ok and r.seq == slot.id for r in self._restores) and ckpt is not None:
                self.checked["restore_failure"] += 1
                self.branches["restore_failure:checkpoint-abort"] += 1
                raise ExpectedAbort(str(e)) from e
            raise
        finally:
            self._want_state = False
        if ckpt is None:
            return res
        failed = [r for r in self._restores if not r.ok and r.seq == slot.id]
        if failed:
            self.checked["restore_failure"] += 1
            _fail(
                "restore_failure",
                f"slot{slot.id}: the checkpoint restore failed ({failed[0].ctx}) and the "
                "server went on; upstream aborts (common.cpp:2335-2338, 2353-2356)",
            )
        assert saved is not None
        for ctx, data in ((server.ctx_tgt, saved[0]), (server.ctx_dft, saved[1])):
            if ctx is None or data is None:
                continue
            got = [
                r
                for r in self._restores
                if r.ctx == ctx.name and r.seq == slot.id and r.flags == STATE_SEQ_FLAGS_PARTIAL_ONLY
            ]
            self._check_bytes(
                "checkpoint restore",
                ctx,
                slot.id,
                (got[-1].state or b"") if got else b"",
                tokens,
                data,
                STATE_SEQ_FLAGS_PARTIAL_ONLY,
                resume=min(slot.prompt.n_tokens(), n_ckpt),
            )
        return res
