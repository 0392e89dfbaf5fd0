"""Each server-side property fails on a ``llama-server`` built from the pinned tree with one C++ line of ours
changed (a mutant made at run time from the pinned sdist, ``conftest.TREES``; never committed as a tree), and holds
on the pinned build: the server's own log (no model needed), the differential's agreement with the model, the
drawn configurations at the limits, and the gate's steps after the backend (stateless tasks, ``--cache-reuse``
and context shifts, slot files). Each failure carries a program that replays it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, Trees, no_traceback, run_harness

from harness.backends.llama_server.differential import (
    LIMIT_PROGRAMS,
    MachineStats,
    ServerMismatch,
    run_program,
    server_machine,
)
from harness.backends.llama_server.limits import (
    LimitStats,
    failed_load_program,
    limits_machine,
    run_limit_program,
    shrink_steps,
)
from harness.backends.llama_server.section import hypothesis_settings
from harness.experiments.full_disk import full_disk, full_disk_program
from harness.load.concurrent import load_config, run_concurrent
from harness.load.edges import edges_program, run_edges
from harness.load.gate_step import (
    N_TRACES,
    REUSE_EXAMPLES,
    SLOT_EXAMPLES,
    STATELESS_RUNS,
    stateless_config,
    stateless_program,
)
from harness.load.reuse_programs import run_model as run_reuse_programs
from harness.load.slot_programs import run_model as run_slot_programs
from harness.load.stateless import stateless_differential
from harness.targets.llama_server import ServerConfig
from harness.targets.server_log import LOG_PROPERTIES
from harness.trees.build import build_server, build_source
from properties.run import run_seeded

pytestmark = [pytest.mark.llama_server_builds, pytest.mark.user_trees]  # built before the first test (conftest)


# --------------------------------------------------------------------------------------------
# the server-side properties, each killed by a C++ mutant (the server's own log, no model needed)
# --------------------------------------------------------------------------------------------

#: tree (one line of the pinned tree changed, tests/conftest.py) -> the gate's program at the limit it breaks,
#: and the property of harness.targets.server_log the server's log must show broken
SERVER_MUTANTS = {
    "threshold": ("load-threshold", "load_choice"),
    "cap": ("checkpoint-cap", "checkpoint_lists"),
    "room": ("eviction", "alloc_eviction"),
    "tokens": ("token-limit", "limit"),
    "size": ("eviction", "accounting"),
    "transfer": ("load-threshold", "load_transfer"),
    "contained": ("prefix-entry", "no_prefix_entries"),
    "newest": ("eviction", "alloc_eviction"),
    "extra": ("eviction", "alloc_eviction"),
    "kept": ("cleared-slot", "cleared_checkpoints"),
    "early": ("token-limit", "update_eviction"),
}


@pytest.mark.parametrize("name", sorted(SERVER_MUTANTS))
def test_each_server_side_property_fails_on_its_cpp_mutant(trees: Trees, name: str) -> None:
    program, prop = SERVER_MUTANTS[name]
    binary = build_source(trees(name), log=lambda _m: None)
    cfg, requests = LIMIT_PROGRAMS[program]()
    with pytest.raises(ServerMismatch) as caught:
        run_program(cfg, requests, binary, "shared", None)
    e = caught.value
    assert e.name == prop and e.message.startswith("the server's log: "), (e.name, e.message)
    assert "Differential(" in e.program and "d.check(d.request(" in e.program  # the program that replays it


def test_the_pinned_build_holds_every_server_side_property_at_every_limit() -> None:
    """Each property of the log is checked (and holds) on the pr build, over the gate's programs at the limits and
    its failed-load program (a load without room under a unified KV: the one no model-exact program can reach)."""
    binary = build_server("shared")
    seen: dict[str, int] = {}
    for make in LIMIT_PROGRAMS.values():
        rows = run_program(*make(), binary, "shared", None)
        for k, v in rows[-1].log_checked.items():
            seen[k] = seen.get(k, 0) + v
    done = run_limit_program(*failed_load_program(), binary, None)
    for k, v in done.log.checked.items():
        seen[k] = seen.get(k, 0) + v
    assert done.log.checked["restore_failure"] == 1, done.log.checked
    assert all(seen.get(p, 0) > 0 for p in LOG_PROPERTIES), seen


def test_a_failed_load_that_keeps_its_slot_fails_restore_failure(trees: Trees) -> None:
    """C++ mutant ``load-keeps``: a cache load that fails leaves its slot as it was instead of clearing it
    (server-context.cpp:1630-1632). The failed-load program (requests alone: a unified KV without room for the
    entry) fails ``restore_failure`` from the server's log, with a program that replays it."""
    binary = build_source(trees("load-keeps"), log=lambda _m: None)
    with pytest.raises(ServerMismatch) as caught:
        run_limit_program(*failed_load_program(), binary, None, f"Path({str(binary)!r})")
    e = caught.value
    assert e.name == "restore_failure" and "a failed load clears the slot" in e.message, (e.name, e.message)
    r = subprocess.run([sys.executable, "-c", e.program], capture_output=True, text=True, cwd=REPO, timeout=300,
                       check=False)  # fmt: skip
    assert r.returncode == 1 and "restore_failure" in r.stderr, r.stdout + r.stderr[-2000:]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", ["threshold", "size", "cap", "transfer"])
