"""The slot side (harness/server.py): restore point from checkpoints, idle-slot caching, child tasks,
speculative decoding with a draft, and slot selection.

Upstream: server-context.cpp:3140-3400 (restore/invalidate), 2417-2432 (idle slots), 692-704 and
515-530 (child copy and clear), 1528-1640 (get_available_slot).

P is a 48-token prompt. With n_batch 16 / n_ubatch 8 it is processed as 0-16, 16-32, 32-36, 36-44,
44-48, and the checkpoints are taken before the batches at 36 and 44 (near the prompt end).
"""

from __future__ import annotations

import pytest

from harness.model import CommonPromptCheckpoint, ServerContext, ServerParams, ServerSlot, SlotState, Task
from harness.targets.synthetic import make_server

P = tuple(1 + (i * 7) % 23 for i in range(48))
X = 99  # a token that diverges from P


def _after_p(kind: str, sem: str = "shared") -> tuple[ServerContext, ServerSlot]:
    s = make_server(sem, kind, params=ServerParams(n_slots=1, cache_ram=0))
    s.handle_completion(P, n_predict=2)
    s.run_until_idle()
    return s, s.slots[0]


def _state(slot: ServerSlot) -> SlotState:
    return slot.state


def _ckpts(slot: ServerSlot) -> list[tuple[int, int, int]]:
    return [(c.n_tokens, c.pos_min, c.pos_max) for c in slot.prompt.checkpoints]


def _start(s: ServerContext, tokens: tuple[int, ...]) -> ServerSlot:
    """Launch a task and run only its start (restore point + invalidation), not its first batch."""
    r = s.handle_completion(tokens, n_predict=1)
    assert r.status == "launched"
    slot = s.slots[r.slot]
    s._start_prompt(slot)
    assert slot.state is SlotState.PROCESSING_PROMPT
    return slot


# ---- restore point ------------------------------------------------------------------------------


@pytest.mark.parametrize("kind", ["recurrent", "hybrid"])
def test_checkpoints_after_p(kind: str) -> None:
    _, slot = _after_p(kind)
    assert _ckpts(slot) == [(36, 35, 35), (44, 43, 43)]


def test_iswa_checkpoints_after_p() -> None:
    _, slot = _after_p("iswa")
    assert _ckpts(slot) == [(36, 28, 35), (44, 36, 43)]  # SWA window 8: pos_min = pos_max - 7


@pytest.mark.parametrize("kind", ["recurrent", "hybrid"])
@pytest.mark.parametrize(("shared", "resume"), [(40, 36), (46, 44), (43, 36)])
def test_recurrent_restores_newest_usable_checkpoint(kind: str, shared: int, resume: int) -> None:
    s, slot = _after_p(kind)
    kept = [c for c in slot.prompt.checkpoints if c.pos_max <= resume]
    dropped = [c for c in slot.prompt.checkpoints if c.pos_max > resume]
    dropped_payloads = [c.data_tgt for c in dropped]
    _start(s, (*P[:shared], X, X, X))
    # resumes exactly at the checkpoint: n_past = ckpt.n_tokens, pos_next = n_tokens
    assert slot.n_prompt_cached == resume and slot.pos_next == resume
    assert slot.prompt.tokens == P[:resume]
    assert s.ctx_tgt.seq_tokens(0) == P[:resume]
    # invalidation: later checkpoints erased (and freed), earlier ones are the same objects
    assert list(slot.prompt.checkpoints) == kept
    assert all(p is not None and p.released for p in dropped_payloads)
    s.run_until_idle()
    assert s.ctx_tgt.seq_tokens(0) == slot.prompt.tokens
    assert slot.prompt.tokens[: shared + 3] == (*P[:shared], X, X, X)


@pytest.mark.parametrize("kind", ["recurrent", "hybrid"])
def test_prompt_without_new_tokens_skips_checkpoint_at_the_end(kind: str) -> None:
    """N = P[:44]: thold = 44 - 1 = 43, the checkpoint at 44 (pos_min 43) would leave nothing to evaluate."""
    s, slot = _after_p(kind)
    _start(s, P[:44])
    assert slot.n_prompt_cached == 36 and slot.pos_next == 36
    assert _ckpts(slot) == [(36, 35, 35)]


