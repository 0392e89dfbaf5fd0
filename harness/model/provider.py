"""State providers: what the model asks of a ``llama_context``, and a synthetic one.

The server touches sequence state through a handful of libllama calls; :class:`StateProvider` is
exactly that surface (names without the ``llama_`` prefix):

* ``state_seq_get_size_ext`` / ``state_seq_get_data_ext`` / ``state_seq_set_data_ext`` with
  ``flags`` 0 (full state, used for cache entries) or :data:`STATE_SEQ_FLAGS_PARTIAL_ONLY`
  (only the part that cannot be rolled back: SWA or recurrent cells, used for checkpoints);
* ``memory_seq_rm`` / ``memory_seq_cp`` / ``memory_seq_pos_min`` / ``memory_seq_pos_max``;
* ``decode`` of tokens appended to one sequence, and ``seq_rm_type`` as
  ``common_context_can_seq_rm`` reports it.

``seq_tokens`` is the one addition: the token history the sequence's state describes, or ``None``
when its parts disagree. It is what "target and draft stay in step" is checked against. A real
provider may answer it only from positions (``None`` is never a valid answer for a consistent
sequence).

:class:`SyntheticProvider` makes deterministic bytes whose sizes behave like the four memory kinds
(a libllama provider lives beside it once the real-target issue lands):

==============  =========================================  ====================================
kind            full state (flags 0)                       partial state (PARTIAL_ONLY)
==============  =========================================  ====================================
transformer     KV cells, grows with tokens                 same as full (libllama returns the KV)
recurrent       one recurrent block, constant               same as full
hybrid          recurrent block + KV cells                  recurrent block only (constant)
iswa            full-attention KV + SWA KV (window cells)   SWA KV only, bounded by the window
==============  =========================================  ====================================

Its promises: bytes are a pure function of (seed, kind, component, token history); a state that
is loaded back restores exactly the history it was taken from; a truncated, corrupted or
mismatched buffer is refused (``set`` returns 0 and clears the sequence, as libllama does);
``seq_rm`` of a suffix fails on recurrent memory unless it removes everything or nothing, and
succeeds or fails as a whole on hybrid memory (recurrent part first, as ``llama_memory_hybrid``).
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from harness.errors import BadAlloc
from harness.model.shift import kv_add, kv_rm, rs_add, rs_rm

__all__ = ["STATE_SEQ_FLAGS_NONE", "STATE_SEQ_FLAGS_PARTIAL_ONLY", "MemoryKind", "SeqRmType", "StateProvider",
           "SyntheticProvider"]  # fmt: skip

STATE_SEQ_FLAGS_NONE = 0
STATE_SEQ_FLAGS_PARTIAL_ONLY = 1


class SeqRmType(enum.Enum):
    """``common_context_seq_rm_type`` (common/common.h)."""

    NO = "no"
    PART = "part"
    FULL = "full"
    RS = "rs"


class MemoryKind(enum.Enum):
    TRANSFORMER = "transformer"
    RECURRENT = "recurrent"
    HYBRID = "hybrid"
    ISWA = "iswa"


@runtime_checkable
class StateProvider(Protocol):
    """One ``llama_context``'s sequence-state surface, as the server uses it."""

    name: str
    n_swa: int

    def seq_rm_type(self) -> SeqRmType: ...

    def state_seq_get_size_ext(self, seq: int, flags: int) -> int: ...

    def state_seq_get_data_ext(self, seq: int, flags: int) -> bytes: ...

    def state_seq_set_data_ext(self, seq: int, data: bytes, flags: int) -> int: ...

    def memory_seq_rm(self, seq: int, p0: int, p1: int) -> bool: ...

    def memory_seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None: ...

    def memory_seq_pos_min(self, seq: int) -> int: ...

    def memory_seq_pos_max(self, seq: int) -> int: ...

    def decode(self, seq: int, tokens: Sequence[int], pos0: int) -> int: ...

    def seq_tokens(self, seq: int) -> tuple[int, ...] | None: ...


_MAGIC = b"SYNS"
_HEADER = struct.Struct("<4sBBBB")  # magic, kind, flags, n_components, pad
_COMP = struct.Struct("<BII16s")  # component id, n (history length), lo (first kept cell), digest