def test_the_drawn_configurations_kill_the_cpp_mutants_on_any_seed(trees: Trees, name: str, seed: int) -> None:
    """The gate's drawn configurations (harness.backends.llama_server.limits) reach these mutants' limits without a
    fixed program (the token-limit and make-room mutants are the fixed programs' to kill: a drawn cache rarely holds
    enough tokens or MiB within the ci profile's budget)."""
    binary = build_source(trees(name), log=lambda _m: None)
    stats = LimitStats()
    with pytest.raises(ServerMismatch) as caught:
        run_seeded(limits_machine(binary, stats, None), hypothesis_settings("ci", None), seed)
    assert caught.value.name == SERVER_MUTANTS[name][1], caught.value.message
    assert "LimitRun(ServerConfig(" in caught.value.program and stats.examples >= 1


def test_checkpoints_at_other_positions_fail_checkpoint_policy_against_the_model(trees: Trees) -> None:
    """C++ mutant ``checkpoint-offset`` (the prompt's last checkpoint 5 tokens before its end, not 4): each request's
    checkpoints, as the server's log says it created them, against the model's ``create_checkpoint``: the gate's fixed
    program at the checkpoint cap fails ``checkpoint_policy`` on its first request, where ``cache_n`` still agrees, and
    so does the differential machine of every configuration that creates checkpoints, on seeds 0 and 1."""
    binary = build_source(trees("checkpoint-offset"), log=lambda _m: None)
    with pytest.raises(ServerMismatch) as caught:
        run_program(*LIMIT_PROGRAMS["checkpoint-cap"](), binary, "shared", None)
    e = caught.value
    assert e.name == "checkpoint_policy" and "[(0, 232), (0, 295)]" in e.message, e.message
    assert e.program.count("d.check(d.request(") == 1, e.program
    for seed in (0, 1):
        with pytest.raises(ServerMismatch) as caught:
            run_seeded(server_machine(ServerConfig("mamba"), binary, "shared", MachineStats(), None),
                       hypothesis_settings("ci", None), seed)  # fmt: skip
        assert caught.value.name == "checkpoint_policy", caught.value.message


