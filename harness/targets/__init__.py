"""Target adapters: one module per thing the properties run against.

- ``synthetic.py``: the model on synthetic state (:func:`make_server`).
- ``libllama.py``: the model on real libllama contexts through llama-cpp-python
  (:class:`LlamaProvider`, :func:`make_llama_server`), with restore equivalence checks.
- ``llama_server.py``: a real ``llama-server`` process (:class:`ServerProcess`) and its build
  (``llama_server_build.py``).
- ``lcp_cache.py``: llama-cpp-python's own ``LlamaRAMCache`` / ``LlamaDiskCache``.

May import: ``harness.model``, ``harness.errors``, ``harness.findings``, ``harness.child``,
``fixtures``. Never another target, the properties, the faults, the backends or the commands.
"""
