"""ServerPromptCache.load (server-task.cpp:1793-1868) and update() (:1870-1905).

Entries for ``load`` hold real states of a SyntheticProvider: the state is produced in sequence 1 and
the slot restores into sequence 0.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import pytest
from conftest import Kit

from harness.model import (
    STATE_SEQ_FLAGS_NONE,
    CommonPromptCheckpoint,
    MemoryKind,
    ServerPrompt,
    ServerPromptCache,
    ServerPromptCacheState,
    SyntheticProvider,
)

KitF = Callable[[str], Kit]
FULL = STATE_SEQ_FLAGS_NONE
SLOT, SCRATCH = 0, 1


def _ctx(n_ctx: int = 4096, kind: MemoryKind = MemoryKind.TRANSFORMER, seed: int = 0) -> SyntheticProvider:
    return SyntheticProvider(kind, n_seq=2, n_ctx=n_ctx, seed=seed)


def _save(
    k: Kit,
    cache: ServerPromptCache,
    tgt: SyntheticProvider,
    tokens: Sequence[int],
    ckpts: Sequence[CommonPromptCheckpoint] = (),
    dft: SyntheticProvider | None = None,
) -> ServerPromptCacheState:
    """Process ``tokens`` in the scratch sequence, save it into the cache, then clear the scratch sequence."""
    ctxs = [c for c in (tgt, dft) if c is not None]
    for c in ctxs:
        assert c.memory_seq_rm(SCRATCH, -1, -1)
        assert c.decode(SCRATCH, list(tokens), 0) == 0
    sizes = [c.state_seq_get_size_ext(SCRATCH, FULL) for c in ctxs] + [0]
    pr = k.prompt(tokens, ckpts)
    e = cache.alloc(pr, sizes[0], sizes[1])
    assert e is not None
    for c, p in zip(ctxs, (e.data.main, e.data.drft), strict=False):
        assert p is not None
        p.fill(c.state_seq_get_data_ext(SCRATCH, FULL))
        assert c.memory_seq_rm(SCRATCH, -1, -1)
    pr.checkpoints.clear()
    return e


def _slot(k: Kit, tgt: SyntheticProvider, tokens: Sequence[int]) -> ServerPrompt:
    if tokens:
        assert tgt.decode(SLOT, list(tokens), 0) == 0
    return k.prompt(tokens)


N20 = tuple(range(1, 21))


# ---- choice of the entry ----------------------------------------------------------------------


def test_empty_slot_loads_qualifying_entry(kit: KitF) -> None:
    """Empty slot: base f_keep = -1 (not 0/0 = NaN, which would refuse every entry)."""
    k = kit("shared")
    tgt = _ctx()
    cache = k.cache(0)
    _save(k, cache, tgt, (1, 2, 3, 4, 5, 6, 7, 8))
    slot = _slot(k, tgt, ())
    assert cache.load(slot, (1, 2, 3, 4, 50, 51), tgt, None, SLOT)  # f_keep 0.5, f_sim 0.667
    assert slot.tokens == (1, 2, 3, 4, 5, 6, 7, 8)
    assert tgt.seq_tokens(SLOT) == slot.tokens
    assert len(cache) == 0


@pytest.mark.parametrize(("entry_len", "loaded"), [(20, False), (17, False), (16, True)])
def test_f_keep_threshold_quarter(kit: KitF, entry_len: int, loaded: bool) -> None:
    """lcp 4: f_keep 4/20 = 0.2 and 4/17 skip, 4/16 = 0.25 is enough."""
    k = kit("shared")
    tgt = _ctx()
    cache = k.cache(0)
    entry_tokens = (1, 2, 3, 4, *range(100, 100 + entry_len - 4))
    e = _save(k, cache, tgt, entry_tokens)
    slot = _slot(k, tgt, ())
    assert cache.load(slot, (1, 2, 3, 4, 9), tgt, None, SLOT)
    assert (slot.tokens == entry_tokens) is loaded
    assert (cache.states == [e]) is not loaded


def test_slot_with_full_prefix_is_never_replaced(kit: KitF) -> None:
    """The slot's f_keep is 1.0; an entry can only tie on f_keep, and the comparison is strict."""
    k = kit("shared")
    tgt = _ctx()
    cache = k.cache(0)
    e = _save(k, cache, tgt, (1, 2, 3, 4, 5, 6, 7, 8))  # lcp 8: f_keep 1.0 (a tie), f_sim 8/9 (better)
    slot = _slot(k, tgt, (1, 2, 3, 4, 5, 6))  # lcp 6: f_keep 1.0, f_sim 6/9
    assert cache.load(slot, (1, 2, 3, 4, 5, 6, 7, 8, 60), tgt, None, SLOT)
    assert slot.tokens == (1, 2, 3, 4, 5, 6) and cache.states == [e]
    assert e.data.main is not None and not e.data.main.released


