"""The bench of ``python -m harness bench``: its framework, its cases and what they measure with.

* :mod:`harness.bench.framework`: cases, figures with their inputs and spread, goals, the table, the comparison.
* :mod:`harness.bench.cases`: the cases (issue 17); :mod:`harness.bench.builds` and :mod:`harness.bench.oom`:
  the build and out-of-memory cases.
* :mod:`harness.bench.baselines`: Hypothesis alone on a gate machine's programs (the exploration case's
  divisor); :mod:`harness.bench.arms`: the exploration case's arms, each a child, timed in turns on
  one CPU; :mod:`harness.bench.calls`: the same pair's function calls, in a fresh interpreter.
"""