@pytest.mark.parametrize("seed", [0, 1])
def test_an_idle_slot_kept_under_a_unified_kv_fails_idle_pass(trees: Trees, seed: int) -> None:
    """C++ mutant ``idle-kept``: the idle-slot pass saves an idle slot under a unified KV and no longer clears it
    (server-context.cpp:2429): each request's pass, (slot, cleared) as the log says, against the model's fails
    ``idle_pass`` on the first request whose launch passes over an idle slot."""
    binary = build_source(trees("idle-kept"), log=lambda _m: None)
    with pytest.raises(ServerMismatch) as caught:
        run_seeded(server_machine(ServerConfig("jamba", kv_unified=True), binary, "shared", MachineStats(), None),
                   hypothesis_settings("ci", None), seed)  # fmt: skip
    e = caught.value
    assert e.name == "idle_pass" and "the idle-slot pass took (slot, cleared)" in e.message, e.message
    server_side = e.message.split("the idle-slot pass took (slot, cleared) ")[1].split(" on the server")[0]
    assert "False)" in server_side and "True)" not in server_side, e.message  # saved, never cleared
    assert e.program.count("d.check(d.request(") >= 1


@pytest.mark.parametrize("seed", [0, 1])
def test_a_stateless_task_that_updates_the_cache_fails_stateless_not_cached_in_the_gates_stateless_step(
    trees: Trees, seed: int
) -> None:
    """C++ mutant ``stateless-saves``: an embedding or rerank that takes a slot by LRU saves the slot's prompt and
    loads an entry as a completion does (server-context.cpp:1621 removed). The gate's stateless step without the
    idle-slot cache sees the entries left by stateless tasks differ from the model's and fails
    ``stateless_not_cached``; its printed program replays it in a new process; the pinned build passes the same
    programs, with the idle-slot cache on and off, every stateless request counted."""
    binary = build_source(trees("stateless-saves"), log=lambda _m: None)
    d = stateless_differential(stateless_config(False), binary, "shared", seed, STATELESS_RUNS)
    assert "stateless_not_cached" in d.failed_all, d.problems
    assert any("entries left by stateless tasks: server [" in p for p in d.problems)
    r = subprocess.run([sys.executable, "-c", stateless_program(binary, "shared", seed, False)], capture_output=True,
                       text=True, cwd=REPO, timeout=300, check=False)  # fmt: skip
    assert r.returncode == 0 and "entries left by stateless tasks: server [" in r.stdout, r.stdout + r.stderr
    for idle in (True, False):
        held = stateless_differential(stateless_config(idle), build_server("shared"), "shared", seed, STATELESS_RUNS)
        assert held.failed is None and held.fresh_checked == held.stateless_requests > 0, held.problems


@pytest.mark.parametrize(("tree", "prop"), [("reuse-chunk", "reuse_chunks"), ("shift-early", "shift_timing"),
                                          ("shift-discard", "context_shift")])  # fmt: skip
def test_the_reuse_step_fails_a_server_whose_chunk_loop_or_context_shift_changed(
    trees: Trees, tree: str, prop: str
) -> None:
    """C++ mutants of the ``--cache-reuse`` chunk loop (``reuse-chunk``: runs of more than N tokens,
    server-context.cpp:3241), of when a context shifts (``shift-early``: at n_tokens + 2 >= n_ctx, :2892) and of how
    much it discards (``shift-discard``: a third, :2923): the gate's reuse step fails each by its own property, with
    a shrunk program that replays it on that binary in a new process."""
    binary = build_source(trees(tree), log=lambda _m: None)
    fig = run_reuse_programs("llama", binary, examples=REUSE_EXAMPLES, seed=0, binary_expr=f"Path({str(binary)!r})")
    assert fig.failure is not None and fig.failure.name == prop, fig.failure and fig.failure.message
    r = subprocess.run([sys.executable, "-c", fig.failure.program], capture_output=True, text=True, cwd=REPO,
                       timeout=300, check=False)  # fmt: skip
    assert r.returncode == 1 and f"GeneratedFailure: {prop}: " in r.stderr, r.stdout + r.stderr[-2000:]


