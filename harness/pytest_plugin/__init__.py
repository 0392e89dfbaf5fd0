"""The harness's parts for your own tests: a pytest plugin (entry point ``pytest11``).

Installed with the harness, it is loaded by every pytest run in that environment (or explicitly:
``pytest -p harness.pytest_plugin``). It gives

* fixtures (:mod:`harness.pytest_plugin.fixtures`): ``modelled_server`` (the reference model of
  llama-server in ``shared`` or ``master`` semantics), ``tiny_model`` (the generated GGUF models by
  architecture), ``llama_server`` / ``llama_server_binary`` (a real ``llama-server`` process, always
  stopped), ``native_faults`` (fail the Nth large native allocation) and ``rlimited`` (a callable in an
  address-space-limited child);
* the marker ``@pytest.mark.prompt_cache_invariants`` (:mod:`harness.pytest_plugin.marker`): the
  gate's invariants on every modelled server the test made, during and after its body;
* the options ``--llama-server-bin PATH``, ``--llama-source DIR`` and ``--llama-server-semantics shared|master``
  (:mod:`harness.pytest_plugin.options`).

The plugin is the top floor of the house: it imports the floors below it, and nothing imports it.
"""

from __future__ import annotations

from collections.abc import Generator

import pytest

from harness.pytest_plugin.fixtures import (
    NativeFaults,
    llama_server,
    llama_server_binary,
    modelled_server,
    native_faults,
    rlimited,
    tiny_model,
)
from harness.pytest_plugin.marker import MARKER, check_after_test, register_marker
from harness.pytest_plugin.options import add_options, check_options

__all__ = [
    "MARKER",
    "NativeFaults",
    "llama_server",
    "llama_server_binary",
    "modelled_server",
    "native_faults",
    "pytest_addoption",
    "pytest_configure",
    "pytest_runtest_call",
    "rlimited",
    "tiny_model",
]


def pytest_addoption(parser: pytest.Parser) -> None:
    add_options(parser)


def pytest_configure(config: pytest.Config) -> None:
    register_marker(config)
    check_options(config)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item: pytest.Item) -> Generator[None, object, object]:
    result = yield  # the test body: when it fails, that failure stands and nothing more is checked
    check_after_test(item)
    return result
