"""Concurrent clients and sustained load against a real ``llama-server`` (floor: above the backends).

* :mod:`harness.load.clients`: K client threads sending timed requests; the timed trace they
  leave is what a failure prints (:func:`~harness.load.clients.replay_program`).
* :mod:`harness.load.order`: the order the server actually took (selections, launches, saves,
  releases), read from its log at ``-lv 4``.
* :mod:`harness.load.order_replay`: the reference model fed that order, step by step.
* :mod:`harness.load.concurrent`: the concurrent differential: the reference model replays that
  order and must predict every response's slot and ``cache_n``; outputs are compared with a fresh
  cache-less server (the gate's short concurrent run, and ``busy-slot-by-id`` on the real server).
* :mod:`harness.load.outputs`: responses against a fresh cache-less server; which differences a
  known finding explains.
* :mod:`harness.load.gate_step`: the gate's short concurrent run.
* :mod:`harness.load.soak`: ``python -m harness soak``: sustained load against a small
  ``--cache-ram``, RSS and the cache's logged size sampled every second, faults off then on.

Everything binds to 127.0.0.1; every loop is bounded in time and count; servers are stopped on
failure and Ctrl-C (:class:`harness.targets.llama_server.ServerProcess`).
"""
