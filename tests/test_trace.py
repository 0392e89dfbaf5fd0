"""The libllama trace (harness/trace/trace.c) on a real llama-server, its replay in one process, and the shrink.

A real concurrent run (three clients, ``-np 2``, the generated llama model) is recorded through the
``LD_PRELOAD`` interposer; replayed through llama-cpp-python on the server's own ``libllama.so``, every
logits read must come back bit for bit. A wrong ``seq_id`` planted in the trace must be the call the
replay finds first, and what the shrink keeps.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fixtures.gguf import model_path
from harness.load.traced import TracedRun, fresh_answers, record_concurrent, workload
from harness.trace.calls import (
    Event,
    Memory,
    build_trace,
    check_trace,
    is_batch,
    main_context,
    read_trace,
    rows,
    static_note,
    write_trace,
)
from harness.trace.replay import replay, shrink_trace
from harness.trees.build import build_server
from harness.trees.stage import sanitizer_first

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.llama_server_builds  # built before the first test (tests/conftest.py)


@pytest.fixture(scope="module")
def pr_binary() -> Path:
    return build_server("shared")


@pytest.fixture(scope="module")
def recorded(pr_binary: Path, tmp_path_factory: pytest.TempPathFactory) -> TracedRun:
    """One concurrent round of the divergence reproducer's workload (seed 1: 12 requests) under the trace."""
    model = model_path("llama")
    work = workload(1)
    want = fresh_answers(pr_binary, model, work)
    for _ in range(4):  # a round whose scheduling gave a two-slot generation batch to plant in (most do)
        run = record_concurrent(pr_binary, model, work, want, tmp_path_factory.mktemp("trace") / "run.jsonl")
        if _plant(read_trace(run.trace).events) is not None:
            break
    return run


def _mixed_batches(events: list[Event]) -> list[Event]:
    return [e for e in events if e.get("ev") == "process" and len({r.seqs for r in rows(e)}) > 1]


def test_a_concurrent_run_is_traced_call_by_call(recorded: TracedRun) -> None:
    t = read_trace(recorded.trace)
    assert recorded.answers == 12
    assert not t.truncated and t.torn == 0
    ctx = t.contexts()[-1]
    assert (ctx["n_seq_max"], ctx["n_batch"], ctx["n_ubatch"], ctx["n_ctx"]) == (2, 256, 64, 2048)
    assert ctx["resolved"]["n_seq_max"] == 2 and ctx["n_vocab"] == 260
    assert t.model_path(ctx["model"]) == str(model_path("llama"))
    # the clients overlapped: batches hold rows of both slots' sequences
    assert _mixed_batches(t.events), "no batch mixed the two slots: the run was not concurrent"
    assert t.of("seq_rm") and t.of("logits")
    read = t.of("logits")[0]
    assert len(read["top"]) == 10 and len(read["bits"]) == 8 * 260  # the whole row: the vocabulary is 260
    assert check_trace(t.events) == []  # the server's calls are consistent with what they put in memory


def test_the_replay_gives_the_servers_logits_bit_for_bit(recorded: TracedRun) -> None:
    assert recorded.lib_dir is not None
    res: dict[str, Any] = replay(recorded.trace, lib_dir=recorded.lib_dir)
    # the server's own library, mapped through the driver bound from its tree's header
    assert Path(res["libllama"]).resolve() == (recorded.lib_dir / "libllama.so").resolve()
    assert res["driver"].startswith("libllama bound from its header")
    s = res["replay"]
    n_reads = len(read_trace(recorded.trace).of("logits"))
    assert s["reads"] == n_reads > 20
    assert s["reads_same"] == s["reads"], s["first_diff"]  # right and wrong answers alike
    assert s["rets_differ"] == [] and s["issues"] == [] and s["skipped"] == []


