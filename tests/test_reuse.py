"""The reuse property (properties/reuse.py): each reported case on the model, its mutant, and the real server.

Cases (issue #39, point 2), on 0c1e570:

(a) ``id-slot-empty-skips-cache``: a request pinned to an empty slot recomputes what the cache held;
(b) ``similar-slot-skips-better-entry``: a slot kept by the ``f_keep >= 0.5`` gate hides a better entry;
(c) an LRU slot keeps an unrelated conversation's tokens: saved to the cache first (S-C.cpp:1628), so
    nothing is lost and the property holds (not a finding);
plus the two the property found in the gate's machines: ``save-evicts-better-entry`` (also on the real
server) and ``load-picks-unresumable-entry`` (also on the real server, hybrid ``jamba``).

The real-server tests send the same token ids to the pinned tree's ``llama-server`` (the reproducers in
``fixtures/findings/``) and compare ``timings.cache_n`` with the model's resumed prefix.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from fixtures.gguf import model_path
from harness.backends.llama_server.differential import Differential, ServerMismatch
from harness.findings import finding
from harness.model.server_context import ServerContext, ServerParams
from harness.targets.libllama import close_server, make_llama_server
from harness.targets.llama_server import Launch, ServerConfig, ServerProcess
from harness.targets.synthetic import make_server
from harness.trees.build import build_server
from properties.invariants import Violation
from properties.machine import MachineConfig, machine_class
from properties.mutants import MUTANTS, config, kill
from properties.reuse import REUSE_FINDINGS, Ckpt, ReuseTracer, Source, restored_pos_min, resume_point
from properties.run import SHRINKS, make_settings, run_machine

ROOT = Path(__file__).resolve().parents[1]

A = tuple(10 + i % 50 for i in range(40))  # the reproducers' prompts
EXT = (70, 71, 72, 73)


def _reproducer(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, ROOT / "fixtures" / "findings" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _model(kind: str = "transformer", **params: Any) -> tuple[ServerContext, ReuseTracer]:
    """A modelled server with the real server's flags (-np 2, --cache-ram 64 MiB) and a strict reuse tracer."""
    p = ServerParams(n_slots=2, cache_ram=64, **params)
    server = make_server("shared", kind, params=p, n_ctx=512)
    return server, ReuseTracer(server)


def _send(server: ServerContext, tokens: tuple[int, ...], id_slot: int = -1) -> int:
    """One completion (n_predict 1) run to the end; the slot's ``n_prompt_cached`` (the server's ``cache_n``)."""
    r = server.handle_completion(tokens, id_slot=id_slot, n_predict=1)
    server.run_until_idle()
    return server.slots[r.slot].n_prompt_cached


def test_every_reuse_finding_is_registered_with_the_property() -> None:
    for fid in REUSE_FINDINGS:
        f = finding(fid)
        assert f.property == "reuse" and f.backend == "synthetic"
        if f.reproducer is not None:
            assert (ROOT / f.reproducer).is_file()


def test_resume_point_resumes_recurrent_memory_only_at_a_checkpoint_or_the_end() -> None:
    new = (1, 2, 3, 4, 5, 6)
    kv = Source((1, 2, 3, 9), (), 0)  # full KV: cut back to the common prefix
    assert resume_point(kv, new, 0) == 3
    rs = Source((1, 2, 3, 9), (), 3)  # recurrent: pos_min = last position, no checkpoint
    assert resume_point(rs, new, 0) == 0
    assert resume_point(rs._replace(ckpts=(Ckpt(2, 1, 1),)), new, 0) == 2  # at the checkpoint
    assert resume_point(Source((1, 2, 3), (), 2), new, 0) == 3  # the exact end: nothing to cut
    assert resume_point(Source(new, (), 5), new, 0) == 0  # all of it, no checkpoint: [TAG_PROMPT_LOGITS]
    assert resume_point(Source(new, (), 0), new, 0) == 5  # full KV: all but the last token


# ---- SWA: an entry restores only the window ----------------------------------------------------

