"""The bench's framework: cases, figures with their inputs and spread, goals, the table, the comparison.

A *case* (:class:`Case`, registered in :data:`CASES` by :mod:`harness.bench.cases`) is a
function of a :class:`Budget` that returns :class:`Figure` objects. A figure is one number measured
``reps`` times: its samples give ``min``/``median``/``max``, its ``inputs`` say what was measured (seed,
sizes, examples, repetitions...), and an optional :class:`Goal` says what it should be
(``>= 0.80``, ``<= 60 s``). :func:`run_bench` runs the chosen cases and returns the JSON document
(commit, machine, load before and after, every case's figures); :func:`table` renders it as markdown
(``docs/bench.md``) and for the terminal; :func:`compare` sets a run against an earlier one.

Noise and regressions: two runs of the same figure are compared by their medians, in the figure's
direction (``higher`` is better for rates and ratios, ``lower`` for times). A figure is a regression
when it is worse by more than the noise measured, the larger relative spread ``(max - min) / median``
of the two runs, and never by less than :data:`MIN_NOISE` (a figure measured once has no spread of its
own, unless it declares one: ``noise``, as a statistic over repetitions does). A ratio of two speeds
measured side by side (interleaved) is much steadier on a loaded host than either speed: the goals
are ratios wherever the issue allows.
"""

from __future__ import annotations

import json
import os
import platform
import statistics
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from harness.errors import UsageError

__all__ = [
    "CASES",
    "MIN_NOISE",
    "Budget",
    "Case",
    "Figure",
    "Goal",
    "case_names",
    "compare",
    "cpu_model",
    "figure",
    "load_json",
    "register",
    "run_bench",
    "table",
]

MIN_NOISE = 0.10  # a change of less than 10% is never called a regression


@dataclass(frozen=True)
class Goal:
    """``value OP threshold``: ``op`` is ``">="`` or ``"<="``. The median must meet it, or with ``every``
    each sample (a figure whose samples are seeds, not repetitions: no seed may miss)."""

    op: str
    threshold: float
    every: bool = False

    def met(self, value: float) -> bool:
        return value >= self.threshold if self.op == ">=" else value <= self.threshold

    def met_by(self, samples: Sequence[float]) -> bool:
        """Whether a figure of these samples meets the goal: its median, or with ``every`` each sample."""
        return all(map(self.met, samples)) if self.every else self.met(statistics.median(samples))


@dataclass
class Figure:
    """One measured number: its samples (one per repetition), unit, direction, inputs and goal."""

    name: str
    unit: str
    samples: list[float]
    better: str = "higher"  # "higher" | "lower": which way is an improvement
    inputs: dict[str, Any] = field(default_factory=dict)
    goal: Goal | None = None
    note: str = ""
    noise: float | None = None  # declared by a one-sample figure derived from repetitions (see compare)

    @property
    def median(self) -> float:
        return statistics.median(self.samples)

    @property
    def spread(self) -> float:
        """The noise of this figure in this run: its declared ``noise``, else (max - min) / median (0 for
        one sample)."""
        if self.noise is not None:
            return self.noise
        m = self.median
        return (max(self.samples) - min(self.samples)) / abs(m) if m else 0.0

    def row(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "name": self.name,
            "unit": self.unit,
            "better": self.better,
            "min": min(self.samples),
            "median": self.median,
            "max": max(self.samples),
            "samples": list(self.samples),
            "repetitions": len(self.samples),
            "inputs": self.inputs,
        }
        if self.goal is not None:
            out["goal"] = {"op": self.goal.op, "threshold": self.goal.threshold, "met": self.goal.met_by(self.samples)}
            if self.goal.every:
                out["goal"]["every"] = True
        if self.note:
            out["note"] = self.note
        if self.noise is not None:
            out["noise"] = round(self.noise, 4)
        return out


def figure(
    name: str,
    unit: str,
    samples: Iterable[float],
    *,
    better: str = "higher",
    goal: tuple[str, float] | tuple[str, float, bool] | None = None,
    note: str = "",
    noise: float | None = None,
    **inputs: Any,
) -> Figure:
    """A :class:`Figure`; ``goal=(">=", 0.8)``, or ``(">=", 0.8, True)`` for every sample; keyword arguments
    are its inputs."""
    values = [float(v) for v in samples]
    if not values:
        raise ValueError(f"figure {name!r} has no samples")
    return Figure(name, unit, values, better, dict(inputs), Goal(*goal) if goal else None, note, noise)


