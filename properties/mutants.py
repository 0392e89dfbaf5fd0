"""Deliberately broken caches: each one must be killed by the property it names.

A mutant is a :class:`~harness.model.semantics.Semantics` whose ``cache_cls``, ``checkpoint_cls`` or
``server_cls`` is a subclass of the model with one rule broken, plus ``master`` itself (killed by
``transient_peak`` and, once a fault is armed, by ``no_partial_entries``). :data:`MUTANTS` maps
the name to ``(semantics, the property expected to kill it, what is broken)``.

Size: the one table of the gate's mutants, one short class each (a rule broken in one place), with the kill that
tries them on the gate's whole list of machines; splitting the table would split the matrix it is.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, cast

from hypothesis.statistics import collector

from harness.errors import BadAlloc, UsageError
from harness.model.cache import (
    ServerPrompt,
    ServerPromptCache,
    ServerPromptCacheState,
    ServerPromptData,
    clone_tokens,
    get_common_prefix,
)
from harness.model.checkpoint import CheckpointList, CommonPromptCheckpoint
from harness.model.memory import Payload
from harness.model.semantics import MASTER, SHARED, Semantics
from harness.model.server_context import ServerContext, ServerSlot
from harness.model.slot_files import SlotFileStore
from properties.machine import MachineConfig
from properties.run import SHRINKS, machines_for, make_settings, run_machine
from properties.stateless import STATELESS_MUTANTS

__all__ = ["FAMILY_HOOKS", "MUTANTS", "SLOT_FILE_MUTANTS", "STATELESS_MUTANTS", "FamilyHooks", "Mutant", "config",
           "expected", "kill", "kill_configs", "resolve"]  # fmt: skip


class _UpdateIgnoresLimitSize(ServerPromptCache):
    """limit: update() skips its byte-limit pass (and computes the token limit without it)."""

    def update(self) -> int:
        saved, self.limit_size = self.limit_size, 0
        try:
            return super().update()
        finally:
            self.limit_size = saved


class _SizeOmitsCheckpoints(ServerPromptCache):
    """accounting: size() counts the state buffers but not the checkpoints (pre-#25070)."""

    def size(self) -> int:
        return sum(e.data.size() for e in self.states)


class _UpdateInPlace(CommonPromptCheckpoint):
    """immutability: update_tgt/dft write into the existing payload even when it is shared."""

    def _write(self, old: Payload | None, data: bytes, site: str, kind: str) -> Payload | None:
        if old is not None:
            old.rewrite(data, site)
            return old
        return super()._write(old, data, site, kind)


class _EvictForgetsRelease(ServerPromptCache):
    """refcount: evicting the oldest entry unlinks it without destroying it."""

    def _pop_front(self) -> None:
        self.states.pop(0)


class _EvictFreesShared(ServerPromptCache):
    """refcount: evicting the oldest entry frees its checkpoints' payloads outright, though a slot still holds them."""

    def _pop_front(self) -> None:
        for c in self.states[0].prompt.checkpoints.items:
            for p in c.payloads():
                while p.holders > 1:  # the entry's release below drops the last holder: freed
                    p.release()
        super()._pop_front()


class _HalfBuiltEntry(ServerPromptCache):
    """no_partial_entries: the entry is appended before its checkpoints are copied."""

    def _push_back(self, prompt: ServerPrompt, tgt: Payload | None, dft: Payload | None) -> ServerPromptCacheState:
        try:
            tokens = clone_tokens(self.host, prompt.tokens)
        except BadAlloc:
            for p in (tgt, dft):
                if p is not None:
                    p.release()
            raise
        entry = ServerPromptCacheState(ServerPrompt(tokens, CheckpointList(self.host)), ServerPromptData(tgt, dft))
        self.states.append(entry)
        entry.prompt.checkpoints = prompt.checkpoints.copy()  # a BadAlloc here leaves the entry half-built
        return entry


class _LoadKeepsEntry(ServerPromptCache):
    """load_transfer: a successful load leaves the (emptied) entry in the cache instead of erasing it."""

    _keep = False

    def load(self, *args: Any) -> bool:
        self._keep = True
        try:
            return super().load(*args)
        finally:
            self._keep = False

    def _erase(self, entry: ServerPromptCacheState) -> None:
        if not self._keep:
            super()._erase(entry)


class _KeepsPrefixes(ServerPromptCache):
    """no_prefix_entries: alloc does not remove entries that are prefixes of the new prompt."""

    def _remove_obsolete(self, prompt: ServerPrompt) -> None:
        return None


class _ClearKeepsCheckpoints(ServerSlot):
    """cleared_checkpoints: prompt_clear drops the slot's tokens and memory but keeps its checkpoints."""

    def prompt_clear(self) -> None:
        kept = self.prompt.checkpoints.take()
        super().prompt_clear()
        self.prompt.checkpoints = kept


class _NoCheckpointCap(ServerContext):
    """checkpoint_lists: create_checkpoint ignores n_ctx_checkpoints."""

    def create_checkpoint(self, slot: ServerSlot, n_tokens_cur: int, pos_min: int, pos_max: int) -> None:
        saved = self.params.n_ctx_checkpoints
        self.params.n_ctx_checkpoints = 1 << 30
        try:
            super().create_checkpoint(slot, n_tokens_cur, pos_min, pos_max)
        finally:
            self.params.n_ctx_checkpoints = saved


class _NoInvalidation(ServerContext):
    """checkpoint_lists: checkpoints beyond the resume position are kept."""

    def _invalidate_checkpoints(self, slot: ServerSlot, pos_next: int) -> None:
        return None


class _IdleCachingSavesBusy(ServerContext):
    """busy_slot_untouched: idle-slot caching also saves slots that are processing."""

    def _cache_idle_slots(self) -> None:
        if self.prompt_cache is None:
            return
        for s in self.slots:
            if s.prompt_save(self.prompt_cache):
                self.prompt_cache.update()


class _DraftNotRestored(ServerContext):
    """draft_in_step: after drafting, the draft context is not rolled back to the checkpoint."""

    def _restore_draft(self, slot: ServerSlot, use_ckpt_dft: bool) -> None:
        return None


class _CorruptCheckpointRestore(CommonPromptCheckpoint):
    """restore_equivalence: a checkpoint restore lands one flipped bit (rot in shared payload storage).

    The restore is bookkept as the checkpoint's (same tokens, same sizes); only the bytes that
    reach libllama differ, which only a comparison of logits can see (libllama backend only).
    """

    def load_tgt(self, ctx: Any, seq_id: int, flags: int) -> None:
        super().load_tgt(ctx, seq_id, flags)
        data = self.data_tgt.data if self.data_tgt is not None else b""
        set_raw = getattr(ctx, "_set_raw", None)
        if set_raw is not None and len(data) >= 64:
            bad = bytearray(data)
            bad[-9] ^= 0x40  # inside the last tensor's values, past every header
            set_raw(ctx.ctx, seq_id, bytes(bad), flags)


class _LoadFirstUsable(ServerPromptCache):
    """load_choice: load takes the first entry that beats the slot, not upstream's best-so-far scan."""

    def load(self, prompt: ServerPrompt, tokens_new: Any, ctx_tgt: Any, ctx_dft: Any, id_slot: int) -> bool:
        n0 = get_common_prefix(prompt.tokens, tokens_new)
        keep0 = n0 / len(prompt.tokens) if prompt.tokens else -1.0
        first = None
        for e in self.states:
            n = get_common_prefix(e.prompt.tokens, tokens_new)
            if e.prompt.tokens and n / len(e.prompt.tokens) >= 0.25 and n / len(e.prompt.tokens) > keep0 and n > n0:
                first = e
                break
        if first is None:
            return super().load(prompt, tokens_new, ctx_tgt, ctx_dft, id_slot)
        everyone = list(self.states)
        self.states = [first]  # the scan sees only the first usable entry
        try:
            return super().load(prompt, tokens_new, ctx_tgt, ctx_dft, id_slot)
        finally:
            gone = first not in self.states
            self.states = [e for e in everyone if not (gone and e is first)]


class _EvictNewest(ServerPromptCache):
    """alloc_eviction: making room before an insert evicts the newest entry (MRU), not the oldest."""

    def _make_room(self, state_size_new: int) -> None:
        if self.limit_size > 0:
            while self.states and self.size() + state_size_new > self.limit_size:
                self.evictions += 1
                self._erase(self.states[-1])


class _EvictOneMore(ServerPromptCache):
    """update_eviction: whenever update() evicts, it evicts one entry more than needed."""

    def update(self) -> int:
        n = len(self.states)
        res = super().update()
        if self.states and len(self.states) < n:
            self._pop_front()
        return res


class _TokenLimitNeedsRam(ServerPromptCache):
    """update_eviction: update() applies the token limit only when --cache-ram sets a byte limit."""

    def update(self) -> int:
        if self.limit_size > 0:
            return super().update()
        saved, self.limit_tokens = self.limit_tokens, 0
        try:
            return super().update()
        finally:
            self.limit_tokens = saved


class _NoMinStepThinning(ServerContext):
    """checkpoint_policy: a full checkpoint list only drops its oldest; no min-step thinning (pre-#25472)."""

    def create_checkpoint(self, slot: ServerSlot, n_tokens_cur: int, pos_min: int, pos_max: int) -> None:
        saved = self.params.checkpoint_min_step
        self.params.checkpoint_min_step = -(1 << 30)  # no checkpoint is ever within min-step
        try:
            super().create_checkpoint(slot, n_tokens_cur, pos_min, pos_max)
        finally:
            self.params.checkpoint_min_step = saved


class _FailedLoadKeepsSlot(ServerSlot):
    """restore_failure: prompt_load reports success after a failed restore, so the slot is not cleared."""

    def prompt_load(self, prompt_cache: ServerPromptCache, tokens: Any) -> bool:
        super().prompt_load(prompt_cache, tokens)
        return True


class _CheckpointRestoreFailureIgnored(CommonPromptCheckpoint):
    """restore_failure: a checkpoint restore whose read fails is ignored instead of aborting."""

    def load_tgt(self, ctx: Any, seq_id: int, flags: int) -> None:
        if ctx is not None and self.data_tgt is not None:
            ctx.state_seq_set_data_ext(seq_id, self.data_tgt.data, flags)

    def load_dft(self, ctx: Any, seq_id: int, flags: int) -> None:
        if ctx is not None and self.data_dft is not None:
            ctx.state_seq_set_data_ext(seq_id, self.data_dft.data, flags)


class _LoadRestoresOldestBytes(ServerPromptCache):
    """restore_bytes: a cache load restores the oldest entry's state bytes, whichever entry it moves."""

    def load(self, prompt: ServerPrompt, tokens_new: Any, ctx_tgt: Any, ctx_dft: Any, id_slot: int) -> bool:
        oldest = self.states[0].data.main if self.states else None
        data = oldest.data if oldest is not None else None
        loads = self.loads
        res = super().load(prompt, tokens_new, ctx_tgt, ctx_dft, id_slot)
        if res and self.loads > loads and data is not None:
            ctx_tgt.state_seq_set_data_ext(id_slot, data, 0)
        return res


class _SelectionIgnoresCache(ServerContext):
    """reuse: get_available_slot never saves to or loads from the prompt cache (an LRU slot keeps its old prompt)."""

    def get_available_slot(self, task: Any) -> Any:
        cache, self.prompt_cache = self.prompt_cache, None
        try:
            return super().get_available_slot(task)
        finally:
            self.prompt_cache = cache


class _IdleClearsOnlySaved(ServerContext):
    """idle_pass: with kv_unified the idle pass clears only the slots it saved; upstream clears every idle slot,
    saved or not (a save refused over the byte limit or for a prompt already cached keeps it, :2419-2432)."""

    def _cache_idle_slots(self) -> None:
        if self.prompt_cache is None:
            return
        for s in self.slots:
            if not s.is_processing() and s.prompt_save(self.prompt_cache):
                self.prompt_cache.update()
                if self.params.kv_unified:
                    s.prompt_clear()


class _IdleSkipsUpdate(ServerContext):
    """idle_pass: the idle pass saves every idle slot but never calls update(): the cache stays over its token
    limit until the next request's selection."""

    def _cache_idle_slots(self) -> None:
        if self.prompt_cache is None:
            return
        for s in self.slots:
            if not s.is_processing():
                s.prompt_save(self.prompt_cache)
                if self.params.kv_unified:
                    s.prompt_clear()


class _SelectSkipsUpdate(ServerContext):
    """limit: a completion's selection saves and loads without the update() after them (:1628); the idle pass's
    update() covers it unless no idle slot is saved, so the cache is over its token limit between steps only."""

    def get_available_slot(self, task: Any) -> Any:
        cache = self.prompt_cache
        if cache is None:
            return super().get_available_slot(task)
        had = vars(cache).get("update")  # the tracer's wrapper of this instance, if any
        cache.update = lambda: 0  # type: ignore[method-assign]
        try:
            return super().get_available_slot(task)
        finally:
            if had is None:
                del cache.update
            else:
                cache.update = had  # type: ignore[method-assign]


@dataclass(frozen=True)
class Mutant:
    semantics: Semantics
    kills: str  # the property expected to kill it
    what: str
    also: frozenset[str] = frozenset()  # other properties that may legitimately kill it first
    kind: str = "hybrid"
    draft: bool = False
    arch: str = ""  # run on this fixtures model (libllama backend) instead of the synthetic provider
    # more of its own machine's settings (MachineConfig fields besides kind and draft), where the broken
    # behaviour shows: the kill tries this machine first, then the gate's
    machine: tuple[tuple[str, Any], ...] = ()


def _m(
    name: str,
    kills: str,
    cls: type,
    *,
    kind: str = "hybrid",
    draft: bool = False,
    arch: str = "",
    also: frozenset[str] = frozenset(),
    machine: tuple[tuple[str, Any], ...] = (),
) -> Mutant:
    """A mutant of ``shared`` whose one broken class is ``cls`` (its docstring says what is broken)."""
    slot = {
        ServerPromptCache: "cache_cls",
        CommonPromptCheckpoint: "checkpoint_cls",
        ServerContext: "server_cls",
        ServerSlot: "slot_cls",
    }
    field_name = next(v for k, v in slot.items() if issubclass(cls, k))
    sem = Semantics(name, shared_payloads=True, wide_try=True, **{field_name: cls})
    return Mutant(
        sem, kills, (cls.__doc__ or "").strip(), also=also, kind=kind, draft=draft, arch=arch, machine=machine
    )


_KVU: tuple[tuple[str, Any], ...] = (("kv_unified", True),)
_TOKENS_ONLY: tuple[tuple[str, Any], ...] = (("cache_ram", -1), ("n_ctx", 44))  # the token limit alone evicts

MUTANTS: dict[str, Mutant] = {
    m.semantics.name: m
    for m in [
        Mutant(
            MASTER,
            "transient_peak",
            "upstream as vendored: deep copy on insert, narrow try",
            also=frozenset({"no_partial_entries"}),
        ),
        Mutant(
            Semantics("deep-copy-on-insert", shared_payloads=False, wide_try=True),
            "transient_peak",
            "the PR's wide handler, but checkpoint payloads still deep-copied",
        ),
        Mutant(
            Semantics("narrow-try", shared_payloads=True, wide_try=False),
            "no_partial_entries",
            "shared payloads, but bad_alloc caught only around the state resize",
        ),
        _m("update-ignores-limit-size", "limit", _UpdateIgnoresLimitSize),
        _m("size-omits-checkpoints", "accounting", _SizeOmitsCheckpoints),
        _m("update-in-place", "immutability", _UpdateInPlace),
        _m("evict-forgets-release", "refcount", _EvictForgetsRelease),
        _m("evict-frees-shared", "refcount", _EvictFreesShared),
        _m("half-built-entry", "no_partial_entries", _HalfBuiltEntry),
        _m("load-keeps-entry", "load_transfer", _LoadKeepsEntry),
        # on a transformer: no checkpoints, so the entry a prefix leaves behind is all that differs (3-4 steps)
        _m(
            "keeps-prefixes",
            "no_prefix_entries",
            _KeepsPrefixes,
            also=frozenset({"alloc_eviction"}),
            kind="transformer",
        ),
        _m("no-checkpoint-cap", "checkpoint_lists", _NoCheckpointCap, also=frozenset({"checkpoint_policy"})),
        _m("no-invalidation", "checkpoint_lists", _NoInvalidation),
        # an idle slot is cleared after its save only under a unified KV ([TAG_IDLE_SLOT_CLEAR])
        _m("clear-keeps-checkpoints", "cleared_checkpoints", _ClearKeepsCheckpoints, machine=_KVU),
        _m("idle-caching-saves-busy", "busy_slot_untouched", _IdleCachingSavesBusy),
        _m("draft-not-restored", "draft_in_step", _DraftNotRestored, draft=True),
        _m("corrupt-checkpoint-restore", "restore_equivalence", _CorruptCheckpointRestore, arch="jamba"),
        # killed on the gate's recurrent machine (two entries that beat the slot, one better): its own first
        # without a byte limit the cache keeps several usable entries for one prompt, which the choice needs:
        # killed on seeds 0-4 in 1.3-2.1 s (with --cache-ram 6, seed 2 survived and seed 4 needed 10 steps)
        _m(
            "load-first-usable",
            "load_choice",
            _LoadFirstUsable,
            kind="recurrent",
            machine=(("kv_unified", True), ("cache_ram", -1)),
        ),
        _m("evict-newest", "alloc_eviction", _EvictNewest),
        _m("evict-one-more", "update_eviction", _EvictOneMore, draft=True),  # killed on the draft machine
        # only the token limit is at stake: a machine with the byte limit off and little KV room (n_ctx 24:
        # three short prompts pass the token limit; at the gate's 44 the shrunk program needed 11 steps)
        _m(
            "token-limit-needs-ram",
            "update_eviction",
            _TokenLimitNeedsRam,
            also=frozenset({"limit"}),  # the entries it leaves over the token limit break the limit itself
            kind="transformer",
            machine=(("kv_unified", True), ("cache_ram", -1), ("n_ctx", 24)),
        ),
        _m("no-min-step-thinning", "checkpoint_policy", _NoMinStepThinning),
        _m("failed-load-keeps-slot", "restore_failure", _FailedLoadKeepsSlot, kind="iswa"),  # killed on iswa
        # killed on the gate's draft machine: its own first
        _m("checkpoint-restore-failure-ignored", "restore_failure", _CheckpointRestoreFailureIgnored, draft=True),
        _m("load-restores-oldest-bytes", "restore_bytes", _LoadRestoresOldestBytes),
        # on a transformer (every prefix resumes): the first request that an LRU slot could have loaded
        _m("selection-ignores-cache", "reuse", _SelectionIgnoresCache, kind="transformer"),
        # issue #50: the idle loop's branches (idle_pass), and the limit checked after every step
        _m("idle-clears-only-saved", "idle_pass", _IdleClearsOnlySaved, kind="transformer", machine=_KVU),
        _m("idle-skips-update", "idle_pass", _IdleSkipsUpdate, kind="transformer", also=frozenset({"limit"}),
           machine=(*_KVU, *_TOKENS_ONLY)),
        _m("select-skips-update", "limit", _SelectSkipsUpdate, kind="transformer", machine=_TOKENS_ONLY),
    ]
}


class _RestoreKeepsCheckpoints(SlotFileStore):
    """slot_file_restore: a slot file restore replaces the tokens and state but keeps the slot's checkpoints
    (upstream's ``prompt.clear()`` drops them, server-context.cpp:2618)."""

    def restore_prompt(self, slot: ServerSlot, tokens: tuple[int, ...]) -> None:
        slot.prompt.tokens = tokens


class _SaveIgnoresWriteError(SlotFileStore):
    """no_partial_file: a save whose write fails mid-file answers 200 and leaves the bytes written."""

    def write_failed(self, size: int, room: int | None) -> bool:
        return False


#: the slot-file mutants (issue #39): name -> (the store class, the property expected to kill it). They run on
#: :func:`properties.slot_file_machine.slot_file_machine` (the gate's machines have no slot-file rule), so they
#: are not in :data:`MUTANTS` (``python -m harness mutants`` and the report run those on the gate's machines).
SLOT_FILE_MUTANTS: dict[str, tuple[type[SlotFileStore], str]] = {
    "restore-keeps-checkpoints": (_RestoreKeepsCheckpoints, "slot_file_restore"),
    "save-ignores-write-error": (_SaveIgnoresWriteError, "no_partial_file"),
}


def resolve(name: str) -> Semantics:
    """The semantics of mutant ``name`` (or of ``shared``/``master``)."""
    if name == "shared":
        return SHARED
    return MUTANTS[name].semantics


def config(name: str, kind: str | None = None, *, draft: bool | None = None) -> MachineConfig:
    """The machine configuration that runs mutant ``name`` (its own kind and draft by default)."""
    m = MUTANTS[name]
    cfg = MachineConfig(
        name, "" if m.arch else kind or m.kind, arch=m.arch, draft=m.draft if draft is None else draft, resolve=resolve
    )
    return replace(cfg, **dict(m.machine))


@dataclass
class FamilyHooks:
    """What :mod:`properties.families` registers when it is imported (it imports this module, so a hook, not an
    import): the families' machines a gate run covers (``configs(semantics, profile)``), a family mutant's own
    machines (``own(name)``), each family mutant's expected and also-allowed properties, and the resolver of any
    mutant name."""

    configs: Callable[[str, str], list[MachineConfig]] | None = None
    own: Callable[[str], list[MachineConfig]] | None = None
    kills: dict[str, tuple[str, frozenset[str]]] = field(default_factory=dict)
    resolve: Callable[[str], Semantics] | None = None


FAMILY_HOOKS = FamilyHooks()


def expected(name: str) -> tuple[str, frozenset[str]]:
    """The property expected to kill mutant ``name`` (the gate's or a family's) and those allowed first."""
    if name in MUTANTS:
        return MUTANTS[name].kills, MUTANTS[name].also
    if name in FAMILY_HOOKS.kills:
        return FAMILY_HOOKS.kills[name]
    raise UsageError(f"unknown mutant {name!r}" + ("" if FAMILY_HOOKS.configs else " (import properties.families)"))


def kill_configs(name: str) -> list[MachineConfig]:
    """The machines :func:`kill` tries on mutant ``name``, in order: its own, then the gate's whole list (its seven
    machines and the machine families' of the ci profile), each once."""
    hooks = FAMILY_HOOKS
    if hooks.configs is None or hooks.own is None or hooks.resolve is None:
        raise UsageError("the machine families are not loaded: import properties.families")
    expected(name)
    own = [config(name)] if name in MUTANTS else hooks.own(name)[:1]
    rest = machines_for("shared", "ci") + hooks.configs("shared", "ci")
    gate = [replace(c, semantics=name, resolve=hooks.resolve) for c in rest]
    return own + [c for c in gate if c not in own]  # its own machine is often one of the gate's: once


def kill(name: str, *, seed: int = 0, max_examples: int = 300) -> dict[str, Any]:
    """Run the gate's machines, the families' included (:func:`kill_configs`), against mutant ``name`` (the gate's,
    or a family's: :data:`properties.families.FAMILY_MUTANTS`) until one fails; return the JSON row.

    ``seconds`` is the whole kill, wall clock; it splits into ``detect_seconds`` (from the start to
    the first failing example: the machines that passed, then the killing run's generate phase, from
    Hypothesis' own phase statistics), ``shrink_seconds`` (Hypothesis' shrink phase) and the rest
    (:func:`properties.run.tidy` and printing the program).
    """
    kills, also = expected(name)
    cfg_settings = make_settings("ci", None, max_examples)
    t0 = time.perf_counter()
    configs = kill_configs(name)
    # a mutant that survives one seed gets two more before it counts as surviving
    for cfg, s in ((c, s) for s in (seed, seed + 1, seed + 2) for c in configs):
        replay = f"python -m harness mutants --only {name} --seed {s}"
        start = time.perf_counter() - t0
        phases: list[dict[str, Any]] = []
        with cast(Any, collector).with_value(phases.append):  # Hypothesis' phase statistics (typed None)
            r = run_machine(cfg, cfg_settings, s, replay, shrinks=SHRINKS["ci"])
        if r.failure is not None:
            f = r.failure

            def phase(p: str, runs: list[dict[str, Any]] = phases) -> float:
                # both runs of run_seeded: the first finds (generate), the second shrinks
                return sum(float(r.get(f"{p}-phase", {}).get("duration-seconds", 0.0)) for r in runs)

            return {
                "name": name,
                "killed": True,
                "seed": s,
                "by": f.property,
                "expected": kills,
                "also": sorted(also),
                "machine": f.machine,
                "message": f.message,
                "seconds": round(time.perf_counter() - t0, 2),
                "detect_seconds": round(start + phase("explicit") + phase("generate"), 2),
                "shrink_seconds": round(phase("shrink"), 2),
                "steps": f.steps,
                "program": f.program,
                "teardown": f.teardown,
            }
    return {
        "name": name,
        "killed": False,
        "by": None,
        "expected": kills,
        "also": sorted(also),
        "seconds": round(time.perf_counter() - t0, 2),
        "steps": 0,
    }
