"""The memory report of ``python -m harness report``: its stages, the figures and the page.

* :mod:`harness.report.stages`: the stages that measure, in order, and the files they leave (:func:`build_report`).
* :mod:`harness.report.saves`: one save's transient peak and time against the number and the size of the
  checkpoints, on the model's ledger, libllama under memray and a real llama-server; the cost of a checkpoint
  update; the breakdown of the server's peak (the bench's ``saves`` case uses it too).
* :mod:`harness.report.flame`: a memray capture drawn as a flame graph in plain SVG (renders offline).
* :mod:`harness.report.page`: the self-contained HTML page and ``report.json``.
"""