@dataclass(frozen=True)
class Budget:
    """How much a run may spend: ``quick`` is the tiny budget of the test; ``seed`` for every case."""

    quick: bool = False
    seed: int = 0
    out: Callable[[str], None] = print
    repetitions: int | None = None  # --reps: every case's repetitions (each case has its own default)

    def reps(self, full: int) -> int:
        return 1 if self.quick else self.repetitions or full


@dataclass(frozen=True)
class Case:
    name: str
    title: str
    fn: Callable[[Budget], list[Figure]]
    full_only: bool = False  # skipped by --quick (too long for a tiny budget whatever its settings)
    named_only: bool = False  # runs only when named (--only NAME): longer than the rest of the bench


CASES: dict[str, Case] = {}


def register(
    name: str, title: str, *, full_only: bool = False, named_only: bool = False
) -> Callable[[Callable[[Budget], list[Figure]]], Any]:
    """Decorator: register a case function under ``name`` (the ``--only`` word)."""

    def deco(fn: Callable[[Budget], list[Figure]]) -> Callable[[Budget], list[Figure]]:
        if name in CASES:
            raise ValueError(f"bench case {name!r} registered twice")
        CASES[name] = Case(name, title, fn, full_only, named_only)
        return fn

    return deco


def _loadavg() -> list[float]:
    try:
        return [round(x, 2) for x in os.getloadavg()]
    except OSError:
        return []


