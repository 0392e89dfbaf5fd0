"""Locating a wrong answer in the server's libllama trace (issue #41): the short-window rule of the calls
(:func:`harness.trace.calls.short_window`), the slice and the explainer (:mod:`harness.trace.lineage`), the shrink from
the slice (:mod:`harness.trace.shrink`), on a real gemma2 llama-server's wrong answer; and the standalone
reproducer of the soak's shrunk divergence."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.gguf import SPECS, model_path
from harness.load.outputs import Divergences, OutputDiff
from harness.targets.llama_server import Launch, ServerProcess
from harness.trace.calls import Event, Memory, check_trace, read_trace, short_window, trace_env
from harness.trace.lineage import SHORT_WINDOW, Explainer, slice_read
from harness.trace.replay import lib_dir_of, replay, shrink_trace
from harness.trees.build import build_server

ROOT = Path(__file__).resolve().parents[1]
N_SWA = SPECS["gemma2"].n_swa or 0

pytestmark = pytest.mark.llama_server_builds


def _decode(i: int, seq: int, pos: list[int]) -> Event:
    return {"i": i, "ev": "process", "ctx": 0, "type": "decode", "tok": [7] * len(pos), "pos": pos,
            "seq": [seq] * len(pos), "out": [len(pos) - 1]}  # fmt: skip


def test_a_row_decoded_with_its_window_short_is_an_issue_of_the_calls() -> None:
    assert N_SWA == 16
    assert short_window(16, 140, 154) and not short_window(16, 139, 154) and not short_window(16, 140, 155)
    assert not short_window(0, 140, 154) and not short_window(16, 0, 5)
    head = [_decode(1, 0, list(range(156))), {"i": 2, "ev": "pos_min", "ctx": 0, "seq": 0, "ret": 140},
            {"i": 3, "ev": "seq_rm", "ctx": 0, "seq": 0, "p0": 154, "p1": -1, "ret": True}]  # fmt: skip
    found = [x for x in check_trace([*head, _decode(4, 0, [154])], ctx=0, n_swa=16) if "window" in x[1]]
    assert found == [(4, "seq 0 decodes position 154 with its memory from 140: its window of 16 starts at 139")]
    assert not [x for x in check_trace([*head, _decode(4, 0, [154])], ctx=0) if "window" in x[1]]  # no window
    cut155 = {**head[2], "p0": 155}
    assert not [x for x in check_trace([head[0], head[1], cut155, _decode(4, 0, [155])], ctx=0, n_swa=16)
                if "window" in x[1]]  # fmt: skip
    # a whole state set makes libllama's pos_min unknown until asked again: no issue from a stale value
    mem = Memory(0, n_swa=16)
    for e in [*head, {"i": 5, "ev": "state_seq_set_data", "ctx": 0, "seq": 0, "flags": 0, "hash": "x"}]:
        mem.apply(e)
    assert 0 not in mem.pos_min


def _answer(binary: Path, tokens: list[int], *, first: list[int] | None, trace: Path | None, n: int) -> list[int]:
    """The fixture's scenario (fixtures/findings/swa_restore_window_short.py): ``first`` sent, then
    ``tokens`` with the prompt cache on (a checkpoint restored at pos_max == pos_next) or, without
    ``first``, a fresh answer."""
    with ServerProcess(
        binary,
        Launch(
            model=model_path("gemma2"),
            n_parallel=1,
            ctx_size=512,
            cache_ram=0,
            args=["--no-warmup", "-lv", "4", "-b", "512", "-ub", "512"],
        ),
        env=trace_env(trace) if trace is not None else None,
    ) as srv:
        if first is not None:
            srv.completion(first, 1, ignore_eos=True)
        r = srv.completion(tokens, n, ignore_eos=True, return_tokens=True, cache_prompt=first is not None)
    return [int(t) for t in r["tokens"]]


def test_a_real_servers_wrong_swa_answer_is_located_in_its_trace_and_shrunk(tmp_path: Path) -> None:
    """gemma2 on the real server: the answer after an SWA checkpoint restore differs from a fresh one;
    the server's own trace shows the short-window decode, the explainer names swa-restore-window-short
    for the first wrong token (and nothing for a token the fresh server chose), and the shrink from the
    read's slice keeps a few calls that still show it."""
    binary = build_server("shared")
    a = [3 + (i * 7) % 250 for i in range(22)]
    c = a[:17]
    trace = tmp_path / "swa.jsonl"
    want = _answer(binary, c, first=None, trace=None, n=8)
    got = _answer(binary, c, first=a, trace=trace, n=8)
    k = next(i for i, (x, y) in enumerate(zip(got, want, strict=True)) if x != y)
    events = read_trace(trace).events
    windows = [x for x in check_trace(events, n_swa=N_SWA) if "window" in x[1]]
    assert windows, "no short-window decode in the trace"
    ex = Explainer(events, N_SWA)
    assert ex.explain([*c, *got[:k]], got[k]) == SHORT_WINDOW
    assert ex.explain([*c, *got[:k]], want[k]) is None  # no read answered the fresh token
    diff = OutputDiff("gemma2", tuple(c), tuple(got), tuple(want), k, None)
    assert Divergences("gemma2").located(diff, trace) == SHORT_WINDOW
    assert Divergences("gemma2").located(diff, None) is None
    # the read's slice replays to the same wrong token, and the shrink keeps only what shows it
    read = ex.reads_of([*c, *got[:k]])[0]
    lin = slice_read(events, int(read["i"]))
    assert lin.calls and len(lin.calls) < len([e for e in events if e.get("ev") == "process"]) + 10
    small = tmp_path / "swa.min.jsonl"
    res = shrink_trace(trace, lib_dir=lib_dir_of(binary), out=small, target=f"fresh:{read['i']}", budget=120)
    assert res["shrink"]["calls"] <= 8, res["shrink"]
    again = replay(small, lib_dir=lib_dir_of(binary), fresh=True)["replay"]
    assert again["short_windows"] >= 1 and again["fresh_argmax_differ"] == 1, again


