"""In-slot reuse (issue #39): ``--cache-reuse`` chunks and context shift, in the model and on the real server.

The model's chunk loop and shift bounds on the figures the real server logged; the synthetic memory's range
``seq_rm``/``seq_add``; the reuse machines (every invariant of the synthetic machine plus ``reuse_equivalence``
and ``context_shift``) on transformer and iSWA memory; each reuse mutant killed by the property it names; and
the real pr server: ``cache_n`` of a trimmed conversation against the model on llama, the refusal on gemma2
(iSWA caches of two sizes), the registered finding ``cache-reuse-recurrent-stale`` on mamba, and a generation
past n_ctx with ``--context-shift`` whose shifts and final tokens the model predicts.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fixtures.gguf import model_path
from harness.experiments.reuse import reuse_pair, shift_run
from harness.findings import FINDINGS
from harness.load.outputs import Divergences, compare_output
from harness.model.provider import MemoryKind, SyntheticProvider
from harness.model.reuse import Chunk, context_shift_bounds, reuse_chunks, shifted_tokens
from harness.model.server_context import ServerParams
from harness.model.shift import HOLE
from harness.targets.llama_server import Launch, ServerProcess
from harness.targets.synthetic import make_server
from harness.trees.build import build_server
from properties.invariants import Violation
from properties.pinned import upstream_chunks
from properties.reuse_machine import REUSE_KINDS, kill_reuse, reuse_config, reuse_machine_class, run_reuse
from properties.reuse_mutants import REUSE_MUTANTS

ROOT = Path(__file__).resolve().parents[1]
A = (1, *(3 + (i * 7) % 40 for i in range(40)))
FINDING = "cache-reuse-recurrent-stale"


# ---- the model ------------------------------------------------------------------------------


def test_chunk_loop_moves_the_runs_after_a_deletion() -> None:
    """A[10:20) deleted: the run A[20:41) moves to 10 (the server logged "shifting KV cache [20, 41) -> [10, 31)")."""
    cached = (*A, 9, 9, 9)
    second = (*A[:10], *A[20:], 5, 6, 7)
    chunks = reuse_chunks(cached, second, 10, 4)
    assert chunks == [Chunk(20, 10, 21)] and chunks[0].kv_shift == -10
    assert shifted_tokens(cached, chunks)[:31] == second[:31]
    assert reuse_chunks(cached, second, 10, 22) == []  # a run shorter than N only advances head_c
    # two deletions: two chunks, back to back in the new prompt
    assert reuse_chunks(A, (*A[:5], *A[8:20], *A[25:]), 5, 3) == [Chunk(8, 5, 12), Chunk(25, 17, 16)]


def test_context_shift_bounds_are_the_servers() -> None:
    """The (n_keep, n_discard) the pr server logged for a 20-token prompt at n_ctx 256 (add_bos: +1)."""
    assert context_shift_bounds(255, 20, 0, 0, add_bos=True, n_ctx=256) == (1, 127)
    assert context_shift_bounds(255, 20, -1, 0, add_bos=True, n_ctx=256) == (21, 117)  # -1 keeps one generated
    assert context_shift_bounds(255, 20, 5, 7, add_bos=True, n_ctx=256) == (6, 7)
    assert context_shift_bounds(10, 20, 100, 9, add_bos=False, n_ctx=12) == (8, 1)  # n_ctx - 4; n_left - 1


def test_synthetic_memory_shifts_a_range_and_refuses_recurrent_tails() -> None:
    kv = SyntheticProvider(MemoryKind.TRANSFORMER, n_seq=1)
    kv.decode(0, (1, 2, 3, 4, 5, 6), 0)
    assert kv.memory_seq_rm(0, 1, 3)
    assert kv.seq_tokens(0) == (1, HOLE, HOLE, 4, 5, 6)
    kv.memory_seq_add(0, 3, 5, -2)
    assert kv.seq_tokens(0) == (1, 4, 5, HOLE, HOLE, 6)
    assert kv.memory_seq_rm(0, 3, -1) and kv.seq_tokens(0) == (1, 4, 5)
    rs = SyntheticProvider(MemoryKind.RECURRENT, n_seq=1)
    rs.decode(0, (1, 2, 3, 4), 0)
    assert rs.memory_seq_rm(0, 1, 2) and rs.seq_tokens(0) == (1, 2, 3, 4)  # short of the tail: silently nothing
    assert not rs.memory_seq_rm(0, 2, 9)  # into the tail from p0 > 0: refused
    assert rs.can_shift() and not SyntheticProvider(MemoryKind.ISWA).can_shift()


def test_a_server_that_cannot_shift_turns_both_off() -> None:
    p = ServerParams(n_slots=1, cache_ram=0, cache_ram_unit=1024, n_cache_reuse=4, ctx_shift=True)
    make_server("shared", "iswa", params=p, n_ctx=256)
    assert (p.n_cache_reuse, p.ctx_shift) == (0, False)


def test_the_model_stops_at_n_ctx_without_context_shift() -> None:
    """236 tokens of a 20-token prompt at n_ctx 256: n_tokens + 1 >= n_ctx stops it, as the server did."""
    p = ServerParams(n_slots=1, cache_ram=0, cache_ram_unit=1024, ctx_limit=True)
    m = make_server("shared", "transformer", params=p, n_ctx=256)
    m.handle_completion(A[:20], n_predict=260)
    m.run_until_idle()
    assert len(m.slots[0].result) == 236 and m.slots[0].prompt.n_tokens() == 255 and not m.ctx_shifts


@pytest.mark.parametrize("kind", REUSE_KINDS)
def test_reuse_machine_holds(kind: str) -> None:
    cls = reuse_machine_class(reuse_config(kind))
    assert run_reuse(reuse_config(kind), max_examples=25) is None
    reused, shifts = cls.shifts_seen
    if kind == "transformer":
        assert reused > 0 and shifts > 0  # both post-conditions ran on something
    else:
        assert (reused, shifts) == (0, 0)  # iSWA: llama_memory_can_shift is false, both refused


@pytest.mark.parametrize("name", list(REUSE_MUTANTS))
def test_reuse_mutant_is_killed(name: str) -> None:
    assert kill_reuse(name) == REUSE_MUTANTS[name].kills


# ---- the real server ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def binary() -> Path:
    return build_server("shared")


@pytest.mark.llama_server_builds  # built before the first test (tests/conftest.py)
def test_server_cache_reuse_against_the_model(binary: Path, tmp_path: Path) -> None:
    """llama: the trimmed conversation's cache_n is the model's; with N above every run nothing moves and the
    answer is a fresh server's (a greedy flip within the batch-shape bound excused, as everywhere)."""
    r = reuse_pair(binary, model_path("llama"), "llama", log_dir=tmp_path)
    assert not r.refused and r.chunks and r.cache_n == r.model_cache_n > r.n_prefix, r.line()
    # the moved cells attended to the deleted tokens: an answer unlike a fresh one is by design here (a figure)
    print(r.line(), "matches fresh:", r.matches_fresh)
    ctl = reuse_pair(binary, model_path("llama"), "llama", n_cache_reuse=64, log_dir=tmp_path)
    assert ctl.chunks == [] and ctl.cache_n == ctl.model_cache_n == ctl.n_prefix, ctl.line()
    if not ctl.matches_fresh:
        with ServerProcess(binary, Launch(model=model_path("llama"), n_parallel=1, ctx_size=256, threads=1)) as fresh:
            diff = compare_output(fresh, ctl.second, ctl.generated, "llama")
        assert diff is None or Divergences.batch_shape(diff, ctl.cache_n) is not None, ctl.line()


