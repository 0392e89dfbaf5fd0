"""Why a branch of a reached line was never taken: the branch half of the coverage report's reasons.

gcov counts each outcome of a line's conditions (gcovr leaves out the edges an exception takes and those it
proves unreachable). A line the workloads reached can still hold an outcome none of them took: the other side
of an ``if``, a loop that never ran to its end, a short-circuit operand never evaluated. :data:`BRANCH_REASONS`
maps such a line (its source text, the statement's lines joined, and its function) to why: first match wins, and
each says whether a request could take it (``reachable``: the gate's programs do not yet, and the reason names
the request that would) or why no request can (a log line's verbosity test under ``-lv 4``, an assertion that
holds, a flag or model the server gate never runs, a state the server's own code never builds). A line no row
explains is ``unexplained``, listed in the report with its text.

The rows are read from the pinned sources (llama.cpp 0c1e570 with PR #27451); each names the code it is about.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass
from typing import Any

__all__ = ["BRANCH_REASONS", "UNEXPLAINED", "BranchReason", "Untaken", "branch_reason"]


@dataclass(frozen=True)
class BranchReason:
    """``text``: a regex on the line's statement; ``function``: one on its function's name (both must match)."""

    reason: str
    text: str
    function: str | None = None
    reachable: bool = False  # a request could take it: the gate's programs do not yet

    def matches(self, text: str, function: str) -> bool:
        return re.search(self.text, text) is not None and (
            self.function is None or re.search(self.function, function) is not None
        )


@dataclass(frozen=True)
class Untaken:
    """A reached line with outcomes never taken: ``untaken`` of its ``total``, and why."""

    target: str
    function: str
    file: str
    line: int
    untaken: int
    total: int
    text: str
    reason: str
    reachable: bool

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


_CACHE = r"^server_prompt_cache::"
_SLOT_TASK = r"process_single_task"
_HANDLERS = r"handle_slots_"

BRANCH_REASONS: tuple[BranchReason, ...] = (
    # the three kinds no request changes
    BranchReason("a log line: every server of the gate runs at -lv 4, so the verbosity test (common/log.h LOG_TMPL) "
                 "never skips it", r"^\s*(SRV|SLT|QUE|LOG|LLAMA_LOG|GGML_LOG)_?[A-Z]*\s*\("),
    BranchReason("an assertion that holds: its other edge is the abort (the process would end)",
                 r"^\s*GGML_(ASSERT|ABORT)\s*\("),
    BranchReason("the catch's type test: only that exception's type is thrown in its try", r"\}\s*catch\s*\("),
    # libllama's guards, as the blocks they open are explained (harness.coverage.functions.REASONS)
    BranchReason("a KV cache sharing another's cells (TAG_KV_CACHE_SHARE_CELLS: shared KV layers, in none of the "
                 "five models)", r"^\s*if \(other\) \{"),
    BranchReason("a context without memory (llama_get_memory is null: a model with no KV cache or state)",
                 r"^\s*if \(!mem\) \{"),
    BranchReason("a seq_add no server call makes: a zero shift, a negative or empty range (cache reuse and context "
                 "shift move [p0, p1) with 0 <= n_keep <= p0 < p1)", r"if \((shift == 0|p0 < 0|p1 < 0|p0 == p1)\)",
                 r"^llama_kv_cache::seq_add"),
    BranchReason("state kept on the device (LLAMA_STATE_SEQ_FLAGS_ON_DEVICE: neither the server nor common/ passes "
                 "it)", r"LLAMA_STATE_SEQ_FLAGS_ON_DEVICE"),
    # the prompt cache
    BranchReason("an empty cache is never over its limit (size() of no entries is 0): the loop always ends on the "
                 "limit test", r"while \(!states\.empty\(\) && (size|n_tokens)\(\) >", _CACHE),
    BranchReason("limit_tokens is the context size the cache was made with (server_prompt_cache(cache_ram_mib, "
                 "n_ctx), server-context.cpp), never 0", r"if \(limit_tokens > 0\)", _CACHE),
    BranchReason("a draft state that does not load whole after the target's did: llama_state_seq_set_data_ext on "
                 "the draft context fails only on a state of another model or size, which the cache never holds",
                 r"if \(n != size\)", r"server_prompt_cache::load"),
    BranchReason("a draft model's state on a server without one: the draft payload is empty there (the GGML_ASSERT "
                 "after it holds)", r"if \(!data\.empty\(\)\)", r"server_prompt_cache::load"),
    # choosing a slot
    BranchReason("get_slot_by_id never returns null: `id_slot % slots.size()` (server-context.cpp:1503) converts the "
                 "id to size_t, so every id, a negative one too, wraps to a slot (seen: id_slot -2 selects slot 0, "
                 "POST /slots/-2?action=erase answers id_slot -2)", r"^\s*if \(ret\) \{", r"get_available_slot"),
    BranchReason("--slot-prompt-similarity 0 (the gate runs upstream's default, 0.1)",
                 r"if \(slot_prompt_similarity != 0\.0f\)", r"get_available_slot"),
    # the purge of a unified KV
    BranchReason("a decode that finds no room in a per-slot KV (try_clear_idle_slots is called only then, :3710): "
                 "each slot's stream holds its n_ctx cells and a slot never holds more (a prompt of n_ctx tokens is "
                 "refused, generation stops or shifts at n_ctx)", r"if \(!params_base\.kv_unified\)",
                 r"try_clear_idle_slots"),
    # the slot actions
    BranchReason("get_slot_by_id never returns null (every id wraps to a slot, :1503; see get_available_slot)",
                 r"if \(slot == nullptr\)", _SLOT_TASK),
    BranchReason("an erase that fails: its only error is the null slot, which get_slot_by_id never returns (:1503)",
                 r"if \(result->is_error\(\)\)", r"handle_slots_erase"),
    # checkpoints: creating and restoring
    BranchReason("its body is GGML_ABORT (\"should not happen\", server-context.cpp:3284): a slot that resumes "
                 "from n_past > 0 tokens holds its sequence (an invariant that holds)", r"if \(pos_min == -1\)",
                 r"pre_decode"),
    BranchReason("n_past past the slot's tokens: n_past is their common prefix with the task's (get_common_prefix), "
                 "never longer than either", r"if \(n_past > 0 && n_past <= slot\.prompt\.n_tokens\(\)\)",
                 r"pre_decode"),
    BranchReason("a memory of seq_rm type RS (partial removal within rollback snapshots: n_rs_seq > 0, an "
                 "architecture llm_arch_supports_rs_rollback lists; none of the five models)",
                 r"COMMON_CONTEXT_SEQ_RM_TYPE_RS"),
    BranchReason("a size mismatch whose branch is GGML_ABORT: a state's size does not change between "
                 "llama_state_seq_get_size_ext and the read or write of it (an invariant that holds)",
                 r"if \(n != (ckpt_size|data_tgt->size\(\)|data_dft->size\(\))\)", r"common_prompt_checkpoint"),
    BranchReason("a checkpoint of the target on no context: the target context always exists (only the draft's is "
                 "null, without -md)", r"if \(ctx == nullptr\)", r"common_prompt_checkpoint::(update|load)_tgt"),
    BranchReason("a checkpoint without its payload sized, restored or loaded: every checkpoint the server keeps was "
                 "captured with its target payload, and on a draft server with its draft payload too (update_tgt, "
                 "update_dft right after create_checkpoint)",
                 r"!data_(tgt|dft) \|\| data_(tgt|dft)->empty\(\)|return data_tgt \? data_tgt->size\(\) : 0",
                 r"common_prompt_checkpoint::"),
    # context shift and --cache-reuse
    BranchReason("a vocabulary that adds no BOS token (llama_vocab_get_add_bos false, :1099): the fixtures' GGUF "
                 "vocabularies add one", r"if \(add_bos_token\)", r"pre_decode"),
    BranchReason("--slots-debug (a debugging printout; the gate runs without it)", r"if \(slots_debug\)"),
    BranchReason("a multimodal prompt (an mtmd chunk): no model of the fixtures has a projector",
                 r"has_mtmd|mctx\)|if \(mctx\)"),
    BranchReason("speculation without a draft model (--spec-type ngram-*: the gate's speculation is a draft model, "
                 "-md)", r"^\s*if \(ctx_dft\) \{", r"pre_decode"),
    BranchReason("a draft model whose memory cannot roll back (recurrent: seq_rm type FULL or RS): the fixtures' "
                 "draft model is a llama-architecture transformer (fixtures/gguf.py draft_path)",
                 r"^\s*if \(use_ckpt_dft\) \{", r"pre_decode"),
    BranchReason("its body is GGML_ABORT (\"failed to remove sequence\"): removing a draft's tail from a transformer "
                 "draft context never fails (an invariant that holds)",
                 r"if \(!llama_memory_seq_rm\(llama_get_memory\(ctx_dft\)", r"pre_decode"),
    BranchReason("a draft longer than the recurrent rollback snapshots (n_rs_seq > 0 needs an architecture "
                 "llm_arch_supports_rs_rollback lists: none of the five models)", r"llama_n_rs_seq\("),
)  # fmt: skip

UNEXPLAINED = "unexplained"


def branch_reason(text: str, function: str) -> BranchReason | None:
    """The first row of :data:`BRANCH_REASONS` that explains a reached line's untaken outcomes, or None."""
    return next((r for r in BRANCH_REASONS if r.matches(text, function)), None)
