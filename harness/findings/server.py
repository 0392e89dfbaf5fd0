"""Known findings of a real llama-server (server backend)."""

from __future__ import annotations

from harness.findings.record import Finding

__all__ = [
    "CACHE_REUSE_RECURRENT_STALE",
    "CHECKPOINT_ALLOC_TERMINATES",
    "CLEARED_SLOT_KEEPS_CHECKPOINTS",
    "CONCURRENT_OUTPUT_DIVERGENCE",
    "DECODE_EXCEPTION_KEEPS_SLOT_TOKENS",
    "FAULT_BATCH_ASSERT",
    "GREEDY_FLIP_ON_CACHE_PATH",
    "IDLE_STATELESS_SLOT_CACHED",
    "LFM2_POOLED_COMPLETION_SEGV",
    "SERVER",
    "SLOT_ACTION_BAD_BODY_500",
    "SLOT_FILE_FOLLOWS_SYMLINK",
    "SLOT_RESTORE_ACCEPTS_FOREIGN_TOKENS",
    "SLOT_RESTORE_DROPS_CHECKPOINTS",
    "SLOT_RESTORE_STALE_DRAFT",
    "SLOT_RESTORE_TRUNCATED_FILE_ABORT",
    "SLOT_SAVE_FAILURE_ANSWERED_200",
    "SLOT_SAVE_PARTIAL_FILE",
    "SLOT_SAVE_SILENT_TRUNCATION",
]

# ---- a real llama-server (server backend) ----
GREEDY_FLIP_ON_CACHE_PATH = Finding(
    "greedy-flip-on-cache-path",
    "server",
    "output_equivalence",
    "a near-tie greedy choice flips on the cache path (batch shape, not the cache's state)",
    "fixtures/findings/kv_layout_logits.py",
    detail=(
        "a prompt served partly from a slot, the cache or a checkpoint is evaluated in other batch "
        "shapes and cell layouts than from scratch; where the two best tokens are within "
        "0.02 logprob the greedy choice can differ from a fresh server's "
        "(the same root cause as kv-layout-dependent-logits). Traced and replayed (python -m harness trace record "
        "--sequential: the reproducer's 12 requests one at a time on -np 1 --cache-ram 8, 6 seeds, prompts loaded "
        "from the cache in 4): the calls are consistent and replay to the server's logits bit for bit; against a "
        "fresh evaluation of the same tokens the served logits move by up to 0.086 (the top-10 margins by up to "
        "0.041) with flash attention on (auto), by at most 2.9e-6 with -fa off, cache loads included: the batch-"
        "shape nondeterminism of CPU flash attention (ggml-cpu/ops.cpp:9547-9569), as concurrent-output-"
        "divergence, not the cache's state; under load a flip within BATCH_SHAPE_FLIP_GAP with cache_n > 0"
    ),
)

CONCURRENT_OUTPUT_DIVERGENCE = Finding(
    "concurrent-output-divergence",
    "server",
    "output",
    "concurrent requests sometimes get answers a sequential run never gives (batch shape)",
    "fixtures/findings/concurrent_output_divergence.py",
    detail=(
        "under concurrent requests llama-server (-np 2, with or without the prompt cache, unified or per-slot KV) "
        "sometimes answers a prompt unlike a sequential evaluation of it on models with attention layers; pure "
        "recurrent (mamba) never showed it. Traced and replayed (python -m harness trace; 66 rounds of the "
        "reproducer's workload on llama, gemma2, jamba): the server's libllama calls are consistent (no wrong "
        "seq_id, position or missing seq_rm) and their replay in one process gives the server's logits bit for "
        "bit, so it is neither the server's use of libllama nor a race; it is batch-shape nondeterminism in "
        "libllama's CPU flash attention (on by default: flash_attn auto): a query row is computed by the tiled "
        "f32 kernel when its ubatch holds >= GGML_FA_TILE_Q rows of it, else by the one-row kernel that rounds Q "
        "to f16 and accumulates V in f16 (ggml-cpu/ops.cpp:9547-9569, :8941-8942, :9007), so one sequence's "
        "logits move with how its tokens share batches: up to 0.05-0.08 for the same prompt evaluated whole or "
        "token by token on one sequence, 5e-5 with flash attention off and f32 KV. Measured again on 51 traced "
        "concurrent runs (python -m harness concurrent --keep-traces, every configuration, ~36,000 reads): "
        "|server - fresh| up to 0.196 and margin shifts up to llama 0.179, gemma2 0.077, jamba 0.063, lfm2 0.022, "
        "mamba 2e-5; flips seen at gaps 0.003-0.039, the served token the fresh second best; the flipped token "
        "then stays in the slot. Under load a divergence is this finding only as a flip within "
        "BATCH_SHAPE_FLIP_GAP of its model with cache_n = 0 (harness.load.outputs.Divergences). A real "
        "divergence shrunk by python -m harness trace shrink (191 calls to 3) is fixtures/findings/batch_shape_flip.py "
        "on plain llama-cpp-python: one sequence whose last prompt row is decoded in a ubatch of its own (63 + 1) "
        "answers the fresh second best with flash attention on, the fresh answer with it off"
    ),
)