@pytest.mark.llama_server_builds  # built before the first test (tests/conftest.py)
def test_server_refuses_cache_reuse_where_memory_cannot_shift(binary: Path, tmp_path: Path) -> None:
    """gemma2 with a context larger than its SWA cache (-c 2048 -ub 64): --cache-reuse turned off (:1172-1175)."""
    r = reuse_pair(binary, model_path("gemma2"), "gemma2", args=("-c", "2048", "-ub", "64"), log_dir=tmp_path)
    assert r.refused and r.cache_n <= r.n_prefix and r.matches_fresh, r.line()


@pytest.mark.llama_server_builds  # built before the first test (tests/conftest.py)
def test_server_cache_reuse_on_recurrent_memory_is_the_finding(binary: Path, tmp_path: Path) -> None:
    """mamba: reuse admitted (cache_n is the chunk loop's), the answer is the undeleted conversation's."""
    r = reuse_pair(binary, model_path("mamba"), "mamba", cut=33, n_cut=6, log_dir=tmp_path)
    assert not r.refused and r.cache_n == r.model_cache_n == 38, r.line()
    assert r.generated == r.undeleted != r.fresh, r.line()  # no attention layer: no batch-shape excuse
    f = FINDINGS[FINDING]
    assert f.backend == "server" and f.reproducer and (ROOT / f.reproducer).is_file()


