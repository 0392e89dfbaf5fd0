"""prompt-cache-harness: a reference model of llama-server's prompt cache, real targets, properties,
fault injectors and the gate that runs them on every backend.

The house, from the ground floor up. A module may import only from its own floor or below; the
test ``tests/test_architecture.py`` reads every import and fails on a loop or an upward import.

1. ``harness.errors`` (the error root and exit codes), ``harness.findings`` (the one registry of
   known upstream findings), ``harness.interrupt`` (Ctrl-C: the first ends a run cleanly, the second
   at once), ``harness.child`` (the one helper every child process runs through), ``fixtures``
   (generated inputs: tiny GGUF models). They import nothing of the project above them.
2. ``harness.model``: the reference model of llama-server's prompt cache, slots and checkpoints
   pinned to llama.cpp 0c1e570, in ``master`` and ``shared`` (PR #27451) semantics.
3. ``harness.targets``: one adapter module per real or synthetic target (``synthetic``,
   ``libllama``, ``llama_server``, ``lcp_cache``). A target imports the model, never another
   target, the properties, the faults or the gate.
4. ``properties``: invariants, policy checks and the Hypothesis state machines over the targets.
5. ``faults``: fault kinds, the one :class:`~faults.kinds.Outcome` vocabulary and the injectors.
6. ``harness.backends``: one gate runner per backend, all listed in
   :data:`harness.backends.BACKENDS` with one signature; a new engine is a target module plus a
   backend module, which also says which fuzz-campaign machines it has.
7. ``harness.campaign`` (fuzz campaigns: worker processes, example databases, the live view,
   replay), ``harness.measure`` (measurements and the reporters that turn them into pages and
   tables: the memory report, the bench) and ``harness.load`` (concurrent clients and soak runs
   against a real server): work built on the gate's backends, on one floor.
8. ``harness.commands``: one module per ``python -m harness`` subcommand.
9. ``harness.cli`` and ``harness.__main__``: the entry point, importing its commands directly.
10. ``harness.pytest_plugin`` (beside ``ci``): the pytest plugin for users' own tests (fixtures, the
   ``prompt_cache_invariants`` marker, server options); it imports the floors it needs, nothing
   imports it.
"""
