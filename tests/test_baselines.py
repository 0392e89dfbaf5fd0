"""The exploration bench's baselines (:mod:`harness.bench.baselines`): the replayed machine draws
exactly the gate machine's choices, and a replay that does not is caught, never measured."""

from __future__ import annotations

from typing import Any, cast

import pytest
from hypothesis.internal.conjecture import engine

from harness.bench.baselines import PreconditionTape, TrivialMachine, empty_machine, recording
from harness.errors import UsageError
from properties.machine import PromptCacheMachine, machine_class
from properties.run import machines_for, make_settings, run_seeded


def _cases(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, tuple[Any, ...]]]:
    """Every test case Hypothesis runs from now on: its status and its choices."""
    seen: list[tuple[str, tuple[Any, ...]]] = []
    orig = engine.ConjectureRunner.test_function

    def test_function(self: Any, data: Any) -> None:
        try:
            orig(self, data)
        finally:
            seen.append((data.status.name, tuple(data.choices)))

    monkeypatch.setattr(engine.ConjectureRunner, "test_function", test_function)
    return seen


def test_the_replay_draws_the_machines_choices_test_case_for_test_case(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = machines_for("shared", "ci")[-1]  # no byte limit: most rules' preconditions are false
    cls, tape, s = machine_class(cfg), PreconditionTape(), make_settings("ci", None, 40)
    seen = _cases(monkeypatch)
    run_seeded(recording(cls, tape), s, 3)
    machine_cases = list(seen)
    seen.clear()
    run_seeded(empty_machine(cls, "Programs", tape), s, 3)
    assert seen == machine_cases and any(not answer for _, answer in tape.calls)
    tape.finish()
    seen.clear()
    run_seeded(TrivialMachine, s, 3)  # every rule valid: other programs
    assert seen != machine_cases


def test_the_machine_draws_its_recordings_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    # the bench records a machine's tape in a run it does not time, then times the machine without the
    # recorder (as the gate runs it): the recorder only writes down answers, the programs are the same
    cfg = machines_for("shared", "ci")[1]  # a draft model and a byte limit: preconditions both ways
    cls, tape, s = machine_class(cfg), PreconditionTape(), make_settings("ci", None, 40)
    seen = _cases(monkeypatch)
    run_seeded(recording(cls, tape), s, 3)
    recorded = list(seen)
    seen.clear()
    run_seeded(cls, s, 3)
    assert seen == recorded and any(answer for _, answer in tape.calls) and any(not a for _, a in tape.calls)


def test_a_replay_of_other_programs_fails_the_measurement() -> None:
    cfg = machines_for("shared", "ci")[-1]
    cls, tape, s = machine_class(cfg), PreconditionTape(), make_settings("ci", None, 20)
    run_seeded(recording(cls, tape), s, 3)
    with pytest.raises(Exception, match="Inconsistent data generation"):  # Hypothesis sees it too
        run_seeded(empty_machine(cls, "Programs", tape), s, 4)  # another seed: other choices, other calls
    with pytest.raises(UsageError, match="diverged from its recording: precondition call #"):
        tape.finish()


def test_the_baselines_have_the_machines_rules_and_strategies() -> None:
    def rules(cls: Any) -> dict[str, str]:
        return {r.function.__name__: repr(r.arguments) for r in cls.setup_state().rules}

    assert rules(TrivialMachine) == rules(PromptCacheMachine) == rules(empty_machine(PromptCacheMachine, "P"))
    assert not any(r.preconditions for r in cast(Any, TrivialMachine).setup_state().rules)
    assert len(rules(PromptCacheMachine)) == 8
