"""The policy properties' expectations, worked by hand from upstream's rules, and the restore seam."""

from __future__ import annotations

import weakref
from typing import Any

import pytest

from harness.errors import BadAlloc
from harness.model.provider import STATE_SEQ_FLAGS_NONE
from harness.model.server_context import ServerParams
from harness.targets.synthetic import make_server
from properties.policy import (
    CkptView,
    PolicyTracer,
    expected_alloc,
    expected_checkpoints,
    expected_load_choice,
    expected_update,
)


def test_load_choice_is_the_scan_not_the_global_best() -> None:
    new = (1, 2, 3, 4, 5, 6, 7, 8)
    # entry 0 beats the empty slot; entry 1 is better on both ratios; entry 2 keeps more but has a
    # lower f_sim than the best so far, so it is not taken (S-T.cpp:1817)
    entries = [(1, 2, 9, 9), (1, 2, 3, 4, 5, 6), (1, 2, 3, 4, 5)]
    assert expected_load_choice((), new, entries) == 1
    # f_keep < 0.25 is skipped even if it would win on f_sim (S-T.cpp:1813)
    assert expected_load_choice((), new, [(1, 2, 3) + (0,) * 10]) is None
    # the slot itself is the base: an equal entry never wins (strict comparison)
    assert expected_load_choice((1, 2, 3, 4), new, [(1, 2, 3, 4)]) is None
    # ties keep the earlier entry
    assert expected_load_choice((), new, [(1, 2, 9), (1, 2, 7)]) == 0


def test_update_evicts_oldest_by_bytes_then_by_tokens() -> None:
    entries = [(10, 100), (10, 100), (10, 100)]
    assert expected_update(entries, 250, 0) == [1, 2]
    # byte limit off: only the token limit evicts, oldest first, no more than needed
    assert expected_update(entries, 0, 20) == [1, 2]
    assert expected_update(entries, 0, 19) == [2]
    assert expected_update(entries, 0, 0) == [0, 1, 2]
    # with a byte limit the token limit grows to limit_size / bytes-per-token (S-T.cpp:1883)
    assert expected_update(entries, 300, 5) == [0, 1, 2]


def test_alloc_removes_prefixes_then_oldest_and_recovers() -> None:
    entries = [((1, 2), 50), ((5, 6, 7), 50), ((8,), 50)]
    plan = expected_alloc(entries, (1, 2, 3), 60, 150, 0)
    assert plan.outcome == "insert" and plan.survivors == [2]  # (1, 2) is a prefix; then 50+60+50 > 150
    assert plan.recovered_limit == 20 and plan.recovered == []  # 0.4 * 50
    assert expected_alloc(entries, (5, 6), 10, 150, 0).outcome == "contained"
    assert expected_alloc(entries, (9,), 151, 150, 0).outcome == "over-limit"
    assert expected_alloc(entries, (9,), 151, 0, 0).survivors == [0, 1, 2]  # no byte limit: nothing to make room for


def test_checkpoint_thinning_only_when_full_and_superseding() -> None:
    c = [CkptView(1, 4, 1), CkptView(2, 6, 1), CkptView(3, 20, 1)]
    # not full (3 + 1 < 5): no thinning although 6 <= 4 + 4
    assert expected_checkpoints(c, 9, 5, 4, 30) == [1, 2, 3]
    # full (3 + 1 >= 4): 6 is within min-step of 4 and erased; then the cap is met
    assert expected_checkpoints(c, 9, 4, 4, 30) == [1, 3]
    # the current task's checkpoints are spared (and fit); with a smaller cap the oldest is popped
    assert expected_checkpoints(c, 1, 4, 4, 30) == [1, 2, 3]
    assert expected_checkpoints(c, 1, 3, 4, 30) == [2, 3]
    # a checkpoint at the same n_tokens is superseded
    assert expected_checkpoints(c, 9, 5, 4, 20) == [1, 2]


def test_a_scoped_restore_fault_fails_the_read_and_clears_the_sequence() -> None:
    srv = make_server("shared", "transformer", params=ServerParams(cache_ram_unit=1024))
    tgt = srv.ctx_tgt
    assert tgt.decode(0, [1, 2, 3], 0) == 0
    data = tgt.state_seq_get_data_ext(0, STATE_SEQ_FLAGS_NONE)
    srv.host.seam.arm(1)  # unscoped: the model's own allocations only, the read is not counted
    assert tgt.state_seq_set_data_ext(0, data, STATE_SEQ_FLAGS_NONE) == len(data)
    srv.host.seam.arm(1, scope="load")
    assert tgt.state_seq_set_data_ext(0, data, STATE_SEQ_FLAGS_NONE) == len(data)  # no load running
    with srv.host.operation("load"):
        assert tgt.state_seq_set_data_ext(0, data, STATE_SEQ_FLAGS_NONE) == 0
    assert tgt.seq_tokens(0) == ()
    assert not srv.host.seam.armed and srv.host.seam.fired_sites == ["tgt.state_read"]
    with pytest.raises(BadAlloc):
        srv.host.seam.arm(1, scope="restore")
        with srv.host.operation("restore"):
            srv.host.scoped_check("x", 8, ("restore",))


def test_checkpoint_policy_holds_the_erased_checkpoints_until_its_check() -> None:
    """The check compares checkpoints by identity. create_checkpoint frees the checkpoints it erases
    before it allocates the new one, so unless the tracer holds them the new one may get the id()
    of an erased one and a correct list fails ("kept n_tokens [] of [1, 2]", order-dependent)."""
    params = ServerParams(cache_ram=6, cache_ram_unit=1024, n_ctx_checkpoints=3, checkpoint_min_step=4)
    srv = make_server("shared", "hybrid", params=params, n_ctx=256)
    inner = srv.create_checkpoint
    dead: list[int] = []

    def spy(slot: Any, *args: Any) -> None:
        olds = [weakref.ref(c) for c in slot.prompt.checkpoints]
        inner(slot, *args)
        dead.extend(1 for r in olds if r() is None)

    srv.create_checkpoint = spy  # type: ignore[method-assign]
    tracer = PolicyTracer(srv)
    # F1's program: the third request's checkpoint at n_tokens 1 supersedes 1 and thins 2
    for prompt in ((2, 1, 1, 1, 1), (1, 1, 1, 1, 1, 1), (1, 1)):
        srv.handle_completion(prompt, id_slot=0, n_cmpl=1, n_predict=1)
        srv.run_until_idle()
    assert tracer.branches["checkpoint_policy:thinned"] + tracer.branches["checkpoint_policy:superseded"] > 0
    assert dead == []
