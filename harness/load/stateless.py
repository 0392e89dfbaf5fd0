"""Embedding and rerank requests against a real ``llama-server``: soak clients and a mixed differential (#39).

llama.cpp 0c1e570 serves ``/embeddings``, ``/rerank`` and completions from one server started with
``--rerank`` (``params.embedding`` and pooling ``rank``, common/arg.cpp:3484-3490; ``/rerank`` needs both,
server-context.cpp:5130, ``/embeddings`` the first, :5373; completions are not refused). The fixtures'
tiny llama serves all three: without ``cls``/``cls_out`` tensors the rank pooling of a causal model is its
last token's hidden state and the score its first element (llama-graph.cpp:3753-3792,
server-context.cpp:2178-2205), so no extra model is needed. ``--rerank`` also sets ``n_batch = n_ubatch``
(tools/server/server.cpp:150-154), so a fresh server that checks completions gets it too.

* :func:`stateless_clients`: threads sending embedding and rerank requests without pause until the
  phase ends (``python -m harness soak --embedding-clients N``); what they cost in RSS and cache size is
  held by the soak's own bounds, the completions' outputs are still checked.
* :func:`mixed_run` / :func:`predict`: a sequential program of completions, embeddings and reranks on two
  slots; the server's last ``cache state`` block (``-lv 4``, server-task.cpp:1894) against the model's
  prediction of the entries stateless tasks leave (``ServerContext.handle_stateless``; the finding
  ``idle-stateless-slot-cached``), and the completions against a fresh server (``python -m harness
  concurrent --embedding-clients N`` runs one per configuration).
"""

from __future__ import annotations

import random
import re
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Protocol

from fixtures.gguf import BOS_ID, BYTE_TOKEN_OFFSET, SPACE_ID, model_path
from harness.load.live import LiveServer, rss_bytes
from harness.load.outputs import compare_output
from harness.model.semantics import Semantics
from harness.model.server_context import TASK_EMBEDDING, TASK_RERANK, ServerParams
from harness.targets.libllama import close_server, make_llama_server
from harness.targets.llama_server import Launch, RequestFailed, ServerConfig, ServerProcess
from harness.targets.synthetic import make_server
from harness.trees.switches import switches_of_binary
from properties.stateless import check_stateless_not_cached

__all__ = [
    "SERVER_ARGS",
    "STATELESS_ENTRIES",
    "MixedResult",
    "Prediction",
    "StatelessCounts",
    "StatelessDiff",
    "StatelessPhase",
    "Step",
    "cache_entries",
    "fresh_problems",
    "mismatches",
    "mixed_program",
    "mixed_run",
    "predict",
    "reranks",
    "server_args",
    "stateless_clients",
    "stateless_differential",
    "unexplained_outputs",
]

SERVER_ARGS = ("--rerank",)
# lfm2 with pooling last, cls or rank crashes on any completion (the finding lfm2-pooled-completion-segv): there the
# servers get mean pooling (embeddings only: /rerank needs rank pooling; a prompt must fit one ubatch)
_MEAN_ARGS = ("--embeddings", "--pooling", "mean")
_NO_RANK = frozenset({"lfm2"})


def server_args(arch: str) -> tuple[str, ...]:
    """The flags that make a server of ``arch`` answer stateless requests besides completions."""
    return _MEAN_ARGS if arch in _NO_RANK else SERVER_ARGS


def reranks(arch: str) -> bool:
    """Does a server of ``arch`` started with :func:`server_args` answer ``/rerank``?"""
    return arch not in _NO_RANK


_ENTRY = re.compile(r"- prompt 0x[0-9a-f]+:\s+(\d+) tokens, checkpoints:\s+(\d+),\s+([\d.]+) MiB")
_STATE = re.compile(r"cache state: (\d+) prompts")
_WORDS = ("alpha", "beta", "gamma", "delta", "eps", "zeta", "eta", "theta", "iota", "kappa", "lambda", "mu")


def tokens_of(text: str) -> tuple[int, ...]:
    """The fixtures' tokenizer without BOS: one token per byte, a space is ``▁`` (fixtures/gguf.py)."""
    return tuple(SPACE_ID if b == 0x20 else BYTE_TOKEN_OFFSET + b for b in text.encode())


def _text(rng: random.Random, n_words: int) -> str:
    return " ".join(rng.choice(_WORDS) for _ in range(n_words))


