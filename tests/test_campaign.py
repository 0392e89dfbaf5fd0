"""Fuzz campaigns for real: worker processes, a real Redis server, real kills.

Each campaign here is small (one or two machines, a few seconds); the mutant ``size-omits-checkpoints``
plants the failure a campaign must find, shrink, save and print with its replay line. The Redis
server is Debian's ``redis-server`` on 127.0.0.1 on a free port, always stopped after the module
(``.ci/run`` installs it; without it the Redis tests are skipped, saying so).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from harness.backends import BACKENDS
from harness.backends.base import Backend, MachineSpec, Plan, model_spec
from harness.backends.synthetic import SyntheticBackend
from harness.campaign import machines as campaign_machines
from harness.campaign.store import failures, open_db
from harness.cli import main
from harness.errors import PropertyFailure, UsageError
from harness.model.semantics import SHARED
from properties.families import FAMILY_MUTANTS, family_configs, mutant_configs
from properties.machine import MachineConfig
from properties.mutants import MUTANTS
from properties.mutants import config as mutant_config
from properties.run import machines_for, make_settings, run_machine

ROOT = Path(__file__).resolve().parents[1]
MUTANT = "size-omits-checkpoints"
MACHINE = mutant_config(MUTANT).class_name  # the mutant's own machine: finds it within seconds


def fuzz_argv(db: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "harness", "fuzz", "--db", db, "--plain", "--interval", "1", *extra]


def mutant_campaign(db: str, *extra: str, timeout: float = 240) -> subprocess.CompletedProcess[str]:
    argv = fuzz_argv(db, "--mutant", MUTANT, "--machine", MACHINE, "--examples", "40", "--workers", "1", *extra)
    return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=False)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def _redis_server() -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.skip("redis-server is not installed (apt-get install redis-server; .ci/run does)")
    port = _free_port()
    proc = subprocess.Popen(
        [exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 20
        while True:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
                break
            assert proc.poll() is None, "redis-server exited at start"
            assert time.monotonic() < deadline, "redis-server did not listen within 20 s"
            time.sleep(0.1)
        yield f"redis://127.0.0.1:{port}/0", proc
    finally:
        proc.kill()
        proc.wait(timeout=10)


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
    with _redis_server() as (url, _proc):
        yield url


@pytest.fixture(scope="module")
def first_campaign(redis_url: str) -> subprocess.CompletedProcess[str]:
    """A campaign on the shared Redis database that finds the mutant's planted failure."""
    return mutant_campaign(redis_url)


def _record_id(output: str) -> str:
    line = next(x for x in output.splitlines() if x.startswith("FAILED "))
    return line.split("[", 1)[1].split("]", 1)[0]


def test_a_campaign_finds_the_planted_failure_saves_it_then_prints_it(
    first_campaign: subprocess.CompletedProcess[str], redis_url: str
) -> None:
    r = first_campaign
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"FAILED accounting (violation) in {MACHINE}" in r.stdout
    fid = _record_id(r.stdout)
    assert f"python -m harness replay --db {redis_url} --id {fid}" in r.stdout
    assert f"state = {MACHINE}()" in r.stdout  # the shrunk program, pasteable
    records = failures(open_db(redis_url))
    assert [x.id for x in records] == [fid]
    assert records[0].property == "accounting" and records[0].mutant == MUTANT


def test_a_second_campaign_on_the_same_redis_replays_the_first_ones_failure_first(
    first_campaign: subprocess.CompletedProcess[str], redis_url: str
) -> None:
    fid = _record_id(first_campaign.stdout)
    r = mutant_campaign(redis_url)
    lines = r.stdout.splitlines()
    assert lines[1] == "replaying the 1 failure(s) the database holds first:", r.stdout
    assert lines[2].startswith(f"  [still failing] {fid} accounting in {MACHINE}")
    assert r.returncode == 1  # still failing
    assert "new failures: 0" in r.stdout  # found again by this campaign, not recorded twice
    assert len(failures(open_db(redis_url))) == 1


