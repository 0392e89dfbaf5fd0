"""One run of one machine: counted, guided, and a failure shrunk and saved once.

:func:`instrument` makes a subclass of a machine class with the same name (so the same example
database key) whose rules and teardown count into a :class:`Tally`: examples, steps, rules hit.
:func:`run_batch` runs it for a number of examples; a failure's signature
(:func:`~harness.campaign.store.failure_id`) decides what happens next:

* already recorded (by this campaign, an earlier one, or another machine sharing the database):
  dropped without shrinking, the run counts it as a duplicate;
* new: the failing example is replayed from the worker's in-memory database and shrunk; the shrunk
  example is copied into the campaign's database, then the :class:`FailureRecord` is saved beside
  it, and only then is the failure returned to be reported.

Generation runs against an in-memory database per machine (kept for the worker's life): with
targeting on, its ``reuse`` phase carries the Pareto front of ``hypothesis.target`` observations
from one run of a machine to the next, so a campaign climbs over its runs, not within one only.
"""

from __future__ import annotations

import functools
import inspect
import os
import socket
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import ExampleDatabase, InMemoryExampleDatabase
from hypothesis.errors import Unsatisfiable
from hypothesis.reporting import with_reporter
from hypothesis.stateful import RULE_MARKER, Rule, RuleBasedStateMachine, get_state_machine_test

from harness.campaign.machines import MachineSpec, Plan
from harness.campaign.store import FailureRecord, failure_id, failures, save_failure
from harness.errors import PropertyFailure, TargetCrash

__all__ = ["Found", "RunResult", "Tally", "instrument", "replay_settings", "rule_names", "run_batch", "run_settings"]


@dataclass
class Tally:
    examples: int = 0
    rules: Counter[str] = field(default_factory=Counter)

    @property
    def steps(self) -> int:
        return sum(self.rules.values())


@dataclass
class Found:
    """A failure as raised: property, kind, message, program."""

    property: str
    kind: str
    message: str
    program: str


@dataclass
class RunResult:
    machine: str
    examples: int
    steps: int
    rules: Counter[str]
    seconds: float
    reach: dict[str, int]
    record: FailureRecord | None = None  # a new failure, saved
    # known findings counted, not failed (the reuse property's: "id" requests, "id:tokens" tokens recomputed)
    findings: dict[str, int] = field(default_factory=dict)  # a new failure, saved
    duplicate: str | None = None  # the id of a failure already recorded


def _counted(name: str, r: Rule, tally: Tally) -> Callable[..., Any]:
    fn = r.function

    @functools.wraps(fn)
    def counted(self: Any, **kw: Any) -> Any:
        tally.rules[name] += 1
        return fn(self, **kw)

    def holder(self: Any, **kw: Any) -> Any:
        return counted(self, **kw)

    setattr(holder, RULE_MARKER, Rule(targets=r.targets, function=counted, arguments=r.arguments,
                                      preconditions=r.preconditions))  # fmt: skip
    return holder


def rule_names(cls: type[RuleBasedStateMachine]) -> list[str]:
    """The names of the machine's rules."""
    return sorted(name for name, f in inspect.getmembers(cls) if isinstance(getattr(f, RULE_MARKER, None), Rule))


def instrument(cls: type[RuleBasedStateMachine], tally: Tally) -> type[RuleBasedStateMachine]:
    """``cls`` counting into ``tally``; same ``__name__`` and ``__qualname__``, so the same database key."""
    # observe_reach: the machines of properties.machine measure their reach and call hypothesis.target
    ns: dict[str, Any] = {"__qualname__": cls.__name__, "__module__": cls.__module__, "observe_reach": True}
    for name, f in inspect.getmembers(cls):
        r = getattr(f, RULE_MARKER, None)
        if isinstance(r, Rule):
            ns[name] = _counted(name, r, tally)

    def teardown(self: Any) -> None:
        tally.examples += 1
        cls.teardown(self)  # type: ignore[no-untyped-call]

    ns["teardown"] = teardown
    return type(cls.__name__, (cls,), ns)


def _base(spec: MachineSpec, db: ExampleDatabase | None, phases: list[Phase], n: int) -> settings:
    return settings(
        max_examples=n,
        stateful_step_count=spec.steps,
        deadline=None,
        database=db,
        report_multiple_bugs=False,
        derandomize=False,
        suppress_health_check=list(HealthCheck),
        phases=phases,
        print_blob=False,
    )


def run_settings(spec: MachineSpec, db: ExampleDatabase, n: int, target: bool) -> settings:
    """Generation: with targeting, the reuse phase (the Pareto front so far) and the target phase."""
    phases = [Phase.explicit, Phase.reuse, Phase.generate, Phase.target] if target else [Phase.generate]
    return _base(spec, db, phases, n)