# gemma2 (n_swa 16) with the server differential's flags (ServerConfig("gemma2"): -np 2, -b 256, -ub 64, -cms 64):
# SWA_A is saved to the cache (at pos_min 45 of pos_max 300, its state restores 285..300), two unrelated prompts
# pass, then SWA_C shares 240 tokens with it: the entry is loaded, pos_min 285 >= pos_min_thold 224, and the
# newest checkpoint at or below 240 (n_tokens 232, pos_max 231) gives 231; the slot's pos_min said 240
SWA_A = tuple(3 + (i * 17) % 256 for i in range(300))
SWA_OTHERS = (tuple(3 + (31 + i * 17) % 251 for i in range(40)), tuple(3 + (7 + i * 13) % 251 for i in range(30)))
SWA_C = SWA_A[:240] + tuple(3 + (62 + i * 17) % 256 for i in range(8))
SWA_PROGRAM = (SWA_A, *SWA_OTHERS, SWA_C)


def test_an_swa_entry_resumes_from_the_window_its_state_restores() -> None:
    # the clean-clone CI case (server gate, gemma2-np2-kvs, seed 0): entry 1 held 588 tokens, saved at pos_min
    # 332 and pos_max 587, checkpoints at 518 and 582 tokens; the new prompt (739 tokens) shared 546 with it
    ckpts = (Ckpt(518, 262, 517), Ckpt(582, 326, 581))
    assert restored_pos_min(332, 587, 16) == 572  # the state write drops the cells masked against pos 587
    assert restored_pos_min(332, 587, 0) == 332 and restored_pos_min(-1, -1, 16) == -1
    assert restored_pos_min(580, 587, 16) == 580  # already inside the window
    entry = tuple(range(588))
    new = (*entry[:546], *(900 + i for i in range(193)))
    assert resume_point(Source(entry, ckpts, 572), new, 16) == 517  # what the model and the real server resumed
    assert resume_point(Source(entry, ckpts, 332), new, 16) == 546  # the slot's pos_min: the old estimate


def _gemma2(semantics: Any = "shared") -> ServerContext:
    cfg = ServerConfig("gemma2")
    return make_llama_server(semantics, model_path("gemma2"), params=cfg.params(), n_ctx=cfg.n_ctx,
                             check_restores=False)  # fmt: skip


def test_an_swa_entry_estimate_is_what_the_model_resumes_on_real_swa_memory() -> None:
    server = _gemma2()
    try:
        tracer = ReuseTracer(server)  # strict: a shortfall no finding explains raises
        assert [_send(server, p) for p in SWA_PROGRAM] == [0, 0, 0, 231]
        assert any(ev.op == "load" for ev in server.events[-3:])  # SWA_C came from the cache entry
        assert list(tracer.best_of.values())[-1] == 231 and not tracer.shortfalls
    finally:
        close_server(server)


def test_the_slots_pos_min_as_an_swa_entrys_fails_the_reuse_property(monkeypatch: pytest.MonkeyPatch) -> None:
    # the old estimate (the entry's memory = the slot's when saved) claims 240 where 231 is all there is
    monkeypatch.setattr("properties.reuse.restored_pos_min", lambda pos_min, pos_max, n_swa: pos_min)
    server = _gemma2()
    try:
        ReuseTracer(server)
        for p in SWA_PROGRAM[:-1]:
            _send(server, p)
        with pytest.raises(Violation, match=r"resumed 231 of 248 .* \(entry 0\) held 240: 9 recomputed"):
            _send(server, SWA_C)
    finally:
        close_server(server)


def test_selection_that_ignores_the_cache_fails_the_reuse_property_on_swa_memory() -> None:
    # on real SWA memory (gemma2 over libllama): the LRU slot keeps its prompt, the entry's 231 are recomputed
    server = _gemma2(MUTANTS["selection-ignores-cache"].semantics)
    try:
        ReuseTracer(server)
        for p in SWA_PROGRAM[:-1]:
            _send(server, p)
        with pytest.raises(Violation, match=r"resumed 0 of 248 .* \(entry 0\) held 231: 231 recomputed"):
            _send(server, SWA_C)
    finally:
        close_server(server)
    # and on the synthetic SWA machine (iswa) the gate runs: the mutant is killed by reuse
    r = run_machine(config("selection-ignores-cache", "iswa"), make_settings("ci", None, 300), 0, "-",
                    shrinks=SHRINKS["ci"])  # fmt: skip
    assert r.failure is not None and r.failure.property == "reuse", r.failure
    assert "(entry " in r.failure.message


