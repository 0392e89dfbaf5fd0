"""A campaign's worker process: ``python -m harness.campaign.worker JOB`` (started by the engine).

``JOB`` is JSON: the plan, the database, the machine names this worker owns, the deadline (epoch
seconds) or the examples per machine and the worker's index. The worker runs
its machines round-robin until the budget is spent, each run about
:data:`~harness.campaign.machines.RUN_SECONDS` long, and writes one event per line on stdout
(``@@`` then JSON): ``start``, ``run`` (counts and reach of one run; a new failure's record, already
saved in the database, or the id of a duplicate), ``done``. Anything else on stdout is not an
event. It keeps going after a failure. It dies with the campaign (``PR_SET_PDEATHSIG``).
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from dataclasses import asdict
from typing import Any

from hypothesis.database import InMemoryExampleDatabase

from harness.campaign.machines import RUN_SECONDS, Plan, machines
from harness.campaign.runner import rule_names, run_batch
from harness.campaign.store import failures, open_db
from harness.child import child_setup

__all__ = ["EVENT", "main"]

EVENT = "@@ "
KNOWN_REFRESH = 5.0  # seconds between reads of the recorded failures (another campaign may add some)


def emit(kind: str, **data: Any) -> None:
    sys.stdout.write(EVENT + json.dumps({"event": kind, **data}) + "\n")
    sys.stdout.flush()


def main(argv: list[str]) -> int:
    job = json.loads(argv[0])
    child_setup(watchdog=False)
    plan = Plan.from_json(job["plan"])
    db = open_db(job["db"])
    specs = {s.name: s for s in machines(plan)}
    mine = [specs[n] for n in job["machines"]]
    deadline: float | None = job.get("deadline")
    budget: int | None = job.get("examples")
    mems = {s.name: InMemoryExampleDatabase() for s in mine}
    batch = {s.name: s.batch for s in mine}
    done: Counter[str] = Counter()
    known: set[str] = set()
    known_at = 0.0

    def recorded() -> set[str]:
        nonlocal known, known_at
        if time.monotonic() - known_at > KNOWN_REFRESH:
            known = {r.id for r in failures(db)}
            known_at = time.monotonic()
        return known

    emit("start", worker=job["worker"], machines=[s.name for s in mine])
    active = list(mine)
    while active and (deadline is None or time.time() < deadline):
        for spec in list(active):
            if deadline is not None and time.time() >= deadline:
                break
            n = batch[spec.name]
            if budget is not None:
                n = min(n, budget - done[spec.name])
                if n <= 0:
                    active.remove(spec)
                    continue
            r = run_batch(spec, plan, n, db, mems[spec.name], recorded)
            done[spec.name] += max(r.examples, 1)
            if r.record is not None:
                known.add(r.record.id)
            if r.seconds > 0 and r.record is None and r.duplicate is None:
                batch[spec.name] = max(1, min(2000, round(n * RUN_SECONDS / r.seconds)))
            emit(
                "run",
                machine=r.machine,
                backend=spec.backend,
                examples=r.examples,
                steps=r.steps,
                rules=dict(r.rules),
                n_rules=len(rule_names(spec.cls())),
                seconds=round(r.seconds, 4),
                reach=r.reach,
                findings=r.findings,
                record=None if r.record is None else asdict(r.record),
                duplicate=r.duplicate,
            )
    emit("done", worker=job["worker"])
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