def replay_settings(spec: MachineSpec, db: ExampleDatabase, *, shrink: bool) -> settings:
    """Replay what ``db`` holds for the machine (and shrink it, for a fresh failure); never generate."""
    # max_examples bounds the shrinker too (about ten calls per example): room for a real shrink
    return _base(spec, db, [Phase.explicit, Phase.reuse, *([Phase.shrink] if shrink else [])], 1000)


def found_of(spec: MachineSpec, e: BaseException) -> Found:
    notes = list(getattr(e, "__notes__", []))
    program = getattr(e, "program", None) or spec.program(notes)
    if isinstance(e, PropertyFailure):
        return Found(e.name, "crash" if isinstance(e, TargetCrash) else "violation", e.message, program)
    return Found("crash", "error", f"{type(e).__name__}: {e}", program)


def attempt(spec: MachineSpec, cls: type[RuleBasedStateMachine], s: settings) -> Found | None:
    """Run once; the failure it raised, or None. Hypothesis' own report is silenced (notes keep the program).

    Not seeded: Hypothesis neither reads nor writes the database of a test run with ``@seed``.
    """
    test: Any = get_state_machine_test(cls, settings=s)  # type: ignore[no-untyped-call]
    try:
        with with_reporter(lambda _msg: None):
            test()
    except (KeyboardInterrupt, SystemExit):
        raise
    except Unsatisfiable:
        return None  # every example was rejected (a saved one that no longer applies): nothing failed
    except BaseException as e:
        return found_of(spec, e)
    return None


def _primary_keys(mem: InMemoryExampleDatabase) -> list[bytes]:
    return [k for k in mem.data if not k.endswith((b".secondary", b".pareto"))]


def _demote(mem: InMemoryExampleDatabase) -> None:
    """Move the failing example to the secondary key: Hypothesis shrinks what it replays from there
    (an example from the primary key counts as shrunk already)."""
    for key in _primary_keys(mem):
        for value in list(mem.fetch(key)):
            mem.move(key, key + b".secondary", value)


def _forget_failures(mem: InMemoryExampleDatabase) -> None:
    """Drop the failing examples (so the next run generates anew); keep the Pareto front."""
    for k in list(mem.data):
        if not k.endswith(b".pareto"):
            del mem.data[k]


def run_batch(
    spec: MachineSpec,
    plan: Plan,
    n: int,
    db: ExampleDatabase,
    mem: InMemoryExampleDatabase,
    known: Callable[[], set[str]] | None = None,
) -> RunResult:
    """``n`` examples of ``spec``; a new failure is shrunk, saved in ``db`` and recorded."""
    tally = Tally()
    base = spec.cls()
    cls = instrument(base, tally)
    reach: Counter[str] | None = getattr(base, "reach", None)
    if reach is not None:
        reach.clear()
    counted: Counter[str] | None = getattr(base, "reuse_counts", None)
    if counted is not None:
        counted.clear()
    t0 = time.perf_counter()
    found = attempt(spec, cls, run_settings(spec, mem, n, plan.target))
    result = RunResult(spec.name, 0, 0, Counter(), 0.0, {})
    if found is not None:
        recorded = known() if known is not None else {r.id for r in failures(db)}
        fid = failure_id(found.property, spec.name, found.message)
        if fid in recorded:
            result.duplicate = fid
        else:
            _demote(mem)
            shrunk = attempt(spec, cls, replay_settings(spec, mem, shrink=True)) or found
            fid = failure_id(shrunk.property, spec.name, shrunk.message)
            if fid in recorded:
                result.duplicate = fid
            else:
                for key in _primary_keys(mem):  # the shrunk example first, then the record
                    for value in list(mem.fetch(key)):
                        db.save(key, value)
                result.record = record(spec, plan, fid, shrunk)
                save_failure(db, result.record)
        _forget_failures(mem)
    result.examples, result.rules, result.steps = tally.examples, tally.rules, tally.steps
    result.seconds = time.perf_counter() - t0
    result.reach = dict(reach) if reach is not None else {}
    result.findings = dict(counted) if counted is not None else {}
    return result


def record(spec: MachineSpec, plan: Plan, fid: str, f: Found) -> FailureRecord:
    return FailureRecord(
        id=fid,
        backend=spec.backend,
        machine=spec.name,
        property=f.property,
        kind=f.kind,
        message=f.message,
        program=f.program,
        semantics=plan.semantics,
        mutant=plan.mutant,
        found=datetime.now(UTC).isoformat(timespec="milliseconds"),
        where=f"{socket.gethostname()}:{os.getpid()}",
    )
