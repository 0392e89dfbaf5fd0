"""ServerPromptCache.alloc (server-task.cpp:1711-1791) in both semantics, with the allocation seam.

All caches here use a unit of 1 byte, so ``limit`` numbers are bytes.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from conftest import Kit

from harness.model import BadAlloc, ServerPrompt, ServerPromptCache, ServerPromptCacheState, ServerPromptData

KitF = Callable[[str], Kit]
SEMS = ["master", "shared"]


def _tokens(cache: ServerPromptCache) -> list[tuple[int, ...]]:
    return [e.prompt.tokens for e in cache.states]


def _three(k: Kit, limit: int) -> ServerPromptCache:
    """A cache with entries A, B, C of 300 bytes each (front = A)."""
    cache = k.cache(limit)
    for t in ((1, 1), (2, 2), (3, 3)):
        k.entry(cache, t, 300)
    assert cache.size() == 900
    return cache


# ---- contained check, over-limit skip, obsolete removal, eviction ------------------------------


@pytest.mark.parametrize("sem", SEMS)
@pytest.mark.parametrize("new", [(1, 2, 3), (1, 2, 3, 4, 5), ()])
def test_contained_prompt_returns_none_cache_untouched(kit: KitF, sem: str, new: tuple[int, ...]) -> None:
    k = kit(sem)
    cache = k.cache(10_000)
    e = k.entry(cache, (1, 2, 3, 4, 5), 100, ckpts=[k.ckpt(3, tgt=50)])
    live, count = k.host.ledger.live_bytes, k.host.seam.count
    assert cache.alloc(k.prompt(new), 10, 0) is None
    assert cache.states == [e] and cache.size() == 150 and cache.limit_size == 10_000
    assert k.host.ledger.live_bytes == live
    assert k.host.seam.count == count  # nothing was allocated
    assert cache.log[-1] == "prompt is already in the cache, skipping"


def test_contained_check_ignores_checkpoints(kit: KitF) -> None:
    """A longer entry without checkpoints still 'contains' a shorter prompt that has one."""
    k = kit("shared")
    cache = k.cache(0)
    k.entry(cache, tuple(range(20)), 100)
    pr = k.prompt(range(10), [k.ckpt(5, tgt=40)])
    assert cache.alloc(pr, 80, 0) is None
    assert len(cache) == 1


@pytest.mark.parametrize("sem", SEMS)
def test_over_limit_skip_no_eviction_no_removal(kit: KitF, sem: str) -> None:
    k = kit(sem)
    cache = k.cache(1000)
    a = k.entry(cache, (1, 2), 600)  # a prefix of the new prompt: would be obsolete
    live = k.host.ledger.live_bytes
    assert cache.alloc(k.prompt((1, 2, 3)), 900, 101) is None  # 1001 > 1000
    assert cache.states == [a] and cache.size() == 600 and cache.limit_size == 1000
    assert k.host.ledger.live_bytes == live
    # exactly at the limit is admitted (and evicts a to make room)
    e = cache.alloc(k.prompt((1, 2, 3)), 900, 100)
    assert e is not None and cache.states == [e] and cache.size() == 1000


@pytest.mark.parametrize("sem", SEMS)
def test_over_limit_counts_checkpoints(kit: KitF, sem: str) -> None:
    k = kit(sem)
    cache = k.cache(1000)
    pr = k.prompt((7, 8, 9), [k.ckpt(1, tgt=300, dft=100, spec=1), k.ckpt(2, tgt=300)])
    assert cache.alloc(pr, 300, 0) is None  # 300 + 701 = 1001
    assert len(cache) == 0
    k.assert_no_leak(cache, pr)


def test_obsolete_prefix_entries_removed(kit: KitF) -> None:
    k = kit("shared")
    cache = k.cache(0)  # no byte limit: removal happens anyway
    a = k.entry(cache, (1, 2), 10, ckpts=[k.ckpt(1, tgt=33)])
    k.entry(cache, (9, 9), 10)
    k.entry(cache, (1, 3), 10)  # shares (1,) but is not a prefix of the new prompt
    a_ckpt = a.prompt.checkpoints[0].data_tgt
    assert a_ckpt is not None
    new = cache.alloc(k.prompt((1, 2, 3, 5)), 10, 0)
    assert new is not None
    assert _tokens(cache) == [(9, 9), (1, 3), (1, 2, 3, 5)]
    assert a_ckpt.released
    k.assert_no_leak(cache)


def test_every_obsolete_entry_removed(kit: KitF) -> None:
    """Two prefix entries cannot both come from alloc; placed by hand, both go."""
    k = kit("shared")
    cache = k.cache(0)
    for t in ((1,), (5,), (1, 2, 3)):
        cache.states.append(ServerPromptCacheState(k.prompt(t), ServerPromptData(k.payload(10))))
    assert cache.alloc(k.prompt((1, 2, 3, 4)), 10, 0) is not None
    assert _tokens(cache) == [(5,), (1, 2, 3, 4)]
    assert k.host.ledger.live_bytes == 20


@pytest.mark.parametrize("sem", SEMS)
def test_evict_oldest_first_before_allocating(kit: KitF, sem: str) -> None:
    k = kit(sem)
    cache = _three(k, 1000)
    with k.host.operation("save") as op:
        e = cache.alloc(k.prompt((4, 4)), 400, 50)  # need 450: 900+450 > 1000, 600+450 > 1000, 300+450 ok
    assert e is not None
    assert _tokens(cache) == [(3, 3), (4, 4)]
    assert cache.size() == 750
    # the two evicted entries were freed before the new buffers were allocated
    assert op.peak == 900 and op.live_after == 750 and k.host.ledger.peak_bytes == 900
    assert cache.log.count("making room, removing oldest entry (size = 300)") == 2


@pytest.mark.parametrize("sem", SEMS)
def test_make_room_boundary(kit: KitF, sem: str) -> None:
    k = kit(sem)
    cache = k.cache(1000)
    k.entry(cache, (1,), 300)
    k.entry(cache, (2,), 300)
    assert cache.alloc(k.prompt((3,)), 400, 0) is not None  # 600 + 400 == 1000: nothing evicted
    assert _tokens(cache) == [(1,), (2,), (3,)]
    assert cache.alloc(k.prompt((4,)), 1, 0) is not None  # 1000 + 1 > 1000: the oldest goes
    assert _tokens(cache) == [(2,), (3,), (4,)] and cache.size() == 701


def test_new_entry_state_buffers_zeroed_and_sized(kit: KitF) -> None:
    k = kit("master")
    cache = k.cache(0)
    e = cache.alloc(k.prompt((1,)), 64, 16)
    assert e is not None and e.data.main is not None and e.data.drft is not None
    assert e.data.main.data == bytes(64) and e.data.drft.data == bytes(16)
    assert cache.alloc(k.prompt((2,)), 64, 0) is not None
    assert cache.states[-1].data.drft is None and cache.states[-1].size() == 64


# ---- 0.4 recovery on bad_alloc at the state buffers ---------------------------------------------


@pytest.mark.parametrize("sem", SEMS)
def test_bad_alloc_at_state_tgt_reduces_limit_to_forty_percent(kit: KitF, sem: str) -> None:
    k = kit(sem)
    cache = _three(k, 10_000)
    k.host.seam.arm(1)
    assert cache.alloc(k.prompt((4, 4)), 500, 0) is None
    assert k.host.seam.fired_sites == ["alloc.state_tgt"]
    assert cache.limit_size == 360  # int(0.4 * 900)
    assert _tokens(cache) == [(3, 3)]  # update(): 900 > 360, 600 > 360, 300 <= 360
    k.assert_no_leak(cache)


@pytest.mark.parametrize("sem", SEMS)
def test_recovery_limit_measured_after_evictions(kit: KitF, sem: str) -> None:
    k = kit(sem)
    cache = _three(k, 1000)
    k.host.seam.arm(1)
    assert cache.alloc(k.prompt((4, 4)), 450, 0) is None
    # A and B were evicted first (size 300), so the limit is int(0.4 * 300) = 120, not 360
    assert cache.limit_size == 120
    assert len(cache) == 0  # update() then drops C (300 > 120)
    k.assert_no_leak(cache)


@pytest.mark.parametrize("sem", SEMS)
def test_bad_alloc_at_state_dft_releases_tgt(kit: KitF, sem: str) -> None:
    k = kit(sem)
    cache = _three(k, 10_000)
    k.host.seam.arm(2)
    assert cache.alloc(k.prompt((4, 4)), 500, 70) is None
    assert k.host.seam.fired_sites == ["alloc.state_dft"]
    assert cache.limit_size == 360 and _tokens(cache) == [(3, 3)]
    k.assert_no_leak(cache)
    assert k.host.ledger.live_bytes == 300


@pytest.mark.parametrize("sem", SEMS)
def test_bad_alloc_with_empty_cache_disables_caching(kit: KitF, sem: str) -> None:
    k = kit(sem)
    cache = k.cache(0)  # unlimited
    k.host.seam.arm(1)
    assert cache.alloc(k.prompt((1, 2)), 100, 0) is None
    assert cache.limit_size == 1
    k.host.seam.disarm()
    assert cache.alloc(k.prompt((5,)), 2, 0) is None  # 2 > 1: skipped for good
    assert cache.alloc(k.prompt((6,)), 1, 0) is not None
    assert len(cache) == 1


# ---- failures after the state buffers: master escapes, shared recovers --------------------------


def _setup(k: Kit) -> tuple[ServerPromptCache, ServerPrompt]:
    """A cache [A(300), B(300), C(100)] limit 1200, and a prompt with two checkpoints of 124 and 136 bytes.

    Saving it with S = 200 + 50 needs 510: 700 + 510 > 1200 evicts A, 400 + 510 fits.
    """
    cache = k.cache(1200)
    for t, n in (((1, 1), 300), ((2, 2), 300), ((3, 3), 100)):
        k.entry(cache, t, n)
    pr = k.prompt((4, 4, 4), [k.ckpt(1, tgt=100, dft=20, spec=4), k.ckpt(2, tgt=110, dft=22, spec=4)])
    return cache, pr


def _nth(k: Kit, site: str, occurrence: int) -> int:
    """Dry run on an identical setup: the 1-based allocation number of ``site`` (its n-th occurrence)."""
    dry = Kit(k.sem.name)
    cache, pr = _setup(dry)
    dry.host.seam.reset_trace()
    assert cache.alloc(pr, 200, 50) is not None
    hits = [i + 1 for i, s in enumerate(dry.host.seam.sites) if s == site]
    return hits[occurrence - 1]


def test_alloc_site_order(kit: KitF) -> None:
    m, s = kit("master"), kit("shared")
    for k in (m, s):
        cache, pr = _setup(k)
        k.host.seam.reset_trace()
        assert cache.alloc(pr, 200, 50) is not None
    head = ["alloc.state_tgt", "alloc.state_dft", "tokens.clone"]
    per_ckpt_master = ["ckpt_copy.node", "ckpt_copy.tgt", "ckpt_copy.dft", "ckpt_copy.spec"]
    per_ckpt_shared = ["ckpt_copy.node", "ckpt_copy.spec"]
    assert m.host.seam.sites == [*head, *per_ckpt_master * 2, "alloc.states_push_back"]
    assert s.host.seam.sites == [*head, *per_ckpt_shared * 2, "alloc.states_push_back"]


MASTER_SITES = [
    ("tokens.clone", 1),
    ("ckpt_copy.node", 1),
    ("ckpt_copy.tgt", 1),
    ("ckpt_copy.dft", 1),
    ("ckpt_copy.spec", 1),
    ("ckpt_copy.node", 2),
    ("ckpt_copy.tgt", 2),
    ("ckpt_copy.dft", 2),
    ("ckpt_copy.spec", 2),
    ("alloc.states_push_back", 1),
]
SHARED_SITES = [
    ("tokens.clone", 1),
    ("ckpt_copy.node", 1),
    ("ckpt_copy.spec", 1),
    ("ckpt_copy.node", 2),
    ("ckpt_copy.spec", 2),
    ("alloc.states_push_back", 1),
]


@pytest.mark.parametrize(("site", "occ"), MASTER_SITES)
def test_master_bad_alloc_after_state_buffers_escapes(kit: KitF, site: str, occ: int) -> None:
    k = kit("master")
    cache, pr = _setup(k)
    k.host.seam.arm(_nth(k, site, occ))
    with pytest.raises(BadAlloc) as ei:
        cache.alloc(pr, 200, 50)
    assert ei.value.site == site
    # upstream would terminate here; the model unwinds: A was evicted (900 + 500 > 1200), nothing added,
    # the limit is unchanged, and every temporary buffer was freed
    assert _tokens(cache) == [(2, 2), (3, 3)]
    assert cache.limit_size == 1200
    k.assert_no_leak(cache, pr)
    assert k.host.ledger.live_bytes == 400 + 124 + 136


@pytest.mark.parametrize(("site", "occ"), SHARED_SITES)
def test_shared_bad_alloc_after_state_buffers_is_caught(kit: KitF, site: str, occ: int) -> None:
    k = kit("shared")
    cache, pr = _setup(k)
    k.host.seam.arm(_nth(k, site, occ))
    assert cache.alloc(pr, 200, 50) is None
    assert k.host.seam.fired_sites == [site]
    # recovery: limit from the size after eviction of A (int(0.4 * 400)), then update() drops B
    assert cache.limit_size == 160
    assert _tokens(cache) == [(3, 3)]
    # no partial entry and no leak: the prompt's payloads are back to one holder each
    assert all(p.holders == 1 for c in pr.checkpoints for p in c.payloads())
    k.assert_no_leak(cache, pr)
    assert k.host.ledger.live_bytes == 100 + 124 + 136


@pytest.mark.parametrize(("site", "occ"), [("alloc.state_tgt", 1), ("alloc.state_dft", 1)])
def test_state_buffer_failure_recovers_in_master_too(kit: KitF, site: str, occ: int) -> None:
    k = kit("master")
    cache, pr = _setup(k)
    k.host.seam.arm(_nth(k, site, occ))
    assert cache.alloc(pr, 200, 50) is None
    assert cache.limit_size == 160 and _tokens(cache) == [(3, 3)]
    k.assert_no_leak(cache, pr)


@pytest.mark.parametrize("sem", SEMS)
def test_persistent_failure_from_state_dft(kit: KitF, sem: str) -> None:
    k = kit(sem)
    cache, pr = _setup(k)
    k.host.seam.arm(2, persistent=True)
    assert cache.alloc(pr, 200, 50) is None
    assert k.host.seam.disarm() == 1  # the handler itself allocates nothing
    assert cache.limit_size == 160
    k.assert_no_leak(cache, pr)


# ---- what the entry holds in each semantics -----------------------------------------------------


def test_shared_alloc_shares_checkpoint_payloads(kit: KitF) -> None:
    k = kit("shared")
    cache = k.cache(0)
    pr = k.prompt((1, 2, 3), [k.ckpt(2, tgt=100, dft=20, spec=4)])
    e = cache.alloc(pr, 50, 0)
    assert e is not None
    src, dst = pr.checkpoints[0], e.prompt.checkpoints[0]
    assert dst is not src
    assert dst.data_tgt is src.data_tgt and dst.data_dft is src.data_dft
    assert src.data_tgt is not None and src.data_tgt.holders == 2
    assert src.data_dft is not None and src.data_dft.holders == 2
    assert dst.data_spec is not src.data_spec
    assert e.size() == 50 + 124  # logical: charged in full
    assert k.host.ledger.live_bytes == 124 + 50 + 4  # physical: only spec copied
    # the prompt dropping its checkpoints does not free what the entry still holds
    tgt = src.data_tgt
    pr.checkpoints.clear()
    assert not tgt.released and tgt.holders == 1
    k.assert_no_leak(cache)
    cache._pop_front()
    assert tgt.released and k.host.ledger.live_bytes == 0


def test_master_alloc_copies_checkpoint_payloads(kit: KitF) -> None:
    k = kit("master")
    cache = k.cache(0)
    pr = k.prompt((1, 2, 3), [k.ckpt(2, tgt=100, dft=20, spec=4)])
    e = cache.alloc(pr, 50, 0)
    assert e is not None
    for a, b in zip(pr.checkpoints[0].payloads(), e.prompt.checkpoints[0].payloads(), strict=True):
        assert a.ident != b.ident and a.data == b.data and a.holders == b.holders == 1
    assert e.size() == 174
    assert k.host.ledger.live_bytes == 124 + 174
    k.assert_no_leak(cache, pr)


@pytest.mark.parametrize("sem", SEMS)
def test_limit_invariant_after_successful_alloc(kit: KitF, sem: str) -> None:
    k = kit(sem)
    cache = k.cache(1000)
    sizes = [120, 480, 300, 250, 700, 90, 999, 10]
    expect = [[120], [120, 480], [120, 480, 300], [300, 250], [250, 700], [700, 90], [999], [10]]
    for i, (n, exp) in enumerate(zip(sizes, expect, strict=True)):
        e = cache.alloc(k.prompt((100 + i,)), n, 0)
        assert e is not None
        assert [x.size() for x in cache.states] == exp
        assert cache.size() <= 1000
