"""The gate's backends: one runner module per target, all in :data:`BACKENDS`.

======================  ==============================  =========================================
``--backend``           runner                          target
======================  ==============================  =========================================
``synthetic``           ``harness/backends/synthetic``  ``harness/targets/synthetic``
``llama``               ``harness/backends/libllama``   ``harness/targets/libllama``
``server``              ``harness/backends/llama_server``  ``harness/targets/llama_server``
``llama-cpp-python-cache``  ``harness/backends/lcp_cache``  ``harness/targets/lcp_cache``
======================  ==============================  =========================================

Adding an engine or a tree: write its target module and its runner module (a
:class:`~harness.backends.base.Backend` subclass) and list the runner here. The gate loops over the
selected backends with one signature, ``run(report, options, out)``; a fuzz campaign asks each selected
backend for its machines, ``campaign_machines(plan)``, and the models they load, ``campaign_models(plan)``.

May import: everything below the backends (``properties``, ``faults``, ``harness.targets``,
``harness.model``, ``harness.findings``, ``harness.errors``, ``fixtures``); never the commands.
"""

from __future__ import annotations

from harness.backends.base import Backend
from harness.backends.lcp_cache import LcpCacheBackend
from harness.backends.libllama import LlamaBackend
from harness.backends.llama_server import ServerBackend
from harness.backends.synthetic import SyntheticBackend

__all__ = ["BACKENDS", "DEFAULT_BACKENDS", "Backend"]

BACKENDS: dict[str, Backend] = {
    b.name: b for b in (SyntheticBackend(), LlamaBackend(), ServerBackend(), LcpCacheBackend())
}
DEFAULT_BACKENDS = ("synthetic", "llama")
