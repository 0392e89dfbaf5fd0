"""How an output difference's gap is measured (harness/load/outputs.py), without a server: model-only."""

from __future__ import annotations

from pathlib import Path

import pytest

from harness.backends.llama_server.differential import compare_with_reference
from harness.backends.llama_server.probe import HIGH_BYTES
from harness.load.outputs import _gap
from harness.targets.llama_server import sampleable, set_completion_fields, withheld_tokens


def test_the_gap_is_to_the_best_token_the_server_could_sample() -> None:
    """b10566's completions ban the byte tokens 0x80-0xFF (its HTTP 500 on text that is not UTF-8), while the
    probabilities it reports are the raw distribution: a banned token on top is not the fresh server's best.
    Measured against it, a flip of 0.0048 between two allowed tokens read as 0.29 and failed the gate."""
    banned = HIGH_BYTES[0]
    entry = {"id": 118, "top_logprobs": [{"id": banned, "logprob": -1.0}, {"id": 118, "logprob": -1.2860},
                                         {"id": 113, "logprob": -1.2908}]}  # fmt: skip
    assert _gap(entry, 113) == pytest.approx(0.2908)
    (sampled,) = sampleable({"completion_probabilities": [entry]}, frozenset({banned}))["completion_probabilities"]
    assert _gap(sampled, 113) == pytest.approx(0.0048)
    assert _gap(sampled, 7) is None  # not among the reported: no gap to judge by


def test_the_withheld_tokens_are_the_runs_logit_bias_bans(tmp_path: Path) -> None:
    binary = tmp_path / "llama-server"
    assert withheld_tokens(binary) == frozenset()  # a version that needs no field bans nothing
    set_completion_fields(binary, {"logit_bias": [[t, False] for t in HIGH_BYTES] + [[5, 2.0]]})
    assert withheld_tokens(binary) == frozenset(HIGH_BYTES)  # a bias that only moves a token withholds nothing


def test_a_near_tie_is_one_among_the_tokens_the_server_could_sample() -> None:
    """``restore_equivalence``'s near-tie (``greedy-flip-on-cache-path``) on a version whose completions ban the
    byte tokens: the fresh server's runner-up is the second token it could sample, not the second it reports."""
    banned = HIGH_BYTES[-1]
    entries = [{"id": t, "top_logprobs": [{"id": t, "logprob": -0.5}]} for t in (118, 65, 87)]
    entries.append({"id": 40, "top_logprobs": [{"id": banned, "logprob": -1.0}, {"id": 40, "logprob": -1.1},
                                               {"id": 93, "logprob": -1.1001}]})  # fmt: skip
    fresh = {"tokens": [118, 65, 87, 40], "completion_probabilities": entries}
    assert compare_with_reference(sampleable(fresh, frozenset({banned})), (118, 65, 87, 93), "x") == "near-tie"
    assert sampleable(fresh, frozenset()) is fresh
    said = compare_with_reference(fresh, (118, 65, 87, 93), "x")  # the banned token taken for the best
    assert said == "x: generated [118, 65, 87, 93], a fresh server generates [118, 65, 87, 40]"
    assert compare_with_reference(fresh, (118, 65, 87, 40), "x") is None
