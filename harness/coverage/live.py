"""New lines of the C++ under test reached, as a campaign's progress (issue #39, point 0).

A campaign on the server backend run by ``python -m harness coverage --run fuzz`` sends its servers' gcov
counters into a coverage run's directory and names it in :data:`COVERAGE_RUN_ENV` (``DIR`` and the workload,
joined by ``os.pathsep``). :class:`LineProbe` reads, at most every :data:`READ_SECONDS` and only when a target
object's counter file changed, the lines of the targets the servers stopped so far reached
(:func:`harness.coverage.gcovr.gcov_doc`: gcov's own JSON of the eight target objects, a few seconds; never
gcovr, which takes a minute): the campaign's status line and summary say ``lines 946/1856 (+14)`` (the new ones
since the previous reading) and its JSON has every reading over time. A server writes its counters when it
exits, so a reading counts the servers stopped by then; a worker's last servers count once the campaign ends
(the last reading is taken then).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.coverage.gcovr import CoverageRun, gcov_doc, target_reach

__all__ = ["COVERAGE_RUN_ENV", "READ_SECONDS", "LineProbe"]

COVERAGE_RUN_ENV = "PROMPT_CACHE_COVERAGE_RUN"
READ_SECONDS = 30.0  # the most often the counters are read (a reading: about 1 s of gcov per target object)


@dataclass
class LineProbe:
    """The lines of the targets reached by a coverage run's ``workload`` so far, read at a bounded rate."""

    run: CoverageRun
    workload: str
    every: float = READ_SECONDS
    readings: list[tuple[float, int]] = field(default_factory=list)  # (seconds into the campaign, lines reached)
    total: int = 0  # the targets' lines
    failed: int = 0  # readings gcov could not make (a counter file being written): the last one stands
    _next: float = 0.0
    _stamp: tuple[tuple[str, int, int], ...] = ()

    @classmethod
    def from_env(cls, env: dict[str, str] | None = None) -> LineProbe | None:
        """The probe :data:`COVERAGE_RUN_ENV` names; None when it names none (a campaign outside ``coverage``)."""
        value = (os.environ if env is None else env).get(COVERAGE_RUN_ENV, "")
        if not value:
            return None
        root, _, workload = value.rpartition(os.pathsep)
        return cls(CoverageRun.open(Path(root)), workload)

    def _changed(self) -> bool:
        gcda = self.run.gcda(self.workload)
        stamp = tuple(sorted((str(p), s.st_size, s.st_mtime_ns) for p in gcda.rglob("*.gcda") for s in [p.stat()]))
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        return True

    def read(self, elapsed: float, *, force: bool = False) -> bool:
        """Read the counters if due (``every`` seconds since the last reading; ``force``: now) and changed; True
        when a reading was added."""
        now = time.monotonic()
        if not force and now < self._next:
            return False
        self._next = now + self.every
        if not self._changed():
            return False
        doc = gcov_doc(self.run, [self.workload])
        if doc is None:
            self.failed += 1
            self._stamp = ()  # read again next time
            return False
        reached, self.total = target_reach(self.run, doc)
        self.readings.append((round(elapsed, 1), len(reached)))
        return True

    @property
    def lines(self) -> int:
        return self.readings[-1][1] if self.readings else 0

    def text(self) -> str:
        """``lines 946/1856 (+14)``: reached of the targets' lines, and the new ones since the reading before."""
        if not self.readings:
            return "lines - (no counters yet)"
        new = self.lines - (self.readings[-2][1] if len(self.readings) > 1 else 0)
        return f"lines {self.lines}/{self.total} (+{new})"

    def to_json(self) -> dict[str, Any]:
        return {
            "workload": self.workload,
            "lines_reached": self.lines,
            "lines_total": self.total,
            "readings": [list(r) for r in self.readings],
            "failed_readings": self.failed,
        }
