"""Native allocation failures inside libllama: the sweep, its classification, the gate's use of it."""

from __future__ import annotations

import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from faults.kinds import Outcome
from faults.llama_native import LlamaNativeReport, NativeTrial, sweep_llama_native
from harness.backends import libllama as llama_backend
from harness.backends.base import GateReport
from harness.backends.libllama import classify_native

ROOT = Path(__file__).resolve().parents[1]


def test_get_sweep_reaches_completion_and_names_each_case() -> None:
    rep = sweep_llama_native("llama", "get")
    outcomes = [t.outcome for t in rep.trials]
    assert outcomes[-1] == Outcome.OK and not rep.capped
    assert outcomes[0] == Outcome.ABORTED  # the finding: the io object is allocated outside the try
    assert set(outcomes[1:-1]) == {Outcome.ACCEPTED}
    assert all(t.detail.startswith("reported") for t in rep.trials[1:-1])
    assert [t.nth for t in rep.trials] == list(range(1, len(rep.trials) + 1))
    assert rep.trials[3].case == "llama.get.4"
    (group,) = rep.groups()
    assert group["site"].startswith("llama_context::state_seq_get_data")
    # observed, from the stack the shim wrote when it failed the allocation: the io object's make_unique
    assert group["alloc_sites"] == ["libllama.so:llama_context::state_seq_get_data"]
    assert classify_native("get", group) == "state-io-alloc-outside-try"
    # every trial says where its allocation failed: deeper in the state writer for the reported ones
    assert all(t.alloc_site.startswith("libllama.so:llama_") for t in rep.trials[:-1])
    assert len({t.alloc_site for t in rep.trials[1:-1]}) > 1 and rep.trials[-1].alloc_site == "-"


def test_one_case_replays_alone() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "harness", "native", "--case", "mamba.get-part.3"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert r.returncode == 0, r.stderr
    first = r.stdout.splitlines()[0]
    assert first.startswith("mamba.get-part.3") and "accepted-error" in first and "reported" in first


def test_unknown_op_is_refused() -> None:
    with pytest.raises(ValueError, match="unknown op"):
        sweep_llama_native("llama", "save")


@pytest.mark.parametrize(
    ("op", "outcome", "site", "known"),
    [
        ("set", Outcome.ABORTED, "llama_context::state_seq_set_data(int, ...)", "state-io-alloc-outside-try"),
        ("decode", Outcome.ABORTED, "llama_kv_cache::find_slot(...)", "decode-bad-alloc-terminates"),
        ("decode", Outcome.KILLED, "ggml_graph_compute", "graph-compute-segv"),
        ("get", Outcome.VIOLATION, "?", None),  # silent corruption is never a known finding
        ("set", Outcome.KILLED, "llama_kv_cache::state_read(...)", None),
        ("get", Outcome.ABORTED, "llama_kv_cache::state_write(...)", None),
    ],
)
def test_classification(op: str, outcome: str, site: str, known: str | None) -> None:
    assert classify_native(op, {"outcome": outcome, "site": site}) == known


@pytest.mark.parametrize(
    ("alloc_sites", "known"),
    [
        (["libllama.so:llama_context::state_seq_get_data"], "state-io-alloc-outside-try"),
        # the abort's stack is the same, but the allocation that failed was not the io object's
        (["libllama.so:llama_kv_cache::state_write_data"], None),
        (["libllama.so:llama_context::state_seq_get_data", "libggml-base.so:ggml_new_tensor_impl"], None),
    ],
)
def test_classification_reads_where_the_allocation_failed(alloc_sites: list[str], known: str | None) -> None:
    group = {
        "outcome": Outcome.ABORTED,
        "site": "llama_context::state_seq_get_data(int, ...)",
        "alloc_sites": alloc_sites,
    }
    assert classify_native("get", group) == known


def test_an_unlisted_native_outcome_fails_the_gate(monkeypatch: pytest.MonkeyPatch) -> None:
    """Mutant of libllama's behaviour: a call that claims success with a corrupted result."""

    def fake(arch: str, op: str) -> LlamaNativeReport:
        rep = LlamaNativeReport(arch, op)
        rep.trials = [
            NativeTrial(f"{arch}.{op}.1", 1, Outcome.VIOLATION, "wrong ret 0"),
            NativeTrial(f"{arch}.{op}.2", 2, Outcome.OK, "completed"),
        ]
        return rep

    monkeypatch.setattr(llama_backend, "sweep_llama_native", fake)
    report = GateReport("shared", "llama", "ci", 0, "test")
    rows: list[dict[str, object]] = [{"arch": "llama"}]
    llama_backend._run_llama_native(report, "shared", ["llama"], rows, lambda s: None)  # type: ignore[arg-type]
    assert not report.passed
    assert len(report.failures) == 4  # one per swept operation
    f = report.failures[0]
    assert f.property == "native_fault" and "wrong" in f.message
    assert f.replay == "python -m harness native --case llama.get.1"
    assert Counter(k.status for k in report.known) == Counter({"not-reproduced": 3})


@pytest.mark.parametrize("script", ["state_io_alloc_outside_try.py", "graph_compute_segv.py"])
def test_native_finding_reproducers_exit_1_while_present(script: str) -> None:
    r = subprocess.run(
        [sys.executable, f"fixtures/findings/{script}"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 1, r.stdout + r.stderr
    assert "BUG:" in r.stdout
