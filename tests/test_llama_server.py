"""The real llama-server: the cached ``pr`` build, a tiny model, ``/completion`` and process cleanup.

The first run builds llama-server from the llama-cpp-python sdist (tens of minutes on two cores);
later runs reuse the cached binary. Nothing here is skipped: CI must be able to build it.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from harness.cli import main as cli_main
from harness.targets.llama_server import Launch, ServerProcess, ServerStartError, Timeouts
from harness.trees import build as ls
from harness.trees import pinned as llama_pinned
from harness.trees.build import build_server

pytestmark = pytest.mark.llama_server_builds  # built before the first test (tests/conftest.py)

REPO = Path(__file__).resolve().parent.parent
PROMPT = "The quick brown fox jumps over the lazy dog. " * 3


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is as good as gone (only its parent can reap it)
    try:
        with open(f"/proc/{pid}/stat") as fh:
            return fh.read().split(") ", 1)[1][0] != "Z"
    except OSError:
        return False


def _wait_gone(pid: int, timeout: float = 15.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not _alive(pid):
            return True
        time.sleep(0.05)
    return False


@pytest.fixture(scope="module")
def binary() -> Path:
    return build_server("shared", log=lambda m: print(m, file=sys.stderr))


@pytest.fixture(scope="module")
def model() -> Path:
    from fixtures.gguf import model_path

    return model_path("llama")


# --------------------------------------------------------------------------------------------
# build
# --------------------------------------------------------------------------------------------


def test_build_is_cached(binary: Path) -> None:
    assert binary.is_file() and os.access(binary, os.X_OK)
    assert binary.parent.parent == ls.cache_root() / "llama-server"
    assert binary.parent.name.startswith("pr-")
    t0 = time.monotonic()
    again = build_server("shared", log=lambda m: pytest.fail(f"cached build logged {m!r}"))
    assert again == binary
    assert time.monotonic() - t0 < 5.0
    assert (binary.parent / "build-info.json").is_file()


def test_cli_build_server_cached(binary: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["build-server", "--semantics", "shared"]) == 0
    assert capsys.readouterr().out.strip() == str(binary)


def test_cmake_args() -> None:
    master = ls.cmake_args("master")
    for arg in (
        "-DLLAMA_BUILD_SERVER=ON",
        "-DLLAMA_USE_PREBUILT_UI=OFF",
        "-DLLAMA_BUILD_UI=OFF",
        "-DGGML_NATIVE=OFF",
        "-DCMAKE_BUILD_TYPE=Release",
        "-DBUILD_SHARED_LIBS=ON",  # libllama.so beside the server: llama-cpp-python and an interposer use it
        "-DCMAKE_BUILD_RPATH_USE_ORIGIN=ON",
        "-DLLAMA_OPENSSL=OFF",
    ):
        assert arg in master
    assert ls.cmake_args("shared") == master
    assert any("-fsanitize=address,undefined" in a for a in ls.cmake_args("shared", "asan"))
    assert "-DCMAKE_CXX_FLAGS_RELEASE=-O1 -DNDEBUG" in ls.cmake_args("shared", "asan")  # the sanitizers advise -O1


def test_patch_has_header_and_applies_to_vendored_tree(tmp_path: Path) -> None:
    text = ls.PATCH_PATH.read_text()
    assert not text.startswith("diff") and "27451" in text.split("diff --git", 1)[0]
    src = ls.sdist_source()
    for rel in (
        "common/common.h",
        "common/common.cpp",
        "tools/server/server-task.cpp",
        "tools/server/server-context.cpp",
    ):
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes((src / rel).read_bytes())
    r = subprocess.run(
        ["patch", "-p1", "--dry-run", "--batch", "-d", str(tmp_path), "-i", str(ls.PATCH_PATH)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def _fake_source(root: Path, cmakelists: str) -> Path:
    """A stand-in for the extracted sdist: a vendored tree with its hash marker."""
    vendored = root / "sdist" / "llama_cpp_python-0.3.36" / "vendor" / "llama.cpp"
    vendored.mkdir(parents=True)
    (vendored / "CMakeLists.txt").write_text(cmakelists)
    (vendored.parents[1] / ".prompt-cache-harness-source.sha256").write_text("fake\n")
    return vendored


def test_failed_build_is_one_line_and_exit_4(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _fake_source(tmp_path / "prompt-cache-harness", 'message(FATAL_ERROR "broken on purpose")\n')
    rc = cli_main(["build-server", "--semantics", "master"])
    err = capsys.readouterr().err
    assert rc == ls.EXIT_BUILD_FAILED
    assert "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: cmake configure (master) failed") and ".log" in last
    assert "broken on purpose" in err  # the log's last lines are shown
    assert not list((tmp_path / "prompt-cache-harness" / "llama-server").glob(".build-*"))


def test_patch_that_does_not_apply_fails_clearly(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    _fake_source(tmp_path / "prompt-cache-harness", "project(x)\n")
    rc = cli_main(["build-server", "--semantics", "shared"])
    err = capsys.readouterr().err
    assert rc == ls.EXIT_BUILD_FAILED
    assert "error: patch pr-27451.patch does not apply" in err
    assert "Traceback" not in err


def test_bad_jobs_is_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["build-server", "--jobs", "0"]) == 2
    assert capsys.readouterr().err.startswith("error: --jobs")


# --------------------------------------------------------------------------------------------
# running
# --------------------------------------------------------------------------------------------


@pytest.fixture
def server(binary: Path, model: Path) -> Iterator[ServerProcess]:
    with ServerProcess(binary, Launch(model=model, n_parallel=1, ctx_size=512, cache_ram=16, threads=1)) as srv:
        yield srv


def test_completion_returns_text_and_reuses_cache(server: ServerProcess) -> None:
    assert server.url == f"http://127.0.0.1:{server.port}"
    assert server.health() == {"status": "ok"}
    r1 = server.completion(PROMPT, n_predict=8, ignore_eos=True)
    assert isinstance(r1["content"], str)
    assert r1["tokens_predicted"] == 8
    assert r1["timings"]["cache_n"] == 0
    assert r1["timings"]["prompt_n"] > 0
    r2 = server.completion(PROMPT, n_predict=8, ignore_eos=True)
    assert r2["timings"]["cache_n"] > 0
    assert r2["timings"]["prompt_n"] < r1["timings"]["prompt_n"]
    assert r2["content"] == r1["content"]  # temperature 0


def test_prompt_cache_restores_after_slot_is_reused(binary: Path, model: Path) -> None:
    """One slot, --cache-ram on: A is saved to the prompt cache when B takes the slot, then restored."""
    a = PROMPT
    b = "Pack my box with five dozen liquor jugs. " * 3
    with ServerProcess(binary, Launch(model=model, n_parallel=1, ctx_size=512, cache_ram=16)) as srv:
        ra = srv.completion(a, n_predict=2, id_slot=0)
        rb = srv.completion(b, n_predict=2, id_slot=0)
        assert rb["timings"]["cache_n"] <= 1  # only BOS is shared with A
        r = srv.completion(a, n_predict=2, id_slot=0)
    # one token per byte plus BOS: A's whole prefix (all but the last token) comes back from the cache
    assert r["timings"]["cache_n"] == len(a), srv.log_path
    assert r["timings"]["prompt_n"] == 1
    assert r["content"] == ra["content"]


@pytest.mark.parametrize("arch", ["mamba", "jamba", "lfm2", "gemma2"])
def test_checkpoints_saved_to_and_restored_from_prompt_cache(binary: Path, arch: str) -> None:
    """Recurrent/hybrid/SWA models: A's context checkpoint goes into the cache entry (shared under the
    PR patch) and brings A back after B used the slot."""
    from fixtures.gguf import model_path

    a = PROMPT
    b = "Pack my box with five dozen liquor jugs. " * 3
    with ServerProcess(
        binary,
        Launch(
            model=model_path(arch),
            n_parallel=1,
            ctx_size=512,
            cache_ram=16,
            ctx_checkpoints=4,
            args=["--checkpoint-min-step", "16"],
        ),
    ) as srv:  # fmt: skip
        ra = srv.completion(a, n_predict=4, id_slot=0)
        srv.completion(b, n_predict=4, id_slot=0)
        r = srv.completion(a, n_predict=4, id_slot=0)
        assert srv.running()
    assert ra["timings"]["cache_n"] == 0
    # restored from a checkpoint a few tokens before the end of A, not from BOS
    assert len(a) - 8 <= r["timings"]["cache_n"] <= len(a), srv.log_path
    assert r["content"] == ra["content"]


@pytest.mark.parametrize("arch", ["llama", "jamba"])
def test_speculative_draft_with_prompt_cache(binary: Path, arch: str) -> None:
    """-md draft.gguf (+ --spec-type draft-simple): drafts are made, the prompt cache still restores A."""
    from fixtures.gguf import draft_path, model_path

    a = PROMPT
    b = "Pack my box with five dozen liquor jugs. " * 3
    with ServerProcess(
        binary,
        Launch(
            model=model_path(arch),
            draft=draft_path(),
            n_parallel=2,
            ctx_size=1024,
            cache_ram=16,
            ctx_checkpoints=4,
            kv_unified=False,
            args=["--checkpoint-min-step", "16"],
        ),
    ) as srv:  # fmt: skip
        ra = srv.completion(a, n_predict=16, id_slot=0, ignore_eos=True)
        srv.completion(b, n_predict=16, id_slot=0, ignore_eos=True)
        r = srv.completion(a, n_predict=16, id_slot=0, ignore_eos=True)
        assert srv.running()
    assert ra["timings"]["draft_n"] > 0
    assert len(a) - 8 <= r["timings"]["cache_n"] <= len(a), srv.log_path
    assert r["content"] == ra["content"]


def test_process_gone_after_exit(binary: Path, model: Path) -> None:
    with ServerProcess(binary, Launch(model=model, ctx_size=256)) as srv:
        pid = srv.pid
        assert _alive(pid)
    assert _wait_gone(pid, timeout=0.5)
    assert srv.log_path is not None and srv.log_path.stat().st_size > 0


@pytest.mark.parametrize("exc", [RuntimeError, KeyboardInterrupt])
def test_process_gone_when_body_raises(binary: Path, model: Path, exc: type[BaseException]) -> None:
    pid = None
    with pytest.raises(exc), ServerProcess(binary, Launch(model=model, ctx_size=256)) as srv:
        pid = srv.pid
        raise exc("boom")
    assert pid is not None and _wait_gone(pid, timeout=0.5)


def test_unresponsive_server_is_killed(binary: Path, model: Path) -> None:
    """SIGTERM is ignored by a stopped process: after ``stop_timeout`` it gets SIGKILL."""
    with ServerProcess(binary, Launch(model=model, ctx_size=256), timeouts=Timeouts(stop=0.5)) as srv:
        pid = srv.pid
        os.kill(pid, signal.SIGSTOP)
    assert srv.proc is not None and srv.proc.returncode == -signal.SIGKILL
    assert _wait_gone(pid, timeout=0.5)


def test_atexit_stops_a_server_left_running(binary: Path, model: Path, tmp_path: Path) -> None:
    script = textwrap.dedent(
        f"""
        from harness.targets.llama_server import Launch, ServerProcess
        srv = ServerProcess({str(binary)!r}, Launch(model={str(model)!r}, ctx_size=256))
        srv.start()
        print(srv.pid, flush=True)
        """
    )
    r = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert r.returncode == 0, r.stderr
    assert _wait_gone(int(r.stdout.strip()), timeout=5)


def test_server_dies_with_a_killed_parent(binary: Path, model: Path) -> None:
    """SIGKILL of the starting process skips atexit; PR_SET_PDEATHSIG still takes the server down."""
    script = textwrap.dedent(
        f"""
        import os, signal
        from harness.targets.llama_server import Launch, ServerProcess
        srv = ServerProcess({str(binary)!r}, Launch(model={str(model)!r}, ctx_size=256))
        srv.start()
        print(srv.pid, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
        """
    )
    r = subprocess.run(
        [sys.executable, "-c", script], cwd=REPO, capture_output=True, text=True, timeout=120, check=False
    )
    assert r.returncode == -9, r.stderr
    assert _wait_gone(int(r.stdout.strip()), timeout=5)


def test_start_fails_on_missing_binary(tmp_path: Path, model: Path) -> None:
    with pytest.raises(ServerStartError, match=r"binary .* is missing.*log: "):
        ServerProcess(tmp_path / "llama-server", Launch(model=model)).start()


def test_start_fails_on_missing_model(binary: Path, tmp_path: Path) -> None:
    with pytest.raises(ServerStartError, match=r"model .*nope.gguf does not exist"):
        ServerProcess(binary, Launch(model=tmp_path / "nope.gguf")).start()


def test_start_fails_on_corrupt_model(binary: Path, tmp_path: Path) -> None:
    bad = tmp_path / "corrupt.gguf"
    bad.write_bytes(b"GGUF" + b"\x00" * 64)
    srv = ServerProcess(binary, Launch(model=bad), log_path=tmp_path / "srv.log")
    with pytest.raises(ServerStartError) as info:
        srv.start()
    msg = str(info.value)
    assert "\n" not in msg
    assert "exited during startup" in msg and str(tmp_path / "srv.log") in msg and "last lines:" in msg
    assert not srv.running()


def test_start_fails_on_port_in_use(binary: Path, model: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ServerStartError, match=f"port 127.0.0.1:{port} is already in use"):
            ServerProcess(binary, Launch(model=model), port=port).start()


def test_env_is_passed(binary: Path, model: Path, tmp_path: Path) -> None:
    # LLAMA_ARG_* environment variables are read by llama-server: the context size comes from env
    with ServerProcess(binary, Launch(model=model), env={"LLAMA_ARG_CTX_SIZE": "256"}) as srv:
        props = srv.request("GET", "/props")
    assert props["default_generation_settings"]["n_ctx"] == 256


# --------------------------------------------------------------------------------------------
# any tree: build-server --source, semantics inference, the pinned-tree line
# --------------------------------------------------------------------------------------------


def _copy_tree(dst: Path, patched: bool) -> Path:
    """A user's checkout: the vendored tree copied elsewhere, with or without the PR patch."""
    src = ls.sdist_source()
    tree = dst / ("patched" if patched else "plain")
    subprocess.run(["cp", "-a", str(src), str(tree)], check=True)
    (tree / ".git").unlink(missing_ok=True)
    if patched:
        subprocess.run(["patch", "-p1", "-s", "-d", str(tree), "-i", str(ls.PATCH_PATH)], check=True)
    return tree


def test_tree_hash_ignores_git_and_build_dirs(tmp_path: Path) -> None:
    tree = tmp_path / "t"
    (tree / "src").mkdir(parents=True)
    (tree / "src" / "a.cpp").write_text("int a;\n")
    before = ls.tree_hash(tree)
    (tree / ".git").mkdir()
    (tree / ".git" / "HEAD").write_text("ref: x\n")
    (tree / "build").mkdir()
    (tree / "build" / "CMakeCache.txt").write_text("x\n")
    (tree / "build" / "big.o").write_bytes(b"\0" * 100)
    assert ls.tree_hash(tree) == before
    (tree / "src" / "a.cpp").write_text("int b;\n")
    assert ls.tree_hash(tree) != before


def test_source_copy_reuses_the_build_and_says_it_is_pinned(
    binary: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    tree = _copy_tree(tmp_path, patched=True)
    assert cli_main(["build-server", "--source", str(tree)]) == 0
    out, err = capsys.readouterr()
    assert out.strip() == str(binary)  # same content and flags as the pinned pr build: no compile
    assert "is the pinned llama.cpp 0c1e570 tree: using its shared plain build" in err
    pinned, line = ls.pinned_status(tree)
    assert pinned and "PR #27451" in line
    with (tree / "src" / "llama-context.cpp").open("a") as f:
        f.write("// my change\n")
    pinned, line = ls.pinned_status(tree)
    assert not pinned and "differs from llama.cpp 0c1e570 + PR #27451" in line
    assert line.endswith("in 1 source file: src/llama-context.cpp")


def test_source_that_is_not_a_tree_is_one_line_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["build-server", "--source", str(tmp_path)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is not a llama.cpp tree" in err[0]
    assert cli_main(["build-server", "--source", str(tmp_path / "missing")]) == 2
    assert cli_main(["build-server", "--source", str(tmp_path), "--semantics", "master"]) == 2


def test_source_that_does_not_configure_is_exit_4_with_the_log_tail(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    tree = tmp_path / "tree"
    (tree / "tools" / "server").mkdir(parents=True)
    (tree / "common").mkdir()
    (tree / "common" / "common.h").write_text("\n")
    (tree / "CMakeLists.txt").write_text('message(FATAL_ERROR "your tree is broken")\n')
    rc = cli_main(["build-server", "--source", str(tree)])
    err = capsys.readouterr().err
    assert rc == ls.EXIT_BUILD_FAILED and "Traceback" not in err
    last = err.strip().splitlines()[-1]
    assert last.startswith("error: cmake configure (source) failed") and "your tree is broken" in last
    assert sorted(p.name for p in tree.iterdir()) == ["CMakeLists.txt", "common", "tools"]  # tree untouched


def test_gate_refuses_source_and_server_bin_problems(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["gate", "--source", str(tmp_path)]) == 2  # the llama backend reads it: not a tree
    assert "is not a llama.cpp tree" in capsys.readouterr().err
    assert cli_main(["gate", "--base", str(tmp_path)]) == 2  # only the server backend compares two trees
    assert "--backend server" in capsys.readouterr().err
    assert cli_main(["gate", "--backend", "server", "--base", str(tmp_path)]) == 2
    assert "needs --source TREE" in capsys.readouterr().err
    assert cli_main(["gate", "--backend", "server", "--server-bin", str(tmp_path / "nope")]) == 2
    assert "not an executable file" in capsys.readouterr().err
    fake = tmp_path / "llama-server"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    assert cli_main(["gate", "--backend", "server", "--server-bin", str(fake)]) == 2
    err = capsys.readouterr().err
    assert "cannot tell the semantics" in err and "--semantics" in err


def test_cold_sdist_fetch_builds_nothing_from_source(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A cold cache fetches the sdist with pip, for real, and names only llama-cpp-python in
    --no-binary: ``:all:`` made pip build cmake and ninja from source first (~1 h on 2 cores)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    lines: list[str] = []
    vendored = ls.sdist_source(lines.append)
    cmd = next(line for line in lines if line.startswith("$ "))
    assert "--no-binary llama-cpp-python" in cmd and ":all:" not in cmd and "--no-deps" in cmd
    assert (vendored / "tools" / "server" / "server-context.cpp").is_file()
    assert ls.infer_semantics(vendored).semantics == "master"


def test_pinned_builds_share_one_tree_and_rebuild_incrementally(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """master then pr then master again on one persistent copy and build directory: each switch
    recompiles only the files the patch touches (a stand-in tree and patch, real CMake and compiler)."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    cmakelists = textwrap.dedent(
        """\
        cmake_minimum_required(VERSION 3.14)
        project(fake C)
        set(CMAKE_RUNTIME_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
        set(CMAKE_LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/bin)
        add_library(llama SHARED ggml/big.c)
        add_executable(llama-server tools/server/server.c)
        target_link_libraries(llama-server llama)
        """
    )
    vendored = _fake_source(tmp_path / "prompt-cache-harness", cmakelists)
    (vendored / "tools" / "server").mkdir(parents=True)
    (vendored / "tools" / "server" / "server.c").write_text("int big(void);\nint main(void) { return big() - 1; }\n")
    (vendored / "ggml").mkdir()
    (vendored / "ggml" / "big.c").write_text("int big(void) { return 1; }\n")
    patch = tmp_path / "fake.patch"
    patch.write_text(
        "--- a/tools/server/server.c\n+++ b/tools/server/server.c\n@@ -1,2 +1,2 @@\n"
        " int big(void);\n-int main(void) { return big() - 1; }\n+int main(void) { return big() - 0; }\n"
    )
    monkeypatch.setattr(ls, "PATCH_PATH", patch)
    monkeypatch.setattr(llama_pinned, "PATCH_PATH", patch)
    monkeypatch.setattr(ls, "_ensure_tree_recorded", lambda *a: None)  # no real pinned tree to hash here

    def build(semantics: str) -> tuple[Path, str]:
        lines: list[str] = []
        binary = ls.build_server(semantics, log=lines.append)
        log = (ls.cache_root() / "llama-server" / "logs" / f"{binary.parent.name}.log").read_text()
        return binary, log

    master, log = build("master")
    assert "big.c" in log and subprocess.run([str(master)], check=False).returncode == 0
    pr, log = build("shared")
    assert subprocess.run([str(pr)], check=False).returncode == 1  # the patch is in
    assert "server.c" in log and "big.c" not in log  # only the patched file was recompiled
    shutil.rmtree(master.parent)  # build master again: the patched file is restored and recompiled
    master, log = build("master")
    assert subprocess.run([str(master)], check=False).returncode == 0
    assert "server.c" in log and "big.c" not in log
    src = ls.cache_root() / "llama-server" / ".work" / "stage" / "src"
    assert (src / "tools" / "server" / "server.c").read_text() == (vendored / "tools/server/server.c").read_text()
