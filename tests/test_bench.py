"""``python -m harness bench`` on a tiny budget: it runs, writes valid JSON and markdown, and ``--compare``
flags an injected regression (and only a regression). No timing is asserted: speed goals live in the
bench itself, never in a test."""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pytest

from harness.bench import arms
from harness.bench import cases as bench_cases
from harness.bench.framework import CASES, case_names, compare, figure, table
from harness.cli import main
from harness.errors import EXIT_FAILED, EXIT_OK, EXIT_USAGE, UsageError
from harness.memlimit import cgroup_support
from harness.report import saves
from harness.trees.build import cached_binary
from properties.machine import MachineConfig, machine_class
from properties.run import machines_for, make_settings, run_seeded


def _quick(tmp_path: Path, *extra: str) -> tuple[int, dict[str, Any]]:
    out = tmp_path / "bench.json"
    rc = main(["bench", "--quick", "--only", "sweep", "--only", "saves", "--json", str(out), "--md",
               str(tmp_path / "bench.md"), *extra])  # fmt: skip
    return rc, json.loads(out.read_text())


def test_quick_bench_writes_valid_json_and_markdown(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, doc = _quick(tmp_path)
    assert rc == EXIT_OK
    assert set(doc["cases"]) == {"sweep", "saves"} and doc["quick"] is True
    assert doc["commit"] and doc["machine"]["cpus"] >= 1
    sweep = {f["name"]: f for f in doc["cases"]["sweep"]["figures"]}
    wall = sweep["wall, both semantics and modes"]
    assert wall["goal"] == {"op": "<=", "threshold": 60, "met": wall["median"] <= 60}
    assert {"shared transient", "master persistent"} <= set(sweep)
    for f in (f for c in doc["cases"].values() for f in c["figures"]):
        assert f["min"] <= f["median"] <= f["max"] and f["repetitions"] == len(f["samples"]) >= 1
        assert f["better"] in ("higher", "lower") and isinstance(f["inputs"], dict)
    saves = {f["name"]: f for f in doc["cases"]["saves"]["figures"]}
    # the save's peak: master copies the checkpoints, shared does not (the PR's claim), on the model's
    # ledger and measured on libllama (memray); the server layer is left to the full bench
    for layer in ("model", "llama"):
        master = saves[f"{layer} master warm save 4 MiB"]
        shared = saves[f"{layer} shared warm save 4 MiB"]
        assert min(master["inputs"]["peak_bytes"]) > max(shared["inputs"]["peak_bytes"]), layer
        assert master["inputs"]["checkpoint_bytes"] == shared["inputs"]["checkpoint_bytes"] > 0, layer
        for f in (master, shared):
            # every repetition's first save and its warm saves of the same prompt, checkpoints included
            w = f["inputs"]
            assert len(f["samples"]) == w["repetitions"] * w["warm"] == len(w["warm_checkpoint_bytes"]), f
            assert len(w["first_save_seconds"]) == w["repetitions"] == len(w["first_minflt"]), f
            assert min(w["warm_checkpoint_bytes"]) >= w["checkpoint_bytes"] // 2 > 0, f
        # the goal is on the layers (libllama, the server), for the PR; the first saves have none
        ratio = saves[f"{layer} shared warm save time 4/1 MiB"]
        assert ("goal" in ratio) == (layer == "llama"), ratio
        assert "goal" not in saves[f"{layer} master warm save time 4/1 MiB"]
        assert "goal" not in saves[f"{layer} shared first save time 4/1 MiB"]
        # the peak in the table, per size and as the curve's ratio: master grows with the payload, shared not
        peaks = {sem: saves[f"{layer} {sem} save peak 4/1 MiB"]["median"] for sem in ("master", "shared")}
        assert peaks["master"] > 1.5 > peaks["shared"], (layer, peaks)
        in_mib = [b / (1 << 20) for b in master["inputs"]["peak_bytes"]]
        assert saves[f"{layer} master save peak 4 MiB"]["samples"] == in_mib
        slope = saves[f"{layer} shared warm save cost per checkpoint"]
        assert slope["unit"] == "us" and len(slope["inputs"]["medians"]) == len(slope["inputs"]["n_checkpoints"]) == 2
    assert not any(f["inputs"].get("layer") == "server" for f in saves.values())
    # the payload grows by the number of checkpoints: the state S stays, as the PR's claim is stated
    one, four = saves["llama shared warm save 1 MiB"]["inputs"], saves["llama shared warm save 4 MiB"]["inputs"]
    assert one["state_bytes"] == four["state_bytes"] and one["n_checkpoints"] < four["n_checkpoints"]
    md = (tmp_path / "bench.md").read_text()
    assert "| sweep | wall, both semantics and modes |" in md
    assert "wall, both semantics and modes" in capsys.readouterr().out


def test_compare_flags_an_injected_regression(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc, doc = _quick(tmp_path)
    assert rc == EXIT_OK
    old = copy.deepcopy(doc)
    # the earlier run was 100x faster at the sweep: whatever this machine's noise, that is a regression
    for f in old["cases"]["sweep"]["figures"]:
        if f["unit"] == "trials/s":
            f["min"], f["median"], f["max"] = (100 * f[k] for k in ("min", "median", "max"))
    old_path = tmp_path / "old.json"
    old_path.write_text(json.dumps(old))
    capsys.readouterr()
    rc, _ = _quick(tmp_path, "--compare", str(old_path))
    out = capsys.readouterr().out
    assert rc == EXIT_FAILED
    assert "sweep/shared transient" in out and "REGRESSION" in out
    # a run set against itself has none
    lines, regressions = compare(doc, doc)
    assert lines and not regressions


def test_compare_uses_the_noise_and_the_direction() -> None:
    def doc(name: str, samples: list[float], better: str) -> dict[str, Any]:
        return {"cases": {"c": {"figures": [figure(name, "s", samples, better=better).row()]}}}

    # 30% slower but the runs spread by 50%: noise, not a regression
    _, reg = compare(doc("t", [1.0, 1.5, 2.0], "lower"), doc("t", [1.3, 1.3, 1.3], "lower"))
    assert reg == []
    # 30% slower with a 5% spread: a regression; the same change on a rate is an improvement
    _, reg = compare(doc("t", [1.0, 1.0, 1.05], "lower"), doc("t", [1.3, 1.3, 1.3], "lower"))
    assert reg == ["c/t"]
    _, reg = compare(doc("r", [1.0, 1.0, 1.05], "higher"), doc("r", [1.3, 1.3, 1.3], "higher"))
    assert reg == []
    # a one-sample figure (a minimum over repetitions) 15% lower: a regression on the 10% floor, noise
    # where it declares the 20% its repetitions spread by
    for noise, expect in ((None, ["c/m"]), (0.2, [])):
        old, new = (figure("m", "ratio", [v], noise=noise).row() for v in (1.0, 0.85))
        assert ("noise" in new) is (noise is not None)
        assert compare(*({"cases": {"c": {"figures": [f]}}} for f in (old, new)))[1] == expect


def test_compare_across_cpus_calls_nothing_a_regression() -> None:
    def doc(cpu: str | None, v: float) -> dict[str, Any]:
        machine = {} if cpu is None else {"cpu": cpu}
        return {"machine": machine, "cases": {"c": {"figures": [figure("r", "ratio", [v] * 3).row()]}}}

    # 30% lower on another CPU: said, not a regression; on the same CPU, or where a run names none, one
    lines, reg = compare(doc("AMD EPYC", 1.0), doc("Intel Xeon", 0.7))
    assert reg == [] and "different CPUs" in lines[0] and "worse (another CPU)" in lines[1]
    for old_cpu, new_cpu in (("AMD EPYC", "AMD EPYC"), (None, "AMD EPYC")):
        lines, reg = compare(doc(old_cpu, 1.0), doc(new_cpu, 0.7))
        assert reg == ["c/r"] and "REGRESSION" in lines[0]


def test_a_goal_on_every_seed_misses_when_one_seed_misses() -> None:
    # samples that are seeds: the median meets the goal, one seed does not; as a median goal it is met
    every, median = (figure("r", "ratio", [0.9, 0.85, 0.79], goal=(">=", 0.80, *e)).row() for e in ((True,), ()))
    assert every["goal"] == {"op": ">=", "threshold": 0.80, "met": False, "every": True}
    assert median["goal"] == {"op": ">=", "threshold": 0.80, "met": True}
    text = table({"cases": {"exploration": {"figures": [every, median]}}}, markdown=True)
    assert "| >= 0.8 each | MISSED |" in text and "| >= 0.8 | met |" in text


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    bad = tmp_path / "old.json"
    bad.write_text("{not json")
    assert main(["bench", "--quick", "--only", "sweep", "--compare", str(bad)]) == EXIT_USAGE
    assert main(["bench", "--quick", "--only", "no-such-case", "--json", str(tmp_path / "x.json")]) == EXIT_USAGE
    err = capsys.readouterr().err
    assert "is not JSON" in err and "unknown bench case" in err and "Traceback" not in err
    assert {"exploration", "mutants", "sweep", "saves", "server", "state-io", "gate"} <= set(CASES)


def test_quick_exploration_divides_by_hypothesis_on_the_same_programs(tmp_path: Path) -> None:
    # the goal is on the ratio to the replayed programs; checks off and the trivial machine beside it
    out = tmp_path / "e.json"
    assert main(["bench", "--quick", "--only", "exploration", "--json", str(out), "--md", str(tmp_path / "e.md")]) == 0
    figures = {f["name"]: f for f in json.loads(out.read_text())["cases"]["exploration"]["figures"]}
    same, off = figures["Shared_hybrid / same programs"], figures["Shared_hybrid / same programs, checks off"]
    trivial = figures["Shared_hybrid / trivial"]
    assert "goal" in same and "goal" not in off and "goal" not in trivial
    assert same["inputs"]["precondition_calls"] > 0 and "replayed" in same["inputs"]["how"]
    assert same["median"] > 0 and off["median"] > 0 and "checks_on" in off["inputs"]["how"]
    assert "Shared_hybrid / same programs, checks off" in (tmp_path / "e.md").read_text()
    calls = figures["Shared_hybrid / same programs, calls"]  # the clock-free figure beside it: no goal
    assert "goal" not in calls and calls["inputs"]["clock"] == "calls"
    assert 0 < calls["inputs"]["replay_calls"] < calls["inputs"]["machine_calls"]
    assert calls["median"] == calls["inputs"]["replay_calls"] / calls["inputs"]["machine_calls"]
    seeds = figures["Shared_hybrid / same programs, other seeds"]  # the goal again, on the next seed
    assert seeds["inputs"]["seeds"] == [1] and seeds["inputs"]["seed"] is None and seeds["repetitions"] == 1
    assert seeds["goal"]["every"] and seeds["goal"]["met"] == all(v >= 0.80 for v in seeds["samples"])
    assert "Shared_hybrid / same programs, other seeds" in (tmp_path / "e.md").read_text()
    fastest = figures["Shared_hybrid / same programs, fastest runs"]  # another estimator beside the goal's
    assert "goal" not in fastest
    arms = fastest["inputs"]["replay_cpu"], fastest["inputs"]["machine_cpu"]
    assert len(arms[0]) == len(arms[1]) == same["repetitions"]
    assert fastest["median"] == pytest.approx(min(arms[0]) / min(arms[1]), rel=1e-3)  # to the microsecond
    assert fastest["noise"] == 0  # one repetition: nothing to leave out (the jackknife's spread)


def test_the_fastest_runs_noise_is_its_jackknife_spread() -> None:
    rs = [{"replay": r, "machine": m} for r, m in ((2.0, 2.5), (2.2, 2.4), (1.6, 2.6))]
    # 1.6/2.4 = 0.667; leaving out rep 2 (the fastest replay): 2.0/2.4 = 0.833; rep 1: 1.6/2.5 = 0.64
    assert bench_cases._jackknife_spread(rs) == pytest.approx((2.0 / 2.4 - 1.6 / 2.5) / (1.6 / 2.4))


def test_exploration_times_the_machine_only_on_its_recordings_programs(monkeypatch: pytest.MonkeyPatch) -> None:
    # each arm records the machine first (untimed: the tape and the warm-up); a timed machine run of
    # other test cases than the recording's is refused, not measured
    cfg = machines_for("shared", "ci")[0]
    r = arms.timed_arm("machine", cfg, 5, 0)
    replay = arms.timed_arm("replay", cfg, 5, 0)
    assert r["cpu"] > 0 and replay["cpu"] > 0 and r["calls"] == replay["calls"] > 0
    assert r["split"]["invalid"] == replay["split"]["invalid"]
    recorded = arms._statuses
    monkeypatch.setattr(arms, "_statuses", lambda run: [*recorded(run), "valid"])
    with pytest.raises(UsageError, match="ran other test cases than its recording"):
        arms.timed_arm("machine", cfg, 5, 0)


def _arm_children() -> list[str]:
    """Processes running ``harness.bench.arms`` (read from /proc: no pgrep needed on a fresh machine)."""
    found = []
    for d in Path("/proc").iterdir():
        try:
            cmd = (d / "cmdline").read_bytes().split(b"\0") if d.name.isdigit() else []
        except OSError:
            continue
        if b"harness.bench.arms" in cmd:
            found.append(d.name)
    return found


def test_the_arms_take_turns_and_leave_no_child_behind() -> None:
    r = arms.run_arms("Shared_hybrid", 5, 0)
    assert set(r) == set(arms.ARMS) and all(a["cpu"] > 0 for a in r.values())
    assert len({a["calls"] for a in r.values()}) == 1  # every arm recorded the same programs
    with pytest.raises(UsageError, match="ran past its timeout"):
        arms.run_arms("Shared_hybrid", 300, 0, timeout=1.0)  # killed while recording or stopped
    assert _arm_children() == []
    with pytest.raises(UsageError, match="no gate machine 'Nope'"):
        arms.run_arms("Nope", 5, 0)
    assert arms.main([]) == EXIT_USAGE


def test_quick_targeting_sets_every_reach_label_on_against_off(tmp_path: Path) -> None:
    out = tmp_path / "t.json"
    assert main(["bench", "--quick", "--only", "targeting", "--json", str(out), "--md", str(tmp_path / "t.md")]) == 0
    figures = json.loads(out.read_text())["cases"]["targeting"]["figures"]
    assert {f["inputs"]["label"] for f in figures} == {"evictions", "transient_peak", "shared_holders",
                                                        "checkpoints", "faults_fired"}  # fmt: skip
    for f in figures:
        on, off = f["inputs"]["on"], f["inputs"]["off"]
        assert len(on) == len(off) == f["inputs"]["runs"] == 2
        assert f["median"] == pytest.approx((sum(on) / 2 + 1) / (sum(off) / 2 + 1))
    # the machine was exercised: some example made checkpoints
    by = {f["inputs"]["label"]: f for f in figures}
    assert max(by["checkpoints"]["inputs"]["on"] + by["checkpoints"]["inputs"]["off"]) > 0


def test_the_ci_case_runs_only_when_named() -> None:
    # .ci/run takes half an hour: a plain bench leaves it out, --only ci takes it
    assert "ci" not in case_names(None) and {"gate", "saves"} <= set(case_names(None))
    assert case_names(["ci"]) == ["ci"]
    with pytest.raises(UsageError, match="unknown bench case"):
        case_names(["nope"])


def test_merge_keeps_where_each_case_was_measured(tmp_path: Path) -> None:
    # a case merged from a run that had merged it itself keeps its first origin
    old = {
        "commit": "bbbb",
        "started": "T1",
        "cases": {
            "saves": {"title": "s", "figures": [], "from": "commit aaaa, started T0"},
            "state-io": {"title": "i", "figures": []},
        },
    }
    (tmp_path / "old.json").write_text(json.dumps(old))
    out = tmp_path / "new.json"
    rc = main(["bench", "--quick", "--only", "sweep", "--merge", str(tmp_path / "old.json"), "--json", str(out),
               "--md", str(tmp_path / "new.md")])  # fmt: skip
    doc = json.loads(out.read_text())
    assert rc == EXIT_OK and "from" not in doc["cases"]["sweep"]
    assert doc["cases"]["saves"]["from"] == "commit aaaa, started T0"
    assert doc["cases"]["state-io"]["from"] == "commit bbbb, started T1"


def test_the_call_ratio_is_the_same_on_every_run() -> None:
    # what makes it the figure to compare two commits by: no clock in it, and a fresh interpreter per count
    # (in-process, the digest cache of properties.invariants made a second count 8 calls shorter). A few
    # calls of Hypothesis' own still vary between runs (4 of 273645, in both counts alike): the ratio
    # moves by far less than 1e-4, against +-0.05 for the CPU ratio's medians on this machine
    cfg = machines_for("shared", "ci")[0]
    first = bench_cases._calls(cfg, 5, 0)
    run_seeded(machine_class(cfg), make_settings("ci", None, 5), 0)  # this process's caches, warm: no matter
    again = bench_cases._calls(cfg, 5, 0)
    assert first[0] > first[1] > 0
    assert again[0] == pytest.approx(first[0], rel=1e-4) and again[1] == pytest.approx(first[1], rel=1e-4)
    assert again[1] / again[0] == pytest.approx(first[1] / first[0], rel=1e-4)


def test_the_call_count_names_a_machine_it_does_not_know() -> None:
    with pytest.raises(UsageError, match="no gate machine 'Shared_nothing'"):
        bench_cases._calls(MachineConfig("shared", "nothing"), 5, 0)


def test_a_save_point_child_names_what_failed() -> None:
    # the child's own usage line, and a failure reported by the bench in one line with the child's words
    assert saves.main(["server", "shared", "1", "0", "1"]) == EXIT_USAGE
    with pytest.raises(UsageError, match=r"the model nothing save of 1 checkpoints failed \(exited with 2\): usage: "):
        bench_cases._save_point("model", "nothing", 1, 0, 1)


def test_warm_saves_save_the_same_prompt_again_or_say_they_did_not() -> None:
    server = saves.synthetic_server("shared", 4, 1 << 16)
    slot, cache = server.slots[0], server.prompt_cache
    assert cache is not None and len(slot.prompt.checkpoints) == 4
    prompt, c_bytes = tuple(slot.prompt.tokens), sum(c.size() for c in slot.prompt.checkpoints)
    assert saves.timed_save(slot.prompt_save, cache)[0]
    w = saves.warm_saves(server, 3)
    # three more saves of the prompt, each with its checkpoints: a restore between them, not a skip
    assert len(w["warm_save_seconds"]) == len(w["warm_minflt"]) == 3 and w["warm_checkpoint_bytes"] == [c_bytes] * 3
    assert all(t > 0 for t in w["warm_save_seconds"])
    assert any(e.prompt.tokens[: len(prompt)] == prompt for e in cache.states)
    # the slot now holds the diverging prompt: called again, the cycle has no saved prompt to time
    with pytest.raises(UsageError, match="saved the slot's prompt 0 of 2 times"):
        saves.warm_saves(server, 2)


@pytest.mark.llama_server_builds  # built before the first test (tests/conftest.py)
def test_quick_big_saves_master_costs_s_plus_c_and_the_pr_s(tmp_path: Path) -> None:
    # the oom scenario's --mode none at 4 x 64 MiB on both real builds: the cgroup's peak during the save
    if cgroup_support() is None or None in (cached_binary("shared"), cached_binary("master")):
        pytest.skip("needs a writable memory cgroup and both cached llama-server builds")
    out = tmp_path / "b.json"
    assert main(["bench", "--quick", "--only", "big-saves", "--json", str(out), "--md", str(tmp_path / "b.md")]) == 0
    case = json.loads(out.read_text())["cases"]["big-saves"]
    assert "error" not in case, case
    figs = {f["name"]: f for f in case["figures"]}
    pr, master = figs["shared save peak, C 257 MiB"], figs["master save peak, C 257 MiB"]
    s, c = pr["inputs"]["s_mib"], pr["inputs"]["c_mib"]
    assert 60 < s < 70 and 250 < c < 270 and pr["inputs"]["checkpoints"] == 4
    assert pr["median"] < 1.2 * s < master["median"] and master["median"] > 0.9 * (s + c)
    assert pr["inputs"]["resumed"] and master["inputs"]["outcome"] == "survived"
    assert figs["shared save peak / S, C 257 MiB"]["goal"]["met"]
    assert figs["master / shared save peak, C 257 MiB"]["median"] > 3
    assert CASES["big-saves"].named_only and "big-saves" not in case_names(None)
