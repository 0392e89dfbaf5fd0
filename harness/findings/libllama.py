"""Known findings of libllama (llama backend) and of its memory API against its own contract
(``python -m harness contract``)."""

from __future__ import annotations

from harness.findings.record import ContractCondition, Finding

__all__ = [
    "CACHE_LOAD_INTO_PENDING_CHILD_COPY",
    "DECODE_BAD_ALLOC_TERMINATES",
    "DRAFT_KV_EXHAUSTION_REAL_STATE",
    "GRAPH_COMPUTE_SEGV",
    "KV_LAYOUT_DEPENDENT_LOGITS",
    "LIBLLAMA",
    "RECURRENT_SEQ_CP_IGNORES_RANGE",
    "RECURRENT_SEQ_RM_ALL_ABORT",
    "RECURRENT_SEQ_RM_ANY_SEQ_REFUSED",
    "RECURRENT_SEQ_RM_RANGE_SILENT",
    "SEQ_ADD_MOVES_SHARED_CELLS",
    "SEQ_KEEP_IGNORES_OTHER_STREAMS",
    "STATE_GET_MISSES_PENDING_SEQ_CP",
    "STATE_GET_MISSES_PENDING_SHIFT",
    "STATE_IO_ALLOC_OUTSIDE_TRY",
    "STATE_SET_LEAKS_INTO_PENDING_SEQ_CP",
    "SWA_PREPARE_PURGE_NOT_UNDONE",
    "SWA_RESTORE_WINDOW_SHORT",
]

# the fixtures models (fixtures/gguf.py ARCHS), by memory kind, for the contract's conditions
_TRANSFORMERS = frozenset({"llama", "gemma2"})
_HYBRIDS = frozenset({"jamba", "lfm2"})
_RECURRENT = frozenset({"mamba", "jamba", "lfm2"})

# ---- libllama (llama backend) ----
KV_LAYOUT_DEPENDENT_LOGITS = Finding(
    "kv-layout-dependent-logits",
    "llama",
    "restore_equivalence",
    "logits depend on where a sequence's cells sit in the KV cache",
    "fixtures/findings/kv_layout_logits.py",
    detail=(
        "llama.cpp's logits depend on where a sequence's cells sit in the KV cache: after a seq_rm rollback "
        "(new tokens go to cells past the hole) or beside other sequences in a unified KV, the same state gives "
        "logits that differ in the last bits from a fresh evaluation, because attention (flash-attn or soft_max) "
        "reduces over all n_kv cells in cell order; the restored state itself is bit-identical"
    ),
)

CACHE_LOAD_INTO_PENDING_CHILD_COPY = Finding(
    "cache-load-into-pending-child-copy",
    "llama",
    "restore_equivalence",
    "a state restored before a deferred cross-stream seq_cp is overwritten by it",
    "fixtures/findings/cache_load_into_pending_child_copy.py",
    detail=(
        "with a per-slot KV (no --kv-unified), seq_cp between streams defers the K/V buffer copy to the next "
        "llama_decode (src/llama-kv-cache.cpp:494-536, run at llama-context.cpp:1809); a state restored "
        "before then (set_data runs no update, llama-context.cpp:3223-3260) into the destination is "
        "overwritten by the source's buffer: llama-server's n_cmpl child copy (server-context.cpp:695-696), "
        "the child released with n_predict = 1, then a cache load or checkpoint restore into its slot gives "
        "wrong logits with no error (how the server reaches the contract finding state-set-leaks-into-pending-seq-cp)"
    ),
)

SWA_RESTORE_WINDOW_SHORT = Finding(
    "swa-restore-window-short",
    "llama",
    "restore_equivalence",
    "a restored SWA checkpoint lacks the oldest cells of a re-evaluated token's window",
    "fixtures/findings/swa_restore_window_short.py",
    detail=(
        "a restored SWA checkpoint (or loaded cache entry) holds the cells its next position needs, not those of "
        "its own pos_max, yet the server re-evaluates a token at or below that pos_max: the restore moves pos_next "
        "back to the checkpoint's pos_max (server-context.cpp:3354) after testing pos_min against the threshold of "
        "the earlier pos_next (:3278, 3331-3344), and a request with no new token steps back one more "
        "([TAG_PROMPT_LOGITS], :3383-3388); the re-evaluated token attends without the oldest position of its "
        "window: wrong logits and a wrong answer on the real server, master and PR alike, no error (the soak on "
        "gemma2 shows 72 such decodes in 50 s; fixtures/findings/swa_restore_window_short_libllama.py is the "
        "10-call shrink of one, on plain llama-cpp-python; the TODO at 2339-2341; src/llama-kv-cache.cpp:1057, 2094)"
    ),
)

