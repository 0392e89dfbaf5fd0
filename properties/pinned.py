"""The properties that pin the newer rules to what upstream would do (issue #50), each computed apart from the model.

Upstream: tools/server/server-context.cpp at 0c1e570. Each expectation below is computed here from the sites the
model's docstrings cite, never read from the model's own choice; the model's records (``ServerContext.reuses``,
``ctx_shifts``, ``events``) are only what is compared with it.

* ``reuse_chunks`` (reuse machines, at each prompt start): the chunks ``--cache-reuse`` moved are exactly those
  upstream's loop (:3219-3262) takes from the common prefix (:func:`upstream_chunks`: a run of at least
  ``n_cache_reuse`` equal tokens is taken, a shorter one moves ``head_c`` by one), none where the loop does not
  run (``n_cache_reuse <= 0``, a memory that cannot shift, :3210-3216), and ``cache_n`` is the prefix plus
  every chunk (one less when that is the whole prompt, [TAG_PROMPT_LOGITS]).
* ``shift_timing`` (reuse machines, at each generation step): a generating slot shifts exactly when
  ``n_tokens + 1 >= n_ctx`` (:2889-2950), never before; where it cannot (``--context-shift`` off, a parent or
  child task, :2896-2911) the task ends with an error instead.
* ``slot_within_ctx`` (reuse machines: after every step, and at each prompt start): a slot's tokens and its
  sampled token fit its context (``n_tokens + 1 <= n_ctx``, n_ctx the slot's share, :1160), and a prompt of
  ``n_ctx`` tokens or more is refused (:3159-3166).
* ``stateless_fresh`` (stateless machines): an embedding or rerank task never resumes from a cached prefix (its
  prompt starts at 0 with no token kept, :3196-3198, :3269), loads nothing at its selection (:1620) and is not
  treated as a completion (an idle slot it left holds its prompt or nothing: no generated token, no checkpoint,
  :3444, :3800-3812).
* ``idle_pass`` (every machine, after each idle-slot pass, :2417-2432): every idle slot was saved exactly once,
  with ``kv_unified`` every idle slot is cleared (saved or not), without it none changes, and where a save
  appended an entry the cache is back within its limit (``limit``, :func:`check_limit`) after the pass.
* ``limit`` is also a state invariant (:func:`check_limit`, after every step of every machine): before it was
  checked only right after ``alloc`` and ``update``, so a cache left over its limit between them went unseen.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from typing import Any

from harness.model.cache import Tokens, get_common_prefix
from harness.model.reuse import can_shift
from harness.model.server_context import STATELESS_TASKS, ServerContext, ServerSlot, SlotState
from properties.invariants import Violation, unwrap, wrap_timed

__all__ = ["PinnedTracer", "check_limit", "check_slots_within_ctx", "slot_ctx",
           "upstream_chunks"]  # fmt: skip

IDLE = SlotState.IDLE
PROCESSING_PROMPT = SlotState.PROCESSING_PROMPT


def upstream_chunks(cached: Tokens, prompt: Tokens, n_past: int, n_cache_reuse: int) -> list[tuple[int, int, int]]:
    """(head_c, head_p, n_match) of each chunk upstream's loop (:3219-3262) moves, from the common prefix ``n_past``.

    Written from the C++, apart from :func:`harness.model.reuse.reuse_chunks`: ``head_c`` walks the old
    prompt and ``head_p`` the new one; the run of equal tokens at the two heads is measured (:3230-3236); a run
    of ``n_match >= n_cache_reuse`` is moved and both heads pass it (:3242-3258), else ``head_c`` moves one."""
    out: list[tuple[int, int, int]] = []
    head_c = head_p = n_past
    while head_c < len(cached) and head_p < len(prompt):
        run = 0
        for a, b in zip(cached[head_c:], prompt[head_p:], strict=False):
            if a != b:
                break
            run += 1
        if run >= n_cache_reuse:
            out.append((head_c, head_p, run))
            head_c, head_p = head_c + run, head_p + run
        else:
            head_c += 1
    return out


def slot_ctx(server: ServerContext) -> int:
    """A slot's n_ctx as upstream sets it (:1160): the whole context with ``kv_unified``, else its share."""
    n_ctx = int(getattr(server.ctx_tgt, "n_ctx", 0))
    p = server.params
    return n_ctx if p.kv_unified else n_ctx // max(1, p.n_slots)


