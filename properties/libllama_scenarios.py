"""Scenarios on real libllama state that a state machine cannot reach, each checked against a fresh evaluation.

* :func:`full_context_run`: the whole context of a model decoded, its full and partial state saved,
  restored into another sequence, and the next token's logits compared bit for bit with a fresh
  evaluation; the state sizes at full context are reported.
* :func:`memray_figures`: memray (native traces) peaks of one save and one load per semantics.
* :func:`draft_recovery_run`: a draft context out of KV room mid-prompt, upstream against the
  recovery proposed in PR #27451's discussion (property ``draft_recovery``).

May import: ``harness.model``, ``harness.targets``, ``fixtures``, ``properties``.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from fixtures.gguf import draft_path, model_path
from harness.model.provider import STATE_SEQ_FLAGS_NONE, STATE_SEQ_FLAGS_PARTIAL_ONLY
from harness.model.server_context import ServerParams
from harness.targets.libllama import LlamaProvider, close_server, load_model, make_llama_server
from properties import invariants as inv

__all__ = ["FullContextResult", "MemoryFigures", "draft_recovery_run", "full_context_run", "memray_figures"]


@dataclass
class FullContextResult:
    arch: str
    n_ctx: int
    state_bytes: int
    partial_bytes: int
    restore_checks: int
    mismatches: list[str]
    seconds: float
    restores_by: dict[str, int]


def full_context_run(arch: str, *, n_ctx: int | None = None) -> FullContextResult:
    """Fill the whole context of ``arch``'s model, save full and partial state, restore, compare.

    Two sequences in one context of ``n_ctx`` cells each (the model's training context by default):
    sequence 0 is filled up to one token before the end (whose last chunk leaves a checkpoint-sized
    partial state), its full state is restored into sequence 1 and the last token decoded on both
    through the provider, which compares each with a fresh evaluation. Then the partial state is
    restored over sequence 1 after truncating its KV where the memory allows it.
    """
    t0 = time.perf_counter()
    model = load_model(model_path(arch))
    n = n_ctx or model.n_ctx_train
    with LlamaProvider(model, name="tgt", n_seq=2, n_ctx=2 * n, n_batch=256, n_ubatch=64) as p:
        toks = [3 + (i * 7) % 256 for i in range(n)]
        pos = 0
        for i in range(0, n - 1, 256):
            chunk = toks[i : min(i + 256, n - 1)]
            if p.decode(0, chunk, pos) != 0:
                raise RuntimeError(f"{arch}: decode failed at {pos} of {n}")
            pos += len(chunk)
        full = p.state_seq_get_data_ext(0, STATE_SEQ_FLAGS_NONE)
        part = p.state_seq_get_data_ext(0, STATE_SEQ_FLAGS_PARTIAL_ONLY)
        if p.state_seq_set_data_ext(1, full, STATE_SEQ_FLAGS_NONE) == 0:
            raise RuntimeError(f"{arch}: restoring {len(full)} B of full state failed")
        if p.decode(1, toks[n - 1 :], n - 1) != 0:
            raise RuntimeError(f"{arch}: decode after restore failed")
        # a checkpoint restore on the same sequence: drop the last token where the memory can,
        # else everything, and put the partial state back (what server_slot does on a rollback)
        if p.memory_seq_rm(1, n - 1, -1) or p.memory_seq_rm(1, 0, -1):
            if p.memory_seq_pos_max(1) < 0:
                p.state_seq_set_data_ext(1, full, STATE_SEQ_FLAGS_NONE)
                p.memory_seq_rm(1, n - 1, -1)
            if p.state_seq_set_data_ext(1, part, STATE_SEQ_FLAGS_PARTIAL_ONLY) != 0 and p.decode(
                1, toks[n - 1 :], n - 1
            ) not in (0,):
                raise RuntimeError(f"{arch}: decode after a partial restore failed")
        return FullContextResult(
            arch=model.arch,
            n_ctx=n,
            state_bytes=len(full),
            partial_bytes=len(part),
            restore_checks=p.restore_checks,
            mismatches=[m.line() for m in p.mismatches],
            seconds=time.perf_counter() - t0,
            restores_by=dict(p.restores_by),
        )


@dataclass
class MemoryFigures:
    """memray (native traces) figures of one save and one load on real state, per semantics."""

    arch: str
    n_tokens: int
    n_checkpoints: int
    state_bytes: int  # S: target (+ draft) state of the entry
    checkpoint_bytes: int  # C: the checkpoint payloads the entry holds
    save_peak_bytes: dict[str, int]  # semantics -> memray peak of the save
    load_peak_bytes: dict[str, int]
    model_save_peak_bytes: dict[str, int]  # semantics -> the ledger's predicted transient peak

    def to_json(self) -> dict[str, Any]:
        return {
            "n_tokens": self.n_tokens,
            "n_checkpoints": self.n_checkpoints,
            "state_bytes": self.state_bytes,
            "checkpoint_bytes": self.checkpoint_bytes,
            "save_peak_bytes": self.save_peak_bytes,
            "load_peak_bytes": self.load_peak_bytes,
            "model_save_peak_bytes": self.model_save_peak_bytes,
        }


def memray_figures(arch: str, *, n_tokens: int = 768, workdir: str | None = None) -> MemoryFigures:
    """Save a long prompt (with its checkpoints) to the cache and load it back, under memray, per semantics.

    One slot processes ``n_tokens`` in batches of 256, creating checkpoints where the model's memory
    needs them (recurrent, hybrid, SWA), then ``prompt_save`` and, after the slot is cleared,
    ``prompt_load`` each run inside their own ``memray.Tracker(native_traces=True)``: the peak is
    the high-water mark of the heap allocated during that one operation, native allocations of
    libllama included. ``master`` deep-copies the checkpoint payloads into the entry; ``shared``
    shares them, so its save peak should not carry C: the difference of the two peaks is about C.

    The absolute peaks are the harness process's, about 3 S for a save: libllama writes into a
    ctypes buffer, which is copied into Python bytes, beside the entry's zero-filled vector (the
    C++ server has only the vector). Compare semantics with each other, not with the server.
    """
    import tempfile

    import memray


    save: dict[str, int] = {}
    load: dict[str, int] = {}
    model_peak: dict[str, int] = {}
    s_bytes = c_bytes = n_ckpt = 0
    with tempfile.TemporaryDirectory(prefix="memray-", dir=workdir) as tmp:
        for sem in ("master", "shared"):
            params = ServerParams(
                n_slots=1,
                cache_ram=1 << 30,
                cache_ram_unit=1,
                n_ctx_checkpoints=8,
                checkpoint_min_step=64,
                n_batch=256,
                n_ubatch=64,
            )
            server = make_llama_server(sem, model_path(arch), params=params, n_ctx=1024, check_restores=False)
            try:
                prompt = tuple(3 + (i * 7) % 250 for i in range(n_tokens))
                server.handle_completion(prompt, id_slot=0, n_cmpl=1, n_predict=1)
                server.run_until_idle()
                slot = server.slots[0]
                cache = server.prompt_cache
                assert cache is not None
                n_ckpt = len(slot.prompt.checkpoints)
                c_bytes = sum(c.size() for c in slot.prompt.checkpoints)
                path = f"{tmp}/{sem}-save.bin"
                with memray.Tracker(path, native_traces=True):
                    slot.prompt_save(cache)
                save[sem] = int(memray.FileReader(path).metadata.peak_memory)
                op = server.host.last_op
                model_peak[sem] = op.peak_excess if op is not None else 0
                s_bytes = op.state_bytes if op is not None else 0
                tokens = slot.prompt.tokens
                slot.prompt_clear()
                path = f"{tmp}/{sem}-load.bin"
                with memray.Tracker(path, native_traces=True):
                    slot.prompt_load(cache, tokens)
                load[sem] = int(memray.FileReader(path).metadata.peak_memory)
            finally:
                close_server(server)
    return MemoryFigures(arch, n_tokens, n_ckpt, s_bytes, c_bytes, save, load, model_peak)


def draft_recovery_run(arch: str, *, recovery: bool = True) -> dict[str, Any]:
    """The proposed draft-KV recovery on real contexts: a draft of 256 cells shared by two slots.

    Slot 0 processes a 180-token prompt and goes idle; slot 1 then processes 200 tokens while
    slot 0 starts a second, shorter task: the draft runs out of cells mid-prompt, first with no idle
    slot to purge (the out-of-sync slot is cleared and re-processes), later with slot 0 idle again
    (purged, and the batch retried). No request may fail, target and draft must describe every
    slot's tokens afterwards, and a probe token decoded on every slot must give the logits of a
    fresh evaluation, on both contexts. With ``recovery=False`` the same requests run as upstream
    handles them (abort every processing slot) and only the failed requests are reported.
    """

    params = ServerParams(
        n_slots=2,
        cache_ram=0,
        kv_unified=True,
        n_batch=64,
        n_ubatch=32,
        n_draft_max=2,
        draft_recovery=recovery,
        n_ctx_checkpoints=4,
    )
    server = make_llama_server(
        "shared", model_path(arch), draft_model=draft_path(), params=params, n_ctx=2048, n_ctx_dft=256
    )
    try:
        a = tuple(3 + (i * 11) % 250 for i in range(180))
        b = tuple(3 + (i * 13) % 250 for i in range(200))
        server.handle_completion(a, id_slot=0, n_cmpl=1, n_predict=3)
        server.run_until_idle()
        server.handle_completion(b, id_slot=1, n_cmpl=1, n_predict=3)
        server.handle_completion((*a[:60], 9, 9, 9), id_slot=0, n_cmpl=1, n_predict=2)
        server.run_until_idle()
        if not recovery:
            return {"arch": arch, "errors": list(server.errors)}
        inv.check_draft_recovery(server)
        inv.check_draft_in_step(server)
        verified = 0
        for slot in server.slots:
            for ctx in (server.ctx_tgt, server.ctx_dft):
                if not ctx.verify(slot.id, "after draft recovery"):  # type: ignore[union-attr]
                    raise RuntimeError(ctx.mismatches[-1].line())  # type: ignore[union-attr]
                verified += 1
        return {
            "arch": arch,
            "recoveries": dict(server.draft_recoveries),
            "errors": list(server.errors),
            "verified": verified,
            "layout_diffs": sum(len(c.layout_diffs) for c in (server.ctx_tgt, server.ctx_dft)),  # type: ignore[union-attr,misc]
        }
    finally:
        close_server(server)
