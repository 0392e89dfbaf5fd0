"""Coverage of the C++ under test: the gcov build, a run's counters, gcovr's figures per function, the reasons.

The real ``coverage`` build (made before the first test by tests/conftest.py), a few requests through
:class:`ServerProcess` on the tiny llama model, then gcovr: ``server_prompt_cache::load`` is reached, the slot
file handlers (no request saves a slot file) are 0 of their lines with their blocks given the reason "slot
files", and a server killed with SIGKILL is counted as a server whose counters are lost.
"""

from __future__ import annotations

import json
import os
import re
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from fixtures.gguf import model_path
from harness.backends.base import Plan
from harness.campaign.engine import CampaignState
from harness.campaign.view import status
from harness.cli import main as cli_main
from harness.coverage import gcovr as cov
from harness.coverage.functions import TARGETS, UNEXPLAINED, Target, reason_for
from harness.coverage.live import COVERAGE_RUN_ENV, LineProbe
from harness.errors import Unavailable, UsageError
from harness.targets.llama_server import Launch, ServerProcess
from harness.trees.build import build_server, cmake_args
from harness.trees.gcov import SOURCES, gcov_env, is_coverage

pytestmark = pytest.mark.coverage_build  # built before the first test (tests/conftest.py)

SLOT_FILES = "slot files: no slot action in this workload (coverage --run slot-files drives them)"
PROMPT_A = "The quick brown fox jumps over the lazy dog. " * 3
PROMPT_B = "Pack my box with five dozen liquor jugs, said the sphinx. " * 3


@pytest.fixture(scope="module")
def binary() -> Path:
    return build_server("shared", "coverage", log=lambda m: print(m, file=sys.stderr))


@pytest.fixture(scope="module")
def measured(binary: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[cov.CoverageRun, Any]]:
    run = cov.CoverageRun.create(tmp_path_factory.mktemp("coverage") / "run", binary)
    with ServerProcess(
        binary,
        Launch(model=model_path("llama"), n_parallel=1, cache_ram=16, ctx_size=512),
        env=run.env("requests"),
    ) as srv:
        for prompt in (PROMPT_A, PROMPT_B, PROMPT_A):  # A saved to the RAM cache by B, then loaded back
            srv.completion(prompt, n_predict=2)
    killed = ServerProcess(binary, Launch(model=model_path("llama")), env=run.env("requests"))
    with killed:
        assert killed.proc is not None
        killed.proc.kill()  # no clean exit: no counters
        killed.proc.wait()
    yield run, cov.gcovr_report(run, ["requests"], run.root / "requests.json")


def _row(rows: list[cov.Row], function: str) -> cov.Row:
    found = [r for r in rows if r.function == function]
    assert len(found) == 1, [r.function for r in rows]
    return found[0]


def test_a_cache_round_trip_reaches_load_and_not_the_slot_files(measured: tuple[cov.CoverageRun, Any]) -> None:
    run, doc = measured
    rows = cov.function_rows(run, doc)
    load = _row(rows, "server_prompt_cache::load")
    assert 0 < load.lines_reached <= load.lines_total and load.branches_total > 0, load
    assert _row(rows, "server_slot::prompt_save").lines_reached > 0
    for untouched in ("server_routes::handle_slots_save", "server_routes::handle_slots_restore"):
        row = _row(rows, untouched)
        assert row.lines_total > 0 and row.lines_reached == 0 and row.branches_reached == 0, row
    region = _row(rows, "slot files (process_single_task)")
    assert region.lines_total > 20 and region.lines_reached == 0, region


def test_unreached_blocks_carry_their_reason(measured: tuple[cov.CoverageRun, Any]) -> None:
    run, doc = measured
    blocks = cov.unreached_blocks(run, doc)
    slot_files = [b for b in blocks if b.function == "server_routes::handle_slots_save"]
    assert slot_files and all(b.reason == SLOT_FILES for b in slot_files), slot_files
    reached = cov.reached_lines(run.root)
    load = next(r for r in cov.function_rows(run, doc) if r.function == "server_prompt_cache::load")
    assert ("tools/server/server-task.cpp", load.first) in reached
    # a block is never hidden: every unreached line of a target is in exactly one block
    unreached = sum(r.lines_total - r.lines_reached for r in cov.function_rows(run, doc)
                    if not r.target.endswith("(update_slots)") and not r.target.endswith("(process_single_task)"))
    assert sum(b.lines for b in blocks) >= unreached > 0


def test_the_campaigns_gcov_reading_agrees_with_gcovr(measured: tuple[cov.CoverageRun, Any]) -> None:
    """gcov's own JSON of the eight target objects (seconds) gives gcovr's figure (a minute) line for line."""
    run, doc = measured
    rows = cov.function_rows(run, doc)
    fast = cov.gcov_doc(run, ["requests"])
    reached, total = cov.target_reach(run, fast)
    assert total == sum(r.lines_total for r in rows) > 1000
    assert len(reached) == sum(r.lines_reached for r in rows) > 0
    assert reached == cov.target_reach(run, doc)[0] == cov.reached_lines(run.root)