@pytest.mark.llama_server_builds  # built before the first test (tests/conftest.py)
def test_finding_reproducer_exits_1_while_present() -> None:
    script = FINDINGS[FINDING].reproducer
    assert script is not None
    p = subprocess.run([sys.executable, script], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert p.returncode == 1 and "BUG:" in p.stdout, p.stdout + p.stderr


@pytest.mark.llama_server_builds  # built before the first test (tests/conftest.py)
@pytest.mark.parametrize(("n_keep", "n_discard"), [(0, 0), (5, 7)])
def test_server_context_shift_against_the_model(binary: Path, tmp_path: Path, n_keep: int, n_discard: int) -> None:
    """llama, 20-token prompt, 260 tokens at n_ctx 256 with --context-shift: every shift's n_keep/n_discard and
    the final tokens are the model's; the tokens after the first shift against a fresh evaluation of the kept
    tokens are a figure (the kept cells attended to the discarded ones)."""
    s = shift_run(binary, model_path("llama"), "llama", n_keep=n_keep, n_discard=n_discard, log_dir=tmp_path)
    assert s.shifts and s.shifts == s.model_shifts and s.n_tokens == s.model_n_tokens and s.truncated, s.line()
    assert len(s.generated) == 260 and len(s.kept) == s.shifts[0][0] + 255 - sum(s.shifts[0]) + 1
    print(s.line())


# ---- issue #50: the thresholds, pinned to what upstream's loop and shift would do ------------------------------


def test_upstream_chunks_takes_a_run_of_exactly_n_and_not_of_n_minus_one() -> None:
    old, new = (1, 2, 3, 9, 4, 5, 6), (1, 2, 3, 4, 5, 6)  # the 9 deleted: a run of 3 after the prefix of 3
    assert upstream_chunks(old, new, 3, 2) == [(4, 3, 3)]  # n - 1
    assert upstream_chunks(old, new, 3, 3) == [(4, 3, 3)]  # n
    assert upstream_chunks(old, new, 3, 4) == []  # n + 1
    for n in (1, 2, 3, 4):  # the model's loop agrees
        model = [(c.head_c, c.head_p, c.n_match) for c in reuse_chunks(old, new, 3, n)]
        assert model == upstream_chunks(old, new, 3, n)


def _filled(name: str = "shared") -> object:
    cls = reuse_machine_class(reuse_config("transformer", name))
    m = cls()
    m.request(source=0, keep=0, suffix=list(range(2, 20)), id_slot=0, n_cmpl=1, n_predict=1, overlap=False)
    return m


@pytest.mark.parametrize(("at", "moved"), [(-1, True), (0, True), (1, False)])
def test_the_threshold_rule_draws_n_cache_reuse_at_the_first_chunk_s_length(at: int, moved: bool) -> None:
    m: Any = _filled()
    m.trimmed_at_threshold(slot=0, cut=5, n_cut=2, suffix=[], at=at)
    _, _, chunks = m.server.reuses[-1]
    assert bool(chunks) is moved
    m.state_invariants()
    assert m.pinned.checked["reuse_chunks"] >= 1


@pytest.mark.parametrize(("at", "refused"), [(-2, False), (-1, False), (0, True), (1, True)])
def test_a_prompt_at_the_slot_s_n_ctx_is_refused_from_n_on(at: int, refused: bool) -> None:
    m: Any = _filled()
    m.edge_request(at=at, fill=1, n_keep=-1, n_discard=0, n_predict=2, overlap=False)
    assert bool(m.server.errors) is refused
    if at == -1:  # n_ctx - 1 tokens: the first generated token shifts the context
        assert m.server.ctx_shifts and m.pinned.checked["shift_timing"] >= 1
    m.state_invariants()


@pytest.mark.parametrize(
    ("name", "prop"),
    [("reuse-threshold-strict", "reuse_chunks"), ("ctx-shift-late", "shift_timing"),
     ("prompt-fills-ctx", "slot_within_ctx")],
)  # fmt: skip
def test_a_threshold_mutant_dies_by_its_pinned_property(name: str, prop: str) -> None:
    assert REUSE_MUTANTS[name].kills == prop
    m: Any = _filled(name)
    with pytest.raises(Violation) as e:
        if name == "reuse-threshold-strict":
            m.trimmed_at_threshold(slot=0, cut=5, n_cut=2, suffix=[], at=0)
        else:
            m.edge_request(at=-1 if name == "ctx-shift-late" else 0, fill=1, n_keep=-1, n_discard=0, n_predict=2,
                           overlap=False)  # fmt: skip
    assert e.value.name == prop
