"""What Hypothesis alone costs: the baselines the ``exploration`` bench divides by (issue 17).

Both are built from a gate machine's own rules (its ``@rule`` argument strategies, read from
Hypothesis' rule markers) with empty bodies and an empty invariant, so they cannot drift from it:

* :data:`TrivialMachine` (:func:`empty_machine` without a tape): no preconditions. Every rule is
  always valid, so its programs are not the gate machine's: where a configuration's preconditions
  leave mostly ``request`` valid (no byte limit, a transformer: three steps in four), the machine
  draws ~17 choices a step against the trivial machine's ~9, and Hypothesis' own cost per choice
  (~60 us on this host) is then a cost no rule body can remove.
* :func:`empty_machine` with a :class:`PreconditionTape`: **the same programs**. A gate machine run
  through :func:`recording` writes, in order, every answer its preconditions gave Hypothesis. The
  empty machine has the same rules, argument strategies and number of preconditions, and its
  preconditions read the tape back: under the same seed and settings Hypothesis makes exactly the
  same choices, test case for test case (valid, invalid and overrun alike). The gate machine's time
  over this one's is its rule bodies, checks and preconditions: the harness' code and nothing else.
  :meth:`PreconditionTape.finish` proves the replay was exact: a precondition of another rule than
  the one recorded, or a tape not read to its end, fails the measurement.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any, cast

from hypothesis.stateful import (
    INVARIANT_MARKER,
    RULE_MARKER,
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from harness.errors import UsageError
from properties.machine import PromptCacheMachine

__all__ = ["PreconditionTape", "TrivialMachine", "empty_machine", "recording"]


class PreconditionTape:
    """Every precondition call Hypothesis made on a machine, in order: (rule name, answer)."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, bool]] = []
        self.at = 0
        self.diverged = ""

    def recorder(self, name: str, pred: Callable[[Any], Any]) -> Callable[[Any], bool]:
        calls = self.calls

        def recorded(machine: Any) -> bool:
            answer = bool(pred(machine))
            calls.append((name, answer))
            return answer

        return recorded

    def player(self, name: str) -> Callable[[Any], bool]:
        def replayed(machine: Any) -> bool:
            i = self.at
            self.at = i + 1
            if i < len(self.calls) and self.calls[i][0] == name:
                return self.calls[i][1]
            if not self.diverged:  # not raised here: Hypothesis would take it for a failure and shrink it
                got = self.calls[i][0] if i < len(self.calls) else "the end of the tape"
                self.diverged = f"precondition call #{i} is {name}'s, the recording has {got}"
            return True

        return replayed

    def finish(self) -> None:
        """Raise unless the replay asked exactly the recorded calls, in order; then rewind."""
        at, self.at = self.at, 0
        if self.diverged or at != len(self.calls):
            why = self.diverged or f"{at} precondition calls replayed, {len(self.calls)} recorded"
            raise UsageError(f"the replay of a machine's programs diverged from its recording: {why}")


def _rules(cls: type[RuleBasedStateMachine]) -> list[Any]:
    return [r for _, f in inspect.getmembers(cls) if (r := getattr(f, RULE_MARKER, None)) is not None]


def _invariant_names(cls: type[RuleBasedStateMachine]) -> list[str]:
    out = []
    for name, f in inspect.getmembers(cls):
        inv = getattr(f, INVARIANT_MARKER, None)
        if inv is not None:
            if inv.preconditions:  # a tape of rule preconditions only: this would need its own
                raise UsageError(f"{cls.__name__}.{name}: an invariant with a precondition cannot be replayed")
            out.append(name)
    return out


def _empty(name: str) -> Callable[..., None]:
    def body(self: Any, **kwargs: Any) -> None:
        pass

    body.__name__ = body.__qualname__ = name  # Hypothesis orders rules and names features by it
    return body


def empty_machine(
    cls: type[RuleBasedStateMachine], name: str, tape: PreconditionTape | None = None
) -> type[RuleBasedStateMachine]:
    """``cls``'s rules and argument strategies with empty bodies, and one empty invariant per
    invariant; with ``tape``, each precondition of ``cls`` replaced by one that reads the tape."""
    ns: dict[str, Any] = {"__module__": __name__}
    for r in _rules(cls):
        f = rule(**r.arguments)(_empty(r.function.__name__))  # type: ignore[no-untyped-call]
        for _ in r.preconditions if tape is not None else ():
            f = precondition(cast(PreconditionTape, tape).player(r.function.__name__))(f)
        ns[r.function.__name__] = f
    for inv_name in _invariant_names(cls):
        ns[inv_name] = invariant()(_empty(inv_name))
    return type(name, (RuleBasedStateMachine,), ns)


def recording(cls: type[PromptCacheMachine], tape: PreconditionTape) -> type[PromptCacheMachine]:
    """``cls`` with each precondition writing its answers to ``tape``; bodies and checks unchanged.

    The rules are declared again with Hypothesis' own decorators on the same functions, so the
    machine draws and runs as ``cls`` does; the recording costs one call and one append a precondition,
    so the bench records in a run of its own and times ``cls`` itself (the same programs: a run is fixed
    by its seed).
    """
    ns: dict[str, Any] = {"__module__": cls.__module__}
    for r in _rules(cls):
        if not r.preconditions:
            continue
        f = rule(**r.arguments)(r.function)  # type: ignore[no-untyped-call]
        for p in r.preconditions:
            f = precondition(tape.recorder(r.function.__name__, p))(f)
        ns[r.function.__name__] = f
    return type(cls.__name__, (cls,), ns)


TrivialMachine = empty_machine(PromptCacheMachine, "TrivialMachine")