# ---- soak clients ----------------------------------------------------------------------------


@dataclass
class StatelessCounts:
    """What the stateless clients of one soak phase did."""

    embeddings: int = 0
    reranks: int = 0
    errors: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def summary(self) -> dict[str, Any]:
        return {"embeddings": self.embeddings, "reranks": self.reranks, "errors": self.errors}


class StatelessPhase(Protocol):
    """What the clients record into (a soak phase's result): its counts, and a failure with faults off."""

    arch: str
    faults: bool
    stateless: StatelessCounts
    violations: list[str]


def _stateless_client(
    live: LiveServer, k: int, seed: int, stop: threading.Event, deadline: float, phase: StatelessPhase
) -> None:
    rng = random.Random(seed * 1000 + 500 + k)
    res, rank = phase.stateless, reranks(phase.arch)
    while not stop.is_set() and time.monotonic() < deadline:
        gen = live.generation
        rerank = rank and rng.random() < 0.4
        what = "rerank" if rerank else "embedding"
        try:
            if rerank:
                docs = [_text(rng, rng.randint(2, 12)) for _ in range(rng.randint(1, 3))]
                r = live.server.request("POST", "/rerank", {"query": _text(rng, 4), "documents": docs})
                ok = isinstance(r, dict) and len(r.get("results") or ()) == len(docs)
            else:
                prompt = [BOS_ID, *(BYTE_TOKEN_OFFSET + rng.randrange(250) for _ in range(rng.choice((16, 40, 60))))]
                r = live.server.request("POST", "/embeddings", {"content": prompt})
                ok = isinstance(r, list) and bool(r) and bool(r[0].get("embedding"))
        except RequestFailed as e:
            with res.lock:
                res.errors += 1
                if not phase.faults and not live.in_crash(gen):
                    phase.violations.append(f"{what} request failed with faults off: {e}")
            time.sleep(0.05)
            continue
        with res.lock:
            if not ok:
                phase.violations.append(f"{what} answer malformed: {str(r)[:120]}")
            res.reranks += rerank
            res.embeddings += not rerank


def stateless_clients(
    live: LiveServer, n: int, seed: int, stop: threading.Event, deadline: float, phase: StatelessPhase
) -> list[threading.Thread]:
    """``n`` started daemon threads sending embedding and rerank requests (embeddings only where
    :func:`reranks` says no) to ``live`` until ``stop`` or ``deadline``, counted in ``phase.stateless``; a failed
    request is a violation of ``phase`` with faults off, unless the server crashed under it (the soak reports
    that itself)."""
    threads = [
        threading.Thread(target=_stateless_client, args=(live, k, seed, stop, deadline, phase), daemon=True)
        for k in range(n)
    ]
    for t in threads:
        t.start()
    return threads


# ---- the mixed differential ------------------------------------------------------------------


@dataclass(frozen=True)
class Step:
    """One request: ``kind`` completion, embedding or rerank; ``tokens`` what reaches a slot (BOS first)."""

    kind: str
    tokens: tuple[int, ...]
    query: str = ""  # rerank: the query and the document the tokens were made from
    doc: str = ""


def mixed_program(seed: int, n: int, rank: bool = True) -> list[Step]:
    """``n`` requests: a third completions (>= 60 tokens), the rest embeddings and reranks (<= 50 tokens).

    The lengths keep the entries apart in the server's log (an entry is told by its token count: a
    completion's holds its prompt and all but its last generated token); a completion sometimes extends
    an earlier one, so cache loads happen too."""
    rng = random.Random(seed)
    out: list[Step] = []
    done: list[tuple[int, ...]] = []
    for i in range(n):
        r = rng.random()
        if r < 1 / 3:
            base = rng.choice(done) if done and rng.random() < 0.5 else (BOS_ID,)
            toks = (*base, *(BYTE_TOKEN_OFFSET + rng.randrange(250) for _ in range(rng.randint(60, 80))))[:200]
            done.append(toks)
            out.append(Step("completion", toks))
        elif r < 0.75 or not rank:
            n_tok = rng.randint(10, 48)
            out.append(Step(TASK_EMBEDDING, (BOS_ID, *(BYTE_TOKEN_OFFSET + rng.randrange(250) for _ in range(n_tok)))))
        else:
            query, doc = f"q{i} " + _text(rng, 2), _text(rng, rng.randint(1, 4))
            out.append(Step(TASK_RERANK, (BOS_ID, *tokens_of(query), *tokens_of(doc)), query, doc))
    return out


