"""Embedding clients in the concurrent differential's overlapping phase (issue #39, point 3):
``python -m harness concurrent --embedding-clients N``.

Besides the completion clients of :func:`harness.load.concurrent.scenario`, N clients send ``POST /embeddings``
(:data:`~harness.load.clients.EMBED` requests) while the completions overlap, to a server that also answers them
(:func:`harness.load.stateless.server_args`: ``--rerank``, or mean pooling on lfm2, where a pooled completion
crashes: the finding ``lfm2-pooled-completion-segv``). Embeddings on make the server set ``n_batch = n_ubatch``
(tools/server/server.cpp:150-154), so the configuration gets ``-ub`` equal to ``-b`` (:func:`embedding_config`):
``-b`` stays ``-c`` and a slot's prompt is still cut only where the model cuts it. Each embedding prompt has a
length no other one of the trace has: its task in the server's log (a launch with no ``eval time`` line) is matched
to it by length, and the model replays it in the server's order (``ServerContext.handle_stateless``) on the slot
the server chose, so the idle-slot saves that follow (the finding ``idle-stateless-slot-cached``, counted from the
model's ``stateless_saves``) and every later completion's ``cache_n`` are predicted as before.

Held besides (:class:`RssWatch`, :func:`bound_violations`): the server's RSS, sampled every
:data:`SAMPLE_S` while the clients run, stays under its RSS once started + ``--cache-ram`` +
:data:`~harness.load.soak.RSS_SLACK_MIB`, as in the soak; every ``cache state`` line's size is within its limit.
"""

from __future__ import annotations

import random
import threading
from dataclasses import replace
from types import TracebackType

from fixtures.gguf import BOS_ID, BYTE_TOKEN_OFFSET
from harness.load.clients import EMBED, Req
from harness.load.live import rss_bytes
from harness.load.order import cache_states
from harness.load.soak import RSS_SLACK_MIB
from harness.targets.llama_server import ServerConfig

__all__ = ["SAMPLE_S", "RssWatch", "bound_violations", "embedding_config", "embedding_reqs"]

SAMPLE_S = 0.05


def embedding_config(cfg: ServerConfig) -> ServerConfig:
    """``cfg`` with ``-ub`` = ``-b``, which a server with embeddings on would force (server.cpp:150-154)."""
    return replace(cfg, n_ubatch=cfg.n_batch)


def embedding_reqs(seed: int, first_client: int, n_clients: int, per_client: int) -> list[Req]:
    """``per_client`` embedding requests for each of ``n_clients`` clients (numbered from ``first_client``),
    sent over the first ~0.2 s as the completions are; every prompt (BOS + 8-80 byte tokens) of its own length."""
    rng = random.Random(seed * 7919 + 17)
    lengths = rng.sample(range(9, 82), n_clients * per_client)
    out = []
    for k in range(n_clients * per_client):
        toks = (BOS_ID, *(BYTE_TOKEN_OFFSET + rng.randrange(250) for _ in range(lengths[k] - 1)))
        at = round(0.002 + (rng.uniform(0.0, 0.05) if k % per_client else 0.0), 4)
        out.append(Req(first_client + k // per_client, at, toks, 0, EMBED))
    return out


class RssWatch:
    """A thread sampling a process's RSS every :data:`SAMPLE_S` until the ``with`` block ends: ``base`` (at
    entry), ``peak``."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.base = rss_bytes(pid)
        self.peak = self.base
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self.peak = max(self.peak, rss_bytes(self.pid))

    def __enter__(self) -> RssWatch:
        self._thread.start()
        return self

    def __exit__(self, t: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        self._stop.set()
        self._thread.join(1.0)
        self.peak = max(self.peak, rss_bytes(self.pid))

    def bound(self, cache_ram_mib: int) -> int:
        return self.base + (cache_ram_mib + RSS_SLACK_MIB) * (1 << 20)


def bound_violations(watch: RssWatch, cache_ram_mib: int, log: str) -> tuple[list[str], float]:
    """The RSS and cache-size bounds over one trace: what broke them, and the largest logged cache size (MiB)."""
    out = []
    if watch.peak > watch.bound(cache_ram_mib):
        out.append(f"RSS {watch.peak} B exceeds the bound {watch.bound(cache_ram_mib)} B (at start {watch.base} B "
                   f"+ --cache-ram {cache_ram_mib} MiB + {RSS_SLACK_MIB} MiB)")  # fmt: skip
    states = cache_states(log)
    out += [f"the logged cache size {s.mib} MiB exceeds its limit {s.limit_mib} MiB at {s.t:.3f}s"
            for s in states if s.mib > s.limit_mib + 1e-3]  # fmt: skip
    return out, max((s.mib for s in states), default=0.0)
