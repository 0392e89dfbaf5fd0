"""Generated differentials on the real server (issue #39, point 3): slot-file and ``--cache-reuse`` programs drawn by
Hypothesis, each failure shrunk to a pasteable program; each finds its planted bug and passes on the pr build."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from harness.load import reuse_programs, slot_programs
from harness.load.generated import GeneratedFailure
from harness.trees.build import build_server

pytestmark = pytest.mark.llama_server_builds


@pytest.fixture(scope="module")
def binary() -> Path:
    return build_server("shared")


def _replays(program: str) -> GeneratedFailure:
    """Run a printed program as a user would paste it: it must fail the same way."""
    with pytest.raises(GeneratedFailure) as e:
        exec(compile(program, "<shrunk program>", "exec"), {})
    return e.value


def test_slot_programs_pass_on_the_pr_build(binary: Path) -> None:
    fig = slot_programs.run_model("jamba", binary, examples=10, seed=0)
    assert fig.failure is None, fig.failure and fig.failure.program
    assert fig.examples == 10 and fig.restores > 0 and fig.compared > 0 and fig.outputs_equal == fig.compared
    # a restored hybrid slot diverging before its end: counted under the finding, with the tokens reprocessed
    assert fig.findings["slot-restore-drops-checkpoints"] > 0 and fig.tokens_reprocessed > 0


# both are restores that do not leave the slot holding the file's tokens and state alone: slot_file_restore
@pytest.mark.parametrize(("arch", "mutant", "check"), [("jamba", "keep-checkpoints", "slot_file_restore"),
                                                        ("llama", "corrupt-file", "slot_file_restore")])  # fmt: skip
def test_slot_programs_find_a_planted_bug(binary: Path, arch: str, mutant: str, check: str) -> None:
    fig = slot_programs.run_model(arch, binary, examples=30, seed=0, mutant=mutant)
    assert fig.failure is not None and fig.failure.name == check
    assert f"replay({arch!r}, build_server('shared'), mutant={mutant!r})" in fig.failure.program
    assert _replays(fig.failure.program).name == check


def test_reuse_programs_pass_on_the_pr_build(binary: Path) -> None:
    fig = reuse_programs.run_model("llama", binary, examples=12, seed=0)
    assert fig.failure is None, fig.failure and fig.failure.program
    assert fig.chunks_moved > 0 and fig.shifts > 0 and fig.outputs_equal > 0
    assert fig.shift_checks == fig.requests  # every request's shifts (none, or when and how many) held to the model


def test_reuse_programs_find_a_chunk_loop_off_by_one(binary: Path) -> None:
    fig = reuse_programs.run_model("llama", binary, examples=30, seed=0, mutant="reuse-off-by-one")
    assert fig.failure is not None and fig.failure.name == "reuse_chunks"
    assert _replays(fig.failure.program).name == "reuse_chunks"


@pytest.mark.parametrize("argv", [["reuse", "--arch", "mamba"], ["reuse", "--examples", "0"],
                                  ["slot-files", "--differential", "--arch", "llama", "gpt"]])  # fmt: skip
def test_bad_generated_differential_flags_get_one_line(argv: list[str]) -> None:
    r = subprocess.run([sys.executable, "-m", "harness", *argv], capture_output=True, text=True, check=False)
    assert r.returncode == 2 and "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr


def test_a_chunk_moved_to_position_0() -> None:
    """What the generated reuse programs found on seed 0: the first token deleted, the rest moved to position 0.
    The pr server answered cache_n 13 (14 reused, then one re-evaluated: "n_past was set to 13"); the model's
    synthetic memory used to clear the whole sequence on seq_rm(seq, 0, 1) and abort."""
    first = (1, 3, 10, 17, 24, 31, 38, 5, 12, 19, 26, 33)
    m = reuse_programs._model("llama", 1, None)
    m.handle_completion(first, id_slot=0, n_predict=4, forced=(7, 8, 9, 10))
    m.run_until_idle()
    m.handle_completion((*first, 7, 8, 9)[1:], id_slot=0, n_predict=4, forced=(7, 8, 9, 10))
    m.run_until_idle()
    assert m.slots[0].n_prompt_cached == 13 and [c.head_p for _, _, cs in m.reuses for c in cs] == [0]
