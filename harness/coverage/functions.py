"""What the coverage of llama-server is measured on, and why a line the workloads never reached is not reached.

:data:`TARGETS`: the C++ under test (issue #39 point 0), each a function of one source file, matched on its
demangled name, or a region of a long function (``pre_decode``, ``process_single_task``) between two lines
matched on their source text (the first line matching ``start`` and the next matching ``end``, at 0c1e570 with
PR #27451; a region whose markers are not found is reported empty, never guessed).

:data:`REASONS`: a table, first match wins, from a block of unreached lines (its source text and its function)
to the reason it is not reached. A block no row explains is ``unexplained`` and listed as such.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["REASONS", "TARGETS", "UNEXPLAINED", "Reason", "Target", "reason_for"]

SERVER_TASK = "tools/server/server-task.cpp"
SERVER_CONTEXT = "tools/server/server-context.cpp"


@dataclass(frozen=True)
class Target:
    """``function``: a regex on the demangled names of the functions of ``file`` (every match is one row);
    ``start``/``end``: regexes on source lines delimiting a region of the (single) function matched."""

    label: str
    file: str
    function: str
    start: str | None = None
    end: str | None = None


_DECODE = r"^server_context_impl::pre_decode\(\)"  # update_slots' prompt and checkpoint half, lambdas included
_TASK = r"^server_context_impl::process_single_task\("

TARGETS: tuple[Target, ...] = (
    Target("server_prompt_cache::*", SERVER_TASK, r"^server_prompt_cache::"),
    Target("server_prompt::*", "tools/server/server-task.h", r"^server_prompt(_data)?::"),
    Target("get_available_slot", SERVER_CONTEXT, r"^server_context_impl::get_available_slot\("),
    Target("prompt_save", SERVER_CONTEXT, r"^server_slot::prompt_save\("),
    Target("prompt_load", SERVER_CONTEXT, r"^server_slot::prompt_load\("),
    Target("prompt_clear", SERVER_CONTEXT, r"^server_slot::prompt_clear\("),
    Target("try_clear_idle_slots", SERVER_CONTEXT, r"^server_context_impl::try_clear_idle_slots\("),
    Target("create_checkpoint", SERVER_CONTEXT, r"^server_context_impl::create_checkpoint\("),
    Target("checkpoint restore (pre_decode)", SERVER_CONTEXT, _DECODE,
           r"the largest pos_min required for a checkpoint", r"// erase any checkpoints with pos_max > pos_next"),
    Target("checkpoint invalidation (pre_decode)", SERVER_CONTEXT, _DECODE,
           r"// erase any checkpoints with pos_max > pos_next", r"^\s*// \[TAG_PROMPT_LOGITS\]$"),
    Target("checkpoint decision (pre_decode)", SERVER_CONTEXT, _DECODE,
           r"bool do_checkpoint = params_base.n_ctx_checkpoints > 0", r"n_swa > 0\);"),
    Target("checkpoint creation (pre_decode)", SERVER_CONTEXT, _DECODE,
           r"// skip ordinary mid-prompt checkpoints", r"create_checkpoint\(slot, n_tokens_cur"),
    Target("speculative checkpoint (pre_decode)", SERVER_CONTEXT, _DECODE,
           r"// make checkpoints if needed", r"ckpt.update_dft\(ctx_dft"),
    Target("idle slot caching (process_single_task)", SERVER_CONTEXT, _TASK,
           r"if \(params_base.cache_idle_slots\) \{", r"case SERVER_TASK_TYPE_CANCEL:"),
    Target("slot files (process_single_task)", SERVER_CONTEXT, _TASK,
           r"case SERVER_TASK_TYPE_SLOT_SAVE:", r"case SERVER_TASK_TYPE_GET_LORA:"),
    Target("handle_slots_save", SERVER_CONTEXT, r"^server_routes::handle_slots_save\("),
    Target("handle_slots_restore", SERVER_CONTEXT, r"^server_routes::handle_slots_restore\("),
    Target("handle_slots_erase", SERVER_CONTEXT, r"^server_routes::handle_slots_erase\("),
    Target("context shift (pre_decode)", SERVER_CONTEXT, _DECODE, r"// Shift context", r"new_tokens.resize\("),
    Target("cache reuse (pre_decode)", SERVER_CONTEXT, _DECODE,
           r"const auto n_cache_reuse = slot.task->params.n_cache_reuse", r"after context reuse, new n_past"),
    Target("common_prompt_checkpoint::*", "common/common.cpp", r"^common_prompt_checkpoint"),
    Target("llama_context state", "src/llama-context.cpp", r"^(llama_context::state_|llama_state_)"),
    Target("llama_memory seq_*", "src/llama-context.cpp", r"^llama_memory_seq_"),
    Target("llama_kv_cache seq_*/state_*", "src/llama-kv-cache.cpp", r"^llama_kv_cache::(seq_|state_)"),
    Target("llama_memory_recurrent seq_*/state_*", "src/llama-memory-recurrent.cpp",
           r"^llama_memory_recurrent::(seq_|state_)"),
    Target("llama_memory_hybrid seq_*/state_*", "src/llama-memory-hybrid.cpp", r"^llama_memory_hybrid::(seq_|state_)"),
    Target("llama_kv_cache_iswa seq_*/state_*", "src/llama-kv-cache-iswa.cpp", r"^llama_kv_cache_iswa::(seq_|state_)"),
)  # fmt: skip


@dataclass(frozen=True)
class Reason:
    """``text`` (a regex on the block's source lines; only for blocks of at most ``max_lines`` lines when given)
    or ``function`` (a regex on its function's name; only for a function never entered when ``unentered``)."""

    reason: str
    text: str | None = None
    function: str | None = None
    max_lines: int | None = None
    unentered: bool = False


UNEXPLAINED = "unexplained"

REASONS: tuple[Reason, ...] = (
    Reason("error path: a failed state read (state_clear undoes a partial restore)", None, r"::state_clear\("),
    Reason("a decode without room in a per-slot KV (the early return without --kv-unified): each slot's stream "
           "holds its n_ctx cells and a slot never holds more (a prompt of n_ctx tokens is refused, generation "
           "stops or shifts at n_ctx)", None, r"::try_clear_idle_slots\("),
    Reason("needs n_cmpl > 1 (a parent's prompt and sequence copied to its children)", None,
           r"^(server_prompt::clone|llama_memory_seq_cp|llama_kv_cache::seq_cp|llama_memory_recurrent::seq_cp)(\(|$)"),
    Reason("seq_keep: no path of the server keeps one sequence only", None, r"seq_keep(\(|$)"),
    Reason("whole-context session files (llama_state_save/load_file): the server's slot files are per sequence",
           None, r"^(llama_state_(save|load)_file|llama_context::state_(save|load)_file)(\(|$)"),
    # the slot-file paths the slot-files workload (save/restore/erase between completions, a full disk) leaves
    Reason("a client gone before its answer (the HTTP request stopped while its slot task waited)",
           r"req\.should_stop\(\)"),
    Reason("a hostile slot file name (the gate's edge step sends ../escape.bin; coverage --run slot-names more)",
           r'"Invalid filename"'),
    Reason("a slot id the server does not have: get_slot_by_id never returns null (`id_slot % slots.size()` "
           "converts the id to size_t, server-context.cpp:1503, so every id wraps to a slot), and an erase's only "
           "error is that one", r'"Invalid slot ID"|res->error\(result->to_json\(\)\)'),
    Reason("a slot file from a larger context or another vocabulary (restore refuses it)",
           r"does not fit in the slot context|Invalid tokens in slot save file"),
    Reason("a slot file whose token count exceeds the capacity the server passes (it asks for the count first and "
           "reads with exactly it, server-context.cpp:2599-2602: only a file rewritten between the two reads), or "
           "whose state read returns 0 without throwing (the edge step's files of another model throw first: "
           "llama_state_seq_load_file's catch)", r"sequence state file|failed to restore sequence state"),
    # an abort among other lines does not explain them: only a short block that is the abort
    Reason("abort path: an invariant upstream asserts (the process dies: no counters)",
           r"GGML_ABORT|GGML_ASSERT|should not happen", max_lines=4),
    # lines the five models and the server's requests cannot reach, each shown from the pinned sources
    Reason("needs recurrent rollback snapshots (n_rs_seq > 0: a speculative draft on an architecture "
           "llm_arch_supports_rs_rollback lists, src/llama-arch.cpp:1123; none of the five models)",
           r"set_rs_idx|rs_idx\[|n_rs_seq"),
    Reason("needs a model with a PLE conv state (hparams.ple_conv_state() > 0: none of the five models)",
           r"ple_conv_state|p_l\[il\]"),
    Reason("needs an indexed hybrid memory (only llama-memory-hybrid-idx.cpp passes sinfos_out to "
           "state_read_sinfo; none of the five models)", r"sinfos_out"),
    Reason("a layer without a V tensor (has_v false: K doubles as V, in none of the five models)",
           r"if \(!v\) \{\n\s*continue;", max_lines=1),
    Reason("state kept on the device (LLAMA_STATE_SEQ_FLAGS_ON_DEVICE: neither the server nor common/ passes it)",
           r"ON_DEVICE|llama_io_(write|read)_device"),
    Reason("a recurrent state of an empty sequence (cell_count 0: the server saves only a slot holding tokens)",
           r"if \(cell_count == 0\) \{\n\s*return true;", max_lines=1),
    Reason("a second cell of one recurrent sequence (a sequence holds one state cell; adjacent cells of one "
           "range only in a whole-memory write, seq_id -1)", r"cell_ranges_data\.back\(\)\.second\+\+"),
    Reason("a cell's sequence list, written only for a whole-memory write (n_seq_id is 0 unless seq_id is -1)",
           r"if \(n_seq_id\) \{\n\s*for \(auto seq_id"),
    Reason("a checkpoint without target state (common_prompt_checkpoint_capture always captures the target)",
           r"if \(!data_tgt \|\| data_tgt->empty\(\)\) \{\n\s*return;", max_lines=1),
    Reason("a cache entry whose state fails to load (prompt_load false: llama_state_seq_set_data failed; no "
           "workload's fault hits a load in a server that survives to write its counters)",
           r"if \(!ret->prompt_load\(\*prompt_cache, task\.tokens\)\) \{\n\s*ret->prompt_clear\(\);", max_lines=1),
    Reason("a mid-prompt checkpoint's spacing (reached only at a user message's start, with chat spans: the "
           "workloads send token prompts to /completion, so spans.is_user_start is false)", r"checkpoint_min_step\);"),
    Reason("a line gcov does not count though its statement runs: an argument line of a call whose other argument "
           "is counted (server-context.cpp:3333 rbegin() beside 3334 rend()), or a function's closing brace whose "
           "return is counted on the loop header (llama-kv-cache.cpp:2175: 598 = 331 iterations + 267 returns)",
           r"\n\s*(slot\.prompt\.checkpoints\.rend\(\),|\})\s*$", max_lines=1),
    Reason("slot files: no slot action in this workload (coverage --run slot-files drives them)",
           r"SLOT_(SAVE|RESTORE|ERASE)|slot_save_path|state_seq_(save|load)_file|filepath|fs_validate_filename|"
           r"n_erased|_file\(", r"handle_slots_|state_seq_(save|load)_file", unentered=True),
    Reason("seq_div: no path of the server divides positions (cache reuse and context shift move cells with seq_add)",
           None, r"seq_div(\(|$)"),
    Reason("seq_add on iSWA memory: gemma2's SWA cache is smaller than its base, so get_can_shift is false "
           "(src/llama-kv-cache-iswa.cpp:253-257) and the server turns cache reuse and context shift off "
           "(server-context.cpp:1166-1176)", None, r"^llama_kv_cache_iswa::seq_add"),
    Reason("seq_add on recurrent or hybrid memory: the reuse workload runs the llama model only (the model moves "
           "transformer cells only)", r"cache reuse is not supported - ignoring",
           r"^llama_memory_(recurrent|hybrid)::seq_add"),
    Reason("a KV cache sharing another's cells (TAG_KV_CACHE_SHARE_CELLS: shared KV layers, in none of the five "
           "models)", r"if \(other\) \{\n", None, max_lines=1),
    Reason("a context without memory (llama_get_memory is null: a model with no KV cache or state)",
           r"if \(!mem\) \{\n", None, max_lines=1),
    Reason("--cache-reuse / context shift: off on this workload's servers (coverage --run reuse drives them)",
           r"n_cache_reuse|cache_reuse|n_discard|ctx_shift|n_keep", r"seq_add", unentered=True),
    Reason("a seq_add no server call makes: a zero shift, a negative or empty range, or a cell moved below 0 "
           "(cache reuse and context shift move [p0, p1) with 0 <= n_keep <= p0 < p1 and positions stay >= 0)",
           None, r"^llama_kv_cache::seq_add"),
    Reason("needs --slots-debug (a debugging printout)", r"slots_debug|slots_n_diff"),
    Reason("needs a transposed V cache (v_trans: flash attention off)", r"transposed|v_trans"),
    Reason("needs a multimodal model (mtmd)", r"mtmd|mmproj|LLAMA_TOKEN_NULL|image"),
    Reason("unreachable on CPU: a device/GPU branch", r"ggml_backend_buffer_is_host|is_host|cuda|GPU|gpu|offload|"
           r"ggml_backend_dev|dev_type|n_gpu_layers|io\.read_to\(|read_to"),
    # a function the workloads never entered: the kind of model it needs (a workload of the llama model alone)
    Reason("needs a recurrent or hybrid model (mamba, jamba, lfm2) in the workload", None,
           r"^llama_memory_(recurrent|hybrid)::", unentered=True),
    Reason("needs an SWA model (gemma2) in the workload", None, r"^llama_kv_cache_iswa::", unentered=True),
    Reason("needs context checkpoints (a recurrent, hybrid or SWA model)", None,
           r"^(common_prompt_checkpoint|server_context_impl::create_checkpoint)", unentered=True),
    Reason("whole-state save/load (llama_state_*): the server saves per sequence only", None,
           r"^(llama_state_(get|set)_|llama_context::state_(get|set|write|read)_data|llama_state_seq_(get|set)_(data|size)(\(|$))"),
    Reason("needs a speculative draft model (or its checkpoint type)", r"ctx_dft|spec_|draft|drft|size_dft|data_dft"),
    Reason("an embedding or rerank task (concurrent and soak --embedding-clients send them; the gate none)",
           r"task.*(embedding|rerank)|EMBEDDING|RERANK|pooling"),
    Reason("cache pressure: an eviction path no workload hit (a limit reached at update)",
           r"removing oldest entry|making room|exceeds cache size limit|cache (size|token) limit|"
           r"obsolete cached prompt"),
    Reason("a full KV cache (a decode that finds no room)", r"failed to find free space|n_batch /= 2"),
    Reason("needs cell extensions (M-RoPE positions)", r"llama_kv_cell_ext|ext_(get|set)\(|exts"),
    Reason("all sequences at once (seq_id -1)", r"match any sequence|seq_id == -1|seq_id < 0"),
    Reason("needs a busy slot (concurrent requests)", r"is_processing"),
    Reason("error path: an exception", r"catch \(|throw "),
    Reason("error path: allocation failure", r"bad_alloc|nullptr\)\s*\{?\s*$|== nullptr|failed to allocate|"
           r"cannot allocate|OOM|out of memory"),
    Reason("error path: a corrupt or mismatched state read", r"LLAMA_LOG_ERROR|failed to (read|restore|load)|"
           r"mismatch|invalid|!= (n_|cell_count|v_trans|n_layer|n_stream)|return false;|return 0;"),
    Reason("error path: a bad request", r"send_error|ERROR_TYPE_|res_err|format_error"),
    Reason("a LoRA adapter", r"(?i)lora"),
)  # fmt: skip


def reason_for(source: str, function: str, entered: bool = True, context: str = "") -> str:
    """The first reason of :data:`REASONS` whose function pattern names the block's function (``entered``: a
    line of it was reached), else the first whose text pattern is in its lines or the ``context`` before them (the
    ``} else {  // when ...`` that opens the block), else :data:`UNEXPLAINED`."""
    for r in REASONS:
        if r.function is not None and (not r.unentered or not entered) and re.search(r.function, function):
            return r.reason
    n = sum(1 for line in source.split("\n") if line.strip())
    for r in REASONS:
        if r.text is not None and (r.max_lines is None or n <= r.max_lines) and re.search(r.text, context + source):
            return r.reason
    return UNEXPLAINED