@dataclass
class _Comp:
    """One memory component of one sequence: a KV cache (optionally windowed) or a recurrent block."""

    cid: int
    is_rs: bool
    window: int = 0  # >0: sliding-window KV that keeps only the last ``window`` cells
    hist: tuple[int, ...] = ()
    lo: int = 0  # first position whose cell is kept (KV only)
    # _hist_digest(digested), kept for the history object it was made from (a tuple: the same object is
    # the same history); a state read asks for it, a full and a partial read of one history alike
    digest: bytes = b""
    digested: tuple[int, ...] | None = None

    def cells(self) -> int:
        if self.is_rs:
            return 1 if self.hist else 0
        return len(self.hist) - self.lo


@dataclass
class _Seq:
    """A sequence's components. The list and its components are the sequence's for its whole life (a copy,
    :meth:`SyntheticProvider.memory_seq_cp`, writes into them), so the selections are made once."""

    comps: list[_Comp]
    partial: list[_Comp]  # the components STATE_SEQ_FLAGS_PARTIAL_ONLY selects
    by_id: dict[int, _Comp]


class _Seqs(dict[int, _Seq]):
    """A provider's sequences by seq_id: a lookup is the dict's own (no Python call: ~80k a gate run),
    and an id out of range, negative included, is an IndexError that says so."""

    def __init__(self, name: str, n_seq: int, seqs: dict[int, _Seq]) -> None:
        super().__init__(seqs)
        self.name, self.n_seq = name, n_seq

    def __missing__(self, seq: int) -> _Seq:
        raise IndexError(f"{self.name}: seq_id {seq} out of range (n_seq = {self.n_seq})")


# component ids
_KV, _SWA, _RS = 1, 2, 3


