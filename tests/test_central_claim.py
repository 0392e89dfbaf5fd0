"""The seed's central claim, read off the ledger.

Saving a prompt whose checkpoints total C bytes with a new state of S bytes raises the physical
peak of the save by exactly S + C under master (the checkpoints are deep-copied into the entry) and
by exactly S under shared (PR #27451: the entry references the slot's payloads), while the logical
size charged to the cache is S + C in both.

Checkpoint sizes (PARTIAL_ONLY): recurrent and hybrid 8 + 25 + 1024 = 1057 bytes each, iSWA
8 + 25 + 8 * 32 = 289 bytes each; the 48-token prompt gets two checkpoints.
"""

from __future__ import annotations

import pytest

from harness.commands.demo import central_claim
from harness.model import BadAlloc, ServerContext, ServerParams
from harness.targets.synthetic import make_server

KINDS = ["recurrent", "hybrid", "iswa"]
C_EXPECTED = {"recurrent": 2 * 1057, "hybrid": 2 * 1057, "iswa": 2 * 289}
P = tuple(1 + (i * 7) % 23 for i in range(48))


def _full_state_size(kind: str, n_tokens: int) -> int:
    """Independent of the provider: the synthetic full-state layout of one sequence."""
    comp, cell, rs = 25, 32, 1024
    if kind == "recurrent":
        return 8 + comp + rs
    if kind == "hybrid":
        return 8 + (comp + rs) + (comp + cell * n_tokens)
    return 8 + (comp + cell * n_tokens) + (comp + cell * min(n_tokens, 8))


@pytest.mark.parametrize("kind", KINDS)
def test_central_claim_demo(kind: str) -> None:
    m = central_claim("master", kind=kind)
    s = central_claim("shared", kind=kind)
    assert m.checkpoint_bytes == s.checkpoint_bytes == C_EXPECTED[kind]
    assert m.state_bytes == s.state_bytes > 0
    S, C = m.state_bytes, m.checkpoint_bytes
    assert m.peak_excess == S + C
    assert s.peak_excess == S
    assert m.logical_charged == s.logical_charged == S + C


def _processed(sem: str, kind: str, draft: bool = False) -> ServerContext:
    params = ServerParams(n_slots=1, cache_ram=-1, cache_ram_unit=1, cache_idle_slots=False)
    srv = make_server(sem, kind, params=params, draft=draft)
    srv.handle_completion(P, n_predict=1)
    srv.run_until_idle()
    return srv


@pytest.mark.parametrize("sem", ["master", "shared"])
@pytest.mark.parametrize("kind", KINDS)
def test_save_peak_and_live_growth_on_the_ledger(sem: str, kind: str) -> None:
    srv = _processed(sem, kind)
    slot, cache = srv.slots[0], srv.prompt_cache
    assert cache is not None
    n = slot.prompt.n_tokens()
    S = _full_state_size(kind, n)
    assert srv.ctx_tgt.state_seq_get_size_ext(0, 0) == S
    C = sum(p.nbytes for c in slot.prompt.checkpoints for p in c.payloads())
    assert C_EXPECTED[kind] == C
    live0 = srv.host.ledger.live_bytes
    assert live0 == C  # only the slot's checkpoints are alive
    assert slot.prompt_save(cache)
    op = srv.host.last_op
    assert op is not None and op.name == "save"
    expected = S + C if sem == "master" else S
    assert op.peak - op.live_before == expected
    assert srv.host.ledger.live_bytes - live0 == expected
    assert cache.size() == S + C
    entry = cache.states[0]
    assert entry.data.main is not None and entry.data.main.nbytes == S


