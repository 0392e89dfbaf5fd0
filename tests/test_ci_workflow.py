"""The drop-in workflow for a llama.cpp fork (ci/github/prompt-cache-gate.yml) and its one script.

The YAML is validated with the GitHub Actions workflow schema (check-jsonschema's vendored copy, no
network) and linted with zizmor; every step that runs something calls ci/fork_gate.sh, and the
script itself runs here, end to end, on a llama.cpp tree outside the build cache.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from harness.trees import build as ls

REPO = Path(__file__).resolve().parent.parent
WORKFLOW = REPO / "ci" / "github" / "prompt-cache-gate.yml"
SCRIPT = REPO / "ci" / "fork_gate.sh"


def _tool(name: str) -> str:
    path = shutil.which(name) or str(Path(sys.executable).parent / name)
    assert Path(path).is_file(), f"{name} is a test dependency (pip install -e '.[test]')"
    return path


def test_workflow_matches_the_github_actions_schema() -> None:
    r = subprocess.run(
        [_tool("check-jsonschema"), "--builtin-schema", "vendor.github-workflows", str(WORKFLOW)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def test_workflow_passes_zizmor() -> None:
    r = subprocess.run([_tool("zizmor"), "--offline", str(WORKFLOW)], capture_output=True, text=True, check=False)
    assert r.returncode == 0, r.stdout + r.stderr


def test_every_run_step_calls_the_script() -> None:
    runs = re.findall(r"^\s+run: (.+)$", WORKFLOW.read_text(), re.M)
    assert runs, "no run steps"
    steps = [r.split() for r in runs]
    assert all(s[0] == "harness/ci/fork_gate.sh" for s in steps), runs
    assert [s[1] for s in steps] == ["install", "build", "server", "default", "memory"]
    assert "path: artifacts/" in WORKFLOW.read_text()  # the reports are uploaded


def test_script_refuses_bad_arguments() -> None:
    for args in ([], ["nonsense"], ["server", "/nonexistent", "out"], ["build"], ["default", "/nonexistent", "out"]):
        r = subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, check=False)
        assert r.returncode == 2, (args, r.stdout, r.stderr)


@pytest.mark.llama_server_builds  # built before the first test (tests/conftest.py)
def test_script_runs_the_gate_on_a_local_tree(tmp_path: Path) -> None:
    """The vendored tree copied elsewhere with the PR patch: the script builds (a cache hit by
    content), runs the server backend and a gate, and leaves the reports the workflow uploads."""
    tree = tmp_path / "llama.cpp"
    subprocess.run(["cp", "-a", str(ls.sdist_source()), str(tree)], check=True)
    (tree / ".git").unlink(missing_ok=True)
    subprocess.run(["patch", "-p1", "-s", "-d", str(tree), "-i", str(ls.PATCH_PATH)], check=True)
    out = tmp_path / "artifacts"
    env = {
        **os.environ,
        "PYTHON": sys.executable,
        "SERVER_GATE_ARGS": "--max-examples 1",
        "GATE_ARGS": "--backend llama --arch llama --max-examples 5",
    }
    r = subprocess.run([str(SCRIPT), "all", str(tree), str(out)], capture_output=True, text=True, env=env, check=False)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    server = json.loads((out / "gate-server.json").read_text())
    assert server["passed"] and server["server"]["build"] == f"source {tree}"
    assert server["semantics"] == "shared" and server["server"]["pinned"] is True
    default = json.loads((out / "gate.json").read_text())
    pinned_lib = (ls.build_server("shared").parent / "libllama.so").resolve()  # a copy of the pinned tree: its build
    assert default["passed"] and Path(default["llama_lib"]).resolve() == pinned_lib
    for xml in ("gate-server.xml", "gate.xml"):
        assert ET.parse(out / xml).getroot().tag == "testsuite"
    memory = json.loads((out / "memory.json").read_text())
    assert memory["save_peak"][f"source {tree}"]["rss_peak_bytes"] > 0
    assert "| large allocation # of a save |" in (out / "memory.md").read_text()
    assert "fork_gate: done, exit 0" in r.stdout


@pytest.mark.parametrize("missing", [True, False])
def test_memory_summary_exit_codes(tmp_path: Path, missing: bool) -> None:
    src = tmp_path / "gate-server.json"
    if not missing:
        src.write_text(json.dumps({"passed": True, "server": {"build": "build pr", "memory": {}}}))
    r = subprocess.run(
        [sys.executable, "-m", "ci.memory_summary", str(src), str(tmp_path / "o")],
        capture_output=True, text=True, cwd=REPO, check=False,
    )  # fmt: skip
    assert r.returncode == (2 if missing else 0), r.stderr
