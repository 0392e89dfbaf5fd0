"""The reuse machines: the synthetic machine with ``--cache-reuse`` and context shift on (issue #39).

A :class:`ReuseMachine` is a :class:`~properties.machine.PromptCacheMachine` (every rule and state
invariant of it holds here too) whose server runs with ``n_cache_reuse`` = :data:`N_CACHE_REUSE`,
``--context-shift`` and the slot's n_ctx modelled (``ServerParams.ctx_limit``), on 48 KV cells a slot,
plus two rules: :meth:`ReuseMachine.trimmed_request` (the slot's own tokens with a piece deleted and new
ones after: the chunk loop's case) and :meth:`ReuseMachine.long_request` (a generation that runs past the
slot's n_ctx). Two post-conditions run inside every operation that reuses:

* ``reuse_equivalence`` (after each prompt start that reused chunks): the slot's tokens are the new
  prompt's first ``n_prompt_cached`` tokens, its memory's state bytes equal those of a fresh context that
  decoded exactly them (the restore-equivalence check, on synthetic state), every chunk moved equal tokens
  of at least ``n_cache_reuse``, back to back from the common prefix, and ``n_prompt_cached`` (what the
  server reports as ``timings.cache_n``) counts the prefix plus every chunk (one less when that is the
  whole prompt: [TAG_PROMPT_LOGITS]).
* ``context_shift`` (after each shift): the tokens kept are the first ``n_keep`` (the request's, -1 the
  prompt, one more with BOS, at most ``n_ctx - 4``) and the tail after the ``n_discard`` removed, the
  slot's checkpoints gone, and the memory's state equals a fresh evaluation of the kept tokens.

Kinds: transformer (reuse and shift work) and iSWA (``llama_memory_can_shift`` is false: both refused;
the property then sees no reuse, and generations stop at n_ctx). Printed programs run after
``from properties.reuse_machine import *``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any, ClassVar

from hypothesis import HealthCheck, Phase, settings
from hypothesis import seed as seed_
from hypothesis import strategies as st
from hypothesis.stateful import get_state_machine_test, precondition, rule

from harness.errors import PropertyFailure, UsageError
from harness.model.cache import get_common_prefix
from harness.model.provider import STATE_SEQ_FLAGS_NONE, SyntheticProvider
from harness.model.reuse import can_shift
from harness.model.server_context import ServerContext, ServerSlot, SlotState
from properties.invariants import Violation
from properties.machine import BOS, FAMILIES, MAX_PROMPT, MachineConfig, PromptCacheMachine, machine_class
from properties.pinned import check_slots_within_ctx, slot_ctx, upstream_chunks
from properties.reuse_mutants import REUSE_MUTANTS, resolve
from properties.teardown import noted

__all__ = ["N_CACHE_REUSE", "REUSE_KINDS", "ReuseMachine", "kill_reuse", "reuse_config", "reuse_machine_class",
           "run_reuse"]  # fmt: skip

N_CACHE_REUSE = 3
REUSE_KINDS = ("transformer", "iswa")
# edge_request's n_keep and n_discard drawn at their clamps' n-1, n, n+1
_EDGE = {"edge-1": -1, "edge": 0, "edge+1": 1, "clamp-1": -1, "clamp": 0, "clamp+1": 1}
N_CTX = 96  # two slots of 48 cells: a prompt of up to 40 and a long generation reach a slot's n_ctx


def _fresh_state(ctx: SyntheticProvider, tokens: tuple[int, ...]) -> bytes:
    """The full state of a fresh context of ``ctx``'s kind and seed that decoded ``tokens``."""
    fresh = SyntheticProvider(
        ctx.kind, name="fresh", n_seq=1, n_ctx=4096, kv_bytes_per_token=ctx.kv_bpt, rs_bytes=ctx.rs_bytes,
        window=ctx.window, seed=ctx.seed,
    )  # fmt: skip
    if tokens and fresh.decode(0, tokens, 0) != 0:
        raise AssertionError("a fresh synthetic context refused a decode")
    return fresh.state_seq_get_data_ext(0, STATE_SEQ_FLAGS_NONE)


def _same_as_fresh(prop: str, server: ServerContext, slot: ServerSlot) -> None:
    for ctx in (server.ctx_tgt, server.ctx_dft):
        if isinstance(ctx, SyntheticProvider):
            got = ctx.state_seq_get_data_ext(slot.id, STATE_SEQ_FLAGS_NONE)
            if got != _fresh_state(ctx, slot.prompt.tokens):
                raise Violation(
                    prop,
                    f"slot{slot.id}: {ctx.name} memory {ctx.seq_tokens(slot.id)} is not a fresh evaluation of "
                    f"its tokens {slot.prompt.tokens}",
                )