@pytest.mark.parametrize("kind", KINDS)
def test_claim_holds_with_an_older_entry_in_the_cache(kind: str) -> None:
    """The claim is about the excess over the live bytes before the save, whatever the cache holds."""
    results = {}
    for sem in ("master", "shared"):
        srv = _processed(sem, kind)
        slot, cache = srv.slots[0], srv.prompt_cache
        assert cache is not None
        assert slot.prompt_save(cache)
        p_entry_size = cache.size()
        # an unrelated conversation on the same slot (the P entry stays: it is no prefix of it)
        srv.handle_completion(tuple(2 + (i * 3) % 17 for i in range(60)), n_predict=1)
        srv.run_until_idle()
        C = sum(c.size() for c in slot.prompt.checkpoints)
        S = srv.ctx_tgt.state_seq_get_size_ext(0, 0)
        live0 = srv.host.ledger.live_bytes
        assert slot.prompt_save(cache)
        op = srv.host.last_op
        assert op is not None and op.live_before == live0 > C
        assert len(cache) == 2 and cache.size() == p_entry_size + S + C
        results[sem] = (S, C, op.peak_excess)
    (sm, cm, pm), (ss, cs, ps) = results["master"], results["shared"]
    assert (sm, cm) == (ss, cs) and cm > 0
    assert pm == sm + cm and ps == ss


@pytest.mark.parametrize("kind", KINDS)
def test_with_draft_shared_peak_adds_only_value_owned_spec(kind: str) -> None:
    """data_spec stays value-owned under shared, so it is the one checkpoint part still copied."""
    for sem in ("master", "shared"):
        srv = _processed(sem, kind, draft=True)
        slot, cache = srv.slots[0], srv.prompt_cache
        assert cache is not None and srv.ctx_dft is not None
        S = srv.ctx_tgt.state_seq_get_size_ext(0, 0) + srv.ctx_dft.state_seq_get_size_ext(0, 0)
        C = sum(c.size() for c in slot.prompt.checkpoints)
        spec = sum(c.data_spec.nbytes for c in slot.prompt.checkpoints if c.data_spec is not None)
        assert spec == 32 * len(slot.prompt.checkpoints) and spec > 0
        assert slot.prompt_save(cache)
        op = srv.host.last_op
        assert op is not None and op.state_bytes == S and op.spec_bytes == spec
        assert op.peak_excess == (S + C if sem == "master" else S + spec)
        assert cache.size() == S + C


def test_transformer_has_no_checkpoints_so_no_difference() -> None:
    m = central_claim("master", kind="transformer")
    s = central_claim("shared", kind="transformer")
    assert m.checkpoint_bytes == s.checkpoint_bytes == 0
    assert m.peak_excess == s.peak_excess == m.state_bytes == m.logical_charged


@pytest.mark.parametrize("sem", ["master", "shared"])
@pytest.mark.parametrize("kind", KINDS)
def test_copy_failure_during_save_crashes_master_but_not_shared(sem: str, kind: str) -> None:
    """A bad_alloc at the first checkpoint node copy, after S was allocated, while switching the slot."""
    srv = _processed(sem, kind)
    slot = srv.slots[0]
    live_ckpts = sum(c.size() for c in slot.prompt.checkpoints)
    assert srv.host.ledger.live_bytes == live_ckpts
    # save sites in order: alloc.state_tgt, tokens.clone, ckpt_copy.node, ...
    srv.host.seam.arm(3, scope="save")
    unrelated = tuple(range(100, 130))
    if sem == "master":
        with pytest.raises(BadAlloc) as ei:
            srv.handle_completion(unrelated, n_predict=1)
        assert ei.value.site == "ckpt_copy.node"
    else:
        r = srv.handle_completion(unrelated, n_predict=1)
        assert r.status == "launched"
        assert srv.host.seam.fired_sites == ["ckpt_copy.node"]
        assert srv.prompt_cache is not None and len(srv.prompt_cache) == 0
        assert srv.prompt_cache.limit_size == 1  # the cache was empty at the failure: caching is off
    # either way the state buffer of S bytes was freed again and nothing else leaked
    assert srv.host.ledger.live_bytes == live_ckpts
    assert not srv.host.seam.armed  # scope "save" disarms after firing
    if sem == "shared":
        srv.run_until_idle()
        assert srv.ctx_tgt.seq_tokens(0) == slot.prompt.tokens
