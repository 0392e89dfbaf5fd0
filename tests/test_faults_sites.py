"""Observed fault sites: the shim's stacks parsed and named, the model's site table against the pinned tree."""

from __future__ import annotations

import ast
import re
import shutil
from pathlib import Path

import pytest

from faults.native import run_native, run_new_demo
from faults.sites import (
    Frame,
    Stack,
    Symbolizer,
    allocation_text,
    demangle,
    observe,
    parse_stacks,
    qualified,
    site_of,
)
from harness.model.sites import SITES
from harness.trees.pinned import sdist_source

ROOT = Path(__file__).resolve().parents[1]
needs_cc = pytest.mark.skipif(
    shutil.which("gcc") is None or shutil.which("g++") is None, reason="the native layer needs gcc and g++"
)

# a failed allocation in llama-server's checkpoint creation, then the abort, as the shim writes them (the
# modules' paths do not exist here: frames are named from dladdr's exported symbols, demangled)
UPDATE_TGT = """
faultshim: fired 0

faultshim: failed allocation #2 (1073276 B, malloc), stack:
/cache/shim-0123.so(+0x15d3)[0x7f00000015d3] @0x15d3
/cache/shim-0123.so(malloc+0x10)[0x7f0000001c70] @0x1c70
/lib/x86_64-linux-gnu/libstdc++.so.6(_Znwm+0x1c)[0x7f000000958c] @0xa958c
/build/libllama-common.so.0(+0x2ab4c1)[0x7f00002ab4c1] @0x2ab4c1
/build/libllama-common.so.0(_ZN24common_prompt_checkpoint10update_tgtEP13llama_contextij+0x2f)[0x7f00002ab60f] @0x2ab60f
/build/libllama-server-impl.so(_ZN19server_context_impl17create_checkpointER11server_slotlii+0x1a2)[0x7f01] @0x1a2
/lib/x86_64-linux-gnu/libc.so.6(__libc_start_main+0x85)[0x7f0000027305] @0x27305

native stack (faultshim, signal SIGABRT):
/cache/shim-0123.so(+0x180e)[0x7f000000180e] @0x180e
/lib/x86_64-linux-gnu/libc.so.6(abort+0xd3)[0x7f0000026472] @0x26472
/build/libggml-base.so.0(ggml_abort+0x11f)[0x7f0000012f0f] @0x12f0f
/build/libllama-server-impl.so(_ZN19server_context_impl12update_slotsEv+0x9a2)[0x7f02] @0x9a2
"""


def test_the_shims_stacks_are_parsed_with_their_allocation_and_signal() -> None:
    allocation, abort = parse_stacks(UPDATE_TGT)
    assert (allocation.kind, allocation.nth, allocation.size, allocation.allocator) == (
        "allocation",
        2,
        1073276,
        "malloc",
    )
    assert len(allocation.frames) == 7 and allocation.frames[3] == Frame(
        "/build/libllama-common.so.0", "", 0x2AB4C1, allocation.frames[3].raw
    )
    assert (abort.kind, abort.signal, len(abort.frames)) == ("signal", "SIGABRT", 4)
    assert "native stack" not in allocation_text(UPDATE_TGT) and allocation_text(UPDATE_TGT).count("\n") == 7


def test_the_observed_site_is_the_first_llama_frame_that_is_not_the_allocator() -> None:
    seen = observe(UPDATE_TGT)
    # the static helper (no exported symbol, no module to read here) cannot be named: the next frame is
    assert str(seen.site) == "libllama-common.so.0:common_prompt_checkpoint::update_tgt"
    assert (seen.nth, seen.size, seen.failed, seen.signal) == (2, 1073276, 1, "SIGABRT")
    assert str(seen.died_at) == "libllama-server-impl.so:server_context_impl::update_slots"  # not ggml_abort
    assert seen.agrees_with("ckpt.update_tgt")
    assert not seen.agrees_with("ckpt_copy.tgt") and not seen.agrees_with("alloc.state_tgt")
    assert not seen.agrees_with("-") and not seen.agrees_with("no.such_site")
    assert observe("faultshim: fired 1\n").agrees_with("-")


def test_frames_outside_llama_cpp_are_never_the_site() -> None:
    stack = Stack("allocation", tuple(parse_stacks(UPDATE_TGT)[0].frames[:3]), 1, 64, "malloc")
    assert site_of(stack, Symbolizer()) is None  # the shim and libstdc++ only
    assert observe(UPDATE_TGT.replace("/build/", "/elsewhere/lib")).fault().startswith("? (no llama.cpp frame")


@pytest.mark.parametrize(
    ("mangled", "name"),
    [
        ("_ZN24common_prompt_checkpoint10update_tgtEP13llama_contextij", "common_prompt_checkpoint::update_tgt"),
        ("_ZN19server_prompt_cache5allocERK13server_promptmm", "server_prompt_cache::alloc"),
        ("_ZNK13server_tokens5cloneEv", "server_tokens::clone"),
        ("_ZN24common_prompt_checkpointC2ERKS_", "common_prompt_checkpoint::common_prompt_checkpoint"),
        ("_ZN13llama_contextC1ERK11llama_model", "llama_context::llama_context"),
        ("_Z13build_entriesi", "build_entries"),
        ("ggml_abort", "ggml_abort"),
        ("_ZNSt6vectorIhSaIhEE17_M_default_appendEm", "_ZNSt6vectorIhSaIhEE17_M_default_appendEm"),  # template
    ],
)
def test_the_fallback_demangler(mangled: str, name: str) -> None:
    assert demangle(mangled) == name