def check_limit(server: ServerContext, prop: str = "limit", where: str = "after a step") -> None:
    """The cache within its limits: ``size() <= limit_size``, and ``n_tokens()`` within the token limit
    (``limit_tokens``, raised with a byte limit to what the bytes allow, as ``update()`` does, :1870-1890)."""
    cache = server.prompt_cache
    if cache is None:
        return
    size, n, lim, lim_t = cache.size(), cache.n_tokens(), cache.limit_size, cache.limit_tokens
    if lim > 0 and size > lim:
        raise Violation(prop, f"size() = {size} > limit_size = {lim} {where}")
    if lim_t > 0:
        bound = lim_t if lim <= 0 else max(lim_t, lim if size <= n else lim * n // size)
        if n > bound + 1 + bound // (1 << 22):  # upstream computes in float, as the post-update check allows
            raise Violation(prop, f"n_tokens() = {n} > token limit {bound} {where}")


def check_slots_within_ctx(server: ServerContext) -> None:
    """``slot_within_ctx`` at rest: every slot's tokens and its sampled token fit the slot's n_ctx."""
    n_ctx = slot_ctx(server)
    for s in server.slots:
        if s.prompt.n_tokens() + 1 > n_ctx:
            raise Violation("slot_within_ctx", f"slot{s.id} holds {s.prompt.n_tokens()} tokens, its n_ctx is {n_ctx}")


class PinnedTracer:
    """Wraps one server instance with the post-conditions above (:func:`properties.invariants.wrap_timed`).

    Every machine has ``idle_pass``; :meth:`wrap_reuse` (the reuse machines) and :meth:`wrap_stateless` (the
    stateless machines) add theirs. ``checked``/``seconds`` are counted as :class:`properties.invariants.Tracer`'s."""

    def __init__(self, server: ServerContext, *, wrap: bool = True) -> None:
        self.server = server
        self.checked: Counter[str] = Counter()
        self.seconds: defaultdict[str, float] = defaultdict(float)
        self.wrapped: list[tuple[Any, str]] = []
        if wrap:
            self._wrap(server, "_cache_idle_slots", PinnedTracer._idle, "idle_pass")

    def _wrap(self, obj: Any, name: str, post: Callable[..., Any], label: str) -> None:
        wrap_timed(obj, name, post, (self,), self.seconds, label)
        self.wrapped.append((obj, name))

    def unwrap(self) -> None:
        unwrap(self.wrapped)

    def wrap_reuse(self) -> None:
        """``reuse_chunks`` and ``slot_within_ctx`` at each prompt start, ``shift_timing`` at each generation step."""
        self._wrap(self.server, "_start_prompt", PinnedTracer._start_reuse, "reuse_chunks")
        self._wrap(self.server, "_generate", PinnedTracer._generate, "shift_timing")

    def wrap_stateless(self) -> None:
        """``stateless_fresh`` at each stateless task's selection and prompt start."""
        self._wrap(self.server, "handle_stateless", PinnedTracer._stateless, "stateless_fresh")
        self._wrap(self.server, "_start_prompt", PinnedTracer._start_stateless, "stateless_fresh")

    # idle_pass
    def _idle(self, inner: Callable[[], None]) -> None:
        server = self.server
        idle = [(s, s.prompt.tokens) for s in server.slots if s.state is IDLE]
        n_events = len(server.events)
        cache = server.prompt_cache
        entries = list(cache.states) if cache is not None else []  # held: an evicted entry's id() can be reused
        inner()
        if cache is None:
            return
        self.checked["idle_pass"] += 1
        saves = Counter(ev.slot for ev in server.events[n_events:] if ev.op == "save")
        unified = server.params.kv_unified
        for s, tokens in idle:
            if saves[s.id] != 1:
                raise Violation("idle_pass", f"the idle pass saved idle slot{s.id} {saves[s.id]} times, upstream once "
                                "(server-context.cpp:2419-2432)")  # fmt: skip
            if unified and (s.prompt.tokens or len(s.prompt.checkpoints.items)):
                msg = f"with kv_unified the idle pass left idle slot{s.id} holding {s.prompt.n_tokens()} tokens"
                raise Violation("idle_pass", msg + "; upstream clears every idle slot, saved or not")
            if not unified and s.prompt.tokens != tokens:
                raise Violation("idle_pass", f"the idle pass changed idle slot{s.id}'s tokens without kv_unified")
        if any(all(e is not b for b in entries) for e in cache.states):
            # a save appended an entry: its update() (:2425) must have brought the cache back within its limit
            check_limit(server, "idle_pass", "after an idle pass that saved")

    # reuse_chunks + slot_within_ctx
    def _start_reuse(self, inner: Callable[[ServerSlot], None], slot: ServerSlot) -> None:
        server, task = self.server, slot.task
        assert task is not None
        cached, n_records = slot.prompt.tokens, len(server.reuses)
        inner(slot)
        n_ctx = slot_ctx(server)
        self.checked["slot_within_ctx"] += 1
        if len(task.tokens) >= n_ctx and slot.state is PROCESSING_PROMPT:
            raise Violation("slot_within_ctx", f"slot{slot.id} took a prompt of {len(task.tokens)} tokens, its n_ctx "
                            f"is {n_ctx}: upstream refuses it (server-context.cpp:3159-3166)")  # fmt: skip
        if slot.state is not PROCESSING_PROMPT or task.type in STATELESS_TASKS or not task.cache_prompt:
            return
        self.checked["reuse_chunks"] += 1
        prompt = task.tokens
        n_past = get_common_prefix(cached, prompt)
        runs = task.n_cache_reuse > 0 and can_shift(server.ctx_tgt)  # :3210-3216 (text only)
        want = upstream_chunks(cached, prompt, n_past, task.n_cache_reuse) if runs else None
        got = None
        if len(server.reuses) > n_records:
            sid, n_prefix, chunks = server.reuses[-1]
            got = (sid, n_prefix, [(c.head_c, c.head_p, c.n_match) for c in chunks])
        if (got is None) != (want is None) or (got is not None and got != (slot.id, n_past, want)):
            raise Violation("reuse_chunks", f"slot{slot.id}: --cache-reuse {task.n_cache_reuse} from {cached} to "
                            f"{prompt}: the model moved {got}, upstream's loop moves {want} from {n_past}")  # fmt: skip
        if want:
            n_cached = min(n_past + sum(c[2] for c in want), len(prompt) - 1)
            if slot.n_prompt_cached != n_cached:
                raise Violation("reuse_chunks", f"slot{slot.id}: cache_n {slot.n_prompt_cached} after chunks {want} "
                                f"from {n_past}; upstream's is {n_cached}")  # fmt: skip

    # shift_timing
    def _generate(self, inner: Callable[[ServerSlot], None], slot: ServerSlot) -> None:
        server, task = self.server, slot.task
        assert task is not None
        n, shifts, errors = slot.prompt.n_tokens(), len(server.ctx_shifts), len(server.errors)
        inner(slot)
        p = server.params
        if not p.ctx_limit:
            return
        self.checked["shift_timing"] += 1
        n_ctx = slot_ctx(server)
        shifted = len(server.ctx_shifts) > shifts
        if n + 1 < n_ctx:
            if shifted:
                raise Violation("shift_timing", f"slot{slot.id} shifted at {n} tokens; upstream shifts only at "
                                f"n_tokens + 1 >= n_ctx = {n_ctx} (server-context.cpp:2889)")  # fmt: skip
            return
        can = p.ctx_shift and task.n_children == 0 and task.id_parent == -1
        if can and not shifted:
            msg = f"slot{slot.id} at {n} tokens (n_ctx {n_ctx}) generated without a context shift"
            raise Violation("shift_timing", msg + "; upstream shifts before the next decode (:2889-2950)")
        if not can and (shifted or len(server.errors) == errors or slot.state is not IDLE):
            raise Violation("shift_timing", f"slot{slot.id} at {n} tokens (n_ctx {n_ctx}) without a possible shift "
                            "was not ended with an error (server-context.cpp:2896-2911)")  # fmt: skip

    def stateless_done(self, slot_id: int, tokens: Tokens) -> None:
        """``stateless_fresh`` once the stateless task launched on slot ``slot_id`` ran: the slot holds its prompt,
        no generated token and no checkpoint (:3444, :3800-3812: released once the prompt is evaluated)."""
        s = self.server.slots[slot_id]
        prev = s.task_prev
        if s.state is not IDLE or prev is None or prev.tokens != tokens or prev.type not in STATELESS_TASKS:
            return  # it did not run to its end here (the machine runs it with the others to their end)
        self.checked["stateless_fresh"] += 1
        if s.prompt.tokens != tokens or len(s.prompt.checkpoints.items):
            raise Violation(
                "stateless_fresh",
                f"slot{s.id} after a {prev.type} of {len(tokens)} tokens holds {s.prompt.n_tokens()} tokens, "
                f"{len(s.prompt.checkpoints.items)} checkpoints: treated as a completion",
            )

    # stateless_fresh
    def _stateless(self, inner: Callable[..., Any], *a: Any, **kw: Any) -> Any:
        server = self.server
        res = inner(*a, **kw)
        self.checked["stateless_fresh"] += 1
        loads = [ev.slot for ev in server.events if ev.op == "load"]
        if loads:
            msg = f"a stateless task's selection loaded a cache entry into slot{loads[0]}"
            raise Violation("stateless_fresh", msg + "; upstream loads only for completions (server-context.cpp:1620)")
        return res

    def _start_stateless(self, inner: Callable[[ServerSlot], None], slot: ServerSlot) -> None:
        task = slot.task
        assert task is not None
        inner(slot)
        if task.type not in STATELESS_TASKS or slot.state is not PROCESSING_PROMPT:
            return
        self.checked["stateless_fresh"] += 1
        if slot.n_prompt_cached or slot.prompt.tokens or slot.pos_next:
            raise Violation("stateless_fresh", f"slot{slot.id}'s {task.type} resumed from {slot.n_prompt_cached} "
                            f"cached tokens (pos {slot.pos_next}); upstream evaluates it from 0 "
                            "(server-context.cpp:3196-3198, 3269)")  # fmt: skip
