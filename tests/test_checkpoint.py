"""CommonPromptCheckpoint / CheckpointList in both semantics, and ServerContext.create_checkpoint.

Upstream: common/common.cpp:2260-2366 (checkpoint methods), server-context.cpp:2290-2353
(create_checkpoint: min-step thinning only when full, count cap, superseding).
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from conftest import Kit

from harness.model import (
    STATE_SEQ_FLAGS_PARTIAL_ONLY,
    BadAlloc,
    CommonPromptCheckpoint,
    GgmlAbort,
    MemoryKind,
    ServerContext,
    ServerParams,
    ServerSlot,
    SyntheticProvider,
    Task,
)
from harness.targets.synthetic import make_server

PART = STATE_SEQ_FLAGS_PARTIAL_ONLY
KitF = Callable[[str], Kit]


# ---- the checkpoint object ----------------------------------------------------------------------


def test_size_and_empty(kit: KitF) -> None:
    k = kit("master")
    c = k.ckpt(10, tgt=100, dft=20, spec=5)
    assert c.size() == 125 and not c.empty()
    assert k.ckpt(3, tgt=0, dft=20).empty()
    assert k.ckpt(3).size() == 0


def test_master_copy_is_deep_with_equal_bytes(kit: KitF) -> None:
    k = kit("master")
    c = k.ckpt(10, tgt=100, dft=20, spec=5, pos_min=4, pos_max=9, id_task=3)
    d = c.copy()
    assert (d.n_tokens, d.pos_min, d.pos_max, d.id_task) == (10, 4, 9, 3)
    for a, b in zip(c.payloads(), d.payloads(), strict=True):
        assert a is not b and a.ident != b.ident
        assert a.data == b.data
        assert a.holders == b.holders == 1
    assert k.host.ledger.live_bytes == 250


def test_shared_copy_shares_tgt_dft_and_copies_spec(kit: KitF) -> None:
    k = kit("shared")
    c = k.ckpt(10, tgt=100, dft=20, spec=5)
    d = c.copy()
    assert d.data_tgt is c.data_tgt and d.data_dft is c.data_dft
    assert c.data_tgt is not None and c.data_tgt.holders == 2
    assert c.data_dft is not None and c.data_dft.holders == 2
    assert d.data_spec is not c.data_spec
    assert d.data_spec is not None and c.data_spec is not None
    assert d.data_spec.data == c.data_spec.data and d.data_spec.holders == 1
    assert k.host.ledger.live_bytes == 130  # 100 + 20 shared, spec twice
    assert d.size() == c.size() == 125  # logical size unchanged


def test_shared_payload_released_exactly_with_last_holder(kit: KitF) -> None:
    k = kit("shared")
    c = k.ckpt(10, tgt=100)
    d = c.copy()
    e = d.copy()
    p = c.data_tgt
    assert p is not None and p.holders == 3
    c.destroy()
    d.destroy()
    assert p.ident in k.host.ledger.live and p.holders == 1 and k.host.ledger.live_bytes == 100
    e.destroy()
    assert p.released and p.ident not in k.host.ledger.live and k.host.ledger.live_bytes == 0


def _ctx(n: int, kind: MemoryKind = MemoryKind.TRANSFORMER) -> SyntheticProvider:
    ctx = SyntheticProvider(kind, n_seq=1)
    assert ctx.decode(0, list(range(1, n + 1)), 0) == 0
    return ctx


def test_shared_update_tgt_allocates_new_payload_other_holder_unchanged(kit: KitF) -> None:
    k = kit("shared")
    ctx = _ctx(5)
    c = CommonPromptCheckpoint(k.host, k.sem, n_tokens=5)
    c.update_tgt(ctx, 0, PART)
    old = c.data_tgt
    assert old is not None and old.nbytes == 8 + 25 + 5 * 32
    d = c.copy()
    old_bytes, old_digest = old.data, old.digest
    assert ctx.decode(0, [6, 7], 5) == 0
    d.update_tgt(ctx, 0, PART)
    assert d.data_tgt is not old and d.data_tgt is not None
    assert d.data_tgt.nbytes == 8 + 25 + 7 * 32 and d.data_tgt.holders == 1
    assert old.data == old_bytes and old.digest == old_digest and old.holders == 1
    assert c.data_tgt is old
    assert k.host.ledger.live_bytes == old.nbytes + d.data_tgt.nbytes


def test_master_update_tgt_rewrites_in_place(kit: KitF) -> None:
    k = kit("master")
    ctx = _ctx(5)
    c = CommonPromptCheckpoint(k.host, k.sem, n_tokens=5)
    c.update_tgt(ctx, 0, PART)
    p = c.data_tgt
    assert p is not None
    assert ctx.decode(0, [6, 7], 5) == 0
    c.update_tgt(ctx, 0, PART)
    assert c.data_tgt is p and p.nbytes == 8 + 25 + 7 * 32
    assert p.data == ctx.state_seq_get_data_ext(0, PART)
    assert k.host.ledger.live_bytes == p.nbytes


def test_update_and_load_with_null_ctx_are_noops(kit: KitF) -> None:
    k = kit("shared")
    c = CommonPromptCheckpoint(k.host, k.sem)
    c.update_tgt(None, 0, PART)
    c.update_dft(None, 0, PART)
    assert c.payloads() == []
    c.load_tgt(_ctx(3), 0, PART)  # empty data: nothing happens
    c.load_dft(None, 0, PART)


def test_load_tgt_restores_and_mismatch_aborts(kit: KitF) -> None:
    k = kit("shared")
    ctx = _ctx(6, MemoryKind.RECURRENT)
    c = CommonPromptCheckpoint(k.host, k.sem, n_tokens=6, pos_min=5, pos_max=5)
    c.update_tgt(ctx, 0, PART)
    assert ctx.decode(0, [9, 9], 6) == 0
    c.load_tgt(ctx, 0, PART)
    assert ctx.seq_tokens(0) == (1, 2, 3, 4, 5, 6)
    other = SyntheticProvider(MemoryKind.HYBRID, n_seq=1)  # different kind: refuses the buffer
    with pytest.raises(GgmlAbort):
        c.load_tgt(other, 0, PART)


def test_clear_dft_also_clears_spec(kit: KitF) -> None:
    k = kit("shared")
    c = k.ckpt(4, tgt=10, dft=7, spec=3)
    c.clear_dft()
    assert c.data_dft is None and c.data_spec is None and c.data_tgt is not None
    assert k.host.ledger.live_bytes == 10
    c.clear()
    assert (c.n_tokens, c.pos_min, c.pos_max) == (0, 0, 0) and k.host.ledger.live_bytes == 0


def test_list_copy_failure_unwinds_without_leak(kit: KitF) -> None:
    k = kit("master")
    pr = k.prompt(range(10), [k.ckpt(3, tgt=100), k.ckpt(6, tgt=200)])
    # master copy sites: node, tgt, node, tgt -> fail at the second checkpoint's payload
    k.host.seam.arm(4)
    with pytest.raises(BadAlloc) as ei:
        pr.checkpoints.copy()
    assert ei.value.site == "ckpt_copy.tgt" and ei.value.nbytes == 200
    assert k.host.seam.sites == ["ckpt_copy.node", "ckpt_copy.tgt", "ckpt_copy.node", "ckpt_copy.tgt"]
    k.assert_no_leak(None, pr)
    assert k.host.ledger.live_bytes == 300


@pytest.mark.parametrize("sem", ["master", "shared"])
def test_prompt_clone_copies_tokens_and_checkpoints(kit: KitF, sem: str) -> None:
    k = kit(sem)
    pr = k.prompt((5, 6, 7), [k.ckpt(2, tgt=40, dft=8, spec=4)])
    cl = pr.clone()
    assert cl.tokens == (5, 6, 7)
    a, b = pr.checkpoints[0], cl.checkpoints[0]
    assert a is not b
    assert a.data_tgt is not None and b.data_tgt is not None
    assert a.data_spec is not None and b.data_spec is not None
    assert b.data_spec is not a.data_spec  # value-owned in both semantics
    if sem == "shared":
        assert b.data_tgt is a.data_tgt and b.data_dft is a.data_dft and a.data_tgt.holders == 2
        assert k.host.ledger.live_bytes == 52 + 4
    else:
        assert b.data_tgt.ident != a.data_tgt.ident and b.data_tgt.data == a.data_tgt.data
        assert k.host.ledger.live_bytes == 2 * 52
    k.assert_no_leak(None, pr, cl)
    pr.clear()
    k.assert_no_leak(None, cl)
    cl.clear()
    assert k.host.ledger.live_bytes == 0


# ---- create_checkpoint ----------------------------------------------------------------------------

TASK = 7


def _server(cap: int, min_step: int) -> tuple[ServerContext, ServerSlot]:
    params = ServerParams(n_slots=1, cache_ram=0, n_ctx_checkpoints=cap, checkpoint_min_step=min_step)
    s = make_server("shared", "recurrent", params=params)
    slot = s.slots[0]
    slot.task = Task(TASK, tuple(range(1, 101)))
    return s, slot


def _seed(s: ServerContext, slot: ServerSlot, spec: list[tuple[int, int]]) -> None:
    """Put checkpoints (n_tokens, id_task) into the slot, each with a 10-byte payload."""
    for n, task in spec:
        c = CommonPromptCheckpoint(s.host, s.sem, n_tokens=n, id_task=task, pos_min=n - 1, pos_max=n - 1)
        c.data_tgt = s.host.alloc_payload("test", 10, "ckpt_tgt")
        slot.prompt.checkpoints.emplace_back(c)


def _create(s: ServerContext, slot: ServerSlot, n_tokens_new: int, n_tokens_cur: int = 4) -> CommonPromptCheckpoint:
    """Bring the slot to ``n_tokens_new`` tokens in memory plus a batch of ``n_tokens_cur``, then checkpoint."""
    assert s.ctx_tgt.memory_seq_rm(0, -1, -1)
    assert s.ctx_tgt.decode(0, list(range(1, n_tokens_new + 1)), 0) == 0
    slot.prompt.tokens = tuple(range(1, n_tokens_new + n_tokens_cur + 1))
    s.create_checkpoint(slot, n_tokens_cur, n_tokens_new - 1, n_tokens_new - 1)
    return slot.prompt.checkpoints.back()


def _ns(slot: ServerSlot) -> list[int]:
    return [c.n_tokens for c in slot.prompt.checkpoints]


def test_new_checkpoint_fields() -> None:
    s, slot = _server(cap=8, min_step=8)
    c = _create(s, slot, 40, n_tokens_cur=6)
    assert (c.n_tokens, c.pos_min, c.pos_max, c.id_task) == (40, 39, 39, TASK)
    assert c.data_tgt is not None and c.data_tgt.nbytes == 1057
    assert c.data_tgt.data == s.ctx_tgt.state_seq_get_data_ext(0, PART)
    assert c.data_dft is None and c.data_spec is None  # no draft context


def test_no_thinning_when_list_not_full() -> None:
    s, slot = _server(cap=5, min_step=8)
    _seed(s, slot, [(10, 1), (12, 1), (30, 1)])
    _create(s, slot, 40)
    assert _ns(slot) == [10, 12, 30, 40]  # 3 + 1 < 5: 12 is within 8 of 10 but kept


def test_thinning_when_full_keeps_first_and_erases_close_ones() -> None:
    s, slot = _server(cap=4, min_step=8)
    _seed(s, slot, [(10, 1), (12, 1), (30, 1)])
    erased = slot.prompt.checkpoints[1].data_tgt
    assert erased is not None
    _create(s, slot, 40)
    assert _ns(slot) == [10, 30, 40]
    assert erased.released
    assert s.host.ledger.live_bytes == 10 + 10 + 1057


def test_thinning_stops_once_there_is_room() -> None:
    s, slot = _server(cap=5, min_step=8)
    _seed(s, slot, [(10, 1), (12, 1), (14, 1), (16, 1), (30, 1)])
    _create(s, slot, 40)
    # 12 and 14 erased (size 5 -> 3, 3 + 1 < 5), then the walk stops: 16 survives although close to 10
    assert _ns(slot) == [10, 16, 30, 40]


def test_thinning_never_erases_current_task_checkpoints() -> None:
    s, slot = _server(cap=4, min_step=8)
    _seed(s, slot, [(10, 1), (12, TASK), (14, 1)])
    _create(s, slot, 40)
    # 12 is the current task's (kept, and becomes `last`); 14 <= 12 + 8 is erased
    assert _ns(slot) == [10, 12, 40]


def test_first_checkpoint_kept_even_at_zero_distance() -> None:
    s, slot = _server(cap=3, min_step=8)
    _seed(s, slot, [(1, 1), (5, 1)])
    _create(s, slot, 40)
    assert _ns(slot) == [1, 40]


def test_count_cap_pops_front() -> None:
    s, slot = _server(cap=3, min_step=0)
    _seed(s, slot, [(10, 1), (20, 1), (30, 1)])
    oldest = slot.prompt.checkpoints.front().data_tgt
    assert oldest is not None
    _create(s, slot, 40)
    assert _ns(slot) == [20, 30, 40]
    assert oldest.released


def test_count_cap_applies_to_current_task_checkpoints() -> None:
    s, slot = _server(cap=3, min_step=8)
    _seed(s, slot, [(10, TASK), (12, TASK), (14, TASK)])
    _create(s, slot, 40)
    assert _ns(slot) == [12, 14, 40]


def test_superseding_checkpoint_at_same_n_tokens() -> None:
    s, slot = _server(cap=5, min_step=8)
    _seed(s, slot, [(10, 1), (20, 1)])
    old = slot.prompt.checkpoints.back()
    old_payload = old.data_tgt
    assert old_payload is not None
    new = _create(s, slot, 20)
    assert _ns(slot) == [10, 20]
    assert new is not old and new.id_task == TASK
    assert old_payload.released
    assert new.data_tgt is not None and new.data_tgt.nbytes == 1057


# the second prompt has 49 + 46 = 95 tokens: checkpoints 4 + n_ubatch = 12 and 4 before its end (83, 91).
# cap 3: creating 83 finds the list full ([36, 44] + 1 >= 3): 44 <= 36 + 8 is thinned, so [36, 83];
# creating 91: 83 is the current task's, nothing to thin or pop -> [36, 83, 91]
@pytest.mark.parametrize(("cap", "expect"), [(32, [36, 44, 83, 91]), (3, [36, 83, 91]), (2, [83, 91])])
def test_server_checkpoints_ascending_and_capped(cap: int, expect: list[int]) -> None:
    params = ServerParams(n_slots=1, cache_ram=0, n_ctx_checkpoints=cap)
    s = make_server("shared", "recurrent", params=params)
    p1 = tuple(1 + (i * 7) % 23 for i in range(48))
    s.handle_completion(p1, n_predict=2)
    s.run_until_idle()
    assert _ns(s.slots[0]) == [36, 44]
    # extend the conversation: the slot's 49 tokens (48 + the one decoded reply token) plus 46 new ones
    assert s.slots[0].prompt.n_tokens() == 49
    p2 = s.slots[0].prompt.tokens + tuple(1 + (i * 5) % 19 for i in range(46))
    s.handle_completion(p2, n_predict=1)
    s.run_until_idle()
    ns = _ns(s.slots[0])
    assert ns == expect
    assert ns == sorted(set(ns))
    assert all(c.pos_max == c.n_tokens - 1 for c in s.slots[0].prompt.checkpoints)