def test_a_campaign_counts_new_lines_as_progress(binary: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A campaign under ``coverage --run fuzz`` reads the lines reached at a bounded rate: 0 before any server
    stopped, then more after a server that loaded a cache entry, in the status line and the JSON."""
    run = cov.CoverageRun.create(tmp_path / "run", binary)
    monkeypatch.setenv(COVERAGE_RUN_ENV, f"{run.root}{os.pathsep}fuzz")
    probe = LineProbe.from_env()
    assert probe is not None and probe.workload == "fuzz"
    probe.every = 3600.0  # only forced readings are due
    state = CampaignState("db", Plan(("server",)), 1, "1 minutes", {}, lines=probe)
    assert not probe.read(1.0, force=True) and probe.lines == 0 and "lines - (no counters yet)" in status(state)
    with ServerProcess(
        binary, Launch(model=model_path("llama"), n_parallel=1, ctx_size=512), env=run.env("fuzz")
    ) as srv:
        srv.completion(PROMPT_A, n_predict=2)  # no RAM cache: nothing saved or loaded
    assert probe.read(2.0, force=True)
    first = probe.lines
    assert 0 < first < probe.total and status(state).endswith(f"lines {first}/{probe.total} (+{first})")
    assert not probe.read(2.5, force=True)  # nothing new written: no reading
    with ServerProcess(
        binary,
        Launch(model=model_path("llama"), n_parallel=1, cache_ram=16, ctx_size=512),
        env=run.env("fuzz"),
    ) as srv:
        for prompt in (PROMPT_A, PROMPT_B, PROMPT_A):  # A saved by B, then loaded back
            srv.completion(prompt, n_predict=2)
    assert not probe.read(3.0)  # new counters, but not due: a bounded rate
    assert probe.read(4.0, force=True)
    grown = probe.lines - first
    assert grown > 0 and status(state).endswith(f"lines {probe.lines}/{probe.total} (+{grown})")
    assert state.to_json()["coverage"]["readings"] == [[2.0, first], [4.0, probe.lines]]


def test_a_killed_server_is_counted_as_lost(measured: tuple[cov.CoverageRun, Any]) -> None:
    run, _ = measured
    clean, lost = run.servers("requests")
    assert clean == 1 and lost == ["-9"], (clean, lost)


def test_a_region_whose_marker_drifted_is_empty_not_guessed(measured: tuple[cov.CoverageRun, Any]) -> None:
    """What the next test guards against: a start marker no line matches selects nothing (a 0/0 row)."""
    run, doc = measured
    lines = cov._code_lines(doc)["tools/server/server-context.cpp"]
    real = next(t for t in TARGETS if t.label == "checkpoint restore (pre_decode)")
    assert len(cov._selected(run, real, lines)) > 20
    drifted = Target(real.label, real.file, real.function, "a line upstream renamed", real.end)
    assert cov._selected(run, drifted, lines) == []


def test_every_region_marker_is_in_the_pinned_sources(binary: Path) -> None:
    """A region whose markers drifted would be reported empty: each start and end line is found, in order."""
    for t in TARGETS:
        if t.start is None:
            continue
        text = (binary.parent / SOURCES / t.file).read_text().split("\n")
        start = next(i for i, line in enumerate(text) if re.search(t.start, line))
        assert t.end is not None and any(re.search(t.end, line) for line in text[start + 1 :]), t


def test_the_flavour_compiles_with_gcov_and_counts_outside_the_cache(binary: Path, tmp_path: Path) -> None:
    args = cmake_args("shared", "coverage")
    assert is_coverage(args) and not is_coverage(cmake_args("shared")) and not is_coverage(cmake_args("shared", "asan"))
    assert "-DCMAKE_CXX_FLAGS_RELEASE=-O0 -DNDEBUG" in args and "-DCMAKE_SHARED_LINKER_FLAGS=--coverage" in args
    env = gcov_env(binary.parent, tmp_path)
    build_dir = Path(json.loads((binary.parent / "build-info.json").read_text())["coverage"]["build_dir"])
    # a counter named <build_dir>/x/y.gcda lands in <tmp_path>/x/y.gcda
    assert env["GCOV_PREFIX"] == str(tmp_path) and int(env["GCOV_PREFIX_STRIP"]) == len(build_dir.parts) - 1
    other = tmp_path / "pr-entry"
    other.mkdir()
    (other / "build-info.json").write_text(json.dumps({"flavour": "pr"}))
    with pytest.raises(UsageError, match="not a coverage build"):
        gcov_env(other, tmp_path)


def test_reasons_table() -> None:
    assert reason_for("    if (ggml_backend_buffer_is_host(buf)) {", "llama_kv_cache::state_read") == (
        "unreachable on CPU: a device/GPU branch"
    )
    assert reason_for('GGML_ABORT("failed to remove sequence %d\\n", slot.id);', "f").startswith("abort path")
    assert reason_for("x = 1;", "server_routes::handle_slots_erase", entered=False) == SLOT_FILES
    assert reason_for("x = 1;", "server_prompt_cache::load") == UNEXPLAINED
    # a function never entered is explained by its name first, whatever its lines hold
    assert reason_for('GGML_ABORT("x");', "server_routes::handle_slots_save(server_http_req const&, int)",
                      entered=False) == SLOT_FILES  # fmt: skip
    # the slot-file lines a slot-files run leaves, each with its own reason (no longer "a point still to do")
    handler = "server_routes::handle_slots_save(server_http_req const&, int)"
    assert reason_for("GGML_ASSERT(req.should_stop());\nreturn res;", handler).startswith("a client gone")
    assert reason_for('res->error(format_error_response("Invalid filename", X));', handler).startswith("a hostile")
    assert reason_for('send_error(task, "Invalid slot ID", ERROR_TYPE_INVALID_REQUEST);', "f").startswith(
        "a slot id the server does not have: get_slot_by_id never returns null"
    )
    assert reason_for("x", "llama_state_save_file").startswith("whole-context session files")
    assert reason_for('LLAMA_LOG_ERROR("%s: failed to restore sequence state\\n", __func__);', "f").startswith(
        "a slot file whose token count exceeds the capacity the server passes"
    )
    assert reason_for("case SERVER_TASK_TYPE_GET_LORA:", "f") == "a LoRA adapter"
    # the guards of the memory calls: a reason of their own, not "unexplained" and not the reuse workload's
    assert reason_for("        return true;\n", "llama_kv_cache::seq_rm(int, int, int)", context="    if (other) {\n"
                      ).startswith("a KV cache sharing")  # fmt: skip
    assert reason_for("        return -1;\n", "llama_memory_seq_pos_min", context="    if (!mem) {\n").startswith(
        "a context without memory"
    )
    assert reason_for("x = 1;", "llama_kv_cache::seq_add(int, int, int, int)", entered=False).startswith("--cache")
    assert reason_for("        p0 = 0;", "llama_kv_cache::seq_add(int, int, int, int)").startswith("a seq_add no")
    assert reason_for("x", "llama_kv_cache::seq_div(int, int, int, int)", entered=False).startswith("seq_div")
    assert reason_for("set_rs_idx(seq_id, 0);", "llama_memory_recurrent::state_read(x)").startswith("needs recurrent")
    assert reason_for("}", "llama_kv_cache::state_read_sinfo(x)", context="    }\n").startswith("a line gcov")
    assert reason_for("}\n    x = 1;", "f", context="\n") == UNEXPLAINED  # a brace among other lines explains nothing
    iswa = "llama_kv_cache_iswa::seq_add(int, int, int, int)"
    assert reason_for("x", iswa, entered=False).startswith("seq_add on iSWA")


def test_the_reuse_workload_reaches_context_shift_and_cache_reuse(tmp_path: Path) -> None:
    """``coverage --run reuse``: the generated --cache-reuse and context-shift programs on the coverage build reach
    every line of the context shift and all but the unsupported-memory warning of cache reuse."""
    assert cli_main(["coverage", "--run", "reuse", "--out", str(tmp_path), "--top", "0"]) == 0
    doc = json.loads((tmp_path / "coverage.json").read_text())
    rows = {r["function"]: r for r in doc["rows"]["reuse"]}
    shift, reuse = rows["context shift (pre_decode)"], rows["cache reuse (pre_decode)"]
    assert shift["lines_reached"] == shift["lines_total"] > 0, shift
    assert reuse["lines_total"] - reuse["lines_reached"] <= 2, reuse
    assert rows["llama_kv_cache::seq_add"]["lines_reached"] > 0
    why = {b["reason"] for b in doc["unreached"] if b["function"].startswith("llama_memory_recurrent::seq_add")}
    assert why and all(w.startswith("seq_add on recurrent") for w in why), why


def test_usage_errors_are_one_line(capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch) -> None:
    assert cli_main(["build-server", "--coverage", "--semantics", "master"]) == 2
    assert cli_main(["soak", "--minutes", "1", "--server-bin", "/nonexistent"]) == 2
    assert cli_main(["coverage", "--run", "gate", "--minutes", "0"]) == 2
    monkeypatch.setitem(sys.modules, "gcovr", None)  # as if not installed
    with pytest.raises(Unavailable, match="gcovr is not installed"):
        cov._gcovr()
    err = capsys.readouterr().err
    assert "--coverage builds the pinned tree" in err and "--server-bin /nonexistent: not an executable" in err