@pytest.mark.parametrize("kind", ["recurrent", "hybrid"])
def test_no_usable_checkpoint_forces_full_reprocess(kind: str) -> None:
    s, slot = _after_p(kind)
    payloads = [c.data_tgt for c in slot.prompt.checkpoints]
    _start(s, (*P[:20], X, X, X, X, X))  # both checkpoints lie beyond position 20
    assert slot.n_prompt_cached == 0 and slot.pos_next == 0
    assert slot.prompt.tokens == ()
    assert len(slot.prompt.checkpoints) == 0
    assert all(p is not None and p.released for p in payloads)
    assert s.ctx_tgt.seq_tokens(0) == ()
    s.run_until_idle()
    assert s.ctx_tgt.seq_tokens(0) == slot.prompt.tokens


@pytest.mark.parametrize("kind", ["recurrent", "hybrid"])
def test_extension_needs_no_checkpoint(kind: str) -> None:
    """pos_min (last position) < pos_next: ordinary continuation, all checkpoints kept."""
    s, slot = _after_p(kind)
    before = list(slot.prompt.checkpoints)
    n = slot.prompt.n_tokens()
    _start(s, (*slot.prompt.tokens, X, X, X))
    assert slot.n_prompt_cached == n and slot.pos_next == n
    assert list(slot.prompt.checkpoints) == before


def test_iswa_swa_checkpoint_resumes_at_pos_max() -> None:
    s, slot = _after_p("iswa")
    first = slot.prompt.checkpoints[0]
    _start(s, (*P[:40], X, X, X, X, X))
    # pos_next 40, thold 40 - 8 = 32: the 44 checkpoint is beyond 40, the 36 one (pos_min 28 < 32) is used;
    # pos_next = min(40, max(28 + 1, 35)) = 35 and n_past = min(35, 36) = 35: token 35 is evaluated again
    assert slot.n_prompt_cached == 35 and slot.pos_next == 35
    assert list(slot.prompt.checkpoints) == [first]  # pos_max 35 <= 35 survives
    assert s.ctx_tgt.seq_tokens(0) == P[:35]
    assert s.ctx_tgt.memory_seq_pos_min(0) == 28
    s.run_until_idle()
    assert s.ctx_tgt.seq_tokens(0) == slot.prompt.tokens


def test_iswa_later_checkpoint_also_resumes_one_before() -> None:
    s, slot = _after_p("iswa")
    _start(s, (*P[:46], X, X, X))
    # thold 38: checkpoint (44, 36, 43) qualifies -> pos_next = 43, n_past = 43 (ckpt.n_tokens - 1)
    assert slot.n_prompt_cached == 43 and slot.pos_next == 43
    assert _ckpts(slot) == [(36, 28, 35), (44, 36, 43)]


def test_iswa_checkpoint_list_can_lose_ascending_order() -> None:
    """Upstream does the same: after resuming at pos_max (35) the next checkpoint is taken at
    n_tokens 35, behind the restored one at 36; superseding only replaces equal n_tokens."""
    s, slot = _after_p("iswa")
    s.handle_completion((*P[:40], X, X, X, X, X), n_predict=1)
    s.run_until_idle()
    assert [c.n_tokens for c in slot.prompt.checkpoints] == [36, 35, 41]


@pytest.mark.parametrize("kind", ["recurrent", "hybrid", "iswa"])
def test_invalidation_with_cache_prompt_false(kind: str) -> None:
    """cache_prompt = false: n_past = 0, every checkpoint with pos_max > 0 is erased."""
    s, slot = _after_p(kind)
    s.handle_completion(P, n_predict=1, cache_prompt=False)
    s._start_prompt(slot)
    assert slot.n_prompt_cached == 0 and len(slot.prompt.checkpoints) == 0
    assert s.ctx_tgt.seq_tokens(0) == ()


def test_checkpoint_beyond_pos_next_never_used_even_with_pos_min_zero() -> None:
    """The search skips pos_max > pos_next before looking at pos_min (the pos_min == 0 escape)."""
    s, slot = _after_p("hybrid")
    fake = CommonPromptCheckpoint(s.host, s.sem, n_tokens=42, pos_min=0, pos_max=41)
    old = slot.prompt.checkpoints.take()
    items = [old[0], fake, old[1]]
    for c in items:  # (36, 35, 35), (42, 0, 41), (44, 43, 43)
        slot.prompt.checkpoints.emplace_back(c)
    _start(s, (*P[:40], X, X))
    assert slot.n_prompt_cached == 36 and slot.pos_next == 36
    assert list(slot.prompt.checkpoints) == [items[0]]


