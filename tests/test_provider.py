"""SyntheticProvider: sizes per memory kind, state round trips, refusal of bad buffers, seq_rm and positions.

Sizes: header 8 bytes, one component header 25 bytes, KV cell 32 bytes, recurrent block 1024 bytes.
"""

from __future__ import annotations

import pytest

from harness.model import (
    STATE_SEQ_FLAGS_NONE,
    STATE_SEQ_FLAGS_PARTIAL_ONLY,
    MemoryKind,
    SeqRmType,
    StateProvider,
    SyntheticProvider,
)

HDR, COMP, CELL, RS = 8, 25, 32, 1024
FULL, PART = STATE_SEQ_FLAGS_NONE, STATE_SEQ_FLAGS_PARTIAL_ONLY


def _prov(kind: MemoryKind, n: int = 0) -> SyntheticProvider:
    p = SyntheticProvider(kind, n_seq=2)
    if n:
        assert p.decode(0, list(range(1, n + 1)), 0) == 0
    return p


def _sizes(kind: MemoryKind, n: int) -> tuple[int, int]:
    p = _prov(kind, n)
    return p.state_seq_get_size_ext(0, FULL), p.state_seq_get_size_ext(0, PART)


def test_provider_satisfies_protocol() -> None:
    assert isinstance(_prov(MemoryKind.HYBRID), StateProvider)


@pytest.mark.parametrize("n", [1, 10, 40])
def test_transformer_grows_and_partial_equals_full(n: int) -> None:
    assert _sizes(MemoryKind.TRANSFORMER, n) == (HDR + COMP + CELL * n,) * 2


@pytest.mark.parametrize("n", [1, 10, 40])
def test_recurrent_constant(n: int) -> None:
    assert _sizes(MemoryKind.RECURRENT, n) == (1057, 1057)


def test_empty_sequence_sizes() -> None:
    assert _sizes(MemoryKind.RECURRENT, 0) == (HDR + COMP, HDR + COMP)
    assert _sizes(MemoryKind.HYBRID, 0) == (HDR + 2 * COMP, HDR + COMP)


@pytest.mark.parametrize("n", [1, 10, 40])
def test_hybrid_partial_constant_full_growing(n: int) -> None:
    full, part = _sizes(MemoryKind.HYBRID, n)
    assert part == HDR + COMP + RS == 1057
    assert full == HDR + (COMP + RS) + (COMP + CELL * n)


@pytest.mark.parametrize(("n", "cells"), [(3, 3), (8, 8), (9, 8), (40, 8)])
def test_iswa_partial_bounded_by_window(n: int, cells: int) -> None:
    full, part = _sizes(MemoryKind.ISWA, n)
    assert part == HDR + COMP + CELL * cells
    assert full == HDR + (COMP + CELL * n) + (COMP + CELL * cells)


def test_seq_rm_types() -> None:
    assert _prov(MemoryKind.TRANSFORMER).seq_rm_type() is SeqRmType.PART
    assert _prov(MemoryKind.ISWA).seq_rm_type() is SeqRmType.PART
    assert _prov(MemoryKind.RECURRENT).seq_rm_type() is SeqRmType.FULL
    assert _prov(MemoryKind.HYBRID).seq_rm_type() is SeqRmType.FULL
    assert _prov(MemoryKind.ISWA).n_swa == 8 and _prov(MemoryKind.HYBRID).n_swa == 0


@pytest.mark.parametrize("kind", list(MemoryKind))
def test_full_state_round_trip_restores_tokens(kind: MemoryKind) -> None:
    p = _prov(kind, 12)
    data = p.state_seq_get_data_ext(0, FULL)
    assert len(data) == p.state_seq_get_size_ext(0, FULL)
    assert p.memory_seq_rm(0, -1, -1)
    assert p.seq_tokens(0) == ()
    # into the same sequence and into another one
    assert p.state_seq_set_data_ext(0, data, FULL) == len(data)
    assert p.state_seq_set_data_ext(1, data, FULL) == len(data)
    assert p.seq_tokens(0) == p.seq_tokens(1) == tuple(range(1, 13))
    assert p.state_seq_get_data_ext(1, FULL) == data


