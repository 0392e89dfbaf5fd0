"""The canonical scenarios of the allocation-failure sweep.

A :class:`Scenario` builds, for one semantics, a fresh modelled server in a known state and the
one *act* under test: a prompt save, a slot selection that saves and loads, a checkpoint creation,
... Building is deterministic, so trial ``nth`` of a scenario is the same trial every time and a
case id replays it.

What each scenario promises:

* ``scope`` is the :meth:`harness.model.memory.Host.operation` the fault is armed for (``"save"``: only
  allocations made inside ``prompt_save`` count and can fail), or ``None``: every allocation made
  by the act counts.
* ``in_pr_scope`` says whether the act's allocations are inside the contract of PR #27451 (the
  ``try`` in ``server_prompt_cache::alloc``). When it is False, a ``bad_alloc`` escaping the act is
  the expected upstream behaviour in *both* semantics (``crash-out-of-scope``).
* ``check(result, fired)`` returns ``None`` when the act's result is right (no fault fired) or is
  one of the accepted degraded results (a fault fired and was absorbed), else what is wrong.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from harness.model.cache import ServerPromptCache
from harness.model.provider import STATE_SEQ_FLAGS_NONE
from harness.model.semantics import Semantics
from harness.model.server_context import LaunchResult, ServerContext, ServerParams, ServerSlot, SlotState, Task
from harness.targets.synthetic import make_server

__all__ = ["SCENARIOS", "Prepared", "Scenario", "SemanticsLike", "get_scenario"]

Check = Callable[[object, bool], str | None]
SemanticsLike = str | Semantics  # "shared", "master", or any Semantics (a mutant)


@dataclass
class Prepared:
    """One built scenario: the server, the act under test and the check of its result."""

    server: ServerContext
    act: Callable[[], object]
    check: Check


@dataclass(frozen=True)
class Scenario:
    name: str
    summary: str
    scope: str | None
    in_pr_scope: bool
    build: Callable[[SemanticsLike], Prepared]


# ---- helpers -------------------------------------------------------------------------------


def prompt(n: int, salt: int) -> tuple[int, ...]:
    """A deterministic prompt; different salts give prompts with no common prefix."""
    return tuple(1 + ((i * 7 + salt * 5) % 23) if i else 1 + salt for i in range(n))


def _params(**kw: object) -> ServerParams:
    base: dict[str, object] = {"n_slots": 1, "cache_ram": -1, "cache_ram_unit": 1024, "cache_idle_slots": False}
    base.update(kw)
    return ServerParams(**base)  # type: ignore[arg-type]


def _process(server: ServerContext, tokens: tuple[int, ...]) -> LaunchResult:
    res = server.handle_completion(tokens, n_predict=2)
    server.run_until_idle()
    return res


def _cache(server: ServerContext) -> ServerPromptCache:
    assert server.prompt_cache is not None
    return server.prompt_cache


def _tokens_in_cache(server: ServerContext) -> list[tuple[int, ...]]:
    return [e.prompt.tokens for e in _cache(server).states]


def _save_check(server: ServerContext, slot: ServerSlot, before: list[tuple[int, ...]]) -> Check:
    """A save: no fault -> True and the slot's prompt appended; fault -> False, nothing appended."""
    tokens = slot.prompt.tokens

    def check(result: object, fired: bool) -> str | None:
        now = _tokens_in_cache(server)
        if not fired:
            if result is not True or not now or now[-1] != tokens:
                return f"save returned {result!r}, cache holds {len(now)} entries; expected the slot's prompt appended"
            return None
        if result is not False:
            return f"save returned {result!r} although an allocation failed inside it"
        if tokens in now:
            return "the slot's prompt is in the cache although its save failed"
        if any(t not in before for t in now):
            return "a failed save left an entry that was not there before"
        return None

    return check


# ---- the scenarios -------------------------------------------------------------------------


def _save(kind: str, draft: bool = False) -> Callable[[SemanticsLike], Prepared]:
    def build(semantics: SemanticsLike) -> Prepared:
        server = make_server(semantics, kind, draft=draft, params=_params())
        _process(server, prompt(40, 1))
        slot = server.slots[0]
        cache = _cache(server)
        return Prepared(server, lambda: slot.prompt_save(cache), _save_check(server, slot, []))

    return build


