"""Replaying the failures a database holds: each one's program and verdict.

For every :class:`~harness.campaign.store.FailureRecord` the machine it names is rebuilt (its
backend, semantics and mutant come from the record) and run on the saved examples only
(Hypothesis' ``reuse`` phase, no generation, no shrinking) against a read-only view of the
database, so replaying never changes what is saved. Verdicts:

``still failing``        the saved example fails with the same signature (the record's id);
``failing differently``  it fails, with another property or message (the new one is printed);
``fixed``                the saved examples pass;
``no saved example``     the database holds the record but no example for its machine;
``not replayed``         the machine cannot run here (its backend's build or model is missing,
                         or this version of the harness has no machine of that name).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from hypothesis.database import ExampleDatabase, ReadOnlyDatabase

from harness.campaign.machines import MachineSpec, Plan, check_ready, machines
from harness.campaign.runner import Tally, attempt, instrument, replay_settings
from harness.campaign.store import FailureRecord, failure_id
from harness.errors import HarnessError

__all__ = ["FAILING", "Verdict", "replay_records"]

FAILING = ("still failing", "failing differently")


@dataclass
class Verdict:
    record: FailureRecord
    verdict: str
    detail: str  # what failed now (failing differently), or why not replayed
    program: str  # the program as it runs now (failing), else the recorded one

    @property
    def failing(self) -> bool:
        return self.verdict in FAILING

    def to_json(self, db: str) -> dict[str, Any]:
        return {
            "id": self.record.id,
            "machine": self.record.machine,
            "property": self.record.property,
            "message": self.record.message,
            "verdict": self.verdict,
            "detail": self.detail,
            "program": self.program,
            "replay": self.record.replay(db),
        }


def _specs(record: FailureRecord, cache: dict[Plan, dict[str, MachineSpec] | str]) -> dict[str, MachineSpec] | str:
    plan = Plan((record.backend,), record.semantics, record.mutant)
    if plan not in cache:
        try:
            check_ready(plan)
            cache[plan] = {s.name: s for s in machines(plan)}
        except HarnessError as e:
            cache[plan] = str(e)
    return cache[plan]


def replay_one(db: ExampleDatabase, record: FailureRecord, specs: dict[str, MachineSpec] | str) -> Verdict:
    if isinstance(specs, str):
        return Verdict(record, "not replayed", specs, record.program)
    spec = specs.get(record.machine)
    if spec is None:
        return Verdict(record, "not replayed", f"no machine {record.machine} in this harness", record.program)
    tally = Tally()
    found = attempt(spec, instrument(spec.cls(), tally), replay_settings(spec, ReadOnlyDatabase(db), shrink=False))
    if found is None:
        verdict = "fixed" if tally.examples else "no saved example"
        return Verdict(record, verdict, "", record.program)
    if failure_id(found.property, spec.name, found.message) == record.id:
        return Verdict(record, "still failing", "", found.program)
    return Verdict(record, "failing differently", f"[{found.property}] {found.message}", found.program)


def replay_records(db: ExampleDatabase, records: list[FailureRecord], out: Callable[[str], None]) -> list[Verdict]:
    """Replay ``records`` in order, printing each one's verdict and program as it is known."""
    cache: dict[Plan, dict[str, MachineSpec] | str] = {}
    verdicts = []
    for r in records:
        v = replay_one(db, r, _specs(r, cache))
        verdicts.append(v)
        out(f"  [{v.verdict}] {r.id} {r.property} in {r.machine}: {r.message}")
        out(f"    ({r.backend}, found {r.found} by {r.where})")
        if v.detail:
            out(f"    now: {v.detail}")
        out("    " + v.program.replace("\n", "\n    "))
    return verdicts