def check_reuse(server: ServerContext, slot: ServerSlot, cached: tuple[int, ...], n_reuses: int) -> None:
    """``reuse_equivalence`` after ``_start_prompt`` of ``slot``, which held ``cached`` before it."""
    assert slot.task is not None
    prompt = slot.task.tokens
    if len(server.reuses) == n_reuses or not server.reuses[-1][2]:
        return  # refused (or cache_prompt off), or no chunk long enough: the plain prefix, checked as ever
    sid, n_prefix, chunks = server.reuses[-1]
    name = "reuse_equivalence"
    if sid != slot.id or n_prefix != get_common_prefix(cached, prompt):
        raise Violation(name, f"slot{slot.id}: reuse started at {n_prefix}, the common prefix is "
                        f"{get_common_prefix(cached, prompt)}")  # fmt: skip
    head_p = n_prefix
    for ch in chunks:
        if ch.head_p != head_p or ch.n_match < slot.task.n_cache_reuse or ch.head_c < ch.head_p:
            raise Violation(name, f"slot{slot.id}: chunk {ch} out of place (expected at {head_p})")
        if cached[ch.head_c : ch.head_c + ch.n_match] != prompt[ch.head_p : ch.head_p + ch.n_match]:
            raise Violation(name, f"slot{slot.id}: chunk {ch} moved tokens the new prompt does not have there")
        head_p += ch.n_match
    want = min(head_p, len(prompt) - 1)  # [TAG_PROMPT_LOGITS]; no checkpoint on these kinds' reuse
    if slot.n_prompt_cached != want or slot.prompt.tokens != prompt[:want]:
        raise Violation(
            name,
            f"slot{slot.id}: cache_n {slot.n_prompt_cached} and tokens {slot.prompt.tokens} after reusing "
            f"{chunks} from {n_prefix}; expected cache_n {want}, the prompt's first {want} tokens",
        )
    _same_as_fresh(name, server, slot)


