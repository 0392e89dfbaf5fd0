"""Issue #39 point 4: hostile slot file names against the real pr llama-server, and the oracle shown to fail.

The real run (the explicit list and a few generated names, one server, seconds) must show what 0c1e570 does:
every name that must be refused answered 4xx (or the registered 500 of a body nlohmann refuses), every benign
name saved in place, nothing outside ``--slot-save-path`` touched except through the planted symlinks (the
registered ``slot-file-follows-symlink``). The planted bugs are real file operations outside the save
directory during a request, one a write (seen by the snapshot and inotify), one only a read (inotify alone),
and the symlink escape with the finding unregistered: each must fail the verdict.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from harness.experiments.slot_files import (
    BAD_BODY_FINDING,
    SYMLINK_FINDING,
    ActionResult,
    NameResult,
    SlotFilesReport,
    judge,
    run_slot_files,
)
from harness.experiments.slot_names import BENIGN, Name, classify, explicit_names, text_name
from harness.experiments.slot_sandbox import SECRET, SYMLINKS, Sandbox
from harness.findings import FINDINGS
from harness.trees.build import build_server

pytestmark = pytest.mark.llama_server_builds  # built before the first test (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def real() -> SlotFilesReport:
    return run_slot_files(build_server("shared"), examples=15, seed=1)


def test_the_real_run_on_the_pr_server(real: SlotFilesReport) -> None:
    n_explicit = len(explicit_names(Path("/base")))
    explicit = [r for r in real.rows if r.name.source == "explicit"]
    assert len(explicit) == n_explicit and len(real.rows) > n_explicit, "every explicit name, then generated ones"
    assert not real.failures, [(r.name.label, r.reasons) for r in real.failures]
    for r in explicit:
        save, restore = r.actions["save"].status, r.actions["restore"].status
        if r.name.cls == "refuse":
            explained = r.verdict == f"known:{BAD_BODY_FINDING}"
            assert explained or (400 <= (save or 0) < 500 and 400 <= (restore or 0) < 500), r.name.label
            assert not explained or (save, restore) == (500, 500)
        if r.name.cls == "benign":
            assert (save, restore, r.verdict) == (200, 200, "ok"), r.name.label
        assert r.actions["erase"].status == 200
    counts = real.counts()
    assert counts["benign"]["names"] == len(BENIGN) and counts["symlink"]["names"] == len(SYMLINKS)
    # what 0c1e570 does: every planted symlink followed, a 500 for each of the 18 malformed explicit bodies
    # (4 names with lone surrogates, 9 raw byte names, 5 bodies without a string filename)
    assert counts["symlink"][f"known:{SYMLINK_FINDING}"] == len(SYMLINKS)
    assert sum(r.verdict == f"known:{BAD_BODY_FINDING}" for r in explicit) == 18
    for r in real.rows:  # nothing outside changed but what the registered finding explains
        if any(a.outside for a in r.actions.values()):
            assert r.verdict == f"known:{SYMLINK_FINDING}" and r.name.text in SYMLINKS, r.name.label
    link = next(r for r in real.rows if r.name.text == "link.bin")
    assert "root/outside/secret.bin: changed (size, mtime_ns, sha256)" in link.actions["save"].outside
    assert any(line.startswith("root/outside/secret.bin: ") and "ACCESS" in line
               for line in link.actions["restore"].outside)  # fmt: skip


def _benign() -> list[Name]:
    return [text_name("slot0.bin", "benign")]


def test_a_write_outside_during_a_benign_request_is_an_escape() -> None:
    def write(sb: Sandbox, name: Name, action: str) -> None:
        if action == "save":
            with (sb.outside / "secret.bin").open("ab") as f:
                f.write(b"written during the request")

    rep = run_slot_files(build_server("shared"), names=_benign(), during=write)
    (row,) = rep.rows
    assert row.verdict == "FAIL" and row.reasons[0].startswith("save escaped: root/outside/secret.bin")
    assert "root/outside/secret.bin: changed (size, mtime_ns, sha256)" in row.actions["save"].outside


def test_a_read_outside_is_seen_though_nothing_changes() -> None:
    def read(sb: Sandbox, name: Name, action: str) -> None:
        if action == "restore":
            assert (sb.outside / "secret.bin").read_bytes() == SECRET

    rep = run_slot_files(build_server("shared"), names=_benign(), during=read)
    (row,) = rep.rows
    assert row.verdict == "FAIL" and not any("changed" in line for line in row.actions["restore"].outside)
    assert "root/outside/secret.bin: ACCESS" in row.actions["restore"].outside


def test_the_symlink_escape_fails_without_its_registered_finding() -> None:
    names = [text_name(n) for n in SYMLINKS]
    rep = run_slot_files(build_server("shared"), names=names, known=frozenset({BAD_BODY_FINDING}))
    assert [r.verdict for r in rep.rows] == ["FAIL"] * len(SYMLINKS)
    assert all("escaped: root/outside" in r.reasons[0] for r in rep.rows)


def _judged(name: Name, save: int, restore: int, *, msg: str = "", inside: list[str] | None = None) -> NameResult:
    actions = {
        "save": ActionResult("save", save, msg, inside=inside or []),
        "restore": ActionResult("restore", restore, msg),
        "erase": ActionResult("erase", 200, ""),
    }
    r = NameResult(name, actions)
    judge(r, frozenset({SYMLINK_FINDING, BAD_BODY_FINDING}))
    return r


def test_the_status_rules() -> None:
    """A traversal answered 200 or a plain 500 fails; the registered 500 only for a body nlohmann refuses."""
    dots = text_name("../x.bin")
    assert dots.cls == "refuse" and _judged(dots, 200, 400).verdict == "FAIL"
    assert _judged(dots, 500, 500, msg="[json.exception.parse_error.101]").verdict == "FAIL"  # valid UTF-8: no excuse
    sur = text_name("\ud800")
    assert _judged(sur, 500, 500, msg="[json.exception.parse_error.101] x").verdict == f"known:{BAD_BODY_FINDING}"
    assert _judged(sur, 500, 500, msg="Unable to save slot").verdict == "FAIL"
    ok = text_name("a.bin", "benign")
    assert _judged(ok, 400, 400).verdict == "FAIL"
    assert _judged(ok, 200, 200, inside=["root/save/a.bin: created"]).verdict == "ok"
    assert _judged(ok, 200, 200, inside=["root/save/a.bin: created", "root/save/b: created"]).verdict == "FAIL"
    lit = text_name("a\uff0fb")
    assert lit.cls == "literal" and _judged(lit, 200, 200, inside=[]).verdict == "FAIL"  # 200 but no file


def test_classes() -> None:
    assert [classify(s) for s in ("..", "a/b", "a\\b", "a\x00b", "a" * 256, "é" * 128, "", "\x85")] == ["refuse"] * 8
    assert [classify(s) for s in ("a" * 255, "CON", "a\uff0fb", "x.bin.", "%2e%2e")] == ["literal"] * 5
    assert classify("link.bin") == "symlink"


def test_the_findings_are_registered_with_their_reproducers() -> None:
    for fid in (SYMLINK_FINDING, BAD_BODY_FINDING):
        f = FINDINGS[fid]
        assert f.backend == "server" and f.reproducer and (ROOT / f.reproducer).is_file()


@pytest.mark.parametrize("fid", [SYMLINK_FINDING, BAD_BODY_FINDING])
def test_reproducer_exits_1_while_the_bug_is_present(fid: str) -> None:
    script = FINDINGS[fid].reproducer
    assert script is not None
    p = subprocess.run([sys.executable, script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "BUG:" in p.stdout


def test_the_command(tmp_path: Path) -> None:
    out = tmp_path / "slot.json"
    p = subprocess.run([sys.executable, "-m", "harness", "slot-files", "--examples", "0", "--json", str(out)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "KNOWN slot-file-follows-symlink (3 names)" in p.stdout
    rep = json.loads(out.read_text())
    assert rep["failures"] == 0 and rep["names"] == len(explicit_names(Path("/base")))
    assert {k["id"] for k in rep["known_findings"]} == {SYMLINK_FINDING, BAD_BODY_FINDING}
    bad = subprocess.run([sys.executable, "-m", "harness", "slot-files", "--examples", "-1"],
                         cwd=ROOT, capture_output=True, text=True, timeout=60)  # fmt: skip
    assert bad.returncode == 2 and bad.stderr.strip().count("\n") == 0 and "--examples" in bad.stderr