# ---- (a) ---------------------------------------------------------------------------------------


def test_a_pinned_empty_slot_skips_the_cache_on_the_model() -> None:
    server, tracer = _model(kv_unified=True)
    assert _send(server, A, id_slot=1) == 0
    assert _send(server, (90, 91, 92, 93, 94, 95), id_slot=0) == 0  # slot 1 saved to the cache and cleared
    assert not server.slots[1].prompt.tokens and [e.prompt.tokens for e in server.prompt_cache or []] == [A]
    assert _send(server, A + EXT, id_slot=1) == 0
    [sf] = tracer.shortfalls
    assert (sf.finding, sf.best, sf.resumed, sf.source) == ("id-slot-empty-skips-cache", 40, 0, "entry 0")
    assert sf.recomputed == 40
    assert tracer.counts == {"id-slot-empty-skips-cache": 1, "id-slot-empty-skips-cache:tokens": 40}


def test_a_unpinned_control_loads_the_entry_on_the_model() -> None:
    server, tracer = _model(kv_unified=True)
    _send(server, A, id_slot=1)
    _send(server, (90, 91, 92, 93, 94, 95), id_slot=0)
    assert _send(server, A + EXT) == 40 and not tracer.shortfalls


# ---- (b) ---------------------------------------------------------------------------------------


def test_b_similar_slot_keeps_a_shorter_prefix_on_the_model() -> None:
    server, tracer = _model()
    assert _send(server, A) == 0
    assert _send(server, (*A[:16], 90, 91, 92, 93)) == 16  # f_keep 16/40 < 0.5: A saved to the cache
    assert _send(server, A + EXT) == 16  # f_keep 16/20 >= 0.5: the slot as it is
    [sf] = tracer.shortfalls
    assert (sf.finding, sf.best, sf.resumed, sf.recomputed) == ("similar-slot-skips-better-entry", 40, 16, 24)
    assert sf.f_keep == pytest.approx(0.8)


def test_b_without_the_similarity_scan_the_entry_is_loaded_on_the_model() -> None:
    server, tracer = _model(slot_prompt_similarity=0.0)
    _send(server, A)
    _send(server, (*A[:16], 90, 91, 92, 93))
    assert _send(server, A + EXT) == 40 and not tracer.shortfalls


# ---- (c) ---------------------------------------------------------------------------------------


def test_c_lru_slot_keeps_the_old_tokens_but_saved_them_first_on_the_model() -> None:
    server, tracer = _model(cache_idle_slots=False)
    cache = server.prompt_cache
    assert cache is not None
    assert _send(server, A) == 0  # slot 1 (LRU among equals: the last)
    assert _send(server, (90, 91, 92, 93, 94, 95)) == 0  # slot 0
    r = server.handle_completion((80, 81, 82, 83, 84, 85, 86), n_predict=1)  # nothing matches: LRU, slot 1
    assert r.slot == 1 and server.slots[1].prompt.tokens == A  # kept: load found nothing better
    assert [e.prompt.tokens for e in cache.states] == [A]  # ... and saved before the load
    server.run_until_idle()
    assert server.slots[1].n_prompt_cached == 0  # the common prefix with A: nothing to reuse, none lost
    assert _send(server, A + EXT) == 40  # A comes back from the cache (LRU slot 0 saves its prompt, loads A)
    assert not tracer.shortfalls and tracer.checked == 4


# ---- found by the property in the gate's machines --------------------------------------------