FAULT_BATCH_ASSERT = Finding(
    "fault-batch-assert",
    "server",
    "native_fault",
    "a failed host allocation under load once hit GGML_ASSERT in update_slots",
    "fixtures/findings/fault_half_built_batch_assert.py",
    detail=(
        "under sustained load a failed host allocation (native shim, >= 16 KiB) once aborted llama-server with "
        "GGML_ASSERT(batch.slot_batched || batch.size() == 0) right after pre_decode() in update_slots "
        "(server-context.cpp:2826 of the PR build): a batch holding tokens for no slot; 1 of 66 fault trials"
    ),
)

DECODE_EXCEPTION_KEEPS_SLOT_TOKENS = Finding(
    "decode-exception-keeps-slot-tokens",
    "server",
    "output",
    "a slot keeps the tokens of a batch whose decode threw: wrong output, no error",
    "fixtures/findings/decode_exception_keeps_slot_tokens.py",
    detail=(
        "when decode() throws (a std::bad_alloc out of llama_decode), update_slots' catch calls abort_all_slots, "
        "which releases every processing slot without prompt_clear(): the slot keeps the failed batch's tokens "
        "although its memory never got them, the next request sharing the prefix reuses them (cache_n counts "
        "them) and the slot is saved to the prompt cache as that prompt: wrong output, no error "
        "(server-context.cpp:2870-2875, 2735-2742; decode()'s own error path clears the slots, :3693-3700)"
    ),
)

CHECKPOINT_ALLOC_TERMINATES = Finding(
    "checkpoint-alloc-terminates",
    "server",
    "native_fault",
    "a bad_alloc while creating a context checkpoint terminates llama-server",
    detail=(
        "a std::bad_alloc while creating a context checkpoint (common_prompt_checkpoint::update_tgt, "
        "outside any try in update_slots) terminates llama-server, with or without PR #27451 (out of its scope)"
    ),
)

SLOT_FILE_FOLLOWS_SYMLINK = Finding(
    "slot-file-follows-symlink",
    "server",
    "slot_file_confined",
    "slot save/restore follows a symlink in the save directory",
    "fixtures/findings/slot_file_symlink_escape.py",
    upstream="tools/server/server-context.cpp:5279, 5315; src/llama-mmap.cpp:220",
    detail=(
        "POST /slots/{id}?action=save|restore opens --slot-save-path + filename with fopen, which follows a "
        "symlink in the save directory: a name fs_validate_filename accepts (one component, no '..') writes the "
        "slot file through the link to any path the server's user can write (truncating it; a dangling link "
        "creates its target) and restore opens and reads the link's target, a directory included (server-context."
        "cpp:5279, 5315 build the path; :2555, :2599 save/load it; src/llama-context.cpp:3324, 3378 -> "
        "src/llama-mmap.cpp:195, 220 -> ggml/src/ggml.c:627, no O_NOFOLLOW, no realpath check). Needs someone who can "
        "create a symlink in the save directory (the HTTP API cannot: names are one component and only regular "
        "files are written); Linux's fs.protected_symlinks stops it only in a sticky world-writable directory "
        "for a link owned by another user"
    ),
    takes_binary=True,
)

