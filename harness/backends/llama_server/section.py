"""One server-backend run: its section of the gate report, how it files a failure, and what it says first.

:class:`ServerRun` holds the ``server`` section of the gate's report and files every failure of a run (a
model differential or a change differential) as a row with its request program and the replay line.
:func:`describe` says where a build comes from, :func:`hypothesis_settings` is the settings every server
machine runs under, and :func:`unflaked` opens Hypothesis' ``FlakyFailure`` to the failure a real server
showed once.
"""

from __future__ import annotations

import shlex
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, Phase, settings
from hypothesis.errors import FlakyFailure

from harness.backends.base import Failure, GateReport, MachineResult, Out
from harness.backends.llama_server.differential import (
    LIMIT_PROGRAMS,
    SERVER_PROFILES,
    ServerMismatch,
)
from harness.backends.llama_server.probe import agree_forms, probe
from harness.findings import GREEDY_FLIP_ON_CACHE_PATH, KnownRow
from harness.targets.llama_server import sanitizer_reports
from harness.trees.build import PINNED_COMMIT, ServerBuild, pinned_status
from harness.trees.tree import registry_spec
from properties.machine import MachineConfig

__all__ = ["NOT_OBSERVABLE", "ServerRun", "ServerSection", "describe", "hypothesis_settings", "unflaked"]


def hypothesis_settings(profile: str, max_examples: int | None) -> settings:
    sp = SERVER_PROFILES[profile]
    return settings(
        max_examples=max_examples or sp["max_examples"],
        stateful_step_count=sp["steps"],
        deadline=None,
        database=None,
        derandomize=False,
        suppress_health_check=list(HealthCheck),
        # each step is a real request on a real server: no Hypothesis shrinking; the printed program is
        # the full request sequence of the failing example (the change differential shrinks it itself)
        phases=[Phase.explicit, Phase.generate],
        print_blob=False,
    )


def unflaked(e: FlakyFailure, cls: type[ServerMismatch]) -> ServerMismatch | None:
    """The ``cls`` failure inside Hypothesis' ``FlakyFailure``: a real server answered one request of a program
    otherwise the first time than when Hypothesis ran the same program again to confirm it (timing: which slot
    was idle, when a save ran). None when it holds none (then it is re-raised as it is)."""
    for inner in e.exceptions:
        if isinstance(inner, cls):
            return inner
        if isinstance(inner, FlakyFailure):
            found = unflaked(inner, cls)
            if found is not None:
                return found
    return None


@dataclass
class ServerSection:
    """The server backend's part of the gate's JSON (``server``): its figures, filled as the run goes (the build,
    the requests and mismatches counted, the memory and fault figures, the concurrent step's ``concurrent``)."""

    figures: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"server": self.figures}


NOT_OBSERVABLE: dict[str, str] = {
    "immutability": "a checkpoint's payload bytes never leave the server: no answer, endpoint or log line shows them",
    "refcount": "who holds a checkpoint payload is the server's own pointers: neither /metrics nor the log counts them",
    "draft_in_step": "the draft context's memory is not exposed; answers show drafted tokens, not what it holds",
    "restore_bytes": "a restored state's bytes are not exposed over HTTP; restore_equivalence checks its answers",
    "reuse_equivalence": "the slot's memory after --cache-reuse moved chunks is not exposed, and its answers cannot "
    "stand for it: on a real model a moved KV cell keeps what it attended to, so they differ from a fresh "
    "evaluation by upstream's design (the reuse step counts them as moved_differs)",
    "draft_recovery": "the draft-KV recovery is a proposal from PR #27451's discussion that only the model carries: "
    "no llama-server build has it, so no request can turn it on (draft_recovery_run checks it on libllama)",
}
"""The properties no request to a real ``llama-server`` can show, and why: its table says ``not-observable`` for
them rather than leaving them unchecked (they are checked on the model and the libllama backend)."""