def cpu_model() -> str:
    """The CPU's model name (Linux's /proc/cpuinfo), or what ``platform`` knows: ratios of speeds depend
    on it, so :func:`compare` sets only runs of one CPU against each other."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name" and value.strip():
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def case_names(only: Sequence[str] | None) -> list[str]:
    """The cases a run takes: ``only`` (checked), or every case but those that run only when named."""
    names = list(only) if only else [n for n, c in CASES.items() if not c.named_only]
    unknown = [n for n in names if n not in CASES]
    if unknown:
        raise UsageError(f"unknown bench case(s) {', '.join(unknown)}; choose from {', '.join(CASES)}")
    return names


def run_bench(
    commit: str,
    only: Sequence[str] | None = None,
    *,
    quick: bool = False,
    seed: int = 0,
    reps: int | None = None,
    out: Callable[[str], None] = print,
) -> dict[str, Any]:
    """Run the cases (all, or ``only``) and return the JSON document; a case that fails is recorded
    with its error and the others still run."""
    names = case_names(only)
    budget = Budget(quick=quick, seed=seed, out=out, repetitions=reps)
    doc: dict[str, Any] = {
        "commit": commit,
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "quick": quick,
        "seed": seed,
        "reps": reps,
        "machine": {
            "cpus": os.cpu_count(),
            "cpu": cpu_model(),
            "python": platform.python_version(),
            "platform": platform.platform(),
            "loadavg_start": _loadavg(),
        },
        "cases": {},
    }
    for name in names:
        case = CASES[name]
        if quick and case.full_only:
            doc["cases"][name] = {"title": case.title, "skipped": "full bench only (not --quick)", "figures": []}
            out(f"[{name}] skipped: full bench only")
            continue
        out(f"[{name}] {case.title}")
        t0 = time.perf_counter()
        entry: dict[str, Any] = {"title": case.title, "figures": []}
        try:
            entry["figures"] = [f.row() for f in case.fn(budget)]
        except UsageError as e:  # a missing prerequisite (no server build...): recorded, the rest runs
            entry["error"] = str(e)
            out(f"  error: {e}")
        entry["seconds"] = round(time.perf_counter() - t0, 2)
        doc["cases"][name] = entry
    doc["machine"]["loadavg_end"] = _loadavg()
    return doc


def load_json(path: str) -> dict[str, Any]:
    try:
        with open(path) as f:
            doc = json.load(f)
    except OSError as e:
        raise UsageError(f"cannot read {path}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"{path} is not JSON: {e}") from None
    if not isinstance(doc, dict) or not isinstance(doc.get("cases"), dict):
        raise UsageError(f"{path} is not a bench JSON (no 'cases' object)")
    return doc


def _fmt(v: float) -> str:
    if v == 0:
        return "0"
    if abs(v) >= 1000:
        return f"{v:,.0f}"
    if abs(v) >= 10:
        return f"{v:.1f}"
    return f"{v:.3g}"


def _rows(doc: dict[str, Any]) -> Iterable[tuple[str, dict[str, Any]]]:
    for cname, entry in doc["cases"].items():
        for f in entry.get("figures", []):
            yield cname, f


def table(doc: dict[str, Any], *, markdown: bool) -> str:
    """The figures as a table: case, figure, median, min..max, reps, goal, met/missed."""
    head = ["case", "figure", "median", "min .. max", "reps", "goal", "status"]
    lines: list[list[str]] = []
    for cname, f in _rows(doc):
        g = f.get("goal")
        status = "" if g is None else ("met" if g["met"] else "MISSED")
        goal = "" if g is None else f"{g['op']} {_fmt(g['threshold'])}{' each' if g.get('every') else ''}"
        lines.append(
            [
                cname,
                f["name"],
                f"{_fmt(f['median'])} {f['unit']}",
                f"{_fmt(f['min'])} .. {_fmt(f['max'])}",
                str(f["repetitions"]),
                goal,
                status,
            ]
        )
    for cname, entry in doc["cases"].items():
        for key in ("error", "skipped"):
            if key in entry:
                lines.append([cname, key, "", "", "", "", entry[key]])
    if markdown:
        out = ["| " + " | ".join(head) + " |", "|" + "|".join("---" for _ in head) + "|"]
        out += ["| " + " | ".join(c.replace("|", "\\|") for c in line) + " |" for line in lines]
        return "\n".join(out)
    widths = [max(len(r[i]) for r in [head, *lines]) for i in range(len(head))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in [head, *lines])


def compare(old: dict[str, Any], new: dict[str, Any]) -> tuple[list[str], list[str]]:
    """Lines comparing ``new`` with ``old`` figure by figure, and the names of the regressions.

    ratio = new / old in the figure's better direction (> 1 is better); a regression is worse than
    ``1 - noise`` where noise is the larger spread of the two runs (a figure's declared ``noise`` where it
    has one), at least :data:`MIN_NOISE`.

    Runs on different CPUs (``machine.cpu`` of both, where both name one) are compared line by line but
    call nothing a regression: a ratio of two speeds depends on the CPU itself. The same commit's np3
    exploration ratio read 0.77 on one host of this kind and 0.83 on another (an AMD EPYC), each with a
    spread of about 0.02 over five repetitions.
    """
    before = {(c, f["name"]): f for c, f in _rows(old)}
    cpus = (old.get("machine", {}).get("cpu"), new.get("machine", {}).get("cpu"))
    other_cpu = None not in cpus and cpus[0] != cpus[1]
    lines: list[str] = []
    if other_cpu:
        lines.append(f"  the runs ran on different CPUs ({cpus[0]!r}, then {cpus[1]!r}): none is called a regression")
    regressions: list[str] = []
    for cname, f in _rows(new):
        o = before.get((cname, f["name"]))
        if o is None or not o["median"] or not f["median"]:
            continue
        ratio = f["median"] / o["median"] if f["better"] == "higher" else o["median"] / f["median"]
        noise = max(MIN_NOISE, *(x.get("noise", (x["max"] - x["min"]) / abs(x["median"])) for x in (f, o)))
        worse = ratio < 1 - noise
        key = f"{cname}/{f['name']}"
        mark = "REGRESSION" if worse else ("better" if ratio > 1 + noise else "same")
        if other_cpu and worse:
            mark = "worse (another CPU)"
        lines.append(
            f"  {key:<48} {_fmt(o['median']):>10} -> {_fmt(f['median']):>10} {f['unit']:<10} "
            f"x{ratio:.2f} (noise {noise:.0%}) {mark}"
        )
        if worse and not other_cpu:
            regressions.append(key)
    return lines, regressions