def _machine(kind: str, steps: list[dict[str, Any]], **cfg: Any) -> Any:
    state = machine_class(MachineConfig("shared", kind, **cfg))()
    try:
        for s in steps:
            if "cache_ram" in s:
                state.set_limit(**s)
            else:
                state.request(n_cmpl=s.pop("n_cmpl", 1), overlap=s.pop("overlap", False), **s)
            state.state_invariants()
        return state.reuse
    finally:
        state.teardown()


def test_the_save_evicts_the_entry_the_load_would_pick() -> None:
    # the shrunk program of the gate's hybrid machine, seed 0: the slot's save (cache_ram 5 KiB) evicts
    # the only entry, which shared 6 tokens with the prompt (a checkpoint at 1 in the slot: 1 resumed)
    reuse = _machine("hybrid", [
        {"id_slot": 1, "keep": 31, "n_predict": 2, "source": 0, "suffix": [3, 15, 7, 18]},
        {"cache_ram": 5},
        {"id_slot": 1, "keep": 24, "n_predict": 2, "source": 0, "suffix": [22, 20, 8, 13, 9, 3, 23]},
        {"id_slot": 1, "keep": 27, "n_predict": 1, "source": 2, "suffix": [2, 14, 23, 2, 5, 7, 24, 14, 16, 20, 1]},
    ])  # fmt: skip
    [sf] = reuse.shortfalls
    assert (sf.finding, sf.best, sf.resumed) == ("save-evicts-better-entry", 6, 1)


def test_load_picks_an_entry_the_memory_cannot_resume() -> None:
    # the gate's hybrid machine, seed 1: the prompt (1, 19) equals a cache entry without checkpoints, which
    # load picks (f_keep 1); a hybrid memory cannot step back one token ([TAG_PROMPT_LOGITS]): 0 resumed,
    # where the slot's own checkpoint at 1 token resumed 1
    reuse = _machine("hybrid", [
        {"id_slot": 0, "keep": 13, "n_predict": 2, "source": 0, "suffix": [7, 10, 1, 16, 18, 12, 14]},
        {"id_slot": -1, "keep": 37, "n_predict": 1, "source": 3, "suffix": [19]},
        {"id_slot": 1, "keep": 0, "n_predict": 3, "source": 0, "suffix": [24, 1, 2, 20]},
        {"id_slot": -1, "keep": 24, "n_cmpl": 2, "n_predict": 4, "source": 1, "suffix": [18, 7], "overlap": True},
        {"id_slot": -1, "keep": 26, "n_predict": 2, "source": 1, "suffix": [15, 2, 23, 14, 9, 12, 14, 10, 17, 20]},
        {"id_slot": -1, "keep": 35, "n_predict": 3, "source": 3, "suffix": []},
    ])  # fmt: skip
    assert [(s.finding, s.best, s.resumed) for s in reuse.shortfalls][-1] == ("load-picks-unresumable-entry", 1, 0)


def test_the_save_evicts_the_entry_on_the_model_of_the_real_server() -> None:
    # the reproducer's requests on the model over real libllama state (llama, one slot, --cache-ram 1 MiB)
    rep = _reproducer("save_evicts_better_entry")
    got = []
    for ram in (1, 2):
        server = make_llama_server(
            "shared",
            model_path("llama"),
            params=ServerParams(n_slots=1, cache_ram=ram, n_batch=512, n_ubatch=512),
            n_ctx=1024,
            check_restores=False,
        )
        try:
            tracer = ReuseTracer(server)
            got += [[_send(server, tuple(p)) for p in (rep.E, *rep.OTHERS, rep.E + rep.EXT)][-1]]
            got += [[(sf.finding, sf.recomputed) for sf in tracer.shortfalls]]
        finally:
            close_server(server)
    assert got == [0, [("save-evicts-better-entry", 1000)], 1000, []]