def test_entry_must_beat_slot_on_both_ratios(kit: KitF) -> None:
    k = kit("shared")
    tgt = _ctx()
    cache = k.cache(0)
    new = (1, 2, 3, 4, 5, 6, 7, 8, 60)
    # slot: lcp 4 of 8 -> f_keep 0.5, f_sim 4/9
    slot = _slot(k, tgt, (1, 2, 3, 4, 90, 91, 92, 93))
    # equal f_sim (4/9), better f_keep (0.8): not enough
    tie = _save(k, cache, tgt, (1, 2, 3, 4, 77))
    assert cache.load(slot, new, tgt, None, SLOT)
    assert cache.states == [tie] and slot.tokens == (1, 2, 3, 4, 90, 91, 92, 93)
    # better f_sim (5/9) and better f_keep (5/8): taken
    better = _save(k, cache, tgt, (1, 2, 3, 4, 5, 80, 81, 82))
    assert cache.load(slot, new, tgt, None, SLOT)
    assert cache.states == [tie] and better not in cache.states
    assert slot.tokens == (1, 2, 3, 4, 5, 80, 81, 82)
    assert tgt.seq_tokens(SLOT) == (1, 2, 3, 4, 5, 80, 81, 82)


E_A = (*N20[:8], 200)  # lcp 8, len 9:  f_keep 0.889, f_sim 0.40
E_B = (*N20[:12], *range(300, 328))  # lcp 12, len 40: f_keep 0.30, f_sim 0.60


@pytest.mark.parametrize(("order", "winner"), [((E_A, E_B), E_A), ((E_B, E_A), E_B)])
def test_choice_depends_on_list_order(kit: KitF, order: tuple[tuple[int, ...], ...], winner: tuple[int, ...]) -> None:
    """The best-so-far is updated while scanning front to back: whichever qualifies first blocks the other."""
    k = kit("shared")
    tgt = _ctx()
    cache = k.cache(0)
    for t in order:
        _save(k, cache, tgt, t)
    slot = _slot(k, tgt, ())
    assert cache.load(slot, N20, tgt, None, SLOT)
    assert slot.tokens == winner
    assert [e.prompt.tokens for e in cache.states] == [t for t in order if t != winner]


def test_no_candidate_returns_true_and_changes_nothing(kit: KitF) -> None:
    k = kit("shared")
    tgt = _ctx()
    cache = k.cache(0)
    e = _save(k, cache, tgt, (7, 7, 7))
    slot = _slot(k, tgt, (1, 2))
    live = k.host.ledger.live_bytes
    assert cache.load(slot, (1, 2, 3), tgt, None, SLOT)
    assert cache.states == [e] and slot.tokens == (1, 2) and tgt.seq_tokens(SLOT) == (1, 2)
    assert k.host.ledger.live_bytes == live


# ---- the transfer ------------------------------------------------------------------------------