def _save_over_limit(semantics: SemanticsLike) -> Prepared:
    # a 1 KiB cache: a short transformer prompt fits, a long one is over the limit and skipped
    server = make_server(semantics, "transformer", params=_params(cache_ram=1))
    slot = server.slots[0]
    cache = _cache(server)
    _process(server, prompt(12, 1))
    assert slot.prompt_save(cache)
    _process(server, prompt(48, 2))
    before = _tokens_in_cache(server)
    limit = cache.limit_size

    def check(result: object, fired: bool) -> str | None:
        if result is not False:
            return f"an over-limit save returned {result!r}"
        if _tokens_in_cache(server) != before or cache.limit_size != limit:
            return "an over-limit save disturbed the cache"
        return None

    return Prepared(server, lambda: slot.prompt_save(cache), check)


def _save_evicts(semantics: SemanticsLike) -> Prepared:
    server = make_server(semantics, "hybrid", params=_params())
    slot = server.slots[0]
    cache = _cache(server)
    first: list[tuple[int, ...]] = []
    for salt in (1, 2, 3):
        _process(server, prompt(32, salt))
        if salt < 3:
            assert slot.prompt_save(cache)
            first.append(slot.prompt.tokens)
    need = server.ctx_tgt.state_seq_get_size_ext(slot.id, STATE_SEQ_FLAGS_NONE)
    need += sum(c.size() for c in slot.prompt.checkpoints)
    # room for the newest old entry and the new one, not for all three: the oldest must go
    cache.limit_size = cache.states[-1].size() + need
    save_check = _save_check(server, slot, first)

    def check(result: object, fired: bool) -> str | None:
        err = save_check(result, fired)
        if err is None and not fired and _tokens_in_cache(server)[:-1] != first[1:]:
            err = "the save did not evict exactly the oldest entry"
        return err

    return Prepared(server, lambda: slot.prompt_save(cache), check)


def _load(draft: bool) -> Callable[[SemanticsLike], Prepared]:
    def build(semantics: SemanticsLike) -> Prepared:
        server = make_server(semantics, "hybrid", draft=draft, params=_params(n_draft_max=2 if draft else 0))
        slot = server.slots[0]
        cache = _cache(server)
        _process(server, prompt(36, 1))
        assert slot.prompt_save(cache)
        hit = slot.prompt.tokens
        _process(server, prompt(30, 2))
        other = slot.prompt.tokens
        new = (*hit, 5, 6, 7)

        def check(result: object, fired: bool) -> str | None:
            if not isinstance(result, LaunchResult) or result.status != "launched":
                return f"the task was not launched: {result!r}"
            now = _tokens_in_cache(server)
            if hit in now:
                return "the hit entry is still in the cache"
            if slot.prompt.tokens == hit:
                if fired and other in now:
                    return "the save failed but its prompt is in the cache"
                if not fired and now != [other]:
                    return "the slot's previous prompt was not saved"
                return None
            # a miss is accepted only when the recovery of a failed save evicted the entry
            if fired and slot.prompt.tokens == other and other not in now:
                return None
            return "the cached prompt was not loaded into the slot"

        return Prepared(server, lambda: server.handle_completion(new, n_predict=2), check)

    return build


def _update(semantics: SemanticsLike) -> Prepared:
    server = make_server(semantics, "hybrid", params=_params())
    slot = server.slots[0]
    cache = _cache(server)
    saved = []
    for salt in (1, 2, 3):
        _process(server, prompt(24, salt))
        assert slot.prompt_save(cache)
        saved.append(slot.prompt.tokens)
    cache.limit_size = cache.states[-1].size() + cache.states[-2].size()

    def check(result: object, fired: bool) -> str | None:
        if _tokens_in_cache(server) != saved[1:] or cache.size() > cache.limit_size:
            return "update() did not evict exactly the oldest entry down to the limit"
        return None

    return Prepared(server, cache.update, check)


def _create_checkpoint_at_cap(semantics: SemanticsLike) -> Prepared:
    server = make_server(semantics, "hybrid", draft=True, params=_params(n_ctx_checkpoints=2))
    slot = server.slots[0]
    _process(server, prompt(40, 1))
    cps = slot.prompt.checkpoints
    assert len(cps) == 2
    n_tokens = slot.prompt.n_tokens()
    slot.task = Task(10_000, slot.prompt.tokens)
    pos = (server.ctx_tgt.memory_seq_pos_min(slot.id), server.ctx_tgt.memory_seq_pos_max(slot.id))

    def act() -> object:
        server.create_checkpoint(slot, 0, *pos)
        return None

    def check(result: object, fired: bool) -> str | None:
        if len(cps) != 2 or cps.back().n_tokens != n_tokens or cps.back().empty():
            return f"expected 2 checkpoints ending with a full one at {n_tokens}, got {list(cps)}"
        return None

    return Prepared(server, act, check)


