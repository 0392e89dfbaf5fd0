"""The allocation seam, payload holders and the ledger (harness/memory.py)."""

from __future__ import annotations

import pytest

from harness.model import BadAlloc, Host


def _try(host: Host, n: int, nbytes: int = 8) -> list[bool]:
    """Make ``n`` metadata allocations; True where one raised BadAlloc."""
    out = []
    for i in range(n):
        try:
            host.allocate(f"site{i + 1}", nbytes)
            out.append(False)
        except BadAlloc:
            out.append(True)
    return out


def test_transient_fault_fires_only_at_n() -> None:
    host = Host()
    host.seam.arm(3)
    assert _try(host, 6) == [False, False, True, False, False, False]
    assert host.seam.fired == 1
    assert host.seam.fired_sites == ["site3"]
    assert host.seam.count == 6


def test_persistent_fault_fires_at_n_and_after() -> None:
    host = Host()
    host.seam.arm(2, persistent=True)
    assert _try(host, 5) == [False, True, True, True, True]
    assert host.seam.fired == 4


def test_bad_alloc_names_site_number_and_size() -> None:
    host = Host()
    host.seam.arm(2)
    host.allocate("a", 4)
    with pytest.raises(BadAlloc) as ei:
        host.alloc_payload("alloc.state_tgt", 777, "state_main")
    assert (ei.value.site, ei.value.nth, ei.value.nbytes) == ("alloc.state_tgt", 2, 777)
    # the failed payload was never created
    assert host.ledger.live == {}
    assert host.ledger.live_bytes == 0


def test_disarm_returns_fired_and_restores_normal_behaviour() -> None:
    host = Host()
    host.seam.arm(1, persistent=True)
    assert _try(host, 3) == [True, True, True]
    assert host.seam.disarm() == 3
    assert not host.seam.armed
    assert _try(host, 4) == [False, False, False, False]
    p = host.alloc_payload("x", 10, "k")
    assert p is not None and p.nbytes == 10


def test_disarm_without_fault_returns_zero() -> None:
    host = Host()
    host.seam.arm(5)
    assert _try(host, 4) == [False] * 4
    assert host.seam.disarm() == 0


def test_arm_rejects_nth_below_one() -> None:
    with pytest.raises(ValueError):
        Host().seam.arm(0)


def test_zero_byte_allocations_never_reach_the_seam() -> None:
    host = Host()
    host.seam.arm(1)
    host.allocate("meta0", 0)
    assert host.alloc_payload("pay0", 0, "k") is None
    assert host.seam.count == 0
    assert host.seam.sites == []
    # the first non-empty allocation is the armed #1
    with pytest.raises(BadAlloc) as ei:
        host.allocate("meta1", 1)
    assert ei.value.site == "meta1" and ei.value.nth == 1


def test_scope_save_counts_only_inside_save_operation() -> None:
    host = Host()
    host.seam.arm(2, scope="save")
    # outside any operation and inside another operation: not counted, cannot fail
    assert _try(host, 3) == [False, False, False]
    with host.operation("load"):
        assert _try(host, 3) == [False, False, False]
    assert host.seam.count == 0
    with host.operation("save"):
        assert _try(host, 3) == [False, True, False]
    assert host.seam.count == 3
    # a fault fired inside the scope: the seam disarmed itself when "save" ended
    assert not host.seam.armed
    with host.operation("save"):
        assert _try(host, 3) == [False, False, False]


def test_scope_stays_armed_when_nothing_fired() -> None:
    host = Host()
    host.seam.arm(5, scope="save")
    with host.operation("save"):
        _try(host, 2)
    assert host.seam.armed
    with host.operation("save"):
        assert _try(host, 4) == [False, False, True, False]


def test_payload_holders_and_ledger() -> None:
    host = Host()
    a = host.alloc_payload("a", 100, "k")
    b = host.alloc_payload("b", 30, "k")
    assert a is not None and b is not None
    assert host.ledger.live_bytes == 130 and host.ledger.peak_bytes == 130
    assert a.acquire() is a and a.holders == 2
    a.release()
    assert a.ident in host.ledger.live and host.ledger.live_bytes == 130
    a.release()  # last holder
    assert a.released and a.ident not in host.ledger.live
    assert host.ledger.live_bytes == 30
    assert host.ledger.released == 1 and host.ledger.released_bytes == 100
    assert host.ledger.peak_bytes == 130
    with pytest.raises(RuntimeError):
        a.release()
    with pytest.raises(RuntimeError):
        _ = a.data
    with pytest.raises(RuntimeError):
        a.acquire()


def test_fill_seals_digest_and_keeps_size() -> None:
    host = Host()
    p = host.alloc_payload("a", 4, "k")
    assert p is not None and p.data == b"\0\0\0\0"
    d0 = p.digest
    assert p.fill(b"abcdef") == 4
    assert p.data == b"abcd" and p.digest != d0
    assert p.fill(b"x") == 1
    assert p.data == b"xbcd"


def test_rewrite_growth_goes_through_seam_shrink_does_not() -> None:
    host = Host()
    p = host.alloc_payload("a", 10, "k")
    assert p is not None
    host.seam.arm(1, persistent=True)
    p.rewrite(b"12345", "shrink")
    assert p.nbytes == 5 and host.ledger.live_bytes == 5
    with pytest.raises(BadAlloc):
        p.rewrite(b"x" * 20, "grow")
    assert host.seam.fired_sites == ["grow"]
    host.seam.disarm()
    p.rewrite(b"y" * 20, "grow")
    assert host.ledger.live_bytes == 20 and host.ledger.peak_bytes == 20


def test_operation_measures_peak_meta_and_live() -> None:
    host = Host()
    keep = host.alloc_payload("keep", 50, "k")
    assert keep is not None
    with host.operation("save") as op:
        t = host.alloc_payload("t", 200, "k")
        host.allocate("meta", 16)
        assert t is not None
        t.release()
        u = host.alloc_payload("u", 70, "k")
    assert (op.live_before, op.peak, op.live_after) == (50, 250, 120)
    assert op.peak_excess == 200
    assert op.meta_bytes == 16 and op.allocations == 3
    assert host.last_op is op
    assert u is not None and host.ledger.live_bytes == 120
