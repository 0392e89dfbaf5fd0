"""PR #27451's save under a real memory limit, on the real pinned builds (:mod:`harness.backends.llama_server.oom`).

A small instance of ``python -m harness oom``: 4 checkpoints of 64 MiB (``mamba2-c64``), the limit
``baseline + S + C/2`` measured per server. In a memory cgroup master's save is OOM-killed (the cgroup's
``oom_kill`` counter and SIGKILL) where the PR's survives and the next request resumes from the cache; under
RLIMIT_AS master's escaping ``std::bad_alloc`` aborts it where the PR's save completes. And a harness killed
with SIGKILL leaves neither a server nor a cgroup behind once the next run has swept.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from harness.backends.llama_server.oom import OomSettings, gate_check, run_oom
from harness.memlimit import PREFIX, cgroup_support, sweep_stale
from harness.trees.build import build_server

pytestmark = pytest.mark.llama_server_builds

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20


def test_in_a_cgroup_master_is_oom_killed_where_the_pr_survives_and_resumes(tmp_path: Path) -> None:
    st = OomSettings(checkpoints=4, size_mib=64, mode="cgroup")
    pr = run_oom(build_server("shared"), "pr", "shared", st, tmp_path)
    master = run_oom(build_server("master"), "master", "master", st, tmp_path)
    for r in (pr, master):
        assert r.n_checkpoints == 4 and 64 <= r.checkpoint_mib_log < 65, r
        assert r.limit_bytes == r.baseline_bytes + r.s_bytes + r.c_bytes // 2
    assert pr.outcome == "survived", pr
    assert pr.oom_kills == 0 and pr.exit_code is None
    assert pr.resumed and pr.cache_n is not None and pr.cache_n > 0, pr
    assert pr.peak_above_baseline is not None and pr.peak_above_baseline < pr.s_bytes + pr.c_bytes // 4
    assert master.outcome == "oom-killed", master
    assert master.exit_signal == "SIGKILL" and master.oom_kills is not None and master.oom_kills >= 1
    assert master.resumed is None  # there was no server left to ask


def test_under_rlimit_as_master_aborts_where_the_pr_completes(tmp_path: Path) -> None:
    st = OomSettings(checkpoints=4, size_mib=64, mode="rlimit")
    pr = run_oom(build_server("shared"), "pr", "shared", st, tmp_path)
    master = run_oom(build_server("master"), "master", "master", st, tmp_path)
    assert pr.outcome == "survived" and pr.bad_alloc == "none" and pr.resumed, pr
    assert master.outcome == "aborted", master
    assert master.exit_signal == "SIGABRT" and master.bad_alloc == "escaped"


def _ours() -> set[str]:
    support = cgroup_support()
    assert support is not None
    return {p.name for p in support[1].iterdir() if p.name.startswith(PREFIX)}


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGINT], ids=["kill-9", "ctrl-c"])
def test_a_killed_or_interrupted_harness_leaves_no_server_and_no_cgroup(tmp_path: Path, sig: signal.Signals) -> None:
    """Ctrl-C: the run removes its group itself and exits 130. kill -9: the server dies with the harness
    (PR_SET_PDEATHSIG) and the next run's sweep removes the group."""
    before = _ours()
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    cmd = [sys.executable, "-P", "-m", "harness", "oom", "--semantics", "shared", "--size", "64", "--mode", "cgroup",
           "--keep-logs", str(tmp_path)]  # fmt: skip
    harness = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        group: Path | None = None
        server = 0
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and not server:  # until its server runs inside its group
            assert harness.poll() is None, harness.stderr.read() if harness.stderr else ""
            support = cgroup_support()
            assert support is not None
            for name in _ours() - before:
                procs = (support[1] / name / "cgroup.procs").read_text().split()
                if procs:
                    group, server = support[1] / name, int(procs[0])
            time.sleep(0.2)
        assert group is not None and server, "the harness never started its server inside a cgroup"
        harness.send_signal(sig)  # kill -9: no finally, no atexit
        rc = harness.wait(timeout=60)
        deadline = time.monotonic() + 10
        while _alive(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(server), "llama-server outlived the harness"
        if sig == signal.SIGINT:
            assert rc == 130 and not group.exists()
        else:
            assert group.name in sweep_stale()  # what the next run does first
        assert not group.exists()
    finally:
        if harness.poll() is None:
            harness.send_signal(signal.SIGKILL)
            harness.wait()
        sweep_stale()


def test_the_gate_check_files_masters_failures_as_the_prs_claims(tmp_path: Path) -> None:
    """In the server gate master's OOM kill is ``transient_peak`` and its abort ``no_partial_entries``: the two
    claims ``ci/expect_master.py`` expects, so the master gate still fails exactly where the PR says."""
    fails: list[tuple[str, ...]] = []
    section: dict[str, object] = {}
    gate_check(section, "master", "master", build_server("master"), str(tmp_path),
               lambda *a: fails.append(a), lambda _m: None)  # fmt: skip
    assert {(f[0], f[1]) for f in fails} == {("transient_peak", "crash"), ("no_partial_entries", "crash")}
    assert set(section["oom"]) == {"cgroup", "rlimit"}  # type: ignore[arg-type]