@pytest.mark.parametrize("seed", [0, 1])
def test_a_server_that_resumes_from_less_than_its_slots_prefix_fails_reuse(trees: Trees, seed: int) -> None:
    """C++ mutant ``reuse-short``: a request keeps three quarters of the prefix its slot shares with it
    (server-context.cpp:3200). The differential machine holds each answer's ``cache_n`` to the best usable source
    the model saw before it holds it to the model's ``cache_n``, so the failure is ``reuse``, with a program that
    replays it; the pinned build passes the same seed with ``reuse`` counted on its requests."""
    with pytest.raises(ServerMismatch) as caught:
        run_seeded(server_machine(ServerConfig("llama"), build_source(trees("reuse-short"), log=lambda _m: None),
                                  "shared", MachineStats(), None), hypothesis_settings("ci", None), seed)  # fmt: skip
    e = caught.value
    assert e.name == "reuse" and "the best usable source held" in e.message, (e.name, e.message)
    assert e.program.count("d.check(d.request(") >= 1
    stats = MachineStats()
    run_seeded(server_machine(ServerConfig("llama"), build_server("shared"), "shared", stats, None),
               hypothesis_settings("ci", None), seed)  # fmt: skip
    assert 0 < stats.log_checks["reuse"] <= stats.requests, (stats.log_checks, stats.requests)


@pytest.mark.parametrize("seed", [0, 1])
def test_a_restore_that_keeps_the_slots_checkpoints_fails_slot_file_restore(trees: Trees, seed: int) -> None:
    """C++ mutant ``restore-keeps``: a slot file's restore replaces the slot's tokens but keeps the checkpoints of
    the prompt it held before (server-context.cpp:2618, ``slot->prompt.clear()`` dropped). The gate's slot-file step
    on jamba fails ``slot_file_restore`` on the completion after a restore, with a shrunk program that replays it on
    that binary in a new process; the pinned build passes the same seed, every restore counted."""
    binary = build_source(trees("restore-keeps"), log=lambda _m: None)
    fig = run_slot_programs("jamba", binary, examples=SLOT_EXAMPLES, seed=seed, binary_expr=f"Path({str(binary)!r})")
    assert fig.failure is not None and fig.failure.name == "slot_file_restore", fig.failure and fig.failure.message
    assert "r.action('restore'" in fig.failure.program
    r = subprocess.run([sys.executable, "-c", fig.failure.program], capture_output=True, text=True, cwd=REPO,
                       timeout=300, check=False)  # fmt: skip
    assert r.returncode == 1 and "GeneratedFailure: slot_file_restore: " in r.stderr, r.stdout + r.stderr[-2000:]
    held = run_slot_programs("jamba", build_server("shared"), examples=SLOT_EXAMPLES, seed=seed)
    assert held.failure is None and held.restore_checks == held.restores > 0, held.failure


@pytest.mark.skipif(os.geteuid() != 0, reason="the full-disk step mounts a tmpfs (root only)")
def test_a_save_that_answers_200_for_a_failed_write_fails_no_partial_file_at_the_full_disks_boundaries(
    trees: Trees,
) -> None:
    """C++ mutant ``save-error-ok``: a slot save whose write failed (``nwrite`` 0) answers 200
    (server-context.cpp:2558-2561). The full-disk step saves at every page of free space and fails
    ``no_partial_file`` on each partial file no registered finding's shape explains (a 200 for a file short by more
    than the stdio buffer), with a program that replays it in a new process; the pinned build leaves partial files
    only in the registered shapes, each counted: a 500 at 0 to 12 KiB free, a 200 losing the buffered tail at 16 KiB."""
    binary = build_source(trees("save-error-ok"), log=lambda _m: None)
    d = full_disk(binary)
    assert d.problems and d.died is None, d.to_json()
    first = "a save of 17548 bytes with 0 bytes free answered 200, n_written 0: 0 of 17548 bytes on disk"
    assert d.problems[0] == first, d.problems
    r = subprocess.run([sys.executable, "-c", full_disk_program(f"Path({str(binary)!r})")], capture_output=True,
                       text=True, cwd=REPO, timeout=300, check=False)  # fmt: skip
    assert r.returncode == 1 and "answered 200, n_written 0" in r.stdout, r.stdout + r.stderr[-2000:]
    held = full_disk(build_server("shared"))
    assert not held.problems and held.died is None and held.checked == 7, held.to_json()
    assert held.findings == {"slot-save-partial-file": 4, "slot-save-silent-truncation": 1}, held.findings


