"""The gate on the trees its users have: made from the pinned sdist (copies, our patch, edits of our own).

* the change differential (``--base``): our patch against the pinned tree changes no answer and halves the
  save's peak; a behaviour change of our own is attributed to the change, with a short program, and so are
  checkpoints created at other positions, as many as the base's;
* the driver: an HTTP 500 and a server dying mid-request are classified failures with a replay, exit 1 and
  3, the JSON written, no traceback;
* the libllama layers on a tree's own libllama through the driver bound from its header, and a header the harness
  cannot drive refused;
* a second build of a near-identical tree compiles only what differs;
* a tree whose prompt cache the model cannot read runs the checks that need no model.

Each server-side property failing on its C++ mutant is ``test_server_mutants.py``.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, Trees, no_traceback, run_harness

from harness.backends.llama_server.differential import (
    Differential,
    ServerMismatch,
)
from harness.targets.llama_server import ServerConfig
from harness.trees.api import check_libllama
from harness.trees.binding import binding
from harness.trees.build import build_server, build_source, cache_root
from harness.trees.pinned import sdist_source

pytestmark = [pytest.mark.llama_server_builds, pytest.mark.user_trees]  # built before the first test (conftest)


# --------------------------------------------------------------------------------------------
# --base: the change differential
# --------------------------------------------------------------------------------------------


def test_our_patch_against_the_pinned_tree_changes_no_answer_and_halves_the_save_peak(
    trees: Trees, tmp_path: Path
) -> None:
    tree, base = trees("pr"), trees("pinned")
    out = tmp_path / "gate.json"
    r = run_harness("gate", "--backend", "server", "--source", str(tree), "--base", str(base), "--max-examples", "2",
                 "--json", str(out))  # fmt: skip
    no_traceback(r)
    assert r.returncode == 0, r.stdout[-4000:]
    s = json.loads(out.read_text())["server"]
    assert s["changes"] == 0 and s["requests"] > 50 and s["same_answers"] == s["requests"]
    assert s["base_pinned"] and s["drift"] == []  # both pinned: the model held on every request
    assert s["rss_ratio_base_over_tree"] > 2.0  # master's save copies the checkpoints; the PR's does not
    assert "the change's memory difference" in r.stdout


def test_a_behaviour_change_of_our_own_is_attributed_to_the_change_with_a_short_program(
    trees: Trees, tmp_path: Path
) -> None:
    tree, base = trees("threshold"), trees("pinned")
    out = tmp_path / "gate.json"
    r = run_harness("gate", "--backend", "server", "--source", str(tree), "--base", str(base), "--max-examples", "4",
                 "--json", str(out))  # fmt: skip
    no_traceback(r)
    assert r.returncode == 1, r.stdout[-4000:]
    failures = json.loads(out.read_text())["failures"]
    change = [f for f in failures if f["property"] == "change"]
    assert change, failures
    first = change[0]
    assert "cache_n" in first["message"] or "cache_loads" in first["message"], first["message"]
    n = first["program"].count("p.request(")
    assert 1 <= n <= 6, first["program"]  # shrunk on fresh servers
    assert f"--base {base}" in first["replay"]
    # the program replays the difference on both servers, standalone
    program = first["program"].replace("TREE", f"build_source(Path({str(tree)!r}))")
    replayed = subprocess.run([sys.executable, "-c", program], cwd=REPO, capture_output=True, text=True,
                              timeout=600, check=False)  # fmt: skip
    assert replayed.returncode == 0, replayed.stderr[-2000:]
    assert "->" in replayed.stdout.strip().splitlines()[-1], replayed.stdout


def test_checkpoints_at_other_positions_are_the_changes_though_as_many(trees: Trees, tmp_path: Path) -> None:
    tree, base = trees("checkpoint-offset"), trees("pr")
    out = tmp_path / "gate.json"
    r = run_harness("gate", "--backend", "server", "--source", str(tree), "--base", str(base), "--max-examples", "4",
                 "--json", str(out))  # fmt: skip
    no_traceback(r)
    assert r.returncode == 1, r.stdout[-4000:]
    change = [f for f in json.loads(out.read_text())["failures"] if f["property"] == "change"]
    assert change, r.stdout[-4000:]
    message = change[0]["message"]  # the first one, shrunk: a checkpoint's numbers, not a count
    shown = r"checkpoints_created \(\d+ of \d+\): TREE .*n_tokens \d+ where BASE .*n_tokens \d+"
    assert re.search(shown, message), message


# --------------------------------------------------------------------------------------------
# a driver that survives other server versions
# --------------------------------------------------------------------------------------------


def test_an_http_500_and_a_server_dying_mid_request_are_failures_with_their_requests(trees: Trees) -> None:
    binary = build_source(trees("fail"), log=lambda _m: None)
    prompts = [[3 + (i * k) % 250 for i in range(40 + k)] for k in range(1, 5)]
    for spec, prop, kind, at in (("http500:3", "http_error", "violation", 3), ("abort:2", "server_crash", "crash", 2)):
        with Differential(ServerConfig("llama"), binary, env={"HARNESS_TEST_FAIL": spec}) as d, pytest.raises(
            ServerMismatch
        ) as err:
            for p in prompts:
                d.request(p, 2)
        e = err.value
        assert (e.name, e.kind) == (prop, kind), e
        assert e.program.count("d.request(") == at  # the requests that got there, the failing one last
        assert f"request #{at}" in e.message
        if prop == "http_error":
            assert "HTTP 500 'injected by the harness tests'" in e.message
        else:
            assert "the server died (exit -6 = signal 6)" in e.message


@pytest.mark.parametrize(("spec", "rc", "prop"), [("http500:4", 1, "http_error"), ("abort:4", 3, "server_crash")])
def test_the_gate_classifies_them_and_writes_its_json(
    trees: Trees, tmp_path: Path, spec: str, rc: int, prop: str
) -> None:
    tree = trees("fail")
    out = tmp_path / "gate.json"
    r = run_harness("gate", "--backend", "server", "--source", str(tree), "--max-examples", "1", "--json", str(out),
                 env={"HARNESS_TEST_FAIL": spec})  # fmt: skip
    no_traceback(r)
    assert r.returncode == rc, r.stdout[-3000:]
    rep = json.loads(out.read_text())
    # the steps after the backend run programs of their own (whole runs, or generated ones shrunk on servers that
    # fail at their 4th request too): each files the failure with its program, and no traceback (above)
    steps = ("server-concurrent", "server-stateless", "server-reuse", "server-slot-files")
    mine = [f for f in rep["failures"] if f["property"] == prop and not f["machine"].startswith(steps)]
    # each program ends with the request that failed: the differential's d.request(), the drawn limits' r.request()
    # (a context edge, r.boundary(), is two completions)
    assert mine and all(f["program"].count(".request(") + 2 * f["program"].count(".boundary(") == 4 for f in mine), [
        (f["machine"], f["program"][-300:]) for f in mine
    ]
    stepped = [f for f in rep["failures"] if f["machine"].startswith(steps[1:])]
    assert all(f["program"] and f["property"] in (prop, "request_error") for f in stepped), stepped
    assert any(f["machine"] == "server-limits" and "LimitRun(" in f["program"] for f in mine), rep["failures"]
    assert all(f["replay"].startswith("python -m harness gate --backend server --source ") for f in mine)
    assert f"FAILED {prop}" in r.stdout and "--- replay ---" in r.stdout
    # not the pinned tree, no --base: the gate offers the line that bisects the failure over history
    assert f"where it came from: python -m harness history property:{prop} --trees OLDER_TREE,{tree}" in r.stdout


def test_unreadable_semantics_stop_before_building(trees: Trees, tmp_path: Path) -> None:
    tree = trees("unknown-sem")
    r = run_harness("gate", "--backend", "server", "--source", str(tree), timeout=120)
    no_traceback(r)
    assert r.returncode == 2
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "cannot tell the semantics" in err[0] and "--semantics" in err[0], r.stderr
    assert "build:" not in r.stdout  # refused before any build


# --------------------------------------------------------------------------------------------
# every layer on the user's tree
# --------------------------------------------------------------------------------------------


def test_the_libllama_backend_and_the_contract_run_on_the_trees_own_libllama(trees: Trees, tmp_path: Path) -> None:
    tree = trees("pr")
    lib = build_server("shared").parent / "libllama.so"  # a copy of the pinned tree is the pinned build
    r = run_harness("gate", "--backend", "llama", "--source", str(tree), "--arch", "llama", "--max-examples", "20")
    no_traceback(r)
    assert r.returncode == 0, r.stdout[-3000:]
    assert "bound from its include/llama.h" in r.stdout
    loaded = [line.split(": ", 1)[1] for line in r.stdout.splitlines() if "libllama this run loaded: " in line]
    assert loaded and Path(loaded[0]).resolve() == lib.resolve(), loaded  # the file /proc/self/maps shows
    out = tmp_path / "contract.json"
    r = run_harness("contract", "--source", str(tree), "--arch", "llama", "--max-examples", "20", "--steps", "20",
                 "--json", str(out))  # fmt: skip
    no_traceback(r)
    assert r.returncode == 0, r.stdout[-3000:]
    assert Path(json.loads(out.read_text())["libllama"]).resolve() == lib.resolve()


def test_a_function_the_harness_never_calls_renamed_away_is_driven(trees: Trees) -> None:
    """llama-cpp-python's bindings refuse this tree (``llama_adapter_meta_count`` is not exported); the driver bound
    from its header binds only what the harness calls, so the libllama layers run on it."""
    tree = trees("renamed")
    lib = build_source(tree, log=lambda _m: None).parent
    assert any("llama_adapter_meta_count is not exported" in d for d in check_libllama(lib, tree, sdist_source())
               .differences)  # fmt: skip
    r = run_harness("gate", "--backend", "llama", "--source", str(tree), "--arch", "llama", "--max-examples", "10")
    no_traceback(r)
    assert r.returncode == 0, r.stdout[-3000:]
    assert "bound from its include/llama.h" in r.stdout


def test_a_libllama_the_harness_cannot_drive_is_a_skip_in_one_line(trees: Trees, tmp_path: Path) -> None:
    """A limit of the harness, not the user's mistake: exit 6 (a skip), the function named in one line and in the
    JSON, before anything is built."""
    tree = trees("uncallable")
    out = tmp_path / "gate.json"
    r = run_harness("gate", "--backend", "llama", "--source", str(tree), "--arch", "llama", "--json", str(out))
    no_traceback(r)
    assert r.returncode == 6, r.stdout[-2000:] + r.stderr[-2000:]
    line = next(x for x in r.stdout.splitlines() if x.startswith("SKIPPED llama backend"))
    assert "cannot drive the libllama" in line and "llama_memory_seq_rm is not in llama.h" in line, r.stdout
    assert "--backend server" in line  # what still runs on this tree
    assert "build:" not in r.stdout + r.stderr  # refused from the header, nothing built
    assert "cannot drive the libllama" in json.loads(out.read_text())["skipped"]["llama backend"]


def test_the_fork_script_reports_a_skip_and_stays_green(trees: Trees, tmp_path: Path) -> None:
    """ci/fork_gate.sh's default step on a tree whose libllama the harness cannot drive: exit 0, said."""
    tree = trees("uncallable")
    out = tmp_path / "artifacts"
    summary = tmp_path / "summary.md"
    (out).mkdir()
    (out / "gate-server.json").write_text(json.dumps({"passed": True, "server": {"build": "b", "memory": {}}}))
    env = {**os.environ, "PYTHON": sys.executable, "GATE_ARGS": "--backend llama --arch llama",
           "GITHUB_STEP_SUMMARY": str(summary)}  # fmt: skip
    script = str(Path(__file__).parents[1] / "ci" / "fork_gate.sh")
    r = subprocess.run([script, "default", str(tree), str(out)], capture_output=True, text=True, env=env,
                       check=False, timeout=1500)  # fmt: skip
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    said = (out / "skipped.txt").read_text()
    assert "fork_gate: default skipped on this tree (a limit of the harness, not the change)" in said
    assert "cannot drive the libllama" in said
    m = subprocess.run([script, "memory", str(tree), str(out)], capture_output=True, text=True, env=env, check=False)
    assert m.returncode == 0 and "## Skipped steps" in summary.read_text(), m.stderr


