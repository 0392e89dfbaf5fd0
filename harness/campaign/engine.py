"""The campaign: worker processes over the machines of a plan, for a time or an example budget.

:func:`run_campaign` checks everything first (database, backends: one line and exit 2 on bad
input, before any work), replays every failure the database already holds (a campaign that joins
a shared database sees the others' failures first), then spawns ``workers`` processes through
:func:`harness.child.spawn`, machine ``i`` going to worker ``i % workers``, and follows their events
until the budget is spent.

Nothing found is lost: a worker saves the shrunk example and then the failure record in the
database before it sends the event; the campaign then rewrites the ``--json`` report, and only
then prints the failure. A kill -9 of the campaign loses nothing it printed (the workers die with
it: ``PR_SET_PDEATHSIG``). Ctrl-C (or SIGTERM) ends the campaign at any moment of its life
(:mod:`harness.interrupt`): every worker's process group is killed, the events they had already
written are read and the failures they had saved but not sent are taken from the database (a
failure still being shrunk is not saved yet, and is lost), then the summary is printed once with
what was found. A worker is recorded before a Ctrl-C can be raised; a second Ctrl-C kills every
worker and exits at once (130).

Run by ``python -m harness coverage --run fuzz`` (the server backend on the gcov build), a campaign also counts
the lines of the C++ under test its servers reached as progress (:class:`~harness.coverage.live.LineProbe`,
read at most every 30 s): in the status line, the summary and the JSON.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from hypothesis.database import ExampleDatabase

from harness.campaign.machines import Plan, check_ready, machines
from harness.campaign.replay import Verdict, replay_records
from harness.campaign.store import FailureRecord, failures, open_db
from harness.campaign.worker import EVENT
from harness.child import Spawned, read_lines, spawn
from harness.coverage.live import LineProbe
from harness.interrupt import guard, interrupted, shielded

__all__ = ["GRACE", "CampaignState", "MachineStat", "View", "run_campaign"]

GRACE = 120.0  # seconds a worker may go on past the deadline (finishing a shrink) before it is killed
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@dataclass
class MachineStat:
    name: str
    backend: str
    examples: int = 0
    steps: int = 0
    seconds: float = 0.0
    runs: int = 0
    rules: Counter[str] = field(default_factory=Counter)
    n_rules: int = 0
    reach: Counter[str] = field(default_factory=Counter)  # maxima over the campaign
    failures: list[str] = field(default_factory=list)
    duplicates: int = 0
    findings: Counter[str] = field(default_factory=Counter)  # known findings counted (RunResult.findings)

    @property
    def rate(self) -> float:
        return self.examples / self.seconds if self.seconds > 0 else 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "machine": self.name,
            "backend": self.backend,
            "examples": self.examples,
            "steps": self.steps,
            "seconds": round(self.seconds, 2),
            "examples_per_second": round(self.rate, 2),
            "runs": self.runs,
            "rules_hit": len(self.rules),
            "rules": self.n_rules,
            "rule_counts": dict(self.rules),
            "reach": dict(self.reach),
            "failures": self.failures,
            "duplicates": self.duplicates,
            "known_findings": dict(self.findings),
        }


@dataclass
class CampaignState:
    db: str
    plan: Plan
    workers: int
    budget: str
    machines: dict[str, MachineStat]
    started: float = field(default_factory=time.monotonic)
    failures: list[FailureRecord] = field(default_factory=list)  # new in this campaign
    replayed: list[Verdict] = field(default_factory=list)  # what the database held, replayed first
    notes: list[str] = field(default_factory=list)
    interrupted: bool = False
    broken_workers: int = 0  # workers that died or failed before finishing: a crash of the campaign
    # the C++ lines its servers reached, read at a bounded rate (a campaign run by ``coverage --run fuzz``)
    lines: LineProbe | None = None

    @property
    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def total(self, what: str) -> int:
        return sum(int(getattr(m, what)) for m in self.machines.values())

    def reach(self, label: str) -> int:
        return max((m.reach[label] for m in self.machines.values()), default=0)

    def findings(self) -> Counter[str]:
        """The known findings counted over every machine (``id`` requests, ``id:tokens`` tokens recomputed)."""
        out: Counter[str] = Counter()
        for m in self.machines.values():
            out.update(m.findings)
        return out

    def to_json(self) -> dict[str, Any]:
        return {
            "db": self.db,
            "plan": self.plan.to_json(),
            "workers": self.workers,
            "budget": self.budget,
            "seconds": round(self.elapsed, 1),
            "interrupted": self.interrupted,
            "broken_workers": self.broken_workers,
            "examples": self.total("examples"),
            "steps": self.total("steps"),
            "known_findings": dict(self.findings()),
            "machines": [m.to_json() for m in self.machines.values()],
            "failures": [{**asdict(r), "replay": r.replay(self.db)} for r in self.failures],
            "replayed": [v.to_json(self.db) for v in self.replayed],
            "notes": self.notes,
            **({"coverage": self.lines.to_json()} if self.lines is not None else {}),
        }


class View(Protocol):
    def start(self, state: CampaignState) -> None: ...
    def line(self, text: str) -> None: ...
    def update(self, state: CampaignState) -> None: ...
    def failure(self, state: CampaignState, record: FailureRecord) -> None: ...
    def stop(self, state: CampaignState) -> None: ...


def _write_json(path: str | None, state: CampaignState) -> None:
    """The report, replaced atomically (a kill between two writes leaves the previous one whole)."""
    if path is None:
        return
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(state.to_json(), f, indent=2)
    os.replace(tmp, path)


def run_campaign(
    plan: Plan,
    db_spec: str,
    view: View,
    *,
    workers: int = 2,
    minutes: float | None = None,
    examples: int | None = None,
    json_path: str | None = None,
    interval: float = 10.0,
) -> CampaignState:
    """Run the campaign; returns its state (``interrupted`` on Ctrl-C). Bad input raises before any work."""
    db = open_db(db_spec)
    check_ready(plan)
    specs = machines(plan)
    budget = f"{examples} examples per machine" if examples is not None else f"{minutes:g} minutes"
    stats = {s.name: MachineStat(s.name, s.backend) for s in specs}
    state = CampaignState(db_spec, plan, max(1, min(workers, len(specs))), budget, stats)
    state.lines = LineProbe.from_env()
    children: list[Spawned] = []
    with guard(), tempfile.TemporaryDirectory(prefix="fuzz-campaign-") as tmp:
        try:
            view.start(state)
            earlier = failures(db)
            if earlier:
                view.line(f"replaying the {len(earlier)} failure(s) the database holds first:")
                state.replayed = replay_records(db, earlier, view.line)
            deadline = None if minutes is None else time.time() + 60 * minutes
            _spawn(state, specs, db_spec, deadline, examples, tmp, children)
            _follow(state, children, view, deadline, json_path, interval)
        except KeyboardInterrupt:
            state.interrupted = True
        finally:
            with shielded(reraise=False):  # a first Ctrl-C now ends nothing early: cleanup, then the summary
                _stop(state, children, db, view, json_path)
                state.interrupted = state.interrupted or interrupted()
                view.stop(state)
    return state


def _stop(
    state: CampaignState, children: list[Spawned], db: ExampleDatabase, view: View, json_path: str | None
) -> None:
    """Kill the workers; after a Ctrl-C, what they wrote before they died and what they saved without telling."""
    for c in children:
        c.kill(close=False)
    if state.interrupted or interrupted() or state.broken_workers:
        for i, c in enumerate(children):
            for line in c.drain():
                if line.startswith(EVENT):
                    with contextlib.suppress(ValueError, KeyError, TypeError):
                        _event(state, i, json.loads(line[len(EVENT) :]), set(), view, json_path)
        _unreported(state, children, db, view, json_path)
    for c in children:
        c.kill()
    if state.lines is not None:  # the last servers' counters (written as they stopped) count too
        state.lines.read(state.elapsed, force=True)
    _write_json(json_path, state)


def _unreported(
    state: CampaignState, children: list[Spawned], db: ExampleDatabase, view: View, json_path: str | None
) -> None:
    """Failures a worker of this campaign saved in the database but was stopped before it sent."""
    ours = {f"{socket.gethostname()}:{c.pid}" for c in children}
    known = {r.id for r in state.failures} | {v.record.id for v in state.replayed}
    try:
        saved = failures(db)
    except Exception as e:  # a database gone away at the end: say so, the records stay where they are
        state.notes.append(f"could not read the database for failures saved but not reported: {e}")
        return
    for rec in saved:
        if rec.where in ours and rec.id not in known:
            state.failures.append(rec)
            if rec.machine in state.machines:
                state.machines[rec.machine].failures.append(rec.id)
            state.notes.append(f"{rec.id} was saved by a worker stopped before it reported it")
            _write_json(json_path, state)
            view.failure(state, rec)


def _spawn(
    state: CampaignState,
    specs: list[Any],
    db_spec: str,
    deadline: float | None,
    examples: int | None,
    tmp: str,
    children: list[Spawned],
) -> None:
    """Start the workers into ``children``, each one in it before a Ctrl-C can be raised."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    for i in range(state.workers):
        job = {
            "plan": state.plan.to_json(),
            "db": db_spec,
            "machines": [s.name for j, s in enumerate(specs) if j % state.workers == i],
            "deadline": deadline,
            "examples": examples,
            "worker": i,
        }
        argv = [sys.executable, "-m", "harness.campaign.worker", json.dumps(job)]
        with shielded():
            children.append(spawn(argv, stderr_path=os.path.join(tmp, f"worker-{i}.stderr"), env=env))