N_PREDICT = 3


@dataclass
class MixedResult:
    """A mixed run: the server's last logged cache entries ``(n_tokens, MiB)``, RSS, the completions' tokens."""

    entries: list[tuple[int, float]] = field(default_factory=list)
    generated: list[tuple[int, ...]] = field(default_factory=list)  # per completion step, in order
    rss_before: int = 0
    rss_after: int = 0
    errors: list[str] = field(default_factory=list)
    fresh_checked: int = 0  # stateless tasks whose log was held to stateless_fresh (:func:`fresh_problems`)
    fresh_problems: list[str] = field(default_factory=list)

    def stateless_entries(self, program: Sequence[Step]) -> list[tuple[int, float]]:
        lengths = {len(s.tokens) for s in program if s.kind != "completion"}
        return [e for e in self.entries if e[0] in lengths]


def cache_entries(log: str) -> list[tuple[int, float]]:
    """The entries ``(n_tokens, MiB)`` listed under the log's last ``cache state`` line."""
    at = max((m.end() for m in _STATE.finditer(log)), default=-1)
    if at < 0:
        return []
    out: list[tuple[int, float]] = []
    for line in log[at:].splitlines()[1:]:
        m = _ENTRY.search(line)
        if m is None:
            break
        out.append((int(m.group(1)), float(m.group(3))))
    return out


_RELEASED = "stop processing: n_tokens"
_NEW_PROMPT = re.compile(r"\| task \d+ \| new prompt, n_ctx_slot = \d+, n_keep = \d+, task\.n_tokens = (\d+)")
_CACHED = re.compile(r"\| task \d+ \| cached n_tokens = (\d+), memory_seq_rm")
_HELD = re.compile(r"\| task \d+ \| stop processing: n_tokens = (\d+)")


def fresh_problems(log: str, program: Sequence[Step]) -> tuple[int, list[str]]:
    """``stateless_fresh`` read from a ``-lv 4`` log of ``program`` sent one request at a time (each request is one
    task; its lines run from the previous task's release to its own): each embedding or rerank task took its slot
    without updating the prompt cache ("updating prompt cache", server-context.cpp:1624 at 0c1e570, is for
    completions only, :1620-1621), resumed from no cached prefix ("cached n_tokens = 0", :3423: ``n_past`` stays 0
    for a stateless task, :3196-3198), created no checkpoint (:2350) and left its slot holding its prompt alone
    (the release's ``n_tokens``, :518, equals the prompt's ``task.n_tokens``, :3126). The tasks checked and the
    problems; nothing is checked when the log does not show one release per request."""
    tasks: list[list[str]] = [[]]
    for line in log.splitlines():
        tasks[-1].append(line)
        if _RELEASED in line:
            tasks.append([])
    if len(tasks) - 1 != len(program):
        return 0, []
    checked, problems = 0, []
    for i, (step, lines) in enumerate(zip(program, tasks, strict=False)):
        if step.kind == "completion":
            continue
        checked += 1
        text = "\n".join(lines)
        what = f"step {i} ({step.kind} of {len(step.tokens)} tokens)"
        prompt = [int(n) for n in _NEW_PROMPT.findall(text)]
        cached = [int(n) for n in _CACHED.findall(text)]
        held = [int(n) for n in _HELD.findall(text)]
        if "updating prompt cache" in text:
            problems.append(f"{what}: the prompt cache was updated (the slot's prompt saved, an entry loaded) when it "
                            "took its slot; upstream updates it for completions only (server-context.cpp:1620)")
        if any(cached):
            problems.append(f"{what}: resumed from {max(cached)} cached tokens; a stateless task starts from none "
                            "(server-context.cpp:3196-3198)")  # fmt: skip
        if "created context checkpoint" in text:
            problems.append(f"{what}: created a context checkpoint; a stateless task leaves none")
        if prompt and held and held[-1] != prompt[-1]:
            problems.append(f"{what}: its slot held {held[-1]} tokens at release, its prompt {prompt[-1]}")
    return checked, problems