def test_a_layout_change_in_the_header_is_named(trees: Trees) -> None:
    """No build needed: the headers of a tree against the bindings, the pinned library's exports."""
    tree = trees("layout")
    pinned = sdist_source()
    lib = build_server("shared").parent
    assert check_libllama(lib, pinned, pinned).differences == ()
    diffs = check_libllama(lib, tree, pinned).differences
    assert any(d.startswith("struct llama_context_params is ") for d in diffs), diffs
    assert any(d.startswith("llama_context_params.n_ctx is at offset 4") for d in diffs), diffs
    assert "llama_n_threads takes 2 parameters in llama.h, 1 in the bindings" in diffs
    # the driver bound from the header absorbs both: the struct is the compiler's, llama_n_threads is not called
    assert binding((tree / "include" / "llama.h").read_text()).refused == ()


# --------------------------------------------------------------------------------------------
# fast second builds
# --------------------------------------------------------------------------------------------


def test_a_near_identical_tree_recompiles_only_what_differs(trees: Trees) -> None:
    build_server("shared", force=True, log=lambda _m: None)  # the stage now holds the pinned tree with our patch
    tree = trees("threshold")  # that tree with one line of server-task.cpp changed
    lines: list[str] = []
    binary = build_source(tree, log=lines.append, force=True)
    log = (cache_root() / "llama-server" / "logs" / f"{binary.parent.name}.log").read_text()
    compiled = [line for line in log.splitlines() if "Building CXX object" in line or "Building C object" in line]
    assert compiled and all("server-task.cpp" in line for line in compiled), compiled
    info = json.loads((binary.parent / "build-info.json").read_text())
    assert info["staged_changes"] == 1  # only the edited file was rewritten into the stage


