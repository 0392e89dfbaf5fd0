"""Shared builders for the unit tests: hand-made checkpoints, prompts, cache entries, and a ledger check.

And the llama-server builds, before the first test: a test that runs the real server says so
(``@pytest.mark.llama_server_builds``, or ``pytestmark`` for a module whose every test does), and when one
such test is selected, both pinned builds (``shared`` and ``master``) are made or found in the cache once,
after collection, with a line each; a run that selects none builds nothing. A cold build takes minutes (9
and 4.5 on 2 cores): inside a test it would trip pytest's ``faulthandler_timeout`` and print every thread's
stack; here no test's timer runs. A test that builds users' trees (``pytest.mark.user_trees``) gets those
trees made and built there too (:data:`BUILT`), and one that runs the gcov build
(``pytest.mark.coverage_build``) gets the ``coverage`` build made there. The three markers make the build
tier; the default tier (``python -m pytest``) leaves them out and builds nothing (tests/README.md).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

from harness.errors import HarnessError
from harness.model import (
    CheckpointList,
    CommonPromptCheckpoint,
    Host,
    Payload,
    ServerPrompt,
    ServerPromptCache,
    ServerPromptCacheState,
    get_semantics,
)
from harness.trees.build import build_name, build_server, build_source, cached_binary
from harness.trees.pinned import export_pinned

BUILDS = (("shared", "plain"), ("master", "plain"))  # (semantics, instrumentation)


def pytest_collection_finish(session: pytest.Session) -> None:
    if session.config.option.collectonly:
        return
    coverage = any(item.get_closest_marker("coverage_build") for item in session.items)
    if not coverage and not any(item.get_closest_marker("llama_server_builds") for item in session.items):
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")

    def say(line: str) -> None:
        if reporter is not None:
            reporter.write_line(line)
        else:
            print(line, file=sys.stderr)

    wanted = BUILDS if any(item.get_closest_marker("llama_server_builds") for item in session.items) else ()
    for semantics, instrumentation in (*wanted, *((("shared", "coverage"),) if coverage else ())):
        name = build_name(semantics, instrumentation)
        if cached_binary(semantics, instrumentation) is not None:
            say(f"llama-server builds for the server tests: {name} cached")
            continue
        say(f"llama-server builds for the server tests: building {name} now, before the tests "
            "(minutes on 2 cores; once, then cached)")  # fmt: skip
        t0 = time.monotonic()
        try:
            build_server(semantics, instrumentation, log=lambda m: say(f"  build: {m}"))
        except HarnessError as e:  # the tests that need it fail with the same one line
            say(f"llama-server builds for the server tests: {name} failed: {e}")
            continue
        say(f"llama-server builds for the server tests: {name} built in {time.monotonic() - t0:.0f} s")
    if any(item.get_closest_marker("user_trees") for item in session.items):
        _build_users_trees(session, say)


def pattern(n: int, seed: int) -> bytes:
    """``n`` deterministic bytes that differ between seeds."""
    return bytes((seed * 31 + i * 7) % 251 for i in range(n))


class Kit:
    """Builds model objects by hand on one host with one semantics (no server involved)."""

    def __init__(self, sem_name: str) -> None:
        self.host = Host()
        self.sem = get_semantics(sem_name)
        self._seed = 0

    def payload(self, nbytes: int, kind: str = "test") -> Payload | None:
        self._seed += 1
        p = self.host.alloc_payload("test.setup", nbytes, kind)
        if p is not None:
            p.fill(pattern(nbytes, self._seed))
        return p

    def ckpt(
        self,
        n_tokens: int,
        tgt: int = 0,
        dft: int = 0,
        spec: int = 0,
        *,
        pos_min: int | None = None,
        pos_max: int | None = None,
        id_task: int = -1,
    ) -> CommonPromptCheckpoint:
        c = CommonPromptCheckpoint(
            self.host,
            self.sem,
            n_tokens=n_tokens,
            id_task=id_task,
            pos_min=n_tokens - 1 if pos_min is None else pos_min,
            pos_max=n_tokens - 1 if pos_max is None else pos_max,
        )
        c.data_tgt = self.payload(tgt, "ckpt_tgt")
        c.data_dft = self.payload(dft, "ckpt_dft")
        c.data_spec = self.payload(spec, "ckpt_spec")
        return c

    def prompt(self, tokens: Iterable[int], ckpts: Iterable[CommonPromptCheckpoint] = ()) -> ServerPrompt:
        return ServerPrompt(tuple(tokens), CheckpointList(self.host, list(ckpts)))

    def cache(self, limit_bytes: int = 0, limit_tokens: int = 0) -> ServerPromptCache:
        """A cache whose ``limit_size`` is ``limit_bytes`` bytes (unit = 1 byte)."""
        return ServerPromptCache(self.host, self.sem, limit_bytes, limit_tokens, unit=1)

    def entry(
        self,
        cache: ServerPromptCache,
        tokens: Iterable[int],
        main: int,
        drft: int = 0,
        ckpts: Iterable[CommonPromptCheckpoint] = (),
    ) -> ServerPromptCacheState:
        """Append an entry through ``alloc`` (the source prompt is destroyed afterwards)."""
        prompt = self.prompt(tokens, ckpts)
        e = cache.alloc(prompt, main, drft)
        assert e is not None, "setup entry was not admitted"
        if e.data.main is not None:
            e.data.main.fill(pattern(main, 1000 + len(cache)))
        if e.data.drft is not None:
            e.data.drft.fill(pattern(drft, 2000 + len(cache)))
        prompt.checkpoints.clear()
        return e

    def referenced(self, cache: ServerPromptCache | None = None, *prompts: ServerPrompt) -> dict[int, int]:
        """ident -> number of references, over the cache entries and the given prompts."""
        refs: dict[int, int] = {}
        payloads: list[Payload] = []
        if cache is not None:
            for e in cache.states:
                payloads.extend(e.payloads())
        for pr in prompts:
            for c in pr.checkpoints:
                payloads.extend(c.payloads())
        for p in payloads:
            refs[p.ident] = refs.get(p.ident, 0) + 1
        return refs

    def assert_no_leak(self, cache: ServerPromptCache | None = None, *prompts: ServerPrompt) -> None:
        """Live payloads are exactly the referenced ones, each with as many holders as references."""
        refs = self.referenced(cache, *prompts)
        live = self.host.ledger.live
        assert set(live) == set(refs)
        assert {i: live[i].holders for i in live} == refs
        assert self.host.ledger.live_bytes == sum(live[i].nbytes for i in refs)


@pytest.fixture
def kit() -> Callable[[str], Kit]:
    return Kit


# --------------------------------------------------------------------------------------------
# users' trees, made from the pinned sdist: copies, our patch, edits of our own
# --------------------------------------------------------------------------------------------

Edits = dict[str, list[tuple[str, str]]]

#: a behaviour change of our own: ``server_prompt_cache::load`` skips entries it keeps at 0c1e570
#: (tools/server/server-task.cpp:1814, "don't trash large prompts"): 25 % of an entry kept -> 75 %
THRESHOLD_EDIT: Edits = {"tools/server/server-task.cpp": [("if (f_keep_cur < 0.25f) {", "if (f_keep_cur < 0.75f) {")]}

#: checkpoints at other positions, as many: the prompt's last checkpoint 5 tokens before its end, not 4
#: (tools/server/server-context.cpp:3546 at 0c1e570, ``checkpoint_offsets``, the tail processed separately)
CHECKPOINT_EDIT: Edits = {
    "tools/server/server-context.cpp": [
        ("static const int checkpoint_offsets[] = {4 + n_ubatch, 4};",
         "static const int checkpoint_offsets[] = {4 + n_ubatch, 5};")
    ]
}  # fmt: skip

_ROUTE = "    this->post_completions = [this](const server_http_req & req) {\n        auto res = create_response();\n"

#: a server that fails on demand: with ``HARNESS_TEST_FAIL=http500:N`` its Nth ``POST /completion`` answers
#: HTTP 500, with ``abort:N`` it aborts mid-request (tools/server/server-context.cpp, the route's lambda)
FAIL_EDIT: Edits = {
    "tools/server/server-context.cpp": [
        ("#include <algorithm>\n", "#include <algorithm>\n#include <atomic>\n#include <cstdlib>\n"),
        (
            _ROUTE,
            _ROUTE + "        static std::atomic<int> n_seen{0};\n"
            '        if (const char * f = std::getenv("HARNESS_TEST_FAIL")) {\n'
            "            const std::string s(f);\n"
            "            const auto c = s.find(':');\n"
            "            if (c != std::string::npos && ++n_seen == std::atoi(s.c_str() + c + 1)) {\n"
            '                if (s.rfind("abort", 0) == 0) {\n'
            "                    std::abort();\n"
            "                }\n"
            '                res->error(format_error_response("injected by the harness tests", ERROR_TYPE_SERVER));\n'
            "                return res;\n"
            "            }\n"
            "        }\n",
        ),
    ]
}

#: an exported function of the bindings renamed away (unused by the server, so the tree still builds)
RENAME_EDIT: Edits = {
    "src/llama-adapter.cpp": [
        ("int32_t llama_adapter_meta_count(const llama_adapter_lora * adapter) {",
         "int32_t llama_adapter_meta_count_renamed(const llama_adapter_lora * adapter) {")
    ]
}  # fmt: skip


#: a function the harness calls renamed in the header (never built: the driver refuses it before any build)
UNCALLABLE_EDIT: Edits = {
    "include/llama.h": [("    LLAMA_API bool llama_memory_seq_rm(", "    LLAMA_API bool llama_memory_seq_remove(")]
}


#: a layout change in the C API: a field before ``n_ctx`` in ``llama_context_params`` and a parameter more
#: for ``llama_n_threads`` (include/llama.h:366 and :1098)
LAYOUT_EDIT: Edits = {
    "include/llama.h": [
        ("        uint32_t n_ctx;                 // text context, 0 = from model",
         "        uint32_t n_ctx_new;\n        uint32_t n_ctx;                 // text context, 0 = from model"),
        ("    LLAMA_API int32_t llama_n_threads(struct llama_context * ctx);",
         "    LLAMA_API int32_t llama_n_threads(struct llama_context * ctx, int extra);"),
    ]
}  # fmt: skip

#: payloads the semantics reader cannot tell (common/common.h:1241)
UNKNOWN_SEMANTICS_EDIT: Edits = {
    "common/common.h": [("    std::vector<uint8_t> data_tgt;", "    std::unique_ptr<std::vector<uint8_t>> data_tgt;")]
}

#: C++ mutants of the prompt cache, one line each, for the server-side properties (harness.targets.server_log):
#: the oldest checkpoint erased only once the list is over the cap (server-context.cpp:2312) -> checkpoint_lists
CAP_EDIT: Edits = {"tools/server/server-context.cpp": [
    ("        while (slot.prompt.checkpoints.size() >= (size_t) params_base.n_ctx_checkpoints) {",
     "        while (slot.prompt.checkpoints.size() > (size_t) params_base.n_ctx_checkpoints) {")]}  # fmt: skip
#: alloc makes room for the cache as it is, not for it plus the new entry (server-task.cpp:1751) -> alloc_eviction
ROOM_EDIT: Edits = {"tools/server/server-task.cpp": [
    ("        while (!states.empty() && size() + state_size_new > limit_size) {",
     "        while (!states.empty() && size() > limit_size) {")]}  # fmt: skip
#: the token limit enforced only when a byte limit is set too (server-task.cpp:1885) -> limit
TOKENS_EDIT: Edits = {"tools/server/server-task.cpp": [
    ("    if (limit_tokens > 0) {", "    if (limit_size > 0 && limit_tokens > 0) {")]}
#: the cache's size leaves the checkpoints out though each entry's counts them (server-task.cpp:1695) -> accounting
SIZE_EDIT: Edits = {"tools/server/server-task.cpp": [
    ("        res += state.size();", "        res += state.data.size();")]}  # fmt: skip
#: load moves the entry's prompt into the slot, the entry stays in the cache (server-task.cpp:1864) -> load_transfer
TRANSFER_EDIT: Edits = {"tools/server/server-task.cpp": [
    ("        states.erase(it_best);", "        // states.erase(it_best);")]}  # fmt: skip


#: make room evicts the newest entry instead of the oldest (server-task.cpp:1754) -> alloc_eviction (the order)
NEWEST_EDIT: Edits = {"tools/server/server-task.cpp": [
    ("            SRV_WRN(\" - making room for prompt cache entry, removing oldest entry (size = %.3f MiB)\\n\",\n"
     "                    states.front().size() / (1024.0 * 1024.0));\n\n            states.pop_front();",
     "            SRV_WRN(\" - making room for prompt cache entry, removing oldest entry (size = %.3f MiB)\\n\",\n"
     "                    states.front().size() / (1024.0 * 1024.0));\n\n            states.pop_back();")]}  # fmt: skip
#: make room for twice the new entry: evicts more than needed (server-task.cpp:1751) -> alloc_eviction (needed)
EXTRA_EDIT: Edits = {"tools/server/server-task.cpp": [
    ("        while (!states.empty() && size() + state_size_new > limit_size) {",
     "        while (!states.empty() && size() + 2 * state_size_new > limit_size) {")]}  # fmt: skip
#: alloc saves a prompt the cache already holds within another entry (server-task.cpp:1716) -> no_prefix_entries
CONTAINED_EDIT: Edits = {"tools/server/server-task.cpp": [
    ("        if (cur_lcp_len == (int) prompt.tokens.size()) {",
     "        if (false && cur_lcp_len == (int) prompt.tokens.size()) {")]}  # fmt: skip

#: prompt_clear drops the slot's tokens but not its checkpoints (server-context.cpp:298) -> cleared_checkpoints
KEPT_EDIT: Edits = {"tools/server/server-context.cpp": [
    ("        mem.seq_rm(id, -1, -1);\n\n        prompt.clear();",
     "        mem.seq_rm(id, -1, -1);\n\n        prompt.tokens.clear();")]}  # fmt: skip

#: update evicts for the token limit while the cache holds more than half its estimate (server-task.cpp:1886)
#: -> update_eviction
EARLY_EDIT: Edits = {"tools/server/server-task.cpp": [
    ("        while (!states.empty() && n_tokens() > limit_tokens_cur) {",
     "        while (!states.empty() && 2 * n_tokens() > limit_tokens_cur) {")]}  # fmt: skip

#: load restores an entry's state with a 128th of its bytes zeroed, from 19 % of the way in (server-task.cpp:1832):
#: inside one layer's K or recurrent state on the fixture models (4 layers), past the headers, so the restore
#: succeeds and only the numbers differ -> restore_equivalence
CORRUPT_EDIT: Edits = {"tools/server/server-task.cpp": [
    ("            const size_t n = llama_state_seq_set_data_ext(ctx_tgt, data.data(), size, id_slot, 0);",
     "            std::fill(data.begin() + size * 19 / 100, data.begin() + size * 19 / 100 + size / 128, 0); "
     "const size_t n = llama_state_seq_set_data_ext(ctx_tgt, data.data(), size, id_slot, 0);")]}  # fmt: skip

#: a prompt of exactly the slot's n_ctx tokens is taken, not refused (server-context.cpp:3186; the model's mutant
#: prompt-fills-ctx) -> slot_within_ctx, at the context's edge of the drawn configurations
EDGE_EDIT: Edits = {"tools/server/server-context.cpp": [
    ("                            if (slot.task->n_tokens() >= slot.n_ctx) {",
     "                            if (slot.task->n_tokens() > slot.n_ctx) {")]}  # fmt: skip

#: the idle-slot pass saves an idle slot under a unified KV but no longer clears it (server-context.cpp:2429)
#: -> idle_pass
IDLE_EDIT: Edits = {"tools/server/server-context.cpp": [
    ("// [TAG_IDLE_SLOT_CLEAR]\n                                    slot.prompt_clear();",
     "// [TAG_IDLE_SLOT_CLEAR] (mutant: the slot is kept)")]}  # fmt: skip

#: a stateless task (embedding, rerank) that takes a slot by LRU also updates the prompt cache: it saves the slot's
#: prompt and loads the best entry for its own (server-context.cpp:1620-1621, the model's mutant
#: stateless-select-saves) -> stateless_not_cached, in the server gate's stateless step
STATELESS_EDIT: Edits = {"tools/server/server-context.cpp": [
    ("            update_cache = update_cache && task.type == SERVER_TASK_TYPE_COMPLETION;\n",
     "            // (mutant: every task type updates the prompt cache)\n")]}  # fmt: skip

#: a stateless task resumes from the slot's common prefix as a completion does (server-context.cpp:3198,
#: ``&& !is_stateless_task`` dropped; the model's mutant stateless-reuses) -> stateless_fresh, in the stateless step
STATELESS_REUSE_EDIT: Edits = {"tools/server/server-context.cpp": [
    ("                            if (slot.task->params.cache_prompt && !is_stateless_task) {",
     "                            if (slot.task->params.cache_prompt) { (void) is_stateless_task;")]}  # fmt: skip

#: the --cache-reuse chunk loop takes runs of more than N tokens, not of at least N (server-context.cpp:3241; the
#: model's mutant reuse-off-by-one) -> reuse_chunks, in the reuse step
REUSE_CHUNK_EDIT: Edits = {"tools/server/server-context.cpp": [
    ("                                        if (n_match >= (size_t) n_cache_reuse) {",
     "                                        if (n_match > (size_t) n_cache_reuse) {")]}  # fmt: skip

#: a generating slot shifts its context one token early, when n_tokens + 2 >= n_ctx (server-context.cpp:2892)
#: -> shift_timing, in the reuse step
SHIFT_EARLY_EDIT: Edits = {"tools/server/server-context.cpp": [
    ("slot.state == SLOT_STATE_GENERATING && slot.prompt.n_tokens() + 1 >= slot.n_ctx) {",
     "slot.state == SLOT_STATE_GENERATING && slot.prompt.n_tokens() + 2 >= slot.n_ctx) {")]}  # fmt: skip

#: a context shift discards a third of the tokens past n_keep, not half (server-context.cpp:2923) -> context_shift
SHIFT_DISCARD_EDIT: Edits = {"tools/server/server-context.cpp": [
    ("slot.task->params.n_discard ? slot.task->params.n_discard : (n_left / 2);",
     "slot.task->params.n_discard ? slot.task->params.n_discard : (n_left / 3);")]}  # fmt: skip

#: a request keeps three quarters of the prefix its slot shares with it (server-context.cpp:3200) -> reuse, before
#: the differential's cache_n agreement
REUSE_SHORT_EDIT: Edits = {"tools/server/server-context.cpp": [
    ("n_past = slot.prompt.tokens.get_common_prefix(input_tokens);\n",
     "n_past = slot.prompt.tokens.get_common_prefix(input_tokens) * 3 / 4;\n")]}  # fmt: skip

#: a slot file's restore replaces the slot's tokens but keeps its checkpoints, of the prompt it held before
#: (server-context.cpp:2618, ``slot->prompt.clear()`` dropped) -> slot_file_restore, in the slot-file step
RESTORE_KEEPS_EDIT: Edits = {"tools/server/server-context.cpp": [
    ("slot->prompt.clear();\n                        slot->prompt.tokens = std::move(restored);",
     "slot->prompt.tokens = std::move(restored); // (mutant: the checkpoints are kept)")]}  # fmt: skip

#: the idle-slot pass saves every slot, also one that is processing (server-context.cpp:2418; the model's mutant
#: idle-caching-saves-busy) -> busy_slot_untouched, in the concurrent step's log
IDLE_BUSY_EDIT: Edits = {"tools/server/server-context.cpp": [
    ("                            if (!slot.is_processing()) {\n                                SLT_TRC(slot, \"%s\", "
     "\"saving idle slot to prompt cache\\n\");",
     "                            if (true) { // (mutant: busy slots too)\n                                "
     "SLT_TRC(slot, \"%s\", \"saving idle slot to prompt cache\\n\");")]}  # fmt: skip

#: a load that fails leaves the slot as it was instead of clearing it (server-context.cpp:1630-1632) ->
#: restore_failure, in the fixed failed-load program
LOAD_KEEPS_EDIT: Edits = {"tools/server/server-context.cpp": [
    ("                if (!ret->prompt_load(*prompt_cache, task.tokens)) {\n                    ret->prompt_clear();\n"
     "                }",
     "                ret->prompt_load(*prompt_cache, task.tokens); // (mutant: kept on a failed load)")]}  # fmt: skip

#: a slot save that failed (nwrite 0) answers 200 (tools/server/server-context.cpp:2558-2561; the model's mutant
#: save-ignores-write-error): a save into a full disk answers 200 for the bytes it wrote -> no_partial_file, in the
#: full-disk step
SAVE_ERROR_OK_EDIT: Edits = {"tools/server/server-context.cpp": [
    ("                    if (nwrite == 0) {\n                        send_error(task, \"Unable to save slot\", "
     "ERROR_TYPE_SERVER);\n                        break;\n                    }\n",
     "                    // (mutant: a failed save answered as done)\n")]}  # fmt: skip

#: a slot file's restore that fails (a forged file: too long, a token outside the vocabulary) leaves the slot as it
#: was instead of clearing it (server-context.cpp:2620, prompt_clear in the catch) -> cleared_checkpoints, in the
#: edge step's foreign-files case
FAILED_RESTORE_KEEPS_EDIT: Edits = {"tools/server/server-context.cpp": [
    ("                        slot->prompt_clear();\n                        send_error(task, std::string(\"Unable to "
     "restore slot: \")",
     "                        // (mutant: the slot is kept)\n                        send_error(task, std::string("
     "\"Unable to restore slot: \")")]}  # fmt: skip

#: an erase sent while its slot processes a completion runs at once instead of waiting for the slot (server-context.cpp:
#: 2649-2654, the defer dropped) -> busy_slot_untouched, in the edge step's deferred-actions case
BUSY_ERASE_EDIT: Edits = {"tools/server/server-context.cpp": [
    ("                    if (slot->is_processing()) {\n                        // if requested slot is unavailable, "
     "we defer this task for processing later\n                        SRV_DBG(\"requested slot is unavailable, defer "
     "task, id_task = %d\\n\", task.id);\n                        queue_tasks.defer(std::move(task));\n              "
     "          break;\n                    }\n\n                    // Erase token cache",
     "                    // Erase token cache (mutant: also of a slot that is processing)")]}  # fmt: skip

#: a slot save's name is not validated (server-context.cpp:5275, fs_validate_filename skipped on save) -> a save named
#: "../escape.bin" writes beside the save directory: no_partial_file, in the edge step's hostile-name case
NAME_UNCHECKED_EDIT: Edits = {"tools/server/server-context.cpp": [
    ("    std::string filename = request_data.at(\"filename\");\n    if (!fs_validate_filename(filename)) {\n        "
     "res->error(format_error_response(\"Invalid filename\", ERROR_TYPE_INVALID_REQUEST));\n        return res;\n"
     "    }\n    std::string filepath = params.slot_save_path + filename;\n\n    auto & rd = res->rd;\n    {\n        "
     "server_task task(SERVER_TASK_TYPE_SLOT_SAVE);",
     "    std::string filename = request_data.at(\"filename\"); // (mutant: the name is not validated)\n"
     "    std::string filepath = params.slot_save_path + filename;\n\n    auto & rd = res->rd;\n    {\n        "
     "server_task task(SERVER_TASK_TYPE_SLOT_SAVE);")]}  # fmt: skip

#: checkpoints are made whatever --ctx-checkpoints says (server-context.cpp:3441) -> with --ctx-checkpoints 0 the
#: log shows one created: checkpoint_lists, in the edge step's no-checkpoints case
CHECKPOINTS_ALWAYS_EDIT: Edits = {"tools/server/server-context.cpp": [
    ("bool do_checkpoint = params_base.n_ctx_checkpoints > 0;",
     "bool do_checkpoint = true; // (mutant: whatever --ctx-checkpoints says)")]}  # fmt: skip

#: the prompt cache under another name, as a block cache replacing it would be (tools/server/server-task.h:612): the
#: model's policy describes nothing there (harness.trees.switches: prompt_cache_replaced); an alias keeps it building
BLOCK_EDIT: Edits = {"tools/server/server-task.h": [
    ("struct server_prompt_cache {\n    server_prompt_cache(int32_t limit_size_mib, size_t limit_tokens) {",
     "struct server_block_cache {\n    server_block_cache(int32_t limit_size_mib, size_t limit_tokens) {"),
    ("    void update();\n};\n\n// used exclusively by router mode",
     "    void update();\n};\n\nusing server_prompt_cache = server_block_cache;\n\n// used exclusively by router mode"),
]}  # fmt: skip


def merged(*edits: Edits) -> Edits:
    """Several trees' edits in one tree (a row of trees that each add one change: ``history``'s tests)."""
    out: Edits = {}
    for e in edits:
        for rel, pairs in e.items():
            out[rel] = [*out.get(rel, []), *pairs]
    return out


#: the users' trees the tests make, by name: (semantics of the pinned tree it starts from, edits)
TREES: dict[str, tuple[str, Edits | None]] = {
    "pr": ("shared", None),  # a copy of the pinned tree with our patch (hashes as the pinned pr tree)
    "pinned": ("master", None),  # a copy of the pinned tree
    "threshold": ("shared", THRESHOLD_EDIT),
    "checkpoint-offset": ("shared", CHECKPOINT_EDIT),
    "cap": ("shared", CAP_EDIT),
    "room": ("shared", ROOM_EDIT),
    "tokens": ("shared", TOKENS_EDIT),
    "size": ("shared", SIZE_EDIT),
    "transfer": ("shared", TRANSFER_EDIT),
    "contained": ("shared", CONTAINED_EDIT),
    "kept": ("shared", KEPT_EDIT),
    "early": ("shared", EARLY_EDIT),
    "corrupt": ("shared", CORRUPT_EDIT),
    "edge": ("shared", EDGE_EDIT),
    "idle-kept": ("shared", IDLE_EDIT),
    "stateless-saves": ("shared", STATELESS_EDIT),
    "stateless-resumes": ("shared", STATELESS_REUSE_EDIT),
    "reuse-chunk": ("shared", REUSE_CHUNK_EDIT),
    "reuse-short": ("shared", REUSE_SHORT_EDIT),
    "restore-keeps": ("shared", RESTORE_KEEPS_EDIT),
    "idle-busy": ("shared", IDLE_BUSY_EDIT),
    "load-keeps": ("shared", LOAD_KEEPS_EDIT),
    "save-error-ok": ("shared", SAVE_ERROR_OK_EDIT),
    "failed-restore-keeps": ("shared", FAILED_RESTORE_KEEPS_EDIT),
    "busy-erase": ("shared", BUSY_ERASE_EDIT),
    "name-unchecked": ("shared", NAME_UNCHECKED_EDIT),
    "checkpoints-always": ("shared", CHECKPOINTS_ALWAYS_EDIT),
    "shift-early": ("shared", SHIFT_EARLY_EDIT),
    "shift-discard": ("shared", SHIFT_DISCARD_EDIT),
    "block": ("shared", BLOCK_EDIT),
    "newest": ("shared", NEWEST_EDIT),
    "extra": ("shared", EXTRA_EDIT),
    "fail": ("shared", FAIL_EDIT),
    "renamed": ("shared", RENAME_EDIT),
    "layout": ("shared", LAYOUT_EDIT),
    "uncallable": ("shared", UNCALLABLE_EDIT),
    # a row of trees, each one change on the one before (pr, checkpoint-offset, then these): history's tests
    "offset-cap": ("shared", merged(CHECKPOINT_EDIT, CAP_EDIT)),
    "offset-cap-threshold": ("shared", merged(CHECKPOINT_EDIT, CAP_EDIT, THRESHOLD_EDIT)),
    "unknown-sem": ("master", UNKNOWN_SEMANTICS_EDIT),
}


def make_tree(dest: Path, semantics: str, edits: Edits | None = None) -> Path:
    """The pinned tree (``shared``: with our PR patch) exported to ``dest``, with ``edits`` applied: each
    ``(old, new)`` replaces text that must occur exactly once (an edit that no longer applies fails loudly)."""
    tree = export_pinned(semantics == "shared", dest)
    for rel, pairs in (edits or {}).items():
        text = (tree / rel).read_text()
        for old, new in pairs:
            assert text.count(old) == 1, f"{rel}: the edit's anchor {old[:60]!r} occurs {text.count(old)} times"
            text = text.replace(old, new)
        (tree / rel).write_text(text)
    return tree


BUILT = ("threshold", "checkpoint-offset", "cap", "room", "tokens", "size", "transfer", "fail", "renamed", "contained",
         "kept", "early", "corrupt", "edge", "idle-kept", "stateless-saves", "stateless-resumes", "reuse-chunk",
         "reuse-short", "shift-early", "shift-discard", "restore-keeps", "idle-busy", "load-keeps", "save-error-ok",
         "failed-restore-keeps", "busy-erase", "name-unchecked", "checkpoints-always",
         "block", "newest", "extra", "offset-cap", "offset-cap-threshold")
"""The users' trees the tests build (the others are the pinned builds, or are only read)."""
_MADE = pytest.StashKey[dict[str, Path]]()
_ROOT = pytest.StashKey[Path]()