def test_a_trace_of_llama_decode_calls_replays_as_one_of_llama_process(recorded: TracedRun, tmp_path: Path) -> None:
    """A server from before about b10300 decodes with ``llama_decode``: ``trace.c`` records those batches as
    ``decode`` events, and the replay reads them as it reads ``process`` ones (b10566's 682 reads came back
    0 of 682 while it did not)."""
    assert recorded.lib_dir is not None
    events = read_trace(recorded.trace).events
    legacy = [{**{k: v for k, v in e.items() if k != "type"}, "ev": "decode"} if is_batch(e) else e for e in events]
    assert sum(e.get("ev") == "decode" for e in legacy) > 20
    write_trace(legacy, tmp_path / "legacy.jsonl")
    s = replay(tmp_path / "legacy.jsonl", lib_dir=recorded.lib_dir)["replay"]
    assert s["reads"] == len(read_trace(recorded.trace).of("logits")) > 20
    assert s["reads_same"] == s["reads"], s["first_diff"]


def _plant(events: list[Event]) -> tuple[list[Event], int] | None:
    """A two-slot generation batch whose seq 1 row, relabelled seq 0, lands on a position seq 0 already
    holds (the one whose prefix the fewest calls wrote): a wrong seq_id that collides (None when the run
    had no such batch). Which batch that is depends on the server's scheduling: a seq 1 row ahead of seq
    0's tail would write a new position, no collision."""
    out = [dict(e) for e in events]
    mem = Memory(main_context(out))
    writer: dict[int, int] = {}  # seq 0's position -> the call that wrote it
    best: tuple[int, int] | None = None  # (calls that wrote seq 0 up to the collision, index): the fewest to shrink to
    for k, e in enumerate(out):
        if e.get("ev") == "process" and e.get("ctx") == mem.ctx and e["n"] == 2 and sorted(e["seq"]) == [0, 1]:
            one = e["pos"][e["seq"].index(1)]
            if one in mem.held(0) and one != e["pos"][e["seq"].index(0)]:
                cost = len({writer.get(q) for q in range(one + 1)})
                best = (cost, k) if best is None or cost < best[0] else best
        if e.get("ev") == "process" and e.get("ctx") == mem.ctx:
            writer.update({r.pos: k for r in rows(e) if 0 in r.seqs})
        mem.apply(e)
    if best is None:
        return None
    out[best[1]]["seq"] = [0, 0]
    return out, int(out[best[1]]["i"])


def test_a_planted_wrong_seq_id_is_the_call_the_replay_and_the_shrink_find(recorded: TracedRun, tmp_path: Path) -> None:
    found = _plant(read_trace(recorded.trace).events)
    assert found is not None, "four rounds without a two-slot generation batch"
    events, planted = found
    bad = tmp_path / "planted.jsonl"
    write_trace(events, bad)
    assert [i for i, _ in check_trace(events)][:1] == [planted]  # the trace alone shows the wrong call
    s = replay(bad, lib_dir=recorded.lib_dir)["replay"]
    assert s["rets_differ"][0][0] == planted  # libllama refuses it where the server's call was accepted
    assert s["first_diff"]["i"] > planted
    small = tmp_path / "min.jsonl"
    res = shrink_trace(bad, lib_dir=recorded.lib_dir, out=small, budget=150)
    assert res["shrink"]["target"] == ["ret", planted]
    calls = [e for e in read_trace(small).events if e.get("ev") in ("process", "seq_rm", "seq_cp", "clear")]
    # the planted call last; how many calls are left depends on how seq 0's prefix was batched (a prompt in
    # -ub 64 chunks, then one call per generated token): the rows are bounded below
    assert calls[-1]["i"] == planted, json.dumps(calls)[:500]
    # what is left: the planted row, and before it only the positions it collides with or continues from
    last = rows(calls[-1])
    assert 1 <= len(last) <= 2
    before = [r for e in calls[:-1] if e.get("ev") == "process" for r in rows(e)]
    assert len({r.seqs for r in before}) <= 1 and len(before) <= max(r.pos for r in last) + 1
    # the shrunk trace replays to the same refusal
    again = replay(small, lib_dir=recorded.lib_dir)["replay"]
    assert [r[0] for r in again["rets_differ"]] == [planted]


