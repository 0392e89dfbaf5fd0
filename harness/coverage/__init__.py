"""Line and branch coverage of the C++ under test (``python -m harness coverage``; see docs/coverage.md).

* :mod:`harness.coverage.gcovr`: a coverage run's directory and gcovr on it.
* :mod:`harness.coverage.functions`: the functions measured, and why a block no workload reached is not reached.
* :mod:`harness.coverage.report`: ``coverage.json`` and the table.
* :mod:`harness.coverage.live`: the lines a campaign's servers reached, read with gcov at a bounded rate, as the
  campaign's progress.
"""
