"""Assemble a modelled server from names: semantics, memory kind, draft, parameters.

``make_server("shared", "hybrid", draft=True)`` gives a :class:`~harness.server.ServerContext`
whose target (and draft) contexts are :class:`~harness.provider.SyntheticProvider` instances of
that kind, on a fresh :class:`~harness.memory.Host`. Sizes are small on purpose: a KV cell of 32
bytes and a recurrent block of 1 KiB on the target (8 and 256 on the draft), so that a cache limit
of a few KiB already forces evictions.
"""

from __future__ import annotations

import os

from .memory import Host
from .provider import MemoryKind, SyntheticProvider
from .semantics import Semantics, get_semantics
from .server import ServerContext, ServerParams

__all__ = ["attach_restore_faults", "close_server", "make_llama_server", "make_server"]


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
    """The same modelled server on real libllama contexts (:class:`~harness.llama_provider.LlamaProvider`).

    The contexts are made as llama-server makes them where it matters: ``n_seq_max`` = slots,
    ``kv_unified``, ``n_batch`` and ``n_ubatch`` from ``params``, ``swa_full`` false, one thread.
    Close the server's providers with :func:`close_server` when done.
    """
    from .llama_provider import LlamaProvider, load_model

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