@pytest.mark.parametrize(
    ("full", "name"),
    [
        ("void std::vector<unsigned char, std::allocator<unsigned char> >::_M_default_append(unsigned long)",
         "std::vector<unsigned char, std::allocator<unsigned char> >::_M_default_append"),
        ("server_queue::process_new_tasks(bool) [clone .constprop.0]", "server_queue::process_new_tasks"),
        ("operator new(unsigned long)", "operator new"),
        ("server_context_impl::pre_decode()::{lambda(server_slot&)#6}::operator()(server_slot&) const",
         "server_context_impl::pre_decode()::{lambda(server_slot&)#6}::operator()"),
        ("ggml_abort", "ggml_abort"),
    ],
)  # fmt: skip
def test_qualified_names(full: str, name: str) -> None:
    assert qualified(full) == name


@needs_cc
def test_the_shim_writes_the_failed_allocations_stack_before_the_throw() -> None:
    """new_demo is built with -g: addr2line names its frames with their file and line."""
    caught = run_new_demo(3, catch=True, count=12)
    (stack,) = parse_stacks(caught.child.stacks)  # the throw was caught: no signal stack
    assert (stack.kind, stack.nth, stack.size, stack.allocator) == ("allocation", 3, 4096 + 2, "malloc")
    named = Symbolizer().name(stack.frames)
    demo = next(s for s in named if s.function == "build_entries")
    assert (demo.file, demo.library.startswith("new_demo-")) == ("new_demo.cpp", True) and demo.line is not None
    assert any(s.function == "operator new" for s in named)
    died = run_new_demo(3, catch=False, count=12)
    assert [s.kind for s in parse_stacks(died.child.stacks)] == ["allocation", "signal"]


@needs_cc
def test_a_persistent_fault_writes_a_few_stacks_not_one_per_allocation() -> None:
    code = (
        "import ctypes\nfrom faults.native import ShimControl\nshim = ShimControl()\nlibc = ctypes.CDLL(None)\n"
        "libc.malloc.restype = ctypes.c_void_p\nshim.arm(2, persistent=True)\n"
        "got = [libc.malloc(1 << 20) is None for _ in range(10)]\nprint(shim.disarm(), sum(got))\n"
    )
    r = run_native(["python", "-c", f"import sys; sys.path.insert(0, {str(ROOT)!r})\n" + code], timeout=30)
    assert r.stdout.split() == ["9", "9"], r
    assert [s.nth for s in parse_stacks(r.stacks)] == [2, 3, 4, 5]  # at most four stacks an arming


# ---- the model's site table ------------------------------------------------------------------

_SITE = re.compile(r"^[a-z_]+\.[a-z_]+$")
# what each site's line at 0c1e570 holds (the table's file:line, checked against the pinned tree)
_LINE_HOLDS = {
    "alloc.state_tgt": "state_data_tgt.resize(state_size_tgt)",
    "alloc.state_dft": "state_data_dft.resize(state_size_dft)",
    "tokens.clone": "server_tokens server_tokens::clone() const",
    "ckpt_copy.node": "/*.checkpoints =*/ prompt.checkpoints",
    "ckpt_copy.tgt": "/*.checkpoints =*/ prompt.checkpoints",
    "ckpt_copy.dft": "/*.checkpoints =*/ prompt.checkpoints",
    "ckpt_copy.spec": "/*.checkpoints =*/ prompt.checkpoints",
    "alloc.states_push_back": "states.push_back({",
    "ckpt_list.node": "slot.prompt.checkpoints.emplace_back()",
    "ckpt.update_tgt": "data_tgt.resize(ckpt_size)",
    "ckpt.update_dft": "data_dft.resize(ckpt_size)",
    "ckpt.update_spec": "data.resize(sizeof(llama_pos) + g.size() * sizeof(float))",
    "tgt.state_read": "size_t llama_context::state_seq_set_data(",
    "dft.state_read": "size_t llama_context::state_seq_set_data(",
    "slot_file.write": "std::fwrite(ptr, len, 1, fp)",
    "slot_file.read_ckpt": "buf.resize(n);",  # at b11549 (tests/test_switches.py reads it there)
}


def _model_site_literals() -> set[str]:
    found = set()
    for path in (ROOT / "harness" / "model").glob("*.py"):
        if path.name == "sites.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and _SITE.match(node.value):
                found.add(node.value)
    return found | {"tgt.state_read", "dft.state_read"}  # f"{self.name}.state_read" in provider.py


def test_every_site_of_the_model_is_in_the_table_and_nothing_else() -> None:
    assert _model_site_literals() == set(SITES)
    assert set(_LINE_HOLDS) == set(SITES)


def test_the_tables_lines_are_the_pinned_trees() -> None:
    tree = sdist_source()
    for site, up in SITES.items():
        if up.since:  # upstream's after the pin: read at its build by tests/test_switches.py
            continue
        file, line = up.where.rsplit(":", 1)
        text = (tree / file).read_text().splitlines()[int(line) - 1]
        assert _LINE_HOLDS[site] in text, f"{site}: {up.where} is {text.strip()!r}"
