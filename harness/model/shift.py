"""Position arithmetic on one sequence's memory: ``seq_rm`` of a range and ``seq_add`` (a KV shift).

The synthetic provider (:mod:`harness.model.provider`) keeps a KV component as its token history,
indexed by position. ``--cache-reuse`` and context shift remove a range in the middle and move the
cells after it (upstream ``llama_kv_cache::seq_rm`` / ``seq_add``, src/llama-kv-cache.cpp at 0c1e570),
so a history here may hold :data:`HOLE` (a position with no cell) between cells; a history never ends
with one. A cell moved onto an occupied position replaces it here (upstream two cells then carry one
position: a corrupt sequence either way, and the invariant that memory describes the slot's tokens
sees both).

A recurrent component holds one state, at its last position (``llama_memory_recurrent``,
src/llama-memory-recurrent.cpp:161-240, 318-346): removing a range short of that position changes
nothing and succeeds (the known finding ``recurrent-seq-rm-range-silent``); a range that cuts into the
state's tail from p0 > 0 fails (no rollback snapshots: ``n_rs_seq`` = 0); shifting moves only its
position. The synthetic provider cannot hold a state whose position is not its history's length, so
:func:`rs_add` refuses a shift that moves it (the reuse machines run transformer and iSWA kinds; the
recurrent case is shown on the real server, finding ``cache-reuse-recurrent-stale``).
"""

from __future__ import annotations

__all__ = ["HOLE", "kv_add", "kv_rm", "rs_add", "rs_rm"]

HOLE = -1  # a position with no cell, between cells (never a token: tokens are >= 0)
_END = 1 << 62  # p1 < 0: to the end


def _end(p1: int) -> int:
    return _END if p1 < 0 else p1


def _trim(hist: list[int]) -> tuple[int, ...]:
    while hist and hist[-1] == HOLE:
        hist.pop()
    return tuple(hist)


def kv_rm(hist: tuple[int, ...], lo: int, p0: int, p1: int) -> tuple[tuple[int, ...], int]:
    """``llama_kv_cache::seq_rm``: the cells at positions [p0, p1) removed; (history, first kept cell)."""
    p0, end = max(0, p0), _end(p1)
    if end >= len(hist):
        return hist[:p0], min(lo, p0)
    out = list(hist)
    for p in range(p0, min(end, len(out))):
        out[p] = HOLE
    return _trim(out), lo


def kv_add(hist: tuple[int, ...], lo: int, p0: int, p1: int, delta: int) -> tuple[int, ...]:
    """``llama_kv_cache::seq_add``: the cells at [p0, p1) moved by ``delta``; one below 0 is removed.

    Only a component without a window (``lo`` 0): iSWA memory cannot shift at the sizes modelled
    (``llama_kv_cache_iswa::get_can_shift``, src/llama-kv-cache-iswa.cpp:253-257)."""
    if lo:
        raise NotImplementedError("the synthetic provider shifts KV without a window only")
    if delta == 0:
        return hist
    end = min(_end(p1), len(hist))
    moved = [(p + delta, hist[p]) for p in range(max(0, p0), end) if hist[p] != HOLE]
    out = list(hist)
    for p in range(max(0, p0), end):
        out[p] = HOLE
    for q, tok in moved:
        if q < 0:
            continue
        if q >= len(out):
            out.extend([HOLE] * (q + 1 - len(out)))
        out[q] = tok
    return _trim(out)


def rs_rm(hist: tuple[int, ...], p0: int, p1: int) -> tuple[int, ...] | None:
    """``llama_memory_recurrent::seq_rm`` (:161-240) with ``n_rs_seq`` 0: None when it fails."""
    pos, p0, end = len(hist) - 1, max(0, p0), _end(p1)
    if not hist or not p0 <= pos < end:
        return hist  # the state's position is outside the range: nothing removed, success
    if p0 > 0:
        return None  # a partial erase of the state's tail: refused
    return ()


def rs_add(hist: tuple[int, ...], p0: int, p1: int, delta: int) -> tuple[int, ...]:
    """``llama_memory_recurrent::seq_add`` (:318-346): only the state's position would move."""
    if hist and delta and max(0, p0) <= len(hist) - 1 < _end(p1):
        raise NotImplementedError("the synthetic provider cannot move a recurrent state's position")
    return hist