SLOT_ACTION_BAD_BODY_500 = Finding(
    "slot-action-bad-body-500",
    "server",
    "bad_name_4xx",
    "a malformed slot action body is answered 500 instead of 400",
    "fixtures/findings/slot_action_bad_body_500.py",
    upstream="tools/server/server.cpp:64-67; tools/server/server-context.cpp:5273-5274, 5309-5310",
    detail=(
        "POST /slots/{id}?action=save|restore answers a client's malformed body with 500 server_error instead of "
        '400: json::parse and .at("filename") (server-context.cpp:5273-5274, 5309-5310) throw nlohmann '
        "exceptions, which are no std::invalid_argument, so ex_wrapper maps them to ERROR_TYPE_SERVER "
        "(server.cpp:64-67): a filename with a lone surrogate escape or bytes that are not UTF-8 (overlong '/' "
        "and '.'), a raw control byte, no filename, a filename that is not a string, a body that is not JSON"
    ),
    takes_binary=True,
)

CLEARED_SLOT_KEEPS_CHECKPOINTS = Finding(
    "cleared-slot-keeps-checkpoints",
    "server",
    "cleared_checkpoints",
    "clearing a slot empties its prompt's tokens but keeps its context checkpoints (older builds)",
    "fixtures/findings/cleared_slot_keeps_checkpoints.py",
    upstream="tools/server/server-context.cpp:255-268 at b9780 (server_slot::prompt_clear)",
    detail=(
        "(report: fixtures/findings/cleared_slot_keeps_checkpoints.md) prompt_clear removes the slot's sequence and "
        "clears prompt.tokens only, so the checkpoints of the prompt it held stay; the next prompt on the slot walks "
        "them (\"erased invalidated context checkpoint\") and a restore could take one of other tokens. Found by the "
        "server gate's drawn configurations on b9780 from the log alone; 0c1e570 clears the whole prompt"
    ),
    takes_binary=True,
)

IDLE_STATELESS_SLOT_CACHED = Finding(
    "idle-stateless-slot-cached",
    "server",
    "stateless_not_cached",
    "an idle embedding or rerank slot is saved to the prompt cache as a completion's",
    "fixtures/findings/idle_stateless_slot_cached.py",
    upstream="tools/server/server-context.cpp:2419-2432 (the slot's task_prev, :223, :350, is not consulted)",
    detail=(
        "the idle-slot loop run after launching any task (server-context.cpp:2419-2432, --cache-idle-slots, on by "
        "default) saves every idle slot to the RAM prompt cache whatever its last task was: the state an embedding "
        "or rerank task left (never reused: is_stateless_task, :3196-3198) fills the cache up to --cache-ram; a "
        "completion taking such a slot by LRU saves it too (:1616-1628). Measured on the fixtures' llama, 2 slots: "
        "100 /embeddings calls alone leave 99 entries (2.567 MiB, 26 KiB per 101-token call); none with "
        "--no-cache-idle-slots"
    ),
    takes_binary=True,
)

LFM2_POOLED_COMPLETION_SEGV = Finding(
    "lfm2-pooled-completion-segv",
    "server",
    "crash",
    "an LFM2 server with pooling dies (SIGSEGV) on any completion",
    "fixtures/findings/lfm2_pooled_completion_segv.py",
    upstream="src/models/lfm2.cpp:287; tools/server/server-context.cpp:2844",
    detail=(
        "an LFM2 server started with --rerank or --embeddings --pooling last|cls dies (SIGSEGV in "
        "ggml_gallocr_alloc_graph <- ggml_backend_sched_alloc_graph <- llama_context::process_ubatch) on any "
        "completion, which it does not refuse (server-context.cpp:2844 switches embeddings off for the batch); "
        "pooling mean/none and the other fixtures models answer. LFM2's graph alone depends on cparams.embeddings "
        "(src/models/lfm2.cpp:287)"
    ),
    takes_binary=True,
)

SLOT_SAVE_PARTIAL_FILE = Finding(
    "slot-save-partial-file",
    "server",
    "no_partial_file",
    "a slot save that fails mid-file leaves the partial file under its name",
    "fixtures/findings/slot_save_enospc.py",
    upstream="src/llama-context.cpp:3377-3395, 4354-4363; tools/server/server-context.cpp:2555-2561",
    detail=(
        "POST /slots/{id}?action=save that fails mid-file (ENOSPC, a write error) answers 500 'Unable to save slot' "
        "and leaves the bytes it wrote under the file's name (llama_file::write_raw throws, "
        "src/llama-mmap.cpp:363-366; "
        "llama_state_seq_save_file returns 0, src/llama-context.cpp:4354-4363; nothing unlinks the file): on a "
        "64 KiB tmpfs with 8 KiB free a 17,548-byte save leaves 8,192 bytes, and restoring it aborts the server"
    ),
)

