"""Reading a tree's semantics from its headers: every form PR #27451's payloads take, and what cannot be told.

The header texts are ours, written in the forms the inference must read: master's plain vectors, a
``shared_ptr`` named directly, through an alias in the struct (our patch) or at namespace scope, and
through a small wrapper class of the tree's own (the form the PR's branch uses), one or two levels deep.
The pinned tree and the pinned tree with our patch are read for real.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from harness.trees.pinned import PATCH_PATH, sdist_source
from harness.trees.semantics import infer_semantics, infer_semantics_from_text


def _header(payload: str, before: str = "") -> dict[str, str]:
    return {
        "common/common.h": f"""
#pragma once
#include <vector>
#include <memory>
{before}
struct common_prompt_checkpoint {{
    int64_t n_tokens;

    // (optional) id of the task that created the checkpoint
    int id_task = -1;

    llama_pos pos_min;
    llama_pos pos_max;

{payload}

    // (optional) speculative-decoding implementation state stashed with the checkpoint
    std::vector<uint8_t> data_spec;

    size_t size() const;
    bool empty() const;
    void clear();

    void update_tgt(llama_context * ctx, llama_seq_id seq_id, llama_state_seq_flags flags);
    void load_tgt(llama_context * ctx, llama_seq_id seq_id, llama_state_seq_flags flags) const;
}};
"""
    }


MASTER = "    std::vector<uint8_t> data_tgt;\n    std::vector<uint8_t> data_dft;"

WRAPPER = """
class common_shared_state_buffer {
public:
    size_t size() const {
        return storage ? storage->size() : 0;
    }

    const uint8_t * data() const { return storage ? storage->data() : nullptr; }

    // Allocate fresh storage for a complete state snapshot ("never modified in place").
    uint8_t * reset(size_t n) {
        storage = std::make_shared<std::vector<uint8_t>>(n);
        return storage->data();
    }

    void clear() { storage.reset(); }

private:
    std::shared_ptr<std::vector<uint8_t>> storage;
};
"""


def test_master_plain_vectors() -> None:
    got = infer_semantics_from_text(_header(MASTER))
    assert got.semantics == "master"
    assert "data_tgt and ::data_dft are std::vector<uint8_t>" in got.why and "common/common.h:" in got.why


def test_a_comment_or_another_member_naming_shared_ptr_does_not_make_it_shared() -> None:
    """The old reading looked for the word; a comment and a shared_ptr member that is not a payload are words."""
    payload = (
        "    // TODO: std::shared_ptr<std::vector<uint8_t>> would avoid the copy (PR #27451)\n"
        "    std::shared_ptr<int> unrelated;\n" + MASTER
    )
    assert infer_semantics_from_text(_header(payload)).semantics == "master"


def test_shared_ptr_named_directly() -> None:
    payload = "\n".join(f"    std::shared_ptr<const std::vector<uint8_t>> {m};" for m in ("data_tgt", "data_dft"))
    got = infer_semantics_from_text(_header(payload))
    assert got.semantics == "shared" and "std::shared_ptr<std::vector<uint8_t>>" in got.why


def test_shared_ptr_through_an_alias_in_the_struct() -> None:
    """Our patch's form: ``using data_ptr = std::shared_ptr<const std::vector<uint8_t>>;`` inside the struct."""
    payload = (
        "    using data_ptr = std::shared_ptr<const std::vector<uint8_t>>;\n\n"
        "    data_ptr data_tgt;\n    data_ptr data_dft;"
    )
    got = infer_semantics_from_text(_header(payload))
    assert got.semantics == "shared" and got.why.count("data_ptr = std::shared_ptr") == 1


def test_shared_ptr_through_a_namespace_alias_and_a_typedef() -> None:
    for before in (
        "using ckpt_bytes = std::shared_ptr<const std::vector<uint8_t>>;",
        "typedef std::shared_ptr<const std::vector<uint8_t>> ckpt_bytes;",
    ):
        got = infer_semantics_from_text(_header("    ckpt_bytes data_tgt;\n    ckpt_bytes data_dft;", before))
        assert got.semantics == "shared", (before, got)


