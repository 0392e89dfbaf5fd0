"""Bisecting a history, as ``git bisect run`` does with the harness as its test.

:func:`bisect` takes points oldest first and a test (:class:`Tester`: build the point, run the check) and looks for
where the state changes: it tests both ends (moving inward past a build that cannot be tested), and if they
differ, halves the range between the last point in the first state and the first in the other until they are
neighbours or every point between them could not be tested. A point that cannot be tested (it does not build,
the check does not apply) is :data:`~harness.history.checks.SKIPPED` with its reason, never guessed, and the next
point tried is the untested one nearest the middle (``git bisect skip``).

:class:`Bisection` is the state so far: what each tested point showed, the range, and its lines: a Ctrl-C in the
middle prints it as it stands.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.errors import BuildError, HarnessError
from harness.history.checks import ABSENT, PRESENT, SKIPPED, Check, Verdict
from harness.history.points import Point
from harness.interrupt import check as check_interrupt
from harness.trees.build import server_build

__all__ = ["Bisection", "Tested", "Tester", "bisect"]


@dataclass(frozen=True)
class Tested:
    """One point tested: its verdict, how its build came (``cached``, ``built in 412 s``, ``failed``), seconds."""

    __test__ = False  # not a test class for pytest, whatever its name

    point: Point
    verdict: Verdict
    build: str
    seconds: float

    def to_json(self) -> dict[str, Any]:
        return {"point": self.point.label, "source": self.point.source, "build_number": self.point.build,
                "state": self.verdict.state, "why": self.verdict.why, "build": self.build,
                "seconds": round(self.seconds, 1)}  # fmt: skip


class Tester:
    """Builds a point's ``llama-server`` (cached by the tree's content, ccache across neighbours; only the server
    and libllama targets) and runs ``check`` on it. A build that fails is a skip with its first line. ``builds``
    (shared between testers: the table's findings) keeps each point's build, or why it has none, for this run, so
    a point is built, or fails to build, once."""

    def __init__(self, check: Check, log: Callable[[str], None],
                 builds: dict[str, tuple[Path | None, str]] | None = None) -> None:  # fmt: skip
        self.check = check
        self.log = log
        self.builds = builds if builds is not None else {}
        self.built = 0  # builds compiled (not found in the cache)

    def _build(self, point: Point) -> tuple[Path | None, str]:
        t0 = time.monotonic()
        said: list[str] = []

        def log(m: str) -> None:
            said.append(m)
            self.log(m)

        try:
            tree = point.tree(self.log)
            source = Path(point.source) if point.checkout is None else tree  # a build's name replays by its name
            build = server_build(source=source, log=log)
        except BuildError as e:
            return None, f"does not build: {str(e).splitlines()[0][:300]}"
        except HarnessError as e:
            return None, f"no tree: {str(e).splitlines()[0][:300]}"
        compiled = any("building" in m for m in said)
        self.built += compiled
        return build.binary, (f"built in {time.monotonic() - t0:.0f} s" if compiled else "cached")

    def __call__(self, point: Point) -> Tested:
        t0 = time.monotonic()
        if point.source not in self.builds:
            self.builds[point.source] = self._build(point)
        binary, how = self.builds[point.source]
        if binary is None:
            return Tested(point, Verdict(SKIPPED, how), "failed", time.monotonic() - t0)
        verdict = self.check.run(binary, self.log)
        return Tested(point, verdict, how, time.monotonic() - t0)


@dataclass
class Bisection:
    """Where a bisection stands: the points, what each tested one showed, and the range ``lo``..``hi`` (indices of
    the last point in the first state and the first in the other, once both ends are known)."""

    check: str
    points: list[Point]
    tested: dict[int, Tested] = field(default_factory=dict)
    lo: int | None = None
    hi: int | None = None
    done: bool = False

    def state(self, i: int) -> str:
        return self.tested[i].verdict.state

    def left(self) -> int:
        """About how many more points to test (the halvings left)."""
        if self.lo is None or self.hi is None:
            return 2 + (math.ceil(math.log2(len(self.points))) if len(self.points) > 2 else 0)
        open_ = [i for i in range(self.lo + 1, self.hi) if i not in self.tested]
        return math.ceil(math.log2(len(open_) + 1))

    def range_text(self) -> str:
        if self.lo is None or self.hi is None:
            return f"{self.points[0].label}..{self.points[-1].label} (ends not yet tested)"
        a, b = self.points[self.lo], self.points[self.hi]
        return f"{self.state(self.lo)} at {a.label}, {self.state(self.hi)} at {b.label}"

    def skipped_between(self) -> list[Tested]:
        if self.lo is None or self.hi is None:
            return []
        return [t for i, t in sorted(self.tested.items()) if self.lo < i < self.hi and t.verdict.state == SKIPPED]

    def conclusion(self) -> str:
        """One line: where it changed (the neighbours, or the narrowest range the skips allow), or that it did not."""
        if self.lo is None or self.hi is None:
            ends = [t for _i, t in sorted(self.tested.items())]
            states = {t.verdict.state for t in ends}
            if len(states) == 1 and SKIPPED not in states:
                return (f"{self.check}: {ends[0].verdict.state} at both ends ({self.points[0].label}, "
                        f"{self.points[-1].label}): no change to bisect in this range")  # fmt: skip
            return f"{self.check}: no end of {self.points[0].label}..{self.points[-1].label} could be tested"
        a, b = self.points[self.lo], self.points[self.hi]
        first, second = self.state(self.lo), self.state(self.hi)
        what = "introduced" if (first, second) == (ABSENT, PRESENT) else "fixed"
        lead = "last without it" if what == "introduced" else "last with it"
        follow = "first with it" if what == "introduced" else "first without it"
        skipped = self.skipped_between()
        between = self.hi - self.lo - 1
        untested = between - len(skipped)
        tail = "".join((
            f"; {len(skipped)} build(s) between could not be tested: "
            + ", ".join(f"{t.point.label} ({t.verdict.why[:80]})" for t in skipped) if skipped else "",
            f"; {untested} point(s) between not yet tested" if untested else "",
        ))  # fmt: skip
        return f"{self.check}: {what} between {a.label} ({lead}) and {b.label} ({follow}){tail}"

    def to_json(self) -> dict[str, Any]:
        return {
            "check": self.check,
            "points": [p.label for p in self.points],
            "range": None if self.lo is None or self.hi is None else {
                "from": self.points[self.lo].label, "from_state": self.state(self.lo),
                "to": self.points[self.hi].label, "to_state": self.state(self.hi)},
            "done": self.done,
            "conclusion": self.conclusion(),
            "tested": [t.to_json() for _i, t in sorted(self.tested.items())],
        }  # fmt: skip


def _end(b: Bisection, test: Callable[[Point], Tested], order: Sequence[int], progress: Callable[[str], None],
         ) -> int | None:  # fmt: skip
    """The first index in ``order`` whose test is not skipped (tested as needed), or None."""
    for i in order:
        if i not in b.tested:
            _test(b, i, test, progress)
        if b.state(i) != SKIPPED:
            return i
    return None


def _test(b: Bisection, i: int, test: Callable[[Point], Tested], progress: Callable[[str], None]) -> None:
    check_interrupt()
    progress(f"history: testing {b.points[i].label} ({len(b.tested)} tested, about {b.left()} left; {b.range_text()})")
    t = test(b.points[i])
    b.tested[i] = t
    progress(f"history: {t.point.label}: {t.verdict.state} ({t.build}, {t.seconds:.0f} s): {t.verdict.why}")


def bisect(check: str, points: Sequence[Point], test: Callable[[Point], Tested],
           progress: Callable[[str], None], bisection: Bisection | None = None) -> Bisection:  # fmt: skip
    """Bisect ``points`` (oldest first) with ``test``; ``bisection`` (if given) is filled as it goes, so a caller
    that catches Ctrl-C still holds the range so far."""
    b = bisection if bisection is not None else Bisection(check, list(points))
    n = len(b.points)
    lo = _end(b, test, range(n), progress)
    hi = _end(b, test, range(n - 1, -1, -1), progress) if lo is not None else None
    if lo is None or hi is None or hi <= lo or b.state(lo) == b.state(hi):
        b.done = True
        return b
    b.lo, b.hi = lo, hi
    while b.hi - b.lo > 1:
        mid = (b.lo + b.hi) / 2
        open_ = sorted((i for i in range(b.lo + 1, b.hi) if i not in b.tested), key=lambda i: (abs(i - mid), i))
        if not open_:
            break  # every point between is skipped: the narrowest range the builds allow
        i = open_[0]
        _test(b, i, test, progress)
        state = b.state(i)
        if state == SKIPPED:
            continue
        if state == b.state(b.lo):
            b.lo = i
        else:
            b.hi = i
    b.done = True
    return b
