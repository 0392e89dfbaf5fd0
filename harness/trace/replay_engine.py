"""Replay a libllama trace in one process, through llama-cpp-python's low-level API.

This module runs in the child :mod:`harness.trace.replay` starts (``python -m harness.trace.replay_child``), whose
``LLAMA_CPP_LIB_PATH`` names the traced server's own ``libllama.so``: the same machine code, the
same model file, the same context parameters (``n_threads`` 1), so a replay that does what the server did
gives the server's logits bit for bit.

* :class:`Engine` replays the events of one context in order: every ``process`` batch rebuilt with
  ``llama_batch_ext_add_token``/``set_pos``/``add_seq``/``set_output_logits`` and ``llama_process``;
  every ``llama_memory_seq_*``/``clear``; a ``state_seq_get_data`` keeps the replay's own bytes under
  the trace's hash, so that a later ``set_data`` of that hash restores them; each ``logits`` read is
  compared with the trace's row (hash, and value by value when the trace kept the row). With
  ``fresh=True`` each read is also compared with a fresh sequential evaluation of the tokens its
  sequence holds (:class:`Fresh`: a context of its own, one sequence, the prompt in ``n_batch`` chunks,
  then token by token, as a single-slot server evaluates it). On a model with a sliding window every
  batch's first row of each sequence is checked against the replay's own ``llama_memory_seq_pos_min``
  (:func:`~harness.trace.calls.short_window`): ``RunResult.windows``.

The shrink that runs the engine again and again is :mod:`harness.trace.shrink`; the child's command line,
:mod:`harness.trace.replay_child`.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from harness.targets.libllama import load_model
from harness.trace.calls import (
    Event,
    Memory,
    Row,
    Trace,
    fnv1a64,
    is_batch,
    logits_row,
    main_context,
    rows,
    short_window,
)
from harness.trace.lineage import STATEFUL
from harness.trees.driver import Driver, libllama

__all__ = ["STATEFUL", "Engine", "Fresh", "ReadResult", "RunResult"]

_INT_PARAMS = ("n_ctx", "n_batch", "n_ubatch", "n_seq_max", "n_rs_seq", "n_outputs_max", "n_outputs_max_per_seq",
               "ctx_type", "rope_scaling_type", "pooling_type", "attention_type", "flash_attn_type",
               "yarn_orig_ctx", "type_k", "type_v")  # fmt: skip
_FLOAT_PARAMS = ("rope_freq_base", "rope_freq_scale", "yarn_ext_factor", "yarn_attn_factor", "yarn_beta_fast",
                 "yarn_beta_slow")  # fmt: skip
_BOOL_PARAMS = ("embeddings", "offload_kqv", "op_offload", "swa_full", "kv_unified")


def _ll() -> Driver:
    return libllama()


@dataclass
class ReadResult:
    """One logits read: the trace's row against the replay's (and a fresh evaluation's)."""

    i: int
    idx: int
    seq: int
    pos: int
    same: bool  # the replay's row is the trace's, bit for bit
    argmax_trace: int
    argmax_replay: int
    maxdiff: float | None  # |trace - replay|, when the trace kept the row
    fresh_argmax: int | None = None
    fresh_same: bool | None = None  # the replay's row is the fresh evaluation's, bit for bit
    fresh_maxdiff: float | None = None
    fresh_margin: float | None = None  # the fresh row's top-1 minus top-2
    fresh_rank: int | None = None  # the rank of the replay's argmax in the fresh row (0: its argmax too)
    # how much nearer the replay's row brings one of the fresh row's top 10 to its argmax than the fresh row
    # has it: (f[a] - f[t]) - (row[a] - row[t]), the widest; a greedy flip needs it above the fresh gap
    fresh_shift: float | None = None


@dataclass
class RunResult:
    reads: list[ReadResult] = field(default_factory=list)
    rets: list[tuple[int, int, int]] = field(default_factory=list)  # (i, trace's, replay's) that differ
    issues: list[tuple[int, str]] = field(default_factory=list)  # what the calls themselves get wrong
    # (call, seq, pos, pos_min): a row decoded while the replay's memory of its sequence started above
    # its sliding window (harness.trace.calls.short_window, asked of the replay's own libllama)
    windows: list[tuple[int, int, int, int]] = field(default_factory=list)
    skipped: list[str] = field(default_factory=list)  # what could not be replayed
    calls: int = 0
    seconds: float = 0.0

    def first_diff(self) -> ReadResult | None:
        return next((r for r in self.reads if not r.same), None)

    def first_divergence(self) -> ReadResult | None:
        return next((r for r in self.reads if r.fresh_argmax is not None and r.fresh_argmax != r.argmax_replay), None)

    def summary(self) -> dict[str, Any]:
        d = self.first_diff()
        v = self.first_divergence()
        fresh = [r for r in self.reads if r.fresh_same is not None]
        return {
            "calls": self.calls,
            "reads": len(self.reads),
            "reads_same": sum(r.same for r in self.reads),
            "first_diff": asdict(d) if d else None,
            "rets_differ": self.rets[:10],
            "issues": self.issues[:20],
            "short_windows": len(self.windows),
            "first_short_window": list(self.windows[0]) if self.windows else None,
            "skipped": self.skipped,
            "fresh_compared": len(fresh),
            "fresh_same": sum(bool(r.fresh_same) for r in fresh),
            "fresh_argmax_differ": sum(r.fresh_argmax != r.argmax_replay for r in fresh),
            "fresh_maxdiff": max((r.fresh_maxdiff or 0.0 for r in fresh), default=0.0),
            "fresh_min_margin": min((r.fresh_margin for r in fresh if r.fresh_margin is not None), default=None),
            "fresh_max_shift": max((r.fresh_shift or 0.0 for r in fresh), default=0.0),
            "first_divergence": asdict(v) if v else None,
            "seconds": round(self.seconds, 2),
        }


def _top2(row: np.ndarray) -> tuple[int, float]:
    order = np.argsort(-row, kind="stable")
    return int(order[0]), float(row[order[0]] - row[order[1]]) if row.size > 1 else float("inf")


class _Ctx:
    """A context with its memory handle and one reusable extended batch."""

    def __init__(self, model: Any, params: dict[str, Any], n_threads: int, n_seq_max: int | None = None) -> None:
        ll = _ll()
        cp = ll.llama_context_default_params()
        for k in _INT_PARAMS:
            if k in params:
                setattr(cp, k, int(params[k]))
        for k in _FLOAT_PARAMS:
            if k in params:
                setattr(cp, k, float(params[k]))
        for k in _BOOL_PARAMS:
            if k in params:
                setattr(cp, k, bool(params[k]))
        if n_seq_max is not None:
            cp.n_seq_max = n_seq_max
        cp.n_threads = cp.n_threads_batch = n_threads
        self.ptr = ll.llama_init_from_model(model, cp)
        if not self.ptr:
            raise RuntimeError(f"llama_init_from_model refused the traced parameters {params}")
        self.mem = ll.llama_get_memory(self.ptr)
        # the batch API generation of the tree: llama_batch_ext with llama_process where the header has it (the
        # server's own calls, from between b10816 and b11434), else llama_batch with llama_decode
        self.batch = ll.llama_batch_ext_init(self.ptr) if ll.has("llama_process") else None
        self.n_batch = int(cp.n_batch)

    def process(self, rs: Sequence[Row]) -> int:
        ll = _ll()
        if self.batch is None:
            return self._decode(rs)
        ll.llama_batch_ext_clear(self.batch)
        pos = ll.int32s(4)
        for r in rs:
            idx = int(ll.llama_batch_ext_add_token(self.batch, r.seqs[0], r.tok))
            if idx < 0:
                return -100 + idx
            pos[0] = r.pos
            ll.llama_batch_ext_set_pos(self.batch, idx, pos)
            for s in r.seqs[1:]:
                ll.llama_batch_ext_add_seq(self.batch, idx, s)
            if r.out:
                ll.llama_batch_ext_set_output_logits(self.batch, idx, True)
        return int(ll.llama_process(self.ptr, 1, self.batch))

    def _decode(self, rs: Sequence[Row]) -> int:
        """The rows as one ``llama_batch`` through ``llama_decode`` (trees without the extended batch API)."""
        ll = _ll()
        batch = ll.llama_batch_init(max(len(rs), 1), 0, max((len(r.seqs) for r in rs), default=1))
        try:
            for i, r in enumerate(rs):
                batch.token[i], batch.pos[i], batch.n_seq_id[i] = r.tok, r.pos, len(r.seqs)
                for j, s in enumerate(r.seqs):
                    batch.seq_id[i][j] = s
                batch.logits[i] = bool(r.out)
            batch.n_tokens = len(rs)
            return int(ll.llama_decode(self.ptr, batch))
        finally:
            ll.llama_batch_free(batch)

    def logits(self, idx: int, n_vocab: int) -> np.ndarray | None:
        ll = _ll()
        p = ll.llama_get_logits_ith(self.ptr, idx)
        return np.frombuffer(ll.bytes_at(p, 4 * n_vocab), dtype=np.float32).copy() if p else None

    def close(self) -> None:
        ll = _ll()
        if self.ptr:
            if self.batch is not None:
                ll.llama_batch_ext_free(self.batch)
            ll.llama_free(self.ptr)
            self.ptr = None


class Fresh:
    """Sequential evaluations of token histories on a context of their own (one sequence, seq 0):
    the tokens a history shares with the previous one stay (unless the memory cannot keep them whole:
    recurrent, or a model with sliding-window layers, always evaluated whole), the rest is evaluated in
    ``n_batch`` chunks."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self.ctx = _Ctx(engine.model.ptr, engine.params, engine.n_threads)
        self.hist: list[int] = []
        self.swa = _ll().llama_model_n_swa(engine.model.ptr) > 0

    def logits(self, hist: Sequence[int]) -> np.ndarray:
        ll = _ll()
        keep = 0
        while keep < min(len(hist), len(self.hist)) and hist[keep] == self.hist[keep]:
            keep += 1
        keep = min(keep, len(hist) - 1)
        # a recurrent memory cannot drop a tail; a sliding-window one has dropped cells of its prefix that the
        # next rows attend to (or kept a tail's cells past its window): evaluate those from scratch
        if self.swa:
            keep = 0
        if not ll.llama_memory_seq_rm(self.ctx.mem, 0, keep, -1) or ll.llama_memory_seq_pos_min(self.ctx.mem, 0) > 0:
            ll.llama_memory_clear(self.ctx.mem, True)
            keep = 0
        self.hist = list(hist[:keep])
        for start in range(keep, len(hist), self.ctx.n_batch):
            chunk = hist[start : start + self.ctx.n_batch]
            rs = [Row(t, start + j, (0,), start + j == len(hist) - 1) for j, t in enumerate(chunk)]
            ret = self.ctx.process(rs)
            if ret != 0:
                raise RuntimeError(f"the fresh evaluation's llama_process returned {ret}")
            self.hist.extend(chunk)
        row = self.ctx.logits(-1, self.engine.n_vocab)
        if row is None:
            raise RuntimeError("the fresh evaluation has no logits")
        return row

    def close(self) -> None:
        self.ctx.close()


class Engine:
    """The model of a trace's context ``ctx``, loaded once; :meth:`run` replays a list of its events."""

    def __init__(self, trace: Trace, *, model: str | None = None, ctx: int | None = None, n_threads: int = 1) -> None:
        if ctx is None:
            ctx = main_context(trace.events)
        found = [e for e in trace.contexts() if e.get("ctx") == ctx]
        if not found:
            raise RuntimeError(f"the trace has no context {ctx}")
        self.params = found[0]
        self.ctx_id = ctx
        path = model or trace.model_path(int(self.params.get("model", 0)))
        if path is None:
            raise RuntimeError("the trace names no model file: give one")
        self.model = load_model(path)
        self.n_vocab = self.model.n_vocab
        self.n_swa = int(_ll().llama_model_n_swa(self.model.ptr))
        self.n_threads = n_threads
        self.trace_rets = trace.returns()
        self._fresh: Fresh | None = None

    def fresh(self) -> Fresh:
        if self._fresh is None:
            self._fresh = Fresh(self)
        return self._fresh

    def run(self, events: Sequence[Event], *, fresh: bool | Callable[[Event], bool] = False) -> RunResult:
        ll = _ll()
        t0 = time.monotonic()
        res = RunResult()
        ctx = _Ctx(self.model.ptr, self.params, self.n_threads)
        mem = Memory(self.ctx_id)
        states: dict[str, bytes] = {}
        try:
            for e in events:
                kind = e.get("ev")
                if e.get("ctx", self.ctx_id) != self.ctx_id or kind in ("ret", "ctx", "model", "trace"):
                    continue
                res.issues.extend((int(e.get("i", -1)), issue.text) for issue in mem.apply(e))
                res.calls += 1
                if is_batch(e):
                    if e.get("embd"):
                        res.skipped.append(f"call {e['i']}: a batch of embeddings (not in the trace)")
                        break
                    self._windows(ctx, e, res)
                    ret = ctx.process(rows(e))
                    want = self.trace_rets.get(int(e["i"]), 0)
                    if ret != want:
                        res.rets.append((int(e["i"]), want, ret))
                elif kind == "seq_rm":
                    ok = bool(ll.llama_memory_seq_rm(ctx.mem, e["seq"], e["p0"], e["p1"]))
                    if ok != bool(e.get("ret", True)):
                        res.rets.append((int(e["i"]), int(bool(e.get("ret", True))), int(ok)))
                elif kind == "seq_cp":
                    ll.llama_memory_seq_cp(ctx.mem, e["src"], e["dst"], e["p0"], e["p1"])
                elif kind == "seq_keep":
                    ll.llama_memory_seq_keep(ctx.mem, e["seq"])
                elif kind == "seq_add":
                    ll.llama_memory_seq_add(ctx.mem, e["seq"], e["p0"], e["p1"], e["delta"])
                elif kind == "seq_div":
                    ll.llama_memory_seq_div(ctx.mem, e["seq"], e["p0"], e["p1"], e["d"])
                elif kind == "clear":
                    ll.llama_memory_clear(ctx.mem, bool(e["data"]))
                elif kind == "state_seq_get_data":
                    self._get_state(ctx, e, states)
                elif kind == "state_seq_set_data":
                    data = states.get(e.get("hash", ""))
                    if data is None:
                        res.skipped.append(f"call {e['i']}: a state set whose bytes the replay never got")
                        continue
                    buf = ll.buffer_of(data)
                    flags = int(e.get("flags", 0))
                    ll.llama_state_seq_set_data_ext(ctx.ptr, buf, len(data), e["seq"], flags)
                elif kind == "logits":
                    self._read(ctx, mem, e, res, fresh)
        finally:
            ctx.close()
        res.seconds = time.monotonic() - t0
        return res

    def _windows(self, ctx: _Ctx, e: Event, res: RunResult) -> None:
        """Each sequence's first row of batch ``e`` against the replay's memory (:func:`short_window`)."""
        if not self.n_swa:
            return
        first: dict[int, int] = {}
        for r in rows(e):
            for s in r.seqs:
                if r.pos >= 0 and r.pos < first.get(s, r.pos + 1):
                    first[s] = r.pos
        for s, q in sorted(first.items()):
            pm = int(_ll().llama_memory_seq_pos_min(ctx.mem, s))
            if short_window(self.n_swa, pm, q):
                res.windows.append((int(e["i"]), s, q, pm))
                res.issues.append((int(e["i"]), f"seq {s} decodes position {q} with the replay's memory from {pm}: "
                                   f"its window of {self.n_swa} starts at {max(0, q - self.n_swa + 1)}"))  # fmt: skip

    def _get_state(self, ctx: _Ctx, e: Event, states: dict[str, bytes]) -> None:
        ll = _ll()
        flags = int(e.get("flags", 0))
        n = int(ll.llama_state_seq_get_size_ext(ctx.ptr, e["seq"], flags))
        buf = ll.buffer(n)
        got = int(ll.llama_state_seq_get_data_ext(ctx.ptr, buf, n, e["seq"], flags))
        states[str(e.get("hash", ""))] = ll.bytes_at(buf, got)

    def _read(self, ctx: _Ctx, mem: Memory, e: Event, res: RunResult, fresh: bool | Callable[[Event], bool]) -> None:
        if "hash" not in e:
            return
        row = ctx.logits(int(e["idx"]), self.n_vocab)
        traced = logits_row(e)
        where = mem.read_context(e)
        if row is None:  # the batch before failed: libllama has no such row
            seq, pos = (where[1], where[0].pos) if where else (-1, -1)
            res.reads.append(ReadResult(int(e["i"]), int(e["idx"]), seq, pos, False, int(e["top"][0][0]), -1, None))
            return
        same = fnv1a64(row.tobytes()) == e["hash"]
        r = ReadResult(
            int(e["i"]), int(e["idx"]), where[1] if where else -1, where[0].pos if where else -1, same,
            int(e["top"][0][0]), int(np.argmax(row)),
            float(np.max(np.abs(traced - row))) if traced is not None else None,
        )  # fmt: skip
        want_fresh = fresh(e) if callable(fresh) else fresh
        if want_fresh and where is not None and where[2] is not None:
            f = self.fresh().logits(where[2])
            r.fresh_argmax, r.fresh_margin = _top2(f)
            r.fresh_same = bool(np.array_equal(f.view(np.uint32), row.view(np.uint32)))
            r.fresh_maxdiff = float(np.max(np.abs(f - row)))
            r.fresh_rank = int(np.sum(f > f[r.argmax_replay]))
            a, top = int(np.argmax(f)), np.argsort(-f, kind="stable")[1:11]
            r.fresh_shift = float(np.max((f[a] - f[top]) - (row[a] - row[top])))
        res.reads.append(r)

    def close(self) -> None:
        if self._fresh is not None:
            self._fresh.close()
            self._fresh = None