def test_load_picks_an_unresumable_entry_on_the_model_of_the_real_server() -> None:
    # the reproducer's requests on the model over real libllama state (jamba, one slot, the server's defaults:
    # n_batch 2048, n_ubatch 512, 32 checkpoints, min spacing 8192); --cache-ram 0 is the control
    rep = _reproducer("load_picks_unresumable_entry")
    got: list[list[Any]] = []
    for ram in (64, 0):
        params = ServerParams(
            n_slots=1, cache_ram=ram, n_batch=2048, n_ubatch=512, n_ctx_checkpoints=32, checkpoint_min_step=8192
        )
        server = make_llama_server("shared", model_path("jamba"), params=params, n_ctx=1024, check_restores=False)
        try:
            tracer = ReuseTracer(server)
            got.append([_send(server, tuple(p)) for p in rep.PROGRAM])
            got.append([(s.finding, s.best, s.resumed) for s in tracer.shortfalls])
        finally:
            close_server(server)
    assert got == [[0, 0, 40, 0], [("load-picks-unresumable-entry", 40, 0)], [0, 0, 40, 40], []]


# ---- the mutant --------------------------------------------------------------------------------


def test_selection_that_ignores_the_cache_fails_the_reuse_property() -> None:
    assert MUTANTS["selection-ignores-cache"].kills == "reuse"
    row = kill("selection-ignores-cache")
    assert row["killed"] and row["by"] == "reuse", row
    assert "best usable source" in row["message"]


def test_an_unmatched_shortfall_is_a_violation_not_a_pass() -> None:
    # the mutant on the (c) program: the LRU slot neither saves nor loads, so A + EXT resumes 0 of 40
    sem = MUTANTS["selection-ignores-cache"].semantics
    server = make_server(sem, "transformer", params=ServerParams(n_slots=2, cache_ram=64), n_ctx=512)
    tracer = ReuseTracer(server)
    _send(server, A)
    _send(server, (90, 91, 92, 93, 94, 95))
    _send(server, (80, 81, 82, 83, 84, 85, 86))
    with pytest.raises(Violation, match=r"\[reuse\] .* held 40: 40 recomputed"):
        _send(server, A + EXT)
    assert tracer.counts == {}


# ---- a campaign counts them -----------------------------------------------------------------


