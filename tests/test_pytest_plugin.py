"""The pytest plugin (harness.pytest_plugin): the marker fails what breaks an invariant, the fixtures work,
the server fixture always stops its process and skips or refuses clearly, and the example in
docs/writing-tests.md is the suite's."""

from __future__ import annotations

import re
import sys
import time
from pathlib import Path

import pytest

from faults.rlimit import LimitedRun
from harness.pytest_plugin import NativeFaults
from harness.trees.build import cached_binary

pytestmark = pytest.mark.llama_server_builds  # built before the first test (tests/conftest.py)

pytest_plugins = ["pytester"]

ROOT = Path(__file__).resolve().parents[1]
PLUGIN = ("-p", "harness.pytest_plugin", "--strict-markers", "-p", "no:cacheprovider")
MiB = 1 << 20

BREAKERS = """
import pytest
from harness.model import ServerParams

PROMPT = tuple(1 + (i * 7) % 23 for i in range(48))


def _serve(server, prompts=(PROMPT, (50,) * 40, (*PROMPT, 7, 8))):
    for prompt in prompts:
        server.handle_completion(prompt, n_predict=2)
        server.run_until_idle()


@pytest.mark.prompt_cache_invariants
def test_leaks_a_payload(modelled_server):
    server = modelled_server("shared", "hybrid", params=ServerParams(n_slots=1))
    _serve(server)
    server.host.alloc_payload("test.leak", 64, "leak")  # alive, and nobody holds it


def test_leaks_a_payload_unmarked(modelled_server):
    server = modelled_server("shared", "hybrid", params=ServerParams(n_slots=1))
    _serve(server)
    server.host.alloc_payload("test.leak", 64, "leak")


@pytest.mark.prompt_cache_invariants
def test_master_copies_checkpoints_on_save(modelled_server):
    _serve(modelled_server("master", "hybrid", params=ServerParams(n_slots=1)))


@pytest.mark.prompt_cache_invariants(strict_peak=False)
def test_master_with_the_peak_only_recorded(modelled_server):
    _serve(modelled_server("master", "hybrid", params=ServerParams(n_slots=1)))


@pytest.mark.prompt_cache_invariants
def test_marked_but_no_modelled_server():
    pass
"""


def test_marker_fails_a_test_that_breaks_an_invariant(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_breakers=BREAKERS)
    reprec = pytester.inline_run(*PLUGIN)
    calls = {
        r.nodeid.split("::")[1]: (r.outcome, str(r.longrepr))
        for r in reprec.getreports("pytest_runtest_logreport")
        if r.when == "call"
    }
    # after the body: a payload alive that no one holds
    outcome, text = calls["test_leaks_a_payload"]
    assert outcome == "failed"
    assert "prompt_cache_invariants: modelled server #0 (shared) after the test: [refcount] 1 payload(s) alive" in text
    assert calls["test_leaks_a_payload_unmarked"][0] == "passed"  # the marker is what fails it
    # during the body: master deep-copies the slot's checkpoints when it saves it (what PR #27451 removes)
    outcome, text = calls["test_master_copies_checkpoints_on_save"]
    assert outcome == "failed" and "Violation: [transient_peak] save peak exceeded live bytes" in text
    assert calls["test_master_with_the_peak_only_recorded"][0] == "passed"
    outcome, text = calls["test_marked_but_no_modelled_server"]
    assert outcome == "failed" and "the test made no server through the modelled_server fixture" in text


def test_marker_is_registered(pytester: pytest.Pytester) -> None:
    result = pytester.runpytest(*PLUGIN, "--markers")
    result.stdout.fnmatch_lines(["@pytest.mark.prompt_cache_invariants(strict_peak=True): *"])


def test_the_documented_example_is_the_suite_example() -> None:
    page = (ROOT / "docs" / "writing-tests.md").read_text()
    block = re.search(r"```python\n(.*?)```", page, re.S)
    assert block is not None
    example = (ROOT / "tests" / "test_plugin_example.py").read_text()
    assert block.group(1) == example[example.index("import pytest") :]


# ---- fixtures ---------------------------------------------------------------------------------------


def test_tiny_model(tiny_model: object) -> None:
    assert callable(tiny_model)
    for arch in ("llama", "draft", "jamba"):
        p = tiny_model(arch)
        assert p.is_file() and p.suffix == ".gguf" and p.read_bytes()[:4] == b"GGUF"


def test_rlimited(rlimited: object) -> None:
    assert callable(rlimited)
    small: LimitedRun = rlimited(lambda n: len(bytearray(n)), 4 * MiB, headroom=64 * MiB)
    assert small.ok and small.value == 4 * MiB and small.limit_bytes == small.baseline_bytes + 64 * MiB
    big: LimitedRun = rlimited(lambda n: len(bytearray(n)), 256 * MiB, headroom=64 * MiB)
    assert big.outcome == "accepted-error" and big.peak_bytes <= big.limit_bytes  # type: ignore[operator]
    assert rlimited(lambda: 1 / 0).error == "ZeroDivisionError: division by zero"


