"""The edge cases of :mod:`harness.load.edges`: the forged slot files' layout (no build), then every case on
the pinned build (each check counted, none failing) and in the gate's server section."""

from __future__ import annotations

import struct
import subprocess
import sys

import pytest
from conftest import REPO

from harness.load.edges import EDGES, edges_program, forge_slot_file, run_edges
from harness.trees.build import build_server
from properties.invariants import INVARIANTS


def _saved(tokens: list[int], state: bytes) -> bytes:
    """A slot file as ``llama_state_seq_save_file`` writes one, its tokens packed as ``server_tokens::serialize``."""
    packed = [-1, 1, len(tokens), *tokens, 0]
    return struct.pack("<3I", 0x67677371, 3, len(packed)) + struct.pack(f"<{len(packed)}i", *packed) + state


def test_a_forged_file_of_an_older_tree_lists_the_tokens_alone() -> None:
    older = struct.pack("<3I", 0x67677371, 3, 3) + struct.pack("<3i", 1, 5, 6) + b"STATE"
    assert forge_slot_file(older, [1, 2]) == struct.pack("<3I", 0x67677371, 3, 2) + struct.pack("<2i", 1, 2) + b"STATE"


def test_a_forged_file_keeps_the_state_and_replaces_the_token_list() -> None:
    saved = _saved([1, 5, 6, 7], b"STATE-BYTES")
    forged = forge_slot_file(saved, [1, 2, 3, 4, 5, 6])
    assert forged == _saved([1, 2, 3, 4, 5, 6], b"STATE-BYTES")
    assert forge_slot_file(saved, [1, 5, 6, 7]) == saved
    magic, version, n = struct.unpack("<3I", forged[:12])
    assert (magic, version, n) == (0x67677371, 3, 10) and forged.endswith(b"STATE-BYTES")


def test_every_case_is_counted_under_a_property_of_the_table_and_replays_as_code() -> None:
    assert len({e.name for e in EDGES}) == len(EDGES)
    for e in EDGES:
        assert e.prop in INVARIANTS, e.prop
        assert e.reaches.startswith(":"), e.reaches
        program = edges_program("Path('/x/llama-server')", e.name)
        compile(program, "<edge program>", "exec")
        assert f"names=({e.name!r},)" in program and "SystemExit(1 if r.problems" in program


@pytest.mark.llama_server_builds
def test_every_case_holds_on_the_pinned_build_and_checks_something() -> None:
    results = run_edges(build_server("shared"))
    assert [r.name for r in results] == [e.name for e in EDGES]
    for r in results:
        assert not r.problems and not r.died, r.to_json()
        assert r.checked > 0, r.to_json()
    by = {r.name: r for r in results}
    assert by["deferred-actions"].seen == ["3 of 3 actions sent while the completion ran"]
    assert any("Restored prompt does not fit" in s for s in by["foreign-files"].seen), by["foreign-files"].seen
    assert any("Invalid tokens in slot save file" in s for s in by["foreign-files"].seen), by["foreign-files"].seen
    assert by["reuse-unshiftable"].seen == ["1 'cache reuse is not supported' warnings"]


@pytest.mark.llama_server_builds
def test_the_program_of_a_case_runs_it_in_a_new_process() -> None:
    program = edges_program(f"Path({str(build_server('shared'))!r})", "hostile-name")
    r = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, cwd=REPO, timeout=300,
                       check=False)  # fmt: skip
    assert r.returncode == 0 and "'checked': 2" in r.stdout and "'problems': []" in r.stdout, r.stdout + r.stderr
