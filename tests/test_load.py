"""harness.load on the real pr llama-server: the concurrent differential, the order parser, the soak command."""

from __future__ import annotations

import contextlib
import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from fixtures.gguf import model_path
from harness.backends.base import GateOptions, GateReport
from harness.backends.llama_server.section import ServerSection
from harness.load.clients import BUSY, Req, run_clients
from harness.load.concurrent import attach_trace, concurrent_configs, fresh_server, judge, load_config, scenario
from harness.load.gate_step import server_concurrent_step
from harness.load.order import cache_states, parse_log, tasks
from harness.load.outputs import (
    BATCH_SHAPE_FLIP_GAP,
    Divergences,
    OutputDiff,
    _gap,
    _gap_resumed,
    _pieces_complete,
    compare_output,
)
from harness.load.soak import LiveServer, check_sanitizer_reports
from harness.load.soak_result import PhaseResult
from harness.load.traced import ServerTrace
from harness.targets.llama_server import Launch, ServerProcess
from harness.trace.replay import lib_dir_of, replay
from harness.trees.build import build_server

pytestmark = pytest.mark.llama_server_builds  # built before the first test (tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def pr_binary() -> Path:
    return build_server("shared")


def test_gate_step_follows_the_servers_order_and_finds_no_mismatch(pr_binary: Path) -> None:
    report = GateReport("shared", "server", "ci", 0, "test")
    section = ServerSection({"binary": str(pr_binary), "semantics": "shared", "build_name": "pr"})
    report.sections["server"] = section
    lines: list[str] = []
    server_concurrent_step(report, GateOptions(seed=3), lines.append)
    fig = section.figures["concurrent"]
    assert fig["requests"] == 2 * sum(min(4, c.n_parallel + 1) * 4 for c in concurrent_configs(short=True))
    assert fig["interleavings"] > 0  # the traces overlapped (busy slots are named when /slots shows one)
    assert fig["mismatches"] == 0 and fig["unmodellable"] is None, lines
    assert not [m.failure for m in report.machines if m.failure], lines
    ids = {k.id: k for k in report.known}
    assert set(ids) == {"busy-slot-by-id", "busy-slot-by-id-livelock", "concurrent-output-divergence"}
    assert ids["busy-slot-by-id"].count == fig["busy_slot_by_id"]
    assert fig["traced"] is True and fig["traces_kept"] == []  # every server traced; a passing run keeps none


def test_a_wrong_response_is_a_mismatch_with_the_timed_trace(pr_binary: Path, tmp_path: Path) -> None:
    """A trace judged as it came is clean; the same trace with one response's cache_n off by one, or one
    generated token changed on the pure recurrent model, fails and carries the program that replays it."""
    cfg = load_config("mamba", 2, False)
    reqs = scenario(7, 3, 2, 3, 1024, busy=False)  # a clean trace: no busy-slot-by-id can excuse a mismatch
    with fresh_server(cfg, pr_binary) as fresh:
        server = ServerProcess(
            pr_binary,
            Launch(
                model=model_path("mamba"),
                n_parallel=2,
                ctx_size=2048,
                cache_ram=cfg.cache_ram_mib,
                ctx_checkpoints=4,
                args=[*cfg.server_args(), "-lv", "4"],
            ),
            log_path=tmp_path / "s.log",
        )  # fmt: skip
        with server:
            run = run_clients(server, reqs)
        log = (tmp_path / "s.log").read_text()
        good = judge(cfg, "shared", log, run.sents, fresh, "REQS = [] # program")
        assert good.requests == len(reqs) and good.mismatches == 0, good.failures + good.notes
        first = next(s for s in run.sents if s.response is not None)
        first.response["timings"]["cache_n"] += 1  # type: ignore[index]
        bad = judge(cfg, "shared", log, run.sents, fresh, "REQS = [] # program")
        assert bad.cache_n_mismatches >= 1 and bad.program == "REQS = [] # program", bad.failures
        first.response["timings"]["cache_n"] -= 1  # type: ignore[index]
        toks = first.response["tokens"]  # type: ignore[index]
        toks[-1] = (toks[-1] + 1) % 200 + 3
        worse = judge(cfg, "shared", log, run.sents, fresh, "REQS = [] # program")
        assert worse.output_mismatches >= 1 and any(f.startswith("output:") for f in worse.failures)


