"""Assemble a modelled server from names: semantics, memory kind, draft, parameters.

``make_server("shared", "hybrid", draft=True)`` gives a :class:`~harness.model.server_context.ServerContext`
whose target (and draft) contexts are :class:`~harness.model.provider.SyntheticProvider` instances of
that kind, on a fresh :class:`~harness.model.memory.Host`. Sizes are small on purpose: a KV cell of 32
bytes and a recurrent block of 1 KiB on the target (8 and 256 on the draft), so that a cache limit
of a few KiB already forces evictions.
"""

from __future__ import annotations

from harness.model.memory import Host
from harness.model.provider import MemoryKind, SyntheticProvider
from harness.model.semantics import Semantics, get_semantics
from harness.model.server_context import ServerContext, ServerParams

__all__ = ["attach_restore_faults", "make_server"]


def make_server(
    semantics: str | Semantics = "shared",
    kind: str | MemoryKind = "hybrid",
    *,
    draft: bool = False,
    params: ServerParams | None = None,
    n_ctx: int = 512,
    n_ctx_dft: int | None = None,
    window: int = 8,
    seed: int = 0,
) -> ServerContext:
    sem = get_semantics(semantics) if isinstance(semantics, str) else semantics
    mk = MemoryKind(kind) if isinstance(kind, str) else kind
    params = params or ServerParams(cache_ram_unit=1024)
    n_seq = params.n_slots
    tgt = SyntheticProvider(mk, name="tgt", n_seq=n_seq, n_ctx=n_ctx, window=window, seed=seed)
    dft = None
    if draft:
        dft = SyntheticProvider(
            mk,
            name="dft",
            n_seq=n_seq,
            n_ctx=n_ctx if n_ctx_dft is None else n_ctx_dft,
            kv_bytes_per_token=8,
            rs_bytes=256,
            window=window,
            seed=seed + 1,
        )
    host = Host()
    attach_restore_faults(host, tgt, dft)
    server_cls: type[ServerContext] = sem.server_cls or ServerContext
    return server_cls(params, host, sem, tgt, dft)


# the operations (``Host.operation`` names) whose scoped faults reach a context's state reads
RESTORE_SCOPES_TGT = ("load", "restore")
RESTORE_SCOPES_DFT = ("restore",)


def attach_restore_faults(host: Host, tgt: SyntheticProvider, dft: SyntheticProvider | None) -> None:
    """Let a seam armed for a cache ``load`` or a checkpoint ``restore`` fail the state read inside it.

    The target's reads fail in both operations. The draft's reads fail only in a checkpoint restore:
    a draft read that fails in a cache load after the target's succeeded leaves the entry without its
    main state upstream (server-task.cpp:1842-1856), the known finding ``draft-kv-exhaustion``,
    which the gate runs apart.
    """
    tgt.restore_fault = lambda site, n: host.scoped_check(site, n, RESTORE_SCOPES_TGT)
    if dft is not None:
        dft.restore_fault = lambda site, n: host.scoped_check(site, n, RESTORE_SCOPES_DFT)