def test_a_run_without_checkpoints_has_no_short_window(tmp_path: Path) -> None:
    """The control: the same requests with ``--ctx-checkpoints 0`` reprocess the prompt, and the trace
    shows no short-window decode."""
    binary = build_server("shared")
    a = [3 + (i * 7) % 250 for i in range(22)]
    trace = tmp_path / "none.jsonl"
    with ServerProcess(
        binary,
        Launch(
            model=model_path("gemma2"),
            n_parallel=1,
            ctx_size=512,
            cache_ram=0,
            ctx_checkpoints=0,
            args=["--no-warmup", "-lv", "4", "-b", "512", "-ub", "512"],
        ),
        env=trace_env(trace),
    ) as srv:
        srv.completion(a, 1, ignore_eos=True)
        srv.completion(a[:17], 8, ignore_eos=True, return_tokens=True)  # fmt: skip
    assert not [x for x in check_trace(read_trace(trace).events, n_swa=N_SWA) if "window" in x[1]]


def test_the_soaks_shrunk_swa_divergence_reproduces_on_plain_llama_cpp_python() -> None:
    """swa-restore-window-short as the ten calls the shrink left of a real soak: a restored state
    re-decoded at 154 with its memory from 140 answers 70; a fresh evaluation and the control (resumed
    at 155) answer 106."""
    p = subprocess.run([sys.executable, "fixtures/findings/swa_restore_window_short_libllama.py"], cwd=ROOT,
                       capture_output=True, text=True, timeout=120)  # fmt: skip
    assert p.returncode == 1 and "BUG:" in p.stdout, p.stdout + p.stderr
    fresh, bad, control = p.stdout.splitlines()[:3]
    assert "answers 106" in fresh
    assert "memory from 140" in bad and "answers 70 (DIFFERENT)" in bad
    assert "answers 106" in control and "DIFFERENT" not in control