def test_partial_round_trip_hybrid_restores_recurrent_part_only() -> None:
    p = _prov(MemoryKind.HYBRID, 10)
    ck = p.state_seq_get_data_ext(0, PART)
    assert p.decode(0, [50, 51, 52], 10) == 0
    assert p.state_seq_set_data_ext(0, ck, PART) == len(ck)
    # recurrent part is back at 10 tokens, the KV part still has 13: the parts disagree
    assert p.seq_tokens(0) is None
    assert p.memory_seq_pos_max(0) == 9
    assert p.memory_seq_rm(0, 10, -1)
    assert p.seq_tokens(0) == tuple(range(1, 11))


@pytest.mark.parametrize("kind", list(MemoryKind))
def test_truncated_buffer_is_refused_and_clears(kind: MemoryKind) -> None:
    p = _prov(kind, 12)
    data = p.state_seq_get_data_ext(0, FULL)
    assert p.state_seq_set_data_ext(0, data[:-1], FULL) == 0
    assert p.seq_tokens(0) == ()
    assert p.memory_seq_pos_min(0) == -1


@pytest.mark.parametrize("kind", list(MemoryKind))
def test_corrupted_buffer_is_refused(kind: MemoryKind) -> None:
    p = _prov(kind, 12)
    data = bytearray(p.state_seq_get_data_ext(0, FULL))
    data[-3] ^= 0xFF  # inside the last cell / the recurrent block
    assert p.state_seq_set_data_ext(1, bytes(data), FULL) == 0
    assert p.seq_tokens(1) == ()
    # seq 0 untouched
    assert p.seq_tokens(0) == tuple(range(1, 13))


def test_wrong_flags_or_kind_or_empty_buffer_refused() -> None:
    p = _prov(MemoryKind.HYBRID, 5)
    full = p.state_seq_get_data_ext(0, FULL)
    part = p.state_seq_get_data_ext(0, PART)
    assert p.state_seq_set_data_ext(1, full, PART) == 0
    assert p.state_seq_set_data_ext(1, part, FULL) == 0
    assert p.state_seq_set_data_ext(1, b"", FULL) == 0
    other = _prov(MemoryKind.RECURRENT, 5)
    assert other.state_seq_set_data_ext(0, part, PART) == 0
    assert other.seq_tokens(0) == ()


def test_set_refused_when_kv_has_no_room() -> None:
    p = SyntheticProvider(MemoryKind.TRANSFORMER, n_seq=2, n_ctx=16)
    assert p.decode(0, list(range(10)), 0) == 0
    data = p.state_seq_get_data_ext(0, FULL)
    assert p.state_seq_set_data_ext(1, data, FULL) == 0  # 10 + 10 cells > 16
    assert p.memory_seq_rm(0, 4, -1)
    assert p.kv_cells_used() == 4
    assert p.state_seq_set_data_ext(1, data, FULL) == len(data)  # 4 + 10 <= 16


def test_recurrent_seq_rm_partial_suffix_fails() -> None:
    p = _prov(MemoryKind.RECURRENT, 10)
    assert p.memory_seq_rm(0, 5, -1) is False
    assert p.seq_tokens(0) == tuple(range(1, 11))
    assert p.memory_seq_rm(0, 10, -1) is True  # removes nothing
    assert p.seq_tokens(0) == tuple(range(1, 11))
    assert p.memory_seq_rm(0, 0, -1) is True  # removes everything
    assert p.seq_tokens(0) == ()