def test_the_trace_is_bounded_and_kept_as_it_goes(pr_binary: Path, tmp_path: Path) -> None:
    model = model_path("llama")
    work = workload(0, clients=1, per_client=2)
    want = fresh_answers(pr_binary, model, work)
    run = record_concurrent(pr_binary, model, work, want, tmp_path / "small.jsonl", max_bytes=30_000)
    t = read_trace(run.trace)
    assert t.truncated and run.trace_bytes <= 30_000 + 64
    assert t.events[0]["ev"] == "trace" and t.contexts()


def test_a_statically_linked_binary_is_one_line(pr_binary: Path) -> None:
    assert static_note(pr_binary) is None
    note = static_note(Path("/bin/ls"))
    assert note is not None and "statically" in note and "\n" not in note


def test_a_prompt_cache_load_gives_the_sequence_the_tokens_its_state_held(pr_binary: Path, tmp_path: Path) -> None:
    """The cache path alone (one client, -np 1, --cache-ram 8, seed 1: prompts that extend earlier ones are
    loaded from the cache): the trace's memory follows each whole-sequence state set to the tokens its
    state held, so the calls check clean and every read has the tokens a fresh evaluation needs; with
    flash attention off the server's logits are a fresh evaluation's to a few ulp."""
    model = model_path("llama")
    work = [[x for c in workload(1) for x in c]]
    found: dict[str, dict[str, Any]] = {}
    for fa in ("auto", "off"):
        want = fresh_answers(pr_binary, model, work, extra_args=["-fa", fa])
        run = record_concurrent(pr_binary, model, work, want, tmp_path / f"fa-{fa}.jsonl", n_parallel=1, cache_ram=8,
                                extra_args=["-fa", fa])  # fmt: skip
        t = read_trace(run.trace)
        loads = [e for e in t.of("state_seq_set_data") if not e.get("flags")]
        assert loads, "no prompt-cache load in the run: nothing of the cache path was traced"
        assert check_trace(t.events) == []
        found[fa] = replay(run.trace, lib_dir=run.lib_dir, fresh=True)["replay"]
        s = found[fa]
        assert s["reads_same"] == s["reads"] and s["fresh_compared"] == s["reads"] > 20
    assert found["off"]["fresh_maxdiff"] < 1e-4 < found["auto"]["fresh_maxdiff"], found


def test_the_shrunk_batch_shape_flip_reproduces_on_plain_llama_cpp_python() -> None:
    """concurrent-output-divergence's shrunk trace (3 calls) as a standalone program: the flip, and its cause."""
    p = subprocess.run([sys.executable, "fixtures/findings/batch_shape_flip.py"], cwd=ROOT, capture_output=True,
                       text=True, timeout=120)  # fmt: skip
    assert p.returncode == 1 and "BUG:" in p.stdout, p.stdout + p.stderr
    on, off, alone = p.stdout.splitlines()[:3]
    assert "answers 239" in on and "a fresh evaluation 117" in on and "DIFFERENT" in on, on
    assert "same answer" in off, off
    assert "answers 239" in alone, alone


def test_an_asan_binary_starts_under_a_preload_with_its_runtime_put_first(tmp_path: Path) -> None:
    """ASan refuses to start when another library is preloaded before its runtime; the server's LD_PRELOAD (the
    trace, the fault shim) gets the binary's libasan put first, and a binary without ASan keeps its own."""
    src = tmp_path / "main.c"
    src.write_text("int main(void) { return 0; }\n")
    exe = tmp_path / "asan-main"
    subprocess.run(["gcc", "-fsanitize=address", str(src), "-o", str(exe)], check=True)
    shim = str(build_trace())
    bare = subprocess.run([str(exe)], env={"LD_PRELOAD": shim}, capture_output=True, text=True, check=False)
    assert bare.returncode != 0 and "ASan runtime does not come first" in bare.stderr
    preload = sanitizer_first(exe, shim)
    assert preload.split(":")[0].rsplit("/", 1)[-1].startswith("libasan.so") and preload.endswith(shim)
    fixed = subprocess.run([str(exe)], env={"LD_PRELOAD": preload}, capture_output=True, text=True, check=False)
    assert fixed.returncode == 0, fixed.stderr
    assert sanitizer_first(build_server("shared"), shim) == shim