def _follow(
    state: CampaignState,
    children: list[Spawned],
    view: View,
    deadline: float | None,
    json_path: str | None,
    interval: float,
) -> None:
    done: set[int] = set()
    next_view = time.monotonic() + interval
    while not all(c.eof for c in children):
        if deadline is not None and time.time() > deadline + GRACE:
            state.notes.append(f"workers still busy {GRACE:.0f}s after the deadline were stopped")
            view.line(state.notes[-1])
            break
        for child, line in read_lines(children, max(0.05, min(1.0, next_view - time.monotonic()))):
            if line.startswith(EVENT):
                with shielded():  # the report and the failure's lines whole, then the Ctrl-C
                    _event(state, children.index(child), json.loads(line[len(EVENT) :]), done, view, json_path)
        if time.monotonic() >= next_view:
            if state.lines is not None:
                state.lines.read(state.elapsed)  # at most every READ_SECONDS, and only on new counters
            view.update(state)
            next_view = time.monotonic() + interval
    for i, c in enumerate(children):
        with contextlib.suppress(Exception):
            c.proc.wait(timeout=10)
        if i not in done:
            state.broken_workers += 1
            state.notes.append(f"worker {i} ended without finishing ({_how(c)}): {c.stderr_tail() or 'no stderr'}")
            view.line(state.notes[-1])
    view.update(state)