def test_replay_says_still_failing_then_fixed_once_the_bug_is_gone(
    first_campaign: subprocess.CompletedProcess[str],
    redis_url: str,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
) -> None:
    fid = _record_id(first_campaign.stdout)
    assert main(["replay", "--db", redis_url, "--json", str(tmp_path / "r.json")]) == 1
    out = capsys.readouterr().out
    assert f"[still failing] {fid}" in out and "1 still failing" in out
    assert f"state = {MACHINE}()" in out
    # the "fix": the mutant's semantics replaced by the real shared semantics
    monkeypatch.setitem(MUTANTS, MUTANT, replace(MUTANTS[MUTANT], semantics=SHARED))
    assert main(["replay", "--db", redis_url, "--id", fid]) == 0
    out = capsys.readouterr().out
    assert f"[fixed] {fid}" in out and "1 fixed" in out
    verdicts = json.loads((tmp_path / "r.json").read_text())["failures"]
    assert [v["verdict"] for v in verdicts] == ["still failing"]
    assert main(["replay", "--db", redis_url, "--id", "nope"]) == 2  # bad input: one line


def _children(pid: int) -> set[int]:
    """Every descendant of ``pid`` (from /proc)."""
    out: set[int] = set()
    todo = [pid]
    while todo:
        p = todo.pop()
        with contextlib.suppress(OSError):
            kids = {int(k) for t in os.listdir(f"/proc/{p}/task") for k in _read(f"/proc/{p}/task/{t}/children")}
            out |= kids
            todo += kids
    return out


def _read(path: str) -> list[str]:
    with contextlib.suppress(OSError), open(path) as f:
        return f.read().split()
    return []


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for p in pids:
        with contextlib.suppress(OSError), open(f"/proc/{p}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                alive.add(p)
    return alive


def _wait_gone(pids: set[int], seconds: float = 15) -> set[int]:
    deadline = time.monotonic() + seconds
    while _alive(pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    return _alive(pids)


def _start(argv: list[str]) -> subprocess.Popen[str]:
    return subprocess.Popen(argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _read_until(proc: subprocess.Popen[str], marker: str, seconds: float) -> str:
    assert proc.stdout is not None
    seen = []
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        line = proc.stdout.readline()
        if not line:
            break
        seen.append(line)
        if marker in line:
            return "".join(seen)
    raise AssertionError(f"no {marker!r} within {seconds}s:\n{''.join(seen)}")


def test_kill_9_of_the_campaign_loses_no_reported_failure_and_leaves_no_worker(tmp_path: Path) -> None:
    db = str(tmp_path / "db")
    argv = fuzz_argv(db, "--mutant", MUTANT, "--machine", MACHINE, "--machine", "Size_omits_checkpoints_iswa")
    proc = _start([*argv, "--minutes", "5", "--workers", "2"])
    try:
        seen = _read_until(proc, "python -m harness replay --db", 240)  # the first failure was reported
        workers = _children(proc.pid)
        assert len(workers) >= 2
        proc.kill()  # SIGKILL: no finally, no summary
        proc.wait(timeout=10)
        assert not _wait_gone(workers), "workers outlived the campaign"
    finally:
        proc.kill()
        proc.wait(timeout=10)
    reported = {line.split("[", 1)[1].split("]", 1)[0] for line in seen.splitlines() if line.startswith("FAILED ")}
    assert reported and reported <= {r.id for r in failures(open_db(db))}


SIGTERM_BIT = 1 << (signal.SIGTERM - 1)
ENDED_WITHIN = 5.0  # the promise on a loaded host; the tests allow generous slack for a busier one
SLACK = 25.0


def _harness_started(pid: int) -> bool:
    """``harness/__main__.py`` runs: it catches SIGTERM before its first import (Python does not)."""
    for line in _read_lines(f"/proc/{pid}/status"):
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) & SIGTERM_BIT)
    return False


def _read_lines(path: str) -> list[str]:
    with contextlib.suppress(OSError), open(path) as f:
        return f.read().splitlines()
    return []


class Interrupted:
    """A command started, sent SIGINT at a moment of its life, and what it left."""

    def __init__(self, argv: list[str], *, ignore_sigint: bool = False) -> None:
        self.proc = subprocess.Popen(
            argv, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
            preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN)) if ignore_sigint else None,
        )  # fmt: skip
        self.lines: list[str] = []
        self.descendants: set[int] = set()
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def wait_for(self, moment: Callable[[], bool], seconds: float = 240) -> None:
        deadline = time.monotonic() + seconds
        while not moment():
            self.descendants |= _children(self.proc.pid)
            assert self.proc.poll() is None, f"ended before the moment: {self.lines}"
            assert time.monotonic() < deadline, f"the moment did not come within {seconds}s: {self.lines}"
            time.sleep(0.01)
        self.descendants |= _children(self.proc.pid)

    def line(self, text: str) -> Callable[[], bool]:
        return lambda: any(text in x for x in self.lines)

    def interrupt(self, *, then: float | None = None) -> tuple[int, float, str]:
        """SIGINT (and another ``then`` s later); the exit code, the seconds it took, stderr."""
        t0 = time.monotonic()
        self.proc.send_signal(signal.SIGINT)
        if then is not None:
            time.sleep(then)
            assert self.proc.poll() is None, "ended before the second Ctrl-C"
            t0 = time.monotonic()
            self.proc.send_signal(signal.SIGINT)
        try:
            rc = self.proc.wait(timeout=ENDED_WITHIN + SLACK)
        finally:
            self.proc.kill()
        took = time.monotonic() - t0
        self.reader.join(10)
        assert self.proc.stderr is not None
        return rc, took, self.proc.stderr.read()

    def left(self) -> set[int]:
        return _wait_gone(self.descendants, 2)


