"""The gate's ``server`` backend: a real ``llama-server`` against the reference model, request by request.

What ``python -m harness gate --backend server`` runs, on the pinned builds (``--semantics``, ``--asan``), a
user's tree (``--source DIR``) or binary (``--server-bin PATH``):

1. :func:`harness.targets.llama_server.probe`: which request form this server version answers usably
   (a version that refuses the harness's fields is one line, exit 2, before any property runs).
2. The differential machines (:mod:`.differential`): Hypothesis drives prompts on all five models, unified
   and per-slot KV, and with a draft model; every answer's slot, ``cache_n`` and the evictions its log shows
   are predicted by the model, every generation compared with a fresh cache-less server; then the eviction
   and full-context programs.
3. The memory properties (:mod:`.memory`): the RSS peak of a save with MiBs of checkpoints (the PR's S
   against master's S + C) and native allocation faults inside a save.
4. On the ``asan`` build: no ASan/UBSan report in any server log.

With ``--base BASE`` (a tree, or a revision of the git checkout ``--source`` names) the machines and programs
run as the change differential (:mod:`.change`): ``TREE`` against ``BASE`` request for request, the model
against ``BASE`` (upstream drift, reported once and not failing unless ``BASE`` is the pinned tree), and the
memory properties on ``TREE`` with ``BASE``'s figures beside them.

Every failure, including a request the server answered with an HTTP error or not at all, is one row with its
property, the request program that replays it and the gate's replay line. Campaign machines: :mod:`.campaign`.

The runner, from the options to the verdict, is :mod:`.runner`; this module only names its backend for the
registry (:data:`harness.backends.BACKENDS`) and its options (:class:`ServerOptions`) for the work that follows it.
"""

from __future__ import annotations

from harness.backends.llama_server.runner import ServerBackend, ServerOptions

__all__ = ["ServerBackend", "ServerOptions"]
