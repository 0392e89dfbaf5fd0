"""Why a reached line's branch outcome was never taken (harness/coverage/branches.py): the table, read on the pinned
sources' own lines. Model-only: the build tier's tests/test_coverage.py measures a real gcov run."""

from __future__ import annotations

from harness.coverage.branches import BRANCH_REASONS, branch_reason
from harness.coverage.gcovr import statement_at

SLOT_TASK = "server_context_impl::process_single_task(server_task&&, bool)"


def _why(text: str, function: str = "f") -> str:
    r = branch_reason(text, function)
    return "unexplained" if r is None else r.reason


def test_each_kind_of_line_gets_its_reason() -> None:
    assert _why('            SRV_TRC("%s", " - prompt is already in the cache, skipping\\n");').startswith("a log line")
    assert _why('    LLAMA_LOG_ERROR("%s: failed\\n", __func__);').startswith("a log line")
    assert _why("                GGML_ASSERT(ctx_dft);").startswith("an assertion that holds")
    assert _why("    } catch (const std::bad_alloc & e) {").startswith("the catch's type test")
    assert _why("        while (!states.empty() && size() > limit_size) {", "server_prompt_cache::update()").startswith(
        "an empty cache"
    )
    # a function pattern: the same text elsewhere is not explained by the row
    assert _why("    if (limit_tokens > 0) {", "server_prompt_cache::update()").startswith("limit_tokens is")
    assert _why("    if (limit_tokens > 0) {", "other") == "unexplained"


def test_a_branch_no_request_can_take_says_why_and_none_is_left_to_send() -> None:
    neg = branch_reason("                    if (slot == nullptr) {", SLOT_TASK)
    assert neg is not None and not neg.reachable and "wraps to a slot" in neg.reason
    ret = branch_reason("            if (ret) {", "server_context_impl::get_available_slot(server_task const&)")
    assert ret is not None and not ret.reachable and "size_t" in ret.reason
    erase = branch_reason("    if (result->is_error()) {", "server_routes::handle_slots_erase(server_http_req const&)")
    assert erase is not None and not erase.reachable
    # the requests the rows once named as reachable are the edge step's cases now (harness/load/edges.py): a
    # branch they take needs no row, and none is left that a request could take but the gate does not send
    assert branch_reason("                    if (slot->is_processing()) {", SLOT_TASK) is None
    assert [r.reason for r in BRANCH_REASONS if r.reachable] == []


def test_a_statement_over_several_lines_is_read_whole() -> None:
    text = ["    do_checkpoint = do_checkpoint && (",
            "        ctx_tgt_seq_rm_type == COMMON_CONTEXT_SEQ_RM_TYPE_FULL ||",
            "        n_swa > 0);",
            "    bool has_mtmd = false;"]  # fmt: skip
    assert statement_at(text, 1) == "\n".join(text[:3])
    assert statement_at(text, 4) == text[3]
    assert _why(statement_at(["    x = y ||", "        t == COMMON_CONTEXT_SEQ_RM_TYPE_RS;"], 1)) == "unexplained"
    rs = statement_at(["    x = (y ||", "        t == COMMON_CONTEXT_SEQ_RM_TYPE_RS);"], 1)
    assert _why(rs).startswith("a memory")