def test_a_tree_whose_prompt_cache_the_model_cannot_read_runs_the_checks_that_need_no_model(
    trees: Trees, tmp_path: Path
) -> None:
    """``block``: no ``struct server_prompt_cache`` in server-task.h (a block cache in its place). The server gate says
    in one line which checks are model-exact and were skipped, and still runs the drawn configurations: the log's
    properties and every cached answer against a fresh server's (restore_equivalence), counted; exit 6, nothing
    failed."""
    binary = build_source(trees("block"), log=lambda _m: None)
    out = tmp_path / "gate.json"
    r = run_harness("gate", "--backend", "server", "--server-bin", str(binary), "--semantics", "shared",
                 "--json", str(out))  # fmt: skip
    no_traceback(r)
    assert r.returncode == 6, r.stdout[-3000:]
    assert "prompt_cache_replaced: on (server_prompt_cache replaced" in r.stdout
    skips = [line for line in r.stdout.splitlines() if line.startswith("  [skip] the model cannot read")]
    assert len(skips) == 1 and "not in tools/server/server-task.h" in skips[0] and "still run:" in skips[0], skips
    report = json.loads(out.read_text())
    assert "model-exact" in report["skipped"]["server backend: model-exact checks"]
    props = {p["name"]: p for p in report["properties"]}
    assert props["restore_equivalence"]["status"] == "passed" and props["restore_equivalence"]["examples"] > 0
    assert props["limit"]["examples"] > 0 and props["checkpoint_lists"]["examples"] > 0, props
    assert "[ok  ] drawn configurations" in r.stdout
    assert "outputs checked against a fresh server" not in r.stdout  # no machine of the model ran