SLOT_SAVE_SILENT_TRUNCATION = Finding(
    "slot-save-silent-truncation",
    "server",
    "no_partial_file",
    "a slot save on a full disk can answer 200 for a truncated file",
    "fixtures/findings/slot_save_enospc.py",
    upstream="src/llama-mmap.cpp:377-383; src/llama-context.cpp:3391",
    detail=(
        "POST /slots/{id}?action=save answers 200 with n_written the full size when the disk fills inside the last "
        "stdio buffer: fwrite only buffers it and llama_file's destructor closes the FILE without checking fclose "
        "(src/llama-mmap.cpp:358-366, 377-383), so the error is lost: 17,548 bytes reported, 16,384 on disk"
    ),
)

SLOT_SAVE_FAILURE_ANSWERED_200 = Finding(
    "slot-save-failure-answered-200",
    "server",
    "no_partial_file",
    "a slot save whose write failed answers 200 with n_written 0 (older builds)",
    "fixtures/findings/slot_save_failure_answered_200.py",
    upstream="tools/server/server-context.cpp:2006-2019 at b9093 (SERVER_TASK_TYPE_SLOT_SAVE)",
    detail=(
        "(report: fixtures/findings/slot_save_failure_answered_200.md) the save's result is sent whatever "
        "llama_state_seq_save_file returned: a write that failed (0) answers HTTP 200 \"n_written\": 0 and the bytes "
        "written stay under the file's name; 0c1e570 answers 500 'Unable to save slot' (server-context.cpp:2558). "
        "Found by the server gate's full-disk step on b9093 (no_partial_file: a 200 for a file of 0 bytes)"
    ),
    takes_binary=True,
)

SLOT_RESTORE_ACCEPTS_FOREIGN_TOKENS = Finding(
    "slot-restore-accepts-foreign-tokens",
    "server",
    "slot_file_restore",
    "a slot file holding a token outside the vocabulary is restored (older builds)",
    "fixtures/findings/slot_restore_accepts_foreign_tokens.py",
    upstream="tools/server/server-context.cpp:2040-2053 at b9093 (SERVER_TASK_TYPE_SLOT_RESTORE)",
    detail=(
        "(report: fixtures/findings/slot_restore_accepts_foreign_tokens.md) the restore puts the file's token list "
        "into the slot unchecked: a file whose list holds a token id past the vocabulary (1,000,000 on a 260-token "
        "vocabulary) answers 200 and the slot holds it, over a KV state of other tokens; 0c1e570 refuses it, 400 "
        "'Invalid tokens in slot save file' (server_tokens::validate, server-context.cpp:2616). Found by the server "
        "gate's edge step (foreign-files) on b9093; fixed between b10380 and b10405"
    ),
    takes_binary=True,
)

SLOT_RESTORE_TRUNCATED_FILE_ABORT = Finding(
    "slot-restore-truncated-file-abort",
    "server",
    "crash",
    "restoring a truncated slot file aborts llama-server",
    "fixtures/findings/slot_save_enospc.py",
    upstream="src/llama-mmap.cpp:270-280; src/llama-context.cpp:3365-3371",
    detail=(
        "POST /slots/{id}?action=restore of a slot file cut inside its state aborts llama-server: read_raw_unsafe "
        "clamps a read at the end of file and returns without an error (src/llama-mmap.cpp:270-280), the reader counts "
        "the bytes it asked for, and GGML_ASSERT(nread <= state_size) (src/llama-context.cpp:3370) fails (SIGABRT); "
        "the tensors were already set from the unread buffer. Any short file in --slot-save-path does it, e.g. one "
        "a failed save left (slot-save-partial-file, slot-save-silent-truncation)"
    ),
)