def _child_task_clone(semantics: SemanticsLike) -> Prepared:
    server = make_server(semantics, "hybrid", draft=True, params=_params(n_slots=2))
    server.handle_completion(prompt(40, 1), n_cmpl=2, n_predict=2)
    parent = next(s for s in server.slots if s.task is not None and s.task.is_parent())
    child = next(s for s in server.slots if s.state is SlotState.WAIT_OTHER)
    # process the parent's prompt up to DONE_PROMPT, stopping before update_slots copies it
    while parent.state is not SlotState.DONE_PROMPT:
        if parent.state is SlotState.STARTED:
            server._start_prompt(parent)
        if parent.state is SlotState.PROCESSING_PROMPT:
            server._prompt_batch(parent)

    def act() -> object:
        parent.copy_state_to(child)
        return None

    def check(result: object, fired: bool) -> str | None:
        if child.prompt.tokens != parent.prompt.tokens or len(child.prompt.checkpoints) != len(
            parent.prompt.checkpoints
        ):
            return "the child slot did not receive the parent's prompt and checkpoints"
        return None

    return Prepared(server, act, check)


def _checkpoint_update(semantics: SemanticsLike) -> Prepared:
    server = make_server(semantics, "hybrid", draft=True, params=_params(n_draft_max=3))
    slot = server.slots[0]
    server.handle_completion(prompt(30, 1), n_predict=6)
    while slot.state is not SlotState.GENERATING:
        server.update_slots()
    n_before = slot.n_decoded

    def act() -> object:
        server.update_slots()
        return None

    def check(result: object, fired: bool) -> str | None:
        if slot.n_decoded <= n_before or slot.spec_ckpt.empty():
            return "the speculative round did not decode or did not keep its checkpoint"
        return None

    return Prepared(server, act, check)


def _idle_slot_caching(semantics: SemanticsLike) -> Prepared:
    server = make_server(semantics, "hybrid", params=_params(n_slots=2, cache_idle_slots=True))
    _process(server, prompt(36, 1))
    idle = next(s for s in server.slots if s.prompt.tokens)
    tokens = idle.prompt.tokens

    def check(result: object, fired: bool) -> str | None:
        if not isinstance(result, LaunchResult) or result.status != "launched" or result.slot == idle.id:
            return f"the task was not launched on the empty slot: {result!r}"
        if idle.prompt.tokens != tokens:
            return "the idle slot's prompt changed"
        cached = tokens in _tokens_in_cache(server)
        if cached == fired:
            return "the idle slot's prompt is cached although its save failed" if fired else "it was not cached"
        return None

    return Prepared(server, lambda: server.handle_completion(prompt(30, 2), n_predict=2), check)


# name, fault scope, inside the PR's contract, builder, summary
_TABLE: list[tuple[str, str | None, bool, Callable[[SemanticsLike], Prepared], str]] = [
    ("save-no-checkpoints", "save", True, _save("transformer"), "prompt_save of a transformer prompt"),
    ("save-with-checkpoints", "save", True, _save("hybrid"), "prompt_save of a hybrid prompt with checkpoints"),
    ("save-with-draft", "save", True, _save("hybrid", True), "prompt_save with a draft (state_dft, ckpt dft/spec)"),
    ("save-over-limit", "save", True, _save_over_limit, "prompt_save of an entry over --cache-ram (skipped)"),
    ("save-evicts", "save", True, _save_evicts, "prompt_save that evicts the oldest entry first"),
    ("load-hit", "save", True, _load(False), "slot selection: save the slot, load a cached hit, update"),
    ("load-with-draft", "save", True, _load(True), "load-hit with a draft context"),
    ("update", None, True, _update, "server_prompt_cache::update() over the byte limit"),
    ("idle-slot-caching", "save", True, _idle_slot_caching, "a launch that caches the other, idle slot"),
    ("create-checkpoint-at-cap", None, False, _create_checkpoint_at_cap, "create_checkpoint at n_ctx_checkpoints"),
    ("child-task-clone", None, False, _child_task_clone, "copy_state_to: a child task clones the parent's prompt"),
    ("checkpoint-update", None, False, _checkpoint_update, "speculative round: spec_ckpt update_dft/update_tgt"),
]

SCENARIOS: dict[str, Scenario] = {n: Scenario(n, summary, scope, pr, b) for n, scope, pr, b, summary in _TABLE}


def get_scenario(name: str) -> Scenario:
    """The scenario called ``name``; ``KeyError`` naming the choices otherwise."""
    try:
        return SCENARIOS[name]
    except KeyError:
        raise KeyError(f"unknown scenario {name!r}: choose one of {', '.join(SCENARIOS)}") from None
