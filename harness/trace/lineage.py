"""What a logits read of a trace depends on, and which located finding's condition those calls meet.

* :func:`slice_read` keeps, of the calls before a read, only those its sequence's memory depends on,
  walking back from the read: the rows of the sequences it depends on (a batch's other rows go), every
  cut, copy and shift of them, a state set into one of them and the get that made those bytes (whose
  sequence it then depends on), until a whole state set, a ``seq_rm`` of everything or a ``clear``
  replaces what came before. A soak's trace of 100,000 calls slices to a few thousand, which the replay
  runs in about a second and the shrink (:mod:`harness.trace.shrink`) starts from.
* :class:`Explainer` finds the reads whose sequence held a given token history (the calls' view,
  :class:`~harness.trace.calls.Memory`: the read that gave an answer's token ``k`` held the prompt and the
  ``k`` tokens before it) and names the located finding whose exact condition a read's calls meet:
  ``decode-exception-keeps-slot-tokens`` when one of them is a decode that threw (it has no return
  in the trace: the server kept the batch's tokens as evaluated, server-context.cpp:2871-2874 at
  0c1e570), ``swa-restore-window-short`` when one of them decoded a row with its sliding window short
  (:func:`~harness.trace.calls.short_window`, from the ``pos_min`` libllama answered the server). Else None:
  a difference no located finding explains.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from harness.findings import DECODE_EXCEPTION_KEEPS_SLOT_TOKENS, SWA_RESTORE_WINDOW_SHORT
from harness.trace.calls import Event, Memory, is_batch, main_context, rows

__all__ = ["DECODE_THREW", "SHORT_WINDOW", "Explainer", "Lineage", "slice_read", "with_rows"]

DECODE_THREW = DECODE_EXCEPTION_KEEPS_SLOT_TOKENS.id
SHORT_WINDOW = SWA_RESTORE_WINDOW_SHORT.id
#: the calls that change a context's memory (the rest are reads and queries)
STATEFUL = ("process", "decode", "seq_rm", "seq_cp", "seq_keep", "seq_add", "seq_div", "clear",
            "state_seq_get_data", "state_seq_set_data", "state_set_data")  # fmt: skip
_PARTIAL_ONLY = 1


def with_rows(e: Event, keep: Sequence[int]) -> Event:
    """A batch event with only its rows ``keep`` (in order)."""
    out = dict(e)
    rs = rows(e)
    sel = [rs[j] for j in keep]
    out["n"] = len(sel)
    out["tok"] = [r.tok for r in sel]
    out["pos"] = [r.pos for r in sel]
    out["seq"] = [list(r.seqs) if len(r.seqs) > 1 else r.seqs[0] for r in sel]
    out["out"] = [j for j, r in enumerate(sel) if r.out]
    out["embd"] = []
    return out


def _depends(events: Sequence[Event], before: int, seqs: set[int]) -> list[Event]:
    """The calls before call ``before`` that what ``seqs`` hold then depends on (see the module's text)."""
    need = set(seqs)
    hashes: set[str] = set()
    keep: list[Event] = []
    for e in reversed([e for e in events if e.get("ev") in STATEFUL and int(e["i"]) < before]):
        k = e["ev"]
        if k in ("process", "decode"):
            raw = e.get("seq") or [0]
            if not any((s in need) if isinstance(s, int) else bool(need.intersection(s)) for s in raw):
                continue
            rs = rows(e)
            js = [j for j, r in enumerate(rs) if set(r.seqs) & need]
            keep.append(with_rows(e, js))
            need |= {s for j in js for s in rs[j].seqs}
        elif k in ("seq_rm", "seq_add", "seq_div", "seq_keep"):
            s = int(e["seq"])
            if s < 0 or s in need:
                keep.append(e)
                if k == "seq_rm" and s >= 0 and int(e["p0"]) < 0 and int(e["p1"]) < 0:
                    need.discard(s)  # emptied: nothing before matters
        elif k == "seq_cp":
            if int(e["dst"]) in need:
                keep.append(e)
                need.add(int(e["src"]))
        elif k == "clear":
            keep.append(e)
            break
        elif k == "state_seq_set_data":
            if int(e["seq"]) in need:
                keep.append(e)
                hashes.add(str(e.get("hash")))
                if not int(e.get("flags", 0)) & _PARTIAL_ONLY:
                    need.discard(int(e["seq"]))  # a whole state replaces it
        elif k == "state_seq_get_data" and str(e.get("hash")) in hashes:
            keep.append(e)
            need.add(int(e["seq"]))
        if not need and not hashes:
            break
    return list(reversed(keep))


@dataclass
class Lineage:
    """A read's slice: the calls it depends on, its batch (only its sequence's rows) and the read
    (its row index in that batch)."""

    calls: list[Event]
    batch: Event
    read: Event


def slice_read(events: Sequence[Event], read_i: int) -> Lineage:
    """The slice of read ``read_i`` (see the module's text)."""
    by_i = {int(e["i"]): e for e in events if "i" in e and e.get("ev") not in ("ret",)}
    read = by_i[read_i]
    ctx = read.get("ctx")
    batch = max((e for e in events if e.get("ev") in ("process", "decode") and e.get("ctx") == ctx
                 and int(e["i"]) < read_i), key=lambda e: int(e["i"]))  # fmt: skip
    rs = rows(batch)
    idx = int(read["idx"]) if int(read["idx"]) >= 0 else len(rs) + int(read["idx"])
    seq = rs[idx].seqs[0]
    js = [j for j, r in enumerate(rs) if seq in r.seqs]
    calls = _depends([e for e in events if e.get("ctx") == ctx], int(batch["i"]), set(rs[idx].seqs))
    return Lineage(calls, with_rows(batch, js), {**read, "idx": js.index(idx)})


class Explainer:
    """One trace, read once, asked which located finding explains a served token (:meth:`explain`).

    One walk of the calls indexes every read by the token history its sequence held (the calls' view,
    :class:`~harness.trace.calls.Memory`) and finds the decodes that threw and those decoded with a short
    window; then each question is a lookup and a slice."""

    def __init__(self, events: Sequence[Event], n_swa: int) -> None:
        self.events = events
        ctx = main_context(events)
        returned = {int(e["of"]) for e in events if e.get("ev") == "ret"}
        self.threw = {int(e["i"]) for e in events if is_batch(e) and e.get("ctx") == ctx
                      and int(e["i"]) not in returned}  # fmt: skip
        self.short: set[tuple[int, int]] = set()
        self.reads: dict[int, list[tuple[tuple[int, ...], Event]]] = {}  # by the history's hash
        mem = Memory(ctx, n_swa=n_swa)
        for e in events:
            self.short |= {(int(e["i"]), x.seq) for x in mem.apply(e) if x.what == "window"}
            if e.get("ev") == "logits" and e.get("ctx", ctx) == ctx:
                where = mem.read_context(e)
                if where is not None and where[2] is not None:
                    h = tuple(where[2])
                    self.reads.setdefault(hash(h), []).append((h, e))

    def reads_of(self, history: Sequence[int]) -> list[Event]:
        """The reads whose row's sequence held exactly ``history`` (positions 0.. its last), in order."""
        h = tuple(int(t) for t in history)
        return [e for k, e in self.reads.get(hash(h), []) if k == h]

    def explain_read(self, read_i: int) -> str | None:
        """The located finding whose condition the calls read ``read_i`` depends on meet, or None."""
        lin = slice_read(self.events, read_i)
        decodes = [e for e in [*lin.calls, lin.batch] if e.get("ev") in ("process", "decode")]
        if any(int(e["i"]) in self.threw for e in decodes):
            return DECODE_THREW
        if any((int(e["i"]), s) in self.short for e in decodes for r in rows(e) for s in r.seqs):
            return SHORT_WINDOW
        return None

    def explain(self, history: Sequence[int], served: int) -> str | None:
        """The located finding that explains a served token: every read of ``history`` whose argmax is
        ``served`` (the token the server chose after that history) depends on calls that meet that one
        finding's condition. None when no such read is in the trace, or one of them meets none."""
        found: set[str | None] = set()
        for e in self.reads_of(history):
            if e.get("top") and int(e["top"][0][0]) == served:
                found.add(self.explain_read(int(e["i"])))
                if None in found or len(found) > 1:
                    return None
        return found.pop() if found else None
