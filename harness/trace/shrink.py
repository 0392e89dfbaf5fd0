"""Shrink a libllama trace to the fewest calls whose replay still shows one divergence.

:func:`shrink` keeps the target (``("fresh", i)``: read ``i``'s argmax unlike a fresh sequential
evaluation's; ``("ret", i)``: call ``i`` returning unlike in the trace) and cuts the rest:

1. **the slice** (:func:`~harness.trace.lineage.slice_read`): only the calls the target's sequences depend
   on, when the replay of that alone still shows the target (a 100,000-call soak trace slices to a
   few thousand calls, replayed in about a second);
2. **drop calls**, then **drop batch rows**: Zeller's delta debugging (:func:`ddmin`) over the calls,
   then over the rows of the batches left, until neither shrinks;
3. **merge ubatches**: two batches next to each other become one (their rows in order), when the
   target still shows.

Every candidate must keep the rest of the trace's behaviour: each call kept returns what it returned
in the trace, the calls make no inconsistency of their own (:class:`~harness.trace.calls.Memory`) but the
target's, and no batch is decoded with a sliding window shorter than the trace's own replay had it
(:attr:`~harness.trace.replay_engine.RunResult.windows`: a shrink that drops a checkpoint restore must not
show the target for another reason than the server's).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import TypeVar

from harness.trace.calls import Event, Memory, is_batch, rows
from harness.trace.lineage import STATEFUL, slice_read, with_rows
from harness.trace.replay_engine import Engine, RunResult

__all__ = ["ddmin", "merge_batches", "shrink"]

T = TypeVar("T")


def ddmin(units: list[T], test: Callable[[list[T]], bool], *, budget: float = 600.0) -> list[T]:
    """Zeller's delta debugging: a 1-minimal sublist of ``units`` that still passes ``test`` (which the
    whole list must pass), or the smallest found when ``budget`` seconds run out."""
    deadline = time.monotonic() + budget
    n = 2
    while len(units) >= 2 and time.monotonic() < deadline:
        size = -(-len(units) // n)
        parts = [units[k : k + size] for k in range(0, len(units), size)]
        for cand in [*parts, *([u for j, p in enumerate(parts) if j != k for u in p] for k in range(len(parts)))]:
            if len(cand) < len(units) and test(cand):
                units = cand
                n = max(n - 1, 2) if len(cand) > size else 2
                break
        else:
            if n >= len(units):
                break
            n = min(2 * n, len(units))
    return units


def merge_batches(a: Event, b: Event) -> Event:
    """One batch of ``a``'s rows then ``b``'s (it keeps ``a``'s call number)."""
    both = {**a, "tok": [*(a.get("tok") or []), *(b.get("tok") or [])]}
    na = len(a.get("tok") or [])
    both["pos"] = [*(a.get("pos") or []), *(b.get("pos") or [])]
    both["seq"] = [*(a.get("seq") or []), *(b.get("seq") or [])]
    both["out"] = [*(j for j, r in enumerate(rows(a)) if r.out), *(na + j for j, r in enumerate(rows(b)) if r.out)]
    return with_rows(both, range(len(both["tok"])))


class _Shrinker:
    """One shrink: the calls left (``base``) and the pinned target (its call; for a read, the batch
    before it and the read)."""

    def __init__(self, engine: Engine, events: list[Event], target: tuple[str, int]) -> None:
        self.engine = engine
        self.kind, self.at = target
        by_i = {int(e["i"]): e for e in events if "i" in e and e.get("ev") != "ret"}
        if self.at not in by_i:
            raise ValueError(f"target call {self.at} is not in the trace")
        self.windows: set[tuple[int, int, int, int]] | None = None  # the trace's own short windows
        # reads and queries change nothing: only the target read stays; nothing after the target matters
        self.base = [e for e in events if e.get("ev") in STATEFUL and int(e["i"]) < self.at]
        self.pinned: list[Event] = [by_i[self.at]]
        if self.kind == "fresh":
            proc = max((e for e in self.base if is_batch(e)), key=lambda e: int(e["i"]))
            self.base.remove(proc)
            self.pinned.insert(0, proc)
        self.sliced = False
        if self.kind == "fresh":  # the slice first: the whole trace may show other differences of its own
            lin = slice_read(events, self.at)
            if self.shows(lin.calls, [lin.batch, lin.read], None):
                self.base, self.pinned, self.sliced = lin.calls, [lin.batch, lin.read], True
        if not self.sliced and not self.shows(self.base, self.pinned, None):
            raise ValueError(f"the replay of the trace does not show {self.kind} at call {self.at}")
        self.wanted = self.issues([*self.base, *self.pinned])[0]

    def issues(self, evs: list[Event]) -> tuple[set[tuple[str, int, int]], bool]:
        """The target call's inconsistencies (what, seq, pos), and whether any other call has one."""
        mem = Memory(self.engine.ctx_id)
        at_target: set[tuple[str, int, int]] = set()
        others = False
        for e in sorted(evs, key=lambda e: int(e["i"])):
            found = {(x.what, x.seq, x.pos) for x in mem.apply(e) if x.what != "pos_max"}
            if int(e["i"]) == self.at:
                at_target |= found
            else:
                others = others or bool(found)
        return at_target, others

    def _run(self, evs: list[Event]) -> RunResult:
        res = self.engine.run(evs, fresh=lambda e: int(e["i"]) == self.at)
        if self.windows is None:
            self.windows = set(res.windows)
        return res

    def shows(self, base: list[Event], pinned: list[Event], wanted: set[tuple[str, int, int]] | None) -> bool:
        evs = sorted([*base, *pinned], key=lambda e: int(e["i"]))
        if self.kind == "ret" and wanted is not None:
            # the same wrong call: its inconsistencies among the original's, none anywhere else
            mine, others = self.issues(evs)
            if others or not mine <= wanted or (wanted and not mine):
                return False
        res = self._run(evs)
        if self.windows is not None and not set(res.windows) <= self.windows:
            return False  # a short window the server never had: another cause than the trace's
        if self.kind == "ret":
            return any(i == self.at for i, _, _ in res.rets) and all(i == self.at for i, _, _ in res.rets)
        if res.rets:
            return False
        v = next((r for r in res.reads if r.i == self.at), None)
        return v is not None and v.fresh_argmax is not None and v.fresh_argmax != v.argmax_replay

    def out_row(self) -> int:
        if self.kind != "fresh":
            return -1
        idx = int(self.pinned[1]["idx"])
        return idx if idx >= 0 else len(rows(self.pinned[0])) + idx

    def rebuild(self, sel: list[tuple[int, int]]) -> tuple[list[Event], list[Event]] | None:
        """The calls with only the rows ``sel`` (event i, row j) left; None when the pinned batch is empty."""
        keep: dict[int, list[int]] = {}
        extra = [(int(self.pinned[0]["i"]), self.out_row())] if self.kind == "fresh" else []
        for i, j in [*sel, *extra]:
            keep.setdefault(i, []).append(j)
        base = [e if not is_batch(e) else with_rows(e, sorted(keep[int(e["i"])]))
                for e in self.base if not is_batch(e) or int(e["i"]) in keep]  # fmt: skip
        pin = self.pinned[0]
        if not is_batch(pin):
            return base, list(self.pinned)
        js = sorted(keep.get(int(pin["i"]), []))
        if not js:
            return None  # an empty batch fails for its own reason
        pins = [with_rows(pin, js)]
        if self.kind == "fresh":
            pins.append({**self.pinned[1], "idx": js.index(self.out_row())})
        return base, pins

    def merge(self, deadline: float) -> int:
        """Merge neighbouring batches of ``base`` while the target shows; how many merges held."""
        merged = 0
        k = len(self.base) - 2
        while k >= 0 and time.monotonic() < deadline:
            a, b = self.base[k], self.base[k + 1]
            if is_batch(a) and is_batch(b):
                cand = [*self.base[:k], merge_batches(a, b), *self.base[k + 2 :]]
                if self.shows(cand, self.pinned, self.wanted):
                    self.base = cand
                    merged += 1
            k -= 1
        return merged

    def size(self) -> tuple[int, int]:
        return len(self.base), sum(len(rows(e)) for e in [*self.base, *self.pinned] if is_batch(e))

    def run(self, budget: float) -> list[Event]:
        deadline = time.monotonic() + budget
        for _ in range(4):  # calls, then rows, then merges, until none shrinks
            size = self.size()
            self.base = ddmin(self.base, lambda b: self.shows(b, self.pinned, self.wanted),
                              budget=max(1.0, (deadline - time.monotonic()) / 2))  # fmt: skip
            units = [(int(e["i"]), j) for e in [*self.base, *self.pinned[:1]] if is_batch(e)
                     for j in range(len(rows(e)))]  # fmt: skip
            if self.kind == "fresh":
                units.remove((int(self.pinned[0]["i"]), self.out_row()))

            def rows_show(sel: list[tuple[int, int]]) -> bool:
                built = self.rebuild(sel)
                return built is not None and self.shows(built[0], built[1], self.wanted)

            sel = ddmin(units, rows_show, budget=max(1.0, (deadline - time.monotonic()) / 2)) if units else units
            built = self.rebuild(sel)
            if built is not None and rows_show(sel):
                self.base, self.pinned = built
            merged = self.merge(deadline)
            if (self.size() == size and not merged) or time.monotonic() > deadline:
                break
        rets = self.engine.trace_rets
        out = sorted([*self.base, *self.pinned], key=lambda e: int(e["i"]))
        return [x for e in out for x in ([e, {"ev": "ret", "of": int(e["i"]), "ret": rets.get(int(e["i"]), 0)}]
                                         if is_batch(e) else [e])]  # fmt: skip


def shrink(engine: Engine, events: Sequence[Event], target: tuple[str, int], *, budget: float = 600.0) -> list[Event]:
    """The fewest calls (and batch rows) whose replay still shows ``target`` (see the module's text)."""
    return _Shrinker(engine, list(events), target).run(budget)
