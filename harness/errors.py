"""Exceptions that stand for the C++ failure modes the model reproduces.

* :class:`BadAlloc` is ``std::bad_alloc``, raised only by the allocation seam
  (:mod:`harness.memory`).
* :class:`GgmlAbort` is ``GGML_ABORT``/``GGML_ASSERT``: the server process aborts. The model raises
  it where upstream aborts (a checkpoint restore of the wrong size, ``common_memory::seq_rm``
  failing, ``pos_min == -1`` with ``n_past > 0``).

Either one escaping a :class:`~harness.server.ServerContext` operation is a crash of the modelled
server: upstream has no handler above ``process_single_task``/``update_slots``.
"""

from __future__ import annotations

__all__ = ["BadAlloc", "GgmlAbort"]


class BadAlloc(MemoryError):
    """``std::bad_alloc`` at an armed allocation point.

    ``site`` names the allocation point (``"alloc.state_tgt"``, ``"alloc.ckpt_copy.tgt"``, ...),
    ``nth`` is its 1-based number since the seam was armed.
    """

    def __init__(self, site: str, nth: int, nbytes: int) -> None:
        super().__init__(f"std::bad_alloc at allocation #{nth} ({site}, {nbytes} bytes)")
        self.site = site
        self.nth = nth
        self.nbytes = nbytes


class GgmlAbort(RuntimeError):
    """``GGML_ABORT``: the upstream process would abort here, with this message."""
