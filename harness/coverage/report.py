"""The coverage report: ``coverage.json`` and the table ``python -m harness coverage`` prints.

``rows``: per workload and ``all`` (their counters merged), one row per function of the targets with lines and
branches reached of the total; ``totals`` their sums; ``unreached``: the blocks of lines no workload reached,
each with its reason; ``reasons``: blocks and lines per reason; ``untaken_branches``: the reached lines with a
branch outcome no workload took, each with its reason and whether a request could take it
(:mod:`harness.coverage.branches`); ``branch_reasons``: lines and branches per reason; ``workloads``: each one's
exit code and how many of its servers stopped cleanly (the others wrote no counters).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from harness.coverage.branches import UNEXPLAINED as BRANCH_UNEXPLAINED
from harness.coverage.functions import UNEXPLAINED
from harness.coverage.gcovr import CoverageRun, Row, function_rows, unreached_blocks, untaken_branches

__all__ = ["print_report", "write_report"]


def _totals(rows: list[Row]) -> dict[str, int]:
    keys = ("lines_reached", "lines_total", "branches_reached", "branches_total")
    return {k: sum(getattr(r, k) for r in rows) for k in keys}


def write_report(
    run: CoverageRun, docs: Mapping[str, Any], exits: Mapping[str, tuple[int, str]], path: Path
) -> dict[str, Any]:
    rows = {w: function_rows(run, doc) for w, doc in docs.items()}
    blocks = unreached_blocks(run, docs["all"])
    reasons: dict[str, dict[str, int]] = {}
    for b in blocks:
        r = reasons.setdefault(b.reason, {"blocks": 0, "lines": 0})
        r["blocks"] += 1
        r["lines"] += b.lines
    untaken = untaken_branches(run, docs["all"])
    by_reason: dict[str, dict[str, Any]] = {}
    for u in untaken:
        r2 = by_reason.setdefault(u.reason, {"lines": 0, "branches": 0, "reachable": u.reachable})
        r2["lines"] += 1
        r2["branches"] += u.untaken
    workloads = {}
    for w, (code, error) in exits.items():
        clean, lost = run.servers(w)
        workloads[w] = {"exit": code, "error": error, "servers_clean": clean, "servers_lost": lost}
    report = {
        "build": str(run.entry),
        "run": str(run.root),
        "workloads": workloads,
        "rows": {w: [r.as_dict() for r in rs] for w, rs in rows.items()},
        "totals": {w: _totals(rs) for w, rs in rows.items()},
        "unreached": [b.as_dict() for b in blocks],
        "reasons": dict(sorted(reasons.items(), key=lambda kv: -kv[1]["lines"])),
        "untaken_branches": [u.as_dict() for u in untaken],
        "branch_reasons": dict(sorted(by_reason.items(), key=lambda kv: -kv[1]["branches"])),
    }
    path.write_text(json.dumps(report, indent=1) + "\n")
    return report


def _cell(row: Mapping[str, Any] | None) -> str:
    if row is None:
        return f"{'-':>9} {'-':>9}"
    lines = f"{row['lines_reached']}/{row['lines_total']}"
    branches = f"{row['branches_reached']}/{row['branches_total']}"
    return f"{lines:>9} {branches:>9}"


def print_report(report: Mapping[str, Any], top: int = 15, out: Callable[[str], None] = print) -> None:
    """The table (function, lines and branches reached/total per workload and all), the servers that wrote no
    counters, the reasons, and the ``top`` largest unexplained blocks."""
    for w, info in report["workloads"].items():
        lost = info["servers_lost"]
        out(f"{w}: exit {info['exit']}; {info['servers_clean']} servers stopped cleanly"
            + (f"; {len(lost)} did not (exit {', '.join(lost)}): their counts are lost" if lost else ""))  # fmt: skip
    cols = [w for w in report["rows"] if w != "all"] + (["all"] if len(report["rows"]) > 2 else [])
    keyed = {w: {(r["target"], r["function"]): r for r in rs} for w, rs in report["rows"].items()}
    out(f"{'function':<52}" + "".join(f" {w + ' lines':>9} {'branches':>9}" for w in cols))
    for r in report["rows"]["all"]:
        key = (r["target"], r["function"])
        out(f"{r['function'][:52]:<52}" + "".join(" " + _cell(keyed[w].get(key)) for w in cols))
    out(f"{'total':<52}" + "".join(" " + _cell(report["totals"][w]) for w in cols))
    out("lines never reached, by reason:")
    for reason, n in report["reasons"].items():
        out(f"  {n['lines']:>5} lines in {n['blocks']:>3} blocks: {reason}")
    unexplained = sorted((b for b in report["unreached"] if b["reason"] == UNEXPLAINED), key=lambda b: -b["lines"])
    if unexplained:
        out(f"largest unexplained blocks ({len(unexplained)} in all):")
    for b in unexplained[:top]:
        first = next((s.strip() for s in b["text"].split("\n") if s.strip()), "")
        out(f"  {b['file']}:{b['first']}-{b['last']} {b['function']} ({b['lines']} lines): {first[:70]}")
    reasons = report.get("branch_reasons", {})
    if reasons:
        out("branch outcomes never taken on reached lines, by reason:")
    for reason, n in reasons.items():
        how = " [reachable: not yet sent]" if n["reachable"] else ""
        out(f"  {n['branches']:>5} outcomes on {n['lines']:>3} lines: {reason}{how}")
    lines = [u for u in report.get("untaken_branches", []) if u["reason"] == BRANCH_UNEXPLAINED]
    if lines:
        out(f"unexplained untaken branches ({len(lines)} lines; all in the JSON):")
    for u in sorted(lines, key=lambda u: -u["untaken"])[:top]:
        first = u["text"].split("\n")[0].strip()
        out(f"  {u['file']}:{u['line']} {u['function']} ({u['untaken']}/{u['total']}): {first[:70]}")
