"""The libllama state provider: :class:`~harness.model.provider.StateProvider` on a real ``llama_context``.

:class:`LlamaProvider` answers the server's state calls with llama-cpp-python 0.3.36's low-level
bindings (the vendored llama.cpp at 0c1e570), exactly the calls ``server_slot::prompt_save`` /
``prompt_load`` and ``common_prompt_checkpoint::update_*`` / ``load_*`` make:
``llama_state_seq_get_size_ext`` / ``get_data_ext`` / ``set_data_ext`` (flags 0 for cache entries,
``LLAMA_STATE_SEQ_FLAGS_PARTIAL_ONLY`` for checkpoints), ``llama_memory_seq_rm`` / ``seq_cp`` /
``seq_pos_min`` / ``seq_pos_max`` and ``llama_decode``. Contexts are made the way the server makes
them where it matters: ``n_seq_max`` = number of slots, ``swa_full`` false, ``kv_unified`` as asked,
``n_threads`` 1.

What it adds on top of libllama, and promises:

* **Token histories.** libllama does not say which tokens a sequence's state describes. The
  provider tracks them per memory component (KV, recurrent, SWA), the same way the synthetic
  provider does, and learns the history of a state buffer when it hands the buffer out (its digest
  is remembered), so ``seq_tokens`` says whether target and draft (or the parts of a hybrid) agree.
* **Restore equivalence.** After a successful ``set_data`` (cache load, checkpoint restore), a
  ``seq_cp`` or a ``seq_rm`` that truncates a sequence, the next ``decode`` of that sequence is
  compared, bit for bit, with the logits of the same history evaluated from scratch in a fresh
  single-sequence context, decoded in the same batches (logits depend on batch shape; a batch
  whose tail was rolled back is decoded whole and cut, see :meth:`LlamaProvider.reference_logits`).
  Each comparison counts in ``restore_checks`` (per path in ``restores_by``). A difference goes to
  ``mismatches``, unless the same state, moved into a fresh context where its cells are
  contiguous, does reproduce the fresh logits: then only the KV cell layout differed, and it goes
  to ``layout_diffs`` (the known finding ``kv-layout-dependent-logits``,
  ``fixtures/findings/kv_layout_logits.py``).
* **Deferred stream copies.** With a per-slot KV (several sequences, not unified) a ``seq_cp``
  between sequences only enqueues the copy of the source stream's K/V buffer; the next
  ``llama_decode`` runs it. A state restored into the destination before then is overwritten by it
  (the known finding ``cache-load-into-pending-child-copy``): the provider marks such a sequence
  (and what is saved from it or copied from it later) as overwritten, and a decode of it that
  differs from the fresh evaluation goes to ``finding_diffs[PENDING_CP_FINDING]``, not to
  ``mismatches``. Nothing else is excused by it.
* Token ids of the model (small integers) are passed to libllama unchanged; they must be below
  ``n_vocab`` (the fixtures' vocabulary has 259 tokens).

The provider owns its context and frees it in :meth:`close` (also a context manager). Models are
loaded once per path and process (:func:`load_model`).

Size: the provider's state I/O on real contexts, the restore-equivalence check and the classifiers of the
known findings it sees share the provider's per-sequence state, so they stay together.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import struct
import threading
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.errors import ModelLoadError
from harness.findings import CACHE_LOAD_INTO_PENDING_CHILD_COPY, SWA_RESTORE_WINDOW_SHORT
from harness.model.memory import Host
from harness.model.provider import STATE_SEQ_FLAGS_PARTIAL_ONLY, MemoryKind, SeqRmType
from harness.model.semantics import Semantics, get_semantics
from harness.model.server_context import ServerContext, ServerParams
from harness.trees.driver import libllama

__all__ = [
    "PENDING_CP_FINDING",
    "LlamaModel",
    "LlamaProvider",
    "Mismatch",
    "ModelLoadError",
    "close_server",
    "load_model",
    "make_llama_server",
]


_init_lock = threading.Lock()
_initialised = False


def _ensure_backend() -> None:
    global _initialised
    with _init_lock:
        if _initialised:
            return
        ll = libllama()
        ll.llama_backend_init()
        if not os.environ.get("HARNESS_LLAMA_VERBOSE"):
            ll.quiet_logs()
        _initialised = True


@dataclass
class LlamaModel:
    """A loaded ``llama_model`` and what the provider needs to know about it."""

    path: Path
    ptr: Any
    arch: str
    n_vocab: int
    n_swa: int
    n_ctx_train: int
    kind: MemoryKind

    def close(self) -> None:
        if self.ptr is not None:
            libllama().llama_model_free(self.ptr)
            self.ptr = None


_MODELS: dict[Path, LlamaModel] = {}


def load_model(path: str | os.PathLike[str]) -> LlamaModel:
    """Load ``path`` once per process; :class:`ModelLoadError` with one clear line if it cannot be."""
    p = Path(path).resolve()
    hit = _MODELS.get(p)
    if hit is not None and hit.ptr is not None:
        return hit
    if not p.is_file():
        raise ModelLoadError(f"model file not found: {p}")
    _ensure_backend()
    ll = libllama()
    mparams = ll.llama_model_default_params()
    ptr = ll.llama_model_load_from_file(str(p).encode(), mparams)
    if not ptr:
        raise ModelLoadError(f"libllama could not load {p} (corrupt or unsupported GGUF)")
    arch = ll.meta(ptr, "general.architecture") or "?"
    vocab = ll.llama_model_get_vocab(ptr)
    n_swa = int(ll.llama_model_n_swa(ptr))
    if ll.llama_model_is_hybrid(ptr):
        kind = MemoryKind.HYBRID
    elif ll.llama_model_is_recurrent(ptr):
        kind = MemoryKind.RECURRENT
    elif n_swa > 0:
        kind = MemoryKind.ISWA
    else:
        kind = MemoryKind.TRANSFORMER
    model = LlamaModel(
        path=p,
        ptr=ptr,
        arch=arch,
        n_vocab=int(ll.llama_vocab_n_tokens(vocab)),
        n_swa=n_swa,
        n_ctx_train=int(ll.llama_model_n_ctx_train(ptr)),
        kind=kind,
    )
    _MODELS[p] = model
    return model


@dataclass
class Mismatch:
    """A decode after a restore whose logits differ from a fresh evaluation of the same history."""

    provider: str
    seq: int
    restored_by: str  # "set_data(flags=0)", "set_data(flags=1)", "seq_rm(p0=12)"
    n_tokens: int  # history length after the decode
    first_diff: int  # first differing logit index
    max_abs_diff: float
    history: tuple[int, ...] = field(repr=False, default=())

    def line(self) -> str:
        return (
            f"{self.provider} seq {self.seq}: logits after {self.restored_by} and a decode to {self.n_tokens} tokens "
            f"differ from a fresh evaluation (first at logit {self.first_diff}, max |diff| {self.max_abs_diff:.3g})"
        )


# In a unified KV, a difference up to this fraction of the largest logit is the layout finding
# (observed: below 0.2 %); a wrong or stale state moves logits by far more (10 % and up).
UNIFIED_LAYOUT_TOLERANCE = 0.01

# A restore into a sequence while a cross-stream seq_cp into it waits for the next decode is overwritten
# by that copy (fixtures/findings/cache_load_into_pending_child_copy.py)
PENDING_CP_FINDING = CACHE_LOAD_INTO_PENDING_CHILD_COPY.id

# An SWA checkpoint restored and then rolled back below its pos_max lacks the oldest cells of the
# re-evaluated token's window (fixtures/findings/swa_restore_window_short.py)
SWA_WINDOW_FINDING = SWA_RESTORE_WINDOW_SHORT.id

# component ids, as in the synthetic provider
_KV, _SWA, _RS = "kv", "swa", "rs"

# A sequence's history: the batches it was decoded in, each with how many of its tokens are still
# there (a rollback keeps a prefix of a batch). Logits depend on batch shapes (see reference_logits).
Chunk = tuple[tuple[int, ...], int]
Chunks = tuple[Chunk, ...]


def _flat(chunks: Chunks) -> tuple[int, ...]:
    return tuple(t for batch, kept in chunks for t in batch[:kept])


def _truncate(chunks: Chunks, n: int) -> Chunks:
    out: list[Chunk] = []
    left = n
    for batch, kept in chunks:
        if left <= 0:
            break
        out.append((batch, min(kept, left)))
        left -= kept
    return tuple(out)


class LlamaProvider:
    """One ``llama_context`` of a real model, speaking the :class:`StateProvider` surface."""

    def __init__(
        self,
        model: LlamaModel,
        *,
        name: str = "tgt",
        n_seq: int = 4,
        n_ctx: int = 512,
        n_batch: int = 512,
        n_ubatch: int = 512,
        kv_unified: bool = False,
        check_restores: bool = True,
    ) -> None:
        ll = libllama()
        self._ll = ll
        self.model = model
        self.name = name
        self.n_seq = n_seq
        self.kind = model.kind
        self.n_swa = model.n_swa  # the server's n_swa with swa_full false
        self.check_restores = check_restores
        self._n_batch, self._n_ubatch, self._kv_unified = n_batch, n_ubatch, kv_unified
        self._streams = 1 if kv_unified else n_seq  # KV streams: n_stream (src/llama-kv-cache.cpp:84)
        self.ctx = self._new_context(n_seq, n_ctx)
        self.n_ctx = int(ll.llama_n_ctx(self.ctx))
        self.mem = ll.llama_get_memory(self.ctx)
        self._rm_type = self._probe_seq_rm_type()
        comps = {
            MemoryKind.TRANSFORMER: (_KV,),
            MemoryKind.RECURRENT: (_RS,),
            MemoryKind.HYBRID: (_RS, _KV),
            MemoryKind.ISWA: (_KV, _SWA),
        }[self.kind]
        self._comps = comps
        self._partial = {
            MemoryKind.TRANSFORMER: (_KV,),
            MemoryKind.RECURRENT: (_RS,),
            MemoryKind.HYBRID: (_RS,),
            MemoryKind.ISWA: (_SWA,),
        }[self.kind]
        self._hist: list[dict[str, Chunks]] = [dict.fromkeys(comps, ()) for _ in range(n_seq)]
        self._registry: dict[bytes, dict[str, Chunks]] = {}
        self._pending: dict[int, str] = {}
        self._ref: Any = None
        self.decode_calls = 0
        self.restore_checks = 0
        self.mismatches: list[Mismatch] = []
        self.layout_diffs: list[Mismatch] = []
        # differences explained by a known finding, by finding id (see _check_restore)
        self.finding_diffs: dict[str, list[Mismatch]] = {}
        # cross-stream seq_cp (src, dst) whose buffer copy waits for the next llama_decode, and the
        # sequences (and saved states) whose K/V such a copy overwrote after a restore
        self._unflushed_cp: list[list[int]] = []  # [src, dst, restored since the seq_cp (0/1)]
        self._overwritten: set[int] = set()
        self._overwritten_states: set[bytes] = set()
        self.restores_by: Counter[str] = Counter()  # checks per restore path: set_data, set_data(partial), ...
        self.max_state_bytes = 0
        self.max_partial_bytes = 0

    # ---- context life --------------------------------------------------------------------

    def _new_context(self, n_seq: int, n_ctx: int) -> Any:
        ll = self._ll
        p = ll.llama_context_default_params()
        p.n_ctx = n_ctx
        p.n_batch = self._n_batch
        p.n_ubatch = self._n_ubatch
        p.n_seq_max = n_seq
        p.n_threads = 1
        p.n_threads_batch = 1
        p.swa_full = False
        p.kv_unified = self._kv_unified
        p.no_perf = True
        ctx = ll.llama_init_from_model(self.model.ptr, p)
        if not ctx:
            raise ModelLoadError(f"libllama could not create a context for {self.model.path} (n_ctx={n_ctx})")
        return ctx

    def close(self) -> None:
        for attr in ("ctx", "_ref"):
            c = getattr(self, attr, None)
            if c:
                self._ll.llama_free(c)
            setattr(self, attr, None)

    def __enter__(self) -> LlamaProvider:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # best effort; close() is the promise
        with contextlib.suppress(Exception):
            self.close()

    def _probe_seq_rm_type(self) -> SeqRmType:
        """``common_context_can_seq_rm`` (common/common.cpp:1491): decode two tokens, try a partial rm."""
        ll = self._ll
        if self.mem is None:
            return SeqRmType.NO
        # recurrent-state snapshots per sequence (n_rs_seq, upstream after b9093): a tree without it has none
        if ll.has("llama_n_rs_seq") and ll.llama_n_rs_seq(self.ctx) > 0:
            return SeqRmType.RS
        ll.llama_memory_clear(self.mem, True)
        try:
            if self._decode_raw(self.ctx, 0, [0, 0], 0, want_logits=False)[0] != 0:
                return SeqRmType.NO
            if not ll.llama_memory_seq_rm(self.mem, 0, 1, -1):
                return SeqRmType.FULL
            return SeqRmType.PART
        finally:
            ll.llama_memory_clear(self.mem, True)

    def seq_rm_type(self) -> SeqRmType:
        return self._rm_type

    # ---- state bytes ----------------------------------------------------------------------

    def _selected(self, flags: int) -> tuple[str, ...]:
        return self._partial if flags & STATE_SEQ_FLAGS_PARTIAL_ONLY else self._comps

    def state_seq_get_size_ext(self, seq: int, flags: int) -> int:
        self._check_seq(seq)
        return int(self._ll.llama_state_seq_get_size_ext(self.ctx, seq, flags))

    def state_seq_get_data_ext(self, seq: int, flags: int) -> bytes:
        self._check_seq(seq)
        data = self._raw_state(self.ctx, seq, flags)
        n = len(data)
        digest = _digest(data, flags)
        self._registry[digest] = {c: self._hist[seq][c] for c in self._selected(flags)}
        if seq in self._overwritten:
            self._overwritten_states.add(digest)
        else:
            self._overwritten_states.discard(digest)
        if flags & STATE_SEQ_FLAGS_PARTIAL_ONLY:
            self.max_partial_bytes = max(self.max_partial_bytes, n)
        else:
            self.max_state_bytes = max(self.max_state_bytes, n)
        return data

    def state_seq_set_data_ext(self, seq: int, data: bytes, flags: int) -> int:
        self._check_seq(seq)
        ret = self._set_raw(self.ctx, seq, data, flags)
        if ret == 0:
            # libllama clears the destination sequence when a restore fails (llama-context.cpp)
            self._hist[seq] = dict.fromkeys(self._comps, ())
            self._pending.pop(seq, None)
            self._overwritten.discard(seq)
            return 0
        digest = _digest(data, flags)
        known = self._registry.get(digest)
        for c in self._selected(flags):
            self._hist[seq][c] = known[c] if known is not None else (((-1,), 1),)
        self._pending[seq] = f"set_data(flags={flags})"
        # a deferred stream copy into or out of this sequence will now move restored K/V around
        # (set_data runs no memory update first: src/llama-context.cpp:3223-3260)
        for cp in self._unflushed_cp:
            if seq in (cp[0], cp[1]):
                cp[2] = 1
        if digest in self._overwritten_states:
            self._overwritten.add(seq)
        elif flags == 0:
            self._overwritten.discard(seq)  # every component replaced by a state that is right
        return ret

    def _set_raw(self, ctx: Any, seq: int, data: bytes, flags: int) -> int:
        buf = self._ll.buffer_of(data)
        return int(self._ll.llama_state_seq_set_data_ext(ctx, buf, len(data), seq, flags))

    # ---- memory ---------------------------------------------------------------------------

    def memory_seq_rm(self, seq: int, p0: int, p1: int) -> bool:
        ok = bool(self._ll.llama_memory_seq_rm(self.mem, seq, p0, p1))
        if not ok:
            return False
        seqs = range(self.n_seq) if seq < 0 else range(seq, seq + 1)
        for s in seqs:
            if p1 >= 0 and p0 > 0:
                raise NotImplementedError("the libllama provider tracks suffix removal only (p1 = -1)")
            keep = max(0, p0)
            h = self._hist[s]
            before = {c: len(_flat(h[c])) for c in h}
            for c in h:
                h[c] = _truncate(h[c], keep)
            if keep > 0 and any(v > keep for v in before.values()):
                prior = self._pending.get(s)
                self._pending[s] = f"{prior}+seq_rm(p0={keep})" if prior else f"seq_rm(p0={keep})"
            elif keep == 0:
                self._pending.pop(s, None)
                self._overwritten.discard(s)
        return True

    def memory_seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        if p0 > 0 or p1 >= 0:
            raise NotImplementedError("the libllama provider tracks whole-sequence copy only")
        self._ll.llama_memory_seq_cp(self.mem, src, dst, p0, p1)
        self._hist[dst] = dict(self._hist[src])
        self._pending[dst] = f"seq_cp({src})"
        if src in self._overwritten:
            self._overwritten.add(dst)
        else:
            self._overwritten.discard(dst)
        if src != dst and self._streams > 1 and self.kind is not MemoryKind.RECURRENT:
            # between KV streams only the cell metadata is copied now; the K/V buffer copy of the
            # whole source stream waits for the next llama_decode (src/llama-kv-cache.cpp:494-536,
            # run by llama_kv_cache::update, :827-846, from llama-context.cpp:1809)
            self._unflushed_cp.append([src, dst, 0])

    def _flush_copies(self) -> None:
        """The deferred stream copies ran (a ``llama_decode`` got past its input checks).

        A copy after which either end was restored overwrote the destination's K/V with the source
        stream's buffer: if the destination holds cells, they no longer hold what its history says
        (the known finding ``cache-load-into-pending-child-copy``).
        """
        for src, dst, restored in self._unflushed_cp:
            if (restored or src in self._overwritten) and any(self._hist[dst].values()):
                self._overwritten.add(dst)
        self._unflushed_cp.clear()

    def memory_seq_pos_min(self, seq: int) -> int:
        return int(self._ll.llama_memory_seq_pos_min(self.mem, seq))

    def memory_seq_pos_max(self, seq: int) -> int:
        return int(self._ll.llama_memory_seq_pos_max(self.mem, seq))

    # ---- decode ---------------------------------------------------------------------------

    def _decode_raw(
        self, ctx: Any, seq: int, tokens: Sequence[int], pos0: int, *, want_logits: bool
    ) -> tuple[int, bytes]:
        ll = self._ll
        n = len(tokens)
        batch = ll.llama_batch_init(max(n, 1), 0, 1)
        try:
            for i, t in enumerate(tokens):
                batch.token[i] = int(t)
                batch.pos[i] = pos0 + i
                batch.n_seq_id[i] = 1
                batch.seq_id[i][0] = seq
                batch.logits[i] = 1 if (want_logits and i == n - 1) else 0
            batch.n_tokens = n
            ret = int(ll.llama_decode(ctx, batch))
        finally:
            ll.llama_batch_free(batch)
        if ret != 0 or not want_logits:
            return ret, b""
        ptr = ll.llama_get_logits_ith(ctx, -1)
        return ret, ll.bytes_at(ptr, 4 * self.model.n_vocab)

    def decode(self, seq: int, tokens: Sequence[int], pos0: int) -> int:
        """``llama_decode`` of ``tokens`` at ``pos0..`` on ``seq``: 0 ok, 1 no KV slot, <0 error."""
        self._check_seq(seq)
        self.decode_calls += 1
        toks = tuple(int(t) for t in tokens)
        bad = [t for t in toks if not 0 <= t < self.model.n_vocab]
        if bad:
            raise ValueError(f"token ids {bad[:3]} outside the vocabulary (n_vocab = {self.model.n_vocab})")
        h = self._hist[seq]
        if any(len(_flat(h[c])) != pos0 for c in h):
            # libllama checks the same (llama_batch_allocr::init: positions must continue the sequence)
            return -1
        why = self._pending.get(seq) if self.check_restores else None
        snap = self._raw_state(self.ctx, seq) if why is not None else b""
        short = why is not None and self._window_short(seq, why, pos0)
        ret, logits = self._decode_raw(self.ctx, seq, toks, pos0, want_logits=True)
        if ret != -1:
            # -1 is returned only by the input checks, before memory_update runs the deferred
            # stream copies (src/llama-context.cpp:1762-1781 vs 1809)
            self._flush_copies()
        if ret != 0:
            return ret
        for c in h:
            h[c] = (*h[c], (toks, len(toks)))
        self._pending.pop(seq, None)
        if why is not None:
            self._check_restore(seq, why, logits, snap, toks, pos0, window_short=short)
        return 0

    def _window_short(self, seq: int, why: str, pos0: int) -> bool:
        """After a partial (checkpoint) restore, the SWA cells of ``seq`` start above the window of
        the token at ``pos0``: it will attend without a position inside its window.

        ``llama_state_seq_get_data`` saves only the SWA cells not masked for the sequence's pos_max
        (src/llama-kv-cache.cpp:2094), so a checkpoint restored and then cut below its pos_max (the
        server's [TAG_PROMPT_LOGITS] step back) holds ``[pos_max - n_swa + 1, ...]`` while the token
        at ``pos0`` needs ``[pos0 - n_swa + 1, ...]`` (LLAMA_SWA_TYPE_STANDARD: a cell is masked when
        ``p1 - p0 >= n_swa``). The known finding ``swa-restore-window-short``.
        """
        if self.n_swa <= 0 or pos0 <= 0 or not why.startswith(f"set_data(flags={STATE_SEQ_FLAGS_PARTIAL_ONLY})"):
            return False
        return self.memory_seq_pos_min(seq) > max(0, pos0 - self.n_swa + 1)

    def verify(self, seq: int, why: str = "verify", token: int = 3) -> bool:
        """Decode one probe token on ``seq`` and compare it with a fresh evaluation (a restore check).

        For the end of a scenario: the probe stays in the sequence. False when the logits differ
        from the fresh evaluation (recorded in :attr:`mismatches`).
        """
        before = len(self.mismatches)
        self._pending[seq] = why
        n = len(self.seq_tokens(seq) or ())
        if self.decode(seq, [token], n) != 0:
            raise RuntimeError(f"{self.name}: probe decode on seq {seq} at {n} failed")
        return len(self.mismatches) == before

    def _raw_state(self, ctx: Any, seq: int, flags: int = 0) -> bytes:
        """``llama_state_seq_get_data_ext`` of ``seq`` in ``ctx``, without any bookkeeping."""
        ll = self._ll
        size = int(ll.llama_state_seq_get_size_ext(ctx, seq, flags))
        buf = ll.buffer(size)
        n = int(ll.llama_state_seq_get_data_ext(ctx, buf, size, seq, flags))
        return ll.bytes_at(buf, n)

    def _check_restore(
        self,
        seq: int,
        why: str,
        logits: bytes,
        snap: bytes,
        toks: tuple[int, ...],
        pos0: int,
        *,
        window_short: bool = False,
    ) -> None:
        """Compare with a fresh evaluation; tell a wrong state from a different KV cell layout.

        When the logits differ, the sequence's full state as it was right before this decode
        (``snap``) is loaded into the fresh context, where its cells are contiguous from cell 0, and
        the same tokens are decoded. If that equals the fresh evaluation bit for bit, the restored
        state was right and only the cell layout (holes left by ``seq_rm``, cells shared by
        ``seq_cp``, other sequences' cells in a unified KV) changed the order of the attention
        reductions: a :attr:`layout_diffs` entry (the known finding ``kv-layout-dependent-logits``).
        In a unified KV the sequence may have been computed beside other sequences' cells, which
        changes the rounding of its stored K/V too; there a difference within
        :data:`UNIFIED_LAYOUT_TOLERANCE` of the largest logit is also the layout finding, and so it
        is where the components hold the same tokens decoded in different batches (the reference
        can reproduce one batch shape only). Otherwise the state itself differs: a
        :attr:`mismatches` entry.
        """
        chunks_by_comp = self._hist[seq]
        histories = {_flat(v) for v in chunks_by_comp.values()}
        if len(histories) != 1:
            return  # parts disagree: the state invariants report that, not this check
        chunks = max(chunks_by_comp.values(), key=len)
        ref = self.reference_logits(chunks)
        self.restore_checks += 1
        first = why.split("+")[0]
        partial = first == f"set_data(flags={STATE_SEQ_FLAGS_PARTIAL_ONLY})"
        self.restores_by[first.split("(")[0] + ("(partial)" if partial else "")] += 1
        if ref == logits:
            return
        n = len(logits) // 4
        a = struct.unpack(f"<{n}f", logits)
        b = struct.unpack(f"<{n}f", ref)
        diffs = [i for i in range(n) if a[i] != b[i]]
        m = Mismatch(
            provider=self.name,
            seq=seq,
            restored_by=why,
            n_tokens=len(_flat(chunks)),
            first_diff=diffs[0] if diffs else -1,
            max_abs_diff=max((abs(a[i] - b[i]) for i in diffs), default=0.0),
            history=_flat(chunks),
        )
        scale = max((abs(x) for x in b), default=0.0) or 1.0
        mixed_batches = len({tuple(v) for v in chunks_by_comp.values()}) > 1
        if seq in self._overwritten:
            # a deferred stream copy overwrote this sequence's restored K/V when this decode (or an
            # earlier one, whose cells it kept) began: the known finding, not the provider's restore.
            # The layout test cannot tell: its snapshot was taken before the copy ran.
            self.finding_diffs.setdefault(PENDING_CP_FINDING, []).append(m)
        elif window_short:
            # the restored SWA cells start above this token's window (:meth:`_window_short`): the
            # known finding, not the provider's restore; the compacted state lacks the cell too
            self.finding_diffs.setdefault(SWA_WINDOW_FINDING, []).append(m)
        elif self._compacted_logits(snap, toks, pos0) == ref:
            self.layout_diffs.append(m)
        elif self._kv_unified and m.max_abs_diff <= UNIFIED_LAYOUT_TOLERANCE * scale:
            # in a unified KV the sequence was computed beside other sequences' cells, so even its
            # stored K/V (layers past the first) carry the layout's rounding: not a wrong state
            self.layout_diffs.append(m)
        elif mixed_batches and m.max_abs_diff <= UNIFIED_LAYOUT_TOLERANCE * scale:
            # the same tokens, computed in different batches per component (a partial restore put an
            # SWA checkpoint taken in one batch beside KV cells decoded in another): one fresh
            # evaluation cannot have both batch shapes, so the last bits differ; not a wrong state
            self.layout_diffs.append(m)
        else:
            self.mismatches.append(m)

    def _compacted_logits(self, snap: bytes, toks: tuple[int, ...], pos0: int) -> bytes:
        ll = self._ll
        ref = self._reference_ctx()
        ll.llama_memory_clear(ll.llama_get_memory(ref), True)
        if snap and LlamaProvider._set_raw(self, ref, 0, snap, 0) == 0:
            return b""
        ret, logits = self._decode_raw(ref, 0, toks, pos0, want_logits=True)
        return logits if ret == 0 else b""

    def _reference_ctx(self) -> Any:
        """A one-sequence context with the KV room one sequence has here (n_ctx / n_seq unless unified)."""
        if self._ref is None:
            n_ctx = self.n_ctx if self._kv_unified else self.n_ctx // max(1, self.n_seq)
            self._ref = self._new_context(1, max(n_ctx, 32))
        return self._ref

    def reference_logits(self, chunks: Chunks) -> bytes:
        """The last token's logits after decoding ``chunks`` from scratch in a fresh context.

        Logits are not invariant to batch shape (a token's K/V and recurrent update differ in the
        last bits with the number of tokens in its batch), so the fresh evaluation decodes the
        same batches: a batch whose tail was later rolled back is decoded whole and then cut with
        ``seq_rm`` where the memory allows a partial removal; where it does not (recurrent and
        hybrid memory), the kept prefix is decoded on its own. After a cut the state is moved to
        contiguous cells before the last batch, so the reference has the canonical layout.
        """
        ll = self._ll
        ref = self._reference_ctx()
        mem = ll.llama_get_memory(ref)
        ll.llama_memory_clear(mem, True)
        pos = 0
        logits = b""
        cut = False
        for i, (batch, kept) in enumerate(chunks):
            last = i == len(chunks) - 1
            if last and cut:
                # the cuts left holes; move the state to contiguous cells so that only the values,
                # not the layout, are compared (see the kv-layout-dependent-logits finding)
                snap = self._raw_state(ref, 0)
                ll.llama_memory_clear(mem, True)
                if LlamaProvider._set_raw(self, ref, 0, snap, 0) == 0:
                    raise RuntimeError("reference compaction failed")
            toks = batch if kept == len(batch) or self._rm_type is SeqRmType.PART else batch[:kept]
            ret, logits = self._decode_raw(ref, 0, toks, pos, want_logits=last)
            if ret != 0:
                raise RuntimeError(f"reference decode failed ({ret}) at position {pos}")
            if len(toks) > kept:
                if not ll.llama_memory_seq_rm(mem, 0, pos + kept, -1):
                    raise RuntimeError(f"reference seq_rm at {pos + kept} refused")
                cut = True
            pos += kept
        return logits

    def seq_component_tokens(self, seq: int) -> list[tuple[int, ...]]:
        """The token history of each memory component (KV, SWA, recurrent) of ``seq``."""
        return [_flat(v) for v in self._hist[seq].values()]

    def seq_tokens(self, seq: int) -> tuple[int, ...] | None:
        hists = {_flat(v) for v in self._hist[seq].values()}
        if len(hists) != 1:
            return None
        return next(iter(hists))

    def _check_seq(self, seq: int) -> None:
        if not 0 <= seq < self.n_seq:
            raise IndexError(f"{self.name}: seq_id {seq} out of range (n_seq = {self.n_seq})")


def _digest(data: bytes, flags: int) -> bytes:
    return hashlib.blake2b(data, digest_size=16, person=b"flags%d" % flags).digest()


def make_llama_server(
    semantics: str | Semantics,
    model: str | os.PathLike[str],
    *,
    draft_model: str | os.PathLike[str] | None = None,
    params: ServerParams | None = None,
    n_ctx: int = 512,
    n_ctx_dft: int | None = None,
    check_restores: bool = True,
) -> ServerContext:
    """The same modelled server on real libllama contexts (:class:`~harness.targets.libllama.LlamaProvider`).

    The contexts are made as llama-server makes them where it matters: ``n_seq_max`` = slots,
    ``kv_unified``, ``n_batch`` and ``n_ubatch`` from ``params``, ``swa_full`` false, one thread.
    Close the server's providers with :func:`close_server` when done.
    """
    sem = get_semantics(semantics) if isinstance(semantics, str) else semantics
    params = params or ServerParams(cache_ram_unit=1024)
    common = {
        "n_seq": params.n_slots,
        "n_batch": params.n_batch,
        "n_ubatch": params.n_ubatch,
        "kv_unified": params.kv_unified,
        "check_restores": check_restores,
    }
    tgt = LlamaProvider(load_model(model), name="tgt", n_ctx=n_ctx, **common)  # type: ignore[arg-type]
    dft = None
    if draft_model is not None:
        dft = LlamaProvider(
            load_model(draft_model),
            name="dft",
            n_ctx=n_ctx if n_ctx_dft is None else n_ctx_dft,
            **common,  # type: ignore[arg-type]
        )
    server_cls: type[ServerContext] = sem.server_cls or ServerContext
    return server_cls(params, Host(), sem, tgt, dft)


def close_server(server: ServerContext) -> None:
    """Free the native contexts of a server made by :func:`make_llama_server` (no-op for synthetic ones)."""
    for ctx in (server.ctx_tgt, server.ctx_dft):
        close = getattr(ctx, "close", None)
        if close is not None:
            close()
