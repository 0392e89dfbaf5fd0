"""The upstream changes the model follows, read from a tree (harness/trees/switches.py): text, the pinned tree, and
a real upstream tree from the package index (b11549, which has #26004)."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest

from fixtures.gguf import model_path
from harness.model.sites import SITES
from harness.targets.libllama import make_llama_server
from harness.targets.llama_server import ServerConfig
from harness.targets.server_log import CacheLog
from harness.targets.synthetic import make_server
from harness.trees.pinned import sdist_source
from harness.trees.switches import (
    COMMON_H,
    PINNED,
    SERVER_CONTEXT,
    SERVER_TASK_CPP,
    SERVER_TASK_H,
    read_switches,
    switches_from_text,
    switches_of_binary,
)
from harness.trees.tree import check_tree


def test_each_switch_is_read_with_the_line_that_decided_it() -> None:
    server = "// a comment: SLOT_CKPT_MAGIC\nstruct x {\n    static constexpr uint32_t SLOT_CKPT_MAGIC = 1;\n"
    common = "struct common_prompt_checkpoint {\n    bool load_tgt(llama_context * ctx, int seq, int flags) const;\n"
    sw = switches_from_text({SERVER_CONTEXT: server, COMMON_H: common})
    assert sw.slot_file_checkpoints.on and sw.slot_file_checkpoints.where == f"{SERVER_CONTEXT}:3"
    assert sw.checkpoint_load_bool.on and sw.checkpoint_load_bool.where == f"{COMMON_H}:2"
    old = switches_from_text({SERVER_CONTEXT: "// SLOT_CKPT_MAGIC\n", COMMON_H: "void load_tgt(llama_context * c);"})
    assert not old.slot_file_checkpoints.on and not old.checkpoint_load_bool.on
    unreadable = switches_from_text({SERVER_CONTEXT: None, COMMON_H: None, SERVER_TASK_H: None, SERVER_TASK_CPP: None})
    assert unreadable.all() == tuple(
        type(s)(s.name, False, f"{p} not readable: the pinned behaviour", s.change)
        for s, p in zip(PINNED.all(), (SERVER_CONTEXT, COMMON_H, SERVER_TASK_H, SERVER_CONTEXT, SERVER_CONTEXT,
                                       SERVER_TASK_CPP), strict=True)
    )


def test_a_tree_without_server_prompt_cache_is_read_as_replaced_with_where() -> None:
    """The block cache upstream has spoken of: no ``struct server_prompt_cache`` in server-task.h is the switch on
    (the model's policy describes nothing there); the struct's line is it off, as on the pinned tree."""
    has = "// struct server_prompt_cache { in a comment\n\nstruct server_prompt_cache {\n    int x;\n};\n"
    kept = switches_from_text({SERVER_TASK_H: has}).prompt_cache_replaced
    assert not kept.on and kept.where == f"{SERVER_TASK_H}:3"
    gone = switches_from_text({SERVER_TASK_H: "struct server_block_cache {\n};\n"}).prompt_cache_replaced
    assert gone.on and gone.where == f"not in {SERVER_TASK_H}"
    assert "prompt_cache_replaced: on (server_prompt_cache replaced" in gone.line()


def test_an_idle_pass_that_needs_a_unified_kv_is_read_from_the_start_and_turns_the_models_pass_off() -> None:
    """b9093's server-context.cpp:1010-1013: ``--cache-idle-slots`` with a per-slot KV is turned off at start; the
    model, given that tree's switches, runs no idle-slot pass on a per-slot KV and still runs it on a unified one."""
    start = ("        if (params_base.cache_idle_slots) {\n            if (!params_base.kv_unified) {\n"
             "                SRV_WRN(\"%s: --cache-idle-slots requires --kv-unified, disabling\\n\", __func__);\n")
    sw = switches_from_text({SERVER_CONTEXT: "// before\n" + start})
    assert sw.idle_pass_needs_unified.on and sw.idle_pass_needs_unified.where == f"{SERVER_CONTEXT}:2"
    later = "        if (params_base.cache_idle_slots) {\n            if (params_base.cache_ram_mib == 0) {\n"
    assert not switches_from_text({SERVER_CONTEXT: later}).idle_pass_needs_unified.on
    for unified, runs in ((False, False), (True, True)):
        params = ServerConfig("llama", kv_unified=unified).params(sw)
        assert params.idle_pass_needs_unified
        server = make_llama_server("master", model_path("llama"), params=params, n_ctx=2048, check_restores=False)
        assert server.params.cache_idle_slots is runs
        pinned = make_llama_server("master", model_path("llama"), params=ServerConfig("llama", kv_unified=unified)
                                   .params(), n_ctx=2048, check_restores=False)  # fmt: skip
        assert pinned.params.cache_idle_slots


def test_an_end_checkpoint_held_to_the_spacing_rule_is_read_and_the_model_skips_it() -> None:
    """b9780's server-context.cpp:3546: the spacing statement lets no ``near_prompt_end`` through, so a 120-token
    prompt at ``-cms 64`` gets a checkpoint at 52 and none at 116 (116 is not past 52 + 64); 0c1e570's (:3606)
    makes both."""
    old = ("        // no need to create checkpoints that are too close together, unless it's the last user message\n"
           "        do_checkpoint = do_checkpoint && (slot.prompt.checkpoints.empty() || is_last_user_message || "
           "n_tokens_start > slot.prompt.checkpoints.back().n_tokens + params_base.checkpoint_min_step);\n")
    new = old.replace("is_last_user_message || ", "is_last_user_message || near_prompt_end || ")
    sw = switches_from_text({SERVER_CONTEXT: "// near_prompt_end\n" + old})
    assert sw.end_checkpoint_spaced.on and sw.end_checkpoint_spaced.where == f"{SERVER_CONTEXT}:3"
    assert not switches_from_text({SERVER_CONTEXT: new}).end_checkpoint_spaced.on
    shapeless = switches_from_text({SERVER_CONTEXT: "int x;\n"}).end_checkpoint_spaced
    assert not shapeless.on and shapeless.where.startswith("no spacing statement")
    made = {}
    for spaced in (False, True):
        cfg = ServerConfig("jamba", n_parallel=1, ctx_checkpoints=4, checkpoint_min_step=64, n_ubatch=64)
        params = cfg.params(sw if spaced else PINNED)
        assert params.end_checkpoint_spaced is spaced
        server = make_server("master", "hybrid", params=params, n_ctx=2048)
        server.handle_completion(tuple(3 + (i * 17) % 250 for i in range(120)), n_predict=1)
        server.run_until_idle()
        made[spaced] = [c.n_tokens for c in server.slots[0].prompt.checkpoints]
    assert made == {False: [52, 116], True: [52]}


ALLOC = """server_prompt_cache_state * server_prompt_cache::alloc(const server_prompt & prompt, size_t a, size_t b) {
    // remove any cached prompts that are fully contained in the current prompt
%s    std::vector<uint8_t> state_data_tgt;
}

bool server_prompt_cache::load(server_prompt & prompt) {
    SRV_WRN(" - making room for prompt cache entry, removing oldest entry (size = %%.3f MiB)\\n", 1.0);
}
"""
ROOM = """    while (!states.empty() && size() + state_size_new > limit_size) {
        SRV_WRN(" - making room for prompt cache entry, removing oldest entry (size = %.3f MiB)\\n", 1.0);
    }
"""


def test_an_alloc_that_makes_no_room_is_read_and_followed_by_the_model_and_the_log_reader() -> None:
    """b9780's server-task.cpp:1623: ``server_prompt_cache::alloc`` neither skips an over-limit entry nor makes
    room (the line in another function does not count); the model then saves past the limit and lets update()
    evict, and the log reader takes update()'s eviction for size as that version's design."""
    old = switches_from_text({SERVER_TASK_CPP: ALLOC % ""}).alloc_without_room
    assert old.on and old.where == f"{SERVER_TASK_CPP}:1"
    new = switches_from_text({SERVER_TASK_CPP: ALLOC % ROOM}).alloc_without_room
    assert not new.on and new.where == f"{SERVER_TASK_CPP}:4"
    assert not switches_from_text({SERVER_TASK_CPP: "int x;"}).alloc_without_room.on
    sw = switches_from_text({SERVER_TASK_CPP: ALLOC % ""})
    evicted = {}
    for without in (False, True):
        params = ServerConfig("llama", n_parallel=1, cache_ram_mib=1).params(sw if without else PINNED)
        params = dataclasses.replace(params, cache_ram_unit=1)  # a limit of 1 byte: every save is over it
        server = make_server("master", "transformer", params=params, n_ctx=2048)
        for k in range(3):
            server.handle_completion(tuple(3 + (i * (k + 5)) % 250 for i in range(40)), n_predict=1)
            server.run_until_idle()
        assert server.prompt_cache is not None
        cache = server.prompt_cache
        evicted[without] = (cache.makes_room, any("exceeds cache size limit" in m for m in cache.log), len(cache))
    # pinned: every save over the limit is skipped; before b10001 each goes in and update() keeps the newest one
    assert evicted == {False: (True, True, 0), True: (False, False, 1)}
    line = "srv update:  - cache size limit reached, removing oldest entry (size = 0.049 MiB)\n"
    assert [p.property for p in CacheLog(4).feed(line)] == ["alloc_eviction"]
    assert CacheLog(4, alloc_makes_room=False).feed(line) == []


def test_the_log_reader_follows_the_tree_of_the_binary_its_log_names(tmp_path: Path) -> None:
    """ServerProcess writes its command line first in the log ("$ BINARY ..."): the reader follows that binary's
    tree (a harness build's ``build-info.json`` names it), so every reader of every step judges ``alloc_eviction``
    as the version that wrote the log does, and a log without the line keeps the pinned rule."""
    tree = tmp_path / "tree"
    (tree / "include").mkdir(parents=True)
    (tree / "include" / "llama.h").write_text("struct llama_context_params { int n_ctx; };\n")
    (tree / "tools" / "server").mkdir(parents=True)
    (tree / "tools" / "server" / "server-task.cpp").write_text(ALLOC % "")
    build = tmp_path / "build"
    build.mkdir()
    (build / "build-info.json").write_text(json.dumps({"source": str(tree)}))
    evicted = "srv update:  - cache size limit reached, removing oldest entry (size = 0.049 MiB)\n"
    old = f"$ {build / 'llama-server'} --host 127.0.0.1 --port 8080 -m x.gguf\n" + evicted
    assert CacheLog(4).feed(old) == []
    (tree / "tools" / "server" / "server-task.cpp").write_text(ALLOC % ROOM)
    switches_of_binary.cache_clear()  # the same path, another tree: read again
    assert [p.property for p in CacheLog(4).feed(old)] == ["alloc_eviction"]


def test_the_pinned_tree_has_every_switch_off() -> None:
    sw = read_switches(sdist_source())
    assert [s.on for s in sw.all()] == [False] * 6
    assert "not in tools/server/server-context.cpp" in sw.slot_file_checkpoints.line()
    assert sw.prompt_cache_replaced.where.startswith(f"{SERVER_TASK_H}:")


@pytest.mark.user_trees
def test_upstream_b11549_has_26004(tmp_path: Path) -> None:
    """xllamacpp 2026.10.11549 ships upstream b11549, two days after #26004 merged: both switches on."""
    tree = check_tree(Path("pypi:xllamacpp==2026.10.11549"))
    sw = read_switches(tree)
    assert sw.slot_file_checkpoints.on and sw.slot_file_checkpoints.where.startswith(f"{SERVER_CONTEXT}:")
    assert sw.checkpoint_load_bool.on and sw.checkpoint_load_bool.where.startswith(f"{COMMON_H}:")
    b11434 = read_switches(check_tree(Path("b11434")))  # before it: off
    assert not sw.end_checkpoint_spaced.on and not b11434.end_checkpoint_spaced.on
    assert not sw.alloc_without_room.on and read_switches(check_tree(Path("b9780"))).alloc_without_room.on
    assert not b11434.slot_file_checkpoints.on and not b11434.checkpoint_load_bool.on
    assert not sw.prompt_cache_replaced.on and not b11434.prompt_cache_replaced.on  # both still have it
    for site, up in SITES.items():  # the model's allocations of #26004, where b11549 makes them
        if up.since == "b11549":
            file, line = up.where.rsplit(":", 1)
            assert "buf.resize(n);" in (tree / file).read_text().splitlines()[int(line) - 1], site