DRAFT_KV_EXHAUSTION_REAL_STATE = Finding(
    "draft-kv-exhaustion (real state)",
    "llama",
    "draft_recovery",
    "a draft context out of KV room fails every processing request",
    detail=(
        "a draft context without room for a batch the target took fails every processing request "
        "(abort_all_slots, server-context.cpp:3731); the purge/retry/resync recovery proposed in the PR's "
        "discussion serves them instead"
    ),
)

STATE_IO_ALLOC_OUTSIDE_TRY = Finding(
    "state-io-alloc-outside-try",
    "llama",
    "native_fault",
    "state_seq_get/set_data allocate before their try: a bad_alloc terminates",
    "fixtures/findings/state_io_alloc_outside_try.py",
    detail=(
        "llama_state_seq_get_data_ext/set_data_ext allocate their io object (std::make_unique) before the try "
        "that turns exceptions into a 0 return, so a bad_alloc there terminates the process instead of failing "
        "the call (src/llama-context.cpp:3204-3227); every later allocation in these calls is reported as 0"
    ),
)

DECODE_BAD_ALLOC_TERMINATES = Finding(
    "decode-bad-alloc-terminates",
    "llama",
    "native_fault",
    "llama_decode has no catch: a bad_alloc inside it terminates the process",
    "fixtures/findings/decode_bad_alloc_terminates.py",
    detail=(
        "llama_decode has no catch: a std::bad_alloc from any allocation inside it (batch conversion, ubatch "
        "split, KV slot search, graph build, input masks) escapes the C API and terminates the process; "
        "llama-server's update_slots has no catch around it either (src/llama-context.cpp:4401)"
    ),
)

GRAPH_COMPUTE_SEGV = Finding(
    "graph-compute-segv",
    "llama",
    "native_fault",
    "two allocations in ggml_graph_compute are used unchecked: a failed one is a SIGSEGV",
    "fixtures/findings/graph_compute_segv.py",
    detail=(
        "two allocations inside ggml_graph_compute (ggml-cpu) are used without a NULL check: failing either "
        "crashes llama_decode with SIGSEGV"
    ),
)

# ---- libllama's memory API against its own contract (python -m harness contract) ----
SEQ_KEEP_IGNORES_OTHER_STREAMS = Finding(
    "seq-keep-ignores-other-streams",
    "contract",
    "pos-max",
    "seq_keep with a per-slot KV leaves the other streams' sequences in place",
    "fixtures/findings/seq_keep_per_slot_kv.py",
    upstream="src/llama-kv-cache.cpp:551",
    condition=ContractCondition("seq_keep", "per_slot_kv", _TRANSFORMERS | _HYBRIDS, kv_unified=False),
    detail=(
        "llama_memory_seq_keep with a per-slot KV (kv_unified false) only clears cells in seq_id's own stream: "
        "the other sequences keep their tokens (transformers: seq_pos_max unchanged; hybrids: the attention "
        "cells survive while the recurrent part is cleared, so the next decode attends to stale cells)"
    ),
)

RECURRENT_SEQ_RM_ANY_SEQ_REFUSED = Finding(
    "recurrent-seq-rm-any-seq-refused",
    "contract",
    "seq-rm-whole",
    "seq_rm(-1, -1, -1) is refused on recurrent and hybrid memory",
    "fixtures/findings/recurrent_seq_rm_any_seq.py",
    upstream="src/llama-memory-recurrent.cpp:172 (and src/llama-memory-hybrid.cpp:146)",
    condition=ContractCondition("seq_rm_all", "any_seq", _RECURRENT),
    detail=(
        "llama_memory_seq_rm(mem, -1, -1, -1) returns false and removes nothing on recurrent and hybrid memory: "
        "the recurrent seq_rm rejects seq_id -1 as >= n_seq_max before its own branch for negative ids, "
        "although llama.h says removing a whole sequence never fails and seq_id < 0 matches any sequence"
    ),
)

