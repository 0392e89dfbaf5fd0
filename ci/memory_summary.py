"""The memory report of a server gate run: ``python -m ci.memory_summary GATE_SERVER_JSON OUT_DIR``.

Writes ``memory.json`` (the server section's memory figures: the RSS high-water mark of one save
against the model's prediction, per build, and the native fault trials) and ``memory.md`` (the
same as a table for a CI summary). Exit 2 when the gate's JSON is missing or unreadable.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any


def summary(gate: dict[str, Any]) -> dict[str, Any]:
    server = gate.get("server") or {}
    return {
        "build": server.get("build"),
        "semantics": server.get("semantics") or gate.get("semantics"),
        "pinned": server.get("pinned"),
        "commit": gate.get("commit"),
        "save_peak": server.get("memory", {}),
        "rss_ratio_master_over_pr": server.get("rss_ratio_master_over_pr"),
        "fault_trials": server.get("faults", []),
        "passed": gate.get("passed"),
    }


def markdown(s: dict[str, Any]) -> str:
    lines = [
        f"# Prompt-cache memory: {s['build']} ({s['semantics']} semantics)",
        "",
        "| build | checkpoints | C (bytes) | S (bytes) | RSS peak of one save | model's prediction |",
        "|---|---|---|---|---|---|",
    ]
    for name, m in s["save_peak"].items():
        lines.append(
            f"| {name} | {m.get('n_checkpoints')} | {m.get('checkpoint_bytes')} | {m.get('state_bytes')} "
            f"| {m.get('rss_peak_bytes')} | {m.get('model_peak_bytes')} |"
        )
    if s["rss_ratio_master_over_pr"] is not None:
        lines += ["", f"master/pr RSS peak ratio: {s['rss_ratio_master_over_pr']}"]
    if s["fault_trials"]:
        lines += [
            "",
            "| large allocation # of a save | model | server | observed site (where the allocation failed) | detail |",
            "|---|---|---|---|---|",
        ]
        for t in s["fault_trials"]:
            lines.append(
                f"| {t.get('nth')} | {t.get('predicted')} at {t.get('predicted_site')} | {t.get('observed')} "
                f"| {t.get('observed_site', '?')} | {t.get('detail')} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str]) -> int:
    if len(argv) != 2:
        print("usage: python -m ci.memory_summary GATE_SERVER_JSON OUT_DIR", file=sys.stderr)
        return 2
    src, out = Path(argv[0]), Path(argv[1])
    try:
        gate = json.loads(src.read_text())
    except (OSError, ValueError) as e:
        print(f"memory_summary: cannot read {src}: {e}", file=sys.stderr)
        return 2
    s = summary(gate)
    out.mkdir(parents=True, exist_ok=True)
    (out / "memory.json").write_text(json.dumps(s, indent=2) + "\n")
    (out / "memory.md").write_text(markdown(s))
    print(f"memory_summary: wrote {out / 'memory.json'} and {out / 'memory.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
