"""The model-seam layer: faults fire exactly at N, disarm restores, the sweep classifies per semantics."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from faults import FAULT_KINDS, OUTCOMES, SCENARIOS, parse_case_id, run_sweep, run_trial
from faults.sweep import sweep_scenario
from harness.cli import main
from harness.errors import BadAlloc, UsageError
from harness.model.cache import ServerPrompt, ServerPromptCache, ServerPromptCacheState, ServerPromptData
from harness.model.checkpoint import CheckpointList
from harness.model.memory import Payload
from harness.model.semantics import Semantics


def _sites(scenario: str, semantics: str) -> list[str]:
    """The allocation sites the act passes through, in order, with nothing armed to fail."""
    sc = SCENARIOS[scenario]
    p = sc.build(semantics)
    seam = p.server.host.seam
    seam.arm(10**9, scope=sc.scope)
    p.act()
    sites = list(seam.sites)
    seam.disarm()
    return sites


@pytest.mark.parametrize("semantics", ["shared", "master"])
def test_fault_fires_exactly_at_n(semantics: str) -> None:
    sites = _sites("save-with-checkpoints", semantics)
    assert len(sites) >= 5
    for nth in range(1, len(sites) + 1):
        r = run_trial(SCENARIOS["save-with-checkpoints"], semantics, "transient", nth)
        assert r.fired and r.sites == [sites[nth - 1]], (nth, r)
    past = run_trial(SCENARIOS["save-with-checkpoints"], semantics, "transient", len(sites) + 1)
    assert not past.fired and past.outcome == "ok"


def test_persistent_fails_every_allocation_from_n() -> None:
    sc = SCENARIOS["save-with-draft"]
    p = sc.build("shared")
    seam = p.server.host.seam
    seam.arm(3, persistent=True, scope=sc.scope)
    assert p.act() is False
    assert seam.fired == 1  # the first failure ends alloc's construction; recovery allocates nothing
    assert seam.fired_sites == [_sites("save-with-draft", "shared")[2]]


def test_disarm_restores_normal_behaviour() -> None:
    sc = SCENARIOS["save-with-checkpoints"]
    p = sc.build("shared")
    host = p.server.host
    slot = p.server.slots[0]
    cache = p.server.prompt_cache
    assert cache is not None
    host.seam.arm(1)
    with pytest.raises(BadAlloc) as e:
        host.allocate("probe", 8)
    assert e.value.nth == 1 and e.value.site == "probe"
    assert host.seam.disarm() == 1
    host.allocate("probe", 8)  # no longer fails
    assert slot.prompt_save(cache) is True
    assert [e.prompt.tokens for e in cache.states] == [slot.prompt.tokens]


def test_sweep_one_scenario_shared_absorbs_every_point() -> None:
    trials = sweep_scenario(SCENARIOS["save-with-checkpoints"], "shared", "transient")
    assert [t.nth for t in trials] == list(range(1, len(trials) + 1))
    assert all(t.outcome == "accepted-error" for t in trials[:-1])
    assert trials[-1].outcome == "ok" and not trials[-1].fired


def test_sweep_one_scenario_master_crashes_outside_its_handler() -> None:
    trials = sweep_scenario(SCENARIOS["save-with-checkpoints"], "master", "transient")
    by_site = {t.sites[0]: t.outcome for t in trials if t.fired}
    assert by_site["alloc.state_tgt"] == "accepted-error"  # inside master's narrow try
    for site in ("tokens.clone", "ckpt_copy.node", "ckpt_copy.tgt", "alloc.states_push_back"):
        assert by_site[site] == "crash", site
    crash = next(t for t in trials if t.sites == ["ckpt_copy.tgt"])
    assert crash.id == f"save-with-checkpoints.oom-transient.{crash.nth}"
    assert "escaped" in crash.detail and "BadAlloc" in crash.trace


@pytest.mark.parametrize("semantics", ["shared", "master"])
def test_paths_outside_the_pr_crash_in_both_semantics(semantics: str) -> None:
    for name in ("create-checkpoint-at-cap", "child-task-clone", "checkpoint-update"):
        trials = sweep_scenario(SCENARIOS[name], semantics, "persistent")
        assert {t.outcome for t in trials[:-1]} == {"crash-out-of-scope"}, name
        assert trials[-1].outcome == "ok"


def test_whole_sweep_shared_passes_and_master_crashes() -> None:
    shared = run_sweep("shared")
    s = shared.summary()
    assert s["points"] > 50 and s["violations"] == s["crashes"] == s["partial_entries"] == 0
    assert s["crashes_out_of_scope"] > 0 and shared.exit_code() == 0
    master = run_sweep("master")
    assert master.summary()["crashes"] > 0 and master.summary()["violations"] == 0 and master.exit_code() == 3
    assert {c.outcome for c in shared.cases + master.cases} <= set(OUTCOMES)


def test_cli_sweep_json_and_exit_codes(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "sweep.json"
    assert main(["sweep", "--semantics", "master", "--scenario", "save-no-checkpoints", "--json", str(out)]) == 3
    printed = capsys.readouterr().out
    assert "save-no-checkpoints" in printed and "swept 6 allocation points" in printed
    assert "replay: python -m harness sweep --semantics master --case save-no-checkpoints.oom-transient.2" in printed
    data = json.loads(out.read_text())
    assert data["variant"] == "master"
    assert set(data["summary"]) >= {"trials", "points", "violations", "crashes", "partial_entries"}
    row = data["cases"][0]
    assert set(row) >= {"id", "scenario", "mode", "nth", "fired", "outcome", "detail"}
    assert main(["sweep", "--scenario", "save-no-checkpoints"]) == 0


def test_case_id_replays_one_trial(capsys: pytest.CaptureFixture[str]) -> None:
    trials = sweep_scenario(SCENARIOS["load-with-draft"], "master", "persistent")
    target = next(t for t in trials if t.outcome == "crash")
    assert main(["sweep", "--semantics", "master", "--case", target.id]) == 3
    out = capsys.readouterr().out
    assert f"case {target.id} (master)" in out and f"fault fired at {target.sites[0]}" in out
    assert "outcome: crash" in out and "Traceback" in out
    sc, mode, nth = parse_case_id(target.id)
    again = run_trial(sc, "master", mode, nth)
    assert (again.outcome, again.sites, again.detail) == (target.outcome, target.sites, target.detail)
    assert main(["sweep", "--semantics", "shared", "--case", target.id]) == 0


@pytest.mark.parametrize(
    "bad", ["nope", "save-evicts.oom-transient.0", "save-evicts.pymem.1", "missing.oom-transient.1"]
)
def test_bad_case_id_is_a_usage_error(bad: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(UsageError):
        parse_case_id(bad)
    assert main(["sweep", "--case", bad]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and err.count("\n") == 1


def test_the_table_names_five_kinds_and_the_docstring_documents_them() -> None:
    import faults

    assert list(FAULT_KINDS) == ["oom-transient", "oom-persistent", "pymem", "rlimit", "native"]
    for name, kind in FAULT_KINDS.items():
        assert f"``{name}``" in (faults.__doc__ or "")
        assert kind.arm and kind.disarm and kind.accepted and kind.reaches and kind.cannot_reach
    assert "crash-out-of-scope" in (faults.__doc__ or "")


class _HalfBuiltEntry(ServerPromptCache):
    """Appends the entry before copying its checkpoints: a failed copy leaves it half-built."""

    def _push_back(self, prompt: ServerPrompt, tgt: Payload | None, dft: Payload | None) -> ServerPromptCacheState:
        entry = ServerPromptCacheState(
            ServerPrompt(prompt.tokens, CheckpointList(self.host)), ServerPromptData(tgt, dft)
        )
        self.states.append(entry)
        entry.prompt.checkpoints = prompt.checkpoints.copy()
        return entry


def test_the_sweep_is_not_vacuous_it_fails_broken_semantics() -> None:
    narrow = run_sweep(Semantics("narrow-try", shared_payloads=True, wide_try=False), ["transient"])
    assert narrow.summary()["crashes"] > 0 and narrow.exit_code() == 3
    half = run_sweep(Semantics("half-built", shared_payloads=True, wide_try=True, cache_cls=_HalfBuiltEntry))
    assert half.summary()["partial_entries"] > 0 and half.exit_code() == 1