RECURRENT_SEQ_RM_RANGE_SILENT = Finding(
    "recurrent-seq-rm-range-silent",
    "contract",
    "success-changes-state",
    "seq_rm of a range short of the tail returns true and removes nothing (recurrent)",
    "fixtures/findings/recurrent_seq_rm_range_silent.py",
    upstream="src/llama-memory-recurrent.cpp:194 (test), :218-246 (no cell matches, returns true)",
    condition=ContractCondition("seq_rm_range", "recurrent_not_tail", _RECURRENT),
    detail=(
        "llama_memory_seq_rm of a range that ends before the tail (a prefix or a middle range) returns true on "
        "recurrent memory and removes nothing from the recurrent state (the refusal test only covers ranges "
        "that contain the tail cell); a hybrid then removes the attention cells, so its parts disagree"
    ),
)

SEQ_ADD_MOVES_SHARED_CELLS = Finding(
    "seq-add-moves-shared-cells",
    "contract",
    "pos-max",
    "seq_add shifts cells seq_cp made shared: every sharing sequence moves",
    "fixtures/findings/seq_add_moves_shared_cells.py",
    upstream="src/llama-kv-cache.cpp:606-607 (pos_add on shared cells), src/llama-memory-recurrent.cpp:342",
    condition=ContractCondition("seq_add", "shared_cells", _TRANSFORMERS | _HYBRIDS | _RECURRENT),
    detail=(
        "llama_memory_seq_add shifts cells that seq_cp made shared (one KV stream, or a recurrent tail cell), "
        "so every sequence sharing them is shifted too, not only seq_id"
    ),
)

RECURRENT_SEQ_CP_IGNORES_RANGE = Finding(
    "recurrent-seq-cp-ignores-range",
    "contract",
    "cp-range",
    "seq_cp with a range copies the whole recurrent state",
    "fixtures/findings/recurrent_seq_cp_ignores_range.py",
    upstream="src/llama-memory-recurrent.cpp:249-284",
    condition=ContractCondition("seq_cp_prefix", "recurrent", _RECURRENT),
    detail=(
        "llama_memory_seq_cp with a range copies the whole recurrent state (p0/p1 are never used, and the void "
        "call cannot refuse): the destination silently gets the entire source history"
    ),
)

STATE_GET_MISSES_PENDING_SEQ_CP = Finding(
    "state-get-misses-pending-seq-cp",
    "contract",
    "next-decode-equals-fresh",
    "a state saved before a deferred cross-stream seq_cp holds stale K/V",
    "fixtures/findings/state_get_before_pending_seq_cp.py",
    upstream="src/llama-kv-cache.cpp:508-509 (copy deferred), "
    "src/llama-context.cpp:3443 (state written without update)",
    condition=ContractCondition("state_get", "unflushed_cp", _TRANSFORMERS | _HYBRIDS, kv_unified=False),
    detail=(
        "with a per-slot KV, seq_cp between streams defers the K/V buffer copy to the next decode; "
        "llama_state_seq_get_data_ext taken before that decode saves the destination's positions with the "
        "stale K/V of its stream, and the restored state gives wrong logits"
    ),
)

STATE_SET_LEAKS_INTO_PENDING_SEQ_CP = Finding(
    "state-set-leaks-into-pending-seq-cp",
    "contract",
    "next-decode-equals-fresh",
    "a state restored at either end of a pending cross-stream seq_cp is mixed up",
    "fixtures/findings/state_set_before_pending_seq_cp.py",
    upstream="src/llama-kv-cache.cpp:508-509 (copy deferred), src/llama-context.cpp:3223 (set_data without update)",
    condition=ContractCondition("state_set", "into_unflushed_cp", _TRANSFORMERS | _HYBRIDS, kv_unified=False),
    detail=(
        "with a per-slot KV, a state restored into either end of a cross-stream seq_cp before the next decode "
        "is mixed up by the deferred buffer copy: restored into the source, it is what the destination gets; "
        "restored into the destination, it is overwritten by the source's buffer"
    ),
)

