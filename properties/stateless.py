"""The check on stateless (embedding, rerank) tasks and the prompt cache: ``stateless_not_cached``.

Property: no cache entry holds the state a stateless task left in a slot. Such a prompt is never reused
(``is_stateless_task``, server-context.cpp:3196-3198, evaluates it from position 0), so an entry of it is
memory with no reuse; only a later completion whose prompt starts with the same tokens could load it.

Upstream 0c1e570 breaks it on one path: the idle-slot loop after every launch (:2419-2432, on by default,
common/common.h:630) saves every idle slot, whatever its last task was; and a completion that takes an
idle slot by LRU or with ``f_keep < 0.5`` saves the slot it takes (:1616-1628), which may hold an
embedding. That is the registered finding ``idle-stateless-slot-cached``: :func:`check_stateless_not_cached`
returns it with the entries and bytes it holds (never a silent pass), and raises :class:`Violation` when
``strict``. Upstream never saves at a stateless task's own selection (:1620 ``task.type ==
SERVER_TASK_TYPE_COMPLETION``): an entry that got in that way, or that the model has no record of
saving on one of the two paths, fails even when the finding is excused.

The entries are found independently of the model's records: by the token sequences the driver sent as
stateless tasks (and never as completions). Not one of the gate machine's properties (its machines send
no stateless task, and a new rule would move every seed's program): ``tests/test_idle_slots.py`` drives it,
on the model and on the mutants (:data:`STATELESS_MUTANTS`, below).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace

from harness.model.cache import Tokens
from harness.model.semantics import Semantics
from harness.model.server_context import STATELESS_TASKS, TASK_COMPLETION, ServerContext, ServerSlot, Task
from properties.invariants import Violation

__all__ = ["FINDING", "PROPERTY", "STATELESS_MUTANTS", "StatelessEntries", "check_stateless_not_cached"]

PROPERTY = "stateless_not_cached"
FINDING = "idle-stateless-slot-cached"


@dataclass(frozen=True)
class StatelessEntries:
    """The cache entries that hold a stateless task's prompt: how many, their bytes, the saves that made them."""

    entries: int
    nbytes: int
    idle_saves: int  # saves the model made on the idle-slot path (:2419-2432)
    select_saves: int  # saves made when a completion took the slot (:1616-1628)

    @property
    def finding(self) -> str | None:
        return FINDING if self.entries else None


def check_stateless_not_cached(
    server: ServerContext, stateless_prompts: Iterable[Tokens], *, strict: bool = False
) -> StatelessEntries:
    """The entries of ``server``'s cache whose tokens are one of ``stateless_prompts``.

    Raises :class:`Violation` (``stateless_not_cached``) when a save was made at a stateless task's own
    selection (upstream never does, :1620), when an entry has no save on upstream's two paths behind it,
    or, with ``strict``, when any entry is there (the finding itself)."""
    wanted = set(stateless_prompts)
    cache = server.prompt_cache
    held = [e for e in (cache.states if cache is not None else []) if e.prompt.tokens in wanted]
    saves = server.stateless_saves
    wrong = [s for s in saves if s.where == "select" and s.by != TASK_COMPLETION]
    if wrong:
        s = wrong[0]
        raise Violation(
            PROPERTY,
            f"slot {s.slot}'s {s.task_type} prompt ({s.n_tokens} tokens) was saved when a {s.by} task took the "
            "slot; upstream saves at selection only for completion tasks (server-context.cpp:1620)",
        )
    if len(held) > len(saves):
        raise Violation(
            PROPERTY,
            f"{len(held)} cache entries hold a stateless task's prompt, only {len(saves)} were saved on upstream's "
            "paths (idle slots :2419-2432, a completion's selection :1616-1628)",
        )
    found = StatelessEntries(
        len(held),
        sum(e.size() for e in held),
        sum(s.where == "idle" for s in saves),
        sum(s.where == "select" for s in saves),
    )
    if strict and held:
        raise Violation(
            PROPERTY,
            f"{found.entries} cache entries ({found.nbytes} bytes) hold the state of an embedding/rerank task, "
            f"which is never reused: {FINDING} (server-context.cpp:2419-2432)",
        )
    return found


class _StatelessSelectSaves(ServerContext):
    """stateless_not_cached: an embedding/rerank task's selection saves the slot it takes, as a completion's
    does (upstream's :1620 gate dropped)."""

    def get_available_slot(self, task: Task) -> ServerSlot | None:
        ret = super().get_available_slot(task)
        if ret is not None and task.type != TASK_COMPLETION and self.prompt_cache is not None:
            if ret.prompt_save(self.prompt_cache):
                self._note_stateless(ret, "select", task.type)
            self.prompt_cache.update()
        return ret


class _IdleSkipsStateless(ServerContext):
    """the reverse, upstream's rule not modelled: the idle-slot loop skips a slot whose last task was an
    embedding or a rerank (what a fix would do; 0c1e570 saves it, :2419-2432)."""

    def _cache_idle_slots(self) -> None:
        if self.prompt_cache is None:
            return
        for s in self.slots:
            if not s.is_processing():
                stateless = s.task_prev is not None and s.task_prev.type in STATELESS_TASKS
                if not stateless and s.prompt_save(self.prompt_cache):
                    self.prompt_cache.update()
                if self.params.kv_unified:
                    s.prompt_clear()


class _StatelessResumesPrefix(ServerContext):
    """stateless_fresh: an embedding/rerank prompt resumes from the slot's common prefix, as a completion's does
    (upstream's ``is_stateless_task`` branch, :3196-3198, dropped)."""

    def _start_prompt(self, slot: ServerSlot) -> None:
        task = slot.task
        if task is not None and task.type in STATELESS_TASKS:
            slot.task = replace(task, type=TASK_COMPLETION)
            try:
                super()._start_prompt(slot)
            finally:
                slot.task = task
            return
        super()._start_prompt(slot)


# Mutants of the stateless-task rules (re-exported by properties.mutants), not in its MUTANTS: the gate's
# machines send no embedding or rerank task (a rule for them would move every seed's program), so
# tests/test_idle_slots.py kills these: the first by check_stateless_not_cached on the model, the second by the
# model's prediction against a real llama-server's log.
STATELESS_MUTANTS: dict[str, Semantics] = {
    "stateless-select-saves": Semantics(
        "stateless-select-saves", shared_payloads=True, wide_try=True, server_cls=_StatelessSelectSaves
    ),
    "idle-skips-stateless": Semantics(
        "idle-skips-stateless", shared_payloads=True, wide_try=True, server_cls=_IdleSkipsStateless
    ),
    "stateless-resumes-prefix": Semantics(
        "stateless-resumes-prefix", shared_payloads=True, wide_try=True, server_cls=_StatelessResumesPrefix
    ),
}
