"""Experiments on a real ``llama-server`` beside the gate: what ``python -m harness slot-files`` runs, what the
tests of issue #39 drive, and what the load tools' generated programs (:mod:`harness.load.slot_programs`,
:mod:`harness.load.reuse_programs`) build on. The gate's server backend (:mod:`harness.backends.llama_server`) runs
none of them; the gate's steps after it (:mod:`harness.load.gate_step`) run some.

- :mod:`.slot_files`: hostile slot file names sent to save/restore/erase, each judged;
- :mod:`.slot_names`: those names: an explicit list and a Hypothesis tail, each classed from what it is on POSIX;
- :mod:`.slot_sandbox`: the ``--slot-save-path`` sandbox with planted symlinks, watched by snapshots and inotify;
- :mod:`.slot_restore`: save/restore/erase between completions against the model and a fresh evaluation, and a
  full tmpfs (``slot-files --differential``);
- :mod:`.full_disk`: a slot save at every free-space boundary of a full tmpfs, each file held to ``no_partial_file``
  (the server gate's full-disk step);
- :mod:`.reuse`: ``--cache-reuse`` and ``--context-shift`` on a real server against the model and a fresh server.

Floor: above the backends (an experiment may use the server backend's differential), below the work built on
them (``harness.load`` imports the experiments).
"""