def test_hybrid_seq_rm_fails_as_a_whole() -> None:
    p = _prov(MemoryKind.HYBRID, 10)
    full_before = p.state_seq_get_size_ext(0, FULL)
    assert p.memory_seq_rm(0, 4, -1) is False
    assert p.state_seq_get_size_ext(0, FULL) == full_before  # the KV part was not truncated either
    assert p.seq_tokens(0) == tuple(range(1, 11))


def test_transformer_and_iswa_seq_rm_suffix() -> None:
    t = _prov(MemoryKind.TRANSFORMER, 10)
    assert t.memory_seq_rm(0, 6, -1)
    assert t.seq_tokens(0) == tuple(range(1, 7))
    w = _prov(MemoryKind.ISWA, 20)
    assert w.memory_seq_rm(0, 15, -1)
    assert w.seq_tokens(0) == tuple(range(1, 16))
    # SWA kept [12, 20); after removing [15, ..) it keeps [12, 15)
    assert (w.memory_seq_pos_min(0), w.memory_seq_pos_max(0)) == (12, 14)


def test_seq_pos_min_max_per_kind() -> None:
    t = _prov(MemoryKind.TRANSFORMER, 10)
    assert (t.memory_seq_pos_min(0), t.memory_seq_pos_max(0)) == (0, 9)
    r = _prov(MemoryKind.RECURRENT, 10)
    assert (r.memory_seq_pos_min(0), r.memory_seq_pos_max(0)) == (9, 9)
    h = _prov(MemoryKind.HYBRID, 10)
    # max of the parts' minima: recurrent 9, KV 0
    assert (h.memory_seq_pos_min(0), h.memory_seq_pos_max(0)) == (9, 9)
    w = _prov(MemoryKind.ISWA, 20)
    assert (w.memory_seq_pos_min(0), w.memory_seq_pos_max(0)) == (12, 19)
    e = _prov(MemoryKind.HYBRID)
    assert (e.memory_seq_pos_min(0), e.memory_seq_pos_max(0)) == (-1, -1)


def test_decode_kv_full_and_out_of_order() -> None:
    p = SyntheticProvider(MemoryKind.TRANSFORMER, n_seq=2, n_ctx=8)
    assert p.decode(0, [1, 2, 3, 4, 5], 0) == 0
    assert p.decode(1, [1, 2, 3, 4], 0) == 1  # 5 + 4 > 8
    assert p.seq_tokens(1) == ()
    assert p.decode(0, [6], 3) == -1  # position 3 is not the next one (5)
    assert p.seq_tokens(0) == (1, 2, 3, 4, 5)


def test_seq_cp_copies_whole_sequence() -> None:
    p = _prov(MemoryKind.HYBRID, 7)
    p.memory_seq_cp(0, 1, -1, -1)
    assert p.seq_tokens(1) == tuple(range(1, 8))
    assert p.state_seq_get_data_ext(1, FULL) == p.state_seq_get_data_ext(0, FULL)
    # then each goes its own way: the copy shares no component with its source
    assert p.decode(1, [8], 7) == 0 and p.memory_seq_rm(0, 0, -1)
    assert p.seq_tokens(1) == tuple(range(1, 9)) and p.seq_tokens(0) == ()
    assert p.state_seq_get_data_ext(1, PART) != p.state_seq_get_data_ext(0, PART)


def test_a_partial_hybrid_restore_needs_no_kv_room() -> None:
    # a hybrid's partial state is the recurrent part only: no KV cell to place, so it is read even
    # where the count of all sequences' cells is above n_ctx (a seq_cp filled another stream)
    p = SyntheticProvider(MemoryKind.HYBRID, n_seq=2, n_ctx=32)
    assert p.decode(0, list(range(1, 18)), 0) == 0
    part = p.state_seq_get_data_ext(0, STATE_SEQ_FLAGS_PARTIAL_ONLY)
    p.memory_seq_cp(0, 1, -1, -1)
    assert p.kv_cells_used() > 32
    assert p.state_seq_set_data_ext(0, part, STATE_SEQ_FLAGS_PARTIAL_ONLY) == len(part)
