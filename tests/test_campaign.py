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
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from harness.backends import BACKENDS
from harness.backends.base import Backend, MachineSpec, Plan, model_spec
from harness.campaign import machines as campaign_machines
from harness.campaign.store import failures, open_db
from harness.cli import main
from harness.errors import UsageError
from harness.model.semantics import SHARED
from properties.machine import MachineConfig
from properties.mutants import MUTANTS
from properties.mutants import config as mutant_config

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


@pytest.fixture(scope="module")
def redis_url() -> Iterator[str]:
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
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait(timeout=10)


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


def test_ctrl_c_prints_the_summary_and_leaves_no_child(tmp_path: Path) -> None:
    proc = _start([*fuzz_argv(str(tmp_path / "db"), "--machine", "Shared_hybrid*"), "--minutes", "5", "--workers", "2"])
    try:
        _read_until(proc, "examples (", 120)  # the first interval line: workers are running
        workers = _children(proc.pid)
        assert len(workers) == 2
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        proc.kill()
        proc.wait(timeout=10)
    assert proc.returncode == 130, err
    assert "interrupted: [" in out and "new failures: 0" in out
    assert not _wait_gone(workers, 5)


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