def _machines_run(line: str) -> int:
    """N of a live line's "N/M machines run" (0 when the line has none)."""
    m = re.search(r"(\d+)/\d+ machines run", line)
    return int(m.group(1)) if m else 0


def _summaries(lines: list[str]) -> int:
    return sum(1 for x in lines if x.startswith(("interrupted: [", "done: [")))


# every moment of a campaign's life: the interpreter importing, the database opened and the header printed,
# the workers starting, running, changing machines, and (the mutant) finding, shrinking and reporting failures
MOMENTS = {
    "imports": ("started", 0.0),
    "imports-late": ("started", 1.0),
    "header": ("fuzz: backends=", 0.0),
    "workers-starting": ("fuzz: backends=", 0.5),
    "workers-running": ("examples (", 0.0),
    "changing-machines": ("machines run", 0.0),  # from the first line with 3 or more of the 9 run (see below)
    "failure-printed": ("FAILED ", 0.0),  # the other worker may be shrinking one of its own
    "sigint-inherited-ignored": ("examples (", 0.0),
}


@pytest.mark.parametrize("moment", list(MOMENTS))
def test_ctrl_c_at_any_moment_ends_the_campaign_with_one_summary_no_child_and_every_failure(
    moment: str, tmp_path: Path
) -> None:
    db = str(tmp_path / "db")
    mutant = moment.startswith("failure")
    which = ["--mutant", MUTANT, "--machine", MACHINE, "--machine", "Size_omits_checkpoints_iswa"] if mutant else [
        "--machine", "Shared_hybrid*"]  # fmt: skip
    run = Interrupted([*fuzz_argv(db, *which), "--minutes", "5", "--workers", "2"],
                      ignore_sigint=moment == "sigint-inherited-ignored")  # fmt: skip
    marker, after = MOMENTS[moment]
    try:
        if marker == "started":
            run.wait_for(lambda: _harness_started(run.proc.pid))
        elif moment == "changing-machines":  # the live line is printed once a second: it may skip from 2/9 to 4/9
            run.wait_for(lambda: any(_machines_run(x) >= 3 for x in run.lines))
        else:
            run.wait_for(run.line(marker))
        time.sleep(after)
        rc, took, err = run.interrupt()
    finally:
        run.proc.kill()
    out = run.lines
    assert rc == 130, (rc, out, err)
    assert took < ENDED_WITHIN + SLACK
    assert "Traceback" not in err, err
    assert not run.left(), f"children outlived the campaign: {run.left()}"
    if not any(x.startswith("fuzz: backends=") for x in out):  # interrupted in the imports: nothing started
        assert out == [] and err.strip() == "interrupted", (out, err)
        return
    assert _summaries(out) == 1 and sum(x.startswith("new failures: ") for x in out) == 1, out
    assert any(x.startswith("interrupted: [") for x in out), out
    reported = {x.split("[", 1)[1].split("]", 1)[0] for x in out if x.startswith("FAILED ")}
    saved = {r.id for r in failures(open_db(db))}
    assert reported == saved, (reported, saved, out)  # every failure saved was printed, and none printed unsaved
    summary = out[next(i for i, x in enumerate(out) if x.startswith("interrupted: [")) :]
    assert f"new failures: {len(saved)}" in summary
    if moment.startswith("failure"):
        assert saved, out


