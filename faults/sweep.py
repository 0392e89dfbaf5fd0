"""``python -m harness sweep``: fail allocation 1, 2, 3, ... of every canonical scenario.

In the manner of SQLite's malloc tests: for each scenario of :mod:`faults.scenarios` and each mode
(``oom-transient``: only allocation ``nth`` fails; ``oom-persistent``: ``nth`` and every later one
fail), build the scenario afresh, arm the model's allocation seam at ``nth``, run the act, and
classify the trial; then ``nth + 1``, until a trial completes with no fault fired. The number of
trials in which a fault fired is the number of allocation points swept.

Each trial is judged in this order, and the first failure decides its outcome:

1. the act under :class:`properties.invariants.Tracer` (post-conditions, ``no_partial_entries``
   among them; ``transient_peak`` only recorded, the sweep is about failures, not peaks);
2. an escaping exception: a ``BadAlloc`` is a ``crash`` when the scenario is inside the PR's
   contract and ``crash-out-of-scope`` otherwise; anything else is a ``crash``;
3. the scenario's check of the result (the right result, or a documented degraded one);
4. :func:`properties.invariants.check_state` against a shadow taken before the act;
5. :func:`properties.invariants.clear_all`: with every slot and the cache cleared no payload may be
   alive (no leak).

After a crash there is no result (step 3 is skipped) and step 4 describes a state upstream could
not observe (the process is gone): a violation there is noted in the detail only. Step 5 still
counts, since the model must unwind its temporaries as C++ stack unwinding would.

A case id ``SCENARIO.KIND.NTH`` (``save-with-checkpoints.oom-transient.7``) is a reproducer:
``python -m harness sweep --semantics S --case ID`` replays exactly that trial and prints its detail.

Pass criterion (exit 0): no ``violation`` and no ``crash``. ``crash-out-of-scope`` trials are
printed and counted separately: they are upstream's behaviour in both semantics, outside what PR
#27451 claims. Exit 3 if any trial crashed, else 1 if any violated.
"""

from __future__ import annotations

import traceback
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

from faults.kinds import Outcome
from faults.scenarios import SCENARIOS, Scenario, SemanticsLike
from harness.errors import EXIT_CRASH, EXIT_FAILED, EXIT_OK, BadAlloc, UsageError
from properties.invariants import Shadow, Tracer, Violation, check_state, clear_all

__all__ = [
    "MODES",
    "SweepReport",
    "TrialResult",
    "case_id",
    "parse_case_id",
    "run_sweep",
    "run_trial",
    "sweep_scenario",
]

# mode name on the command line -> fault kind in case ids
MODES: dict[str, str] = {"transient": "oom-transient", "persistent": "oom-persistent"}
_MAX_NTH = 10_000


@dataclass
class TrialResult:
    """One trial; serialises to the ``cases`` rows of ``--json``."""

    id: str
    scenario: str
    mode: str
    nth: int
    fired: bool
    outcome: Outcome
    detail: str
    sites: list[str] = field(default_factory=list)  # fired allocation sites
    invariant: str | None = None  # the Violation's name, when there is one
    trace: str = ""  # traceback of an escaping exception (not in --json)

    def row(self) -> dict[str, object]:
        d = asdict(self)
        del d["trace"]
        return d


def case_id(scenario: str, mode: str, nth: int) -> str:
    return f"{scenario}.{MODES[mode]}.{nth}"


def parse_case_id(text: str) -> tuple[Scenario, str, int]:
    """``SCENARIO.KIND.NTH`` -> (scenario, mode, nth); :class:`UsageError` when malformed."""
    parts = text.split(".")
    kinds = {v: k for k, v in MODES.items()}
    if len(parts) != 3 or parts[1] not in kinds or not parts[2].isdigit() or int(parts[2]) < 1:
        raise UsageError(f"bad case id {text!r}: expected SCENARIO.{{{','.join(kinds)}}}.N with N >= 1")
    if parts[0] not in SCENARIOS:
        raise UsageError(f"unknown scenario {parts[0]!r} in case id: choose one of {', '.join(SCENARIOS)}")
    return SCENARIOS[parts[0]], kinds[parts[1]], int(parts[2])


