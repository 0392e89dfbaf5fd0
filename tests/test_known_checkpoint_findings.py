"""The two minimal programs of issue 12 (seed 5 on ``shared``) and how the gate treats them.

Both are upstream behaviour at 0c1e570 (server-context.cpp:3280-3388), confirmed on a real
llama-server (``fixtures/findings/stale_checkpoint_after_miss.py``). The model reproduces them;
the main gate machines excuse exactly these states, the known-finding machines (``strict-*``)
report them.
"""

from __future__ import annotations

import pytest

from properties.invariants import Violation
from properties.machine import MachineConfig, machine_class


def _f1(known: frozenset[str]) -> None:
    # F1 needs prompts that do not share a first token: the main runs start every prompt with BOS
    state = machine_class(MachineConfig("shared", "hybrid", known=known | {"no-bos"}))()
    try:
        for suffix in ([2, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [1, 1]):
            state.request(id_slot=0, keep=0, n_cmpl=1, n_predict=1, source=0, suffix=suffix)
            state.finish()
            state.state_invariants()
    finally:
        state.teardown()


def _f2(known: frozenset[str]) -> None:
    state = machine_class(MachineConfig("shared", "iswa", known=known))()
    try:
        state.request(id_slot=0, keep=0, n_cmpl=1, n_predict=1, source=0, suffix=[1, 2, 3, 4, 5, 6, 7, 8])
        state.finish()
        state.state_invariants()
        state.request(id_slot=0, keep=3, n_cmpl=1, n_predict=1, source=0, suffix=[])
        state.finish()
        state.state_invariants()
    finally:
        state.teardown()


def test_f1_stale_checkpoint_is_restored_and_reported_by_the_strict_machine() -> None:
    # restore_bytes sees the stale state at the restore, draft_in_step at the next check
    with pytest.raises(Violation, match=r"\[restore_bytes\] checkpoint restore: tgt slot0 holds \['\(2,\)'\]"):
        _f1(frozenset({"strict-stale-checkpoint"}))


def test_f1_is_excused_by_its_exact_state_in_the_main_machines() -> None:
    _f1(frozenset())


def test_f1_model_records_the_stale_prefix() -> None:
    state = machine_class(MachineConfig("shared", "hybrid", known=frozenset({"no-bos"})))()
    try:
        for suffix in ([2, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1], [1, 1]):
            state.request(id_slot=0, keep=0, n_cmpl=1, n_predict=1, source=0, suffix=suffix)
            state.finish()
        # the checkpoint at n_tokens = 1 of [2, 1, 1, 1, 1] was restored for a slot holding [1, ...]
        assert state.server.stale_restores == [(2,)]
        assert sorted(state.server.ctx_tgt.seq_component_tokens(0)) == [(1, 1), (2, 1)]
    finally:
        state.teardown()


def test_f1_excuse_does_not_cover_other_memory_mismatches() -> None:
    """The excuse needs the memory to differ from the slot only by a recorded stale prefix."""
    from properties import invariants as inv

    state = machine_class(MachineConfig("shared", "hybrid"))()
    try:
        state.request(id_slot=0, keep=0, n_cmpl=1, n_predict=1, source=0, suffix=[3, 4, 5])
        state.finish()
        state.server.stale_restores.append((9,))
        s = state.server.slots[0]
        s.prompt.tokens = (*s.prompt.tokens[:-1], 7)  # a mismatch in the last token, not the prefix
        with pytest.raises(Violation, match="draft_in_step"):
            inv.check_draft_in_step(state.server, excuse_stale_checkpoint=True)
        s.prompt.tokens = (9, *s.prompt.tokens[1:])  # still not what memory holds
        with pytest.raises(Violation, match="draft_in_step"):
            inv.check_draft_in_step(state.server, excuse_stale_checkpoint=True)
    finally:
        state.crashed = True  # the slot was edited by hand: skip teardown's clear_all
        state.teardown()


def test_f2_descending_list_after_prompt_logits_is_reported_by_the_strict_machine() -> None:
    with pytest.raises(Violation, match=r"\[checkpoint_lists\] slot0: n_tokens not ascending \(4 then 2\)"):
        _f2(frozenset({"strict-swa-order"}))


def test_f2_is_excused_only_for_the_task_that_decremented_n_past() -> None:
    _f2(frozenset())
    state = machine_class(MachineConfig("shared", "iswa"))()
    try:
        state.request(id_slot=0, keep=0, n_cmpl=1, n_predict=1, source=0, suffix=[1, 2, 3, 4, 5, 6, 7, 8])
        state.finish()
        state.request(id_slot=0, keep=3, n_cmpl=1, n_predict=1, source=0, suffix=[])
        state.finish()
        cps = state.server.slots[0].prompt.checkpoints
        assert [(c.n_tokens, c.pos_max) for c in cps] == [(4, 3), (2, 1)]
        assert state.server.prompt_logits_resumes == {cps[1].id_task: 3}
        state.server.prompt_logits_resumes.clear()
        with pytest.raises(Violation, match="checkpoint_lists"):
            state.state_invariants()
    finally:
        state.teardown()


def test_refresh_does_not_move_the_newest_checkpoint_onto_an_older_one() -> None:
    """Gate seed 3: after the swa-checkpoint-order quirk left [4, 3], refreshing 3 -> 4 made [4, 4],
    a list upstream cannot make (create_checkpoint supersedes an equal n_tokens); the rule is now
    not applicable there."""
    state = machine_class(MachineConfig("shared", "iswa"))()
    try:
        for suffix in ([1, 1, 1, 1, 1], [1, 1, 1, 1]):
            state.request(id_slot=0, keep=0, n_cmpl=1, n_predict=1, source=0, suffix=suffix)
            state.finish()
        state.refresh_checkpoint(slot=0)
        state.request(id_slot=0, keep=0, n_cmpl=1, n_predict=1, source=0, suffix=[1, 1, 1, 1])
        state.finish()
        state.state_invariants()
        assert [c.n_tokens for c in state.server.slots[0].prompt.checkpoints] == [4, 3]
        assert not state._refreshable(0)
    finally:
        state.teardown()


@pytest.mark.llama_server_builds  # these two only: built before the first test (tests/conftest.py)
@pytest.mark.parametrize("name", ["stale_checkpoint_after_miss", "swa_checkpoint_order"])
def test_reproducer_shows_the_finding_on_the_pr_server(name: str) -> None:
    import importlib.util
    from pathlib import Path

    from harness.trees.build import cached_binary

    binary = cached_binary("shared")
    if binary is None:
        pytest.skip("the pr llama-server is not built (python -m harness build-server --semantics shared)")
    path = Path(__file__).resolve().parents[1] / "fixtures" / "findings" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    assert mod.main(["--server-bin", str(binary)]) == 1  # 1: the upstream bug is present at 0c1e570
