"""Stateful Hypothesis models that drive the reference model the way a server is driven.

A :class:`PromptCacheMachine` owns one modelled server (``harness.make_server``) and sends it
completion requests whose prompts share, extend and diverge from what the slots and the cache
hold; it steps prompt processing (which creates checkpoints), finishes tasks, changes the cache
limit, asks for child tasks and speculative rounds, re-captures a checkpoint, and arms allocation
faults as ordinary steps (``state.arm_fault(kind='oom-transient', nth=3)``), so that Hypothesis
shrinks and prints faults with the rest of the program.

After every step all state invariants run (:func:`properties.invariants.check_state`); the
per-operation post-conditions run inside the operations (:class:`properties.invariants.Tracer`).
An exception that escapes the server (``BadAlloc``, ``GgmlAbort``) is a :class:`TargetCrash`.

Guidance for fuzzing: each example measures what it reached (:data:`REACH`: cache evictions,
the save's transient peak above live bytes, the most holders one checkpoint payload had, the most
checkpoints alive at once, allocation faults that fired) and hands each to ``hypothesis.target``
at teardown, so that a campaign with Hypothesis' ``target`` phase (``python -m harness fuzz``)
climbs toward cache pressure and shared state. Only a class with ``observe_reach`` set measures
(the campaign's subclasses set it): the gate's profiles have no ``target`` phase, and its machines
pay one attribute test per step. ``reach`` (per class) keeps the maxima over the examples of a
run, for the campaign's live view.

Each configuration is a concrete subclass registered in this module under a stable name
(``Shared_hybrid_draft`` ...), so a printed failing program runs as pasted after
``from properties.machine import *``.

Size: one class, because Hypothesis reads a machine's rules, preconditions, invariant and teardown
from one class body; its preconditions are named methods (not lambdas), each a few lines.
"""

from __future__ import annotations

import operator
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar

from hypothesis import currently_in_test_context, target
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from fixtures.gguf import draft_path, model_path
from harness.errors import BadAlloc, GgmlAbort, TargetCrash, UsageError
from harness.model.provider import STATE_SEQ_FLAGS_PARTIAL_ONLY
from harness.model.semantics import Semantics, get_semantics
from harness.model.server_context import ServerParams, SlotState
from harness.targets.libllama import LlamaProvider, close_server, load_model, make_llama_server
from harness.targets.synthetic import make_server
from properties import invariants as inv
from properties.pinned import PinnedTracer, check_limit
from properties.policy import ExpectedAbort, PolicyTracer
from properties.reuse import ReuseTracer
from properties.teardown import noted, settle, stages

__all__ = ["FAMILIES", "REACH", "MachineConfig", "PromptCacheMachine", "TargetCrash", "machine_class"]

MAX_PROMPT = 40
BOS = 1
IDLE = SlotState.IDLE
# what an example reached, each a hypothesis.target label (maximised by a campaign's target phase)
REACH = ("evictions", "transient_peak", "shared_holders", "checkpoints", "faults_fired")


