"""The one registry of known findings: suspected upstream bugs the gate reports and does not fail on.

A :class:`Finding` names the property it violates, the backend that sees it, where upstream's code
is at fault (file:line at 0c1e570 unless said otherwise) and, where one exists, the standalone
reproducer under ``fixtures/findings/`` that exits 1 while the bug is present. Each backend decides
*whether* a run shows a finding (matched by the violated property and the state that makes it, never
by a broad tolerance); this table says *what* each one is, once. :meth:`Finding.entry` renders the
``known_findings`` row of the gate's JSON. The contract machine's findings also say where upstream is
at fault (``upstream``) and the state that shows them (:class:`ContractCondition`).

Imports nothing of the project: every floor may use it.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["BATCH_SHAPE_FLIP_GAP", "FINDINGS", "ContractCondition", "Finding", "finding"]

#: Per model, the widest gap a greedy choice can flip across by batch shape alone (issue #41): at the first
#: token a server's answer differs from a fresh single-slot server's, the fresh server's logprob of its best
#: token minus that of the token served. Measured with ``python -m harness trace`` on 51 traced runs of
#: ``python -m harness concurrent`` (seeds 1 and 2, every configuration, ~36,000 logits reads): every
#: replay gave the server's logits bit for bit and no call was inconsistent, and the widest shift of the
#: margin between a fresh evaluation's best token and any of its top 10 was llama 0.179, gemma2 0.077,
#: jamba 0.063, lfm2 0.022 (flash attention's two kernels, ggml-cpu/ops.cpp:9547-9569), mamba 2e-5; the
#: bound is that, rounded up. The flips seen were narrower (0.003-0.039; 0.0142 at most on 2-16 token
#: answers). No entry (mamba: no attention layer): no flip is excused. The one condition under which an
#: output divergence is excused as ``concurrent-output-divergence`` or ``greedy-flip-on-cache-path``.
BATCH_SHAPE_FLIP_GAP: dict[str, float] = {"llama": 0.18, "gemma2": 0.08, "jamba": 0.07, "lfm2": 0.03}


@dataclass(frozen=True)
class ContractCondition:
    """The state in which the contract machine (``properties/libllama_contract.py``) shows a finding.

    The machine tags each call with the conditions that hold (``seq_rm_range`` of a recurrent
    memory's range short of the tail is ``seq_rm_range:recurrent_not_tail``); a violation is this
    finding when a call since the last check carries ``op:tag``, on one of ``archs``, with the KV mode
    ``kv_unified`` (None: either).
    """

    op: str
    tag: str
    archs: frozenset[str]
    kv_unified: bool | None = None

    def matches(self, arch: str, kv_unified: bool, tags: Iterable[str]) -> bool:
        if arch not in self.archs:
            return False
        if self.kv_unified is not None and kv_unified != self.kv_unified:
            return False
        return f"{self.op}:{self.tag}" in set(tags)


@dataclass(frozen=True)
class Finding:
    """A suspected upstream bug: ``id`` is its name everywhere (JSON, reproducer, replay lines)."""

    id: str
    backend: str  # "synthetic" | "llama" | "server" | "llama-cpp-python-cache" | "contract" (harness contract)
    property: str  # the property it violates
    title: str
    reproducer: str | None = None  # path of the standalone reproducer, relative to the repository
    scope: tuple[str, ...] = ()  # where it applies, when narrower than the backend (e.g. the cache kind)
    upstream: str | None = None  # where upstream's code is at fault, file:line at 0c1e570, when not in the title
    condition: ContractCondition | None = None  # the contract machine's: the state that shows it

    def entry(self, machine: str, status: str, **extra: Any) -> dict[str, Any]:
        """The ``known_findings`` row: id, title, machine, reproducer (if any), status, then ``extra``."""
        row: dict[str, Any] = {"id": self.id, "title": self.title, "machine": machine}
        if self.reproducer is not None:
            row["reproducer"] = self.reproducer
        row["status"] = status
        row.update(extra)
        return row


# the fixtures models (fixtures/models.py ARCHS), by memory kind, for the contract's conditions
_TRANSFORMERS = frozenset({"llama", "gemma2"})
_HYBRIDS = frozenset({"jamba", "lfm2"})
_RECURRENT = frozenset({"mamba", "jamba", "lfm2"})

_ALL = [
    # ---- the model's machines (synthetic backend): upstream's logic, modelled ----
    Finding(
        "busy-slot-by-id",
        "synthetic",
        "busy_slot_untouched",
        "get_available_slot saves/loads the cache into a slot that is processing when the request names "
        "that slot by id (server-context.cpp:1532-1633, with slot_prompt_similarity != 0); on the real server "
        "the request being generated in that slot goes on from the loaded prompt: a wrong answer, no error",
        "fixtures/findings/busy_slot_by_id_server.py",
    ),
    Finding(
        "busy-slot-by-id-livelock",
        "server",
        "request_error",
        "as busy-slot-by-id, but the named slot is still processing its prompt and the prompt loaded into it is at "
        "least as long: the prompt loop has nothing to add and re-creates ('supersedes') the same checkpoint every "
        "iteration; the server spins, the request never answers and the request naming the slot stays deferred until "
        "a client gives up (server-context.cpp:1534-1628, 3441-3530)",
        "fixtures/findings/busy_slot_by_id_livelock.py",
    ),
    Finding(
        "draft-kv-exhaustion",
        "synthetic",
        "draft_in_step",
        "a draft context with less KV room than the target: a cache load whose draft restore fails after the "
        "target restore succeeded leaves the entry without its main state (server-task.cpp:1842-1856), and a "
        "draft decode failure aborts every slot without clearing it, leaving target and draft out of step "
        "(server-context.cpp:3731, 2735)",
    ),
    Finding(
        "swa-checkpoint-order",
        "synthetic",
        "checkpoint_lists",
        "a checkpoint with pos_max == pos_next survives invalidation (it erases only pos_max > pos_next), so "
        "after an SWA checkpoint restore (the slot resumes at pos_max) or after [TAG_PROMPT_LOGITS] decrements "
        "n_past of a request that is exactly pos_next tokens long, the next checkpoint is created below it and "
        "the list is no longer ascending in n_tokens (server-context.cpp:3339-3377, 3383-3388, 2290-2345)",
        "fixtures/findings/swa_checkpoint_order.py",
    ),
    Finding(
        "stale-checkpoint-after-miss",
        "synthetic",
        "restore_bytes",
        "a request sharing no token with the slot (n_past = 0) skips the checkpoint search and invalidation "
        "keeps pos_max <= 0, so the old prompt's checkpoint at n_tokens = 1 survives; a later request sharing "
        "a token restores it via `cur.pos_min == 0` and the recurrent/SWA state holds the old first token: "
        "wrong output, no error (server-context.cpp:3280, 3339-3342, 3355-3356, 3370-3377)",
        "fixtures/findings/stale_checkpoint_after_miss.py",
    ),
    # ---- libllama (llama backend) ----
    Finding(
        "kv-layout-dependent-logits",
        "llama",
        "restore_equivalence",
        "llama.cpp's logits depend on where a sequence's cells sit in the KV cache: after a seq_rm rollback "
        "(new tokens go to cells past the hole) or beside other sequences in a unified KV, the same state gives "
        "logits that differ in the last bits from a fresh evaluation, because attention (flash-attn or soft_max) "
        "reduces over all n_kv cells in cell order; the restored state itself is bit-identical",
        "fixtures/findings/kv_layout_logits.py",
    ),
    Finding(
        "cache-load-into-pending-child-copy",
        "llama",
        "restore_equivalence",
        "with a per-slot KV (no --kv-unified), seq_cp between streams defers the K/V buffer copy to the next "
        "llama_decode (src/llama-kv-cache.cpp:494-536, run at llama-context.cpp:1809); a state restored "
        "before then (set_data runs no update, llama-context.cpp:3223-3260) into the destination is "
        "overwritten by the source's buffer: llama-server's n_cmpl child copy (server-context.cpp:695-696), "
        "the child released with n_predict = 1, then a cache load or checkpoint restore into its slot gives "
        "wrong logits with no error (how the server reaches the contract finding state-set-leaks-into-pending-seq-cp)",
        "fixtures/findings/cache_load_into_pending_child_copy.py",
    ),
    Finding(
        "swa-restore-window-short",
        "llama",
        "restore_equivalence",
        "a request with no new token (the slot holds all of it) restores an SWA checkpoint with pos_max == "
        "pos_next (only pos_max > pos_next is skipped; its recorded pos_min is the memory's, 0, not what it holds), "
        "then [TAG_PROMPT_LOGITS] steps back one token; the checkpoint holds only the cells not masked for its "
        "pos_max, so the re-evaluated token attends without the oldest position of its window: wrong logits and "
        "a wrong answer on the real server, master and PR alike, no error (server-context.cpp:3277, 3331-3344, "
        "3383-3388, the TODO at 2339-2341; src/llama-kv-cache.cpp:2094)",
        "fixtures/findings/swa_restore_window_short.py",
    ),
    Finding(
        "draft-kv-exhaustion (real state)",
        "llama",
        "draft_recovery",
        "a draft context without room for a batch the target took fails every processing request "
        "(abort_all_slots, server-context.cpp:3731); the purge/retry/resync recovery proposed in the PR's "
        "discussion serves them instead",
    ),
    Finding(
        "state-io-alloc-outside-try",
        "llama",
        "native_fault",
        "llama_state_seq_get_data_ext/set_data_ext allocate their io object (std::make_unique) before the try "
        "that turns exceptions into a 0 return, so a bad_alloc there terminates the process instead of failing "
        "the call (src/llama-context.cpp:3204-3227); every later allocation in these calls is reported as 0",
        "fixtures/findings/state_io_alloc_outside_try.py",
    ),
    Finding(
        "decode-bad-alloc-terminates",
        "llama",
        "native_fault",
        "llama_decode has no catch: a std::bad_alloc from any allocation inside it (batch conversion, ubatch "
        "split, KV slot search, graph build, input masks) escapes the C API and terminates the process; "
        "llama-server's update_slots has no catch around it either (src/llama-context.cpp:4401)",
        "fixtures/findings/decode_bad_alloc_terminates.py",
    ),
    Finding(
        "graph-compute-segv",
        "llama",
        "native_fault",
        "two allocations inside ggml_graph_compute (ggml-cpu) are used without a NULL check: failing either "
        "crashes llama_decode with SIGSEGV",
        "fixtures/findings/graph_compute_segv.py",
    ),
    # ---- libllama's memory API against its own contract (python -m harness contract) ----
    Finding(
        "seq-keep-ignores-other-streams",
        "contract",
        "pos-max",
        "llama_memory_seq_keep with a per-slot KV (kv_unified false) only clears cells in seq_id's own stream: "
        "the other sequences keep their tokens (transformers: seq_pos_max unchanged; hybrids: the attention "
        "cells survive while the recurrent part is cleared, so the next decode attends to stale cells)",
        "fixtures/findings/seq_keep_per_slot_kv.py",
        upstream="src/llama-kv-cache.cpp:551",
        condition=ContractCondition("seq_keep", "per_slot_kv", _TRANSFORMERS | _HYBRIDS, kv_unified=False),
    ),
    Finding(
        "recurrent-seq-rm-any-seq-refused",
        "contract",
        "seq-rm-whole",
        "llama_memory_seq_rm(mem, -1, -1, -1) returns false and removes nothing on recurrent and hybrid memory: "
        "the recurrent seq_rm rejects seq_id -1 as >= n_seq_max before its own branch for negative ids, "
        "although llama.h says removing a whole sequence never fails and seq_id < 0 matches any sequence",
        "fixtures/findings/recurrent_seq_rm_any_seq.py",
        upstream="src/llama-memory-recurrent.cpp:172 (and src/llama-memory-hybrid.cpp:146)",
        condition=ContractCondition("seq_rm_all", "any_seq", _RECURRENT),
    ),
    Finding(
        "recurrent-seq-rm-range-silent",
        "contract",
        "success-changes-state",
        "llama_memory_seq_rm of a range that ends before the tail (a prefix or a middle range) returns true on "
        "recurrent memory and removes nothing from the recurrent state (the refusal test only covers ranges "
        "that contain the tail cell); a hybrid then removes the attention cells, so its parts disagree",
        "fixtures/findings/recurrent_seq_rm_range_silent.py",
        upstream="src/llama-memory-recurrent.cpp:194 (test), :218-246 (no cell matches, returns true)",
        condition=ContractCondition("seq_rm_range", "recurrent_not_tail", _RECURRENT),
    ),
    Finding(
        "seq-add-moves-shared-cells",
        "contract",
        "pos-max",
        "llama_memory_seq_add shifts cells that seq_cp made shared (one KV stream, or a recurrent tail cell), "
        "so every sequence sharing them is shifted too, not only seq_id",
        "fixtures/findings/seq_add_moves_shared_cells.py",
        upstream="src/llama-kv-cache.cpp:606-607 (pos_add on shared cells), src/llama-memory-recurrent.cpp:342",
        condition=ContractCondition("seq_add", "shared_cells", _TRANSFORMERS | _HYBRIDS | _RECURRENT),
    ),
    Finding(
        "recurrent-seq-cp-ignores-range",
        "contract",
        "cp-range",
        "llama_memory_seq_cp with a range copies the whole recurrent state (p0/p1 are never used, and the void "
        "call cannot refuse): the destination silently gets the entire source history",
        "fixtures/findings/recurrent_seq_cp_ignores_range.py",
        upstream="src/llama-memory-recurrent.cpp:249-284",
        condition=ContractCondition("seq_cp_prefix", "recurrent", _RECURRENT),
    ),
    Finding(
        "state-get-misses-pending-seq-cp",
        "contract",
        "next-decode-equals-fresh",
        "with a per-slot KV, seq_cp between streams defers the K/V buffer copy to the next decode; "
        "llama_state_seq_get_data_ext taken before that decode saves the destination's positions with the "
        "stale K/V of its stream, and the restored state gives wrong logits",
        "fixtures/findings/state_get_before_pending_seq_cp.py",
        upstream="src/llama-kv-cache.cpp:508-509 (copy deferred), "
        "src/llama-context.cpp:3443 (state written without update)",
        condition=ContractCondition("state_get", "unflushed_cp", _TRANSFORMERS | _HYBRIDS, kv_unified=False),
    ),
    Finding(
        "state-set-leaks-into-pending-seq-cp",
        "contract",
        "next-decode-equals-fresh",
        "with a per-slot KV, a state restored into either end of a cross-stream seq_cp before the next decode "
        "is mixed up by the deferred buffer copy: restored into the source, it is what the destination gets; "
        "restored into the destination, it is overwritten by the source's buffer",
        "fixtures/findings/state_set_before_pending_seq_cp.py",
        upstream="src/llama-kv-cache.cpp:508-509 (copy deferred), src/llama-context.cpp:3223 (set_data without update)",
        condition=ContractCondition("state_set", "into_unflushed_cp", _TRANSFORMERS | _HYBRIDS, kv_unified=False),
    ),
    Finding(
        "state-get-misses-pending-shift",
        "contract",
        "next-decode-equals-fresh",
        "a state saved between llama_memory_seq_add and the next decode has the shifted positions but keys "
        "not yet rotated (the K-shift runs at the next decode); restored, it gives wrong logits",
        "fixtures/findings/state_get_before_pending_shift.py",
        upstream="src/llama-context.cpp:3443 (state written without update), "
        "src/llama-kv-cache.cpp:2226 (new pos written)",
        condition=ContractCondition("state_get", "unflushed_shift", frozenset({"llama", "gemma2", "lfm2"})),
    ),
    Finding(
        "swa-prepare-purge-not-undone",
        "contract",
        "next-decode-equals-fresh",
        "llama_decode of a batch longer than n_ubatch on a sliding-window cache places all its ubatches in a "
        "dry run first (llama_kv_cache::prepare) and undoes only the cells of each ubatch's slot; when a later "
        "ubatch is given a window-masked cell of its sequence, apply_ubatch purges that sequence's positions "
        "below it and the purge is not undone, so the earlier ubatches of the same call are computed without "
        "positions still inside their window: wrong K/V and logits (about 10 % of the largest logit on gemma2), "
        "where the same ubatches as separate llama_decode calls are right",
        "fixtures/findings/swa_prepare_purge_not_undone.py",
        upstream="src/llama-kv-cache.cpp:751-811 (prepare saves and restores only the slot's cells, :785, :805), "
        ":1166-1177 (apply_ubatch's purge, seq_rm), :1057 (find_slot takes window-masked cells)",
        condition=ContractCondition("decode", "swa_ubatches_differ", frozenset({"gemma2"})),
    ),
    # ---- a real llama-server (server backend) ----
    Finding(
        "greedy-flip-on-cache-path",
        "server",
        "output_equivalence",
        "a prompt served partly from a slot, the cache or a checkpoint is evaluated in other batch "
        "shapes and cell layouts than from scratch; where the two best tokens are within "
        "0.02 logprob the greedy choice can differ from a fresh server's "
        "(the same root cause as kv-layout-dependent-logits). Traced and replayed (python -m harness trace record "
        "--sequential: the reproducer's 12 requests one at a time on -np 1 --cache-ram 8, 6 seeds, prompts loaded "
        "from the cache in 4): the calls are consistent and replay to the server's logits bit for bit; against a "
        "fresh evaluation of the same tokens the served logits move by up to 0.086 (the top-10 margins by up to "
        "0.041) with flash attention on (auto), by at most 2.9e-6 with -fa off, cache loads included: the batch-"
        "shape nondeterminism of CPU flash attention (ggml-cpu/ops.cpp:9547-9569), as concurrent-output-"
        "divergence, not the cache's state; under load a flip within BATCH_SHAPE_FLIP_GAP with cache_n > 0",
        "fixtures/findings/kv_layout_logits.py",
    ),
    Finding(
        "concurrent-output-divergence",
        "server",
        "output",
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
        "answers the fresh second best with flash attention on, the fresh answer with it off",
        "fixtures/findings/concurrent_output_divergence.py",
    ),
    Finding(
        "fault-batch-assert",
        "server",
        "native_fault",
        "under sustained load a failed host allocation (native shim, >= 16 KiB) once aborted llama-server with "
        "GGML_ASSERT(batch.slot_batched || batch.size() == 0) right after pre_decode() in update_slots "
        "(server-context.cpp:2826 of the PR build): a batch holding tokens for no slot; 1 of 66 fault trials",
        "fixtures/findings/fault_half_built_batch_assert.py",
    ),
    Finding(
        "decode-exception-keeps-slot-tokens",
        "server",
        "output",
        "when decode() throws (a std::bad_alloc out of llama_decode), update_slots' catch calls abort_all_slots, "
        "which releases every processing slot without prompt_clear(): the slot keeps the failed batch's tokens "
        "although its memory never got them, the next request sharing the prefix reuses them (cache_n counts "
        "them) and the slot is saved to the prompt cache as that prompt: wrong output, no error "
        "(server-context.cpp:2870-2875, 2735-2742; decode()'s own error path clears the slots, :3693-3700)",
        "fixtures/findings/decode_exception_keeps_slot_tokens.py",
    ),
    Finding(
        "checkpoint-alloc-terminates",
        "server",
        "native_fault",
        "a std::bad_alloc while creating a context checkpoint (common_prompt_checkpoint::update_tgt, "
        "outside any try in update_slots) terminates llama-server, with or without PR #27451 (out of its scope)",
    ),
    Finding(
        "slot-file-follows-symlink",
        "server",
        "slot_file_confined",
        "POST /slots/{id}?action=save|restore opens --slot-save-path + filename with fopen, which follows a "
        "symlink in the save directory: a name fs_validate_filename accepts (one component, no '..') writes the "
        "slot file through the link to any path the server's user can write (truncating it; a dangling link "
        "creates its target) and restore opens and reads the link's target, a directory included (server-context."
        "cpp:5279, 5315 build the path; :2555, :2599 save/load it; src/llama-context.cpp:3324, 3378 -> "
        "src/llama-mmap.cpp:195, 220 -> ggml/src/ggml.c:627, no O_NOFOLLOW, no realpath check). Needs someone who can "
        "create a symlink in the save directory (the HTTP API cannot: names are one component and only regular "
        "files are written); Linux's fs.protected_symlinks stops it only in a sticky world-writable directory "
        "for a link owned by another user",
        "fixtures/findings/slot_file_symlink_escape.py",
        upstream="tools/server/server-context.cpp:5279, 5315; src/llama-mmap.cpp:220",
    ),
    Finding(
        "slot-action-bad-body-500",
        "server",
        "bad_name_4xx",
        "POST /slots/{id}?action=save|restore answers a client's malformed body with 500 server_error instead of "
        '400: json::parse and .at("filename") (server-context.cpp:5273-5274, 5309-5310) throw nlohmann '
        "exceptions, which are no std::invalid_argument, so ex_wrapper maps them to ERROR_TYPE_SERVER "
        "(server.cpp:64-67): a filename with a lone surrogate escape or bytes that are not UTF-8 (overlong '/' "
        "and '.'), a raw control byte, no filename, a filename that is not a string, a body that is not JSON",
        "fixtures/findings/slot_action_bad_body_500.py",
        upstream="tools/server/server.cpp:64-67; tools/server/server-context.cpp:5273-5274, 5309-5310",
    ),
    Finding(
        "cache-reuse-recurrent-stale",
        "server",
        "reuse_equivalence",
        "--cache-reuse on a recurrent or hybrid model: llama_memory_can_shift answers true for recurrent memory "
        "(llama-memory-recurrent.cpp:716-719; hybrid :133-136), so the chunk loop (server-context.cpp:3219-3258) "
        "runs; its seq_rm(head_p, head_c) of a range short of the state's tail removes nothing and succeeds "
        "(recurrent-seq-rm-range-silent) and seq_add moves only the state's position, so when the last chunk "
        "reaches the old end the slot resumes from the recurrent state of the old, undeleted conversation: "
        "cache_n counts the deleted tokens as gone, the answer is the old conversation's, no error",
        "fixtures/findings/cache_reuse_recurrent_stale.py",
        upstream="src/llama-memory-recurrent.cpp:716-719, 161-240, 318-346; tools/server/server-context.cpp:3210-3258",
    ),
    # ---- llama-cpp-python 0.3.36's own caches ----
    Finding(
        "ram_size_ignores_scores",
        "llama-cpp-python-cache",
        "accounting",
        "LlamaRAMCache.cache_size sums llama_state_size only; every entry also holds the state's scores "
        "(n_tokens x n_vocab float32) and input_ids (n_ctx int32), so capacity_bytes does not bound the memory",
        "fixtures/findings/lcp_ram_size_ignores_scores.py",
        ("ram",),
    ),
    Finding(
        "oversize_flushes_cache",
        "llama-cpp-python-cache",
        "oversize",
        "inserting an entry larger than capacity_bytes evicts every cached entry and then the new one: "
        "the cache ends empty",
        "fixtures/findings/lcp_oversize_flushes_cache.py",
        ("ram", "disk"),
    ),
    Finding(
        "disk_lookup_removes_entry",
        "llama-cpp-python-cache",
        "lookup",
        "LlamaDiskCache.__getitem__ pops the entry it returns: a second lookup of the same prompt misses",
        "fixtures/findings/lcp_disk_lookup_removes_entry.py",
        ("disk",),
    ),
    Finding(
        "lookup_unusable_for_recurrent",
        "llama-cpp-python-cache",
        "lookup",
        "_find_longest_prefix_key returns the key with the longest common prefix even when it diverges from "
        "the prompt; a recurrent model cannot truncate the loaded state, so Llama re-evaluates everything while "
        "a stored key that is a prefix of the prompt was usable",
        "fixtures/findings/lcp_lookup_unusable_for_recurrent.py",
        ("ram", "disk"),
    ),
    Finding(
        "fault_leaves_over_capacity",
        "llama-cpp-python-cache",
        "fault_atomic",
        "a MemoryError from the size computation in __setitem__'s eviction loop leaves the new entry in and the "
        "cache above capacity_bytes",
        "fixtures/findings/lcp_fault_leaves_over_capacity.py",
        ("ram", "disk"),
    ),
    Finding(
        "reinsert_fault_loses_entry",
        "llama-cpp-python-cache",
        "fault_atomic",
        "__setitem__ deletes an existing key before storing the new value; a failure in between (disk: "
        "pickling, e.g. under an address-space limit; RAM: the OrderedDict insertion) loses the cached entry",
        "fixtures/findings/lcp_reinsert_fault_loses_entry.py",
        ("ram", "disk"),
    ),
]

FINDINGS: dict[str, Finding] = {f.id: f for f in _ALL}
if len(FINDINGS) != len(_ALL):  # one id, one finding: a second row under an id would silently win
    raise RuntimeError(f"duplicate finding ids: {sorted(i for i in FINDINGS if sum(f.id == i for f in _ALL) > 1)}")


def finding(id: str) -> Finding:
    """The registered finding ``id`` (a KeyError names a finding nobody registered: a harness bug)."""
    return FINDINGS[id]
