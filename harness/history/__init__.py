"""Where a finding was born and where it was fixed: the harness on upstream's history.

``python -m harness history CHECK`` (:mod:`harness.commands.history`) runs a check on the builds of a history and
bisects it, as ``git bisect run`` does with the harness as its test:

* :mod:`~harness.history.points`: the history's points, oldest first (upstream's builds on the package index, a
  row of trees, the revisions of a git checkout).
* :mod:`~harness.history.checks`: what each build is asked (a finding's reproducer, a fixed program under the
  server's own log, a property of the server gate), answered present, absent or skipped.
* :mod:`~harness.history.bisect`: the bisection and its state so far; :mod:`~harness.history.table`: a check on
  a spread of builds, the findings x history table.
"""