def test_a_campaign_prints_and_writes_the_known_findings_it_counted(tmp_path: Path) -> None:
    out = tmp_path / "campaign.json"
    argv = ["fuzz", "--examples", "20", "--workers", "1", "--plain", "--no-target"]
    argv += ["--machine", "Shared_transformer_kvu", "--db", str(tmp_path / "db"), "--json", str(out)]
    r = subprocess.run([sys.executable, "-m", "harness", *argv], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    data = json.loads(out.read_text())
    n = data["known_findings"]["id-slot-empty-skips-cache"]
    assert n > 0 and data["known_findings"]["id-slot-empty-skips-cache:tokens"] >= n
    tokens = data["known_findings"]["id-slot-empty-skips-cache:tokens"]
    assert f"known finding id-slot-empty-skips-cache: {n} requests, {tokens} tokens recomputed" in r.stdout
    [m] = data["machines"]
    assert m["known_findings"] == data["known_findings"]


# ---- the real server ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server_bin() -> Path:
    return build_server("shared")


@pytest.mark.llama_server_builds
def test_a_on_the_real_server(server_bin: Path) -> None:
    rep = _reproducer("id_slot_empty_skips_cache")
    assert (rep.run(server_bin, True), rep.run(server_bin, False)) == (0, 40)  # the model: 0, then 40


@pytest.mark.llama_server_builds
def test_b_on_the_real_server(server_bin: Path) -> None:
    rep = _reproducer("similar_slot_skips_better_entry")
    assert (rep.run(server_bin, True), rep.run(server_bin, False)) == (16, 40)  # the model: 16, then 40


@pytest.mark.llama_server_builds
def test_save_evicts_on_the_real_server(server_bin: Path) -> None:
    rep = _reproducer("save_evicts_better_entry")
    assert (rep.run(server_bin, 1), rep.run(server_bin, 2)) == (0, 1000)  # the model: 0, then 1000


@pytest.mark.llama_server_builds
def test_load_picks_unresumable_entry_on_the_real_server(server_bin: Path) -> None:
    rep = _reproducer("load_picks_unresumable_entry")
    assert (rep.run(server_bin, 64), rep.run(server_bin, 0)) == ([0, 0, 40, 0], [0, 0, 40, 40])  # as the model


@pytest.mark.llama_server_builds
def test_c_on_the_real_server(server_bin: Path) -> None:
    args = ["--no-warmup", "--no-kv-unified", "--no-cache-idle-slots"]
    with ServerProcess(
        server_bin,
        Launch(model=model_path("llama"), n_parallel=2, ctx_size=512, cache_ram=64, args=args),
    ) as srv:
        got = [
            srv.completion(list(p), 1, ignore_eos=True)["timings"]["cache_n"]
            for p in (A, (90, 91, 92, 93, 94, 95), (80, 81, 82, 83, 84, 85, 86), A + EXT)
        ]
    assert got == [0, 0, 0, 40]  # as the model: the LRU slot's old prompt went to the cache, and came back


@pytest.mark.llama_server_builds
def test_the_server_differential_compares_cache_n_with_the_best_usable_source(server_bin: Path) -> None:
    # case (b) through the server backend's differential: the server's cache_n (16) is the model's, below the
    # best usable source (40: the cache entry), and the shortfall is the registered finding, not a failure
    with Differential(ServerConfig("llama", n_ctx=1024), server_bin) as d:
        rows = [d.request(p, 1) for p in (A, (*A[:16], 90, 91, 92, 93), A + EXT)]
    assert all(r.ok and r.reuse_problem() is None for r in rows)
    last = rows[-1]
    assert (last.cache_n, last.best_usable, last.reuse_finding) == (16, 40, "similar-slot-skips-better-entry")
    assert d.reuse_counts == {"similar-slot-skips-better-entry": 1, "similar-slot-skips-better-entry:tokens": 24}
    # an unexplained shortfall of the server is the property's failure
    unexplained = dataclasses.replace(last, reuse_finding=None).reuse_problem()
    assert unexplained is not None and unexplained.endswith("the best usable source held 40 tokens")


@pytest.mark.llama_server_builds
def test_an_swa_entry_estimate_is_what_the_real_server_resumes(server_bin: Path) -> None:
    # the SWA program through the server differential: the server loads the entry and resumes 231, as the model
    # does and as the best usable source says (the slot's pos_min said 240: the CI's 546 against 517)
    with Differential(ServerConfig("gemma2"), server_bin) as d:
        rows = [d.request(p, 2) for p in SWA_PROGRAM]
    assert all(r.ok and r.reuse_problem() is None for r in rows), [r.describe() for r in rows]
    assert [(r.cache_n, r.best_usable) for r in rows] == [(0, 0), (0, 0), (0, 0), (231, 231)]


# the bug planted in the replayed program: an SWA entry estimated from the slot's pos_min when saved
_PLANT = "import properties.reuse\nproperties.reuse.restored_pos_min = lambda pos_min, pos_max, n_swa: pos_min\n"


@pytest.mark.llama_server_builds
def test_the_printed_program_of_a_reuse_failure_fails_when_run(server_bin: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    monkeypatch.setattr("properties.reuse.restored_pos_min", lambda pos_min, pos_max, n_swa: pos_min)
    with Differential(ServerConfig("gemma2"), server_bin) as d, pytest.raises(ServerMismatch) as err:
        for p in SWA_PROGRAM:
            d.check(d.request(p, 2))
    e = err.value
    assert e.name == "reuse" and e.message.endswith("the best usable source held 240 tokens"), e
    assert e.program.count("d.check(d.request(") == len(SWA_PROGRAM)

    def replay(program: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-c", program], cwd=ROOT, capture_output=True, text=True, timeout=300)

    planted = replay(_PLANT + e.program)  # pasted where the bug is: it fails, on the same row, with reuse
    assert planted.returncode != 0 and "[reuse] prompt of 248 tokens" in planted.stderr, planted.stderr[-2000:]
    assert "the best usable source held 240 tokens" in planted.stderr
    clean = replay(e.program)  # without the bug the same requests pass: it is the check that fails the replay
    assert clean.returncode == 0, clean.stderr[-2000:]
    assert "server slot 0 cache_n 231" in clean.stdout.splitlines()[-1]
