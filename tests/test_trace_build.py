"""trace.c for every API generation (harness/trace/calls.py: trace_features, build_trace): what a tree's llama.h
has decides what the interposer is compiled with."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.trace.calls import TRACE_OPTIONAL_FIELDS, build_trace, trace_features
from harness.trees.tree import check_tree

PINNED_LIKE = """
struct llama_context_params {
    uint32_t n_ctx;
    uint32_t n_rs_seq;       // recurrent states
    uint32_t n_outputs_max;
    uint32_t n_outputs_max_per_seq;
    enum llama_context_type ctx_type;
    struct llama_context * ctx_other;
};
LLAMA_API int32_t llama_process(struct llama_context * ctx, enum llama_process_type type, struct llama_batch_ext * b);
"""


def test_the_features_are_read_from_the_header() -> None:
    assert trace_features(PINNED_LIKE) == {"BATCH_EXT": True, **dict.fromkeys(TRACE_OPTIONAL_FIELDS, True)}
    # b10280's shape: no extended batch API, no n_outputs_max_per_seq; a field named in a comment is not one
    old = PINNED_LIKE.replace("    uint32_t n_outputs_max_per_seq;\n", "    // n_outputs_max_per_seq;? later\n")
    old = old[: old.index("LLAMA_API")] + "LLAMA_API int32_t llama_decode(struct llama_context * c, llama_batch b);"
    got = trace_features(old)
    assert not got["BATCH_EXT"] and not got["n_outputs_max_per_seq"] and got["n_rs_seq"] and got["ctx_other"]
    assert trace_features("") == {"BATCH_EXT": False, **dict.fromkeys(TRACE_OPTIONAL_FIELDS, False)}


@pytest.mark.user_trees
def test_trace_c_builds_against_a_tree_from_before_the_extended_batch_api() -> None:
    """xllamacpp 2026.8.10566 (upstream b10566): llama_decode, no llama_process; trace.c compiled against the
    pinned API alone failed there ("parameter 3 ('embd') has incomplete type")."""
    tree = check_tree(Path("pypi:xllamacpp==2026.8.10566"))
    assert not trace_features((tree / "include" / "llama.h").read_text())["BATCH_EXT"]
    assert build_trace(tree).is_file()