def test_invalidation_boundary_pos_max_equal_to_pos_next_survives() -> None:
    """Transformer memory needs no restore (pos_min 0 < thold); the rule alone: erase pos_max > pos_next."""
    s = make_server("shared", "transformer", params=ServerParams(n_slots=1, cache_ram=0))
    slot = s.slots[0]
    tokens = tuple(range(1, 21))
    assert s.ctx_tgt.decode(0, list(tokens), 0) == 0
    slot.prompt.tokens = tokens
    for n in (9, 10, 11, 12):
        slot.prompt.checkpoints.emplace_back(
            CommonPromptCheckpoint(s.host, s.sem, n_tokens=n + 1, pos_min=0, pos_max=n)
        )
    _start(s, (*tokens[:10], X, X))
    assert slot.n_prompt_cached == 10 and slot.pos_next == 10
    assert [c.pos_max for c in slot.prompt.checkpoints] == [9, 10]


# ---- idle-slot caching --------------------------------------------------------------------------

A = tuple(1 + (i * 5) % 19 for i in range(30))
B = tuple(100 + i for i in range(20))


def _two_slots(kv_unified: bool, sem: str = "shared") -> ServerContext:
    params = ServerParams(n_slots=2, cache_ram=-1, cache_ram_unit=1024, kv_unified=kv_unified)
    return make_server(sem, "hybrid", params=params)


@pytest.mark.parametrize("kv_unified", [False, True])
def test_idle_slot_saved_after_launch(kv_unified: bool) -> None:
    s = _two_slots(kv_unified)
    r1 = s.handle_completion(A, n_predict=2)
    assert r1.slot == 1  # LRU tie (both never used): the later index wins
    s.run_until_idle()
    slot_a = s.slots[1]
    tokens_a = slot_a.prompt.tokens
    ckpts_a = _ckpts(slot_a)
    state_a = s.ctx_tgt.state_seq_get_data_ext(1, 0)
    assert s.prompt_cache is not None and len(s.prompt_cache) == 0
    r2 = s.handle_completion(B, n_predict=2)
    assert r2.slot == 0
    # the idle slot 1 was saved right after launching B
    cache = s.prompt_cache
    assert len(cache) == 1
    entry = cache.states[0]
    assert entry.prompt.tokens == tokens_a
    assert [(c.n_tokens, c.pos_min, c.pos_max) for c in entry.prompt.checkpoints] == ckpts_a
    assert entry.data.main is not None and entry.data.main.data == state_a
    if kv_unified:
        assert slot_a.prompt.tokens == () and len(slot_a.prompt.checkpoints) == 0
        assert s.ctx_tgt.seq_tokens(1) == ()
        # the cleared slot's checkpoints live on in the entry only
        assert all(p.holders == 1 for c in entry.prompt.checkpoints for p in c.payloads())
    else:
        assert slot_a.prompt.tokens == tokens_a and _ckpts(slot_a) == ckpts_a
        assert s.ctx_tgt.seq_tokens(1) == tokens_a
        for c, d in zip(slot_a.prompt.checkpoints, entry.prompt.checkpoints, strict=True):
            assert c.data_tgt is d.data_tgt and c.data_tgt is not None and c.data_tgt.holders == 2
    s.run_until_idle()


def test_idle_slot_restored_from_cache_with_kv_unified() -> None:
    s = _two_slots(True)
    s.handle_completion(A, n_predict=2)
    s.run_until_idle()
    s.handle_completion(B, n_predict=2)  # slot 1 (A) is saved and cleared
    s.run_until_idle()
    assert s.prompt_cache is not None and len(s.prompt_cache) == 1
    a_tokens = s.prompt_cache.states[0].prompt.tokens
    r = s.handle_completion((*a_tokens, 7, 7, 7), n_predict=1)
    slot = s.slots[r.slot]
    # the cleared slot was picked and its prompt loaded back from the cache before it started
    assert r.slot == 1 and slot.prompt.tokens == a_tokens
    assert s.ctx_tgt.seq_tokens(1) == a_tokens
    # A's entry moved to the slot; the idle slot 0 (B) was then saved and cleared in turn
    assert [e.prompt.tokens[: len(B)] for e in s.prompt_cache.states] == [B]
    assert s.slots[0].prompt.tokens == ()
    s.run_until_idle()
    assert slot.n_prompt_cached == len(a_tokens)
    assert s.ctx_tgt.seq_tokens(1) == slot.prompt.tokens


def test_no_idle_caching_when_disabled() -> None:
    params = ServerParams(n_slots=2, cache_ram=-1, cache_ram_unit=1024, cache_idle_slots=False)
    s = make_server("shared", "hybrid", params=params)
    s.handle_completion(A, n_predict=2)
    s.run_until_idle()
    s.handle_completion(B, n_predict=2)
    assert s.prompt_cache is not None and len(s.prompt_cache) == 0


