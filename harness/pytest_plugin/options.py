"""The plugin's command-line options and which ``llama-server`` binary they choose.

``--llama-server-bin PATH``              use this binary (built anywhere)
``--llama-source DIR``                   build (or reuse) llama-server from this llama.cpp checkout
``--llama-server-semantics shared|master``  build (or reuse) the pinned tree with PR #27451 or as vendored
(none of them)                           reuse the cached ``shared`` build if there is one, else skip the
                                         tests that need a server, saying how to get one
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from harness.errors import HarnessError
from harness.trees.build import build_server, build_source, cached_binary

__all__ = ["SERVER_SEMANTICS", "add_options", "check_options", "server_binary"]

SERVER_SEMANTICS = ("shared", "master")


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("prompt-cache-harness", "prompt-cache-harness (llama-server fixtures)")
    group.addoption(
        "--llama-server-bin",
        metavar="PATH",
        default=None,
        help="the llama-server binary the llama_server fixture starts",
    )
    group.addoption(
        "--llama-source",
        metavar="DIR",
        default=None,
        help="build llama-server from this llama.cpp checkout (cached by a hash of the tree's content)",
    )
    group.addoption(
        "--llama-server-semantics",
        choices=SERVER_SEMANTICS,
        default=None,
        help="build (or reuse) llama-server from the pinned llama.cpp 0c1e570: shared (PR #27451 applied) "
        "or master (as vendored)",
    )


def check_options(config: pytest.Config) -> None:
    """Refuse contradictory or broken server options before any test runs."""
    binary = config.getoption("llama_server_bin", None)
    source = config.getoption("llama_source", None)
    semantics = config.getoption("llama_server_semantics", None)
    given = [n for n, v in (("--llama-server-bin", binary), ("--llama-source", source),
                            ("--llama-server-semantics", semantics)) if v is not None]  # fmt: skip
    if len(given) > 1:
        raise pytest.UsageError(f"give one of --llama-server-bin, --llama-source, --llama-server-semantics, "
                                f"not {' and '.join(given)}")  # fmt: skip
    if binary is not None:
        p = Path(binary).expanduser()
        if not p.is_file() or not os.access(p, os.X_OK):
            raise pytest.UsageError(f"--llama-server-bin {binary}: not an executable file")
    if source is not None and not (Path(source).expanduser() / "tools" / "server").is_dir():
        raise pytest.UsageError(f"--llama-source {source}: not a llama.cpp tree (no tools/server)")


def server_binary(config: pytest.Config, log: Callable[[str], None]) -> Path:
    """The ``llama-server`` the options choose; skips the test when none was asked for and none is cached,
    fails it with one line when the asked-for build fails."""
    binary = config.getoption("llama_server_bin", None)
    if binary is not None:
        return Path(binary).expanduser().resolve()
    source = config.getoption("llama_source", None)
    semantics = config.getoption("llama_server_semantics", None)
    try:
        if source is not None:
            return build_source(Path(source), log=log)
        if semantics is not None:
            return build_server(semantics, log=log)
    except HarnessError as e:
        pytest.fail(f"building llama-server ({source or semantics}) failed: {e}", pytrace=False)
    cached = cached_binary("shared")
    if cached is None:
        pytest.skip(
            "no llama-server binary: pass --llama-server-bin PATH, --llama-source DIR, or "
            "--llama-server-semantics shared|master to build one (then cached)"
        )
    return cached