def test_native_faults_run_fails_the_nth_large_allocation(native_faults: NativeFaults) -> None:
    code = "import sys; a = bytearray(1 << 20); print('first'); sys.stdout.flush(); b = bytearray(1 << 20)"
    ok = native_faults.run([sys.executable, "-c", code], 3)
    assert ok.returncode == 0, ok.stderr
    second = native_faults.run([sys.executable, "-c", code], 2)
    assert second.returncode == 1 and second.stdout == "first\n" and "MemoryError" in second.stderr


# ---- the real server --------------------------------------------------------------------------------

SERVER_TEST = """
import os

def test_server_is_stopped_even_when_the_test_fails(llama_server):
    srv = llama_server(n_parallel=1, ctx_size=256)
    with open(os.environ["PIDFILE"], "w") as f:
        f.write(str(srv.pid))
    assert srv.completion("Hello", n_predict=2)["content"] is not None
    raise RuntimeError("the test fails; the server must still be stopped")
"""


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _gone(pid: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")  # before pytester points HOME (and so the default cache) elsewhere
def pr_binary() -> Path:
    binary = cached_binary("shared")
    if binary is None:  # tests/test_llama_server.py builds it; this file does not wait 10 minutes for it
        pytest.skip("no cached llama-server (pr) build yet")
    return binary


def test_llama_server_is_always_stopped(
    pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch, pr_binary: Path
) -> None:
    pidfile = pytester.path / "pid"
    monkeypatch.setenv("PIDFILE", str(pidfile))
    pytester.makepyfile(test_server=SERVER_TEST)
    result = pytester.runpytest(*PLUGIN, "--llama-server-bin", str(pr_binary))
    result.assert_outcomes(failed=1)
    result.stdout.fnmatch_lines(["*RuntimeError: the test fails; the server must still be stopped*"])
    pid = int(pidfile.read_text())
    assert _gone(pid), f"llama-server {pid} outlived its test"


def test_llama_server_with_native_faults(llama_server: object, native_faults: NativeFaults, pr_binary: Path) -> None:
    assert callable(llama_server)
    srv = llama_server(n_parallel=1, ctx_size=512, cache_ram=16, env=native_faults.env())
    srv.completion("The quick brown fox jumps over the lazy dog. " * 4, n_predict=2)
    # the next prompt saves the slot to the cache first: its state buffer is the first allocation of >= 16 KiB
    native_faults.arm(srv.pid, 1, min_size=16 * 1024)
    assert srv.completion("Something entirely different goes here now. " * 4, n_predict=2)["content"] is not None
    assert native_faults.disarm(srv.pid) == 1 and srv.running()
    assert srv.log_path is not None
    assert "failed to allocate memory for prompt cache state: std::bad_alloc" in srv.log_path.read_text()
    seen = native_faults.observe()  # where it failed, from the stack the shim wrote then
    assert seen.failed == 1 and seen.signal is None
    assert seen.site is not None and seen.site.function == "server_prompt_cache::alloc", seen.frames


def test_native_faults_refuse_a_process_started_without_the_shim(
    llama_server: object, native_faults: NativeFaults, pr_binary: Path
) -> None:
    assert callable(llama_server)
    srv = llama_server(n_parallel=1, ctx_size=256)
    with pytest.raises(Exception, match="was not started with this RemoteShim's env"):
        native_faults.arm(srv.pid, 1)
    assert srv.running()  # SIGUSR2 was not sent: it would have killed the server


def test_llama_server_skips_when_there_is_no_binary(pytester: pytest.Pytester, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(pytester.path / "empty-cache"))
    pytester.makepyfile(test_server="def test_needs_a_server(llama_server):\n    llama_server()\n")
    result = pytester.runpytest(*PLUGIN, "-rs")
    result.assert_outcomes(skipped=1)
    result.stdout.fnmatch_lines(
        ["SKIPPED * no llama-server binary: pass --llama-server-bin PATH, --llama-source DIR, *"]
    )


def test_server_options_are_checked_before_any_test(pytester: pytest.Pytester) -> None:
    pytester.makepyfile(test_nothing="def test_nothing():\n    pass\n")
    missing = pytester.runpytest(*PLUGIN, "--llama-server-bin", str(pytester.path / "nope"))
    assert missing.ret == pytest.ExitCode.USAGE_ERROR
    missing.stderr.fnmatch_lines(["*--llama-server-bin */nope: not an executable file*"])
    both = pytester.runpytest(*PLUGIN, "--llama-server-bin", sys.executable, "--llama-server-semantics", "shared")
    assert both.ret == pytest.ExitCode.USAGE_ERROR
    both.stderr.fnmatch_lines(["*not --llama-server-bin and --llama-server-semantics*"])