def mixed_run(server: ServerProcess, program: Sequence[Step]) -> MixedResult:
    """Send ``program`` one request at a time (each answered before the next) to a ``-lv 4`` server."""
    res = MixedResult(rss_before=rss_bytes(server.pid))
    for s in program:
        try:
            if s.kind == "completion":
                r = server.completion(list(s.tokens), N_PREDICT, ignore_eos=True, return_tokens=True)
                res.generated.append(tuple(int(x) for x in r.get("tokens") or ()))
            elif s.kind == TASK_EMBEDDING:
                server.request("POST", "/embeddings", {"content": list(s.tokens)})
            else:
                server.request("POST", "/rerank", {"query": s.query, "documents": [s.doc]})
        except RequestFailed as e:
            res.errors.append(f"{s.kind} of {len(s.tokens)} tokens: {e}")
    res.rss_after = rss_bytes(server.pid)
    log = server.log_through(len(program)) if server.log_path is not None else ""
    res.entries = cache_entries(log)
    if not res.errors:
        res.fresh_checked, res.fresh_problems = fresh_problems(log, program)
    return res


@dataclass(frozen=True)
class Prediction:
    """The model's cache after a mixed program: every entry's token count and those stateless tasks left
    (sorted), and the finding as :func:`properties.stateless.check_stateless_not_cached` counts it."""

    lengths: tuple[int, ...]
    stateless: tuple[int, ...]
    finding_entries: int
    finding_bytes: int


def predict(
    program: Sequence[Step],
    generated: Sequence[Sequence[int]],
    sem: str | Semantics = "shared",
    *,
    params: ServerParams | None = None,
    arch: str | None = None,
    n_ctx: int = 8192,
) -> Prediction:
    """The model's cache after ``program``, fed the server's completion tokens (``generated``): on the
    synthetic transformer (two slots, no byte limit, ``n_ctx`` tokens) unless ``arch`` names a fixtures
    model (then on its real libllama state, with ``params``)."""
    params = params or ServerParams(n_slots=2, cache_ram=-1)
    if arch is None:
        m = make_server(sem, "transformer", params=params, n_ctx=n_ctx)
    else:
        m = make_llama_server(sem, model_path(arch), params=params, n_ctx=n_ctx, check_restores=False)
    try:
        forced = iter(generated)
        for s in program:
            if s.kind == "completion":
                m.handle_completion(s.tokens, n_predict=N_PREDICT, forced=tuple(next(forced, ())))
            else:
                m.handle_stateless(s.tokens, s.kind)
            m.run_until_idle()
        completions = {s.tokens for s in program if s.kind == "completion"}
        stateless = {s.tokens for s in program if s.kind != "completion"} - completions
        found = check_stateless_not_cached(m, stateless)
        states = m.prompt_cache.states if m.prompt_cache is not None else []
        return Prediction(
            tuple(sorted(e.prompt.n_tokens() for e in states)),
            tuple(sorted(e.prompt.n_tokens() for e in states if e.prompt.tokens in stateless)),
            found.entries,
            found.nbytes,
        )
    finally:
        if arch is not None:
            close_server(m)


STATELESS_ENTRIES = "entries left by stateless tasks"


def mismatches(program: Sequence[Step], res: MixedResult, want: Prediction) -> list[str]:
    """Where the server's last cache block differs from the model's prediction (token counts of the entries)."""
    out = []
    got = tuple(sorted(n for n, _ in res.stateless_entries(program)))
    if got != want.stateless:
        out.append(f"{STATELESS_ENTRIES}: server {list(got)}, model {list(want.stateless)}")
    every = tuple(sorted(n for n, _ in res.entries))
    if every != want.lengths:
        out.append(f"cache entries: server {list(every)}, model {list(want.lengths)}")
    return out


def unexplained_outputs(fresh: ServerProcess, program: Sequence[Step], res: MixedResult, arch: str) -> list[str]:
    """Each completion of a mixed run against a fresh cache-less server: the differences that no batch-shape
    flip within the model's bound explains (:attr:`~harness.load.outputs.OutputDiff.batch_shape_flip`)."""
    out = []
    for s, gen in zip((s for s in program if s.kind == "completion"), res.generated, strict=False):
        diff = compare_output(fresh, s.tokens, gen, arch) if gen else None
        if diff is not None and not diff.batch_shape_flip:
            out.append(f"completion of {len(s.tokens)} tokens: {diff.describe()}")
    return out