def run_trial(scenario: Scenario, semantics: SemanticsLike, mode: str, nth: int) -> TrialResult:
    """Build ``scenario`` for ``semantics``, fail allocation ``nth`` (``mode``), judge the trial."""
    prepared = scenario.build(semantics)
    server = prepared.server
    shadow = Shadow()
    check_state(server, shadow)  # the setup itself must be sound, and the shadow records it
    Tracer(server, strict_peak=False, shadow=shadow)
    seam = server.host.seam
    cid = case_id(scenario.name, mode, nth)

    def result(outcome: Outcome, detail: str, invariant: str | None = None, trace: str = "") -> TrialResult:
        fired = seam.fired > 0
        return TrialResult(
            cid, scenario.name, mode, nth, fired, outcome, detail, list(seam.fired_sites), invariant, trace
        )

    escaped: BaseException | None = None
    value: object = None
    seam.arm(nth, persistent=mode == "persistent", scope=scenario.scope)
    try:
        value = prepared.act()
    except Violation as v:
        seam.disarm()
        return result(Outcome.VIOLATION, str(v), v.name, traceback.format_exc())
    except Exception as e:
        escaped = e
    finally:
        seam.disarm()
    fired = seam.fired > 0

    if escaped is not None:
        trace = "".join(traceback.format_exception(escaped))
        if isinstance(escaped, BadAlloc):
            outcome: Outcome = Outcome.CRASH if scenario.in_pr_scope else Outcome.CRASH_OUT_OF_SCOPE
            where = "inside the PR's scope" if scenario.in_pr_scope else "outside any bad_alloc handler"
            detail = f"{escaped} escaped {where}: upstream terminates"
        else:
            outcome, detail = Outcome.CRASH, f"{type(escaped).__name__}: {escaped} escaped the target"
        try:
            check_state(server, shadow)
        except Violation as v:
            detail += f"; post-crash state (not observable upstream): {v}"
        try:
            clear_all(server)
        except Violation as v:
            return result(Outcome.VIOLATION, f"{detail}; leak after unwinding: {v}", v.name, trace)
        return result(outcome, detail, trace=trace)

    err = prepared.check(value, fired)
    if err is not None:
        return result(Outcome.VIOLATION, err, "result")
    try:
        check_state(server, shadow)
        clear_all(server)
    except Violation as v:
        return result(Outcome.VIOLATION, str(v), v.name, traceback.format_exc())
    if fired:
        return result(Outcome.ACCEPTED, f"bad_alloc at {', '.join(seam.fired_sites)} absorbed")
    return result(Outcome.OK, f"completed; {seam.count} allocation(s) counted")


def sweep_scenario(scenario: Scenario, semantics: SemanticsLike, mode: str) -> list[TrialResult]:
    """Trials ``nth = 1, 2, ...`` until one completes with no fault fired (that one included)."""
    out: list[TrialResult] = []
    for nth in range(1, _MAX_NTH + 1):
        r = run_trial(scenario, semantics, mode, nth)
        out.append(r)
        if not r.fired:
            return out
    raise RuntimeError(f"{scenario.name}: still failing allocations after {_MAX_NTH} trials")


@dataclass
class SweepReport:
    semantics: str
    cases: list[TrialResult]

    def count(self, outcome: Outcome) -> int:
        return sum(1 for c in self.cases if c.outcome == outcome)

    def summary(self) -> dict[str, int]:
        return {
            "trials": len(self.cases),
            "points": sum(1 for c in self.cases if c.fired),
            "violations": self.count(Outcome.VIOLATION),
            "crashes": self.count(Outcome.CRASH),
            "crashes_out_of_scope": self.count(Outcome.CRASH_OUT_OF_SCOPE),
            "partial_entries": sum(1 for c in self.cases if c.invariant == "no_partial_entries"),
            "accepted_errors": self.count(Outcome.ACCEPTED),
        }

    def exit_code(self) -> int:
        if self.count(Outcome.CRASH):
            return EXIT_CRASH
        return EXIT_FAILED if self.count(Outcome.VIOLATION) else EXIT_OK

    def to_json(self) -> dict[str, object]:
        return {"semantics": self.semantics, "variant": self.semantics,  # "variant": the old key, for one release
                "cases": [c.row() for c in self.cases], "summary": self.summary()}  # fmt: skip


def run_sweep(
    semantics: SemanticsLike,
    modes: Iterable[str] = ("transient", "persistent"),
    scenarios: Iterable[Scenario] | None = None,
    progress: Callable[[str], None] | None = None,
) -> SweepReport:
    """Sweep every allocation point of ``scenarios`` (all by default) in each of ``modes``."""
    modes = list(modes)
    cases: list[TrialResult] = []
    for sc in SCENARIOS.values() if scenarios is None else scenarios:
        per_mode = {m: sweep_scenario(sc, semantics, m) for m in modes}
        for trials in per_mode.values():
            cases.extend(trials)
        if progress is not None:
            pts = ", ".join(f"{m} {sum(t.fired for t in ts)}" for m, ts in per_mode.items())
            tally = Counter(t.outcome for ts in per_mode.values() for t in ts)
            outcomes = ", ".join(f"{tally[o]} {o}" for o in Outcome if tally[o])
            scope = f"scope={sc.scope or 'act'}{'' if sc.in_pr_scope else ', outside the PR'}"
            progress(f"  {sc.name:<26} points: {pts:<28} {outcomes}  [{scope}]")
    return SweepReport(str(semantics), cases)


# ---- command line ------------------------------------------------------------------------------
