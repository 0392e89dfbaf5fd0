"""The in-slot reuse mutants (issue #39): a reuse shift off by one, a context shift that breaks the tail.

Each is a mutant of ``shared`` (``properties.mutants._m``) whose broken rule is an in-slot reuse one, killed on
the reuse machines (:mod:`properties.reuse_machine`), whose post-conditions ``reuse_equivalence`` and
``context_shift`` they break; kept apart from :data:`properties.mutants.MUTANTS`, the gate's matrix, whose
machines never reuse.
"""

from __future__ import annotations

from dataclasses import replace

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


class _ReuseThresholdStrict(ServerContext):
    """reuse_chunks: a run of exactly ``n_cache_reuse`` equal tokens is not moved (``n_match > n_cache_reuse``;
    :3244 takes ``>=``): every chunk moved is still in place, only fewer are taken."""

    def cache_reuse(self, slot: ServerSlot, input_tokens: tuple[int, ...], n_past: int) -> int:
        task = slot.task
        assert task is not None
        if task.n_cache_reuse > 0:
            slot.task = replace(task, n_cache_reuse=task.n_cache_reuse + 1)
        try:
            return super().cache_reuse(slot, input_tokens, n_past)
        finally:
            slot.task = task


class _CtxShiftLate(ServerContext):
    """shift_timing: the context shifts one token late, at ``n_tokens + 1 > n_ctx`` (:2889 shifts at ``>=``): the
    slot decodes into its last cell first; n_keep and n_discard are upstream's."""

    def _generate(self, slot: ServerSlot) -> None:
        if self.params.ctx_limit and slot.prompt.n_tokens() + 1 == self.slot_n_ctx:
            self.params.ctx_limit = False
            try:
                super()._generate(slot)
            finally:
                self.params.ctx_limit = True
            return
        super()._generate(slot)


class _PromptFillsCtx(ServerContext):
    """slot_within_ctx: a prompt of exactly the slot's n_ctx tokens is taken (:3159 refuses ``>= n_ctx``)."""

    def _start_prompt(self, slot: ServerSlot) -> None:
        if slot.task is not None and len(slot.task.tokens) == self.slot_n_ctx:
            self.slot_n_ctx += 1
            try:
                super()._start_prompt(slot)
            finally:
                self.slot_n_ctx -= 1
            return
        super()._start_prompt(slot)


REUSE_MUTANTS: dict[str, Mutant] = {
    m.semantics.name: m
    for m in [
        _m("reuse-shift-off-by-one", "reuse_equivalence", _ReuseShiftOffByOne, kind="transformer"),
        _m("ctx-shift-no-seq-add", "context_shift", _CtxShiftNoSeqAdd, kind="transformer"),
        _m("ctx-shift-keep-off-by-one", "context_shift", _CtxShiftKeepOffByOne, kind="transformer"),
        # issue #50: the thresholds, each pinned by a property computed apart from the model (properties/pinned.py)
        _m("reuse-threshold-strict", "reuse_chunks", _ReuseThresholdStrict, kind="transformer"),
        _m("ctx-shift-late", "shift_timing", _CtxShiftLate, kind="transformer", also=frozenset({"slot_within_ctx"})),
        _m("prompt-fills-ctx", "slot_within_ctx", _PromptFillsCtx, kind="transformer"),
    ]
}


def resolve(name: str) -> Semantics:
    """The semantics of reuse mutant ``name``, else of the gate's mutant or ``shared``/``master``."""
    return REUSE_MUTANTS[name].semantics if name in REUSE_MUTANTS else resolve_gate(name)