class SyntheticProvider:
    """A deterministic stand-in for a ``llama_context`` of one of the four memory kinds.

    ``kv_bytes_per_token`` is the size of one KV cell (>= 8), ``rs_bytes`` the size of the recurrent
    block, ``window`` the SWA window (iSWA only), ``n_ctx`` the KV cells shared by all sequences
    (``decode`` returns 1 when they run out, as ``llama_decode`` does when the KV is full).
    """

    def __init__(
        self,
        kind: MemoryKind,
        *,
        name: str = "tgt",
        n_seq: int = 4,
        n_ctx: int = 4096,
        kv_bytes_per_token: int = 32,
        rs_bytes: int = 1024,
        window: int = 8,
        seed: int = 0,
    ) -> None:
        if kv_bytes_per_token < 8:
            raise ValueError("kv_bytes_per_token must be >= 8")
        self.kind = kind
        self.name = name
        self.n_seq = n_seq
        self.n_ctx = n_ctx
        self.kv_bpt = kv_bytes_per_token
        self.rs_bytes = rs_bytes
        self.window = window
        self.seed = seed
        self.n_swa = window if kind is MemoryKind.ISWA else 0
        self._kind_id = _KIND_IDS[kind]  # not looked up per state: an Enum hashes in Python
        self._registry: dict[bytes, tuple[int, ...]] = {_hist_digest(()): ()}
        self._fill: dict[int, bytes] = {}  # component id -> the fillers of positions 0.. (:meth:`_fillers`)
        self._blocks: dict[bytes, bytes] = {}
        self._seqs = _Seqs(name, n_seq, {i: self._new_seq() for i in range(n_seq)})
        # the components a state read or write selects, per STATE_SEQ_FLAGS_PARTIAL_ONLY: fixed by the kind
        all_ids = [c.cid for c in self._seqs[0].comps] if self._seqs else []
        partial = self._partial_ids()
        self._ids = (all_ids, [c for c in all_ids if c in partial])
        self.decode_calls = 0
        # an allocation inside libllama's state read (``llama_state_seq_set_data_ext``): the host's
        # seam may make it fail with BadAlloc, which libllama catches and reports as 0 bytes read
        self.restore_fault: Callable[[str, int], None] | None = None

    # ---- structure -------------------------------------------------------------------------

    def _new_seq(self) -> _Seq:
        k = self.kind
        if k is MemoryKind.TRANSFORMER:
            comps = [_Comp(_KV, False)]
        elif k is MemoryKind.RECURRENT:
            comps = [_Comp(_RS, True)]
        elif k is MemoryKind.HYBRID:
            comps = [_Comp(_RS, True), _Comp(_KV, False)]
        else:
            comps = [_Comp(_KV, False), _Comp(_SWA, False, window=self.window)]
        partial = self._partial_ids()
        return _Seq(comps, [c for c in comps if c.cid in partial], {c.cid: c for c in comps})

    def _partial_ids(self) -> set[int]:
        k = self.kind
        if k is MemoryKind.TRANSFORMER:
            return {_KV}
        if k is MemoryKind.RECURRENT or k is MemoryKind.HYBRID:
            return {_RS}
        return {_SWA}

    def _selected(self, seq: int, flags: int) -> list[_Comp]:
        """The components of ``seq`` a state read or write with ``flags`` selects (made with the sequence;
        the state reads take them inline)."""
        s = self._seqs[seq]
        return s.partial if flags & STATE_SEQ_FLAGS_PARTIAL_ONLY else s.comps

    def _comp_ids(self, flags: int) -> list[int]:
        return self._ids[1] if flags & STATE_SEQ_FLAGS_PARTIAL_ONLY else self._ids[0]

    def seq_rm_type(self) -> SeqRmType:
        if self.kind in (MemoryKind.RECURRENT, MemoryKind.HYBRID):
            return SeqRmType.FULL
        return SeqRmType.PART

    def kv_cells_used(self) -> int:
        n = 0
        for s in self._seqs.values():  # loops, not a generator of cells(): a decode and a restore each ask
            for c in s.comps:
                if not c.is_rs:
                    n += len(c.hist) - c.lo
        return n

    # ---- state bytes ----------------------------------------------------------------------

    def state_seq_get_size_ext(self, seq: int, flags: int) -> int:
        size = _HEADER.size
        s = self._seqs[seq]  # the selected components, made once per sequence (_Seq)
        for c in s.partial if flags & STATE_SEQ_FLAGS_PARTIAL_ONLY else s.comps:  # each one's size, inline
            if c.is_rs:
                size += _COMP.size + (self.rs_bytes if c.hist else 0)
            else:
                size += _COMP.size + (len(c.hist) - c.lo) * self.kv_bpt
        return size

    def state_seq_get_data_ext(self, seq: int, flags: int) -> bytes:
        s = self._seqs[seq]
        comps = s.partial if flags & STATE_SEQ_FLAGS_PARTIAL_ONLY else s.comps
        out = [_HEADER.pack(_MAGIC, self._kind_id, flags & 0xFF, len(comps), 0)]
        size = _HEADER.size  # state_seq_get_size_ext's sum over the same components, inline
        for c in comps:
            hist = c.hist
            if c.digested is not hist:
                c.digest, c.digested = _hist_digest(hist), hist
            d = c.digest
            self._registry[d] = hist
            if c.is_rs:
                out.append(_COMP.pack(c.cid, len(hist), 0, d))
                if hist:
                    out.append(self._rs_block(d))
                size += _COMP.size + (self.rs_bytes if hist else 0)
            else:
                out.append(_COMP.pack(c.cid, len(hist), c.lo, d))
                out.append(_tokens(hist[c.lo :]))
                out.append(self._fillers(c.cid, c.lo, len(hist)))
                size += _COMP.size + (len(hist) - c.lo) * self.kv_bpt
        data = b"".join(out)
        assert len(data) == size, "the state's bytes disagree with state_seq_get_size_ext"
        return data

    def _rs_block(self, digest: bytes) -> bytes:
        """The recurrent block of the history with ``digest``; cached per provider, as :meth:`_fillers`."""
        block = self._blocks.get(digest)
        if block is None:
            if len(self._blocks) >= 1 << 10:  # at most ~1 MiB of them at the default rs_bytes
                self._blocks.clear()
            h = hashlib.blake2b(b"rs" + self.seed.to_bytes(8, "little") + digest).digest()  # 64 bytes, repeated
            block = self._blocks[digest] = (h * (self.rs_bytes // len(h) + 1))[: self.rs_bytes]
        return block

    def _fillers(self, cid: int, lo: int, hi: int) -> bytes:
        """The fillers of KV cells ``lo..hi-1`` of component ``cid``: ``kv_bpt - 4`` bytes per position,
        derived from (seed, component, position) by one SHAKE-256 stream per component.

        A KV component's state is its cells' tokens (int32 each), then their fillers: a pack and a
        slice, not a loop over cells. Kept per provider (a save and the restore that checks it ask
        for the same positions), not per process: a fault trial's allocations must not depend on the
        trials before it. The stream is a prefix of itself at any length, so it grows by doubling
        without changing the bytes already handed out.
        """
        n = self.kv_bpt - 4
        run = self._fill.get(cid, b"")
        if len(run) < hi * n:
            cap = max(64, hi, 2 * len(run) // n)
            run = hashlib.shake_256(b"kv" + self.seed.to_bytes(8, "little") + bytes((cid,))).digest(cap * n)
            self._fill[cid] = run
        return run[lo * n : hi * n]

    def state_seq_set_data_ext(self, seq: int, data: bytes, flags: int) -> int:
        """Restore ``data`` into ``seq``; 0 on any mismatch, and then the sequence is cleared."""
        s = self._seqs[seq]
        if self.restore_fault is not None:
            try:
                self.restore_fault(f"{self.name}.state_read", len(data))
            except BadAlloc:
                # llama_state_seq_set_data_ext catches the exception and returns 0; the KV cache
                # had already removed the sequence (llama_kv_cache::state_read_meta seq_rm)
                self.memory_seq_rm(seq, -1, -1)
                return 0
        parsed = self._parse(data, flags)
        if parsed is None:
            self.memory_seq_rm(seq, -1, -1)
            return 0
        by_id = s.by_id
        # the restored cells must find room in the KV cache (llama_kv_cache::state_read_meta); a state
        # without KV cells (a hybrid's partial one: the recurrent part only) needs none, and is read
        # even where this count of all sequences' cells is above n_ctx (cells a seq_cp into another
        # stream added: per-slot KV streams each have their own room, which this count does not split)
        freed = sum(by_id[cid].cells() for cid, _, _ in parsed if cid != _RS)
        needed = sum(len(h) - lo for cid, h, lo in parsed if cid != _RS)
        if needed > 0 and self.kv_cells_used() - freed + needed > self.n_ctx:
            self.memory_seq_rm(seq, -1, -1)
            return 0
        for cid, hist, lo in parsed:
            c = by_id[cid]
            c.hist = hist
            c.lo = lo
        return len(data)

    def _parse(self, data: bytes, flags: int) -> list[tuple[int, tuple[int, ...], int]] | None:
        if len(data) < _HEADER.size:
            return None
        magic, kind_id, dflags, n, _ = _HEADER.unpack_from(data, 0)
        if magic != _MAGIC or kind_id != self._kind_id or dflags != (flags & 0xFF):
            return None
        expect_ids = self._comp_ids(flags)
        if n != len(expect_ids):
            return None
        off = _HEADER.size
        out: list[tuple[int, tuple[int, ...], int]] = []
        for cid_expected in expect_ids:
            if off + _COMP.size > len(data):
                return None
            cid, nh, lo, d = _COMP.unpack_from(data, off)
            off += _COMP.size
            hist = self._registry.get(d)
            if cid != cid_expected or hist is None or len(hist) != nh:
                return None
            if cid == _RS:
                if nh:
                    if data[off : off + self.rs_bytes] != self._rs_block(d):
                        return None
                    off += self.rs_bytes
                out.append((cid, hist, 0))
            else:
                if lo > nh:
                    return None
                toks = _tokens(hist[lo:])
                end = off + len(toks)
                if data[off:end] != toks:
                    return None
                fill = self._fillers(cid, lo, nh)
                off, end = end, end + len(fill)
                if data[off:end] != fill:
                    return None
                off = end
                out.append((cid, hist, lo))
        if off != len(data):
            return None
        return out

    # ---- memory ---------------------------------------------------------------------------

    def memory_seq_rm(self, seq: int, p0: int, p1: int) -> bool:
        """Remove positions [p0, p1) (p1 < 0: to the end); a bounded range, from 0 too (``--cache-reuse`` moving a
        chunk to position 0 removes [0, head_c)): :mod:`harness.model.shift`."""
        s = self._seqs[seq]
        if p1 >= 0:
            if any(rs_rm(c.hist, p0, p1) is None for c in s.comps if c.is_rs):  # recurrent parts first
                return False
            for c in (c for c in s.comps if not c.is_rs):  # a recurrent part keeps its state (rs_rm)
                c.hist, c.lo = kv_rm(c.hist, c.lo, p0, p1)
            return True
        p0 = max(0, p0)
        # recurrent parts first: if they refuse, nothing changes (llama_memory_hybrid::seq_rm)
        for c in s.comps:
            if c.is_rs and 0 < p0 < len(c.hist):
                return False
        for c in s.comps:
            if p0 == 0:
                c.hist, c.lo = (), 0
            elif c.is_rs:
                pass  # p0 >= len(hist): nothing to remove
            else:
                c.hist = c.hist[:p0]
                c.lo = min(c.lo, p0)
        return True

    def memory_seq_add(self, seq: int, p0: int, p1: int, delta: int) -> None:
        """``llama_memory_seq_add``: the cells at [p0, p1) moved by ``delta`` (:mod:`harness.model.shift`)."""
        for c in self._seqs[seq].comps:
            c.hist = rs_add(c.hist, p0, p1, delta) if c.is_rs else kv_add(c.hist, c.lo, p0, p1, delta)

    def can_shift(self) -> bool:
        """``llama_memory_can_shift``: iSWA only where both caches have one size (not at the sizes modelled)."""
        return self.kind is not MemoryKind.ISWA

    def memory_seq_cp(self, src: int, dst: int, p0: int, p1: int) -> None:
        if p0 > 0 or p1 >= 0:
            raise NotImplementedError("the synthetic provider models whole-sequence copy only")
        for sc, dc in zip(self._seqs[src].comps, self._seqs[dst].comps, strict=True):  # same kinds, same order
            dc.hist, dc.lo = sc.hist, sc.lo

    def memory_seq_pos_min(self, seq: int) -> int:
        # hybrid and iSWA: the max of the parts' minima (llama_memory_hybrid::seq_pos_min)
        # a part's minimum: a recurrent block holds only its last position, a KV part its first kept
        # cell; -1 for a part with no cell, so the max of the minima is -1 exactly when every part is
        # empty (one loop: ~9k calls a gate run)
        best = -1
        for c in self._seqs[seq].comps:
            n = len(c.hist)
            m = n - 1 if c.is_rs else (c.lo if c.lo < n else -1)
            if m > best:
                best = m
        return best

    def memory_seq_pos_max(self, seq: int) -> int:
        comps = self._seqs[seq].comps  # the min of the parts' last positions
        low = len(comps[0].hist)
        for c in comps:
            if len(c.hist) < low:
                low = len(c.hist)
        return low - 1

    def decode(self, seq: int, tokens: Sequence[int], pos0: int) -> int:
        """Append ``tokens`` at positions ``pos0..``: 0 ok, 1 KV full, -1 positions out of order."""
        self.decode_calls += 1
        comps = self._seqs[seq].comps
        for c in comps:
            if len(c.hist) != pos0:
                return -1
        toks = tuple(map(int, tokens))
        new = []
        delta = 0  # KV cells this decode adds (an SWA window may drop as many as it adds)
        for c in comps:
            h = c.hist + toks
            lo = max(c.lo, len(h) - c.window) if c.window else c.lo
            new.append((c, h, lo))
            if not c.is_rs:
                delta += (len(h) - lo) - (len(c.hist) - c.lo)
        if self.kv_cells_used() + delta > self.n_ctx:
            return 1
        for c, h, lo in new:
            c.hist, c.lo = h, lo
        return 0

    def seq_component_tokens(self, seq: int) -> list[tuple[int, ...]]:
        """The token history of each memory component (KV, SWA, recurrent) of ``seq``."""
        return [c.hist for c in self._seqs[seq].comps]

    def seq_tokens(self, seq: int) -> tuple[int, ...] | None:
        comps = self._seqs[seq].comps
        first = comps[0].hist
        for c in comps:  # compared, not put in a set: a set hashes every history in full
            if c.hist != first:
                return None
        return first


_KIND_IDS = {MemoryKind.TRANSFORMER: 1, MemoryKind.RECURRENT: 2, MemoryKind.HYBRID: 3, MemoryKind.ISWA: 4}


def _tokens(toks: tuple[int, ...]) -> bytes:
    """KV cells' tokens as state bytes: int32, little-endian."""
    return struct.pack(f"<{len(toks)}i", *toks)


def _hist_digest(hist: tuple[int, ...]) -> bytes:
    h = hashlib.blake2b(digest_size=16)
    h.update(struct.pack(f"<{len(hist)}i", *hist))
    return h.digest()