@dataclass
class StatelessDiff:
    """The mixed differential on one configuration: figures and every problem (a mismatch with the model,
    a request error, an output no known finding explains)."""

    config: str
    requests: int = 0
    stateless_requests: int = 0
    stateless_entries: int = 0  # in the server's cache at the end of each run, summed
    stateless_mib: float = 0.0
    predicted_entries: int = 0  # the model's (the finding idle-stateless-slot-cached, as the check counts it)
    rss_growth: int = 0  # bytes, summed over the runs
    problems: list[str] = field(default_factory=list)
    fresh_checked: int = 0  # stateless tasks held to stateless_fresh in the server's log
    failed: str | None = None  # the first problem's property (stateless_not_cached, stateless_fresh, output, ...)
    failed_all: list[str] = field(default_factory=list)  # every property a problem was filed under, in order

    def fail(self, prop: str, problems: Sequence[str]) -> None:
        """File ``problems``, all of property ``prop``."""
        if problems:
            self.failed = self.failed or prop
            self.failed_all += [prop] if prop not in self.failed_all else []
        self.problems += problems

    def as_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items() if k != "problems"} | {"problems": self.problems[:20]}


def stateless_differential(
    cfg: ServerConfig, binary: Path, semantics: str | Semantics, seed: int, runs: int, *, n: int = 24,
    log_dir: str | None = None,
) -> StatelessDiff:  # fmt: skip
    """``runs`` mixed programs of ``n`` requests on ``cfg`` (plus ``--rerank``, ``-lv 4``; its
    ``cache_idle_slots`` says whether the idle-slot pass runs), each on a fresh server: its cache entries against
    the model's
    (``stateless_not_cached``: those the stateless tasks left; ``cache_entries``: all of them), each stateless
    task's lines of its log (``stateless_fresh``, :func:`fresh_problems`), its completions against a fresh
    cache-less server (``output``)."""
    out = StatelessDiff(cfg.name)
    args = [*cfg.server_args(), *server_args(cfg.arch)]
    # embeddings on: n_batch = n_ubatch (server.cpp:150-154); the model follows the tree's upstream changes
    params = replace(cfg.params(switches_of_binary(binary)), n_batch=cfg.n_ubatch)
    base = Launch(model=model_path(cfg.arch), ctx_size=cfg.n_ctx, ctx_checkpoints=cfg.ctx_checkpoints, args=args)
    fresh_log = None if log_dir is None else f"{log_dir}/{cfg.name}-stateless-fresh.log"
    with ServerProcess(binary, replace(base, n_parallel=1, cache_ram=0), log_path=fresh_log) as fresh:
        for i in range(runs):
            program = mixed_program(seed * 1000 + i, n, reranks(cfg.arch))
            log = None if log_dir is None else f"{log_dir}/{cfg.name}-stateless{i}.log"
            launch = replace(base, n_parallel=cfg.n_parallel, cache_ram=cfg.cache_ram_mib, kv_unified=cfg.kv_unified,
                             args=[*args, "-lv", "4"])  # fmt: skip
            with ServerProcess(binary, launch, log_path=log) as srv:
                res = mixed_run(srv, program)
            want = predict(program, res.generated, semantics, params=params, arch=cfg.arch, n_ctx=cfg.n_ctx)
            held = res.stateless_entries(program)
            out.requests += len(program)
            out.stateless_requests += sum(s.kind != "completion" for s in program)
            out.stateless_entries += len(held)
            out.stateless_mib += sum(mib for _, mib in held)
            out.predicted_entries += want.finding_entries
            out.rss_growth += res.rss_after - res.rss_before
            where = f"run {i} (seed {seed * 1000 + i}, log {log})"
            out.fail("request_error", [f"{where}: {p}" for p in res.errors])
            for p in mismatches(program, res, want):
                prop = "stateless_not_cached" if p.startswith(STATELESS_ENTRIES) else "cache_entries"
                out.fail(prop, [f"{where}: {p}"])
            out.fresh_checked += res.fresh_checked
            out.fail("stateless_fresh", [f"{where}: {p}" for p in res.fresh_problems])
            out.fail("output", [f"{where}: {p}" for p in unexplained_outputs(fresh, program, res, cfg.arch)])
    return out
