"""K client threads sending timed completion requests to one ``llama-server``, and their trace.

A :class:`Req` is one request of one client: its tokens, ``n_predict``, the slot it names
(``id_slot``: -1 none, a slot id, or :data:`BUSY`: whichever slot ``GET /slots`` shows processing
when it is sent, so the request names a slot that is busy; :data:`EMBED`: not a completion but a
``POST /embeddings`` of the tokens, whose answer has no slot) and ``at``, the earliest time after the
run's start it may be sent (a client sends its requests in order, each after the previous one
answered). :func:`run_clients` runs every client in its own thread and returns one :class:`Sent`
per request with wall-clock send and receive times; :func:`replay_program` prints the requests as a
program that sends them again with the same timing.

Bounded: every request has a timeout, the whole run a deadline; threads are daemons, so Ctrl-C
leaves none behind once the server (stopped by its owner) closes the connections.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from harness.targets.llama_server import RequestFailed, ServerProcess

__all__ = ["BUSY", "EMBED", "Req", "Sent", "replay_program", "run_clients", "soak_prompt"]

BUSY = -2  # id_slot: name whichever slot is processing when the request is sent
EMBED = -3  # id_slot: an embedding request (the server picks its slot; the answer names none)
_BUSY_POLL_S = 2.0  # how long a BUSY request looks for a processing slot before sending anyway


@dataclass(frozen=True)
class Req:
    client: int
    at: float  # seconds after the start, at the earliest
    tokens: tuple[int, ...]
    n_predict: int
    id_slot: int = -1  # -1: none; BUSY: a slot /slots shows processing

    def __repr__(self) -> str:
        return f"Req({self.client}, {self.at!r}, {self.tokens!r}, {self.n_predict}, {self.id_slot})"


@dataclass
class Sent:
    """One request as it went: when (seconds after the start), which slot it named, what came back."""

    req: Req
    index: int  # position in the trace
    t_send: float = 0.0
    t_recv: float = 0.0
    id_slot: int = -1  # the slot actually named (BUSY resolved; -1 when /slots showed none busy)
    response: dict[str, Any] | None = None
    error: str | None = None

    @property
    def embedding(self) -> bool:
        return self.req.id_slot == EMBED

    @property
    def slot(self) -> int:
        return int(self.response["id_slot"]) if self.response and not self.embedding else -1

    @property
    def cache_n(self) -> int:
        return int(self.response["timings"]["cache_n"]) if self.response and not self.embedding else -1

    @property
    def generated(self) -> tuple[int, ...]:
        return tuple(int(t) for t in (self.response or {}).get("tokens") or ())

    def describe(self) -> str:
        named = f" id_slot={self.id_slot}" if self.id_slot >= 0 else ""
        got = f"slot {self.slot} cache_n {self.cache_n}" if self.response else f"error {self.error}"
        return (
            f"#{self.index} client {self.req.client} at {self.t_send:.3f}-{self.t_recv:.3f}s: {len(self.req.tokens)} "
            f"tokens (…{list(self.req.tokens[-3:])}) n_predict {self.req.n_predict}{named} -> {got}"
        )


def _busy_slot(server: ServerProcess, deadline: float) -> int:
    """The first slot ``GET /slots`` shows processing, polling until ``deadline`` (-1: none)."""
    while time.monotonic() < deadline:
        try:
            slots = server.request("GET", "/slots")
        except RequestFailed:
            return -1
        busy = [int(s["id"]) for s in slots if s.get("is_processing")]
        if busy:
            return busy[0]
        time.sleep(0.001)
    return -1


def _client(server: ServerProcess, sents: list[Sent], t0: float, deadline: float, extra: dict[str, Any]) -> None:
    for s in sents:
        if time.monotonic() >= deadline:
            s.error = "not sent: the run's deadline passed"
            continue
        wait = t0 + s.req.at - time.monotonic()
        if wait > 0:
            time.sleep(wait)
        slot = s.req.id_slot
        if slot == BUSY:
            slot = _busy_slot(server, min(deadline, time.monotonic() + _BUSY_POLL_S))
        s.id_slot = slot
        s.t_send = time.monotonic() - t0
        try:
            if slot == EMBED:
                r = server.request("POST", "/embeddings", {"content": list(s.req.tokens)})
                if not (isinstance(r, list) and r and r[0].get("embedding")):
                    raise RequestFailed("POST", "/embeddings", "malformed", message=str(r)[:120])
                s.response = {"embedding": len(r[0]["embedding"])}
                s.t_recv = time.monotonic() - t0
                continue
            s.response = server.completion(
                list(s.req.tokens),
                s.req.n_predict,
                id_slot=slot if slot >= 0 else None,
                ignore_eos=True,
                return_tokens=True,
                **extra,
            )
        except RequestFailed as e:
            s.error = e.describe()
        s.t_recv = time.monotonic() - t0


@dataclass
class ClientRun:
    sents: list[Sent] = field(default_factory=list)
    seconds: float = 0.0


def run_clients(
    server: ServerProcess, reqs: Sequence[Req], *, timeout: float = 60.0, extra: dict[str, Any] | None = None
) -> ClientRun:
    """Send ``reqs`` from one thread per client; returns every request's :class:`Sent`, in trace order."""
    sents = [Sent(r, i) for i, r in enumerate(reqs)]
    by_client: dict[int, list[Sent]] = {}
    for s in sents:
        by_client.setdefault(s.req.client, []).append(s)
    t0 = time.monotonic()
    deadline = t0 + timeout
    threads = [
        threading.Thread(target=_client, args=(server, group, t0, deadline, extra or {}), daemon=True)
        for group in by_client.values()
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(max(0.0, deadline + server.request_timeout - time.monotonic()))
    return ClientRun(sents, time.monotonic() - t0)


def replay_program(setup: Sequence[str], call: str, reqs: Sequence[Req]) -> str:
    """``setup`` lines, then ``call`` (e.g. ``replay(cfg, binary, 'shared', REQS)``) with the timed requests."""
    lines = [*setup, "REQS = ["]
    lines += [f"    {r!r}," for r in reqs]
    lines += ["]", call]
    return "\n".join(lines)


def soak_prompt(rng: random.Random, pool: list[tuple[int, ...]], n_max: int) -> tuple[int, ...]:
    """A soak client's next prompt: a new one (kept in ``pool``, the last 12), or half the time an earlier one,
    sometimes with a new tail."""
    if pool and rng.random() < 0.5:  # repeating: an earlier prompt, sometimes with a new tail
        base = rng.choice(pool)
        tail = tuple(3 + rng.randrange(250) for _ in range(rng.choice((0, 0, 4, 32))))
        return (base + tail)[:n_max] or (1,)
    toks = tuple(3 + rng.randrange(250) for _ in range(rng.choice((16, 64, 160, 320))))
    pool.append(toks)
    if len(pool) > 12:
        pool.pop(0)
    return toks