def test_order_parser_reads_selections_saves_and_releases(pr_binary: Path, tmp_path: Path) -> None:
    log = tmp_path / "s.log"
    a = [3 + (i * 7) % 250 for i in range(120)]
    with ServerProcess(
        pr_binary,
        Launch(model=model_path("llama"), n_parallel=2, ctx_size=1024, cache_ram=4, args=["-lv", "4", "--no-warmup"]),
        log_path=log,
    ) as srv:  # fmt: skip
        run = run_clients(srv, [Req(0, 0.0, tuple(a), 300), Req(1, 0.01, (*a[:60], 9, 9), 3, BUSY)])
    events = parse_log(log.read_text())
    kinds = [e.kind for e in events]
    assert kinds.count("launch") == 2 and kinds.count("release") == 2 and "save" in kinds
    info = tasks(events)
    assert sorted((t.n_prompt, t.n_decoded) for t in info.values()) == [(62, 3), (120, 300)]
    assert run.sents[1].id_slot in (0, 1, -1)
    assert cache_states(log.read_text()), "the cache's state lines are read"


def test_divergences_explain_only_what_a_known_finding_explains() -> None:
    for arch in ("mamba", "llama"):  # strict on every model: attention no longer excuses a divergence
        d = Divergences(arch)
        assert not d.explains((1, 2, 3), 0)
        d.add((1, 2), (3,))  # a response busy-slot-by-id changed
        assert d.explains((1, 2, 3, 4), 3) and not d.explains((1, 5, 3, 4), 3)


def test_only_a_flip_within_the_models_batch_shape_bound_is_a_known_finding() -> None:
    def diff(gap: float | None, arch: str = "llama") -> OutputDiff:
        return OutputDiff(arch, (5, 6), (7, 8), (7, 9), 1, gap)

    assert Divergences.batch_shape(diff(0.0142), 0) == "concurrent-output-divergence"
    assert Divergences.batch_shape(diff(0.0142), 5) == "greedy-flip-on-cache-path"
    assert Divergences.batch_shape(diff(BATCH_SHAPE_FLIP_GAP["llama"]), 0) is None  # the bound is exclusive
    assert Divergences.batch_shape(diff(0.05, "lfm2"), 0) is None  # lfm2's measured shift is narrower
    assert Divergences.batch_shape(diff(1e-6, "mamba"), 0) is None  # no attention layer: nothing to excuse
    assert Divergences.batch_shape(diff(None), 0) is None  # not in the fresh server's top 10
    assert "logprob gap 0.3000" in diff(0.3).describe() and "llama's bound 0.18" in diff(0.3).describe()


def test_a_gap_the_server_withheld_is_recomputed_in_the_fresh_generations_shape(pr_binary: Path) -> None:
    """llama-server reports no probabilities for a token that leaves its text inside a UTF-8 sequence; the
    gap there is recomputed on the same memory, one row, and must equal the reported one where both exist."""
    cfg = load_config("llama", 2, False)
    with fresh_server(cfg, pr_binary) as fresh:
        prompt = [3 + (i * 37) % 250 for i in range(40)]
        r = fresh.completion(prompt, 24, ignore_eos=True, return_tokens=True, cache_prompt=False, n_probs=10)
        want = [int(t) for t in r["tokens"]]
        probs = r["completion_probabilities"]
        reported = [k for k, ok in enumerate(_pieces_complete(want)) if ok]
        assert [want[k] for k in reported] == [int(p["id"]) for p in probs]  # the server's own rule
        withheld = [k for k in range(len(want)) if k not in reported]
        assert withheld, "no withheld token in 24: pick another prompt"
        assert _gap_resumed(fresh, prompt, want, withheld[0], want[withheld[0]]) == 0.0  # its best is its own
        for k in reported[1:4]:
            second = int(probs[reported.index(k)]["top_logprobs"][1]["id"])
            assert _gap_resumed(fresh, prompt, want, k, second) == _gap(probs[reported.index(k)], second)
        j = withheld[0]
        d = compare_output(fresh, prompt, [*want[:j], (want[j] + 1) % 250 + 3, *want[j + 1 :]], "llama")
        assert d is not None and d.index == j
        assert d.gap is not None or "not in the fresh server's top 10" in d.describe()


