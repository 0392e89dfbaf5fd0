"""Replay and shrink a libllama trace in a child process on the traced server's own libllama.

:func:`replay` and :func:`shrink_trace` run :mod:`harness.trace.replay_child` in a child
(:func:`harness.child.run_child`) on ``lib_dir``'s ``libllama.so`` (the directory of the traced
``llama-server``'s: :func:`lib_dir_of`), so that the replay runs the machine code the server ran: through the
driver bound from its tree's header when the harness built it (:mod:`harness.trees.driver`), else through
llama-cpp-python's bindings (``LLAMA_CPP_LIB_PATH``); ``lib_dir=None`` keeps llama-cpp-python's own library.
Each returns the child's JSON (the replay's summary: calls, reads compared and bit-identical, the first read
that differs, calls whose return value differs, what the calls get wrong by themselves; with ``fresh`` the
comparison of every read with a fresh sequential evaluation; for a shrink the target, the calls and rows left
and the shrunk trace's path). A child that dies or overruns is one :class:`ReplayFailed` line with its stderr's tail.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from harness.child import run_child
from harness.errors import HarnessError
from harness.trees.binding import bind
from harness.trees.build import tree_of_build
from harness.trees.driver import DRIVER_ENV

__all__ = ["ReplayFailed", "lib_dir_of", "replay", "replay_line", "shrink_trace"]

_ROOT = str(Path(__file__).resolve().parents[2])


class ReplayFailed(HarnessError):
    """The replay's child died, overran or refused the trace: one line."""

    exit_code = 3


def lib_dir_of(binary: Path) -> Path | None:
    """The directory of the ``libllama.so`` beside ``binary`` (the harness's builds), else None."""
    d = binary.resolve().parent
    return d if (d / "libllama.so").exists() else None


def _run(args: list[str], lib_dir: Path | None, timeout: float) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_ROOT, env.get("PYTHONPATH")) if p)
    env.pop("LD_PRELOAD", None)
    env.pop("LLAMA_TRACE", None)
    if lib_dir is not None:
        tree = tree_of_build(lib_dir)  # a harness build: the driver bound from its tree's own header
        if tree is not None:
            env[DRIVER_ENV] = str(bind(tree, lib_dir))
        else:  # a library of the user's: llama-cpp-python's bindings, as the user runs them
            env["LLAMA_CPP_LIB_PATH"] = str(lib_dir)
    with tempfile.TemporaryDirectory(prefix="trace-replay-") as tmp:
        out = Path(tmp) / "out.json"
        res = run_child([sys.executable, "-m", "harness.trace.replay_child", *args, "--out", str(out)], env=env,
                        timeout=timeout)  # fmt: skip
        if res.crashed or res.returncode != 0 or not out.is_file():
            tail = " | ".join((res.stderr or res.stacks).strip().splitlines()[-3:])
            raise ReplayFailed(f"the replay of {args[1]} {res.describe()}: {tail}")
        data: dict[str, Any] = json.loads(out.read_text())
        return data


def replay(
    trace: str | os.PathLike[str],
    *,
    lib_dir: Path | None,
    model: str | os.PathLike[str] | None = None,
    fresh: bool = False,
    timeout: float = 600.0,
) -> dict[str, Any]:
    args = ["replay", os.fspath(trace)]
    if model is not None:
        args += ["--model", os.fspath(model)]
    if fresh:
        args.append("--fresh")
    return _run(args, lib_dir, timeout)


def shrink_trace(
    trace: str | os.PathLike[str],
    *,
    lib_dir: Path | None,
    out: str | os.PathLike[str],
    target: str | None = None,
    model: str | os.PathLike[str] | None = None,
    budget: float = 600.0,
) -> dict[str, Any]:
    """Shrink ``trace`` to the fewest calls that still show ``target`` (``fresh:I`` or ``ret:I``; by
    default the first call whose return differs, else the first read unlike a fresh evaluation); the
    shrunk trace is written to ``out``."""
    args = ["shrink", os.fspath(trace), "--shrunk", os.fspath(out), "--budget", str(budget)]
    if target:
        args += ["--target", target]
    if model is not None:
        args += ["--model", os.fspath(model)]
    return _run(args, lib_dir, timeout=budget * 1.5 + 300)


def replay_line(trace: str | os.PathLike[str], lib_dir: Path | None) -> str:
    """The command that replays and shrinks ``trace`` again."""
    lib = f" --lib-dir {lib_dir}" if lib_dir is not None else ""
    return f"python -m harness trace shrink {os.fspath(trace)}{lib}"