def check_context_shift(server: ServerContext, slot: ServerSlot) -> None:
    """``context_shift`` right after a shift of ``slot`` (:2914-2946)."""
    assert slot.task is not None
    task, p, name = slot.task, server.params, "context_shift"
    _, before, n_keep, n_discard = server.ctx_shifts[-1]
    keep = min(server.slot_n_ctx - 4, (len(task.tokens) if task.n_keep < 0 else task.n_keep) + int(p.add_bos))
    n_left = len(before) - keep
    discard = min(max(task.n_discard or n_left // 2, 0), max(0, n_left - 1))
    if (n_keep, n_discard) != (keep, discard):
        raise Violation(name, f"slot{slot.id}: shifted with n_keep {n_keep}, n_discard {n_discard}; "
                        f"expected {keep}, {discard} ({len(before)} tokens, task n_keep {task.n_keep})")  # fmt: skip
    if slot.prompt.tokens != before[:keep] + before[keep + discard :] or len(slot.prompt.checkpoints):
        raise Violation(name, f"slot{slot.id}: kept {slot.prompt.tokens} from {before} (n_keep {keep}, "
                        f"n_discard {discard}), {len(slot.prompt.checkpoints)} checkpoints left")  # fmt: skip
    _same_as_fresh(name, server, slot)


class ReuseMachine(PromptCacheMachine):
    """The generic reuse machine; concrete ones come from :func:`reuse_machine_class`."""

    shifts_seen: ClassVar[list[int]]  # [reuses with a chunk, context shifts] over every example of the class

    def __init__(self) -> None:
        super().__init__()
        p, server = self.params, self.server
        p.n_cache_reuse, p.ctx_shift, p.ctx_limit = N_CACHE_REUSE, True, True
        if not can_shift(server.ctx_tgt):  # the start-up check (:1166-1175), as ServerContext makes it
            p.ctx_shift, p.n_cache_reuse = False, 0
        if self.checks_on:
            self._wrap(server)
            self.pinned.wrap_reuse()  # reuse_chunks, slot_within_ctx, shift_timing (properties/pinned.py)
            self.checks = (*self.checks, ("slot_within_ctx", check_slots_within_ctx))

    def _wrap(self, server: ServerContext) -> None:
        """The post-conditions, around the server's own methods (instance attributes shadow them)."""
        start, shift = server._start_prompt, server.context_shift
        seen, checked = type(self).shifts_seen, type(self).stats_checked

        def started(slot: ServerSlot) -> None:
            cached, n = slot.prompt.tokens, len(server.reuses)
            start(slot)
            if slot.state is SlotState.PROCESSING_PROMPT:
                seen[0] += len(server.reuses) > n and bool(server.reuses[-1][2])
                check_reuse(server, slot, cached, n)
                checked["reuse_equivalence"] += 1

        def shifted(slot: ServerSlot) -> bool:
            ok = shift(slot)
            if ok:
                seen[1] += 1
                check_context_shift(server, slot)
                checked["context_shift"] += 1
            return ok

        server._start_prompt = started  # type: ignore[method-assign]
        server.context_shift = shifted  # type: ignore[method-assign]

    def _idle_with_tokens(self) -> bool:
        slots = self.server.slots
        return not self.crashed and any(s.state is SlotState.IDLE and s.prompt.n_tokens() > 2 for s in slots)

    @precondition(_idle_with_tokens)
    @rule(
        slot=st.integers(0, 1),
        cut=st.integers(1, MAX_PROMPT),
        n_cut=st.integers(1, 8),
        suffix=st.lists(st.integers(1, 24), max_size=4),
        n_cache_reuse=st.sampled_from([None, 1, 5]),
        n_predict=st.integers(1, 4),
    )
    @noted
    def trimmed_request(
        self, slot: int, cut: int, n_cut: int, suffix: list[int], n_cache_reuse: int | None, n_predict: int
    ) -> None:
        """The idle slot's tokens with ``[cut, cut + n_cut)`` deleted and ``suffix`` after, sent to that slot
        (``n_cache_reuse`` None: the server's), run to completion."""
        idle = [s for s in self.server.slots if s.state is SlotState.IDLE and s.prompt.n_tokens() > 2]
        s = idle[slot % len(idle)]
        base = s.prompt.tokens
        cut = 1 + cut % (len(base) - 1)
        tokens = (base[:cut] + base[cut + n_cut :] + tuple(suffix))[:MAX_PROMPT]
        if tokens[0] != BOS:
            tokens = (BOS, *tokens)[:MAX_PROMPT]
        self._guard("handle_completion", self.server.handle_completion, tokens, id_slot=s.id, n_predict=n_predict,
                    n_cache_reuse=n_cache_reuse)  # fmt: skip
        self._guard("update_slots", self.server.run_until_idle)

    @rule(
        source=st.integers(0, 5),
        keep=st.integers(0, MAX_PROMPT),
        suffix=st.lists(st.integers(1, 24), min_size=1, max_size=16),
        n_predict=st.integers(8, 48),
        n_keep=st.integers(-1, 8),
        n_discard=st.sampled_from([0, 1, 7]),
    )
    @noted
    def long_request(self, source: int, keep: int, suffix: list[int], n_predict: int, n_keep: int,
                     n_discard: int) -> None:  # fmt: skip
        """A request whose generation may run past the slot's n_ctx (48): a context shift, or a stop."""
        tokens = (BOS, *(self._base(source)[:keep] + tuple(suffix)))[:MAX_PROMPT]
        self._guard("handle_completion", self.server.handle_completion, tokens, n_predict=n_predict, n_keep=n_keep,
                    n_discard=n_discard)  # fmt: skip
        self._guard("update_slots", self.server.run_until_idle)

    def _live(self) -> bool:
        return not self.crashed

    @precondition(_idle_with_tokens)
    @rule(
        slot=st.integers(0, 1),
        cut=st.integers(1, MAX_PROMPT),
        n_cut=st.integers(1, 8),
        suffix=st.lists(st.integers(1, 24), max_size=4),
        at=st.sampled_from([-1, 0, 1]),
    )
    @noted
    def trimmed_at_threshold(self, slot: int, cut: int, n_cut: int, suffix: list[int], at: int) -> None:
        """:meth:`trimmed_request` with the request's ``n_cache_reuse`` at the first chunk's length plus ``at``
        (n-1, n, n+1: the loop's threshold ``n_match >= n_cache_reuse``, :3244, taken, taken, refused)."""
        idle = [s for s in self.server.slots if s.state is SlotState.IDLE and s.prompt.n_tokens() > 2]
        s = idle[slot % len(idle)]
        base = s.prompt.tokens
        cut = 1 + cut % (len(base) - 1)
        tokens = (base[:cut] + base[cut + n_cut :] + tuple(suffix))[:MAX_PROMPT]
        if tokens[0] != BOS:
            tokens = (BOS, *tokens)[:MAX_PROMPT]
        first = upstream_chunks(base, tokens, get_common_prefix(base, tokens), 1)
        n_cache_reuse = max(1, (first[0][2] if first else 1) + at)
        self._guard("handle_completion", self.server.handle_completion, tokens, id_slot=s.id, n_predict=1,
                    n_cache_reuse=n_cache_reuse)  # fmt: skip
        self._guard("update_slots", self.server.run_until_idle)

    @precondition(_live)
    @rule(
        at=st.sampled_from([-2, -1, 0, 1]),
        fill=st.integers(1, 24),
        n_keep=st.sampled_from([-1, 0, 1, "edge-1", "edge", "edge+1"]),
        n_discard=st.sampled_from([0, "clamp-1", "clamp", "clamp+1"]),
        n_predict=st.integers(1, 4),
        overlap=st.booleans(),
    )
    @noted
    def edge_request(self, at: int, fill: int, n_keep: int | str, n_discard: int | str, n_predict: int,
                     overlap: bool) -> None:  # fmt: skip
        """A prompt of the slot's n_ctx plus ``at`` tokens (n-2 .. n+1: refused from n on, :3159; from n-1 the
        first generated token shifts, :2889), ``n_keep`` around its clamp ``n_ctx - 4`` (:2917) and ``n_discard``
        around its clamp ``n_left - 1`` (:2926). ``overlap`` leaves it processing for the steps after it."""
        n_ctx = slot_ctx(self.server)
        tokens = (BOS, *((fill + i) % 24 + 1 for i in range(n_ctx + at - 1)))
        edge = n_ctx - 4
        keep = n_keep if isinstance(n_keep, int) else edge + _EDGE[n_keep]
        kept = min(edge, (len(tokens) if keep < 0 else keep) + 1)  # the task's n_keep as the shift makes it
        clamp = max(0, n_ctx - 1 - kept - 1)  # n_left - 1 for a slot at n_ctx - 1 tokens
        discard = n_discard if isinstance(n_discard, int) else clamp + _EDGE[n_discard]
        self._guard("handle_completion", self.server.handle_completion, tokens, n_predict=n_predict, n_keep=keep,
                    n_discard=max(0, discard))  # fmt: skip
        if not overlap:
            self._guard("update_slots", self.server.run_until_idle)


_CLASSES: dict[MachineConfig, type[ReuseMachine]] = {}


def reuse_machine_class(config: MachineConfig) -> type[ReuseMachine]:
    """The reuse machine for ``config`` (its kind one of :data:`REUSE_KINDS`, n_ctx :data:`N_CTX`),
    registered in this module as ``Reuse_`` + the config's class name."""
    config = replace(config, family="reuse")
    cls = _CLASSES.get(config)
    if cls is None:
        name = config.class_name  # Reuse_Shared_transformer_ctx96
        # the per-class statistics the synthetic machine's concrete classes carry, fresh (whatever they are)
        base = machine_class(replace(config, resolve=None, family=""))
        attrs: dict[str, Any] = {k: type(v)() for k, v in vars(base).items() if isinstance(v, Counter | list | dict)}
        attrs.update(config=config, shifts_seen=[0, 0], __module__=__name__)
        cls = type(name, (ReuseMachine,), attrs)
        _CLASSES[config] = cls
        globals()[name] = cls
    return cls


def reuse_config(kind: str, semantics: str = "shared") -> MachineConfig:
    """The reuse machine's configuration for ``kind``; a mutant name of ``REUSE_MUTANTS`` as semantics."""
    if kind not in REUSE_KINDS:
        raise UsageError(f"reuse machines run {', '.join(REUSE_KINDS)}, not {kind!r}")
    return MachineConfig(semantics, kind, n_ctx=N_CTX, resolve=resolve, family="reuse")


FAMILIES["reuse"] = reuse_machine_class


def run_reuse(
    config: MachineConfig, *, max_examples: int = 60, seed: int = 0, steps: int = 30, shrink: bool = True
) -> str | None:
    """Run one reuse machine; the name of the property that failed (its program on stdout), or None."""
    phases = [Phase.explicit, Phase.generate, *([Phase.shrink] if shrink else [])]
    cls = reuse_machine_class(config)
    s = settings(max_examples=max_examples, stateful_step_count=steps, deadline=None, database=None,
                 suppress_health_check=list(HealthCheck), phases=phases)  # fmt: skip
    test: Any = get_state_machine_test(cls, settings=s)  # type: ignore[no-untyped-call]
    seed_(seed)(test)
    try:
        test()
    except PropertyFailure as e:
        return e.name
    return None


def kill_reuse(name: str, *, seeds: int = 3, max_examples: int = 100) -> str | None:
    """The property that kills reuse mutant ``name`` on its own kind's machine, unshrunk (None: it survived
    ``seeds`` seeds)."""
    m = REUSE_MUTANTS[name]
    for s in range(seeds):
        by = run_reuse(reuse_config(m.kind, name), max_examples=max_examples, seed=s, shrink=False)
        if by is not None:
            return by
    return None
