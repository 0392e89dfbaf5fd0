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
``python -m harness sweep --variant V --case ID`` replays exactly that trial and prints its detail.

Pass criterion (exit 0): no ``violation`` and no ``crash``. ``crash-out-of-scope`` trials are
printed and counted separately: they are upstream's behaviour in both semantics, outside what PR
#27451 claims. Exit 3 if any trial crashed, else 1 if any violated.
"""

from __future__ import annotations

import argparse
import json
import traceback
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field

from harness.cli import EXIT_CRASH, EXIT_FAILED, EXIT_OK, UsageError
from harness.errors import BadAlloc
from properties.invariants import Shadow, Tracer, Violation, check_state, clear_all

from .kinds import ACCEPTED, CRASH, CRASH_OUT_OF_SCOPE, OK, VIOLATION, Outcome
from .scenarios import SCENARIOS, Scenario, Variant

__all__ = [
    "MODES",
    "SweepReport",
    "TrialResult",
    "add_arguments",
    "case_id",
    "parse_case_id",
    "run",
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


def run_trial(scenario: Scenario, variant: Variant, mode: str, nth: int) -> TrialResult:
    """Build ``scenario`` for ``variant``, fail allocation ``nth`` (``mode``), judge the trial."""
    prepared = scenario.build(variant)
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
        return result(VIOLATION, str(v), v.name, traceback.format_exc())
    except Exception as e:
        escaped = e
    finally:
        seam.disarm()
    fired = seam.fired > 0

    if escaped is not None:
        trace = "".join(traceback.format_exception(escaped))
        if isinstance(escaped, BadAlloc):
            outcome: Outcome = CRASH if scenario.in_pr_scope else CRASH_OUT_OF_SCOPE
            where = "inside the PR's scope" if scenario.in_pr_scope else "outside any bad_alloc handler"
            detail = f"{escaped} escaped {where}: upstream terminates"
        else:
            outcome, detail = CRASH, f"{type(escaped).__name__}: {escaped} escaped the target"
        try:
            check_state(server, shadow)
        except Violation as v:
            detail += f"; post-crash state (not observable upstream): {v}"
        try:
            clear_all(server)
        except Violation as v:
            return result(VIOLATION, f"{detail}; leak after unwinding: {v}", v.name, trace)
        return result(outcome, detail, trace=trace)

    err = prepared.check(value, fired)
    if err is not None:
        return result(VIOLATION, err, "result")
    try:
        check_state(server, shadow)
        clear_all(server)
    except Violation as v:
        return result(VIOLATION, str(v), v.name, traceback.format_exc())
    if fired:
        return result(ACCEPTED, f"bad_alloc at {', '.join(seam.fired_sites)} absorbed")
    return result(OK, f"completed; {seam.count} allocation(s) counted")


def sweep_scenario(scenario: Scenario, variant: Variant, mode: str) -> list[TrialResult]:
    """Trials ``nth = 1, 2, ...`` until one completes with no fault fired (that one included)."""
    out: list[TrialResult] = []
    for nth in range(1, _MAX_NTH + 1):
        r = run_trial(scenario, variant, mode, nth)
        out.append(r)
        if not r.fired:
            return out
    raise RuntimeError(f"{scenario.name}: still failing allocations after {_MAX_NTH} trials")


@dataclass
class SweepReport:
    variant: str
    cases: list[TrialResult]

    def count(self, outcome: str) -> int:
        return sum(1 for c in self.cases if c.outcome == outcome)

    def summary(self) -> dict[str, int]:
        return {
            "trials": len(self.cases),
            "points": sum(1 for c in self.cases if c.fired),
            "violations": self.count(VIOLATION),
            "crashes": self.count(CRASH),
            "crashes_out_of_scope": self.count(CRASH_OUT_OF_SCOPE),
            "partial_entries": sum(1 for c in self.cases if c.invariant == "no_partial_entries"),
            "accepted_errors": self.count(ACCEPTED),
        }

    def exit_code(self) -> int:
        if self.count(CRASH):
            return EXIT_CRASH
        return EXIT_FAILED if self.count(VIOLATION) else EXIT_OK

    def to_json(self) -> dict[str, object]:
        return {"variant": self.variant, "cases": [c.row() for c in self.cases], "summary": self.summary()}


def run_sweep(
    variant: Variant,
    modes: Iterable[str] = ("transient", "persistent"),
    scenarios: Iterable[Scenario] | None = None,
    progress: Callable[[str], None] | None = None,
) -> SweepReport:
    """Sweep every allocation point of ``scenarios`` (all by default) in each of ``modes``."""
    modes = list(modes)
    cases: list[TrialResult] = []
    for sc in SCENARIOS.values() if scenarios is None else scenarios:
        per_mode = {m: sweep_scenario(sc, variant, m) for m in modes}
        for trials in per_mode.values():
            cases.extend(trials)
        if progress is not None:
            pts = ", ".join(f"{m} {sum(t.fired for t in ts)}" for m, ts in per_mode.items())
            tally = Counter(t.outcome for ts in per_mode.values() for t in ts)
            outcomes = ", ".join(
                f"{tally[o]} {o}" for o in (OK, ACCEPTED, VIOLATION, CRASH, CRASH_OUT_OF_SCOPE) if tally[o]
            )
            scope = f"scope={sc.scope or 'act'}{'' if sc.in_pr_scope else ', outside the PR'}"
            progress(f"  {sc.name:<26} points: {pts:<28} {outcomes}  [{scope}]")
    return SweepReport(str(variant), cases)


# ---- command line ------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--variant", default="shared", choices=["shared", "master"], help="semantics (default shared)")
    parser.add_argument("--mode", default="both", choices=["transient", "persistent", "both"])
    parser.add_argument("--case", metavar="ID", help="replay one trial, e.g. save-with-checkpoints.oom-transient.7")
    parser.add_argument("--scenario", action="append", metavar="NAME", help="only this scenario (repeatable)")
    parser.add_argument("--json", metavar="PATH", help="write every trial and the summary as JSON")


def _write_json(path: str, data: dict[str, object]) -> None:
    try:
        with open(path, "w") as f:
            json.dump(data, f, indent=2)
            f.write("\n")
    except OSError as e:
        raise UsageError(f"cannot write {path}: {e.strerror}") from None


def _replay(args: argparse.Namespace) -> int:
    scenario, mode, nth = parse_case_id(args.case)
    r = run_trial(scenario, args.variant, mode, nth)
    print(f"case {r.id} ({args.variant}): {scenario.summary}")
    print(f"  fault {'fired at ' + ', '.join(r.sites) if r.fired else 'did not fire'}")
    print(f"  outcome: {r.outcome}: {r.detail}")
    if r.trace:
        print("  " + r.trace.rstrip().replace("\n", "\n  "))
    report = SweepReport(args.variant, [r])
    if args.json:
        _write_json(args.json, report.to_json())
    if r.outcome == CRASH_OUT_OF_SCOPE:
        print("  (outside PR #27451's handler: upstream terminates here in both semantics; not counted as a failure)")
    return report.exit_code()


def run(args: argparse.Namespace) -> int:
    if args.case:
        return _replay(args)
    modes = ["transient", "persistent"] if args.mode == "both" else [args.mode]
    scenarios = None
    if args.scenario:
        unknown = [s for s in args.scenario if s not in SCENARIOS]
        if unknown:
            raise UsageError(f"unknown scenario {unknown[0]!r}: choose one of {', '.join(SCENARIOS)}")
        scenarios = [SCENARIOS[s] for s in args.scenario]
    print(f"allocation-failure sweep, variant {args.variant}, modes {'+'.join(modes)}")
    report = run_sweep(args.variant, modes, scenarios, progress=print)
    s = report.summary()
    for title, outcome in (("crashes", CRASH), ("violations", VIOLATION), ("crashes out of scope", CRASH_OUT_OF_SCOPE)):
        rows = [c for c in report.cases if c.outcome == outcome]
        if rows:
            print(f"{title} ({len(rows)}), by first failing site (count, first case id):")
            by_site: dict[str, list[TrialResult]] = {}
            for c in rows:
                by_site.setdefault(c.sites[0] if c.sites else c.invariant or "-", []).append(c)
            for site, cs in by_site.items():
                print(f"  {site:<24} {len(cs):>3}  {cs[0].id}: {cs[0].detail}")
    print(
        f"swept {s['points']} allocation points in {s['trials']} trials: {s['violations']} violations, "
        f"{s['crashes']} crashes, {s['partial_entries']} partial entries, {s['accepted_errors']} accepted errors; "
        f"{s['crashes_out_of_scope']} crashes outside the PR's scope (upstream terminates there in both semantics)"
    )
    if args.json:
        _write_json(args.json, report.to_json())
    code = report.exit_code()
    first = next((c for c in report.cases if c.outcome in (CRASH, VIOLATION)), None)
    if first is not None:
        print(f"replay: python -m harness sweep --variant {args.variant} --case {first.id}")
    return code
