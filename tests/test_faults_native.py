"""The child runner and the native LD_PRELOAD layer: exact Nth-malloc failure, crashes as findings."""

from __future__ import annotations

import os
import shutil
import sys
import textwrap
import time
from pathlib import Path

import pytest

from faults.kinds import Outcome
from faults.native import build_shim, run_native, run_new_demo
from harness.child import run_child

ROOT = str(Path(__file__).resolve().parent.parent)
needs_cc = pytest.mark.skipif(
    shutil.which("gcc") is None or shutil.which("g++") is None, reason="the native layer needs gcc and g++"
)


def _py(code: str) -> list[str]:
    return [sys.executable, "-c", f"import sys; sys.path.insert(0, {ROOT!r})\n" + textwrap.dedent(code)]


def test_crashing_python_child_is_reported_with_its_stack_and_the_runner_goes_on() -> None:
    code = """
        from harness.child import child_setup
        child_setup()
        def deep_inside_the_target():
            import os; os.abort()
        deep_inside_the_target()
    """
    r = run_child(_py(code), timeout=20)
    assert r.crashed and r.status == "signalled" and r.signal == "SIGABRT"
    assert "deep_inside_the_target" in r.stacks and "Fatal Python error: Aborted" in r.stacks
    after = run_child(_py("print('still here')"), timeout=20)
    assert after.status == "exited" and after.returncode == 0 and after.stdout.strip() == "still here"


def test_hanging_child_and_its_grandchild_are_killed() -> None:
    code = """
        import os, sys, time
        pid = os.fork()
        if pid == 0:
            time.sleep(60); os._exit(0)
        print(pid, flush=True)
        time.sleep(60)
    """
    t0 = time.monotonic()
    r = run_child(_py(code), timeout=2)
    assert r.status == "timeout" and r.crashed and time.monotonic() - t0 < 15
    grandchild = int(r.stdout.split()[0])
    for _ in range(50):
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"grandchild {grandchild} survived the timeout")


def _forked_prints_and_returns() -> int:
    print("from the fork", flush=True)
    os.write(2, b"native stderr\n")  # a C library's output is captured too
    return 7


def _forked_raises() -> None:
    raise RuntimeError("escaped the forked function")


def _forked_aborts() -> None:
    os.abort()


def _forked_hangs_with_a_grandchild() -> None:
    pid = os.fork()
    if pid == 0:
        time.sleep(60)
        os._exit(0)
    print(pid, flush=True)
    time.sleep(60)


def test_a_forked_function_reports_its_output_and_status() -> None:
    r = run_child(_forked_prints_and_returns, timeout=20)
    assert (r.status, r.returncode) == ("exited", 7) and r.stdout == "from the fork\n"
    assert r.stderr == "native stderr\n" and r.argv == ["<fork _forked_prints_and_returns>"]
    r = run_child(_forked_raises, timeout=20)
    assert r.returncode == 1 and "RuntimeError: escaped the forked function" in r.stderr


def test_a_forked_function_that_aborts_is_a_signalled_result() -> None:
    r = run_child(_forked_aborts, timeout=20)
    assert r.crashed and r.status == "signalled" and r.signal == "SIGABRT"
    assert "_forked_aborts" in r.stacks  # faulthandler in the fork writes its Python stack
    assert run_child(_forked_prints_and_returns, timeout=20).returncode == 7  # the runner goes on


def test_a_hanging_fork_and_its_grandchild_are_killed_and_reaped() -> None:
    t0 = time.monotonic()
    r = run_child(_forked_hangs_with_a_grandchild, timeout=1)
    assert r.status == "timeout" and r.returncode is None and time.monotonic() - t0 < 15
    grandchild = int(r.stdout.split()[0])
    for _ in range(50):
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"grandchild {grandchild} survived the timeout")
    with pytest.raises(ChildProcessError):
        os.waitpid(-1, os.WNOHANG)  # nothing left unreaped


def test_a_forked_child_refuses_env_and_preload() -> None:
    with pytest.raises(ValueError, match="inherits"):
        run_child(_forked_prints_and_returns, env={})


@needs_cc
def test_shim_is_cached_by_source_hash() -> None:
    first = build_shim()
    assert first.exists() and build_shim() == first


@needs_cc
@pytest.mark.parametrize("nth", [1, 2, 5, 9])
def test_native_fault_fires_exactly_at_n(nth: int) -> None:
    r = run_new_demo(nth, catch=True, count=12)
    assert r.outcome == Outcome.ACCEPTED and r.failed_at == nth, r.child
    assert "caught std::bad_alloc" in r.child.stdout


@needs_cc
def test_uncaught_bad_alloc_aborts_with_native_stack_and_runner_goes_on() -> None:
    r = run_new_demo(3, catch=False, count=12)
    assert r.outcome == Outcome.ABORTED and r.child.signal == "SIGABRT"
    assert "native stack (faultshim, signal SIGABRT)" in r.child.stacks and "build_entries" in r.child.stacks
    assert "std::bad_alloc" in r.child.stderr  # libstdc++'s terminate handler says what escaped
    ok = run_new_demo(100, catch=False, count=12)  # the fault is past the last allocation
    assert ok.outcome == Outcome.OK


@needs_cc
def test_python_arms_the_shim_at_run_time_and_disarm_restores() -> None:
    code = """
        import ctypes
        from faults.native import ShimControl
        shim = ShimControl()
        libc = ctypes.CDLL(None)
        libc.malloc.restype = ctypes.c_void_p
        shim.arm(3)
        got = [libc.malloc(1 << 20) is None for _ in range(5)]
        fired = shim.disarm()
        after = [libc.malloc(1 << 20) is None for _ in range(5)]
        print(got, fired, after)
    """
    r = run_native(_py(code), timeout=20)
    assert r.status == "exited", r
    assert r.stdout.strip() == "[False, False, True, False, False] 1 [False, False, False, False, False]"