@dataclass(frozen=True)
class MachineConfig:
    """One state-machine configuration.

    ``known`` enables request patterns that reach suspected upstream bugs (kept out of the main
    gate run, exercised by the known-findings runs): ``"busy-slot-by-id"`` lets a request name a
    slot that is processing; ``"small-draft-ctx"`` gives the draft context far fewer KV cells than
    the target; ``"strict-swa-order"`` stops excusing the checkpoint order that upstream leaves
    after an SWA checkpoint restore; ``"strict-stale-checkpoint"`` stops excusing a slot whose
    memory holds the prefix of a checkpoint taken for another prompt (known finding
    ``stale-checkpoint-after-miss``); ``"draft-recovery"`` turns on the draft-KV recovery proposed
    in the PR's discussion (``ServerParams.draft_recovery``) and checks that no request fails;
    ``"no-bos"`` lets prompts start with any token (the main runs start every prompt with BOS).
    """

    semantics: str
    kind: str = "hybrid"
    arch: str = ""  # a fixtures model (llama, mamba, jamba, lfm2, gemma2): run on real libllama state
    draft: bool = False
    kv_unified: bool = False
    n_slots: int = 2
    cache_ram: int = 6  # KiB; -1: --cache-ram -1, no byte limit (the token limit n_ctx alone evicts)
    n_ctx: int = 256  # the target's KV cells over all slots (also the cache's token limit)
    known: frozenset[str] = frozenset()
    resolve: Any = field(default=None, compare=False, repr=False)  # name -> Semantics, for mutants
    # "": this module's machine; else a machine of :data:`FAMILIES` (slot files, reuse, stateless tasks)
    family: str = ""

    @property
    def class_name(self) -> str:
        parts = [_ident(self.semantics), f"libllama_{self.arch}" if self.arch else self.kind]
        if self.draft:
            parts.append("draft")
        if self.kv_unified:
            parts.append("kvu")
        if self.n_slots != 2:
            parts.append(f"np{self.n_slots}")  # distinct names: a printed program and the example database key on it
        if self.cache_ram != 6:
            parts.append("nobytes" if self.cache_ram < 0 else f"ram{self.cache_ram}")
        if self.n_ctx != 256:
            parts.append(f"ctx{self.n_ctx}")
        parts += sorted(_ident(k) for k in self.known)
        name = "_".join(parts)
        name = name[0].upper() + name[1:]
        if self.family:  # SlotFiles_Shared_hybrid: the family's name first
            name = "".join(w.capitalize() for w in self.family.split("_")) + "_" + name
        return name


_UNITS: dict[str, int] = {}


