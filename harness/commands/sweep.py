"""``python -m harness sweep``: the SQLite-style allocation-failure sweep over canonical scenarios.

Every allocation point of every scenario of :mod:`faults.scenarios` fails once (``oom-transient``)
and from there on (``oom-persistent``); each trial id (``save-with-checkpoints.oom-transient.7``)
replays one trial with ``--case``. The runner is :mod:`faults.sweep`.
"""

from __future__ import annotations

import argparse
import json

from faults.kinds import Outcome
from faults.scenarios import SCENARIOS
from faults.sweep import SweepReport, TrialResult, parse_case_id, run_sweep, run_trial
from harness.commands.common import add_semantics, semantics_of
from harness.errors import UsageError

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_semantics(parser)
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


def _replay(args: argparse.Namespace, semantics: str) -> int:
    scenario, mode, nth = parse_case_id(args.case)
    r = run_trial(scenario, semantics, mode, nth)
    print(f"case {r.id} ({semantics}): {scenario.summary}")
    print(f"  fault {'fired at ' + ', '.join(r.sites) if r.fired else 'did not fire'}")
    print(f"  outcome: {r.outcome}: {r.detail}")
    if r.trace:
        print("  " + r.trace.rstrip().replace("\n", "\n  "))
    report = SweepReport(semantics, [r])
    if args.json:
        _write_json(args.json, report.to_json())
    if r.outcome == Outcome.CRASH_OUT_OF_SCOPE:
        print("  (outside PR #27451's handler: upstream terminates here in both semantics; not counted as a failure)")
    return report.exit_code()


def run(args: argparse.Namespace) -> int:
    semantics = semantics_of(args)
    if args.case:
        return _replay(args, semantics)
    modes = ["transient", "persistent"] if args.mode == "both" else [args.mode]
    scenarios = None
    if args.scenario:
        unknown = [s for s in args.scenario if s not in SCENARIOS]
        if unknown:
            raise UsageError(f"unknown scenario {unknown[0]!r}: choose one of {', '.join(SCENARIOS)}")
        scenarios = [SCENARIOS[s] for s in args.scenario]
    print(f"allocation-failure sweep, semantics {semantics}, modes {'+'.join(modes)}")
    report = run_sweep(semantics, modes, scenarios, progress=print)
    s = report.summary()
    for outcome, title in (
        (Outcome.CRASH, "crashes"),
        (Outcome.VIOLATION, "violations"),
        (Outcome.CRASH_OUT_OF_SCOPE, "crashes out of scope"),
    ):
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
    first = next((c for c in report.cases if c.outcome in (Outcome.CRASH, Outcome.VIOLATION)), None)
    if first is not None:
        print(f"replay: python -m harness sweep --semantics {semantics} --case {first.id}")
    return code
