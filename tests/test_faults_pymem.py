"""The CPython-allocator layer: hooks only in children, always removed, availability said clearly."""

from __future__ import annotations

import pytest

import faults.pymem as pymem
from faults.kinds import Outcome
from faults.pymem import PymemUnavailable, pymem_unavailable, sweep_pymem

needs_testcapi = pytest.mark.skipif(pymem_unavailable() is not None, reason=str(pymem_unavailable()))


@needs_testcapi
def test_transient_sweep_runs_in_a_child_and_classifies() -> None:
    r = sweep_pymem("save-no-checkpoints", "shared", max_points=25, persistent_samples=0)
    assert [t.nth for t in r.trials] == list(range(1, 26))
    assert {t.outcome for t in r.trials} <= {Outcome.ACCEPTED, Outcome.VIOLATION}
    assert any(t.outcome == Outcome.ACCEPTED and t.detail.startswith("MemoryError") for t in r.trials)


@needs_testcapi
def test_the_transient_sweep_ends_where_the_act_stops_allocating() -> None:
    r = sweep_pymem("update", "shared", persistent_samples=0)  # update() allocates little
    assert r.trials and r.trials[-1].outcome == Outcome.OK and not r.trials[-1].reached
    assert len(r.trials) < 1000


@needs_testcapi
def test_a_hung_interpreter_is_a_killed_finding_and_the_runner_goes_on() -> None:
    r = sweep_pymem("save-with-checkpoints", "shared", first=60, max_points=2, persistent_samples=2, trial_timeout=1)
    persistent = [t for t in r.trials if t.mode == "persistent"]
    assert [t.nth for t in persistent] == [60, 61]  # one per point, whatever happened to the child
    for t in persistent:
        assert t.outcome in {Outcome.ACCEPTED, Outcome.VIOLATION, Outcome.KILLED, Outcome.ABORTED}
        if t.outcome in (Outcome.KILLED, Outcome.ABORTED):
            assert t.stacks  # the watchdog's or faulthandler's dump


def test_missing_testcapi_is_said_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pymem, "_testcapi", lambda: None)
    reason = pymem_unavailable()
    assert reason is not None and "_testcapi" in reason and "\n" not in reason
    with pytest.raises(PymemUnavailable, match="_testcapi"):
        sweep_pymem("save-no-checkpoints")