#: tree -> the edge case (harness.load.edges) it fails, that case's property and the start of its first problem
EDGE_MUTANTS = {
    # prompt_clear dropped from a failed restore's catch (server-context.cpp:2620)
    "failed-restore-keeps": ("foreign-files", "after a failed restore of long.bin the slot resumed the prompt it held "
                             "from 36 tokens: not cleared"),
    # an erase of a slot that is processing runs at once (server-context.cpp:2649-2654, the defer dropped)
    "busy-erase": ("deferred-actions", "the erase sent while a completion ran on its slot answered"),
    # a save's name not validated (server-context.cpp:5275)
    "name-unchecked": ("hostile-name", "a save named '../escape.bin' answered 200"),
    # checkpoints whatever --ctx-checkpoints says (server-context.cpp:3441): the server dies making one
    "checkpoints-always": ("no-checkpoints", "a request got no usable answer: POST /completion: the connection closed "
                           "before an answer; the server died"),
}  # fmt: skip


@pytest.mark.parametrize("tree", sorted(EDGE_MUTANTS))
def test_an_edge_case_fails_its_property_on_its_mutant_and_its_program_replays_it(trees: Trees, tree: str) -> None:
    """C++ mutants of the edge cases (:mod:`harness.load.edges`): the case finds the problem on the mutant's
    server (among others its timing decides: an erase at once may also change the completion it cut into), and its
    program (the one the gate prints) exits 1 with it in a new process; the pinned build holds every case
    (``test_edges.py``)."""
    case, first = EDGE_MUTANTS[tree]
    binary = build_source(trees(tree), log=lambda _m: None)
    res = run_edges(binary, names=(case,))[0]
    assert any(p.startswith(first) for p in res.problems), res.to_json()
    assert res.died == (tree == "checkpoints-always"), res.to_json()  # a crash only where the server really died
    p = subprocess.run([sys.executable, "-c", edges_program(f"Path({str(binary)!r})", case)], capture_output=True,
                       text=True, cwd=REPO, timeout=300, check=False)  # fmt: skip
    assert p.returncode == 1 and first in p.stdout, p.stdout + p.stderr[-2000:]


def test_the_gate_fails_an_edge_cases_property_with_its_program(trees: Trees, tmp_path: Path) -> None:
    """The gate's edge step on the mutant ``failed-restore-keeps``: the gate exits 1, its JSON fails
    ``cleared_checkpoints`` on the machine ``server-edge-foreign-files`` with the case's program, and counts the
    case's checks in the property table."""
    binary = build_source(trees("failed-restore-keeps"), log=lambda _m: None)
    r = run_harness("gate", "--backend", "server", "--server-bin", str(binary), "--semantics", "shared",
                    "--json", str(tmp_path / "gate.json"), timeout=1800)  # fmt: skip
    no_traceback(r)
    report = json.loads((tmp_path / "gate.json").read_text())
    edges = [f for f in report["failures"] if f["machine"] == "server-edge-foreign-files"]
    assert r.returncode == 1 and edges, r.stdout[-3000:]
    assert edges[0]["property"] == "cleared_checkpoints", edges[0]
    assert edges[0]["message"].startswith("edge foreign-files: " + EDGE_MUTANTS["failed-restore-keeps"][1]), edges[0]
    assert "run_edges(" in edges[0]["program"] and "('foreign-files',)" in edges[0]["program"], edges[0]
    assert "[FAIL] edge foreign-files" in r.stdout, r.stdout[-3000:]


