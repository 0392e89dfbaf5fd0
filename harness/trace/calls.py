"""A trace of what a process asks of libllama: the interposer ``trace.c``, built and preloaded, and its file read.

``trace.c`` (beside this file) is an ``LD_PRELOAD`` interposer of libllama's memory, state, batch and
logits calls (its header says which and what each line holds). What this module promises:

* :func:`build_trace` compiles it with the system ``gcc`` against a tree's own ``include/llama.h`` (the
  pinned sdist's unless given), so every struct it reads by value (``llama_context_params``,
  ``llama_batch``) has that tree's layout; cached beside the fault shim, keyed by the source and the
  headers. A missing compiler or a header it does not compile against is one
  :class:`~faults.native.NativeUnavailable` line.
* :func:`trace_env` is the environment a process starts with to be traced (``LD_PRELOAD``, with the
  fault shim's ``LD_PRELOAD`` kept first when one is given: one process, both jobs). The file is
  bounded (``max_bytes``) and written as it goes, one line per call.
* :func:`static_note` is the one line saying that a binary links libllama statically: the interposer
  sees none of its calls then.
* :func:`read_trace` reads a trace (a torn last line, the mark of a crash mid-write, is dropped and
  counted) into :class:`Trace`; :func:`rows` and :func:`logits_row` decode a batch's rows and a logits
  read's row; :class:`Memory` follows what each sequence holds through the calls, position by position,
  and says when a call is inconsistent with it (a position written twice or past a hole, a read of a
  row that wants no output, a row decoded with its sliding window short of a cell it needs:
  :func:`short_window`): the server's use of libllama, checked from the trace alone.
* :func:`write_trace` writes events back (a shrunk trace is a trace).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from faults.native import NativeUnavailable, cache_dir
from harness.errors import HarnessLimit
from harness.trees.pinned import sdist_source
from harness.trees.semantics import blank_comments
from harness.trees.stage import links_libllama

__all__ = [
    "DEFAULT_MAX_BYTES",
    "TRACE_ENV",
    "Event",
    "Issue",
    "Memory",
    "Row",
    "Trace",
    "build_trace",
    "check_trace",
    "fnv1a64",
    "is_batch",
    "logits_row",
    "main_context",
    "read_trace",
    "rows",
    "short_window",
    "static_note",
    "trace_env",
    "trace_features",
    "write_trace",
]

_HERE = Path(__file__).resolve().parent
TRACE_ENV = "LLAMA_TRACE"
_PARTIAL_ONLY = 1  # LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY (llama.h)
DEFAULT_MAX_BYTES = 64 << 20

Event = dict[str, Any]


# the llama_context_params fields trace.c writes that a tree may not have yet (its "ctx" line leaves them out)
TRACE_OPTIONAL_FIELDS = ("n_rs_seq", "n_outputs_max", "n_outputs_max_per_seq", "ctx_type", "ctx_other")


def trace_features(header: str) -> dict[str, bool]:
    """What trace.c may use of the API in ``header`` (a tree's include/llama.h): ``BATCH_EXT``, the extended batch
    API with ``llama_process`` (the server's from between b10816 and b11434; before, ``llama_decode``), and each of
    :data:`TRACE_OPTIONAL_FIELDS` in ``struct llama_context_params``."""
    header = blank_comments(header)
    body = re.search(r"struct\s+llama_context_params\s*\{(.*?)\};", header, re.S)
    fields = body.group(1) if body else ""
    out = {"BATCH_EXT": re.search(r"\bllama_process\s*\(", header) is not None}
    out.update({f: re.search(rf"\b{f}\s*;", fields) is not None for f in TRACE_OPTIONAL_FIELDS})
    return out


def build_trace(tree: Path | None = None) -> Path:
    """The interposer's shared object, compiled against ``tree``'s headers (the pinned tree by default), with
    what that header has of the API (:func:`trace_features`) in its ``lt_features.h``."""
    tree = tree if tree is not None else sdist_source()
    src = _HERE / "trace.c"
    cc = shutil.which("gcc")
    if cc is None:
        raise NativeUnavailable("gcc not found: the libllama trace needs it to build trace.c")
    headers = [tree / "include" / "llama.h", *sorted((tree / "ggml" / "include").glob("*.h"))]
    if not headers[0].is_file():
        raise NativeUnavailable(f"{tree} has no include/llama.h to build the libllama trace against")
    h = hashlib.sha256(src.read_bytes())
    for p in headers:
        h.update(p.read_bytes())
    out = cache_dir() / f"trace-{h.hexdigest()[:12]}.so"
    if out.exists():
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    features = trace_features(headers[0].read_text(errors="replace"))
    fd, tmp = tempfile.mkstemp(prefix=".trace-", suffix=".so", dir=out.parent)
    os.close(fd)
    try:
        with tempfile.TemporaryDirectory(prefix="trace-features-") as gen:
            defines = "".join(f"#define LT_HAS_{k} {int(v)}\n" for k, v in features.items())
            Path(gen, "lt_features.h").write_text(defines)
            argv = [cc, "-O2", "-Wall", "-shared", "-fPIC", "-I", gen, "-I", str(tree / "include"),
                    "-I", str(tree / "ggml" / "include"), "-o", tmp, str(src), "-ldl", "-lpthread"]  # fmt: skip
            proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
        if proc.returncode != 0:
            first = next((ln for ln in proc.stderr.splitlines() if "error" in ln), proc.stderr.strip()[:200])
            # a limit of the harness on this tree (exit 6), not the user's mistake: trace.c records the pinned API
            raise HarnessLimit(f"the libllama trace cannot be built against {tree}/include/llama.h (trace.c knows "
                               f"the API from about b9093 to the pinned commit): {first}")  # fmt: skip
        os.replace(tmp, out)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return out


def trace_env(
    path: str | os.PathLike[str],
    *,
    tree: Path | None = None,
    max_bytes: int = DEFAULT_MAX_BYTES,
    topk: int = 10,
    row_max: int = 1024,
    with_env: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment that traces a process into ``path``; ``with_env`` (e.g. the fault shim's
    :meth:`~faults.native.RemoteShim.env`) is merged, its ``LD_PRELOAD`` first."""
    env = dict(with_env or {})
    so = str(build_trace(tree))
    env["LD_PRELOAD"] = f"{env['LD_PRELOAD']}:{so}" if env.get("LD_PRELOAD") else so
    env[TRACE_ENV] = os.fspath(path)
    env["LLAMA_TRACE_MAX_BYTES"] = str(max_bytes)
    env["LLAMA_TRACE_TOPK"] = str(topk)
    env["LLAMA_TRACE_ROW_MAX"] = str(row_max)
    return env


def static_note(binary: Path) -> str | None:
    """One line when ``binary`` links libllama statically (no ``libllama.so`` in ``ldd``), else None."""
    if links_libllama(binary):
        return None
    return (f"{binary} links libllama statically (no libllama.so in ldd): the LD_PRELOAD trace sees none of "
            "its calls; build it with -DBUILD_SHARED_LIBS=ON")  # fmt: skip


def fnv1a64(data: bytes) -> str:
    """The hash trace.c writes (FNV-1a 64 over the bytes), as its 16 hex digits."""
    h = 14695981039346656037
    for b in data:
        h = ((h ^ b) * 1099511628211) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


# --------------------------------------------------------------------------------------------
# reading
# --------------------------------------------------------------------------------------------


@dataclass
class Trace:
    """A trace's events in order (the ``trace`` header first), and how it ended."""

    events: list[Event]
    path: Path | None = None
    truncated: bool = False  # the byte cap was reached: calls after it are missing
    torn: int = 0  # lines that were not JSON (a crash mid-write)

    def of(self, *kinds: str) -> list[Event]:
        return [e for e in self.events if e.get("ev") in kinds]

    def contexts(self) -> list[Event]:
        return self.of("ctx")

    def model_path(self, model: int) -> str | None:
        return next((e["path"] for e in self.of("model") if e.get("model") == model), None)

    def returns(self) -> dict[int, int]:
        """Each ``process``/``decode``/``encode`` event's return value, by its ``i``."""
        return {e["of"]: e["ret"] for e in self.of("ret")}

    def size(self) -> int:
        return sum(len(json.dumps(e)) + 1 for e in self.events)


def read_trace(path: str | os.PathLike[str]) -> Trace:
    events: list[Event] = []
    torn = 0
    truncated = False
    with open(path, errors="replace") as f:
        for line in f:
            line = line.strip()
            if not line:
                continue
            try:
                ev = json.loads(line)
            except ValueError:
                torn += 1
                continue
            if ev.get("ev") == "truncated":
                truncated = True
                continue
            events.append(ev)
    return Trace(events, Path(path), truncated, torn)


def write_trace(events: Iterable[Event], path: str | os.PathLike[str]) -> None:
    with open(path, "w") as f:
        for e in events:
            f.write(json.dumps(e, separators=(",", ":")) + "\n")


@dataclass(frozen=True)
class Row:
    """One row of a batch: its token (-1: an embedding), first position, sequences, and whether it
    wants output."""

    tok: int
    pos: int
    seqs: tuple[int, ...]
    out: bool


def is_batch(ev: Event) -> bool:
    """Whether ``ev`` decoded a batch of rows: a ``process`` of type decode (``llama_process``, the server's call
    from between b10816 and b11434) or a ``decode`` (``llama_decode``, the server's call before; ``trace.c``
    records both)."""
    return ev.get("ev") in ("process", "decode") and ev.get("type", "decode") == "decode"


def rows(ev: Event) -> list[Row]:
    """The rows of a ``process``/``decode`` event (positions -1 when libllama chose them)."""
    toks = ev.get("tok") or []
    n = len(toks)
    pos = ev.get("pos") or [-1] * n
    seq = ev.get("seq") or [0] * n
    out = set(ev["out"]) if ev.get("out") is not None else {n - 1}
    return [
        Row(int(toks[i]), int(pos[i]), tuple(seq[i]) if isinstance(seq[i], list) else (int(seq[i]),), i in out)
        for i in range(n)
    ]


def logits_row(ev: Event) -> np.ndarray | None:
    """The whole logits row of a ``logits`` event (float32), when the trace kept it (``bits``)."""
    bits = ev.get("bits")
    if not bits:
        return None
    return np.frombuffer(bytes.fromhex(bits), dtype=">u4").astype("<u4").view(np.float32).copy()


# --------------------------------------------------------------------------------------------
# what each sequence holds
# --------------------------------------------------------------------------------------------


def short_window(n_swa: int, pos_min: int, pos: int) -> bool:
    """Whether a row at ``pos``, the first of its sequence in a batch, attends without a cell its sliding
    window needs: the sequence's memory starts at ``pos_min`` (``llama_memory_seq_pos_min``, which for an
    SWA model is the SWA cache's: src/llama-kv-cache-iswa.cpp:142-145 at 0c1e570) above ``pos - n_swa +
    1``, the oldest position not masked for it (``is_masked_swa``: ``p1 - p0 >= n_swa``,
    src/llama-hparams.h:484). A standard window only; ``pos_min`` -1 (empty) is a hole, not this."""
    return n_swa > 0 and pos > 0 and pos_min > max(0, pos - n_swa + 1)


class Issue(NamedTuple):
    """A call inconsistent with what the calls before it put in memory: ``what`` is ``holds`` (a position
    written twice), ``hole`` (a position past a hole), ``no-output`` (a read of a row that asked for no
    output), ``pos_max`` (libllama's answer unlike the calls') or ``window`` (a row decoded while its
    sequence's memory, as libllama last reported it, starts above the row's window: :func:`short_window`)."""

    what: str
    seq: int
    pos: int
    text: str


@dataclass
class Memory:
    """What each sequence of one context holds, position -> token, as the traced calls make it.

    :meth:`apply` takes the events in order and returns what in the event is inconsistent with it:
    a row at a position its sequence already holds, or past a hole (the server asking libllama to
    attend to a prefix it never wrote); a logits read of a row that asked for no output. A whole
    sequence's state set (``llama_state_seq_set_data``, a prompt-cache load) gives the sequence the
    tokens it held when a state of the same hash was got; a partial one (a checkpoint's recurrent or
    SWA part, ``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY``) leaves its positions as they are.

    With ``n_swa`` (the model's sliding window) it also keeps, per sequence, the ``pos_min`` libllama
    last reported (the server asks after every load, restore and cut), forgets it when a call may move
    it down, and says ``window`` when a batch's first row of a sequence is decoded with that memory
    starting above the row's window. A value kept too low only hides an issue, never makes one."""

    ctx: int = 0
    n_swa: int = 0
    pos_min: dict[int, int] = field(default_factory=dict)  # libllama's last answer, per sequence
    seqs: dict[int, dict[int, int]] = field(default_factory=dict)
    last_rows: list[Row] = field(default_factory=list)
    states: dict[str, dict[int, int]] = field(default_factory=dict)  # a whole sequence's state (by hash): its tokens

    def held(self, seq: int) -> dict[int, int]:
        return self.seqs.setdefault(seq, {})

    def history(self, seq: int, upto: int) -> list[int] | None:
        """The tokens of ``seq`` at positions 0..``upto``, or None if one is missing."""
        held = self.seqs.get(seq, {})
        out = []
        for p in range(upto + 1):
            if p not in held:
                return None
            out.append(held[p])
        return out

    def apply(self, ev: Event) -> list[Issue]:
        kind = ev.get("ev")
        if ev.get("ctx", self.ctx) != self.ctx:
            return []
        issues: list[Issue] = []
        self._forget(ev)
        if is_batch(ev):
            rs = rows(ev)
            self.last_rows = rs
            issues.extend(self._windows(rs))
            for j, r in enumerate(rs):
                for s in r.seqs:
                    held = self.held(s)
                    if r.pos < 0:
                        continue
                    if r.pos in held:
                        issues.append(Issue("holds", s, r.pos, f"row {j}: seq {s} already holds position {r.pos}"))
                    elif r.pos > 0 and (r.pos - 1) not in held:
                        issues.append(Issue("hole", s, r.pos, f"row {j}: seq {s} at position {r.pos} past a hole "
                                            f"(holds up to {max(held, default=-1)})"))  # fmt: skip
                    held[r.pos] = r.tok
        elif kind == "seq_rm" and ev.get("ret", True):
            for s in [ev["seq"]] if ev["seq"] >= 0 else list(self.seqs):
                held = self.held(s)
                p0, p1 = ev["p0"], ev["p1"]
                for p in [p for p in held if (p0 < 0 or p >= p0) and (p1 < 0 or p < p1)]:
                    del held[p]
        elif kind == "seq_cp":
            src = self.held(ev["src"])
            p0, p1 = ev["p0"], ev["p1"]
            self.held(ev["dst"]).update({p: t for p, t in src.items() if (p0 < 0 or p >= p0) and (p1 < 0 or p < p1)})
        elif kind == "seq_keep":
            self.seqs = {ev["seq"]: self.held(ev["seq"])}
        elif kind == "seq_add":
            held = self.held(ev["seq"])
            p0, p1, d = ev["p0"], ev["p1"], ev["delta"]
            moved = {p: t for p, t in held.items() if (p0 < 0 or p >= p0) and (p1 < 0 or p < p1)}
            for p in moved:
                del held[p]
            held.update({p + d: t for p, t in moved.items() if p + d >= 0})
        elif kind == "clear":
            self.seqs = {}
        elif kind == "state_seq_get_data" and ev.get("ret") and not int(ev.get("flags", 0)) & _PARTIAL_ONLY:
            self.states[str(ev.get("hash"))] = dict(self.held(ev["seq"]))
        elif kind == "state_seq_set_data" and not int(ev.get("flags", 0)) & _PARTIAL_ONLY:
            # a whole sequence's state replaces what the sequence held (a prompt-cache load); a state this
            # trace never saved (another process's) leaves it unknown
            self.seqs[ev["seq"]] = dict(self.states.get(str(ev.get("hash")), {}))
        elif kind == "logits":
            i = ev["idx"]
            if i >= 0 and (i >= len(self.last_rows) or not self.last_rows[i].out):
                issues.append(Issue("no-output", -1, i, f"logits read of row {i}, which asked for no output"))
        elif kind == "pos_min":
            self.pos_min[int(ev["seq"])] = int(ev["ret"])
        elif kind == "pos_max":
            mine = max(self.held(ev["seq"]), default=-1)
            if mine != ev["ret"]:
                issues.append(
                    Issue(
                        "pos_max",
                        ev["seq"],
                        ev["ret"],
                        f"libllama says seq {ev['seq']} ends at {ev['ret']}, the calls say {mine}",
                    )
                )
        return issues

    def _forget(self, ev: Event) -> None:
        """Drop the ``pos_min`` a call may move down (or make unknown)."""
        kind = ev.get("ev")
        if kind in ("clear", "seq_keep") or (kind in ("seq_rm", "seq_add", "seq_div") and int(ev["seq"]) < 0):
            self.pos_min.clear()
        elif kind in ("seq_add", "seq_div", "state_seq_set_data"):
            self.pos_min.pop(int(ev["seq"]), None)
        elif kind == "seq_cp":
            self.pos_min.pop(int(ev["dst"]), None)
        elif kind == "seq_rm":
            known = self.pos_min.get(int(ev["seq"]))
            if known is not None and int(ev["p0"]) <= known:
                del self.pos_min[int(ev["seq"])]

    def _windows(self, rs: Sequence[Row]) -> list[Issue]:
        if not self.n_swa:
            return []
        first: dict[int, int] = {}
        for r in rs:
            for s in r.seqs:
                if r.pos >= 0 and r.pos < first.get(s, r.pos + 1):
                    first[s] = r.pos
        return [Issue("window", s, q, f"seq {s} decodes position {q} with its memory from {self.pos_min[s]}: "
                      f"its window of {self.n_swa} starts at {max(0, q - self.n_swa + 1)}")
                for s, q in sorted(first.items())
                if s in self.pos_min and short_window(self.n_swa, self.pos_min[s], q)]  # fmt: skip

    def read_context(self, ev: Event) -> tuple[Row, int, list[int] | None] | None:
        """For a ``logits`` event just applied: its row, that row's first sequence and that sequence's
        tokens up to the row's position (None where one is missing)."""
        i = ev["idx"]
        if i < 0:
            i += len(self.last_rows)
        if not 0 <= i < len(self.last_rows):
            return None
        r = self.last_rows[i]
        return r, r.seqs[0], self.history(r.seqs[0], r.pos) if r.pos >= 0 else None


def main_context(events: Iterable[Event]) -> int:
    """The context that decoded most (llama-server makes and frees one to fit the model first)."""
    counts: dict[int, int] = {}
    for e in events:
        if e.get("ev") in ("process", "decode"):
            counts[int(e.get("ctx", -1))] = counts.get(int(e.get("ctx", -1)), 0) + 1
    return max(counts, key=lambda c: counts[c]) if counts else 0


def check_trace(events: Sequence[Event], ctx: int | None = None, n_swa: int = 0) -> list[tuple[int, str]]:
    """Every inconsistency :class:`Memory` sees in ``events`` (context ``ctx``, by default the one that
    decoded most; ``n_swa``: the model's sliding window): (event ``i``, what)."""
    mem = Memory(main_context(events) if ctx is None else ctx, n_swa=n_swa)
    out: list[tuple[int, str]] = []
    for e in events:
        out.extend((int(e.get("i", -1)), issue.text) for issue in mem.apply(e))
    return out
