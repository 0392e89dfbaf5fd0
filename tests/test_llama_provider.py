"""The libllama provider on the tiny fixtures models: state round trips, restore checks, their mutants."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from fixtures.gguf import ARCHS, draft_path, model_path
from harness.findings import finding
from harness.model.provider import (
    STATE_SEQ_FLAGS_NONE,
    STATE_SEQ_FLAGS_PARTIAL_ONLY,
    MemoryKind,
    SeqRmType,
    StateProvider,
)
from harness.model.server_context import ServerParams
from harness.targets.libllama import (
    PENDING_CP_FINDING,
    SWA_WINDOW_FINDING,
    LlamaProvider,
    ModelLoadError,
    close_server,
    load_model,
    make_llama_server,
)
from properties import invariants as inv

ROOT = Path(__file__).resolve().parents[1]

EXPECT = {
    "llama": (MemoryKind.TRANSFORMER, SeqRmType.PART),
    "mamba": (MemoryKind.RECURRENT, SeqRmType.FULL),
    "jamba": (MemoryKind.HYBRID, SeqRmType.FULL),
    "lfm2": (MemoryKind.HYBRID, SeqRmType.FULL),
    "gemma2": (MemoryKind.ISWA, SeqRmType.PART),
}

PROMPT = [1 + i % 24 for i in range(29)]


def provider(arch: str, **kw: object) -> LlamaProvider:
    cfg: dict[str, object] = {"n_seq": 2, "n_ctx": 256, "n_batch": 16, "n_ubatch": 8}
    cfg.update(kw)
    return LlamaProvider(load_model(model_path(arch)), **cfg)  # type: ignore[arg-type]


def fill(p: LlamaProvider, seq: int = 0, toks: list[int] = PROMPT) -> None:
    pos = 0
    for i in range(0, len(toks), 16):
        assert p.decode(seq, toks[i : i + 16], pos) == 0
        pos += len(toks[i : i + 16])


def test_missing_and_corrupt_models_are_one_line_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelLoadError, match="not found"):
        load_model(tmp_path / "nope.gguf")
    bad = tmp_path / "bad.gguf"
    bad.write_bytes(b"GGUF" + b"\0" * 64)
    with pytest.raises(ModelLoadError, match="could not load"):
        load_model(bad)


@pytest.mark.parametrize("arch", ARCHS)
def test_kind_and_seq_rm_type_as_common_context_can_seq_rm(arch: str) -> None:
    with provider(arch) as p:
        assert isinstance(p, StateProvider)
        assert (p.kind, p.seq_rm_type()) == EXPECT[arch]
        assert p.model.arch == arch
        assert (p.n_swa > 0) == (arch == "gemma2")


@pytest.mark.parametrize("arch", ARCHS)
def test_full_state_round_trip_continues_like_a_fresh_evaluation(arch: str) -> None:
    with provider(arch) as p:
        fill(p)
        data = p.state_seq_get_data_ext(0, STATE_SEQ_FLAGS_NONE)
        assert len(data) == p.state_seq_get_size_ext(0, STATE_SEQ_FLAGS_NONE) > 0
        assert p.state_seq_set_data_ext(1, data, STATE_SEQ_FLAGS_NONE) == len(data)
        assert p.seq_tokens(1) == tuple(PROMPT)
        assert p.memory_seq_pos_max(1) == len(PROMPT) - 1
        assert p.decode(1, [7, 8], len(PROMPT)) == 0
        assert p.restore_checks == 1
        assert p.mismatches == [] and p.layout_diffs == []
        assert p.restores_by == {"set_data": 1}


@pytest.mark.parametrize("arch", ARCHS)
def test_partial_state_restore_after_truncation(arch: str) -> None:
    """A checkpoint restore as the server does it: partial state back, then the KV cut behind it."""
    with provider(arch) as p:
        fill(p, toks=PROMPT[:16])
        ckpt = p.state_seq_get_data_ext(0, STATE_SEQ_FLAGS_PARTIAL_ONLY)
        full_size = p.state_seq_get_size_ext(0, STATE_SEQ_FLAGS_NONE)
        if arch in ("jamba", "lfm2", "gemma2"):
            assert len(ckpt) < full_size  # only the recurrent / SWA part
        assert p.decode(0, PROMPT[16:], 16) == 0
        assert p.state_seq_set_data_ext(0, ckpt, STATE_SEQ_FLAGS_PARTIAL_ONLY) == len(ckpt)
        assert p.memory_seq_rm(0, 16, -1)
        assert p.seq_tokens(0) == tuple(PROMPT[:16])
        assert p.decode(0, [9], 16) == 0
        assert p.restore_checks == 1 and p.mismatches == []


def test_rollback_of_part_of_a_batch_is_compared_with_the_same_batch_shapes() -> None:
    """Logits depend on batch shape; the fresh evaluation decodes the rolled-back batch whole, then cuts it."""
    with provider("llama", n_seq=1) as p:
        assert p.decode(0, [22, 21], 0) == 0
        assert p.decode(0, [14, 5, 23], 2) == 0
        assert p.memory_seq_rm(0, 3, -1)
        assert p.decode(0, [17, 20], 3) == 0
        assert p.restore_checks == 1 and p.mismatches == [] and p.layout_diffs == []
        assert p.restores_by == {"seq_rm": 1}


def test_a_failed_restore_clears_the_sequence_as_libllama_does() -> None:
    with provider("llama") as p:
        fill(p)
        assert p.state_seq_set_data_ext(1, b"\x01\x02\x03", STATE_SEQ_FLAGS_NONE) == 0
        assert p.seq_tokens(1) == ()
        assert p.memory_seq_pos_max(1) == -1


def test_decode_checks_positions_and_vocabulary() -> None:
    with provider("llama") as p:
        assert p.decode(0, [1, 2], 0) == 0
        assert p.decode(0, [3], 5) == -1  # positions must continue the sequence
        with pytest.raises(ValueError, match="outside the vocabulary"):
            p.decode(0, [100000], 2)


class CorruptRestore(LlamaProvider):
    """Mutant: a restore that lands slightly wrong bytes (one float of the payload flipped)."""

    def _set_raw(self, ctx: object, seq: int, data: bytes, flags: int) -> int:
        if ctx is self.ctx and len(data) > 64:
            b = bytearray(data)
            b[-9] ^= 0x40  # inside the last tensor's data, past every header
            data = bytes(b)
        return super()._set_raw(ctx, seq, data, flags)


class StaleRestore(LlamaProvider):
    """Mutant: a restore that silently keeps what the sequence had (the set call is dropped)."""

    def state_seq_set_data_ext(self, seq: int, data: bytes, flags: int) -> int:
        known = self._registry.get(sys.modules["harness.targets.libllama"]._digest(data, flags))
        if known is not None:
            for c in self._selected(flags):
                self._hist[seq][c] = known[c]
        self._pending[seq] = f"set_data(flags={flags})"
        return len(data)


@pytest.mark.parametrize("mutant", [CorruptRestore, StaleRestore])
@pytest.mark.parametrize("arch", ["llama", "jamba"])
def test_restore_equivalence_catches_a_wrong_restore(mutant: type[LlamaProvider], arch: str) -> None:
    with mutant(load_model(model_path(arch)), n_seq=2, n_ctx=256, n_batch=16, n_ubatch=8) as p:
        fill(p)
        data = p.state_seq_get_data_ext(0, STATE_SEQ_FLAGS_NONE)
        fill(p, seq=1, toks=[5] * len(PROMPT))  # same length, other tokens
        assert p.state_seq_set_data_ext(1, data, STATE_SEQ_FLAGS_NONE)
        p.decode(1, [7], len(PROMPT))
        assert len(p.mismatches) == 1, "the property must fail on this mutant"
        assert p.layout_diffs == []


def test_cell_order_differences_are_the_layout_finding_not_a_mismatch() -> None:
    """The shrunk program of fixtures/findings/kv_layout_logits.py, through the provider."""
    with provider("lfm2", kv_unified=True) as p:
        p.decode(1, [1], 0)
        p.decode(0, [1], 0)
        p.memory_seq_rm(1, -1, -1)
        p.memory_seq_cp(0, 1, -1, -1)
        p.decode(1, [6], 1)
        assert p.restore_checks == 1
        assert p.mismatches == []
        assert len(p.layout_diffs) == 1


def _child_copy_then_restore(p: LlamaProvider, child_copy: bool = True) -> None:
    """The gemma2 gate program (seed 0), shrunk to the provider's calls: slot 1 saves an entry and a
    checkpoint, becomes a parent whose child copy 1 -> 0 is never flushed by a decode, then slot 0
    loads the entry, restores the checkpoint, rolls back to 4 and decodes."""
    p.decode(0, [1], 0)
    p.memory_seq_rm(0, -1, -1)
    p.decode(1, [1] * 5, 0)
    ckpt = p.state_seq_get_data_ext(1, STATE_SEQ_FLAGS_PARTIAL_ONLY)
    p.decode(1, [1] * 4, 5)
    entry = p.state_seq_get_data_ext(1, STATE_SEQ_FLAGS_NONE)
    p.memory_seq_rm(1, -1, -1)
    p.decode(1, [1], 0)
    if child_copy:
        p.memory_seq_cp(1, 0, -1, -1)  # copy_state_to(child); the child is then released and cleared
    p.memory_seq_rm(0, -1, -1)
    assert p.state_seq_set_data_ext(0, entry, STATE_SEQ_FLAGS_NONE) == len(entry)
    assert p.state_seq_set_data_ext(0, ckpt, STATE_SEQ_FLAGS_PARTIAL_ONLY) == len(ckpt)
    p.memory_seq_rm(0, 4, -1)
    assert p.decode(0, [1, 1], 4) == 0  # the deferred copy 1 -> 0 runs here


def test_a_restore_overwritten_by_a_deferred_seq_cp_is_the_known_finding() -> None:
    with provider("gemma2") as p:
        _child_copy_then_restore(p)
        assert p.restore_checks == 1 and p.mismatches == [] and p.layout_diffs == []
        [m] = p.finding_diffs[PENDING_CP_FINDING]
        assert m.restored_by == "set_data(flags=1)+seq_rm(p0=4)" and m.n_tokens == 6
        # a later check of the same cells is still the finding; a cleared sequence is clean again
        p.memory_seq_rm(0, 3, -1)
        p.decode(0, [1], 3)
        assert p.mismatches == [] and len(p.finding_diffs[PENDING_CP_FINDING]) == 2
        p.memory_seq_rm(0, -1, -1)
        assert 0 not in p._overwritten
    with provider("gemma2") as p:  # control: without the child copy the same program is exact
        _child_copy_then_restore(p, child_copy=False)
        assert p.restore_checks == 1 and p.mismatches == [] and p.finding_diffs == {}
    with provider("gemma2", kv_unified=True) as p:  # one stream: seq_cp copies nothing later
        _child_copy_then_restore(p)
        assert p.finding_diffs == {} and p.mismatches == []


def test_the_deferred_seq_cp_excuse_covers_only_the_overwritten_sequence() -> None:
    """A wrong restore into another sequence is still a mismatch while seq 0 carries the finding."""
    with CorruptRestore(load_model(model_path("llama")), n_seq=2, n_ctx=256, n_batch=16, n_ubatch=8) as p:
        fill(p)
        data = p.state_seq_get_data_ext(0, STATE_SEQ_FLAGS_NONE)
        p.memory_seq_cp(0, 1, -1, -1)
        p.memory_seq_rm(1, -1, -1)
        assert p.state_seq_set_data_ext(1, data, STATE_SEQ_FLAGS_NONE)  # into the pending destination
        p.memory_seq_rm(0, -1, -1)
        assert p.state_seq_set_data_ext(0, data, STATE_SEQ_FLAGS_NONE)  # corrupted, no copy involved
        p.decode(0, [7], len(PROMPT))
        assert len(p.mismatches) == 1 and p.mismatches[0].seq == 0
        p.decode(1, [7], len(PROMPT))
        assert len(p.finding_diffs[PENDING_CP_FINDING]) == 1 and p.finding_diffs[PENDING_CP_FINDING][0].seq == 1


def _reproducer(path: str, arg: str, timeout: float = 120) -> str:
    """Run a finding's standalone reproducer; it must exit 1 (the bug is present). Its output."""
    r = subprocess.run([sys.executable, path, arg], cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert r.returncode == 1, r.stdout + r.stderr
    return r.stdout


def test_pending_child_copy_reproducer_exits_1_while_present() -> None:
    assert finding(PENDING_CP_FINDING).reproducer == "fixtures/findings/cache_load_into_pending_child_copy.py"
    out = _reproducer("fixtures/findings/cache_load_into_pending_child_copy.py", "gemma2")
    assert "identical to cache entry" in out and "differ from a fresh evaluation" in out


def test_layout_finding_reproducer_exits_1_while_present() -> None:
    out = _reproducer("fixtures/findings/kv_layout_logits.py", "llama")
    assert "differ" in out and "identical to the fresh evaluation" in out


def test_check_restore_equivalence_fails_the_invariant_with_the_mismatch_line() -> None:
    params = ServerParams(n_slots=2, cache_ram=64, cache_ram_unit=1024, n_batch=16, n_ubatch=8)
    server = make_llama_server("shared", model_path("llama"), draft_model=draft_path(), params=params, n_ctx=256)
    try:
        inv.check_restore_equivalence(server)  # nothing restored yet
        server.handle_completion(tuple(PROMPT), id_slot=0, n_cmpl=1, n_predict=2)
        server.run_until_idle()
        inv.check_restore_equivalence(server)
        tgt = server.ctx_tgt
        assert isinstance(tgt, LlamaProvider)
        tgt.mismatches.append(
            sys.modules["harness.targets.libllama"].Mismatch("tgt", 0, "set_data(flags=0)", 5, 0, 1.0)
        )
        with pytest.raises(inv.Violation, match="restore_equivalence"):
            inv.check_restore_equivalence(server)
    finally:
        close_server(server)
    assert server.ctx_tgt.ctx is None  # type: ignore[attr-defined]


def test_memray_sees_master_deep_copy_of_checkpoints_and_not_shared() -> None:
    from properties.libllama_scenarios import memray_figures

    m = memray_figures("mamba", n_tokens=512)
    assert m.n_checkpoints >= 1 and m.checkpoint_bytes > 0
    diff = m.save_peak_bytes["master"] - m.save_peak_bytes["shared"]
    assert 0.9 * m.checkpoint_bytes <= diff <= 1.5 * m.checkpoint_bytes + 4096, (diff, m)
    assert m.model_save_peak_bytes["master"] - m.model_save_peak_bytes["shared"] == m.checkpoint_bytes
    assert m.load_peak_bytes["shared"] > 0


def test_draft_recovery_on_real_state_serves_every_request() -> None:
    from properties.libllama_scenarios import draft_recovery_run

    upstream = draft_recovery_run("jamba", recovery=False)
    assert upstream["errors"], "upstream fails a request when the draft runs out of room"
    rec = draft_recovery_run("jamba")
    assert rec["errors"] == [] and rec["verified"] == 4
    assert rec["recoveries"].get("resynced", 0) >= 1 and rec["recoveries"].get("retried", 0) >= 1


def test_draft_recovery_property_fails_without_the_recovery(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant: the recovery is switched on but gives up at once (fails the request as upstream)."""
    from harness.model.server_context import ServerContext
    from properties.libllama_scenarios import draft_recovery_run

    def give_up(self: ServerContext, slot: object, batch: list[int], pos0: int) -> bool:
        self.abort_all_slots("failed to process speculative batch")
        return False

    monkeypatch.setattr(ServerContext, "_recover_draft", give_up)
    with pytest.raises(inv.Violation, match="draft_recovery"):
        draft_recovery_run("llama")


def _swa_checkpoint_then_step_back(p: LlamaProvider, back: int) -> None:
    """The server's steps of swa-restore-window-short: a checkpoint at pos_max 17 (n_tokens 18) of a
    22-token prompt, the slot's memory holding all of it; a request for the first 17 tokens restores
    the checkpoint, and [TAG_PROMPT_LOGITS] re-evaluates from 16 (``back`` = 2; 1 is the ordinary
    restore of a request with a new token, which re-evaluates position 17)."""
    toks = [3 + (i * 7) % 250 for i in range(22)]
    assert p.decode(0, toks[:18], 0) == 0
    ckpt = p.state_seq_get_data_ext(0, STATE_SEQ_FLAGS_PARTIAL_ONLY)
    assert p.decode(0, toks[18:], 18) == 0
    assert p.state_seq_set_data_ext(0, ckpt, STATE_SEQ_FLAGS_PARTIAL_ONLY) == len(ckpt)
    p.memory_seq_rm(0, 18 - back, -1)
    assert p.decode(0, toks[18 - back : 18], 18 - back) == 0


def test_an_swa_checkpoint_cut_below_its_window_is_the_known_finding() -> None:
    with provider("gemma2", n_batch=512, n_ubatch=512) as p:
        assert p.n_swa == 16
        _swa_checkpoint_then_step_back(p, back=2)
        assert p.mismatches == [] and p.layout_diffs == []
        [m] = p.finding_diffs[SWA_WINDOW_FINDING]
        assert m.restored_by == "set_data(flags=1)+seq_rm(p0=16)" and m.max_abs_diff > 0.1
    with provider("gemma2", n_batch=512, n_ubatch=512) as p:  # control: resuming at pos_max is exact
        _swa_checkpoint_then_step_back(p, back=1)
        assert p.restore_checks == 1 and p.mismatches == [] and p.finding_diffs == {}


@pytest.mark.llama_server_builds  # the reproducer runs the pr llama-server (tests/conftest.py)
def test_swa_window_reproducer_exits_1_while_present() -> None:
    assert finding(SWA_WINDOW_FINDING).reproducer == "fixtures/findings/swa_restore_window_short.py"
    out = _reproducer("fixtures/findings/swa_restore_window_short.py", "shared", timeout=300)
    assert "checkpoint pos_max 17 restored: True" in out and "(without checkpoints it is right)" in out
