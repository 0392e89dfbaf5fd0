"""The libllama call tracer (issue #41): what a process asks of libllama, read from an ``LD_PRELOAD``
interposer, checked, replayed in one process and shrunk. Not fault injection: it observes and replays.

* :mod:`harness.trace.calls`: the interposer ``trace.c`` built and preloaded, a trace read, ``Memory`` (what each
  sequence holds and what the calls get wrong).
* :mod:`harness.trace.lineage`: the calls a read depends on, and the located finding whose condition they meet.
* :mod:`harness.trace.replay_engine`: the replay through llama-cpp-python; :mod:`harness.trace.shrink`: slice,
  drop calls and rows, merge batches; :mod:`harness.trace.replay_child`: the replay's child process;
  :mod:`harness.trace.replay`: the parent's side.

May import: the floors below it (``faults`` for the native build cache, the targets, the trees); never the
backends or above.
"""
