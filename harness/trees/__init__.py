"""llama.cpp trees and their builds: from a user's checkout (or the pinned sdist) to a ``llama-server`` binary.

* :mod:`harness.trees.tree`: is it a tree, its content hash, the harness cache, a git revision exported.
* :mod:`harness.trees.semantics`: ``shared`` or ``master``, read from the checkpoint's payload member types.
* :mod:`harness.trees.pinned`: the sdist's tree, our PR patch, is a tree the pinned one.
* :mod:`harness.trees.stage`: the one staging directory and ccache every build compiles in.
* :mod:`harness.trees.build`: CMake, instrumentations, cache keys: ``llama-server`` with its shared ``libllama.so``.
* :mod:`harness.trees.choose`: which build(s) the server gate runs, from ``--server-bin``, ``--source``/``--base``,
  ``--semantics`` and ``--asan`` as plain values.
* :mod:`harness.trees.gcov`: the ``coverage`` instrumentation: gcov flags, its notes and sources kept in the cache
  entry, the environment that sends a run's counters into the run's directory.
* :mod:`harness.trees.api`: can llama-cpp-python's bindings drive a tree's libllama.

The trees' own rule: a tree module imports only the ground floor (``harness.errors``, ``harness.child``,
``harness.interrupt``) and other tree modules; never the model, a target or anything above. The targets
run what the trees build (``harness.targets.llama_server`` starts a built binary), so the trees are the floor
below them, and a target never imports another target.
"""
