"""The plugin's command-line options and which ``llama-server`` binary they choose.

``--llama-server-bin PATH``       use this binary (built anywhere)
``--llama-server-flavour pr|master``  build (or reuse) the harness's own build of that flavour
(neither)                         reuse the cached ``pr`` build if there is one, else skip the tests
                                  that need a server, saying how to get one
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

import pytest

from harness.errors import HarnessError
from harness.targets.llama_server import build_server, cached_binary

__all__ = ["SERVER_FLAVOURS", "add_options", "check_options", "server_binary"]

SERVER_FLAVOURS = ("pr", "master")


def add_options(parser: pytest.Parser) -> None:
    group = parser.getgroup("prompt-cache-harness", "prompt-cache-harness (llama-server fixtures)")
    group.addoption(
        "--llama-server-bin",
        metavar="PATH",
        default=None,
        help="the llama-server binary the llama_server fixture starts",
    )
    group.addoption(
        "--llama-server-flavour",
        choices=SERVER_FLAVOURS,
        default=None,
        help="build (or reuse the cached) llama-server of this flavour from the llama-cpp-python sdist: "
        "pr (PR #27451 applied) or master",
    )
    # ---- PLACE FOR --llama-source DIR ---------------------------------------------------------------
    # Added together with harness.targets.llama_server.build_source(path: Path, *, asan: bool = False,
    # jobs: int | None = None, force: bool = False, log=print) -> Path (another change):
    #   group.addoption("--llama-source", metavar="DIR", default=None,
    #                   help="build llama-server from this llama.cpp checkout (cached by a hash of the tree)")
    # then resolve it in server_binary() below and refuse it with the other two in check_options().
    # ------------------------------------------------------------------------------------------------


def check_options(config: pytest.Config) -> None:
    """Refuse contradictory or broken server options before any test runs."""
    binary = config.getoption("llama_server_bin", None)
    flavour = config.getoption("llama_server_flavour", None)
    if binary is not None and flavour is not None:
        raise pytest.UsageError("give --llama-server-bin or --llama-server-flavour, not both")
    if binary is not None:
        p = Path(binary).expanduser()
        if not p.is_file() or not os.access(p, os.X_OK):
            raise pytest.UsageError(f"--llama-server-bin {binary}: not an executable file")


def server_binary(config: pytest.Config, log: Callable[[str], None]) -> Path:
    """The ``llama-server`` the options choose; skips the test when none was asked for and none is cached,
    fails it with one line when the asked-for build fails."""
    binary = config.getoption("llama_server_bin", None)
    if binary is not None:
        return Path(binary).expanduser().resolve()
    # ---- PLACE FOR --llama-source DIR: `return build_source(Path(source), log=log)` -------------------
    flavour = config.getoption("llama_server_flavour", None)
    if flavour is not None:
        try:
            return build_server(flavour, log=log)
        except HarnessError as e:
            pytest.fail(f"building llama-server ({flavour}) failed: {e}", pytrace=False)
    cached = cached_binary("pr")
    if cached is None:
        pytest.skip(
            "no llama-server binary: pass --llama-server-bin PATH, or --llama-server-flavour pr|master "
            "to build one (about 10 minutes on 2 cores, then cached)"
        )
    return cached