@pytest.mark.parametrize("sem", ["master", "shared"])
def test_transfer_moves_tokens_and_same_checkpoint_objects(kit: KitF, sem: str) -> None:
    k = kit(sem)
    tgt, dft = _ctx(), _ctx(seed=1)
    cache = k.cache(0)
    e = _save(k, cache, tgt, N20[:10], [k.ckpt(4, tgt=50, spec=3), k.ckpt(8, tgt=60)], dft=dft)
    entry_ckpts = list(e.prompt.checkpoints)
    main, drft = e.data.main, e.data.drft
    assert main is not None and drft is not None
    slot = _slot(k, tgt, (1, 2, 99))
    old = k.ckpt(2, tgt=40)
    slot.checkpoints.emplace_back(old)
    old_payload = old.data_tgt
    assert old_payload is not None
    assert cache.load(slot, N20, tgt, dft, SLOT)
    assert slot.tokens == N20[:10]
    assert list(slot.checkpoints) == entry_ckpts
    assert all(a is b for a, b in zip(slot.checkpoints, entry_ckpts, strict=True))
    assert len(cache) == 0
    assert main.released and drft.released and old_payload.released
    assert tgt.seq_tokens(SLOT) == dft.seq_tokens(SLOT) == N20[:10]
    k.assert_no_leak(cache, slot)
    assert k.host.ledger.live_bytes == 50 + 3 + 60


def test_main_restore_failure_returns_false_entry_intact(kit: KitF) -> None:
    k = kit("shared")
    tgt = _ctx()
    cache = k.cache(0)
    e = _save(k, cache, tgt, N20[:10], [k.ckpt(4, tgt=50)])
    main = e.data.main
    assert main is not None
    main.fill(b"\xff\xff\xff\xff")  # the header no longer parses
    size, ckpts = cache.size(), list(e.prompt.checkpoints)
    slot = _slot(k, tgt, (1, 2, 99))
    assert not cache.load(slot, N20, tgt, None, SLOT)
    assert cache.states == [e] and cache.size() == size
    assert e.data.main is main and not main.released
    assert e.prompt.tokens == N20[:10] and list(e.prompt.checkpoints) == ckpts
    assert slot.tokens == (1, 2, 99)  # the caller (get_available_slot) clears the slot


def test_draft_restore_failure_after_target_success_leaves_entry_without_main(kit: KitF) -> None:
    """Upstream hazard (server-task.cpp:1842-1857): main is already freed when the draft restore fails."""
    k = kit("shared")
    tgt = _ctx()
    dft = _ctx(n_ctx=16, seed=1)
    cache = k.cache(0)
    e = _save(k, cache, tgt, N20[:10], dft=dft)
    main, drft = e.data.main, e.data.drft
    assert main is not None and drft is not None
    assert dft.decode(SCRATCH, list(range(10)), 0) == 0  # the draft KV has 6 free cells: restore refused
    slot = _slot(k, tgt, ())
    assert not cache.load(slot, N20, tgt, dft, SLOT)
    assert cache.states == [e]
    assert e.data.main is None and main.released
    assert e.data.drft is drft and not drft.released
    assert cache.size() == drft.nbytes
    assert tgt.seq_tokens(SLOT) == N20[:10]  # the target restore had succeeded
    # later the draft has room again: the entry's empty main "restores" (0 bytes read == 0 expected),
    # so the slot receives the tokens while its target memory is empty
    assert dft.memory_seq_rm(SCRATCH, -1, -1)
    assert tgt.memory_seq_rm(SLOT, -1, -1)
    slot2 = _slot(k, tgt, ())
    assert cache.load(slot2, N20, tgt, dft, SLOT)
    assert slot2.tokens == N20[:10]
    assert tgt.seq_tokens(SLOT) == () and tgt.memory_seq_pos_min(SLOT) == -1
    assert dft.seq_tokens(SLOT) == N20[:10]
    assert len(cache) == 0


# ---- update() ----------------------------------------------------------------------------------