def test_a_wrong_answer_on_an_attention_model_fails_with_its_libllama_trace(pr_binary: Path, tmp_path: Path) -> None:
    """Strict on llama too: a generated token moved off the fresh server's answer by more than the bound is
    an output mismatch, and its record names the kept trace of the real traced server and the lines that
    replay and shrink it; the trace replays to the server's logits bit for bit. A clean judgement deletes it."""
    cfg = load_config("llama", 2, False)
    reqs = scenario(7, 3, 2, 3, 1024, busy=False)
    traces = ServerTrace(pr_binary, tmp_path / "traces")
    trace = traces.path("llama-trace0")
    assert trace is not None
    with fresh_server(cfg, pr_binary) as fresh:
        server = ServerProcess(
            pr_binary,
            Launch(
                model=model_path("llama"),
                n_parallel=2,
                ctx_size=2048,
                cache_ram=cfg.cache_ram_mib,
                ctx_checkpoints=4,
                args=[*cfg.server_args(), "-lv", "4"],
            ),
            log_path=tmp_path / "s.log",
            env=traces.env(trace),
        )  # fmt: skip
        with server:
            run = run_clients(server, reqs)
        log = (tmp_path / "s.log").read_text()
        good = judge(cfg, "shared", log, run.sents, fresh, "REQS = []")
        assert good.output_mismatches == 0, good.failures
        # an answer equal to the fresh server's (one that flipped within the bound would hide the planted token)
        same = [s for s in run.sents if s.generated and not compare_output(fresh, s.req.tokens, s.generated, "llama")]
        first = same[0]
        toks = first.response["tokens"]  # type: ignore[index]
        at = len(toks) - 1
        # a replacement whose gap is beyond the bound (the tiny model has near-ties: check, do not assume)
        for cand in range(3, 259):
            d = compare_output(fresh, first.req.tokens, [*toks[:at], cand], "llama")
            if d is not None and d.index == at and not d.batch_shape_flip:
                break
        else:
            raise AssertionError("every token is within the bound of the fresh answer's last one")
        toks[at] = cand
        bad = judge(cfg, "shared", log, run.sents, fresh, "REQS = []")
    assert bad.output_mismatches >= 1 and bad.concurrent_divergences == good.concurrent_divergences
    attach_trace(bad, traces, trace)
    assert trace.is_file() and bad.trace.startswith(f"libllama trace {trace}")
    out = next(f for f in bad.failures if f.startswith("output:"))
    assert f"python -m harness trace replay {trace}" in out and f"python -m harness trace shrink {trace}" in out
    res = replay(trace, lib_dir=lib_dir_of(pr_binary))["replay"]
    assert res["reads"] > 0 and res["reads_same"] == res["reads"] and not res["rets_differ"]
    clean = ServerTrace(pr_binary, tmp_path / "traces")
    other = clean.path("clean")
    assert other is not None
    other.write_text("{}\n")
    attach_trace(good, clean, other)
    assert not other.exists() and good.trace == ""