def test_an_idle_pass_that_saves_a_processing_slot_fails_busy_slot_untouched(trees: Trees, tmp_path: Path) -> None:
    """C++ mutant ``idle-busy``: the idle-slot pass saves every slot, also one that is processing
    (server-context.cpp:2418). The concurrent step reads each slot's launches and releases from the log and fails
    ``busy_slot_untouched`` on the first save of a processing slot, with the timed requests that replay it (the
    replay reads its own server's log too); the pinned build passes the same traces with the saves counted."""
    cfg = load_config("llama", 2, False)
    binary = build_source(trees("idle-busy"), log=lambda _m: None)
    r = run_concurrent(cfg, binary, "shared", 0, N_TRACES, log_dir=str(tmp_path), binary_expr=f"Path({str(binary)!r})",
                       out=lambda _m: None)  # fmt: skip
    assert r.busy_touches > 0 and r.program, r.failures
    first = next(f for f in r.failures if f.startswith("busy_slot_untouched: "))
    assert "the idle-slot pass saved slot" in first and "while it was processing" in first
    replayed = subprocess.run([sys.executable, "-c", r.program], capture_output=True, text=True, cwd=REPO,
                              timeout=600, check=False)  # fmt: skip
    assert "busy_slot_untouched: the idle-slot pass saved slot" in replayed.stdout, replayed.stdout + replayed.stderr
    held = run_concurrent(cfg, build_server("shared"), "shared", 0, N_TRACES, log_dir=str(tmp_path),
                          out=lambda _m: None)  # fmt: skip
    assert held.busy_touches == 0 and held.busy_checked > 0 and held.mismatches == 0, held.failures


@pytest.mark.parametrize("seed", [0, 1])
def test_a_stateless_task_that_resumes_from_the_slots_prefix_fails_stateless_fresh(trees: Trees, seed: int) -> None:
    """C++ mutant ``stateless-resumes``: an embedding or rerank keeps the slot's common prefix as a completion does
    (server-context.cpp:3198, ``&& !is_stateless_task`` dropped). The stateless step reads each stateless task's
    lines of the log and fails ``stateless_fresh`` ("resumed from N cached tokens"), with the idle-slot cache on
    (the step's first run); the pinned build passes these programs (the test above)."""
    binary = build_source(trees("stateless-resumes"), log=lambda _m: None)
    d = stateless_differential(stateless_config(True), binary, "shared", seed, STATELESS_RUNS)
    assert d.failed == "stateless_fresh", d.problems
    assert any("cached tokens; a stateless task starts from none" in p for p in d.problems), d.problems


@pytest.mark.parametrize("seed", [0, 1])
def test_the_drawn_configurations_refuse_a_prompt_of_the_slots_context_and_fail_a_server_that_takes_it(
    trees: Trees, seed: int
) -> None:
    """C++ mutant ``edge``: a prompt of exactly the slot's ``n_ctx`` tokens is taken (server-context.cpp:3186 ``>=``
    made ``>``): the drawn configurations' context edge fails ``slot_within_ctx`` with a program that replays it, and
    the pinned build passes the same seed, with the property counted."""
    stats = LimitStats()
    with pytest.raises(ServerMismatch) as caught:
        run_seeded(limits_machine(build_source(trees("edge"), log=lambda _m: None), stats, None),
                   hypothesis_settings("ci", None), seed)  # fmt: skip
    assert caught.value.name == "slot_within_ctx", caught.value.message
    assert "the server refuses a prompt of n_ctx tokens" in caught.value.message
    assert "r.boundary([" in caught.value.program
    held = LimitStats()
    run_seeded(limits_machine(build_server("shared"), held, None), hypothesis_settings("ci", None), seed)
    assert held.boundaries >= 1 and held.checked["slot_within_ctx"] > held.requests, held


