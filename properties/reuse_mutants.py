"""The in-slot reuse mutants (issue #39): a reuse shift off by one, a context shift that breaks the tail.

Each is a mutant of ``shared`` (``properties.mutants._m``) whose broken rule is an in-slot reuse one, killed on
the reuse machines (:mod:`properties.reuse_machine`), whose post-conditions ``reuse_equivalence`` and
``context_shift`` they break; kept apart from :data:`properties.mutants.MUTANTS`, the gate's matrix, whose
machines never reuse.
"""

from __future__ import annotations

from harness.model.reuse import Chunk
from harness.model.semantics import Semantics
from harness.model.server_context import ServerContext, ServerSlot
from properties.mutants import Mutant, _m
from properties.mutants import resolve as resolve_gate

__all__ = ["REUSE_MUTANTS", "resolve"]


class _ReuseShiftOffByOne(ServerContext):
    """reuse_equivalence: a reused chunk is moved by ``kv_shift - 1``, one position too far (:3250)."""

    def shift_chunk(self, slot: ServerSlot, ch: Chunk) -> None:
        slot.mem_seq_rm(ch.head_p, ch.head_c)
        slot.mem_seq_add(ch.head_c, ch.head_c + ch.n_match, ch.kv_shift - 1)


class _CtxShiftNoSeqAdd(ServerContext):
    """context_shift: the discarded tokens are removed but the tail is not moved back (no seq_add, :2931)."""

    def discard(self, slot: ServerSlot, n_keep: int, n_discard: int) -> None:
        slot.mem_seq_rm(n_keep, n_keep + n_discard)


class _CtxShiftKeepOffByOne(ServerContext):
    """context_shift: n_keep is one less than :2914-2920 make it (the shift eats the last kept token)."""

    def shift_bounds(self, slot: ServerSlot) -> tuple[int, int]:
        n_keep, n_discard = super().shift_bounds(slot)
        return n_keep - 1, n_discard


REUSE_MUTANTS: dict[str, Mutant] = {
    m.semantics.name: m
    for m in [
        _m("reuse-shift-off-by-one", "reuse_equivalence", _ReuseShiftOffByOne, kind="transformer"),
        _m("ctx-shift-no-seq-add", "context_shift", _CtxShiftNoSeqAdd, kind="transformer"),
        _m("ctx-shift-keep-off-by-one", "context_shift", _CtxShiftKeepOffByOne, kind="transformer"),
    ]
}


def resolve(name: str) -> Semantics:
    """The semantics of reuse mutant ``name``, else of the gate's mutant or ``shared``/``master``."""
    return REUSE_MUTANTS[name].semantics if name in REUSE_MUTANTS else resolve_gate(name)
