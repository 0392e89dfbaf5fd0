"""Target adapters: one module per thing the properties run against.

- ``synthetic.py``: the model on synthetic state (:func:`make_server`).
- ``libllama.py``: the model on real libllama contexts through llama-cpp-python
  (:class:`LlamaProvider`, :func:`make_llama_server`), with restore equivalence checks.
- ``llama_build.py``: builds ``llama-server`` from the pinned tree or any llama.cpp checkout, cached by
  the tree's content; ``llama_server.py``: runs one (:class:`ServerProcess`).
- ``lcp_cache.py``: llama-cpp-python's own ``LlamaRAMCache`` / ``LlamaDiskCache``.

May import: ``harness.model``, ``harness.errors``, ``harness.findings``, ``harness.child``,
``fixtures``. Never another target (``llama_server`` uses ``llama_build``: one target), the properties,
the faults, the backends or the commands.
"""