@pytest.mark.parametrize("seed", [0, 1])
def test_restore_equivalence_fails_on_a_server_whose_cache_load_corrupts_the_state(trees: Trees, seed: int) -> None:
    """C++ mutant ``corrupt``: ``server_prompt_cache::load`` restores an entry with a 128th of its bytes zeroed; the
    restore succeeds and ``cache_n`` is what the model says, so only a cached answer against a fresh server's shows
    it: the gate's differential machine fails ``restore_equivalence`` (the pinned build passes the same machine: the
    gate's own run)."""
    binary = build_source(trees("corrupt"), log=lambda _m: None)
    cfg = ServerConfig("llama", n_parallel=1, cache_ram_mib=8, n_ctx=1024)
    stats = MachineStats()
    with pytest.raises(ServerMismatch) as caught:
        run_seeded(server_machine(cfg, binary, "shared", stats, None, binary_expr=f"Path({str(binary)!r})"),
                   hypothesis_settings("ci", None), seed)  # fmt: skip
    e = caught.value
    assert e.name == "restore_equivalence", (e.name, e.message)
    assert "a fresh server generates" in e.message and "d.request(" in e.program, e.message
    # the printed program holds each answer to a fresh server too, so pasted it fails where the run did (before,
    # it replayed the requests alone and passed: found on b9093)
    assert "print(d.compare_output(fresh, row))" in e.program, e.program
    r = subprocess.run([sys.executable, "-c", e.program], capture_output=True, text=True, cwd=REPO, timeout=300,
                       check=False)  # fmt: skip
    assert r.returncode == 1 and "ServerMismatch: [restore_equivalence]" in r.stderr, r.stdout + r.stderr[-2000:]


def test_the_drawn_configurations_fail_restore_equivalence_on_the_corrupt_mutant_and_shrink_it(trees: Trees) -> None:
    """The drawn configurations hold every cached answer to a fresh server's: on ``corrupt`` some seed of the first
    four fails ``restore_equivalence`` there (a drawn configuration loads from its cache only now and then), and the
    failing steps shrink on fresh servers to a program that still fails it."""
    binary = build_source(trees("corrupt"), log=lambda _m: None)
    found: ServerMismatch | None = None
    for seed in range(4):
        stats = LimitStats()
        try:
            run_seeded(limits_machine(binary, stats, None, fresh=True), hypothesis_settings("ci", None), seed)
        except ServerMismatch as e:
            if e.name == "restore_equivalence":
                found = e
                break
    assert found is not None, "no seed of 0..3 failed restore_equivalence on the drawn configurations"
    assert stats.last is not None
    small, how = shrink_steps(stats.last, "restore_equivalence")
    assert small is not None and small.name == "restore_equivalence", how
    assert small.program.count("r.request(") <= found.program.count("r.request("), how
    assert "fresh=True" in small.program and how.startswith("shrunk from "), how


def test_the_server_gate_fails_a_cpp_mutant_by_the_property_it_breaks(trees: Trees, tmp_path: Path) -> None:
    """As a user would see it: gate --backend server on a llama-server whose token limit is enforced only with a byte
    limit too exits 1 with the property limit failed in the table and the JSON, the others checked and held."""
    binary = build_source(trees("tokens"), log=lambda _m: None)
    out = tmp_path / "gate.json"
    r = run_harness("gate", "--backend", "server", "--server-bin", str(binary), "--semantics", "shared",
                 "--json", str(out))  # fmt: skip
    no_traceback(r)
    assert r.returncode == 1, r.stdout[-3000:]
    report = json.loads(out.read_text())
    props = {p["name"]: p for p in report["properties"]}
    assert props["limit"]["status"] == "failed"
    assert any(f["property"] == "limit" and "token limit" in f["message"] for f in report["failures"])
    held = [n for n in ("accounting", "checkpoint_lists", "load_choice", "alloc_eviction") if props[n]["examples"] > 0]
    assert held == ["accounting", "checkpoint_lists", "load_choice", "alloc_eviction"], props
    assert "FAILED limit" in r.stdout and ("LimitRun(" in r.stdout or "Differential(" in r.stdout)
    hidden = {n for n, p in props.items() if p["status"] == "not-observable"}
    assert hidden == {"immutability", "refcount", "draft_in_step", "restore_bytes", "reuse_equivalence",
                      "draft_recovery"} and all(
        props[n]["why"] for n in hidden), props  # fmt: skip
    assert "  refcount             not-observable" in r.stdout