def _how(c: Spawned) -> str:
    rc = c.poll()
    if rc is None:
        return "still running"
    return f"killed by {signal.Signals(-rc).name}" if rc < 0 else f"exit {rc}"


def _event(
    state: CampaignState, worker: int, ev: dict[str, Any], done: set[int], view: View, json_path: str | None
) -> None:
    if ev["event"] == "done":
        done.add(worker)
        return
    if ev["event"] != "run":
        return
    m = state.machines[ev["machine"]]
    m.runs += 1
    m.examples += ev["examples"]
    m.steps += ev["steps"]
    m.seconds += ev["seconds"]
    m.rules.update(ev["rules"])
    m.n_rules = ev["n_rules"]
    for k, v in ev["reach"].items():
        m.reach[k] = max(m.reach[k], v)
    if ev.get("duplicate"):
        m.duplicates += 1
    m.findings.update(ev.get("findings") or {})
    raw = ev.get("record")
    if raw is not None:
        rec = FailureRecord(**raw)
        if rec.id in {r.id for r in state.failures}:
            m.duplicates += 1
            return
        m.failures.append(rec.id)
        state.failures.append(rec)
        _write_json(json_path, state)  # in the database already (the worker), now the report, then print
        view.failure(state, rec)


Emit = Callable[[str], None]