def _filled(k: Kit, spec: Sequence[tuple[int, int]], limit_bytes: int, limit_tokens: int) -> ServerPromptCache:
    """Entries of (n_tokens, bytes), each starting with a distinct token; then the limits are set."""
    cache = k.cache(0, 0)
    for i, (n_tok, nbytes) in enumerate(spec):
        k.entry(cache, (1000 + i, *range(n_tok - 1)), nbytes)
    cache.limit_size, cache.limit_tokens = limit_bytes, limit_tokens
    return cache


def _firsts(cache: ServerPromptCache) -> list[int]:
    return [e.prompt.tokens[0] - 1000 for e in cache.states]


def test_update_byte_limit_evicts_from_front(kit: KitF) -> None:
    k = kit("shared")
    cache = _filled(k, [(5, 400), (5, 400), (5, 400)], 1000, 0)
    cache.update()
    assert _firsts(cache) == [1, 2] and cache.size() == 800
    assert k.host.ledger.live_bytes == 800


def test_update_limit_size_zero_means_no_byte_limit(kit: KitF) -> None:
    k = kit("shared")
    cache = _filled(k, [(5, 10**6), (5, 10**6)], 0, 0)
    assert cache.update() == 0
    assert _firsts(cache) == [0, 1]


def test_update_token_limit_without_byte_limit(kit: KitF) -> None:
    k = kit("shared")
    cache = _filled(k, [(8, 100), (8, 100), (8, 100)], 0, 10)
    assert cache.update() == 10
    assert _firsts(cache) == [2]


def test_update_token_limit_zero_means_no_token_limit(kit: KitF) -> None:
    k = kit("shared")
    cache = _filled(k, [(500, 1), (500, 1)], 10, 0)
    assert cache.update() == 10  # max(0, 10 / 1.0)
    assert _firsts(cache) == [0, 1]


def test_update_dynamic_token_limit_grows_with_byte_limit(kit: KitF) -> None:
    k = kit("shared")
    cache = _filled(k, [(8, 100), (8, 100), (8, 100)], 1000, 10)
    # 12.5 bytes per token: 1000 / 12.5 = 80 tokens allowed
    assert cache.update() == 80
    assert _firsts(cache) == [0, 1, 2]


def test_update_dynamic_limit_computed_after_byte_pass(kit: KitF) -> None:
    k = kit("shared")
    cache = _filled(k, [(4, 900), (20, 200), (20, 200)], 1000, 10)
    # byte pass drops the first entry; then 400 B / 40 tok = 10 B/tok -> 100 tokens allowed.
    # (before the byte pass it would be 1300/44 B/tok -> 33 tokens, and a second entry would go)
    assert cache.update() == 100
    assert _firsts(cache) == [1, 2]


def test_update_bytes_per_token_floor_is_one(kit: KitF) -> None:
    k = kit("shared")
    cache = _filled(k, [(20, 5), (20, 5), (20, 5)], 50, 10)
    # 15 B / 60 tok = 0.25 -> 1.0: limit_tokens_cur = max(10, 50) = 50 < 60
    assert cache.update() == 50
    assert _firsts(cache) == [1, 2]


def test_update_float_truncation_can_evict_under_the_byte_limit(kit: KitF) -> None:
    """size == limit: 8 B over 7 tokens, float(8) / float(8/7) = 6.9999997 -> 6 tokens allowed."""
    k = kit("shared")
    cache = _filled(k, [(3, 4), (4, 4)], 8, 1)
    assert cache.update() == 6
    assert _firsts(cache) == [1]


def test_update_float_division_can_round_up_to_keep_everything(kit: KitF) -> None:
    """4 B over 3 tokens: spt = 1.3333334f, float(4) / spt = 2.9999999 -> 3.0f -> 3 tokens (a double gives 2)."""
    k = kit("shared")
    cache = _filled(k, [(1, 2), (2, 2)], 4, 1)
    assert cache.update() == 3
    assert _firsts(cache) == [0, 1]
