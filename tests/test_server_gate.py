"""The server backend: a real llama-server (master and pr builds) against the reference model."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.errors import FlakyFailure

from harness.backends.llama_server.differential import Differential, ServerMismatch, full_context
from harness.backends.llama_server.memory import save_fault, save_peak
from harness.backends.llama_server.section import unflaked
from harness.targets.llama_server import ServerConfig, sanitizer_reports
from harness.trees.build import build_server

pytestmark = pytest.mark.llama_server_builds  # built before the first test (tests/conftest.py)


@pytest.fixture(scope="module")
def pr_binary() -> Path:
    return build_server("shared")


@pytest.fixture(scope="module")
def master_binary() -> Path:
    return build_server("master")


A = [3 + (i * 7) % 250 for i in range(300)]
B = [3 + (i * 11) % 250 for i in range(300)]
SCRIPT = [A, A + [5] * 20, B, A[:150] + [9] * 30, B + [7] * 10, A]


@pytest.mark.parametrize("arch", ["llama", "jamba", "gemma2"])
def test_model_predicts_the_servers_slot_and_cache_n(pr_binary: Path, arch: str) -> None:
    with Differential(ServerConfig(arch), pr_binary) as d:
        rows = [d.request(t, 3) for t in SCRIPT]
    assert all(r.ok for r in rows), "\n".join(r.describe() for r in rows)
    assert sum(r.cache_n > 0 for r in rows) >= 3  # prefix reuse, cache loads and checkpoints happened
    assert {r.slot for r in rows} == {0, 1}


@pytest.mark.parametrize("arch", ["llama", "jamba"])
def test_speculative_target_and_draft_restore_match(pr_binary: Path, arch: str) -> None:
    with Differential(ServerConfig(arch, draft=True), pr_binary) as d:
        rows = [d.request(t, 8) for t in SCRIPT]
    assert all(r.ok for r in rows), "\n".join(r.describe() for r in rows)
    assert sum(r.draft_n for r in rows) > 0  # the server really drafted
    assert sum(r.cache_n > 0 for r in rows) >= 3


def test_a_wrong_model_is_caught(pr_binary: Path) -> None:
    """Mutant of the model: no prompt cache at all (the server has one): cache_n must disagree."""
    cfg = ServerConfig("llama")
    with Differential(cfg, pr_binary) as d:
        d.model.prompt_cache = None
        c = [3 + (i * 13) % 250 for i in range(300)]
        rows = [d.request(t, 3) for t in (A, B, c, [*A, 4, 4])]  # A comes back from the cache
    assert [r.ok for r in rows] == [True, True, True, False]
    assert rows[-1].cache_n >= 300 > rows[-1].predicted_cache_n
    program = d.program()
    assert program.count("d.request(") == 4 and "Differential(ServerConfig(arch='llama'" in program


def test_full_context_rows_match(pr_binary: Path) -> None:
    rows = full_context(pr_binary, "shared", None)
    assert len(rows) == 4 and all(r.ok for r in rows)
    assert max(len(r.tokens) for r in rows) >= 1016


def test_pr_save_peak_has_no_checkpoint_copy_and_master_does(pr_binary: Path, master_binary: Path) -> None:
    pr = save_peak(pr_binary, "shared")
    master = save_peak(master_binary, "master")
    c, s = pr["checkpoint_bytes"], pr["state_bytes"]
    assert c > 8 * s > 0  # MiBs of checkpoints
    assert pr["rss_peak_bytes"] < s + c // 2 < master["rss_peak_bytes"]
    assert master["model_peak_bytes"] - pr["model_peak_bytes"] == c
    # the model's prediction for master is within 10 % of what the kernel measured
    assert abs(master["rss_peak_bytes"] - master["model_peak_bytes"]) < 0.1 * master["model_peak_bytes"]


def test_fault_in_the_checkpoint_copy_kills_master_and_not_pr(pr_binary: Path, master_binary: Path) -> None:
    m1 = save_fault(master_binary, "master", "master", 1)
    p1 = save_fault(pr_binary, "pr", "shared", 1)
    assert (m1.predicted, m1.observed) == ("skipped", "skipped") == (p1.predicted, p1.observed)
    assert m1.ok and p1.ok and m1.seen.site is not None and m1.seen.site.function == "server_prompt_cache::alloc"
    assert "a later request" in p1.detail
    m2 = save_fault(master_binary, "master", "master", 2)
    assert (m2.predicted, m2.observed, m2.predicted_site) == ("crash", "crash", "ckpt_copy.tgt") and m2.ok
    # observed, not inferred: the allocation failed in the cache entry's construction, and the abort came from there
    assert m2.seen.site is not None and m2.seen.site.function == "server_prompt_cache::alloc"
    assert m2.seen.signal == "SIGABRT" and m2.seen.died_at == m2.seen.site
    assert "SIGABRT" in m2.detail
    p2 = save_fault(pr_binary, "pr", "shared", 2)
    assert p2.ok and not p2.predicted_site.startswith("ckpt_copy")


def test_a_fault_trial_names_the_site_it_observed(pr_binary: Path) -> None:
    """The message names where the server's allocation failed, read from the call stack the shim wrote when it
    failed it (file:function: the PR's static helper has its file in the symbol table), and, apart, what the
    model predicted; the same observation against another prediction disagrees and says both."""
    t = save_fault(pr_binary, "pr", "shared", 2)
    msg = t.message()
    assert t.observed == "crash" and t.ok, msg
    assert t.observed_site == "common.cpp:common_prompt_checkpoint_capture"
    assert msg.startswith("observed: common.cpp:common_prompt_checkpoint_capture (crash: allocation #2 of "), msg
    assert "SIGABRT" in msg  # how it died, from the abort's own backtrace and the log
    assert msg.endswith(
        "; model predicted: crash at ckpt.update_tgt (common_prompt_checkpoint::update_tgt, common/common.cpp:2298)"
    ), msg
    assert any("common_prompt_checkpoint::update_tgt(llama_context*, int, unsigned int)" in f for f in t.seen.frames)
    wrong = replace(t, predicted_site="ckpt_copy.tgt")  # what the model said in the report this test answers
    assert (wrong.predicted, wrong.observed) == ("crash", "crash") and not wrong.ok
    assert wrong.message().startswith("observed: common.cpp:common_prompt_checkpoint_capture (crash: ")
    assert "; model predicted: crash at ckpt_copy.tgt (server_prompt_cache::alloc, " in wrong.message()


def test_no_server_is_left_behind(pr_binary: Path) -> None:
    with pytest.raises(ServerMismatch), Differential(ServerConfig("llama"), pr_binary) as d:
        pid = d.server.pid
        raise ServerMismatch("cache_n", "boom", "")
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)


def test_sanitizer_reports_are_found_in_every_server_log(tmp_path: Path) -> None:
    (tmp_path / "llama-np2-kvs-00001.log").write_text("srv ok\n")
    (tmp_path / "llama-np2-kvs-00002.log").write_text(
        "x\n==1==ERROR: AddressSanitizer: heap-use-after-free on address 0x6\nmore\n"
        "common.cpp:1:2: runtime error: load of misaligned address\n"
    )
    (tmp_path / "jamba-fresh-00003.log").write_text("==2==ERROR: LeakSanitizer: detected memory leaks\n")
    found = sanitizer_reports(str(tmp_path))
    assert len(found) == 3
    assert any("heap-use-after-free" in r for r in found) and any("LeakSanitizer" in r for r in found)


def test_gate_on_a_binary_built_elsewhere(pr_binary: Path, tmp_path: Path) -> None:
    """--server-bin: a llama-server copied out of the cache with its shared libraries, as a build directory
    elsewhere holds them (no build-info.json beside it), runs the full backend; its source is unknown, so the
    run says the model is pinned to 0c1e570 and asks for the semantics; with them it passes, and a divergence
    would carry that note. The binary alone cannot start: one line naming the missing library, exit 2."""
    binary = tmp_path / "bin" / "llama-server"
    binary.parent.mkdir()
    shutil.copy2(pr_binary, binary)
    repo = Path(__file__).resolve().parent.parent
    alone = [sys.executable, "-m", "harness", "gate", "--backend", "server", "--server-bin", str(binary),
             "--semantics", "shared"]  # fmt: skip
    r = subprocess.run(alone, capture_output=True, text=True, cwd=repo, check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "error while loading shared libraries: libllama-server-impl.so" in r.stderr.strip().splitlines()[-1]
    for lib in pr_binary.parent.glob("lib*.so*"):
        shutil.copy2(lib, binary.parent / lib.name, follow_symlinks=False)
    base = [sys.executable, "-m", "harness", "gate", "--backend", "server", "--server-bin", str(binary)]
    r = subprocess.run(base, capture_output=True, text=True, cwd=repo, check=False)
    assert r.returncode == 2 and "cannot tell the semantics of the binary" in r.stderr
    out = tmp_path / "gate.json"
    r = subprocess.run(
        [*base, "--semantics", "shared", "--max-examples", "1", "--json", str(out)],
        capture_output=True, text=True, cwd=repo, check=False,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-2000:]
    assert "the binary's source is unknown; the model is pinned to llama.cpp 0c1e570" in r.stdout
    server = json.loads(out.read_text())["server"]
    assert server["build"] == f"binary {binary}" and server["pinned"] is False and server["requests"] > 0
    assert server["fault_trials"] == 3 and server["rss_peak_bytes"] > 0
    # the stateless step after the backend: the cache's entries from embeddings and reranks, counted on the server
    doc = json.loads(out.read_text())
    held = server["stateless"]
    stateless = sum(run["stateless_requests"] for run in held.values())
    for name in ("stateless_not_cached", "stateless_fresh"):  # every embedding and rerank, with and without idle
        counted = {p["name"]: p for p in doc["properties"]}[name]
        assert counted["status"] == "passed" and counted["examples"] == stateless > 0, counted
    assert held["llama-np2-kvs"]["stateless_entries"] == held["llama-np2-kvs"]["predicted_entries"] > 0
    assert held["llama-np2-kvs-noidle"]["problems"] == [] and held["llama-np2-kvs-noidle"]["failed"] is None


def test_a_mismatch_hypothesis_calls_flaky_is_unwrapped_not_a_traceback() -> None:
    """A real server answers a program's request otherwise once than when Hypothesis runs the program again to
    confirm it (PR #27451's branch: a save one build's log showed and the other's did not): Hypothesis raises
    ``FlakyFailure``, an exception group, which the backend must open to file (or, for --base, replay) it."""
    seen: list[int] = []

    @settings(max_examples=5, database=None, derandomize=True)
    @given(st.integers(0, 3))
    def once(i: int) -> None:
        seen.append(i)
        if len(seen) == 1:
            raise ServerMismatch("change", "TREE saves 1 where BASE 0", "d.request([1], 2)")

    with pytest.raises(FlakyFailure) as err:
        once()
    found = unflaked(err.value, ServerMismatch)
    assert found is not None and found.message == "TREE saves 1 where BASE 0"
    assert unflaked(FlakyFailure("other", [ValueError("x")]), ServerMismatch) is None
