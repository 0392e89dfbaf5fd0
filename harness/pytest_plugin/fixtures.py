"""The plugin's fixtures: modelled servers, tiny models, a real ``llama-server``, fault injectors.

``modelled_server(semantics="shared", kind="hybrid", **kw)``
    a :class:`~harness.model.server_context.ServerContext` from
    :func:`harness.targets.synthetic.make_server` (``kw``: ``draft``, ``params``, ``n_ctx``, ...),
    watched by ``@pytest.mark.prompt_cache_invariants`` when the test carries it.
``tiny_model(arch="llama", seed=0)``
    the path of a generated tiny GGUF model (``llama mamba jamba lfm2 gemma2``, ``mamba-big``, or
    ``draft``), generated and cached on first use.
``llama_server(**kw)``
    a started :class:`~harness.targets.llama_server.ServerProcess` (``kw``: the fields of its
    :class:`~harness.targets.llama_server.Launch`, its timeouts and its own keywords;
    ``model`` defaults to the tiny llama), stopped at the end of the test whatever happens; the
    binary comes from the options (see :mod:`harness.pytest_plugin.options`), and the test is
    skipped when none was asked for and none is cached.
``llama_server_binary``
    that binary's path (session scope).
``native_faults``
    a :class:`~faults.native.RemoteShim`: start a server with ``env=native_faults.env()``, then
    ``native_faults.arm(srv.pid, nth)`` fails its ``nth`` allocation of at least 512 KiB;
    ``native_faults.run(argv, nth)`` runs a command under the shim armed from the start.
    Skipped where the shim cannot be built (no ``gcc``).
``rlimited(fn, *args, headroom=N)``
    :func:`faults.rlimit.run_limited`: ``fn`` in a forked process under ``RLIMIT_AS``.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import fields
from pathlib import Path
from typing import Any

import pytest

from faults.native import LARGE_ALLOCATION, NativeUnavailable, RemoteShim, build_shim, run_native
from faults.rlimit import LimitedRun, run_limited
from fixtures.gguf import draft_path, model_path
from harness.child import ChildResult
from harness.errors import UsageError
from harness.model.server_context import ServerContext
from harness.pytest_plugin.marker import watch
from harness.pytest_plugin.options import server_binary
from harness.targets.llama_server import Launch, ServerProcess, Timeouts
from harness.targets.synthetic import make_server

__all__ = [
    "NativeFaults",
    "llama_server",
    "llama_server_binary",
    "modelled_server",
    "native_faults",
    "rlimited",
    "tiny_model",
]


@pytest.fixture
def modelled_server(request: pytest.FixtureRequest) -> Callable[..., ServerContext]:
    """A factory of modelled servers: ``modelled_server("master", "recurrent", draft=True)``."""

    def make(semantics: str = "shared", kind: str = "hybrid", **kw: Any) -> ServerContext:
        server = make_server(semantics, kind, **kw)
        watch(request.node, server)
        return server

    return make


@pytest.fixture(scope="session")
def tiny_model() -> Callable[..., Path]:
    """``tiny_model("jamba")``: the path of a tiny generated GGUF model (``"draft"``: the draft model)."""

    def path(arch: str = "llama", *, seed: int = 0) -> Path:
        return draft_path(seed=seed) if arch == "draft" else model_path(arch, seed=seed)

    return path


@pytest.fixture(scope="session")
def llama_server_binary(pytestconfig: pytest.Config) -> Path:
    """The ``llama-server`` the options choose (skips when there is none; see the module)."""
    return server_binary(pytestconfig, log=lambda line: print(line, file=sys.stderr))


_LAUNCH_FIELDS = frozenset(f.name for f in fields(Launch))
_TIMEOUT_KEYWORDS = {"startup_timeout": "startup", "stop_timeout": "stop", "request_timeout": "request"}


@pytest.fixture
def llama_server(llama_server_binary: Path, tmp_path: Path) -> Iterator[Callable[..., ServerProcess]]:
    """A factory of started ``llama-server`` processes, every one stopped when the test ends: its keywords are
    :class:`~harness.targets.llama_server.Launch`'s fields, the timeouts (``startup_timeout``, ``stop_timeout``,
    ``request_timeout``) and :class:`~harness.targets.llama_server.ServerProcess`'s own keywords."""
    started: list[ServerProcess] = []

    def start(**kw: Any) -> ServerProcess:
        flags = {k: kw.pop(k) for k in list(kw) if k in _LAUNCH_FIELDS}
        flags.setdefault("model", model_path("llama"))
        timeouts = {_TIMEOUT_KEYWORDS[k]: kw.pop(k) for k in list(kw) if k in _TIMEOUT_KEYWORDS}
        kw.setdefault("log_path", tmp_path / f"llama-server-{len(started)}.log")
        srv = ServerProcess(llama_server_binary, Launch(**flags), timeouts=Timeouts(**timeouts), **kw)
        started.append(srv)  # before start(): a server that fails to come up is stopped too
        srv.start()
        return srv

    try:
        yield start
    finally:
        for srv in reversed(started):
            srv.stop()


class NativeFaults(RemoteShim):
    """:class:`~faults.native.RemoteShim` plus :meth:`run`: a command under the shim, armed from the start."""

    def run(
        self,
        argv: Sequence[str],
        nth: int,
        *,
        min_size: int = LARGE_ALLOCATION,
        persistent: bool = False,
        timeout: float = 60.0,
        env: dict[str, str] | None = None,
    ) -> ChildResult:
        """Run ``argv`` with its ``nth`` allocation of at least ``min_size`` bytes failing; how it ended."""
        return run_native(argv, nth=nth, persistent=persistent, timeout=timeout, env=env, min_size=min_size)


@pytest.fixture
def native_faults(tmp_path: Path) -> NativeFaults:
    """Native allocation faults in another process (skipped where the shim cannot be built)."""
    try:
        build_shim()
    except NativeUnavailable as e:
        pytest.skip(str(e))
    return NativeFaults(tmp_path / "native-faults")


@pytest.fixture
def rlimited() -> Callable[..., LimitedRun]:
    """``rlimited(fn, *args, headroom=N)``: ``fn`` in a forked process under ``RLIMIT_AS`` (Linux)."""
    if not hasattr(os, "fork") or not os.path.exists("/proc/self/status"):
        pytest.skip("rlimited needs fork() and /proc (Linux)")

    def run(fn: Callable[..., Any], /, *args: Any, **kw: Any) -> LimitedRun:
        try:
            return run_limited(fn, *args, **kw)
        except UsageError as e:
            pytest.fail(str(e), pytrace=False)

    return run
