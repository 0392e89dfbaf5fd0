"""Teardown never hides a failure (properties/teardown.py).

``evict-frees-shared`` is the class of mutant whose corruption breaks teardown: its eviction frees
checkpoint payloads a slot still holds, so the state invariant after the eviction fails ``refcount``
and teardown's ``clear_all`` then releases one of those payloads again (``RuntimeError: double
release``). That error used to replace the violation: the gate reported ``crash`` with an untidied
program that, replayed, failed with ``refcount``.
"""

from __future__ import annotations

import inspect
import json
from typing import Any, ClassVar

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import INVARIANT_MARKER, RULE_MARKER, RuleBasedStateMachine, invariant, rule

from harness.backends.base import Backend, GateOptions, GateReport, Out
from harness.backends.synthetic import SyntheticBackend
from harness.commands.gate import run_gate
from harness.errors import HarnessLimit, PropertyFailure
from properties.invariants import Violation
from properties.lcp_machine import LcpCacheMachine
from properties.machine import PromptCacheMachine, machine_class
from properties.mutants import MUTANTS, kill
from properties.mutants import config as mutant_config
from properties.run import run_seeded
from properties.teardown import NOTE, noted, settle, stages, teardown_errors

MUTANT = "evict-frees-shared"


def _replayed(program: str) -> PropertyFailure:
    """The property failure the printed program raises, pasted as it is."""
    with pytest.raises(PropertyFailure) as e:
        exec(compile(program, "<program>", "exec"), {})  # the harness's own printed program
    return e.value


def test_the_mutant_is_the_class_that_breaks_teardown() -> None:
    assert MUTANTS[MUTANT].kills == "refcount" and not MUTANTS[MUTANT].also


def test_a_teardown_error_after_a_violation_is_kept_beside_it_not_instead() -> None:
    row = kill(MUTANT)
    assert row["killed"] and row["by"] == "refcount", row  # before: by "crash", RuntimeError: double release
    assert "referenced" in row["message"] and "released" in row["message"], row["message"]
    assert len(row["teardown"]) == 1 and row["teardown"][0].startswith("RuntimeError: double release of payload #")
    assert "harness/model/memory.py" in row["teardown"][0]  # where it was raised
    # the printed program is the tidied program of the real property and replays to it
    assert row["steps"] <= 4, row["program"]
    replayed = _replayed(row["program"])
    assert isinstance(replayed, Violation) and replayed.name == "refcount"
    assert replayed.message == row["message"]


def test_the_gate_reports_the_real_property_with_the_teardown_error_beside_it(tmp_path: Any) -> None:
    lines: list[str] = []
    report = run_gate(GateOptions(seed=0), [SyntheticBackend([mutant_config(MUTANT)], known=False)], lines.append)
    [f] = report.failures
    assert (f.property, f.kind) == ("refcount", "violation")
    assert f.teardown and "double release" in f.teardown[0]
    row = json.loads(json.dumps(report.to_json()))["failures"][0]
    assert row["property"] == "refcount" and row["teardown"] == f.teardown
    text = "\n".join(lines)
    assert f"FAILED refcount (violation) in {f.machine}" in text
    assert "teardown also failed after it: RuntimeError: double release" in text
    assert _replayed(f.program).name == "refcount"


def _corrupted() -> PromptCacheMachine:
    """The mutant's machine right after the eviction that freed payloads a slot still holds (no check yet)."""
    m = machine_class(mutant_config(MUTANT))()
    m.request(source=0, keep=31, suffix=[3, 15, 7, 18], id_slot=1, n_cmpl=1, n_predict=2, overlap=False)
    m.request(source=0, keep=0, suffix=[], id_slot=0, n_cmpl=1, n_predict=1, overlap=True)
    m.set_limit(cache_ram=1)
    return m


def test_the_machine_keeps_its_teardown_error_beside_a_failed_check() -> None:
    m = _corrupted()
    with pytest.raises(Violation) as e:
        m.state_invariants()
    assert e.value.name == "refcount" and m.step_failure is e.value
    m.teardown()  # returns: the violation goes on as raised
    [kept] = teardown_errors(e.value)
    assert kept.startswith("RuntimeError: double release of payload #")
    assert NOTE + kept in e.value.__notes__  # a comment line: a program joined from the notes still runs
    assert not hasattr(m, "server")  # closed and released although clear_all failed before it


