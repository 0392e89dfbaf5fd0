"""What a campaign shows while it runs: a live table (rich) on a terminal, a line per interval otherwise.

Both views print a failure as soon as it is recorded (after it is in the database and the
report): the property, the machine, the message, the shrunk program and the one line that replays
it. The live view keeps one row per machine (examples/s, examples, steps, rules hit, faults that
fired, the cache pressure reached: evictions, transient peak above live bytes, holders of one
payload, checkpoints alive) and the failures so far; the plain view prints one summary line per
interval, for CI logs. Both end with the same summary: a row per machine and every failure. A campaign that
counts the C++ lines its servers reached (``coverage --run fuzz``) says ``lines 946/1856 (+14)`` in its status.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from typing import IO

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from harness.campaign.engine import CampaignState, MachineStat
from harness.campaign.store import FailureRecord

__all__ = ["LiveView", "PlainView", "summary_lines"]

Out = Callable[[str], None]
COLUMNS = ("machine", "ex/s", "examples", "steps", "rules", "faults", "evict", "peak B", "holders", "ckpts", "fail")


def _row(m: MachineStat) -> tuple[str, ...]:
    r = m.reach
    return (
        m.name,
        f"{m.rate:.1f}",
        str(m.examples),
        str(m.steps),
        f"{len(m.rules)}/{m.n_rules}" if m.n_rules else "-",
        str(r["faults_fired"]) if "faults_fired" in r else "-",
        str(r["evictions"]) if "evictions" in r else "-",
        str(r["transient_peak"]) if "transient_peak" in r else "-",
        str(r["shared_holders"]) if "shared_holders" in r else "-",
        str(r["checkpoints"]) if "checkpoints" in r else "-",
        str(len(m.failures)) + (f"+{m.duplicates}d" if m.duplicates else ""),
    )


def header(state: CampaignState) -> str:
    p = state.plan
    return (
        f"fuzz: backends={'+'.join(p.backends)} semantics={p.semantics}"
        + (f" mutant={p.mutant}" if p.mutant else "")
        + f" machines={len(state.machines)} workers={state.workers} budget={state.budget} "
        f"target={'on' if p.target else 'off'} db={state.db}"
    )


def status(state: CampaignState) -> str:
    ex, secs = state.total("examples"), state.elapsed
    return (
        f"[{secs:6.0f}s] {ex} examples ({ex / secs if secs else 0:.1f}/s), {state.total('steps')} steps, "
        f"{sum(1 for m in state.machines.values() if m.runs)}/{len(state.machines)} machines run; reached: "
        f"evictions {state.reach('evictions')}, peak {state.reach('transient_peak')} B, "
        f"holders {state.reach('shared_holders')}, checkpoints {state.reach('checkpoints')}, "
        f"faults {state.reach('faults_fired')}; failures {len(state.failures)}"
        + (f"; {state.lines.text()}" if state.lines is not None else "")
    )


def failure_lines(state: CampaignState, rec: FailureRecord) -> list[str]:
    return [
        f"FAILED {rec.property} ({rec.kind}) in {rec.machine} [{rec.id}]: {rec.message}",
        "--- shrunk program (paste into python from the repository root) ---",
        rec.program,
        "--- replay ---",
        rec.replay(state.db),
    ]


def summary_lines(state: CampaignState) -> list[str]:
    """The end of every campaign: per machine, what was replayed first, every new failure."""
    widths = [max(len(c), *(len(_row(m)[i]) for m in state.machines.values())) for i, c in enumerate(COLUMNS)]

    def fmt(cells: tuple[str, ...]) -> str:
        pairs = enumerate(zip(cells, widths, strict=True))
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in pairs)

    lines = [("interrupted: " if state.interrupted else "done: ") + status(state), "  " + fmt(COLUMNS)]
    lines += ["  " + fmt(_row(m)) for m in state.machines.values()]
    lines += [f"note: {n}" for n in state.notes]
    found = state.findings()
    for fid in sorted(k for k in found if ":" not in k):
        tokens = f", {found[fid + ':tokens']} tokens recomputed" if fid + ":tokens" in found else ""
        lines.append(f"known finding {fid}: {found[fid]} requests{tokens}")
    for v in state.replayed:
        lines.append(f"replayed first: [{v.verdict}] {v.record.id} {v.record.property} in {v.record.machine}")
    lines.append(f"new failures: {len(state.failures)}")
    lines += [f"  {r.id} {r.property} in {r.machine}: {r.message}\n    {r.replay(state.db)}" for r in state.failures]
    return lines


class PlainView:
    """A line per interval; failures and the summary as plain text (CI logs, pipes)."""

    def __init__(self, out: Out = print) -> None:
        self.out = out

    def start(self, state: CampaignState) -> None:
        self.out(header(state))

    def line(self, text: str) -> None:
        self.out(text)

    def update(self, state: CampaignState) -> None:
        self.out(status(state))

    def failure(self, state: CampaignState, record: FailureRecord) -> None:
        for line in failure_lines(state, record):
            self.out(line)

    def stop(self, state: CampaignState) -> None:
        for line in summary_lines(state):
            self.out(line)


class LiveView:
    """A rich live table on a terminal; failures printed above it as they come."""

    def __init__(self, file: IO[str] | None = None) -> None:
        self.console = Console(file=file or sys.stdout)
        self.live: Live | None = None

    def _render(self, state: CampaignState) -> Group:
        table = Table(title=status(state), title_justify="left", expand=False, show_edge=False, pad_edge=False)
        for i, c in enumerate(COLUMNS):
            table.add_column(c, justify="left" if i == 0 else "right", no_wrap=True)
        for m in state.machines.values():
            table.add_row(*_row(m), style="red" if m.failures else None)
        fails = [Text(f"{r.id} {r.property} in {r.machine}: {r.replay(state.db)}", style="red") for r in state.failures]
        return Group(table, *fails[-5:])

    def start(self, state: CampaignState) -> None:
        self.console.print(header(state), highlight=False)
        self.live = Live(self._render(state), console=self.console, refresh_per_second=2, transient=True)
        self.live.start()

    def line(self, text: str) -> None:
        self.console.print(text, highlight=False, markup=False)

    def update(self, state: CampaignState) -> None:
        if self.live is not None:
            self.live.update(self._render(state))

    def failure(self, state: CampaignState, record: FailureRecord) -> None:
        for line in failure_lines(state, record):
            self.console.print(line, highlight=False, markup=False)
        self.update(state)

    def stop(self, state: CampaignState) -> None:
        if self.live is not None:
            self.live.stop()
            self.live = None
        for line in summary_lines(state):
            self.console.print(line, highlight=False, markup=False)