def test_cache_ram_zero_disables_cache_and_idle_caching() -> None:
    s = make_server("shared", "hybrid", params=ServerParams(n_slots=2, cache_ram=0))
    assert s.prompt_cache is None and s.params.cache_idle_slots is False


# ---- child tasks --------------------------------------------------------------------------------


@pytest.mark.parametrize("sem", ["master", "shared"])
def test_a_parent_that_fails_cancels_its_children(sem: str) -> None:
    # the prompt does not fit the slot's context: the parent's error result makes the HTTP reader
    # cancel the request's other tasks (server-queue.cpp:559-561, 602-617); without it the child
    # waited for the parent for ever and the server never became idle
    s = make_server(sem, "transformer", params=ServerParams(n_slots=2, cache_ram=-1, kv_unified=True), n_ctx=16)
    r = s.handle_completion(tuple(range(1, 17)), n_cmpl=2, n_predict=1)
    child = s.slots[1 - r.slot]
    assert _state(child) is SlotState.WAIT_OTHER
    s.run_until_idle(max_iters=10)
    assert s.errors == [(r.slot, "request exceeds the available context size")]
    assert not any(slot.is_processing() for slot in s.slots) and child.result == []


@pytest.mark.parametrize("sem", ["master", "shared"])
def test_child_gets_clone_of_parent_prompt_and_is_cleared_on_release(sem: str) -> None:
    s = make_server(sem, "hybrid", params=ServerParams(n_slots=2, cache_ram=-1, cache_ram_unit=1024))
    r = s.handle_completion(P, n_cmpl=2, n_predict=3)
    parent, child = s.slots[r.slot], s.slots[1 - r.slot]
    assert _state(child) is SlotState.WAIT_OTHER
    for _ in range(100):
        s.update_slots()
        if _state(child) is SlotState.GENERATING:
            break
    assert _state(child) is SlotState.GENERATING
    assert child.prompt.tokens == parent.prompt.tokens == P
    assert s.ctx_tgt.seq_tokens(child.id) == P
    assert len(parent.prompt.checkpoints) == 2
    pairs = list(zip(parent.prompt.checkpoints, child.prompt.checkpoints, strict=True))
    for pc, cc in pairs:
        assert pc is not cc and pc.n_tokens == cc.n_tokens
        assert pc.data_tgt is not None and cc.data_tgt is not None
        if sem == "shared":
            assert cc.data_tgt is pc.data_tgt and pc.data_tgt.holders == 2
        else:
            assert cc.data_tgt is not pc.data_tgt and cc.data_tgt.data == pc.data_tgt.data
            assert pc.data_tgt.holders == cc.data_tgt.holders == 1
    child_only = [cc.data_tgt for _, cc in pairs]
    s.run_until_idle()
    # the child slot is cleared on release; the parent keeps its checkpoints
    assert child.prompt.tokens == () and len(child.prompt.checkpoints) == 0
    assert s.ctx_tgt.seq_tokens(child.id) == ()
    assert len(parent.prompt.checkpoints) == 2
    for (pc, _), cp in zip(pairs, child_only, strict=True):
        assert pc.data_tgt is not None and pc.data_tgt.holders == 1 and not pc.data_tgt.released
        if sem == "master":
            assert cp is not None and cp.released
    assert child.result and parent.result


# ---- speculative decoding with a draft ----------------------------------------------------------


@pytest.mark.parametrize("sem", ["master", "shared"])
@pytest.mark.parametrize("kind", ["transformer", "recurrent", "hybrid", "iswa"])
def test_speculative_target_and_draft_stay_in_step(sem: str, kind: str) -> None:
    params = ServerParams(n_draft_max=3, cache_ram_unit=1024)
    s = make_server(sem, kind, draft=True, params=params)
    plain = make_server(sem, kind, params=ServerParams(cache_ram_unit=1024))
    assert s.ctx_dft is not None
    prompts = [P, (*P[:40], X, X, X, X), tuple(range(3, 33))]
    for i, pr in enumerate(prompts):
        r = s.handle_completion(pr, n_predict=10)
        s.run_until_idle()
        rp = plain.handle_completion(pr, n_predict=10)
        plain.run_until_idle()
        slot = s.slots[r.slot]
        assert not s.errors
        for sl in s.slots:
            assert s.ctx_tgt.seq_tokens(sl.id) == sl.prompt.tokens
            assert s.ctx_dft.seq_tokens(sl.id) == sl.prompt.tokens
        # accepted tokens are the target's greedy choices: the same as decoding without a draft
        assert slot.result[:10] == plain.slots[rp.slot].result[:10], f"prompt {i}"
        assert slot.prompt.tokens[: len(pr)] == pr


