"""Target adapters: one module per thing the properties run against.

- ``synthetic.py``: the model on synthetic state (:func:`make_server`).
- ``libllama.py``: the model on real libllama contexts through llama-cpp-python
  (:class:`LlamaProvider`, :func:`make_llama_server`), with restore equivalence checks.
- ``llama_server.py``: runs one ``llama-server`` (:class:`ServerProcess`), built by :mod:`harness.trees.build`
  from the pinned tree or any llama.cpp checkout.
- ``lcp_cache.py``: llama-cpp-python's own ``LlamaRAMCache`` / ``LlamaDiskCache``.

May import the floors below (``harness.trees``, ``harness.model`` and the ground floor). Never another target
(:data:`harness.APART`; ``tests/test_architecture.py`` checks it), the properties, the faults, the backends or
the commands.
"""
