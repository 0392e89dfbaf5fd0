"""The concurrent replay's reading of the server's log around a request that names a busy slot.

No server runs here: the log lines are upstream's format (server-task.cpp:1799-1826), the model is the
real one on libllama (mamba, two slots), and the responses are written as the server would send them.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from fixtures.gguf import model_path
from harness.load.clients import Req, Sent
from harness.load.concurrent import load_config
from harness.load.order import Event, parse_log
from harness.load.order_replay import ConcurrentResult, deferred_request, replay_order
from harness.model.cache import f32, get_common_prefix
from harness.model.server_context import ServerContext
from harness.targets.libllama import close_server, make_llama_server

LOOKUP_LINES = """\
0.00.176.293 I srv          load:  - looking for better prompt, base f_keep = 0.490, f_sim = 0.990
0.00.176.307 I srv          load:    - prompt with length     221, lcp =       0, f_keep = 0.000, f_sim = 0.000
0.00.176.309 I srv          load:    - prompt with length      66, lcp =      32, f_keep = 0.485, f_sim = 0.330
0.00.176.333 I srv          load:  - found better prompt with f_keep = 0.485, f_sim = 0.330
0.00.176.351 I srv        update:    - prompt 0x55c83b39c2c0:     129 tokens, checkpoints:  2,     0.056 MiB
"""

A = tuple(3 + (i * 7) % 250 for i in range(40))  # the long request running in slot 0
B = tuple(200 + i % 40 for i in range(30))  # two requests that name slot 0 while it is busy
C = (*A[:10], *range(60, 80))


def test_the_parser_reads_the_cache_lookup_and_the_load() -> None:
    ev = parse_log(LOOKUP_LINES)
    assert [e.kind for e in ev] == ["lookup", "entry", "entry", "load"]  # the update's list is not an entry
    assert ev[0].how == "f_keep = 0.490, f_sim = 0.990"
    assert [(e.n, e.lcp) for e in ev[1:3]] == [(221, 0), (66, 32)]
    assert ev[3].how == "f_keep = 0.485, f_sim = 0.330"


@pytest.fixture
def model() -> Iterator[ServerContext]:
    cfg = load_config("mamba", 2, False)
    m = make_llama_server("shared", model_path("mamba"), params=cfg.params(), n_ctx=cfg.n_ctx, check_restores=False)
    try:
        yield m
    finally:
        close_server(m)


def _sent(i: int, tokens: tuple[int, ...], n_predict: int, id_slot: int, slot: int = 0) -> Sent:
    gen = [5 + (i + k) % 7 for k in range(n_predict)]
    resp = {"id_slot": slot, "tokens_evaluated": len(tokens), "tokens": gen, "timings": {"cache_n": 0}}
    return Sent(Req(i, 0.01 * i, tokens, n_predict, id_slot), i, t_send=0.01 * i, id_slot=id_slot, response=resp)


def _lookup(m: ServerContext, new: tuple[int, ...]) -> list[Event]:
    """The lookup lines the server logs for ``new`` against slot 0 (just saved) and the model's cache."""
    mine = m.slots[0].prompt.tokens
    lcp = get_common_prefix(mine, new)
    out = [Event("lookup", 2.0, how=f"f_keep = {f32(lcp / len(mine)):.3f}, f_sim = {f32(lcp / len(new)):.3f}")]
    assert m.prompt_cache is not None
    prompts = [st.prompt.tokens for st in m.prompt_cache.states] + [mine]
    return out + [Event("entry", 2.0, n=len(p), lcp=get_common_prefix(p, new)) for p in prompts]


def test_a_deferred_selection_is_the_request_whose_lookup_the_server_logged(model: ServerContext) -> None:
    """Two requests wait for busy slot 0; the server retried the later one first: the lookup says which."""
    r = model.handle_completion(A, id_slot=0, n_predict=20)
    assert r.status == "launched"
    for _ in range(5):
        model.update_slots()
    older, newer = _sent(1, B, 3, 0), _sent(2, C, 4, 0)
    assert deferred_request(model, model.slots[0], [older, newer], _lookup(model, C)) is newer
    assert deferred_request(model, model.slots[0], [newer, older], _lookup(model, B)) is older
    assert deferred_request(model, model.slots[0], [newer, older], []) is older  # nothing logged: the earliest


def _trace(with_load: bool) -> tuple[list[Event], list[Sent]]:
    """Slot 0 runs A; a request naming slot 0 is deferred (its save at 50 tokens), then A is released."""
    long = _sent(0, A, 20, 0)
    busy = _sent(1, B, 3, 0, slot=0)
    window = [Event("save", 2.0, n=50), Event("lookup", 2.0, how="f_keep = 0.000, f_sim = 0.000"),
              Event("entry", 2.0, n=50, lcp=0)]  # fmt: skip
    if with_load:
        window.append(Event("load", 2.0, how="f_keep = 0.600, f_sim = 0.500"))
    events = [
        Event("select", 1.0, 0, -1, how="id"),
        Event("launch", 1.0, 0, 7),
        Event("prompt", 1.0, 0, 7, len(A)),
        Event("select", 2.0, 0, 7, how="id"),
        *window,
        Event("eval", 3.0, 0, 7, 20),
        Event("release", 3.0, 0, 7, len(A) + 19),
    ]
    return events, [long, busy]


def test_a_busy_selection_the_model_agrees_with_is_no_mismatch(model: ServerContext) -> None:
    """No load logged, none in the model (nothing cached shares a prefix with B): the slot runs on to the end."""
    events, sents = _trace(with_load=False)
    res = ConcurrentResult("t")
    replay_order(model, events, sents, res)
    assert (res.busy_requests, res.busy_loads, res.load_mismatches) == (1, 0, 0), res.failures
    assert model.slots[0].prompt.n_tokens() == len(A) + 19


def test_the_servers_log_of_a_busy_load_the_model_missed_fails_the_trace(model: ServerContext) -> None:
    """The same trace with the server's "found better prompt": the model kept the slot, a mismatch."""
    events, sents = _trace(with_load=True)
    res = ConcurrentResult("t")
    replay_order(model, events, sents, res)
    assert (res.busy_loads, res.load_mismatches, res.mismatches) == (1, 1, 1)
    assert res.failures[0].startswith("busy load at 2.000s: the server took a cached prompt into busy slot 0")
    assert res.busy_hits == 1  # the server's log rewrote the slot: its answer is judged as busy-slot-by-id's
