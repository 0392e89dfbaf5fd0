"""A concurrent run against a real ``llama-server`` under the libllama trace, its answers judged.

The workload is the one of the ``concurrent-output-divergence`` reproducer
(``fixtures/findings/concurrent_output_divergence.py``): ``clients`` clients each send ``per_client``
token prompts (16-320 tokens, some extending an earlier one) with 2-16 tokens to generate, all at
once, to a server with ``-np n_parallel``, no prompt cache, ``-b 256 -ub 64``. Each answer is compared
with a fresh single-slot server's (no trace there). :func:`record_concurrent` returns the trace file,
which answers were wrong, and what is needed to replay it (the server's ``libllama.so`` directory).

:class:`ServerTrace` is the same interposer on the servers of ``concurrent`` and ``soak``: one bounded
trace file per server in a directory that is kept, a trace deleted when its run showed no output
mismatch and kept, with the lines that replay and shrink it (:func:`trace_lines`), when it did.
"""

from __future__ import annotations

import contextlib
import os
import random
import tempfile
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.errors import HarnessLimit, UsageError
from harness.targets.llama_server import Launch, ServerProcess
from harness.trace.calls import DEFAULT_MAX_BYTES, static_note, trace_env
from harness.trace.replay import lib_dir_of
from harness.trees.build import tree_of_build

__all__ = [
    "LOAD_TRACE_MAX_BYTES",
    "SERVER_ARGS",
    "ServerTrace",
    "TracedRun",
    "Work",
    "fresh_answers",
    "record_concurrent",
    "trace_lines",
    "workload",
]

SERVER_ARGS = ("-b", "256", "-ub", "64", "--no-warmup")

Work = list[list[tuple[tuple[int, ...], int]]]  # per client: (prompt tokens, n_predict)
LOAD_TRACE_MAX_BYTES = 256 << 20  # one concurrent or soak server's trace (a soak phase's is the largest)


def trace_lines(trace: Path, binary: Path) -> str:
    """The trace file of a server and the two commands that replay it and shrink it."""
    lib = lib_dir_of(binary)
    opt = f" --lib-dir {lib}" if lib is not None else ""
    return (f"libllama trace {trace}; replay: python -m harness trace replay {trace}{opt} --fresh; "
            f"shrink: python -m harness trace shrink {trace}{opt}")  # fmt: skip


class ServerTrace:
    """Where the servers of one ``concurrent`` or ``soak`` run write their libllama traces.

    ``directory`` None: a new ``harness-traces-*`` directory under the temporary directory, made at
    the first trace and removed at :meth:`close` when no trace was kept. Each server gets its own file
    (:meth:`env`); :meth:`settle` keeps it when its run failed, else deletes it (``keep_all``: keeps
    it, the lines printed for failed runs only). ``enabled`` False (a
    binary that links libllama statically, or ``--no-trace``): no environment, nothing kept.
    """

    def __init__(self, binary: Path, directory: Path | None = None, *, enabled: bool = True,
                 max_bytes: int = LOAD_TRACE_MAX_BYTES, keep_all: bool = False) -> None:  # fmt: skip
        self.binary = binary
        self.keep_all = keep_all  # keep every trace (to measure), not only those of failed runs
        self.note = static_note(binary) if enabled else "tracing off"
        self.enabled = enabled and self.note is None
        self.max_bytes = max_bytes
        self._dir = directory
        self._made = False
        self.kept: list[Path] = []

    def path(self, name: str) -> Path | None:
        """A new trace file for the server ``name`` (None when tracing is off)."""
        if not self.enabled:
            return None
        if self._dir is None:
            self._dir = Path(tempfile.mkdtemp(prefix="harness-traces-"))
            self._made = True
        self._dir.mkdir(parents=True, exist_ok=True)
        return self._dir / f"{name}.jsonl"

    def env(self, path: Path | None, with_env: dict[str, str] | None = None) -> dict[str, str] | None:
        """The server's environment: ``with_env`` (e.g. the fault shim's) plus the trace into ``path``."""
        if path is None:
            return with_env
        # the interposer compiled against the server's own tree (its structs and batch API as that server has them)
        tree = tree_of_build(self.binary.resolve().parent)
        try:
            return trace_env(path, tree=tree, max_bytes=self.max_bytes, with_env=with_env)
        except HarnessLimit as e:  # a tree trace.c cannot be built against: the run goes on untraced, said once
            self.enabled, self.note = False, str(e)
            return with_env

    def settle(self, path: Path | None, failed: bool) -> str | None:
        """Keep ``path`` when its run failed (returns :func:`trace_lines`), else delete it."""
        if path is None:
            return None
        if self.keep_all and not failed:
            return None
        if failed and path.exists():
            self.kept.append(path)
            with path.open("rb") as f:
                f.seek(max(0, path.stat().st_size - 512))
                cut = b'"truncated"' in f.read()
            more = f" (cut at {self.max_bytes} bytes: what came later is not in it)" if cut else ""
            return trace_lines(path, self.binary) + more
        path.unlink(missing_ok=True)
        return None

    def close(self) -> None:
        """Remove the directory this made when it kept nothing."""
        if self._made and self._dir is not None and not self.kept:
            with contextlib.suppress(OSError):  # something else is in it: leave it
                os.rmdir(self._dir)


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


def fresh_answers(binary: Path, model: Path, work: Work, *, ctx_size: int = 2048, extra_args: Sequence[str] = ()
                  ) -> dict[tuple[tuple[int, ...], int], list[int]]:  # fmt: skip
    """Each request's answer from a fresh single-slot server without cache, one request at a time."""
    with ServerProcess(
        binary,
        Launch(model=model, n_parallel=1, ctx_size=ctx_size, cache_ram=0, args=[*SERVER_ARGS, *extra_args]),
    ) as srv:  # fmt: skip
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
    cache_ram: int = 0,
) -> TracedRun:
    """One round of ``work`` from concurrent clients on a traced server; the answers unlike ``want``.

    ``work`` of one client on ``n_parallel`` 1 with ``cache_ram`` > 0 is the cache path without
    concurrency: each prompt that extends an earlier one is served partly from the slot or the cache."""
    note = static_note(binary)
    if note is not None:
        raise UsageError(note)
    # the interposer compiled against the server's own tree (its structs as that server has them)
    env = trace_env(trace, max_bytes=max_bytes, tree=tree_of_build(binary.resolve().parent))
    run = TracedRun(trace, binary, lib_dir_of(binary))
    errors: list[BaseException] = []
    lock = threading.Lock()
    with ServerProcess(
        binary,
        Launch(
            model=model,
            n_parallel=n_parallel,
            ctx_size=ctx_size,
            cache_ram=cache_ram,
            args=[*SERVER_ARGS, *extra_args],
        ),
        env=env,
    ) as srv:  # fmt: skip
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