class ServerRun:
    """One server-backend run's report section, its output and how it files a failure."""

    def __init__(self, report: GateReport, build: ServerBuild, semantics: str, replay: str, out: Out,
                 pinned: bool, note: str = "") -> None:  # fmt: skip
        self.report, self.build, self.semantics, self.replay, self.out = report, build, semantics, replay, out
        self.pinned = pinned
        self.note = note  # appended to every failure message (a tree that is not the pinned one)
        self.first = True
        self.offered: set[str] = set()  # the history lines printed (one per failing check)
        self.section: dict[str, Any] = {
            "flavour": build.label,  # the old key of build_name, kept for one release (docs/mechanism.md)
            "build_name": build.label,
            "build": build.origin,
            "binary": str(build.binary),
            "semantics": semantics,
            "pinned": pinned,
            "requests": 0,
            "cache_n_mismatches": 0,
            "output_mismatches": 0,
            "request_failures": 0,
            "rss_peak_bytes": None,
            "fault_trials": 0,
            "server_crashes": 0,
            "near_tie_flips": 0,
            "evictions": 0,
            "cache_loads": 0,
            "sanitizer_reports": 0,
        }
        report.sections["server"] = ServerSection(self.section)
        report.not_observable.update(NOT_OBSERVABLE)

    def fail(self, prop: str, kind: str, message: str, program: str, machine: str) -> None:
        message += self.note
        if self.note and (line := bisect_line(self.build, machine, prop)) is not None and line not in self.offered:
            self.offered.add(line)  # not the pinned tree: where it came from, over upstream's history
            self.out(f"  where it came from: {line}")
        if self.note and self.first and program:
            self.out(f"  first divergence ({prop} in {machine}): {message}")
            self.out("  requests that replay it:\n    " + program.replace("\n", "\n    "))
        self.first = False
        f = Failure(prop, kind, message, program, self.replay, machine, program.count(".request("))
        self.report.machines.append(MachineResult(MachineConfig(self.semantics), 0.0, f, Counter(), Counter(), []))

    def mismatch(self, e: ServerMismatch, machine: str) -> None:
        """File a :class:`ServerMismatch` (a disagreement, or a request the server failed) under its property."""
        key = {"cache_n": "cache_n_mismatches", "output": "output_mismatches", "change": "changes"}.get(
            e.name, "request_failures"
        )
        self.section[key] = self.section.get(key, 0) + 1
        self.section["server_crashes"] += e.kind == "crash"
        self.fail(e.name, e.kind, e.message, e.program, machine)

    def passed(self, machine_seconds: float, checked: Counter[str]) -> None:
        self.report.machines.append(
            MachineResult(MachineConfig(self.semantics), machine_seconds, None, checked, Counter(), [])
        )

    def version(self, builds: list[ServerBuild]) -> None:
        """Probe every build's request form and make them agree (answers are compared across them)."""
        versions = [probe(b.binary, log=lambda m: self.out("  " + m)) for b in builds]
        agree_forms(versions)
        for b, v in zip(builds, versions, strict=True):
            self.out(f"  {b.label}: {v.line()}")
        self.section["versions"] = {b.label: {"build_info": v.build_info, "notes": list(v.notes)}
                                    for b, v in zip(builds, versions, strict=True)}  # fmt: skip

    def sanitizers(self, logs: str) -> None:
        reports = sanitizer_reports(logs)
        self.section["sanitizer_reports"] = len(reports)
        for r in reports[:5]:
            self.fail("sanitizer", "crash", r, "", "server-asan")
        if self.build.asan:
            status = "ok  " if not reports else "FAIL"
            self.out(f"  [{status}] sanitizers: {len(reports)} ASan/UBSan reports in the logs")

    def known_near_ties(self) -> None:
        self.report.known.append(
            KnownRow(
                GREEDY_FLIP_ON_CACHE_PATH,
                f"llama-server {self.build.label}",
                "reproduced" if self.section["near_tie_flips"] else "not-reproduced",
                count=self.section["near_tie_flips"],
            )
        )


def describe(build: ServerBuild, out: Out) -> bool:
    """Print where ``build`` comes from and whether it is the pinned tree; returns that."""
    pinned = build.pinned
    if build.tree is not None:
        pinned, line = pinned_status(build.tree)
        out(f"  {build.label}: {line}")
    elif not pinned:
        out(f"  the binary's source is unknown; the model is pinned to llama.cpp {PINNED_COMMIT}")
    elif not build.by_name:
        out(f"  the binary's build-info.json says it was built from llama.cpp {PINNED_COMMIT}, the pinned tree")
    return pinned


def bisect_line(build: ServerBuild, machine: str, prop: str) -> str | None:
    """The one line that bisects a failure (``prop`` on ``machine``) over the history of the tree ``build`` came from
    (``python -m harness history``): the fixed program it failed in when it is one (judged by the server's log
    alone), else the gate's property; ``--to`` the index's build, ``--checkout`` a git tree. None for a binary."""
    flags = shlex.split(build.replay_flags)
    if "--source" not in flags or flags.index("--source") + 1 >= len(flags):
        return None
    source = flags[flags.index("--source") + 1]
    name = machine.removeprefix("server-")
    check = f"program:{name}:{prop}" if name in LIMIT_PROGRAMS else f"property:{prop}"
    spec = registry_spec(source)
    if spec is not None and spec.build is not None:
        return f"python -m harness history {check} --to b{spec.build}"
    if (Path(source) / ".git").exists():
        return f"python -m harness history {check} --checkout {source} --good REV_WITHOUT_IT --bad HEAD"
    return (f"python -m harness history {check} --trees OLDER_TREE,{source}  (this tree is neither a build of the "
            "package index nor a git checkout: name an older one)")