def test_a_teardown_that_fails_on_its_own_still_fails() -> None:
    m = _corrupted()  # no check ran: nothing failed before teardown
    with pytest.raises(RuntimeError, match="double release of payload"):
        m.teardown()
    assert not hasattr(m, "server")


def test_settle_raises_the_first_error_without_a_failure_and_keeps_the_rest() -> None:
    settle(None, [])
    first, second = RuntimeError("one"), ValueError("two")
    with pytest.raises(RuntimeError) as e:
        settle(None, [first, second])
    assert e.value is first and teardown_errors(first) == ["ValueError: two"]

    def broken() -> None:
        raise KeyError("k")

    failure = AssertionError("the property")
    settle(failure, stages(lambda: None, broken, broken))  # each stage runs, even after one failed
    [kept, again] = teardown_errors(failure)
    assert kept == again and kept.startswith("KeyError: 'k' (tests/test_teardown.py:") and kept.endswith("broken)")


class _Toy(RuleBasedStateMachine):
    """A machine whose teardown fails on the state its invariant rejects (total above 3), the mutant's shape."""

    fail_teardown: ClassVar[bool] = True

    def __init__(self) -> None:
        super().__init__()
        self.total = 0
        self.step_failure: BaseException | None = None

    @rule(n=st.integers(0, 2))
    @noted
    def add(self, n: int) -> None:
        self.total += n

    @invariant()
    @noted
    def small(self) -> None:
        if self.total > 3:
            raise Violation("refcount", f"total {self.total}")

    def teardown(self) -> None:
        def clean() -> None:
            if self.total > 3 and self.fail_teardown:
                raise RuntimeError("double release")

        settle(self.step_failure, stages(clean))


def test_hypothesis_shrinks_and_reports_the_violation_not_the_teardown_error() -> None:
    with pytest.raises(Violation) as e:
        run_seeded(_Toy, settings(settings.get_profile("harness-ci"), max_examples=100), 0)
    assert e.value.name == "refcount"
    assert e.value.message == "total 4"  # shrunk toward the violation: the smallest total above 3
    assert teardown_errors(e.value) and "double release" in teardown_errors(e.value)[0]


def test_every_rule_and_invariant_of_the_machines_is_noted() -> None:
    # a step that is not noted would let teardown's errors replace its failure again
    step = noted(lambda self: None).__code__
    for cls in (PromptCacheMachine, LcpCacheMachine):
        found = 0
        for name, f in inspect.getmembers(cls):
            marked = getattr(f, RULE_MARKER, None) or getattr(f, INVARIANT_MARKER, None)
            if marked is not None:
                found += 1
                assert marked.function.__code__ is step, f"{cls.__name__}.{name} is not @noted"
        assert found >= 5, cls


class _CannotDrive(Backend):
    """A backend the harness cannot run on the tree at hand (as the llama backend on a libllama the bindings
    cannot drive)."""

    name = "cannot-drive"

    def run(self, report: GateReport, opts: GateOptions, out: Out) -> None:
        raise HarnessLimit("llama-cpp-python cannot drive the libllama of TREE: 1 difference; --backend server runs")


def test_a_backend_the_harness_cannot_run_here_is_skipped_and_the_others_still_run() -> None:
    lines: list[str] = []
    machine = [mutant_config(MUTANT)]
    report = run_gate(GateOptions(seed=0), [_CannotDrive(), SyntheticBackend(machine, known=False)], lines.append)
    assert report.failures and report.failures[0].property == "refcount"  # the next backend ran, and failed
    data = json.loads(json.dumps(report.to_json()))
    assert data["skipped"] == {"cannot-drive backend": "llama-cpp-python cannot drive the libllama of TREE: 1 "
                               "difference; --backend server runs"}  # fmt: skip
    text = "\n".join(lines)
    assert "  [skip] cannot-drive backend: llama-cpp-python cannot drive" in text
    assert "SKIPPED cannot-drive backend (a limit of the harness on this tree, exit 6 if nothing failed)" in text
