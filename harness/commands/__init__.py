"""One module per ``python -m harness`` subcommand, each with ``add_arguments(parser)`` and
``run(args) -> int``: ``gate``, ``mutants``, ``sweep``, ``rlimit``, ``native``, ``build_server``,
``demo``; ``common`` holds what several share (the ``--semantics`` flag).

May import: everything below (backends, faults, properties, targets, model, findings, errors,
fixtures); never :mod:`harness.cli`.
"""