def _trees_root(config: pytest.Config) -> Path:
    if _ROOT not in config.stash:
        config.stash[_ROOT] = Path(tempfile.mkdtemp(prefix="harness-trees-"))
        config.stash[_MADE] = {}
    return config.stash[_ROOT]


def _tree(config: pytest.Config, name: str) -> Path:
    root = _trees_root(config)
    made = config.stash[_MADE]
    if name not in made:
        semantics, edits = TREES[name]
        made[name] = make_tree(root / name, semantics, edits)
    return made[name]


def _build_users_trees(session: pytest.Session, say: Callable[[str], None]) -> None:
    for name in BUILT:
        t0 = time.monotonic()
        try:
            build_source(_tree(session.config, name), log=lambda _m: None)
        except HarnessError as e:  # the tests that need it fail with the same one line
            say(f"users' trees for the tests: {name} failed: {e}")
            continue
        say(f"users' trees for the tests: {name} built or cached in {time.monotonic() - t0:.0f} s")


def pytest_sessionfinish(session: pytest.Session) -> None:
    if _ROOT in session.config.stash:
        shutil.rmtree(session.config.stash[_ROOT], ignore_errors=True)


@pytest.fixture(scope="session")
def trees(request: pytest.FixtureRequest) -> Callable[[str], Path]:
    """``trees(name)``: the user's tree :data:`TREES` names, made once per session (built before the first
    test when the module is marked ``user_trees``)."""
    return lambda name: _tree(request.config, name)


REPO = Path(__file__).resolve().parents[1]
Trees = Callable[[str], Path]
"""The ``trees`` fixture's type: a tree's name in :data:`TREES` -> the tree, made (and built) once per session."""


def run_harness(*args: str, env: dict[str, str] | None = None,
                timeout: float = 1500) -> subprocess.CompletedProcess[str]:  # fmt: skip
    """``python -m harness ARGS`` from the repository root, as a user runs it, with ``env`` over the environment."""
    return subprocess.run([sys.executable, "-m", "harness", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=timeout, env={**os.environ, **(env or {})}, check=False)  # fmt: skip


def no_traceback(r: subprocess.CompletedProcess[str]) -> None:
    """A command's output holds no Python traceback (an error is one line with its exit code)."""
    assert "Traceback" not in r.stdout + r.stderr, r.stdout[-3000:] + r.stderr[-3000:]