def test_a_second_ctrl_c_ends_a_campaign_stuck_in_its_cleanup_at_once(tmp_path: Path) -> None:
    """The first Ctrl-C's cleanup reads the database (a paused Redis: up to its 30 s timeout); the second ends now."""
    with _redis_server() as (url, redis_proc):
        run = Interrupted([*fuzz_argv(url, "--machine", "Shared_hybrid*"), "--minutes", "5", "--workers", "2"])
        try:
            run.wait_for(run.line("examples ("))
            redis_proc.send_signal(signal.SIGSTOP)
            rc, took, err = run.interrupt(then=2.0)
        finally:
            redis_proc.send_signal(signal.SIGCONT)
            run.proc.kill()
    assert rc == 130 and took < 1 + SLACK / 5, (rc, took, err)
    assert "interrupted again: every child killed, exiting at once" in err
    assert _summaries(run.lines) == 0  # the summary was still waiting on the database
    assert not run.left()


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--db", "redis://127.0.0.1:1/0"], "error: Redis at redis://127.0.0.1:1/0 is not reachable"),
        (["--db", "/dev/null/db"], "error: example database '/dev/null/db' is not writable"),
        (["--backend", "server"], "error: no llama-server build for --semantics shared"),
        (["--mutant", "nope"], "error: unknown mutant 'nope'"),
        (["--machine", "Nope*"], "error: no machine matches --machine Nope*"),
    ],
)
def test_bad_input_is_one_line_and_exit_2_before_any_work(
    argv: list[str], message: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))  # no cached llama-server build here
    if "--db" not in argv:
        argv = [*argv, "--db", str(tmp_path / "db")]
    assert main(["fuzz", "--examples", "1", *argv]) == 2
    captured = capsys.readouterr()
    assert captured.err.startswith(message) and captured.err.count("\n") == 1
    assert captured.out == ""  # nothing started: no header, no worker


class _ToyBackend(Backend):
    """A backend the campaign modules never heard of: registered in BACKENDS only."""

    name = "toy"

    def campaign_machines(self, plan: Plan) -> list[MachineSpec]:
        return [model_spec(MachineConfig(plan.semantics, "recurrent"), self.name, 7, 3)]

    def campaign_models(self, plan: Plan) -> tuple[frozenset[str], bool]:
        return frozenset({"mamba"}), True


def test_a_backend_says_which_campaign_machines_it_has(monkeypatch: pytest.MonkeyPatch) -> None:
    """One home per backend: a backend registered in BACKENDS is fuzzable with no edit of the campaign."""
    monkeypatch.setitem(BACKENDS, "toy", _ToyBackend())
    made: list[str] = []
    monkeypatch.setattr(campaign_machines, "model_path", made.append)
    monkeypatch.setattr(campaign_machines, "draft_path", lambda: made.append("draft"))
    plan = Plan(("synthetic", "toy"), only=("*_recurrent",))
    specs = campaign_machines.machines(plan)
    assert [(s.name, s.backend, s.steps, s.batch) for s in specs] == [
        ("Shared_recurrent", "synthetic", 60, 30),
        ("Shared_recurrent", "toy", 7, 3),
    ]
    assert specs[1].cls().__name__ == "Shared_recurrent"
    campaign_machines.check_ready(plan)
    assert made == ["mamba", "draft"]  # the models the toy backend said its machines load
    monkeypatch.setattr(_ToyBackend, "campaign_machines", lambda self, plan: [])
    with pytest.raises(UsageError, match="the toy backend has no campaign machines"):
        campaign_machines.machines(plan)


