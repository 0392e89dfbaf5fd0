"""A concurrent run against a real ``llama-server`` under the libllama trace, its answers judged.

The workload is the one of the ``concurrent-output-divergence`` reproducer
(``fixtures/findings/concurrent_output_divergence.py``): ``clients`` clients each send ``per_client``
token prompts (16-320 tokens, some extending an earlier one) with 2-16 tokens to generate, all at
once, to a server with ``-np n_parallel``, no prompt cache, ``-b 256 -ub 64``. Each answer is compared
with a fresh single-slot server's (no trace there). :func:`record_concurrent` returns the trace file,
which answers were wrong, and what is needed to replay it (the server's ``libllama.so`` directory).
"""

from __future__ import annotations

import random
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from faults.replay import lib_dir_of
from faults.trace import DEFAULT_MAX_BYTES, static_note, trace_env
from harness.errors import UsageError
from harness.targets.llama_server import ServerProcess

__all__ = ["SERVER_ARGS", "TracedRun", "Work", "fresh_answers", "record_concurrent", "workload"]

SERVER_ARGS = ("-b", "256", "-ub", "64", "--no-warmup")

Work = list[list[tuple[tuple[int, ...], int]]]  # per client: (prompt tokens, n_predict)


def workload(seed: int, clients: int = 3, per_client: int = 4, lengths: Sequence[int] = (16, 64, 160, 320)) -> Work:
    """The reproducer's requests (its ``prompts(k)`` for ``k`` = ``seed * clients + client``)."""
    out: Work = []
    for k in range(seed * clients, seed * clients + clients):
        rng = random.Random(k)
        pool: list[tuple[int, ...]] = []
        reqs = []
        for _ in range(per_client):
            if pool and rng.random() < 0.5:
                toks = rng.choice(pool) + tuple(3 + rng.randrange(250) for _ in range(rng.choice((0, 0, 4, 32))))
            else:
                toks = tuple(3 + rng.randrange(250) for _ in range(rng.choice(tuple(lengths))))
                pool.append(toks)
            reqs.append((toks, rng.choice((2, 4, 8, 16))))
        out.append(reqs)
    return out


def fresh_answers(binary: Path, model: Path, work: Work, *, ctx_size: int = 2048) -> dict[tuple[tuple[int, ...], int],
                                                                                           list[int]]:  # fmt: skip
    """Each request's answer from a fresh single-slot server without cache, one request at a time."""
    with ServerProcess(binary, SERVER_ARGS, model=model, n_parallel=1, ctx_size=ctx_size, cache_ram=0) as srv:
        return {
            (t, n): list(srv.completion(list(t), n, ignore_eos=True, return_tokens=True, cache_prompt=False)["tokens"])
            for reqs in work
            for t, n in reqs
        }


@dataclass
class TracedRun:
    trace: Path
    binary: Path
    lib_dir: Path | None
    answers: int = 0
    wrong: list[str] = field(default_factory=list)
    log: Path | None = None

    @property
    def trace_bytes(self) -> int:
        return self.trace.stat().st_size if self.trace.exists() else 0


def record_concurrent(
    binary: Path,
    model: Path,
    work: Work,
    want: dict[tuple[tuple[int, ...], int], list[int]],
    trace: Path,
    *,
    n_parallel: int = 2,
    ctx_size: int = 2048,
    max_bytes: int = DEFAULT_MAX_BYTES,
    extra_args: Sequence[str] = (),
) -> TracedRun:
    """One round of ``work`` from concurrent clients on a traced server; the answers unlike ``want``."""
    note = static_note(binary)
    if note is not None:
        raise UsageError(note)
    env = trace_env(trace, max_bytes=max_bytes)
    run = TracedRun(trace, binary, lib_dir_of(binary))
    errors: list[BaseException] = []
    lock = threading.Lock()
    with ServerProcess(binary, [*SERVER_ARGS, *extra_args], model=model, n_parallel=n_parallel, ctx_size=ctx_size,
                       cache_ram=0, env=env) as srv:  # fmt: skip
        run.log = srv.log_path

        def client(reqs: list[tuple[tuple[int, ...], int]]) -> None:
            try:
                for t, n in reqs:
                    r: Any = srv.completion(list(t), n, ignore_eos=True, return_tokens=True)
                    with lock:
                        run.answers += 1
                        if r["tokens"] != want[(t, n)]:
                            run.wrong.append(f"{len(t)}-token prompt (slot {r['id_slot']}, cache_n "
                                             f"{r['timings']['cache_n']}): {r['tokens']}, sequentially "
                                             f"{want[(t, n)]}")  # fmt: skip
            except BaseException as e:  # handed to the caller below
                errors.append(e)

        threads = [threading.Thread(target=client, args=(c,), daemon=True) for c in work]
        for th in threads:
            th.start()
        for th in threads:
            th.join(300)
    if errors:
        raise errors[0]
    return run
