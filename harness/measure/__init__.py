"""Measurements and the reporters that turn them into pages and tables (floor 6 of harness/__init__.py).

* :mod:`harness.measure.bench`: the bench's framework (cases, figures, goals, table, comparison).
* :mod:`harness.measure.bench_cases`: the cases of ``python -m harness bench`` (issue 17).
"""