def test_a_failed_decode_explains_only_prompts_that_reuse_its_tokens() -> None:
    d = Divergences("mamba")
    failed = (7, 8, 9, 10, 11, 12)
    assert not d.explains((*failed, 13), 6)
    d.failed_decode(failed)
    assert d.after_failed_decode((*failed, 13), 6) and d.explains((*failed, 13), 6)
    assert not d.after_failed_decode((7, 8, 9, 99, 11), 5)  # shares 3 first tokens only
    assert not d.after_failed_decode((*failed, 13), 0)  # reused nothing: a fresh evaluation
    assert not d.explains((1, 2, 3, 4, 5), 5)


def test_a_request_overlapping_a_restart_is_part_of_the_crash(pr_binary: Path, tmp_path: Path) -> None:
    # a client reaching the new server while it loads its model gets HTTP 503 "Loading model": the soak
    # must count that with the crash under a fault, never as a request error with faults off
    n = iter(range(10))
    live = LiveServer(lambda: ServerProcess(
        pr_binary,
        Launch(model=model_path("mamba"), n_parallel=1, ctx_size=256, cache_ram=0, args=["--no-warmup"]),
        log_path=tmp_path / f"s{next(n)}.log",
    ))  # fmt: skip
    live.server.start()
    try:
        assert not live.in_crash(0)
        seen: list[bool] = []
        done = threading.Event()

        def watch() -> None:  # a client's view while the restart runs
            while not done.is_set():
                seen.append(live.in_crash(0))
                time.sleep(0.002)

        t = threading.Thread(target=watch)
        t.start()
        try:
            # from this thread, as the soak's sampler does: a server dies with the thread that started it
            # (PR_SET_PDEATHSIG), so a restart must not run in a thread that ends
            live.restart()
        finally:
            done.set()
            t.join()
        assert any(seen), "restart() marks the time it runs"
        assert live.in_crash(0) and not live.in_crash(1)  # sent before the restart / after it
        assert live.server.running()
    finally:
        live.server.stop()


