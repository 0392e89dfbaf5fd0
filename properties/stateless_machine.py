"""The prompt-cache machine with embedding and rerank requests between completions (issue #39: idle slots).

:class:`StatelessMachine` is :class:`properties.machine.PromptCacheMachine` (every rule, fault and state invariant
of the gate's machines) plus one rule, :meth:`StatelessMachine.stateless_request`: an embedding or a rerank
(``ServerContext.handle_stateless``, server-context.cpp:2363-2432) on a prompt built as a completion's is, run to
its end. After every step ``stateless_not_cached`` (:func:`properties.stateless.check_stateless_not_cached`) runs
over the prompts sent only as stateless tasks: an entry saved at a stateless task's own selection (upstream never
does, :1620) or with no upstream save behind it fails; the registered finding ``idle-stateless-slot-cached`` (the
idle-slot loop saves an embedding's slot, :2419-2432) is counted in ``found`` (examples that showed it, and the
most entries and bytes one held), never failed, unless the config's ``known`` has ``strict-stateless``.

The family ``stateless`` of :func:`properties.machine.machine_class`; a config whose semantics names one of
:data:`properties.stateless.STATELESS_MUTANTS` runs that mutant. Printed programs run after
``import properties.families``.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from harness.model.server_context import TASK_EMBEDDING, TASK_RERANK
from properties.machine import BOS, FAMILIES, MAX_PROMPT, MachineConfig, PromptCacheMachine, machine_class
from properties.stateless import FINDING, PROPERTY, check_stateless_not_cached
from properties.teardown import noted

__all__ = ["StatelessMachine", "stateless_machine"]


class StatelessMachine(PromptCacheMachine):
    """The gate's machine plus embedding/rerank requests; the generic class (concrete: :func:`stateless_machine`)."""

    found: ClassVar[Counter[str]]  # FINDING -> examples that showed it; "entries", "bytes" -> the most one held

    def __init__(self) -> None:
        super().__init__()
        self.stateless: set[tuple[int, ...]] = set()  # prompts sent as an embedding or a rerank
        self.completions: set[tuple[int, ...]] = set()  # prompts sent as completions (their entries are not it)
        self.seen = False
        handle = self.server.handle_completion

        def completion(tokens: tuple[int, ...], *args: Any, **kw: Any) -> Any:
            self.completions.add(tuple(tokens))
            return handle(tokens, *args, **kw)

        self.server.handle_completion = completion  # type: ignore[method-assign]
        if self.checks_on:
            self.checks = (*self.checks, (PROPERTY, self._check_stateless))
            self.pinned.wrap_stateless()  # stateless_fresh at selection and prompt start (properties/pinned.py)

    def _check_stateless(self, server: Any) -> None:
        strict = "strict-stateless" in self.config.known
        got = check_stateless_not_cached(server, self.stateless - self.completions, strict=strict)
        if got.finding is not None:
            found = type(self).found
            if not self.seen:
                self.seen = True
                found[FINDING] += 1
            found["entries"] = max(found["entries"], got.entries)
            found["bytes"] = max(found["bytes"], got.nbytes)

    def _live(self) -> bool:
        return not self.crashed

    @precondition(_live)
    @rule(
        source=st.integers(0, 5),
        keep=st.integers(0, MAX_PROMPT),
        suffix=st.lists(st.integers(1, 24), max_size=16),
        id_slot=st.integers(-1, 1),
        rerank=st.booleans(),
    )
    @noted
    def stateless_request(self, source: int, keep: int, suffix: list[int], id_slot: int, rerank: bool) -> None:
        """An embedding (``rerank`` False) or a rerank of a prefix of a slot's or an entry's prompt and new tokens,
        run with every other processing slot to its end."""
        tokens = (BOS, *(self._base(source)[:keep] + tuple(suffix)))[:MAX_PROMPT]
        if id_slot >= self.params.n_slots or (id_slot >= 0 and self.server.slots[id_slot].is_processing()):
            id_slot = -1  # a busy slot named by id: the known finding busy-slot-by-id, run apart
        self.stateless.add(tokens)
        kind = TASK_RERANK if rerank else TASK_EMBEDDING
        launched = self._guard("handle_stateless", self.server.handle_stateless, tokens, kind, id_slot=id_slot)
        self._guard("update_slots", self.server.run_until_idle)
        if self.checks_on and not self.crashed and launched is not None and launched.status == "launched":
            self.pinned.stateless_done(launched.slot, tokens)  # stateless_fresh: its slot as it left it


_CLASSES: dict[MachineConfig, type[StatelessMachine]] = {}


def stateless_machine(config: MachineConfig) -> type[StatelessMachine]:
    """The stateless machine for ``config`` (the family ``stateless``), registered here under its class name."""
    config = replace(config, family="stateless")
    key = replace(config, resolve=None)
    cls = _CLASSES.get(key)
    if cls is None:
        base = machine_class(replace(config, resolve=None, family=""))
        attrs: dict[str, Any] = {k: type(v)() for k, v in vars(base).items() if isinstance(v, Counter | list | dict)}
        attrs.update(config=config, found=Counter(), __module__=__name__)
        cls = type(config.class_name, (StatelessMachine,), attrs)
        _CLASSES[key] = cls
        globals()[config.class_name] = cls
    return cls


FAMILIES["stateless"] = stateless_machine