def test_speculative_checkpoints_carry_draft_and_spec_state() -> None:
    s = make_server("shared", "hybrid", draft=True, params=ServerParams(n_draft_max=3, cache_ram_unit=1024))
    s.handle_completion(P, n_predict=4)
    s.run_until_idle()
    slot = next(sl for sl in s.slots if sl.prompt.tokens)
    assert [c.n_tokens for c in slot.prompt.checkpoints] == [36, 44]
    for c in slot.prompt.checkpoints:
        assert c.data_tgt is not None and c.data_tgt.nbytes == 1057
        assert c.data_dft is not None and c.data_dft.nbytes == 8 + 25 + 256
        assert c.data_spec is not None and c.data_spec.nbytes == 32
    # spec_ckpt is never in the checkpoint list
    assert all(c is not slot.spec_ckpt for c in slot.prompt.checkpoints)


# ---- slot selection -----------------------------------------------------------------------------


def _seeded_slot(s: ServerContext, tokens: tuple[int, ...]) -> ServerSlot:
    slot = s.slots[0]
    assert s.ctx_tgt.decode(0, list(tokens), 0) == 0
    slot.prompt.tokens = tokens
    return slot


def test_similar_slot_with_large_keep_is_not_saved() -> None:
    s = make_server("shared", "transformer", params=ServerParams(n_slots=1, cache_ram=-1, cache_ram_unit=1))
    slot = _seeded_slot(s, tuple(range(1, 21)))
    task = Task(1, (*range(1, 11), X, X))  # f_sim 10/12, f_keep 10/20 = 0.5: not < 0.5
    assert s.get_available_slot(task) is slot
    assert s.events == [] and s.prompt_cache is not None and len(s.prompt_cache) == 0


def test_similar_slot_with_small_keep_is_saved() -> None:
    s = make_server("shared", "transformer", params=ServerParams(n_slots=1, cache_ram=-1, cache_ram_unit=1))
    slot = _seeded_slot(s, tuple(range(1, 21)))
    task = Task(1, (*range(1, 10), X, X))  # f_keep 9/20 < 0.5
    assert s.get_available_slot(task) is slot
    assert [e.op for e in s.events] == ["save", "load"]
    assert s.prompt_cache is not None and len(s.prompt_cache) == 1
    assert slot.prompt.tokens == tuple(range(1, 21))  # its own entry can never beat it


def test_f_keep_is_computed_in_float_as_upstream() -> None:
    """server-context.cpp:1596: f_keep = (f_sim_best * task.tokens.size()) / ret->prompt.tokens.size()
    in float. Slot of 14 tokens, task of 12 sharing 7: float(7/12) * 12 rounds to 7.0f, so f_keep is
    exactly 0.5f, not < 0.5: upstream does not update the cache. (A double-precision product gives
    0.49999998 and saves.)"""
    s = make_server("shared", "transformer", params=ServerParams(n_slots=1, cache_ram=-1, cache_ram_unit=1))
    slot = _seeded_slot(s, tuple(range(1, 15)))
    task = Task(1, (*range(1, 8), X, X, X, X, X))
    assert s.get_available_slot(task) is slot
    assert s.events == []
    assert s.prompt_cache is not None and len(s.prompt_cache) == 0


def test_last_sampled_token_is_not_decoded() -> None:
    """Upstream pushes `sampled` into prompt.tokens only when the next batch is built
    (handle_last_sampled_token, server-context.cpp:475-511); the token that exhausts n_predict is
    sampled (n_gen += 1, :3847) and the slot is released (:3864-3870) without decoding it. So after a
    prompt of 13 tokens and n_predict = 3 the slot holds 13 + 3 - 1 = 15 tokens."""
    s = make_server("shared", "transformer", params=ServerParams(n_slots=1, cache_ram=0))
    s.handle_completion(tuple(range(1, 14)), n_predict=3)
    s.run_until_idle()
    slot = s.slots[0]
    assert len(slot.result) == 3
    assert slot.prompt.n_tokens() == 15
    assert slot.prompt.tokens[13:] == tuple(slot.result[:2])


def test_busy_slot_requested_by_id_defers() -> None:
    s = make_server("shared", "hybrid", params=ServerParams(n_slots=2, cache_ram=-1, cache_ram_unit=1024))
    r = s.handle_completion(A, n_predict=5)
    r2 = s.handle_completion(B, id_slot=r.slot)
    assert r2.status == "deferred" and r2.slot == r.slot
    assert s.slots[1 - r.slot].task is None
