"""Idle slots of other task types (#39): embedding and rerank slots saved into the RAM prompt cache.

The model (``ServerContext.handle_stateless``), the check ``stateless_not_cached`` with its registered finding
``idle-stateless-slot-cached`` and its mutants, the real pr server against the model's prediction, and the
embedding/rerank clients of ``soak`` and ``concurrent``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from fixtures.gguf import model_path
from harness.findings import finding
from harness.load.outputs import compare_output
from harness.load.stateless import SERVER_ARGS, Step, fresh_problems, mismatches, mixed_program, mixed_run, predict
from harness.model.server_context import TASK_EMBEDDING, TASK_RERANK, ServerContext, ServerParams
from harness.targets.llama_server import Launch, ServerProcess
from harness.targets.synthetic import make_server
from harness.trees.build import build_server
from properties.families import resolve
from properties.invariants import Violation
from properties.machine import MachineConfig, machine_class
from properties.mutants import MUTANTS, STATELESS_MUTANTS
from properties.stateless import FINDING, PROPERTY, check_stateless_not_cached

ROOT = Path(__file__).resolve().parents[1]
server = pytest.mark.llama_server_builds  # the tests on a real server: built before the first (tests/conftest.py)


@pytest.fixture(scope="module")
def pr_binary() -> Path:
    return build_server("shared")


def _prompt(i: int, n: int = 30) -> tuple[int, ...]:
    """BOS then ``n`` tokens no other ``i`` shares (no slot is chosen by similarity)."""
    return (1, *((i * 5 + j * 7) % 23 + 2 for j in range(n)))


def _model(sem: object = "shared", *, idle: bool = True, kind: str = "transformer") -> ServerContext:
    params = ServerParams(cache_ram=64, cache_ram_unit=1024, cache_idle_slots=idle)
    return make_server(sem, kind, params=params)  # type: ignore[arg-type]


def _run(m: ServerContext, steps: list[tuple[str, tuple[int, ...]]]) -> None:
    for kind, toks in steps:
        if kind == "completion":
            m.handle_completion(toks)
        else:
            m.handle_stateless(toks, kind)
        m.run_until_idle()


def test_the_idle_loop_saves_every_embedding_slot_and_the_check_counts_the_finding() -> None:
    m = _model()
    steps = [("completion", _prompt(100))] + [(TASK_EMBEDDING, _prompt(i)) for i in range(6)]
    _run(m, steps)
    # each launch saves the other (idle) slot: the completion once, then every embedding but the last
    assert [(s.where, s.task_type) for s in m.stateless_saves] == [("idle", TASK_EMBEDDING)] * 5
    assert m.prompt_cache is not None and len(m.prompt_cache.states) == 6
    stateless = [t for k, t in steps if k != "completion"]
    found = check_stateless_not_cached(m, stateless)
    assert (found.entries, found.idle_saves, found.select_saves, found.finding) == (5, 5, 0, FINDING)
    assert found.nbytes == sum(s.nbytes for s in m.stateless_saves) > 0
    with pytest.raises(Violation) as e:  # strict: the finding itself fails
        check_stateless_not_cached(m, stateless, strict=True)
    assert e.value.name == PROPERTY and FINDING in str(e.value)
    assert finding(FINDING).property == PROPERTY and (ROOT / str(finding(FINDING).reproducer)).is_file()


def test_a_stateless_task_reuses_nothing_makes_no_checkpoint_and_saves_nothing_at_selection() -> None:
    m = _model(idle=False, kind="hybrid")
    p = _prompt(1, 40)
    _run(m, [("completion", p)])
    slot = next(s for s in m.slots if s.prompt.tokens)
    assert slot.prompt.checkpoints.items  # a completion on hybrid memory leaves checkpoints
    r = m.handle_stateless(p, TASK_RERANK, id_slot=slot.id)
    m.run_until_idle()
    assert r.slot == slot.id and slot.n_prompt_cached == 0  # is_stateless_task: n_past = 0 (:3196-3198)
    assert not slot.prompt.checkpoints.items and slot.prompt.tokens == p  # invalidated, none made (:3444)
    assert m.prompt_cache is not None and not m.prompt_cache.states  # no save at its selection (:1620)
    assert slot.task_prev is not None and slot.task_prev.type == TASK_RERANK
    # without idle caching a completion that takes the slot by LRU still saves the rerank's state (:1616-1628)
    _run(m, [("completion", _prompt(2, 40)), ("completion", _prompt(3, 40))])
    assert [(s.where, s.task_type, s.by) for s in m.stateless_saves] == [("select", TASK_RERANK, "completion")]
    assert check_stateless_not_cached(m, [p]).entries == 1


def test_the_select_saves_mutant_is_killed_by_the_check() -> None:
    steps = [(TASK_EMBEDDING, _prompt(i)) for i in range(3)]
    upstream, mutant = _model(idle=False), _model(STATELESS_MUTANTS["stateless-select-saves"], idle=False)
    _run(upstream, steps)
    _run(mutant, steps)
    assert check_stateless_not_cached(upstream, [t for _, t in steps]).entries == 0
    with pytest.raises(Violation, match=r"server-context\.cpp:1620"):
        check_stateless_not_cached(mutant, [t for _, t in steps])
    assert not set(STATELESS_MUTANTS) & set(MUTANTS)  # the gate's machines send no stateless task


@server
@pytest.mark.parametrize("idle", [True, False], ids=["idle-slots", "no-cache-idle-slots"])
def test_the_pr_server_caches_what_the_model_predicts(pr_binary: Path, tmp_path: Path, idle: bool) -> None:
    program = mixed_program(0, 24)
    args = [*SERVER_ARGS, "--no-warmup", "-lv", "4", *(() if idle else ("--no-cache-idle-slots",))]
    with ServerProcess(
        pr_binary,
        Launch(model=model_path("llama"), n_parallel=2, ctx_size=8192, cache_ram=64, args=args),
        log_path=tmp_path / "server.log",
    ) as srv:  # fmt: skip
        res = mixed_run(srv, program)
    assert not res.errors
    want = predict(program, res.generated, params=ServerParams(n_slots=2, cache_ram=-1, cache_idle_slots=idle))
    assert mismatches(program, res, want) == []
    held = res.stateless_entries(program)
    # measured on 0c1e570: every one of the 18 embeddings/reranks leaves an entry with idle caching; without
    # it, the 4 a completion took by LRU still do
    assert len(held) == want.finding_entries == (18 if idle else 4)
    # the reverse mutant (the idle loop skips stateless slots, as a fix would) predicts another cache: killed
    reverse = predict(program, res.generated, STATELESS_MUTANTS["idle-skips-stateless"],
                      params=ServerParams(n_slots=2, cache_ram=-1, cache_idle_slots=idle))  # fmt: skip
    assert (mismatches(program, res, reverse) != []) is idle


@server
def test_an_embedding_entry_is_loaded_only_by_a_completion_that_starts_with_it(pr_binary: Path) -> None:
    # the one use of such an entry: a later completion whose prompt starts with the embedded tokens (here after
    # the slot that ran the embedding was overwritten); on a causal model its state is a completion's
    x = (1, *(3 + (j * 11) % 250 for j in range(60)))
    others = [(1, *(3 + (j * k + 5) % 250 for j in range(40))) for k in (13, 17)]
    c = (*x, *(3 + (j * 19) % 250 for j in range(20)))
    args = [*SERVER_ARGS, "--no-warmup"]
    with ServerProcess(
        pr_binary,
        Launch(model=model_path("llama"), n_parallel=2, ctx_size=4096, cache_ram=64, args=args),
    ) as srv:
        for e in (x, *others):
            srv.request("POST", "/embeddings", {"content": list(e)})
        r = srv.completion(list(c), 4, ignore_eos=True, return_tokens=True)
    m = make_server("shared", "transformer", params=ServerParams(n_slots=2, cache_ram=-1), n_ctx=4096)
    for e in (x, *others):
        m.handle_stateless(e, TASK_EMBEDDING)
        m.run_until_idle()
    launched = m.handle_completion(c, n_predict=4)
    m.run_until_idle()
    assert m.prompt_cache is not None and m.prompt_cache.loads == 1
    assert r["timings"]["cache_n"] == m.slots[launched.slot].n_prompt_cached == len(x)
    with ServerProcess(
        pr_binary,
        Launch(model=model_path("llama"), n_parallel=1, ctx_size=4096, cache_ram=0, args=args),
    ) as fresh:
        assert compare_output(fresh, c, r["tokens"], "llama") is None


@server
def test_the_reproducer_shows_embeddings_alone_filling_the_cache(pr_binary: Path) -> None:
    script = ROOT / "fixtures" / "findings" / "idle_stateless_slot_cached.py"
    p = subprocess.run([sys.executable, str(script), str(pr_binary), "-", "20"], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)  # fmt: skip
    assert p.returncode == 1, p.stdout + p.stderr
    assert "the cache holds 19 entries" in p.stdout


@server
def test_soak_and_concurrent_with_embedding_clients(pr_binary: Path, tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    p = subprocess.run(
        [sys.executable, "-m", "harness", "soak", "--minutes", "0.1", "--arch", "llama", "--embedding-clients", "1",
         "--no-trace", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads(out.read_text())
    for phase in doc["phases"]:
        assert phase["stateless"]["embeddings"] + phase["stateless"]["reranks"] > 0
        assert phase["output_checks"] > 0 and phase["rss_max_bytes"] <= phase["rss_bound_bytes"]
        assert phase["cache_max_mib"] <= phase["cache_limit_mib"]
    assert "embeddings" in p.stdout and "reranks besides" in p.stdout
    out = tmp_path / "concurrent.json"
    p = subprocess.run(
        [sys.executable, "-m", "harness", "concurrent", "--short", "--traces", "1", "--embedding-clients", "1",
         "--no-trace", "--json", str(out)],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    rows = json.loads(out.read_text())["configs"]
    for row in rows.values():
        s = row["stateless"]
        assert s["problems"] == [] and s["stateless_entries"] == s["predicted_entries"] > 0
        # the embedding client in the overlapping phase: replayed by the model, RSS and cache size bounded
        assert row["embeddings"] == 8 and row["bound_violations"] == 0 and 0 < row["rss_peak"] <= row["rss_bound"]


def test_bad_embedding_clients_are_one_line() -> None:
    for cmd in (["soak", "--minutes", "1"], ["concurrent"]):
        p = subprocess.run([sys.executable, "-m", "harness", *cmd, "--embedding-clients", "-1"], capture_output=True,
                           text=True, timeout=60, cwd=ROOT)  # fmt: skip
        assert p.returncode == 2 and "--embedding-clients" in p.stderr and "Traceback" not in p.stderr


# ---- issue #50: stateless_fresh and idle_pass, pinned to upstream's rules on the model --------------------------


def _stateless_machine(name: str) -> Any:
    return machine_class(MachineConfig(name, "transformer", family="stateless", resolve=resolve))()


def test_a_stateless_task_that_resumes_from_a_prefix_dies_by_stateless_fresh() -> None:
    upstream, mutant = _stateless_machine("shared"), _stateless_machine("stateless-resumes-prefix")
    for m in (upstream, mutant):
        m.stateless_request(source=0, keep=0, suffix=[5, 6, 7], id_slot=1, rerank=False)
        m.state_invariants()
    upstream.stateless_request(source=1, keep=2, suffix=[9], id_slot=1, rerank=True)
    upstream.state_invariants()
    assert upstream.pinned.checked["stateless_fresh"] >= 4
    with pytest.raises(Violation, match=r"server-context\.cpp:3196-3198") as e:
        mutant.stateless_request(source=1, keep=2, suffix=[9], id_slot=1, rerank=True)
    assert e.value.name == "stateless_fresh"


def test_the_idle_loop_that_skips_stateless_slots_dies_by_idle_pass_on_the_model() -> None:
    # upstream's loop saves every idle slot, an embedding's too (:2419-2432): the reverse mutant is now killed on
    # the model, beside the real server's test above
    m = _stateless_machine("idle-skips-stateless")
    m.stateless_request(source=0, keep=0, suffix=[5, 6, 7], id_slot=-1, rerank=False)
    with pytest.raises(Violation, match="saved idle slot") as e:
        m.request(source=0, keep=0, suffix=[], id_slot=0, n_cmpl=1, n_predict=1, overlap=False)
    assert e.value.name == "idle_pass"


def _task(slot: int, task: int, n: int, cached: int, held: int, *, update: bool = False,
          checkpoint: bool = False) -> str:  # fmt: skip
    """One task's lines of a -lv 4 log, as 0c1e570 prints them, from its slot's selection to its release."""
    p = f"0.1 I slot operator(): id  {slot} | task {task} | "
    lines = [f"0.1 I slot get_availabl: id  {slot} | task -1 | selected slot by LRU, t_last = -1"]
    lines += ["0.1 I srv  get_availabl: updating prompt cache"] if update else []
    lines += [f"0.1 I slot launch_slot_: id  {slot} | task {task} | processing task, is_child = 0",
              f"{p}new prompt, n_ctx_slot = 1024, n_keep = 0, task.n_tokens = {n}",
              f"{p}cached n_tokens = {cached}, memory_seq_rm [{cached}, end)"]  # fmt: skip
    lines += [f"{p}created context checkpoint 1 of 4 (pos_min = 0, pos_max = 9, n_tokens = 10, size = 0.1 MiB)"
              ] if checkpoint else []  # fmt: skip
    lines.append(f"0.2 I slot      release: id  {slot} | task {task} | stop processing: n_tokens = {held}, "
                 "truncated = 0")
    return "\n".join(lines) + "\n"


def test_a_stateless_tasks_log_lines_hold_it_to_stateless_fresh() -> None:
    """``fresh_problems`` on a log of a completion then an embedding: a fresh start holds; a cache update at its
    selection, a cached prefix, a checkpoint or generated tokens held at release each fail, naming the step."""
    program = [Step("completion", (1,) * 61), Step(TASK_EMBEDDING, (1,) * 40)]
    done = _task(0, 0, 61, 0, 63, update=True)
    assert fresh_problems(done + _task(0, 4, 40, 0, 40), program) == (1, [])
    for bad, said in ((_task(0, 4, 40, 0, 40, update=True), "the prompt cache was updated"),
                      (_task(0, 4, 40, 39, 40), "resumed from 39 cached tokens"),
                      (_task(0, 4, 40, 0, 40, checkpoint=True), "created a context checkpoint"),
                      (_task(0, 4, 40, 0, 41), "its slot held 41 tokens at release, its prompt 40")):  # fmt: skip
        checked, problems = fresh_problems(done + bad, program)
        assert checked == 1 and len(problems) == 1 and problems[0].startswith("step 1 (embedding of 40 tokens): ")
        assert said in problems[0], problems
    assert fresh_problems(done, program) == (0, [])  # a release missing: the log is not read against the program
