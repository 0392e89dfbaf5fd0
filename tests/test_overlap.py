"""Embedding clients in the concurrent differential's overlapping phase (issue #39, point 3): the model replays each
embedding in the server's order, so every completion is still predicted; RSS and cache size stay bounded."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from harness.load.clients import EMBED, Req
from harness.load.concurrent import fresh_server, load_config, run_concurrent, run_trace
from harness.load.overlap import RssWatch, bound_violations, embedding_config, embedding_reqs
from harness.load.stateless import server_args
from harness.model.server_context import ServerContext
from harness.targets.llama_server import ServerProcess
from harness.trees.build import build_server

pytestmark = pytest.mark.llama_server_builds


def test_embedding_requests_have_lengths_of_their_own() -> None:
    reqs = embedding_reqs(3, 4, 2, 8)
    assert len({len(r.tokens) for r in reqs}) == 16 and {r.id_slot for r in reqs} == {EMBED}
    assert {r.client for r in reqs} == {4, 5} and all(r.n_predict == 0 for r in reqs)
    cfg = embedding_config(load_config("llama", 2, False))
    assert cfg.n_ubatch == cfg.n_batch == cfg.n_ctx  # the server forces n_batch = n_ubatch: -b stays -c


def test_bounds_report_the_rss_and_a_cache_past_its_limit() -> None:
    line = "0.00.{}00.000 I srv          update:  - cache state: {} prompts, {} MiB (limits: 8.000 MiB, 2048 tokens)\n"
    log = line.format(1, 2, "3.500") + line.format(2, 3, "8.250")
    with RssWatch(os.getpid()) as w:
        pass
    broke, peak = bound_violations(w, 8, log)
    assert peak == 8.25 and len(broke) == 1 and "8.25 MiB exceeds its limit 8.0 MiB" in broke[0]
    w.peak = w.bound(8) + 1
    broke, _ = bound_violations(w, 8, log)
    assert len(broke) == 2 and broke[0].startswith("RSS")


@pytest.fixture(scope="module")
def binary() -> Any:
    return build_server("shared")


def test_overlapping_embeddings_are_replayed_and_bounded(binary: Any) -> None:
    r = run_concurrent(load_config("llama", 2, False), binary, "shared", 0, 2, embedding_clients=1)
    assert r.mismatches == 0 and r.unmodellable is None, r.failures
    assert r.embeddings == 16 and r.interleavings > 0
    assert r.stateless_cached > 0  # the registered finding idle-stateless-slot-cached, counted from the model
    assert 0 < r.rss_peak <= r.rss_bound and 0 < r.cache_max_mib <= 8


@pytest.fixture
def embeddings_cut_short(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """A planted server-side difference: every embedding reaches the server one token short of what the model is
    told it was (the server evaluates a prompt the replay does not know)."""
    orig = ServerProcess.request

    def cut(self: ServerProcess, method: str, path: str, body: Any = None, **kw: Any) -> Any:
        if path == "/embeddings":
            body = {**body, "content": body["content"][:-1]}
        return orig(self, method, path, body, **kw)

    monkeypatch.setattr(ServerProcess, "request", cut)
    yield


@pytest.mark.usefixtures("embeddings_cut_short")
def test_an_embedding_the_model_does_not_know_is_caught(binary: Any) -> None:
    r = run_concurrent(load_config("llama", 2, False), binary, "shared", 0, 1, embedding_clients=1)
    assert r.unmodellable is not None and "matches no response" in r.unmodellable, r.unmodellable


def _embedding_beside_a_long_completion(binary: Any) -> Any:
    """One long completion, and an embedding sent while it generates: the server takes the other slot."""
    cfg = embedding_config(load_config("llama", 2, False))
    reqs = [Req(0, 0.0, tuple(3 + i % 200 for i in range(40)), 900), *embedding_reqs(0, 1, 1, 1)]
    reqs[1] = Req(1, 0.01, reqs[1].tokens, 0, EMBED)
    with fresh_server(cfg, binary, extra=server_args("llama")) as fresh:
        return run_trace(cfg, binary, "shared", reqs, fresh)


def test_an_embedding_beside_a_long_completion_is_followed(binary: Any) -> None:
    r = _embedding_beside_a_long_completion(binary)
    assert r.mismatches == 0 and r.unmodellable is None and r.embeddings == 1 and r.interleavings == 1, r.failures


def test_a_model_that_puts_an_embedding_on_a_busy_slot_is_caught(binary: Any, monkeypatch: pytest.MonkeyPatch
                                                                 ) -> None:  # fmt: skip
    """A planted model bug: an embedding pinned to the slot that is generating (the model defers it)."""
    orig = ServerContext.handle_stateless

    def busy(self: ServerContext, tokens: Any, task_type: str = "embedding", *, id_slot: int = -1) -> Any:
        return orig(self, tokens, task_type, id_slot=next(s.id for s in self.slots if s.is_processing()))

    monkeypatch.setattr(ServerContext, "handle_stateless", busy)
    r = _embedding_beside_a_long_completion(binary)
    assert r.unmodellable is not None and r.mismatches == 1 and r.failures[0].startswith("embedding slot"), r.failures