def test_every_backend_names_its_own_machines() -> None:
    for name, backend in BACKENDS.items():
        try:
            specs = backend.campaign_machines(Plan((name,)))
        except UsageError as e:  # the server backend without a cached build
            assert name == "server" and "no llama-server build" in str(e)
            continue
        assert specs and {s.backend for s in specs} == {name}
        assert len({s.name for s in specs}) == len(specs)


# ---- the machine families of issue #39 (slot files, --cache-reuse and context shift, stateless tasks) ----------


def test_the_families_run_in_the_gate_and_the_campaign_and_plant_their_mutants() -> None:
    gate = [c.class_name for c in machines_for("shared", "ci")]
    names = [s.name for s in campaign_machines.machines(Plan())]
    family = ["SlotFiles_Shared_hybrid", "Reuse_Shared_transformer_ctx96", "Reuse_Shared_iswa_ctx96",
              "Stateless_Shared_transformer"]  # fmt: skip
    assert not set(family) & set(gate) and set(family) <= set(names)
    in_gate = [c.class_name for c in SyntheticBackend().configs("shared", "ci")]
    assert in_gate[: len(gate)] == gate and set(family) <= set(in_gate)
    assert [c.class_name for c in family_configs("shared", "ci")][:1] == ["SlotFiles_Shared_hybrid"]
    for name, (fam, _, _, _) in FAMILY_MUTANTS.items():
        plan = Plan(mutant=name)
        campaign_machines.check_ready(plan)  # a family's mutant is one a campaign can plant
        specs = campaign_machines.machines(plan)
        own = mutant_configs(name)[0]
        assert specs[0].name == own.class_name and own.family == fam and specs[0].cls().__name__ == own.class_name
    with pytest.raises(UsageError, match="unknown mutant 'nope'"):
        campaign_machines.check_ready(Plan(mutant="nope"))


@pytest.mark.parametrize("name", list(FAMILY_MUTANTS))
def test_each_family_mutant_is_killed_on_its_own_machine(name: str) -> None:
    """Seed 0 of the ci profile kills each (0.7-3.5 s); the printed program replays the failure as pasted.
    ``idle-skips-stateless`` (the idle loop skipping stateless slots, as a fix would) is killed by ``idle_pass``,
    which pins upstream's loop (issue #50; before it, only against a real server: tests/test_idle_slots.py)."""
    cfg = mutant_configs(name)[0]
    r = run_machine(cfg, make_settings("ci", None, 200), 0, "x", shrinks=15)
    assert r.failure is not None and r.failure.property == FAMILY_MUTANTS[name][1], r.failure
    assert "import properties.families" in r.failure.program
    with pytest.raises(PropertyFailure) as e:
        exec(compile(r.failure.program, "<program>", "exec"), {})  # our own printed program, as pasted
    assert e.value.name == r.failure.property


def test_a_campaign_plants_a_slot_file_mutant_and_finds_it(tmp_path: Path) -> None:
    machine = mutant_configs("save-ignores-write-error")[0].class_name
    # a campaign draws its examples at random: 40 missed it once in a clean-clone CI run, 400 (about 4 s) found it
    # in each of 9 runs
    argv = fuzz_argv(str(tmp_path / "db"), "--mutant", "save-ignores-write-error", "--machine", machine,
                     "--examples", "400", "--workers", "1")  # fmt: skip
    r = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=240, check=False)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"FAILED no_partial_file (violation) in {machine}" in r.stdout
    assert "save answered 200" in r.stdout
