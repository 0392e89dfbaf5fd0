"""The gate's steps after the server backend in a change run (``--base``): ``against_base`` files a step's failure
as the change's only where BASE holds the property, and as upstream drift where BASE fails it too. The step here is
a plain function of the binary it is given; the real steps' own tests run real servers (test_server_mutants.py)."""

from __future__ import annotations

from collections import Counter

from harness.backends.base import Failure, GateOptions, GateReport, MachineResult, Out
from harness.backends.llama_server.section import ServerSection
from harness.load.gate_step import Step, against_base
from properties.machine import MachineConfig

OPTS = GateOptions(semantics="shared", semantics_given=False, profile="ci", seed=0, db=None, max_examples=None,
                   backends={})  # fmt: skip


def _report(base: str | None) -> GateReport:
    r = GateReport("shared", "server", "ci", 0, "c0ffee")
    figures = {"binary": "/tree/llama-server", "semantics": "shared", "pinned": False}
    if base is not None:
        figures |= {"base_binary": base, "base_semantics": "master", "base_pinned": False}
    r.sections["server"] = ServerSection(figures)
    return r


def _fails_on(*binaries: str, prop: str = "no_partial_file") -> Step:
    """A step that files ``prop`` failed when the binary it is given is one of ``binaries``."""

    def server_example_step(report: GateReport, opts: GateOptions, out: Out) -> None:
        section = report.sections["server"]
        assert isinstance(section, ServerSection)
        binary = str(section.figures["binary"])
        failure = None
        if binary in binaries:
            failure = Failure(prop, "violation", f"{prop} on {binary}", "program", "replay", "server-example", 1)
        report.machines.append(MachineResult(MachineConfig(section.figures["semantics"]), 0.0, failure,
                                             Counter({prop: 1}), Counter(), []))  # fmt: skip

    return server_example_step


def test_a_failure_base_shows_too_is_upstream_drift_not_the_changes() -> None:
    lines: list[str] = []
    report = _report("/base/llama-server")
    against_base(_fails_on("/tree/llama-server", "/base/llama-server"))(report, OPTS, lines.append)
    assert report.passed and report.machines[0].checked["no_partial_file"] == 1
    section = report.sections["server"]
    assert isinstance(section, ServerSection)
    assert section.figures["step_drift"] == [{"step": "server_example_step", "property": "no_partial_file",
                                              "message": "no_partial_file on /tree/llama-server"}]  # fmt: skip
    assert any(line.startswith("  upstream drift (BASE fails no_partial_file too") for line in lines), lines


def test_a_failure_base_holds_is_the_changes() -> None:
    report = _report("/base/llama-server")
    against_base(_fails_on("/tree/llama-server"))(report, OPTS, lambda _line: None)
    assert [f.property for f in report.failures] == ["no_partial_file"]
    # BASE failing another property does not excuse this one
    report = _report("/base/llama-server")
    step = _fails_on("/tree/llama-server")
    other = _fails_on("/base/llama-server", prop="slot_file_restore")

    def both(r: GateReport, o: GateOptions, out: Out) -> None:
        step(r, o, out)
        other(r, o, out)

    against_base(both)(report, OPTS, lambda _line: None)
    assert [f.property for f in report.failures] == ["no_partial_file"]


def test_without_a_base_the_step_is_as_it_is() -> None:
    report = _report(None)
    against_base(_fails_on("/tree/llama-server"))(report, OPTS, lambda _line: None)
    assert [f.property for f in report.failures] == ["no_partial_file"]