STATE_GET_MISSES_PENDING_SHIFT = Finding(
    "state-get-misses-pending-shift",
    "contract",
    "next-decode-equals-fresh",
    "a state saved between seq_add and the next decode holds unrotated keys",
    "fixtures/findings/state_get_before_pending_shift.py",
    upstream="src/llama-context.cpp:3443 (state written without update), src/llama-kv-cache.cpp:2226 (new pos written)",
    condition=ContractCondition("state_get", "unflushed_shift", frozenset({"llama", "gemma2", "lfm2"})),
    detail=(
        "a state saved between llama_memory_seq_add and the next decode has the shifted positions but keys "
        "not yet rotated (the K-shift runs at the next decode); restored, it gives wrong logits"
    ),
)

SWA_PREPARE_PURGE_NOT_UNDONE = Finding(
    "swa-prepare-purge-not-undone",
    "contract",
    "next-decode-equals-fresh",
    "a multi-ubatch decode on an SWA cache purges cells its dry run does not undo",
    "fixtures/findings/swa_prepare_purge_not_undone.py",
    upstream="src/llama-kv-cache.cpp:751-811 (prepare saves and restores only the slot's cells, :785, :805), "
    ":1166-1177 (apply_ubatch's purge, seq_rm), :1057 (find_slot takes window-masked cells)",
    condition=ContractCondition("decode", "swa_ubatches_differ", frozenset({"gemma2"})),
    detail=(
        "llama_decode of a batch longer than n_ubatch on a sliding-window cache places all its ubatches in a "
        "dry run first (llama_kv_cache::prepare) and undoes only the cells of each ubatch's slot; when a later "
        "ubatch is given a window-masked cell of its sequence, apply_ubatch purges that sequence's positions "
        "below it and the purge is not undone, so the earlier ubatches of the same call are computed without "
        "positions still inside their window: wrong K/V and logits (about 10 % of the largest logit on gemma2), "
        "where the same ubatches as separate llama_decode calls are right"
    ),
)

RECURRENT_SEQ_RM_ALL_ABORT = Finding(
    "recurrent-seq-rm-all-abort",
    "contract",
    "libllama_abort",
    "after seq_rm(-1, -1, -1) on a recurrent memory the next decode aborts (b9093 to b10280)",
    "fixtures/findings/recurrent_seq_rm_all_abort.py",
    upstream="src/llama-memory-recurrent.cpp:575 at b10280 (find_slot: GGML_ASSERT(cell.has_seq_id(seq_id)))",
    detail=(
        "on upstream's builds b9093 to b10280, llama_memory_seq_rm(mem, -1, -1, -1) on a recurrent memory succeeds "
        "and clears every cell's sequences but leaves each sequence's tail on its old cell; the next llama_decode of "
        "that sequence takes the tail in find_slot and asserts GGML_ASSERT(cell.has_seq_id(seq_id)): the process "
        "aborts. Found by the contract machine on b10280's own libllama (three calls: a decode, the seq_rm, a "
        "decode); b11434, b11549 and the pinned commit refuse seq_rm(-1, ...) instead "
        "(recurrent-seq-rm-any-seq-refused), so it was fixed between b10280 and b11434"
    ),
    takes_binary=True,
)

LIBLLAMA = [
    KV_LAYOUT_DEPENDENT_LOGITS,
    CACHE_LOAD_INTO_PENDING_CHILD_COPY,
    SWA_RESTORE_WINDOW_SHORT,
    DRAFT_KV_EXHAUSTION_REAL_STATE,
    STATE_IO_ALLOC_OUTSIDE_TRY,
    DECODE_BAD_ALLOC_TERMINATES,
    GRAPH_COMPUTE_SEGV,
    SEQ_KEEP_IGNORES_OTHER_STREAMS,
    RECURRENT_SEQ_RM_ANY_SEQ_REFUSED,
    RECURRENT_SEQ_RM_RANGE_SILENT,
    SEQ_ADD_MOVES_SHARED_CELLS,
    RECURRENT_SEQ_CP_IGNORES_RANGE,
    STATE_GET_MISSES_PENDING_SEQ_CP,
    STATE_SET_LEAKS_INTO_PENDING_SEQ_CP,
    STATE_GET_MISSES_PENDING_SHIFT,
    SWA_PREPARE_PURGE_NOT_UNDONE,
    RECURRENT_SEQ_RM_ALL_ABORT,
]