def _llama_unit(arch: str) -> int:
    """Bytes per ``cache_ram`` unit on a real model: a third of a full state at ``MAX_PROMPT`` tokens.

    The machine's ``cache_ram`` of 6 units then holds about two long entries and forces evictions,
    as 6 KiB does on the synthetic backend.
    """
    unit = _UNITS.get(arch)
    if unit is None:
        with LlamaProvider(load_model(model_path(arch)), n_seq=1, n_ctx=256, check_restores=False) as p:
            p.decode(0, [1 + i % 24 for i in range(MAX_PROMPT)], 0)
            unit = max(1, p.state_seq_get_size_ext(0, 0) // 3)
        _UNITS[arch] = unit
    return unit


def _ident(s: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in s)


class PromptCacheMachine(RuleBasedStateMachine):
    """The generic machine; concrete configurations are made by :func:`machine_class`."""

    config: ClassVar[MachineConfig]
    # per-invariant check counts and seconds, summed over every instance of this class
    stats_checked: ClassVar[Counter[str]]
    stats_seconds: ClassVar[Counter[str]]  # seconds per invariant (floats in a Counter)
    stats_branches: ClassVar[Counter[str]]  # which upstream policy branch each policy check exercised
    peaks: ClassVar[list[tuple[int, int, int]]]
    llama_stats: ClassVar[Counter[str]]  # restore_checks (summed), state_bytes / partial_bytes (max)
    layout_example: ClassVar[list[str]]  # the first kv-layout-dependent-logits difference seen
    finding_examples: ClassVar[dict[str, str]]  # finding id -> the first restore difference it explains
    reuse_counts: ClassVar[Counter[str]]  # reuse finding id -> requests, "id:tokens" -> tokens recomputed
    reach: ClassVar[Counter[str]]  # REACH label -> the most any example of this class reached
    observe_reach: ClassVar[bool] = False  # measure REACH and hand it to hypothesis.target (campaigns)
    target_labels: ClassVar[tuple[str, ...]] = REACH  # the labels handed to hypothesis.target
    # False only for the bench's price of the checks (exploration, "checks off"): no state invariant and
    # no post-condition (inv.Tracer, PolicyTracer) runs, and nothing judges a crash: the server ends
    # quietly, as on an abort that upstream shares (the policy tracer tells those apart)
    checks_on: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__()
        cfg = self.config
        sem: Semantics = cfg.resolve(cfg.semantics) if cfg.resolve else get_semantics(cfg.semantics)
        self.params = ServerParams(
            n_slots=cfg.n_slots,
            cache_ram=cfg.cache_ram,
            cache_ram_unit=1024,
            n_ctx_checkpoints=3,
            checkpoint_min_step=4,
            cache_idle_slots=True,
            kv_unified=cfg.kv_unified,
            n_batch=16,
            n_ubatch=8,
            n_draft_max=2 if cfg.draft else 0,
            draft_recovery="draft-recovery" in cfg.known,
        )
        small = "small-draft-ctx" in cfg.known
        if cfg.arch:
            self.params.cache_ram_unit = _llama_unit(cfg.arch)
            self.server = make_llama_server(
                sem,
                model_path(cfg.arch),
                draft_model=draft_path() if cfg.draft else None,
                params=self.params,
                n_ctx=cfg.n_ctx,
                n_ctx_dft=32 if small else None,
            )
        else:
            self.server = make_server(
                sem, cfg.kind, draft=cfg.draft, params=self.params, n_ctx=cfg.n_ctx, n_ctx_dft=32 if small else None
            )
        self.shadow = inv.Shadow()
        self.tracer = inv.Tracer(self.server, strict_peak=True, shadow=self.shadow, wrap=self.checks_on)
        # wraps outside the safety post-conditions: a broken safety property is reported first
        self.policy = PolicyTracer(
            self.server, excuse_stale="strict-stale-checkpoint" not in cfg.known, wrap=self.checks_on
        )
        # the reuse property (properties/reuse.py): a shortfall is a counted finding or a Violation
        self.reuse = ReuseTracer(self.server, type(self).reuse_counts) if self.checks_on else None
        # the properties pinned to upstream's rules (properties/pinned.py): idle_pass here, the families add theirs
        self.pinned = PinnedTracer(self.server, wrap=self.checks_on)
        self.crashed = False  # the modelled server is gone (a crash, or an abort where upstream aborts)
        # the last step changed nothing the state invariants read (it only armed the fault seam):
        # their result is the previous step's, so that step's check stands for this one
        self.unchanged = False
        self.checks: tuple[tuple[str, Any], ...] = (
            ("accounting", inv.check_accounting),
            ("refcount", inv.check_refcount),
            ("checkpoint_lists", self._check_lists),
            ("draft_in_step", self._check_in_step),
            ("immutability", self.shadow.check),
            ("limit", check_limit),  # a state invariant too: a cache left over its limit between operations
            *((("restore_equivalence", inv.check_restore_equivalence),) if cfg.arch else ()),
            *((("draft_recovery", inv.check_draft_recovery),) if self.params.draft_recovery else ()),
        ) if self.checks_on else ()
        self._reached: Counter[str] = Counter()  # this example's maxima (REACH)
        self.step_failure: BaseException | None = None  # what escaped a rule or the invariant (noted)
        self.steps_checked = 0  # steps after which every state invariant ran and held

    # ---- helpers ---------------------------------------------------------------------------

    def _guard(self, what: str, fn: Any, *args: Any, **kw: Any) -> Any:
        """Run a server operation; an escaping exception is a crash of the target.

        An abort where upstream aborts too (a failed checkpoint restore, ``restore_failure``) ends
        the server quietly: the remaining steps of the program are no-ops.
        """
        if self.crashed:
            return None
        try:
            return fn(*args, **kw)
        except ExpectedAbort:
            self.crashed = True
            return None
        except (BadAlloc, GgmlAbort) as e:
            self.crashed = True
            if not self.checks_on:
                return None  # no property judges the crash
            if isinstance(e, BadAlloc):
                raise TargetCrash("no_partial_entries", f"std::bad_alloc escaped {what}: {e}") from e
            raise TargetCrash("crash", f"GGML_ABORT in {what}: {e}") from e

    def _base(self, source: int) -> tuple[int, ...]:
        n = self.params.n_slots
        if source < n:
            return self.server.slots[source].prompt.tokens
        cache = self.server.prompt_cache
        entries = cache.states if cache is not None else []
        if source - n < len(entries):
            return entries[source - n].prompt.tokens
        return ()

    def _busy(self) -> bool:
        for s in self.server.slots:  # noqa: SIM110 (not any() over a generator: two preconditions a step)
            if s.state is not IDLE:  # is_processing(), inline: ~40k calls a gate run
                return True
        return False

    # ---- rules -----------------------------------------------------------------------------

    @rule(
        source=st.integers(0, 5),
        keep=st.integers(0, MAX_PROMPT),
        suffix=st.lists(st.integers(1, 24), max_size=16),
        id_slot=st.integers(-1, 1),
        n_cmpl=st.integers(1, 2),
        n_predict=st.integers(1, 4),
        overlap=st.booleans(),
    )
    @noted
    def request(
        self, source: int, keep: int, suffix: list[int], id_slot: int, n_cmpl: int, n_predict: int, overlap: bool = True
    ) -> None:
        """A completion request: a prefix of a slot's or a cache entry's prompt, then new tokens.

        ``overlap=False`` (the simplest value, where the shrinker goes) then runs every processing slot
        to completion, as :meth:`finish`: a client that waits for its answer is one step, not two.
        ``overlap=True`` leaves it processing, for the steps that overlap it; it is the default because
        a program printed before this argument existed omits it and meant that."""
        tokens = (self._base(source)[:keep] + tuple(suffix))[-MAX_PROMPT:] or (1,)
        if tokens[0] != BOS and "no-bos" not in self.config.known:
            # llama-server's tokenizer adds BOS: prompts share their first token. Without it a
            # checkpoint of a first token survives a prompt that starts otherwise and is restored
            # later (the known finding "stale-first-token-checkpoint", run apart)
            tokens = ((BOS, *tokens))[:MAX_PROMPT]
        if id_slot >= self.params.n_slots:
            id_slot = -1
        if id_slot >= 0 and self.server.slots[id_slot].is_processing() and "busy-slot-by-id" not in self.config.known:
            id_slot = -1  # upstream saves/loads a busy slot named by id: a known finding, run apart
        self._guard(
            "handle_completion",
            self.server.handle_completion,
            tokens,
            id_slot=id_slot,
            n_cmpl=n_cmpl,
            n_predict=n_predict,
        )
        if not overlap:
            self._guard("update_slots", self.server.run_until_idle)

    @precondition(_busy)  # the function itself, not a lambda around it: one call fewer per evaluation
    @rule()
    @noted
    def step(self) -> None:
        """One iteration of update_slots: a prompt batch per slot, child activation, generation."""
        self._guard("update_slots", self.server.update_slots)

    @precondition(_busy)  # the function itself, not a lambda around it: one call fewer per evaluation
    @rule()
    @noted
    def finish(self) -> None:
        """Run every processing slot to completion."""
        self._guard("update_slots", self.server.run_until_idle)

    # No-op steps. Rejecting them (``hypothesis.reject``) kept them out of printed programs but threw away
    # whole examples: on the ci profile 331 examples ran for 100 valid ones on hybrid. Now a step that
    # would change nothing is not drawn where a precondition can say so (arming over a fault nothing has
    # touched yet; refreshing a slot whose newest checkpoint is current: one rule per slot), and the state
    # invariants skip a set_limit that evicts nothing (they read no limit; its drawn value is unknown to a
    # precondition). Hypothesis' shrinker keeps no-op steps (``set_limit(cache_ram=1)`` is the simplest
    # step there is), so a printed program goes through :func:`properties.run.tidy`, which deletes every
    # step its failure does not need. 100 valid examples take 110-120 (331 on hybrid with rejections).

    def _fault_pending(self) -> bool:
        """A fault is armed and no allocation was counted since: arming another one now would make a
        program equal to one that arms only the second (the first never had an effect)."""
        seam = self.server.host.seam
        return seam.armed and seam.count == 0

    # named functions, not lambdas: Hypothesis describes each precondition at each call (is_valid), and a
    # lambda's description is a lookup in a weak dictionary (~34k calls a gate run on np3)
    def _can_arm(self) -> bool:
        seam = self.server.host.seam  # not _fault_pending(), inline: one call fewer
        return self.config.cache_ram > 0 and not (seam.armed and seam.count == 0)

    def _can_arm_restore(self) -> bool:
        seam = self.server.host.seam
        return not (seam.armed and seam.count == 0)

    def _can_set_limit(self) -> bool:
        return self.config.cache_ram > 0 and self.server.prompt_cache is not None

    @precondition(_can_arm)
    @rule(kind=st.sampled_from(["oom-transient", "oom-persistent"]), nth=st.integers(1, 8))
    @noted
    def arm_fault(self, kind: str, nth: int) -> None:
        """Fail the nth allocation of the next prompt save (and, if persistent, every later one).

        Not with the byte limit off: the recovery sets one (S-T.cpp:1770), and the machine stands for the
        token-limit-only configuration. Not over an untouched fault (:meth:`_fault_pending`): a precondition.
        """
        self.server.host.seam.arm(nth, persistent=kind == "oom-persistent", scope="save")
        self.unchanged = True  # the seam only: no state invariant reads it

    @precondition(_can_arm_restore)
    @rule(where=st.sampled_from(["load", "restore"]), nth=st.integers(1, 2))
    @noted
    def arm_restore_fault(self, where: str, nth: int) -> None:
        """Fail the nth state read of the next cache load or checkpoint restore (libllama returns 0).
        Not over a fault that is still untouched (:meth:`_fault_pending`)."""
        self.server.host.seam.arm(nth, scope=where)
        self.unchanged = True  # the seam only: no state invariant reads it

    @precondition(_can_set_limit)
    @rule(cache_ram=st.integers(1, 12))
    @noted
    def set_limit(self, cache_ram: int) -> None:
        """Change --cache-ram (KiB here) and let update() enforce it, as the bad_alloc recovery does."""
        cache = self.server.prompt_cache
        assert cache is not None
        before = list(cache.states)  # held, not their id()s: an evicted entry's id() can be reused
        cache.limit_size = cache_ram * 1024
        self._guard("update", cache.update)
        if not self.crashed and len(cache.states) == len(before) and all(map(operator.is_, cache.states, before)):
            # update() evicted nothing: it only pops entries, and no state invariant reads the limits
            # (``limit`` is the post-condition of update() itself, which ran): none can change
            self.unchanged = True

    def _refreshable(self, slot: int) -> bool:
        if slot >= self.params.n_slots or self.crashed:
            return False
        s = self.server.slots[slot]
        cps = s.prompt.checkpoints.items
        if s.state is not IDLE or not cps:  # is_processing(), inline, as in _busy
            return False
        c = cps[-1]
        if len(cps) > 1 and cps[-2].n_tokens >= s.prompt.n_tokens():
            # moving the newest checkpoint to n_tokens at or below an older one would make a list
            # that upstream never makes (create_checkpoint supersedes an equal n_tokens, :2322-2333);
            # after the swa-checkpoint-order quirk the newest one can sit below an older one
            return False
        # already captured at this position for these tokens: a refresh would write the same state
        if (c.n_tokens, c.made_for) == (s.prompt.n_tokens(), s.prompt.tokens):
            return False
        return self.server.ctx_tgt.memory_seq_pos_min(s.id) >= 0  # the costliest test last

    # one rule per slot, each with its own precondition: a drawn slot with nothing to refresh is
    # neither a rejected example nor a printed step that names one slot and refreshes another

    def _refreshable_0(self) -> bool:
        return self._refreshable(0)

    def _refreshable_1(self) -> bool:
        return self._refreshable(1)

    @precondition(_refreshable_0)
    @rule()
    @noted
    def refresh_checkpoint_0(self) -> None:
        """:meth:`refresh_checkpoint` of slot 0."""
        self.refresh_checkpoint(0)

    @precondition(_refreshable_1)
    @rule()
    @noted
    def refresh_checkpoint_1(self) -> None:
        """:meth:`refresh_checkpoint` of slot 1."""
        self.refresh_checkpoint(1)

    def refresh_checkpoint(self, slot: int) -> None:
        """Re-capture an idle slot's newest checkpoint at its current position.

        The vendored server updates only ``spec_ckpt`` in place; this step uses the same
        ``common_prompt_checkpoint::update_*`` API on a list checkpoint that a cache entry may
        share, which is the copy-on-write contract PR #27451 states.
        """
        if not self._refreshable(slot):
            raise UsageError(f"slot {slot} has no checkpoint to refresh")  # a pasted program that misnames it
        s = self.server.slots[slot]
        c = s.prompt.checkpoints.back()
        ctx_tgt, ctx_dft = self.server.ctx_tgt, self.server.ctx_dft
        pos_min = ctx_tgt.memory_seq_pos_min(s.id)
        self.shadow.expect_update(c)
        c.update_pos(s.prompt.n_tokens(), pos_min, ctx_tgt.memory_seq_pos_max(s.id))
        c.made_for = s.prompt.tokens
        self._guard("update_tgt", c.update_tgt, ctx_tgt, s.id, STATE_SEQ_FLAGS_PARTIAL_ONLY)
        self._guard("update_dft", c.update_dft, ctx_dft, s.id, STATE_SEQ_FLAGS_PARTIAL_ONLY)

    # ---- checks ----------------------------------------------------------------------------

    @invariant()
    @noted
    def state_invariants(self) -> None:
        if self.crashed or self.unchanged:
            self.unchanged = False
            return
        if self.observe_reach:
            self._observe()
        inv.run_checks(self.checks, self.server, type(self).stats_seconds)
        self.steps_checked += 1

    def _observe(self) -> None:
        """The shared state after a step: checkpoints alive, the most holders of one payload."""
        server, r = self.server, self._reached
        lists = [s.prompt.checkpoints for s in server.slots]
        if server.prompt_cache is not None:
            lists += [e.prompt.checkpoints for e in server.prompt_cache.states]
        n = sum(len(cl) for cl in lists)
        holders = max((p.holders for cl in lists for c in cl for p in c.payloads()), default=0)
        r["checkpoints"] = max(r["checkpoints"], n)
        r["shared_holders"] = max(r["shared_holders"], holders)

    def _target(self) -> None:
        """This example's reach to ``hypothesis.target`` (once per label) and to the class maxima."""
        r, server = self._reached, self.server
        if server.prompt_cache is not None:
            r["evictions"] = server.prompt_cache.evictions
        r["transient_peak"] = max((p[0] for p in self.tracer.peaks), default=0)
        r["faults_fired"] = server.host.seam.total_fired
        reach = type(self).reach
        for label in REACH:
            reach[label] = max(reach[label], r[label])
        if currently_in_test_context():  # not in a printed program pasted into python
            for label in self.target_labels:
                target(float(r[label]), label=label)

    def _check_lists(self, server: Any) -> None:
        inv.check_checkpoint_lists(server, excuse_swa_resume="strict-swa-order" not in self.config.known)

    def _check_in_step(self, server: Any) -> None:
        inv.check_draft_in_step(server, excuse_stale_checkpoint="strict-stale-checkpoint" not in self.config.known)

    def teardown(self) -> None:
        """The example's statistics, then ``clear_all`` (every payload freed: ``refcount``), then the server closed.

        Hypothesis runs it in a ``finally``, so also while a step's failure is on its way out, on the
        state that failure left: its clean-up can fail there (a payload an eviction freed while a slot
        held it is released again). After a failed step or check its errors are kept beside that failure
        (:mod:`properties.teardown`), never instead of it; with none, its first error fails the example.
        The server is closed even when the clean-up before it failed.
        """
        settle(self.step_failure, stages(self._count, self._clear, self._close))

    def _count(self) -> None:
        if self.observe_reach:
            self._target()
        t = type(self)
        for name, _ in self.checks:
            t.stats_checked[name] += self.steps_checked
        for k, v in self.tracer.checked.items():
            t.stats_checked[k] += v
        for k, v in self.tracer.seconds.items():  # type: ignore[assignment]
            t.stats_seconds[k] += v
        t.stats_checked.update(self.policy.checked)
        t.stats_checked.update(self.pinned.checked)
        for k, v in self.pinned.seconds.items():  # type: ignore[assignment]
            t.stats_seconds[k] += v
        if self.reuse is not None:
            t.stats_checked["reuse"] += self.reuse.checked
            t.stats_seconds["reuse"] += self.reuse.seconds["reuse"]
        t.stats_branches.update(self.policy.branches)
        for key, secs in self.policy.seconds.items():
            t.stats_seconds[key] += secs  # type: ignore[assignment]
        t.peaks.extend(self.tracer.peaks)

    def _clear(self) -> None:
        if not self.crashed:
            t = type(self)
            self.server.host.seam.disarm()
            t0 = time.perf_counter()
            inv.clear_all(self.server)
            t.stats_seconds["refcount"] += time.perf_counter() - t0  # type: ignore[assignment]
            t.stats_checked["refcount"] += 1

    def _close(self) -> None:
        t = type(self)
        stats = t.llama_stats
        for ctx in (self.server.ctx_tgt, self.server.ctx_dft):
            stats["restore_checks"] += getattr(ctx, "restore_checks", 0)
            stats["layout_diffs"] += len(getattr(ctx, "layout_diffs", ()))
            for k, v in getattr(ctx, "restores_by", {}).items():
                stats["restores_by:" + k] += v
            if getattr(ctx, "layout_diffs", None) and not t.layout_example:
                t.layout_example.append(ctx.layout_diffs[0].line())  # type: ignore[union-attr]
            for fid, diffs in getattr(ctx, "finding_diffs", {}).items():
                stats["finding:" + fid] += len(diffs)
                t.finding_examples.setdefault(fid, diffs[0].line())
        tgt = self.server.ctx_tgt
        stats["state_bytes"] = max(stats["state_bytes"], getattr(tgt, "max_state_bytes", 0))
        stats["partial_bytes"] = max(stats["partial_bytes"], getattr(tgt, "max_partial_bytes", 0))
        close_server(self.server)
        tracers = (self.tracer, self.policy, self.pinned, *([self.reuse] if self.reuse else []))
        inv.release(self.server, *tracers)  # freed by reference counting, not a full collection
        # Hypothesis' cycles hold the machine
        del self.server, self.tracer, self.policy, self.shadow, self.checks, self.reuse, self.pinned


_CLASSES: dict[MachineConfig, type[PromptCacheMachine]] = {}

#: family name -> the function that makes its concrete machine for a config (``MachineConfig.family``); each
#: family's module registers itself when imported (:mod:`properties.families` imports them all)
FAMILIES: dict[str, Callable[[MachineConfig], type[PromptCacheMachine]]] = {}


def machine_class(config: MachineConfig) -> type[PromptCacheMachine]:
    """The concrete machine for ``config``, registered in this module under ``config.class_name`` (a family's
    machine: by its family's module)."""
    if config.family:
        make = FAMILIES.get(config.family)
        if make is None:
            raise UsageError(f"machine family {config.family!r} is not loaded: import properties.families")
        return make(config)
    key = replace(config, resolve=None)
    cls = _CLASSES.get(key)
    if cls is None:
        cls = type(
            config.class_name,
            (PromptCacheMachine,),
            {
                "config": config,
                "stats_checked": Counter(),
                "stats_seconds": Counter(),
                "stats_branches": Counter(),
                "peaks": [],
                "llama_stats": Counter(),
                "layout_example": [],
                "finding_examples": {},
                "reuse_counts": Counter(),
                "reach": Counter(),
                "__module__": __name__,
            },
        )
        _CLASSES[key] = cls
        globals()[config.class_name] = cls
    return cls
