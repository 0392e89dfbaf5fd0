"""Fuzz campaigns (``python -m harness fuzz`` and ``python -m harness replay``), on the floor "work" of harness.FLOORS.

* :mod:`~harness.campaign.store`: the example database (a directory or a Redis server) and the
  failure records a campaign keeps in it beside Hypothesis' own examples.
* :mod:`~harness.campaign.machines`: every state machine of the chosen backends, by name, and the
  check that each backend can run here (build, models) before any work starts.
* :mod:`~harness.campaign.runner`: one run of one machine (counted rules and examples, reach,
  failure signature, shrink, save), shared by the workers and by replay.
* :mod:`~harness.campaign.worker`: a worker process (``python -m harness.campaign.worker``).
* :mod:`~harness.campaign.engine`: the campaign: workers, events, the failures record.
* :mod:`~harness.campaign.view`: the live view (rich on a terminal, a line per interval otherwise).
* :mod:`~harness.campaign.replay`: re-running every saved failure, with its verdict.

May import: ``harness.backends`` and everything below it.
"""