SLOT_RESTORE_DROPS_CHECKPOINTS = Finding(
    "slot-restore-drops-checkpoints",
    "server",
    "reuse",
    "a slot file holds no checkpoint: a restored slot recomputes what they held",
    "fixtures/findings/slot_restore_drops_checkpoints.py",
    upstream="tools/server/server-context.cpp:2555-2557, 2618-2619",
    detail=(
        "A slot file holds the tokens and the target's sequence state only: no context checkpoint (and no draft "
        "state) is written (llama_state_seq_save_file, server-context.cpp:2555) and restore clears the slot's "
        "checkpoints (slot->prompt.clear(), :2618; server-task.h:571-574), so a restored hybrid or recurrent slot "
        "reprocesses the whole prompt on the next request that diverges before its end: jamba and mamba, a 100-token "
        "prompt, the next diverging at 80: cache_n 0 after a restore, 32 on a slot that kept its checkpoints (with "
        "--cache-ram 8 too: the RAM cache holds the prompt with its checkpoints, but the restored slot matches 80 of "
        "88 tokens, f_keep >= 0.5, and the cache is never consulted)"
    ),
    takes_binary=True,
)

SLOT_RESTORE_STALE_DRAFT = Finding(
    "slot-restore-stale-draft",
    "server",
    "http_error",
    "a slot restore leaves the draft context with the previous prompt",
    "fixtures/findings/slot_restore_stale_draft.py",
    upstream="tools/server/server-context.cpp:2555-2557, 2596-2619",
    detail=(
        "With a draft model, POST /slots/{id}?action=restore loads the target context only (server-context.cpp:2555, "
        "2600-2603: the draft state is neither saved nor restored), so the draft sequence keeps the slot's previous "
        "prompt; the next completion fails with HTTP 500 'decode() failed: failed to process speculative batch' (the "
        "draft batch starts at the restored position, the draft memory ends at the old prompt: inconsistent "
        "sequence positions). After an erase the restore works, with an empty draft state"
    ),
    takes_binary=True,
)

CACHE_REUSE_RECURRENT_STALE = Finding(
    "cache-reuse-recurrent-stale",
    "server",
    "reuse_equivalence",
    "--cache-reuse on recurrent memory resumes from the old conversation's state",
    "fixtures/findings/cache_reuse_recurrent_stale.py",
    upstream="src/llama-memory-recurrent.cpp:716-719, 161-240, 318-346; tools/server/server-context.cpp:3210-3258",
    detail=(
        "--cache-reuse on a recurrent or hybrid model: llama_memory_can_shift answers true for recurrent memory "
        "(llama-memory-recurrent.cpp:716-719; hybrid :133-136), so the chunk loop (server-context.cpp:3219-3258) "
        "runs; its seq_rm(head_p, head_c) of a range short of the state's tail removes nothing and succeeds "
        "(recurrent-seq-rm-range-silent) and seq_add moves only the state's position, so when the last chunk "
        "reaches the old end the slot resumes from the recurrent state of the old, undeleted conversation: "
        "cache_n counts the deleted tokens as gone, the answer is the old conversation's, no error"
    ),
    takes_binary=True,
)

SERVER = [
    GREEDY_FLIP_ON_CACHE_PATH,
    CONCURRENT_OUTPUT_DIVERGENCE,
    FAULT_BATCH_ASSERT,
    DECODE_EXCEPTION_KEEPS_SLOT_TOKENS,
    CHECKPOINT_ALLOC_TERMINATES,
    SLOT_FILE_FOLLOWS_SYMLINK,
    SLOT_ACTION_BAD_BODY_500,
    IDLE_STATELESS_SLOT_CACHED,
    LFM2_POOLED_COMPLETION_SEGV,
    SLOT_SAVE_PARTIAL_FILE,
    SLOT_SAVE_SILENT_TRUNCATION,
    SLOT_RESTORE_TRUNCATED_FILE_ABORT,
    SLOT_RESTORE_DROPS_CHECKPOINTS,
    SLOT_RESTORE_STALE_DRAFT,
    CACHE_REUSE_RECURRENT_STALE,
    CLEARED_SLOT_KEEPS_CHECKPOINTS,
    SLOT_RESTORE_ACCEPTS_FOREIGN_TOKENS,
    SLOT_SAVE_FAILURE_ANSWERED_200,
]
