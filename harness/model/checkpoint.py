"""``common_prompt_checkpoint`` and the ``std::list`` that holds them, in both semantics.

Upstream: ``struct common_prompt_checkpoint`` at common/common.h:1232, methods at
common/common.cpp:2260-2366, llama.cpp commit 0c1e570 (vendored by llama-cpp-python 0.3.36).

The C++ relies on value semantics and destructors; the model makes both explicit: ``copy()`` is
the copy constructor and ``destroy()`` the destructor, and :class:`CheckpointList` calls
``destroy()`` on every element it erases, pops or clears, as ``std::list`` does. Every allocation
(list node, payload copy, new payload on update) goes through the host's seam and is unwound on
failure, as stack unwinding would free temporaries.
"""

from __future__ import annotations

from collections.abc import Iterator

from harness.errors import GgmlAbort
from harness.model.memory import CHECKPOINT_HEADER_BYTES, LIST_NODE_BYTES, Host, Payload
from harness.model.provider import StateProvider
from harness.model.semantics import Semantics

__all__ = ["CheckpointList", "CommonPromptCheckpoint"]


class CommonPromptCheckpoint:
    """``common_prompt_checkpoint`` (common/common.h:1232 @ 0c1e570).

    Fields, as upstream: ``n_tokens``, ``id_task`` (-1 unless set), ``pos_min``, ``pos_max``,
    ``data_tgt``, ``data_dft``, ``data_spec``. A payload field is ``None`` for an empty vector.

    Harness-only (no upstream field): ``made_for`` is the token prefix the slot held when the
    checkpoint was taken (``n_tokens`` tokens). Nothing in the model reads it; it lets a restore
    of a checkpoint taken for another prompt be recognised (known finding
    ``stale-checkpoint-after-miss``).

    Deviation: under ``shared`` semantics ``data_tgt``/``data_dft`` are shared, immutable
    payloads (PR #27451): :meth:`copy` takes references and :meth:`update_tgt` allocates a new
    payload and swaps it in. ``data_spec`` is deep-copied in both semantics.
    """

    def __init__(
        self,
        host: Host,
        sem: Semantics,
        *,
        n_tokens: int = 0,
        id_task: int = -1,
        pos_min: int = 0,
        pos_max: int = 0,
    ) -> None:
        self.host = host
        self.sem = sem
        self.n_tokens = n_tokens
        self.id_task = id_task
        self.pos_min = pos_min
        self.pos_max = pos_max
        self.made_for: tuple[int, ...] = ()
        self.data_tgt: Payload | None = None
        self.data_dft: Payload | None = None
        self.data_spec: Payload | None = None

    def __repr__(self) -> str:
        return (
            f"ckpt(n_tokens={self.n_tokens}, pos=[{self.pos_min},{self.pos_max}], "
            f"task={self.id_task}, tgt={self.data_tgt}, dft={self.data_dft})"
        )

    def payloads(self) -> list[Payload]:
        return [p for p in (self.data_tgt, self.data_dft, self.data_spec) if p is not None]

    # common.cpp:2260
    def size(self) -> int:
        n = 0
        for p in (self.data_tgt, self.data_dft, self.data_spec):
            if p is not None:
                n += p.nbytes
        return n

    # common.cpp:2264
    def empty(self) -> bool:
        return self.data_tgt is None or self.data_tgt.nbytes == 0

    # common.cpp:2268
    def clear(self) -> None:
        self.n_tokens = 0
        self.pos_min = 0
        self.pos_max = 0
        self.destroy()

    # common.cpp:2279
    def update_pos(self, n_tokens: int, pos_min: int, pos_max: int) -> None:
        self.n_tokens = n_tokens
        self.pos_min = pos_min
        self.pos_max = pos_max

    def _write(self, old: Payload | None, data: bytes, site: str, kind: str) -> Payload | None:
        """``data.resize(n); get_data(data)``: in place (master) or into a fresh payload (shared)."""
        if not self.sem.shared_payloads and old is not None:
            old.rewrite(data, site)
            return old
        new = self.host.alloc_payload(site, len(data), kind)
        if new is not None:
            new.fill(data)
        if old is not None:
            old.release()
        return new

    # common.cpp:2288
    def update_tgt(self, ctx: StateProvider | None, seq_id: int, flags: int) -> None:
        if ctx is None:
            return
        size = ctx.state_seq_get_size_ext(seq_id, flags)
        data = ctx.state_seq_get_data_ext(seq_id, flags)
        if len(data) != size:
            raise GgmlAbort(f"checkpoint size mismatch: expected {size}, got {len(data)}")
        self.data_tgt = self._write(self.data_tgt, data, "ckpt.update_tgt", "ckpt_tgt")

    # common.cpp:2306
    def update_dft(self, ctx: StateProvider | None, seq_id: int, flags: int) -> None:
        if ctx is None:
            return
        size = ctx.state_seq_get_size_ext(seq_id, flags)
        data = ctx.state_seq_get_data_ext(seq_id, flags)
        if len(data) != size:
            raise GgmlAbort(f"checkpoint size mismatch: expected {size}, got {len(data)}")
        self.data_dft = self._write(self.data_dft, data, "ckpt.update_dft", "ckpt_dft")

    def update_spec(self, data: bytes) -> None:
        """``common_speculative_get_state(spec, seq, data_spec)``: value-owned in both semantics."""
        if self.data_spec is not None and self.data_spec.holders == 1:
            self.data_spec.rewrite(data, "ckpt.update_spec")
            return
        new = self.host.alloc_payload("ckpt.update_spec", len(data), "ckpt_spec")
        if new is not None:
            new.fill(data)
        if self.data_spec is not None:
            self.data_spec.release()
        self.data_spec = new

    # common.cpp:2324
    def load_tgt(self, ctx: StateProvider | None, seq_id: int, flags: int) -> None:
        if ctx is None or self.data_tgt is None:
            return
        n = ctx.state_seq_set_data_ext(seq_id, self.data_tgt.data, flags)
        if n != self.data_tgt.nbytes:
            raise GgmlAbort(f"checkpoint size mismatch: expected {self.data_tgt.nbytes}, got {n}")

    # common.cpp:2342
    def load_dft(self, ctx: StateProvider | None, seq_id: int, flags: int) -> None:
        if ctx is None or self.data_dft is None:
            return
        n = ctx.state_seq_set_data_ext(seq_id, self.data_dft.data, flags)
        if n != self.data_dft.nbytes:
            raise GgmlAbort(f"checkpoint size mismatch: expected {self.data_dft.nbytes}, got {n}")

    # common.cpp:2360
    def clear_tgt(self) -> None:
        if self.data_tgt is not None:
            self.data_tgt.release()
            self.data_tgt = None

    # common.cpp:2364
    def clear_dft(self) -> None:
        if self.data_dft is not None:
            self.data_dft.release()
            self.data_dft = None
        if self.data_spec is not None:
            self.data_spec.release()
            self.data_spec = None

    def copy(self) -> CommonPromptCheckpoint:
        """The implicit copy constructor: deep (master) or sharing tgt/dft (shared).

        The list node that holds the copy is allocated by :meth:`CheckpointList.copy`. On
        ``BadAlloc`` whatever was already copied is released before the exception propagates.
        """
        c = type(self)(
            self.host,
            self.sem,
            n_tokens=self.n_tokens,
            id_task=self.id_task,
            pos_min=self.pos_min,
            pos_max=self.pos_max,
        )
        c.made_for = self.made_for
        try:
            if self.sem.shared_payloads:
                c.data_tgt = self.data_tgt.acquire() if self.data_tgt is not None else None
                c.data_dft = self.data_dft.acquire() if self.data_dft is not None else None
            else:
                c.data_tgt = self.host.copy_payload("ckpt_copy.tgt", self.data_tgt)
                c.data_dft = self.host.copy_payload("ckpt_copy.dft", self.data_dft)
            c.data_spec = self.host.copy_payload("ckpt_copy.spec", self.data_spec)
        except BaseException:  # unwinding: release what was already copied
            c.destroy()
            raise
        return c

    def destroy(self) -> None:
        """The destructor: release every payload this checkpoint holds (each by name, not getattr and
        setattr over a tuple of names: ~20k checkpoints a gate run)."""
        self.clear_tgt()
        self.clear_dft()


