"""The libllama driver bound from a tree's own header (harness/trees/driver.py).

Model-only: the header's text, and the driver compiled against the pinned tree's header and linked to the
libllama llama-cpp-python installed (the same commit, 0c1e570), run beside llama-cpp-python's own bindings.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import llama_cpp
import pytest

from harness.errors import HarnessLimit
from harness.trees.binding import CALLS, arity, bind, binding, members, prototypes
from harness.trees.driver import DRIVER_ENV
from harness.trees.pinned import sdist_source

ROOT = Path(__file__).resolve().parents[1]
PACKAGE_LIB = Path(llama_cpp.__file__).parent / "lib"


@pytest.fixture(scope="module")
def pinned() -> Path:
    return sdist_source()


@pytest.fixture(scope="module")
def header(pinned: Path) -> str:
    return (pinned / "include" / "llama.h").read_text()


def test_prototypes_are_the_headers_own_declarations(header: str) -> None:
    protos = prototypes(header)
    assert protos["llama_decode"] == "int32_t llama_decode(struct llama_context * ctx, struct llama_batch batch);"
    assert protos["llama_backend_init"] == "void llama_backend_init(void);"
    assert "LLAMA_API" not in " ".join(protos.values())
    assert arity(protos["llama_memory_seq_cp"]) == 5
    assert arity(protos["llama_backend_init"]) == 0


def test_every_call_of_the_harness_is_in_the_pinned_header(header: str) -> None:
    b = binding(header)
    assert b.refused == () and b.absent == ()
    assert all(f" {name}(" in b.cdef for name in CALLS)


def test_members_are_declared_with_the_headers_types(header: str) -> None:
    got = members(header, "llama_batch", ("token", "seq_id", "logits", "no_such_member"))
    assert got == ["llama_token * token;", "llama_seq_id ** seq_id;", "int8_t * logits;"]


def test_an_older_batch_api_is_absent_not_refused(header: str) -> None:
    old = header.replace("llama_batch_ext_init", "llama_batch_ext_init_gone").replace("llama_process(", "gone(")
    b = binding(old)
    assert b.refused == ()
    assert "llama_batch_ext_init" in b.absent and "llama_process" in b.absent


def test_a_changed_parameter_list_is_refused_naming_the_function(header: str) -> None:
    changed = header.replace(
        "struct llama_context * ctx,\n              struct llama_batch   batch);",
        "struct llama_context * ctx,\n              struct llama_batch   batch,\n              int32_t extra);",
    )
    assert changed != header, "the pinned header's llama_decode is not written as this test expects"
    b = binding(changed)
    assert b.refused == ("llama_decode takes 3 parameters in llama.h, the harness passes 2",)
    missing = binding(header.replace("llama_get_memory", "llama_get_memory_v2"))
    assert missing.refused == ("llama_get_memory is not in llama.h",)


def _tree_copy(pinned: Path, dst: Path) -> Path:
    for sub in ("include", "ggml/include"):
        shutil.copytree(pinned / sub, dst / sub)
    return dst


def test_a_struct_that_grew_is_absorbed_by_the_compiler(pinned: Path, tmp_path: Path) -> None:
    """b11549's ``llama_context_params`` gained ``moe_cache_size``: the driver compiles against it, its size is
    the tree's, and the members the harness sets stay where the tree puts them."""
    grown = _tree_copy(pinned, tmp_path / "grown")
    h = grown / "include" / "llama.h"
    text = h.read_text()
    anchor = "        uint32_t n_ctx;"
    assert anchor in text
    h.write_text(text.replace(anchor, "        uint64_t moe_cache_size;\n" + anchor, 1))
    sizes = {}
    for name, tree in (("pinned", pinned), ("grown", grown)):
        path = bind(tree, PACKAGE_LIB)
        code = (
            "import importlib.util, importlib.machinery, json, sys\n"
            "p = sys.argv[1]; n = p.rsplit('/', 1)[1].split('.')[0]\n"
            "l = importlib.machinery.ExtensionFileLoader(n, p)\n"
            "m = importlib.util.module_from_spec(importlib.util.spec_from_file_location(n, p, loader=l))\n"
            "l.exec_module(m)\n"
            "print(json.dumps([m.ffi.sizeof('struct llama_context_params'),"
            " m.ffi.offsetof('struct llama_context_params', 'n_ctx')]))\n"
        )
        out = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, check=True)
        sizes[name] = json.loads(out.stdout)
    assert sizes["grown"][0] == sizes["pinned"][0] + 8
    assert sizes["grown"][1] == sizes["pinned"][1] + 8


def test_a_tree_it_cannot_drive_is_one_line(pinned: Path, tmp_path: Path) -> None:
    tree = _tree_copy(pinned, tmp_path / "renamed")
    h = tree / "include" / "llama.h"
    h.write_text(h.read_text().replace("llama_memory_seq_rm", "llama_memory_seq_remove"))
    with pytest.raises(HarnessLimit, match=r"cannot drive the libllama of .*: llama_memory_seq_rm is not in llama.h"):
        bind(tree, PACKAGE_LIB)


_FIGURES = """
import hashlib, json, sys
from fixtures.gguf import model_path
from harness.targets.libllama import LlamaProvider, load_model
from harness.trees.driver import libllama
out = {"driver": libllama().name}
for arch in ("llama", "mamba", "jamba", "gemma2"):
    prov = LlamaProvider(load_model(model_path(arch)), n_seq=2, n_ctx=256, n_batch=16, n_ubatch=8)
    rets = [prov.decode(0, [3 + i % 50 for i in range(14)], 0)]
    state = prov.state_seq_get_data_ext(0, 0)
    prov.memory_seq_cp(0, 1, -1, -1)
    rets.append(prov.decode(1, [9, 8, 7], 14))
    state1 = prov.state_seq_get_data_ext(1, 0)
    prov.memory_seq_rm(1, -1, -1)
    rets.append(prov.state_seq_set_data_ext(1, state, 0))
    rets.append(prov.decode(1, [5, 6], 14))
    digest = hashlib.sha256(state + state1 + prov.state_seq_get_data_ext(1, 0)).hexdigest()[:16]
    out[arch] = [rets, len(state), digest, prov.memory_seq_pos_max(1), prov.restore_checks, len(prov.mismatches)]
    prov.close()
print(json.dumps(out))
"""


def _figures(env: dict[str, str]) -> dict[str, object]:
    env = {**env, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, "-c", _FIGURES], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-2000:]
    data: dict[str, object] = json.loads(proc.stdout.strip().splitlines()[-1])
    return data


def test_both_drivers_give_the_same_figures_on_the_pinned_library(pinned: Path) -> None:
    """llama-cpp-python's bindings and the driver bound from the pinned header, on one libllama.so: the same
    decode returns, state sizes and bytes, logits."""
    base = {k: v for k, v in os.environ.items() if k not in (DRIVER_ENV, "LLAMA_CPP_LIB_PATH")}
    package = _figures(base)
    bound = _figures({**base, DRIVER_ENV: str(bind(pinned, PACKAGE_LIB))})
    assert str(package.pop("driver")).startswith("llama-cpp-python")
    assert str(bound.pop("driver")).startswith("libllama bound from its header")
    assert package == bound
    for arch, (rets, size, _digest, pos_max, checks, mismatches) in package.items():  # type: ignore[misc]
        assert rets == [0, 0, size, 0] and pos_max == 15 and checks > 0 and mismatches == 0, arch