def test_a_wrapper_class_holding_a_shared_ptr() -> None:
    """The PR branch's form: a class of the tree's own with a private ``shared_ptr`` member and inline methods."""
    payload = (
        "    // Snapshot payloads are immutable after capture and can be shared\n"
        "    common_shared_state_buffer data_tgt;\n    common_shared_state_buffer data_dft;"
    )
    got = infer_semantics_from_text(_header(payload, WRAPPER))
    assert got.semantics == "shared"
    assert "common_shared_state_buffer (common/common.h:" in got.why and "storage" in got.why


def test_the_wrapper_in_another_header() -> None:
    headers = _header("    common_shared_state_buffer data_tgt;\n    common_shared_state_buffer data_dft;")
    headers["common/state-buffer.h"] = WRAPPER
    got = infer_semantics_from_text(headers)
    assert got.semantics == "shared" and "common/state-buffer.h:" in got.why


def test_two_levels_of_wrapping() -> None:
    before = "using blob = std::shared_ptr<std::vector<uint8_t>>;\nstruct handle { blob b; size_t n = 0; };\n"
    got = infer_semantics_from_text(_header("    handle data_tgt;\n    handle data_dft;", before))
    assert got.semantics == "shared" and "blob" in got.why


def test_a_wrapper_holding_a_vector_by_value_is_a_deep_copy() -> None:
    before = "struct bytes_box { std::vector<uint8_t> bytes; };\n"
    assert infer_semantics_from_text(_header("    bytes_box data_tgt;\n    bytes_box data_dft;", before)).semantics == (
        "master"
    )


@pytest.mark.parametrize(
    ("payload", "before", "said"),
    [
        # neither shared nor a plain copy
        ("    std::unique_ptr<std::vector<uint8_t>> data_tgt;\n    std::unique_ptr<std::vector<uint8_t>> data_dft;", "",
         "std::unique_ptr"),
        # one shared, one copied
        ("    std::shared_ptr<std::vector<uint8_t>> data_tgt;\n    std::vector<uint8_t> data_dft;", "", "cannot tell"),
        # a type the tree does not define
        ("    state_blob data_tgt;\n    state_blob data_dft;", "", "no definition found"),
        # the payloads renamed away
        ("    std::vector<uint8_t> tgt;\n    std::vector<uint8_t> dft;", "", "has no data_tgt or data_dft"),
        # an alias chain longer than the reader follows
        ("    d data_tgt;\n    d data_dft;",
         "using a = std::shared_ptr<int>;\nusing b = a;\nusing c = b;\nusing d = c;", "not followed past"),
    ],
)  # fmt: skip
def test_what_cannot_be_told_says_so(payload: str, before: str, said: str) -> None:
    got = infer_semantics_from_text(_header(payload, before))
    assert got.semantics is None and said in got.why, got


def test_no_struct_at_all() -> None:
    got = infer_semantics_from_text({"common/common.h": "struct other { std::shared_ptr<int> data_tgt; };\n"})
    assert got.semantics is None and "no definition of struct common_prompt_checkpoint" in got.why


@pytest.mark.parametrize(
    ("payload", "semantics"),
    [("    std::vector<uint8_t> data;", "master"), ("    std::shared_ptr<const std::vector<uint8_t>> data;", "shared")],
)
def test_the_older_spelling_server_prompt_checkpoint(payload: str, semantics: str) -> None:
    """Upstream before ``common_prompt_checkpoint`` (b9093, tools/server/server-task.h:568): one payload, ``data``."""
    text = f"struct server_prompt_checkpoint {{\n    llama_pos pos_min;\n{payload}\n}};\n"
    got = infer_semantics_from_text({"common/common.h": "", "tools/server/server-task.h": text})
    assert got.semantics == semantics and "server_prompt_checkpoint::data is" in got.why, got
    assert "tools/server/server-task.h:1" in got.why


def test_the_pinned_tree_and_our_patch(tmp_path: Path) -> None:
    vendored = sdist_source()
    got = infer_semantics(vendored)
    assert got.semantics == "master" and "common/common.h:1232" in got.why
    tree = tmp_path / "patched"
    touched = ["common/common.h", "common/common.cpp", *(f"tools/server/server-{n}.cpp" for n in ("task", "context"))]
    for rel in touched:
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        (tree / rel).write_bytes((vendored / rel).read_bytes())
    subprocess.run(["patch", "-p1", "-s", "-d", str(tree), "-i", str(PATCH_PATH)], check=True)
    got = infer_semantics(tree)
    assert got.semantics == "shared" and "data_ptr = std::shared_ptr<std::vector<uint8_t>>" in got.why