class CheckpointList:
    """``std::list<common_prompt_checkpoint>`` in creation order (front = oldest).

    Erasing, popping and clearing destroy the removed checkpoints. ``copy()`` is the list's copy
    constructor: a node allocation and an element copy per checkpoint, unwound on ``BadAlloc``.
    """

    def __init__(self, host: Host, items: list[CommonPromptCheckpoint] | None = None) -> None:
        self.host = host
        # the list itself, front first: an attribute, not a copy, for readers that change nothing while
        # they walk it (the state invariants, after every step: ~140k reads a gate run on np3, which a
        # method call made a Python frame each); every change goes through the methods below
        self.items: list[CommonPromptCheckpoint] = items if items is not None else []

    def __iter__(self) -> Iterator[CommonPromptCheckpoint]:
        return iter(list(self.items))  # a copy: the loops that erase while they walk stay correct

    def __reversed__(self) -> Iterator[CommonPromptCheckpoint]:
        return iter(list(reversed(self.items)))

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> CommonPromptCheckpoint:
        return self.items[i]

    def empty(self) -> bool:
        return not self.items

    def front(self) -> CommonPromptCheckpoint:
        return self.items[0]

    def back(self) -> CommonPromptCheckpoint:
        return self.items[-1]

    def emplace_back(self, ckpt: CommonPromptCheckpoint) -> CommonPromptCheckpoint:
        """Allocate a node (may fail, then ``ckpt`` is destroyed) and append ``ckpt``."""
        try:
            self.host.allocate("ckpt_list.node", LIST_NODE_BYTES + CHECKPOINT_HEADER_BYTES)
        except BaseException:
            ckpt.destroy()
            raise
        self.items.append(ckpt)
        return ckpt

    def erase(self, ckpt: CommonPromptCheckpoint) -> None:
        self.items.remove(ckpt)
        ckpt.destroy()

    def pop_front(self) -> None:
        self.items.pop(0).destroy()

    def clear(self) -> None:
        items, self.items = self.items, []
        for c in items:
            c.destroy()

    def take(self) -> CheckpointList:
        """``std::move``: the returned list owns the elements, this one is left empty."""
        out = CheckpointList(self.host, self.items)
        self.items = []
        return out

    def copy(self) -> CheckpointList:
        out = CheckpointList(self.host)
        try:
            for c in self.items:
                self.host.allocate("ckpt_copy.node", LIST_NODE_BYTES + CHECKPOINT_HEADER_BYTES)
                out.items.append(c.copy())
        except BaseException:
            out.clear()
            raise
        return out
