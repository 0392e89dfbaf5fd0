"""``python -m harness soak --memory-limit MIB`` on the real pr llama-server: the soaked server in a memory
cgroup; an OOM kill (the group's ``oom_kill`` counter, SIGKILL) fails the run with the requests that led to
it, and a limit the server stays under passes with the group's peak reported. No group is left behind."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from harness.memlimit import PREFIX, cgroup_support
from harness.trees.build import build_server

pytestmark = pytest.mark.llama_server_builds

ROOT = Path(__file__).resolve().parents[1]
MIB = 1 << 20


@pytest.fixture(scope="module", autouse=True)
def _pr_binary() -> Path:
    return build_server("shared")


def _groups() -> set[str]:
    support = cgroup_support()
    assert support is not None, "the CI machine has a writable memory cgroup (tests/test_memlimit.py)"
    return {p.name for p in support[1].iterdir() if p.name.startswith(f"{PREFIX}{os.getpid()}-")} | {
        p.name for p in support[1].iterdir() if p.name.startswith(PREFIX) and "soak" in p.name
    }


def _soak(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    out = tmp_path / "soak.json"
    p = subprocess.run(
        [sys.executable, "-m", "harness", "soak", "--arch", "llama", "--rss-bound", "100000", "--json", str(out),
         *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)},
    )  # fmt: skip
    assert out.exists(), f"exit {p.returncode} without its JSON:\n{p.stdout}\n{p.stderr}"
    return p, json.loads(out.read_text())


def test_an_oom_kill_under_the_limit_fails_the_soak_with_its_request_program(tmp_path: Path) -> None:
    before = _groups()
    # 14 MiB: the tiny server starts under it, and its growing RAM cache (--cache-ram 512) does not fit
    p, doc = _soak(tmp_path, "--minutes", "0.4", "--memory-limit", "14", "--cache-ram", "512")
    assert p.returncode == 1, p.stdout + p.stderr
    assert doc["passed"] is False and doc["oom_kills"] >= 1 and doc["memory_limit_mib"] == 14
    assert "no libllama trace under --memory-limit" in p.stderr  # its page cache would be charged to the group
    first = p.stdout.split("FAIL: ", 1)[1].splitlines()[0]
    assert "OOM-killed under --memory-limit 14 MiB (SIGKILL, the cgroup's oom_kill" in first, first
    assert "--memory-limit 14" in p.stdout.split("--- replay ---", 1)[1]
    kept = Path(p.stderr.split("server logs kept in ", 1)[1].split()[0])
    try:
        program = json.loads(Path(doc["oom_programs"][0]).read_text())
        assert program["memory_limit_bytes"] == 14 * MIB and program["cgroup_peak_bytes"] <= 14 * MIB
        reqs = program["requests"]
        assert reqs and all(r["prompt"] and r["n_predict"] > 0 for r in reqs)
        assert [r["at_s"] for r in reqs] == sorted(r["at_s"] for r in reqs)
    finally:
        shutil.rmtree(kept, ignore_errors=True)
    assert _groups() == before


def test_a_soak_under_a_limit_it_fits_passes_with_the_peak_reported(tmp_path: Path) -> None:
    p, doc = _soak(tmp_path, "--minutes", "0.1", "--memory-limit", "256")
    assert p.returncode == 0, p.stdout + p.stderr
    assert doc["oom_kills"] == 0 and doc["oom_programs"] == [] and doc["passed"] is True
    for ph in doc["phases"]:
        assert ph["memory_limit_bytes"] == 256 * MIB and 0 < ph["cgroup_peak_bytes"] <= 256 * MIB
    assert "limit 256 MiB, cgroup peak" in p.stdout and "0 OOM kills" in p.stdout

