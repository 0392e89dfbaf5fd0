"""harness.interrupt: the first Ctrl-C ends a run cleanly and is never lost, the second ends it at once.

Each case runs in a fresh interpreter (the signals go to it, not to pytest) that prints what it saw.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _as_from_a_terminal() -> None:
    """SIGINT at its default, as a terminal starts a command: pytest itself may run as a script's background
    job, with SIGINT ignored, and a child inherits that (the case that tests it says so with its own hook)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _py(code: str, preexec_fn: Callable[[], object] | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-c", textwrap.dedent(code)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, env=env, check=False,
                          preexec_fn=preexec_fn or _as_from_a_terminal)  # fmt: skip


def _gone(pid: int, seconds: float = 5) -> bool:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    return True
        except OSError:
            return True
        time.sleep(0.05)
    return False


def test_a_second_signal_kills_every_tracked_child_and_exits_130_at_once() -> None:
    r = _py(
        """
        import os, signal, subprocess, time
        from harness.interrupt import guard, shielded, track
        with guard():
            child = subprocess.Popen(["sleep", "120"], start_new_session=True)
            track(child.pid)
            print(child.pid, flush=True)
            with shielded():  # a cleanup that would wait: the first signal is held, the second ends it
                os.kill(os.getpid(), signal.SIGINT)
                print("held", flush=True)
                os.kill(os.getpid(), signal.SIGTERM)
                time.sleep(30)
                print("not reached", flush=True)
        """
    )
    pid, held = r.stdout.split()
    assert r.returncode == 130 and held == "held" and "not reached" not in r.stdout, r
    assert r.stderr == "interrupted again: every child killed, exiting at once\n"
    assert _gone(int(pid)), "the tracked child outlived the process"


def test_a_held_signal_is_raised_at_the_end_of_the_section_or_only_recorded() -> None:
    r = _py(
        """
        import os, signal
        from harness.interrupt import guard, interrupted, shielded
        with guard():
            try:
                with shielded():
                    with shielded():
                        os.kill(os.getpid(), signal.SIGINT)
                        for _ in range(1000): pass
                    print("inner end: not raised", flush=True)
                print("not reached", flush=True)
            except KeyboardInterrupt:
                print("raised at the outer end", flush=True)
        with guard():
            with shielded(reraise=False):
                os.kill(os.getpid(), signal.SIGINT)
                for _ in range(1000): pass
            print("recorded:", interrupted(), flush=True)
        print("after the guards:", signal.getsignal(signal.SIGINT) is signal.default_int_handler)
        """
    )
    assert r.returncode == 0, r
    assert r.stdout.splitlines() == [
        "inner end: not raised",
        "raised at the outer end",
        "recorded: True",
        "after the guards: True",
    ]


def test_a_ctrl_c_python_swallowed_in_a_finalizer_is_raised_again_by_check() -> None:
    r = _py(
        """
        import gc, os, signal, time
        from harness.interrupt import check, guard

        class Finalized:
            def __del__(self):
                os.kill(os.getpid(), signal.SIGINT)
                time.sleep(0.05)  # the handler runs here: its KeyboardInterrupt is "ignored" by Python

        class Broken:
            def __del__(self):
                raise ValueError("a finalizer's own error")

        with guard():
            try:
                Finalized()
                gc.collect()
                print("went on", flush=True)
                check()
                print("not reached", flush=True)
            except KeyboardInterrupt:
                print("raised by check", flush=True)
            Broken()
            gc.collect()
        """
    )
    assert r.returncode == 0, r
    assert r.stdout.splitlines() == ["went on", "raised by check"]
    # the swallowed Ctrl-C prints no traceback (a CI run once showed one from LlamaProvider.__del__); any other
    # error of a finalizer still does
    assert "KeyboardInterrupt" not in r.stderr, r.stderr
    assert "Exception ignored in" in r.stderr and "a finalizer's own error" in r.stderr


def test_sigint_inherited_ignored_is_heard_again() -> None:
    """A script's background job (``cmd &``) starts with SIGINT ignored; Python alone would keep it so."""
    code = """
        import os, signal, time
        from harness.interrupt import take_signals
        print(signal.getsignal(signal.SIGINT) is signal.SIG_IGN, flush=True)
        take_signals()
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(5)
        except KeyboardInterrupt:
            print("heard", flush=True)
        """
    r = _py(code, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    assert r.returncode == 0 and r.stdout.split() == ["True", "heard"], r


def test_a_build_tool_gets_sigint_to_clean_up_then_its_group_is_killed(tmp_path: Path) -> None:
    """``run_logged`` (the build steps): ``kill -INT`` of the harness reaches the tool in its own group."""
    log = tmp_path / "tool.log"
    code = f"""
        from harness.child import run_logged
        from harness.interrupt import guard
        tool = "trap 'echo cleaned up; exit 3' INT; echo started; sleep 120 & echo $! > {tmp_path}/sleep.pid; wait"
        with open({str(log)!r}, "w") as out, guard():
            try:
                run_logged(["sh", "-c", tool], out)
            except KeyboardInterrupt:
                print("interrupted", flush=True)
        """
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(code)], stdout=subprocess.PIPE, text=True, env=env)
    try:
        deadline = time.monotonic() + 60
        while not (log.exists() and "started" in log.read_text() and (tmp_path / "sleep.pid").exists()):
            assert time.monotonic() < deadline and proc.poll() is None, "the tool did not start"
            time.sleep(0.05)
        time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert proc.returncode == 0 and out.strip() == "interrupted"
    assert "cleaned up" in log.read_text()  # the tool heard SIGINT
    assert _gone(int((tmp_path / "sleep.pid").read_text())), "the tool's background child outlived it"
