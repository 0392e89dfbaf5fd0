"""The rlimit layer: under one address-space budget, shared completes the seed's save, master fails."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harness.cli import main


def test_rlimit_shared_completes_master_fails(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "rlimit.json"
    assert main(["rlimit", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    assert "shared completes and master fails under the same budget" in printed
    data = json.loads(out.read_text())
    budget = data["budget_bytes"]
    by = {r["variant"]: r for r in data["results"]}
    assert by["shared"]["outcome"] == "ok"  # the save completed
    assert by["master"]["outcome"] == "crash" and "ckpt_copy.tgt" in by["master"]["detail"]
    s, c = by["shared"]["state_bytes"], by["shared"]["checkpoint_bytes"]
    assert s + c <= by["shared"]["cache_ram_bytes"]  # the entry satisfies --cache-ram
    assert s <= budget < s + c  # the limit is just above what shared needs
    for r in data["results"]:
        assert r["peak_bytes"] > 0 and r["limit_bytes"] == r["baseline_bytes"] + budget
        assert r["peak_bytes"] <= r["limit_bytes"]
