"""The gate's ``llama`` backend: the same state machines on real libllama state, one model per arch.

For each tiny fixtures model (``llama``, ``mamba``, ``jamba``, ``lfm2``, ``gemma2``) this runs

* the stateful machine of :mod:`properties.machine` on :class:`~harness.llama_provider.LlamaProvider`
  contexts (fewer examples than the synthetic backend; a draft model on the transformer and one
  hybrid), with ``restore_equivalence`` checked at the first decode after every restore, and
* one scenario at the model's full context (:func:`full_context_run`): the whole context decoded,
  its full and partial state saved, restored into another sequence, and the next token's logits
  compared bit for bit with a fresh evaluation; the state sizes at full context are reported.

Every mismatch fails the gate. A difference that disappears when the very same state is decoded
from a contiguous cell layout is not a mismatch but the known finding :data:`LAYOUT_FINDING`
(counted per model as ``layout_diffs``, reproducer in ``fixtures/findings/``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from fixtures.models import ARCHS, model_path
from harness.llama_provider import LlamaProvider, load_model
from harness.provider import STATE_SEQ_FLAGS_NONE, STATE_SEQ_FLAGS_PARTIAL_ONLY

from .machine import MachineConfig

__all__ = [
    "LAYOUT_FINDING",
    "LLAMA_PROFILES",
    "NATIVE_FINDINGS",
    "classify_native",
    "full_context_run",
    "llama_machines",
]


@dataclass(frozen=True)
class LlamaFinding:
    id: str
    title: str
    reproducer: str


LAYOUT_FINDING = LlamaFinding(
    "kv-layout-dependent-logits",
    "llama.cpp's logits depend on where a sequence's cells sit in the KV cache: after a seq_rm rollback "
    "(new tokens go to cells past the hole) or beside other sequences in a unified KV, the same state gives "
    "logits that differ in the last bits from a fresh evaluation, because attention (flash-attn or soft_max) "
    "reduces over all n_kv cells in cell order; the restored state itself is bit-identical",
    "fixtures/findings/kv_layout_logits.py",
)

NATIVE_FINDINGS: list[LlamaFinding] = [
    LlamaFinding(
        "state-io-alloc-outside-try",
        "llama_state_seq_get_data_ext/set_data_ext allocate their io object (std::make_unique) before the try "
        "that turns exceptions into a 0 return, so a bad_alloc there terminates the process instead of failing "
        "the call (src/llama-context.cpp:3204-3227); every later allocation in these calls is reported as 0",
        "fixtures/findings/state_io_alloc_outside_try.py",
    ),
    LlamaFinding(
        "decode-bad-alloc-terminates",
        "llama_decode has no catch: a std::bad_alloc from any allocation inside it (batch conversion, ubatch "
        "split, KV slot search, graph build, input masks) escapes the C API and terminates the process; "
        "llama-server's update_slots has no catch around it either (src/llama-context.cpp:4401)",
        "fixtures/findings/decode_bad_alloc_terminates.py",
    ),
    LlamaFinding(
        "graph-compute-segv",
        "two allocations inside ggml_graph_compute (ggml-cpu) are used without a NULL check: failing either "
        "crashes llama_decode with SIGSEGV",
        "fixtures/findings/graph_compute_segv.py",
    ),
]


def classify_native(op: str, group: dict[str, Any]) -> str | None:
    """The known finding a native-fault group belongs to, or None (an unexpected outcome: a gate failure)."""
    outcome, site = group["outcome"], group["site"]
    if op != "decode" and outcome == "aborted" and "state_seq_" in site:
        return "state-io-alloc-outside-try"
    if op == "decode" and outcome == "aborted":
        return "decode-bad-alloc-terminates"
    if op == "decode" and outcome == "crashed" and site.startswith("ggml_graph_compute"):
        return "graph-compute-segv"
    return None


# examples per machine and steps per example on real state
LLAMA_PROFILES: dict[str, dict[str, int]] = {
    "ci": {"max_examples": 150, "steps": 25},
    "fuzz": {"max_examples": 300, "steps": 40},
}


def llama_machines(variant: str, archs: Sequence[str] | None = None) -> list[MachineConfig]:
    """One machine per architecture; drafts on ``llama`` and ``jamba``, a unified KV on ``mamba``/``lfm2``.

    (A draft context cannot be made smaller than 256 cells per sequence in libllama, so the draft-KV
    exhaustion runs as its own scenario, :func:`draft_recovery_run`.)
    """
    out = []
    for arch in archs or ARCHS:
        out.append(
            MachineConfig(
                variant,
                kind="",
                arch=arch,
                draft=arch in ("llama", "jamba"),
                kv_unified=arch in ("mamba", "lfm2"),
            )
        )
    return out


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


def model_rows(
    archs: Sequence[str], machine_stats: dict[str, Any], full: dict[str, FullContextResult]
) -> list[dict[str, Any]]:
    """The ``"llama"`` list of the gate's JSON: one object per model."""
    rows = []
    for arch in archs:
        st = machine_stats.get(arch, {})
        fc = full.get(arch)
        rows.append(
            {
                "arch": load_model(model_path(arch)).arch,
                "state_bytes": max(st.get("state_bytes", 0), fc.state_bytes if fc else 0),
                "partial_bytes": max(st.get("partial_bytes", 0), fc.partial_bytes if fc else 0),
                "restore_checks": st.get("restore_checks", 0) + (fc.restore_checks if fc else 0),
                "mismatches": st.get("mismatches", 0) + (len(fc.mismatches) if fc else 0),
                "layout_diffs": st.get("layout_diffs", 0),
                "restores_by": _merge(
                    {k.split(":", 1)[1]: v for k, v in st.items() if k.startswith("restores_by:")},
                    fc.restores_by if fc else {},
                ),
                "full_context": None
                if fc is None
                else {
                    "n_ctx": fc.n_ctx,
                    "state_bytes": fc.state_bytes,
                    "partial_bytes": fc.partial_bytes,
                    "seconds": round(fc.seconds, 3),
                },
            }
        )
    return rows


def _merge(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: a.get(k, 0) + b.get(k, 0) for k in sorted(set(a) | set(b))}


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

    from harness.build import close_server, make_llama_server
    from harness.server import ServerParams

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
    from fixtures.models import draft_path
    from harness.build import close_server, make_llama_server
    from harness.server import ServerParams

    from . import invariants as inv

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
            "layout_diffs": sum(len(c.layout_diffs) for c in (server.ctx_tgt, server.ctx_dft)),  # type: ignore[union-attr]
        }
    finally:
        close_server(server)
