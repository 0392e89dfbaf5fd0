"""Measurements and the reporters that turn them into pages and tables (floor 7 of harness/__init__.py).

* :mod:`harness.measure.saves`: one save's transient peak and time against the number and the size of
  the checkpoints, on the model's ledger, libllama under memray and a real llama-server; the cost of a
  checkpoint update; the breakdown of the server's peak.
* :mod:`harness.measure.flame`: a memray capture drawn as a flame graph in plain SVG (renders offline).
* :mod:`harness.measure.page`: the self-contained HTML page and ``report.json`` of ``python -m harness report``.
* :mod:`harness.measure.bench`: the bench's framework (cases, figures, goals, table, comparison).
* :mod:`harness.measure.bench_cases`: the cases of ``python -m harness bench`` (issue 17).
* :mod:`harness.measure.baselines`: Hypothesis alone on a gate machine's programs (the exploration case's
  divisor); :mod:`harness.measure.arms`: the exploration case's arms, each a child, timed in turns on
  one CPU; :mod:`harness.measure.calls`: the same pair's function calls, in a fresh interpreter.
"""