def test_decode_exception_reproducer_shows_the_finding_on_the_pr_server(pr_binary: Path) -> None:
    # standalone, as a maintainer runs it: the slot keeps the tokens of a batch whose decode threw
    script = ROOT / "fixtures" / "findings" / "decode_exception_keeps_slot_tokens.py"
    p = subprocess.run([sys.executable, str(script), "--server-bin", str(pr_binary)],
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert p.returncode == 1, p.stdout + p.stderr
    assert "decode() failed: std::bad_alloc" in p.stdout and "BUG:" in p.stdout


def _soak(tmp_path: Path, *extra: str) -> tuple[subprocess.CompletedProcess[str], dict]:
    out = tmp_path / "soak.json"
    p = subprocess.run(
        [sys.executable, "-m", "harness", "soak", "--minutes", "0.1", "--arch", "mamba", "--json", str(out), *extra],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    return p, json.loads(out.read_text())


def test_tiny_soak_writes_its_figures(pr_binary: Path, tmp_path: Path) -> None:
    p, doc = _soak(tmp_path)
    assert p.returncode == 0, p.stdout + p.stderr
    assert [(ph["arch"], ph["faults"]) for ph in doc["phases"]] == [("mamba", False), ("mamba", True)]
    for ph in doc["phases"]:
        assert ph["requests"] > 0 and ph["rss_curve"] and ph["p99_ms"] >= ph["p50_ms"] > 0
        assert ph["rss_max_bytes"] <= ph["rss_bound_bytes"] and ph["cache_max_mib"] <= ph["cache_limit_mib"]
        assert ph["output_checks"] > 0
    assert doc["passed"] is True and doc["violations"] == []
    assert "server logs kept" not in p.stderr  # a pass removes them


def test_soak_detects_a_broken_rss_bound(pr_binary: Path, tmp_path: Path) -> None:
    p, doc = _soak(tmp_path, "--rss-bound", "1")
    assert p.returncode == 1, p.stdout + p.stderr
    assert any("exceeds the bound" in v for v in doc["violations"]) and doc["passed"] is False
    assert "--- replay ---" in p.stdout and "--rss-bound 1" in p.stdout
    # nothing lost: the servers' logs stay, and the run says where
    kept = Path(p.stderr.split("server logs kept in ", 1)[1].split()[0])
    try:
        assert any(f.name.startswith("soak-mamba-") and f.stat().st_size > 0 for f in kept.iterdir())
    finally:
        shutil.rmtree(kept, ignore_errors=True)


def _descendants(pid: int) -> set[int]:
    out: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError), open(f"/proc/{p}/task/{p}/children") as f:
            kids = {int(k) for k in f.read().split()}
            out |= kids
            todo += kids
    return out


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for p in pids:
        with contextlib.suppress(OSError), open(f"/proc/{p}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                alive.add(p)
    return alive


@pytest.mark.parametrize("argv", [["soak", "--minutes", "2", "--arch", "mamba"], ["concurrent", "--traces", "2"]])
def test_ctrl_c_under_load_stops_every_server_and_exits_130(pr_binary: Path, argv: list[str], tmp_path: Path) -> None:
    """The clients are sending, two servers run (the one under load and the fresh one): Ctrl-C ends it all, and
    the JSON asked for still says the run did not pass."""
    out = tmp_path / "run.json"
    argv = [*argv, "--json", str(out)] if argv[0] == "soak" else argv
    proc = subprocess.Popen([sys.executable, "-m", "harness", *argv], cwd=ROOT, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip
    seen: set[int] = set()
    try:
        deadline = time.monotonic() + 240
        while len(_alive(seen)) < 2:  # both servers started (their model loaded or loading)
            seen |= _descendants(proc.pid)
            assert proc.poll() is None and time.monotonic() < deadline, "the servers did not start"
            time.sleep(0.02)
        time.sleep(2.0)  # requests in flight
        seen |= _descendants(proc.pid)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
        took = time.monotonic() - t0
    finally:
        proc.kill()
    assert proc.returncode == 130 and "Traceback" not in err, err
    assert took < 30
    assert not _alive(seen), "a server or child outlived the command"
    if argv[0] == "soak":
        doc = json.loads(out.read_text())
        assert doc["passed"] is False and doc["error"] == "KeyboardInterrupt", doc


def test_busy_slot_by_id_reproducer_shows_the_wrong_answer_on_the_pr_server(pr_binary: Path) -> None:
    p = subprocess.run([sys.executable, "fixtures/findings/busy_slot_by_id_server.py", "pr"], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    if p.returncode == 2:
        pytest.skip("the request naming the busy slot never landed while it ran (machine too slow): " + p.stdout)
    assert p.returncode == 1 and "BUG:" in p.stdout, p.stdout + p.stderr  # 1: present at 0c1e570 (+ PR #27451)


def test_a_sanitizer_report_in_a_soaked_servers_log_fails_the_phase(tmp_path: Path) -> None:
    """An ASan build has no RSS bound in the soak; its reports fail the phase instead: a real use-after-free
    report (a tiny program built with -fsanitize=address) in one server's log is a violation, a clean log none."""
    src = tmp_path / "uaf.c"
    src.write_text("#include <stdlib.h>\nint main(void) { int *p = malloc(4); free(p); return p[0]; }\n")
    exe = tmp_path / "uaf"
    subprocess.run(["gcc", "-fsanitize=address", "-g", str(src), "-o", str(exe)], check=True)
    log = tmp_path / "soak-llama-off-1.log"
    with log.open("w") as fh:
        subprocess.run([str(exe)], stdout=fh, stderr=subprocess.STDOUT, check=False)
    clean = tmp_path / "soak-llama-fresh.log"
    clean.write_text("srv  update_slots: all slots are idle\n")
    res = PhaseResult("llama", False, asan=True)
    check_sanitizer_reports([clean, log, tmp_path / "never-started.log"], res)
    assert len(res.sanitizer_reports) == 1 and "heap-use-after-free" in res.sanitizer_reports[0], res.sanitizer_reports
    assert res.violations and str(log) in res.violations[0]
    assert res.summary()["asan"] is True and res.summary()["sanitizer_reports"] == res.sanitizer_reports
