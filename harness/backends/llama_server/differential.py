"""The server backend's differential: a real ``llama-server`` against the reference model, request by request.

:class:`Differential` starts one ``llama-server`` (:class:`harness.targets.llama_server.ServerProcess`, on
127.0.0.1) and one reference model on real libllama contexts of the same tiny model with the same
parameters (:func:`harness.targets.libllama.make_llama_server`). Each completion request (token ids,
temperature 0, ``cache_prompt``, ``ignore_eos``, ``return_tokens``, plus what the binary's version needs,
:func:`harness.targets.llama_server.probe`) goes to the server first; the model is then fed the same
request with the tokens the server generated (``Task.forced``), picks its own slot, and predicts the slot,
``timings.cache_n`` (prompt tokens reused from the slot, a cache load or a checkpoint) and the evictions the
server logs, and the checkpoints the request created, (slot, ``n_tokens``) as the server's ``-lv 4`` log says it
created them (server-context.cpp:2349 at 0c1e570) against the model's ``create_checkpoint`` (``checkpoint_policy``),
and the slots its launch's idle-slot pass saved and cleared (:2421, :2429) against the model's (``idle_pass``).
Any difference is a mismatch, reported with the request sequence as a script that replays it.
A request the server answers with an HTTP error, drops, or never answers is a failure too
(:func:`request_failure`: ``http_error``, ``server_crash``, ``hang``), with the same replay.

* :func:`server_machine`: Hypothesis drives prompts that share, extend and diverge from what the
  slots and the cache hold, on all five models, unified and per-slot KV, and with a draft model;
  every generation is also compared with a fresh single-slot server without cache (:func:`check_output`).
* :func:`eviction` (``--cache-ram 1``, entries with shared checkpoints) and :func:`full_context`.

Size: ``server_machine`` is one Hypothesis machine class (its rules read the differential's state), built
inside the function that closes over its configuration, as :func:`harness.backends.llama_server.change.change_machine`.

Deviations: requests are sent one at a time (a request completes before the next), so the
server's slot scheduling is deterministic; child tasks (``n_cmpl``) are not used; a failing
example is not shrunk (each step is a real request), the full request sequence is printed instead.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from fixtures.gguf import draft_path, model_path, n_ctx_train
from harness.backends.llama_server.probe import ensure_form
from harness.errors import PropertyFailure
from harness.targets.libllama import close_server, make_llama_server
from harness.targets.llama_server import Launch, RequestFailed, ServerConfig, ServerProcess, unique_log
from harness.targets.server_log import CacheLog, LogProblem
from harness.trees.switches import switches_of_binary
from properties.reuse import ReuseTracer

__all__ = [
    "LIMIT_PROGRAMS",
    "NEAR_TIE_LOGPROB",
    "SERVER_PROFILES",
    "Differential",
    "MachineStats",
    "Program",
    "Row",
    "ServerMismatch",
    "check_output",
    "checkpoint_cap_program",
    "compare_with_fresh",
    "compare_with_reference",
    "eviction",
    "eviction_program",
    "fresh_launch",
    "full_context",
    "full_context_program",
    "launch_of",
    "load_threshold_program",
    "prompt_from",
    "request_failure",
    "request_rule",
    "run_program",
    "server_configs",
    "server_machine",
    "token_limit_program",
]


@dataclass
class Row:
    """One request and what the server and the model made of it."""

    tokens: tuple[int, ...]
    n_predict: int
    slot: int
    cache_n: int
    predicted_slot: int
    predicted_cache_n: int
    generated: tuple[int, ...]
    evictions: int = 0  # "removing oldest entry" lines in the server's log so far
    predicted_evictions: int = 0
    draft_n: int = 0  # tokens the server's draft model proposed (timings.draft_n)
    best_usable: int = -1  # the model's best usable source for this request (properties/reuse.py); -1 unknown
    reuse_finding: str | None = None  # the registered finding the model's shortfall is, if it fell short
    log_problems: tuple[LogProblem, ...] = ()  # what the server's own log showed broken (harness.targets.server_log)
    log_checked: dict[str, int] = field(default_factory=dict)  # the server-side checks so far, per property
    #: the checkpoints this request created, (slot, n_tokens) in order: the server's log's and the model's
    checkpoints: tuple[tuple[int, int], ...] = ()
    predicted_checkpoints: tuple[tuple[int, int], ...] = ()
    #: the slots the idle-slot pass took during this request, (slot, cleared): the server's log's and the model's
    idle: tuple[tuple[int, bool], ...] = ()
    predicted_idle: tuple[tuple[int, bool], ...] = ()

    def reuse_problem(self) -> str | None:
        """The ``reuse`` property on the server's answer: ``cache_n`` below the best usable source, unexplained."""
        if self.cache_n >= self.best_usable or self.reuse_finding is not None:
            return None
        return f"{self.describe()}: the best usable source held {self.best_usable} tokens"

    @property
    def ok(self) -> bool:
        return (self.slot, self.cache_n, self.evictions) == (
            self.predicted_slot,
            self.predicted_cache_n,
            self.predicted_evictions,
        )

    def describe(self) -> str:
        return (
            f"prompt of {len(self.tokens)} tokens (…{list(self.tokens[-4:])}): server slot {self.slot} cache_n "
            f"{self.cache_n} evictions {self.evictions}, model slot {self.predicted_slot} cache_n "
            f"{self.predicted_cache_n} evictions {self.predicted_evictions}"
        )


def launch_of(cfg: ServerConfig, *extra: str) -> Launch:
    """How a server of ``cfg`` is started: its fixture model (and the draft model), its slots, context, cache and
    checkpoints, ``cfg``'s own flags, then ``extra``."""
    return Launch(model=model_path(cfg.arch), draft=draft_path() if cfg.draft else None, n_parallel=cfg.n_parallel,
                  ctx_size=cfg.n_ctx, cache_ram=cfg.cache_ram_mib, ctx_checkpoints=cfg.ctx_checkpoints,
                  kv_unified=cfg.kv_unified, args=[*cfg.server_args(), *extra])  # fmt: skip


@dataclass
class Differential:
    """A live server and the reference model, fed the same requests."""

    cfg: ServerConfig
    binary: Path
    semantics: str = "shared"
    log_dir: str | None = None
    rows: list[Row] = field(default_factory=list)
    env: dict[str, str] = field(default_factory=dict)
    binary_expr: str = "build_server('shared')"  # only for the replay program: how to get the binary again
    _sent: int = field(default=0, init=False, repr=False)  # requests answered: the log's releases to wait for
    pending: tuple[tuple[int, ...], int] | None = field(default=None, init=False, repr=False)  # sent, unanswered
    reuse_counts: Counter[str] = field(default_factory=Counter)  # reuse findings: requests, "id:tokens" tokens
    checked: Counter[str] = field(default_factory=Counter)  # checkpoint_policy, idle_pass: the requests held to them
    _created: tuple[int, int] = field(default=(0, 0), init=False, repr=False)  # creations seen: server's, model's
    _idle: tuple[int, int] = field(default=(0, 0), init=False, repr=False)  # idle-pass slots seen: server's, model's

    def __post_init__(self) -> None:
        if self.cfg.log_verbosity is None:  # -lv 4: the cache's own trace lines, for the server-side properties
            self.cfg = dataclasses.replace(self.cfg, log_verbosity=4)
        self.cache_log = CacheLog(self.cfg.ctx_checkpoints)
        self.model_file = model_path(self.cfg.arch)
        self.server = ServerProcess(
            self.binary,
            launch_of(self.cfg),
            log_path=None if self.log_dir is None else unique_log(self.log_dir, self.cfg.name),
            env=self.env,
        )
        # the model follows the upstream changes the server's tree has (harness.trees.switches)
        params = self.cfg.params(switches_of_binary(self.binary))
        self.model = make_llama_server(
            self.semantics,
            self.model_file,
            draft_model=draft_path() if self.cfg.draft else None,
            params=params,
            n_ctx=self.cfg.n_ctx,
            check_restores=False,
        )
        # the reuse property on the model's side: the best usable source of each request, its finding if short
        self.reuse = ReuseTracer(self.model, self.reuse_counts, strict=False)

    def __enter__(self) -> Differential:
        ensure_form(self.binary)  # a replay program in a new process drives the version as its run did
        self.server.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.server.stop()
        finally:
            close_server(self.model)

    def request(self, tokens: Sequence[int], n_predict: int) -> Row:
        """Send one completion to the server, then feed it to the model. A request the server answers
        with an error, or not at all, raises :class:`ServerMismatch` (its program ends with that request)."""
        toks = tuple(int(t) for t in tokens)
        try:
            answer = self.answer(toks, n_predict)
        except RequestFailed as e:
            raise request_failure(e, self) from None
        return self.record(toks, n_predict, answer)

    def answer(self, toks: tuple[int, ...], n_predict: int) -> Any:
        """The server's answer to one completion (kept as :attr:`pending` until :meth:`record`)."""
        self.pending = (toks, n_predict)
        return self.server.completion(list(toks), n_predict, ignore_eos=True, return_tokens=True)

    def record(self, toks: tuple[int, ...], n_predict: int, answer: Any) -> Row:
        """Feed an answered request to the model and keep the row: the server's slot, ``cache_n`` and
        evictions (from its log) against the model's prediction."""
        self.pending = None
        slot = int(answer["id_slot"])
        cache_n = int(answer["timings"]["cache_n"])
        generated = tuple(int(t) for t in answer.get("tokens") or ())
        res = self.model.handle_completion(toks, n_predict=n_predict, forced=generated)
        self.model.run_until_idle()
        predicted_slot = res.slot
        predicted = self.model.slots[predicted_slot].n_prompt_cached if predicted_slot >= 0 else -1
        self._sent += 1
        log = self.server.log_through(self._sent)  # written by a worker thread: wait for this release
        cache = self.model.prompt_cache
        problems = tuple(self.cache_log.feed(log))
        server_made, model_made = self.cache_log.created, self.model.created
        made = (tuple(server_made[self._created[0] :]), tuple(model_made[self._created[1] :]))
        self._created = (len(server_made), len(model_made))
        server_idle, model_idle = self.cache_log.idle, self.model.idle_passed
        idle = (tuple(server_idle[self._idle[0] :]), tuple(model_idle[self._idle[1] :]))
        self._idle = (len(server_idle), len(model_idle))
        row = Row(
            toks,
            n_predict,
            slot,
            cache_n,
            predicted_slot,
            predicted,
            generated,
            log.count("removing oldest entry"),
            cache.evictions if cache is not None else 0,
            int(answer["timings"].get("draft_n", 0)),
            self.reuse.best_of.get(res.task, -1),
            self.reuse.finding_of.get(res.task),
            problems,
            dict(self.cache_log.checked + self.checked),
            *made,
            *idle,
        )
        self.rows.append(row)
        return row

    def check(self, row: Row) -> str:
        """``row`` held to what every request is: ``cache_n`` at least the best usable source the model saw (``reuse``,
        :meth:`Row.reuse_problem`: a server that resumes from less fails it before it fails the agreement), the
        model's slot, ``cache_n`` and evictions (``cache_n``), its checkpoints and idle-slot pass; a failure raises
        :class:`ServerMismatch` with the program so far. The program calls it on each row it replays, so a
        pasted program fails where the run did (it printed ``cache_n 517 = 517`` and passed before). What the
        server's own log shows broken (:mod:`harness.targets.server_log`) comes first: it needs no model."""
        if row.log_problems:
            first = row.log_problems[0]
            raise ServerMismatch(first.property, f"the server's log: {first.message}", self.program())
        if (problem := row.reuse_problem()) is not None:  # the property before the agreement: it needs no policy
            raise ServerMismatch("reuse", problem, self.program())
        self.checked["reuse"] += row.best_usable >= 0  # a request whose best usable source the model knew
        if not row.ok:
            raise ServerMismatch("cache_n", row.describe(), self.program())
        if row.checkpoints != row.predicted_checkpoints:
            raise ServerMismatch("checkpoint_policy", f"{row.describe()}: the server created checkpoints (slot, "
                                 f"n_tokens) {list(row.checkpoints)}, the model's create_checkpoint "
                                 f"{list(row.predicted_checkpoints)}", self.program())  # fmt: skip
        self.checked["checkpoint_policy"] += bool(row.checkpoints)  # a request that created some (held equal)
        if row.idle != row.predicted_idle:
            raise ServerMismatch("idle_pass", f"{row.describe()}: the idle-slot pass took (slot, cleared) "
                                 f"{list(row.idle)} on the server, {list(row.predicted_idle)} in the model",
                                 self.program())  # fmt: skip
        self.checked["idle_pass"] += bool(row.idle)  # a request whose launch passed over idle slots (held equal)
        return row.describe()

    def compare_output(self, fresh: ServerProcess, row: Row) -> str:
        """``row``'s generated tokens against ``fresh``'s (:func:`check_output`): a difference beyond a near tie
        raises :class:`ServerMismatch`, ``restore_equivalence`` for a row served partly from the cache and ``output``
        otherwise, with the program that replays it against a fresh server too; else what was compared, a line."""
        problem = check_output(fresh, row)
        if problem is not None and problem != "near-tie":
            raise ServerMismatch("restore_equivalence" if row.cache_n > 0 else "output", problem,
                                 self.program(fresh=True))  # fmt: skip
        return f"{row.describe()}; output {'a near tie flipped' if problem else 'as a fresh server'}"

    def program(self, *, fresh: bool = False) -> str:
        """The request sequence so far (the one that failed last, if one did), as a script that replays it
        against the same configuration, each row checked (:meth:`check`); with ``fresh``, each answer also held to
        a fresh cache-less server's (:meth:`compare_output`), as the machine that failed on an output did."""
        lines = [
            "from pathlib import Path",
            "from harness.trees.build import build_server, build_source",
            "from harness.backends.llama_server.differential import Differential"
            + (", fresh_launch" if fresh else ""),
            "from harness.targets.llama_server import ServerConfig" + (", ServerProcess" if fresh else ""),
            f"with Differential({self.cfg!r}, {self.binary_expr}, {self.semantics!r}) as d"
            + (", ServerProcess(d.binary, fresh_launch(d.cfg)) as fresh:" if fresh else ":"),
        ]
        sent = [(row.tokens, row.n_predict) for row in self.rows]
        if self.pending is not None:
            sent.append(self.pending)
        for toks, n in sent:
            if fresh:
                lines += [f"    row = d.request({list(toks)!r}, {n})", "    print(d.check(row))",
                          "    print(d.compare_output(fresh, row))"]  # fmt: skip
            else:
                lines.append(f"    print(d.check(d.request({list(toks)!r}, {n})))")
        return "\n".join(lines)


def request_failure(e: RequestFailed, d: Differential) -> ServerMismatch:
    """A request the server did not answer usably, as the failure it is: the server died (``server_crash``,
    a crash: exit 3), did not answer in time (``hang``) or answered an error (``http_error``); the program
    replays the requests up to that one."""
    toks, n = d.pending or ((), 0)
    what = f"request #{len(d.rows) + 1} (a prompt of {len(toks)} tokens, n_predict {n}): {e.describe()}"
    if not e.alive:
        return ServerMismatch("server_crash", what, d.program(), kind="crash")
    if e.kind == "timeout":
        return ServerMismatch("hang", what, d.program())
    return ServerMismatch("http_error", what, d.program())


NEAR_TIE_LOGPROB = 0.02  # greedy choices closer than this flip with the cache path's rounding


def check_output(fresh: ServerProcess, row: Row) -> str | None:
    """Compare a completion with a fresh server's; None if equal, "near-tie", or what differs.

    A prompt served partly from a slot, a cache entry or a checkpoint is evaluated in other batch
    shapes and cell layouts than from scratch, which moves logits in the last bits (the finding
    ``kv-layout-dependent-logits`` and its batch-shape twin). Where the fresh server's two best
    tokens are within :data:`NEAR_TIE_LOGPROB` and the cached path took the second, the greedy
    choice flipped on a tie: ``"near-tie"`` (the known finding ``greedy-flip-on-cache-path``).
    """
    return compare_with_fresh(fresh, row.tokens, row.n_predict, row.generated, row.describe())


def compare_with_fresh(fresh: ServerProcess, tokens: tuple[int, ...], n_predict: int, generated: tuple[int, ...],
                       what: str) -> str | None:  # fmt: skip
    """:func:`check_output` on plain values (no model's row): ``generated`` is what the server under test answered
    ``tokens``; ``what`` names the request in the message."""
    return compare_with_reference(fresh.fresh_completion(tokens, n_predict), generated, what)


def compare_with_reference(r: Any, generated: tuple[int, ...], what: str) -> str | None:
    """``generated`` against a fresh server's answer ``r`` (``ServerProcess.fresh_completion``: its probabilities
    among the tokens it could sample): None when equal, "near-tie" when the first difference is the fresh server's
    runner-up within :data:`NEAR_TIE_LOGPROB`, else the difference."""
    want = tuple(int(t) for t in r.get("tokens") or ())
    if want == generated:
        return None
    i = next((k for k, (a, b) in enumerate(zip(want, generated, strict=False)) if a != b), None)
    probs = r.get("completion_probabilities") or []
    # the server withholds the entries of tokens that end inside a UTF-8 sequence: align by id
    ids = [int(p["id"]) for p in probs]
    offset = next((o for o in range(len(want) - len(ids) + 1) if list(want[o : o + len(ids)]) == ids), None)
    if i is not None and offset is not None and 0 <= i - offset < len(probs):
        top = probs[i - offset].get("top_logprobs") or []
        if len(top) >= 2 and int(top[1]["id"]) == generated[i]:
            gap = float(top[0]["logprob"]) - float(top[1]["logprob"])
            if gap < NEAR_TIE_LOGPROB:
                return "near-tie"
    return f"{what}: generated {list(generated)}, a fresh server generates {list(want)}"


def fresh_launch(cfg: ServerConfig) -> Launch:
    """The reference server of ``cfg``: its model, context and flags, one slot and no prompt cache, so every answer
    is computed from scratch (``cache_prompt`` off on each request as well)."""
    return Launch(model=model_path(cfg.arch), n_parallel=1, ctx_size=cfg.n_ctx, cache_ram=0,
                  ctx_checkpoints=cfg.ctx_checkpoints, args=cfg.server_args())  # fmt: skip


class ServerMismatch(PropertyFailure):
    """The server and the model disagree, or the server failed a request; ``name`` is the property,
    ``program`` replays it, ``kind`` is ``violation`` or ``crash`` (the server died).

    Paste ``program`` into ``python`` from the repository root to replay it on a fresh server; a difference
    that is upstream's is registered in :mod:`harness.findings` (the differential then counts it), any other
    is a bug of the server or of the model."""

    def __init__(self, name: str, message: str, program: str, kind: str = "violation") -> None:
        super().__init__(name, message)
        self.program = program
        self.kind = kind


@dataclass
class MachineStats:
    requests: int = 0
    cache_hits: int = 0  # cache_n > 0
    output_checks: int = 0
    restore_checks: int = 0  # output checks of a request served partly from the cache (restore_equivalence)
    evictions: int = 0  # predicted by the model and seen in the server's log, request by request
    cache_loads: int = 0
    near_tie_flips: int = 0  # the known finding greedy-flip-on-cache-path
    drafted: int = 0  # draft tokens the server proposed (speculative configurations)
    log_checks: Counter[str] = field(default_factory=Counter)  # the server-side properties checked on its log


def request_rule(f: Callable[..., None]) -> Callable[..., None]:
    """The request rule's arguments, shared by the differential and the change differential (the same
    programs): which base, how much of it (24ths), how many new tokens, their seed, ``n_predict``."""
    decorated: Callable[..., None] = rule(
        source=st.integers(0, 7),
        keep=st.integers(0, 24),
        n_new=st.sampled_from([0, 1, 8, 40, 120, 300, 700]),
        seed=st.integers(0, 255),
        n_predict=st.integers(1, 6),
    )(f)
    return decorated


def prompt_from(bases: Sequence[tuple[int, ...]], cfg: ServerConfig, source: int, keep: int, n_new: int,
                seed: int) -> tuple[int, ...]:  # fmt: skip
    """0-100 % (``keep`` 24ths) of the ``source``-th base, then ``n_new`` new tokens; fitted to a slot's context, which
    the server caps at the model's trained context (1024 for every fixture model but ``mamba-big``)."""
    base = bases[source % len(bases)] if bases else ()
    head = base[: len(base) * keep // 24]
    new = tuple(3 + (seed * 31 + i * 17) % 256 for i in range(n_new))
    return (head + new)[-(min(cfg.n_ctx // cfg.n_parallel, n_ctx_train(cfg.arch)) - 16) :] or (1,)


def server_machine(
    cfg: ServerConfig,
    binary: Path,
    semantics: str,
    stats: MachineStats,
    log_dir: str | None,
    binary_expr: str = "build_server('shared')",
) -> type:
    """A Hypothesis state machine class driving ``cfg`` on ``binary`` against the model in ``semantics``."""

    class ServerMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.d = Differential(cfg, binary, semantics, log_dir, binary_expr=binary_expr)
            self.d.__enter__()
            fresh_log = None if log_dir is None else unique_log(log_dir, f"{cfg.name}-fresh")
            self.fresh = ServerProcess(binary, fresh_launch(cfg), log_path=fresh_log)
            self.fresh.start()
            self.sent: list[tuple[int, ...]] = []

        def teardown(self) -> None:
            cache = self.d.model.prompt_cache
            if cache is not None:
                stats.evictions += cache.evictions
                stats.cache_loads += cache.loads
            stats.log_checks.update(self.d.cache_log.checked + self.d.checked)
            try:
                self.fresh.stop()
            finally:
                self.d.close()

        def _bases(self) -> list[tuple[int, ...]]:
            m = self.d.model
            out = [s.prompt.tokens for s in m.slots]
            if m.prompt_cache is not None:
                out += [e.prompt.tokens for e in m.prompt_cache.states]
            return out + self.sent

        @request_rule
        def request(self, source: int, keep: int, n_new: int, seed: int, n_predict: int) -> None:
            """A prompt: 0-100 % (in 24ths) of a slot's, a cache entry's or an earlier prompt, then new tokens."""
            tokens = prompt_from(self._bases(), cfg, source, keep, n_new, seed)
            row = self.d.request(tokens, n_predict)
            self.sent.append(tokens)
            stats.requests += 1
            stats.cache_hits += row.cache_n > 0
            stats.drafted += row.draft_n
            self.d.check(row)
            try:
                said = self.d.compare_output(self.fresh, row)  # a difference beyond a near tie raises
            except RequestFailed as e:
                kind = "crash" if not e.alive else "violation"
                raise ServerMismatch("http_error" if e.alive else "server_crash",
                                     f"the fresh reference server, asked {row.describe()}: {e}", self.d.program(),
                                     kind) from None  # fmt: skip
            stats.output_checks += 1
            stats.restore_checks += row.cache_n > 0  # served partly from the slot, a cache entry or a checkpoint
            stats.near_tie_flips += said.endswith("a near tie flipped")

        @precondition(lambda self: len(self.sent) > 0)
        @rule(i=st.integers(0, 50))
        def repeat(self, i: int) -> None:
            """Send an earlier prompt again (a cache hit or a slot hit)."""
            tokens = self.sent[i % len(self.sent)]
            row = self.d.request(tokens, 2)
            stats.requests += 1
            stats.cache_hits += row.cache_n > 0
            self.d.check(row)

    ServerMachine.__name__ = f"Server_{cfg.name.replace('-', '_')}"
    return ServerMachine


SERVER_PROFILES: dict[str, dict[str, int]] = {
    "ci": {"max_examples": 12, "steps": 10},
    "fuzz": {"max_examples": 100, "steps": 25},
}


def server_configs() -> list[ServerConfig]:
    """The differential's configurations: every memory kind, unified and per-slot KV."""
    return [
        ServerConfig("llama"),
        ServerConfig("jamba", kv_unified=True),
        ServerConfig("mamba"),
        ServerConfig("lfm2", kv_unified=True),
        ServerConfig("gemma2"),
        # speculative: target + draft restored together from the cache and from checkpoints
        ServerConfig("llama", draft=True),
        ServerConfig("jamba", draft=True, kv_unified=True),
    ]


Program = list[tuple[tuple[int, ...], int]]
"""A request program: (prompt token ids, n_predict) per request, in order."""


def full_context_program() -> tuple[ServerConfig, Program]:
    """One slot at the model's full context (1024): a prompt that fills it, reused, then diverging."""
    cfg = ServerConfig("jamba", n_parallel=1, n_ctx=1024, cache_ram_mib=8)
    a = tuple(3 + (i * 7) % 250 for i in range(1016))
    b = tuple(3 + (i * 5) % 250 for i in range(900))
    return cfg, [(toks, 2) for toks in (a, (*a[:1000], 9, 9, 9, 9, 9, 9), b, a[:1010])]


def eviction_program() -> tuple[ServerConfig, Program]:
    """Evictions under --cache-ram 1 with checkpoint storage shared between slots and entries (jamba).

    Eight distinct 900-token prompts through two slots overflow the 1 MiB cache several times;
    then the first and the last ones come back (an evicted entry: a miss; a surviving one: a
    load with its checkpoints)."""
    cfg = ServerConfig("jamba", cache_ram_mib=1, ctx_checkpoints=4)
    prompts = [tuple(3 + (k * 29 + i * 7) % 250 for i in range(900)) for k in range(8)]
    tail = ((*prompts[0], 9, 9), (*prompts[-1], 9, 9), (*prompts[-3], *(8,) * 10))
    return cfg, [(toks, 2) for toks in (*prompts, *tail)]


def checkpoint_cap_program() -> tuple[ServerConfig, Program]:
    """One slot, ``--ctx-checkpoints 2``: a prompt growing by 300 tokens a request, so the slot's checkpoint list
    is full at every request after the second and each new checkpoint must first erase the oldest."""
    cfg = ServerConfig("jamba", n_parallel=1, cache_ram_mib=8, ctx_checkpoints=2)
    p = tuple(3 + (i * 7) % 250 for i in range(900))
    return cfg, [(p[:300], 2), (p[:600], 2), (p, 2), ((*p, *(7,) * 100), 2)]


def token_limit_program() -> tuple[ServerConfig, Program]:
    """No byte limit (``--cache-ram -1``), so the cache's token limit (the server's ``n_ctx``, 1024) is the one that
    binds: four distinct 900-token prompts through one slot, then the first again (evicted by then)."""
    cfg = ServerConfig("llama", n_parallel=1, cache_ram_mib=-1, n_ctx=1024)
    prompts = [tuple(3 + (k * 29 + i * 7) % 250 for i in range(900)) for k in range(4)]
    return cfg, [(toks, 2) for toks in (*prompts, prompts[0])]


def load_threshold_program() -> tuple[ServerConfig, Program]:
    """One slot: A, then B (A is saved), then A's first 226 of 901 tokens and new ones: the entry's ``f_keep``
    is 0.2508, just above the 0.25 below which upstream's ``load`` skips an entry (server-task.cpp:1812)."""
    cfg = ServerConfig("jamba", n_parallel=1, cache_ram_mib=8)
    a = tuple(3 + (i * 7) % 250 for i in range(900))
    b = tuple(3 + (i * 11) % 250 for i in range(900))
    return cfg, [(a, 2), (b, 2), ((*a[:226], *(5,) * 300), 2)]


def prefix_entry_program() -> tuple[ServerConfig, Program]:
    """One slot, one generated token a request (a saved entry is then exactly its prompt): Y (1000 tokens) is saved,
    X (Y's first 200) is processed afresh (Y's f_keep 0.2 is below load's 0.25), and when the slot moves on X is
    not saved, being a prefix of Y (server-task.cpp:1713); a request starting with X then scans the cache, whose
    entries' lengths and common prefixes show any entry that is a prefix of another (``no_prefix_entries``)."""
    cfg = ServerConfig("llama", n_parallel=1, cache_ram_mib=8, n_ctx=2048)
    y = tuple(3 + (i * 7) % 250 for i in range(1000))
    u = tuple(3 + (i * 11 + 5) % 250 for i in range(300))
    v = tuple(3 + (i * 13 + 9) % 250 for i in range(300))
    return cfg, [(y, 1), (u, 1), (y[:200], 1), (v, 1), ((*y[:200], *(9,) * 100), 1)]


def cleared_slot_program() -> tuple[ServerConfig, Program]:
    """Two slots under a unified KV: when a request starts, the other, idle slot is saved to the cache and cleared
    ([TAG_IDLE_SLOT_CLEAR], server-context.cpp:2427), so each new unrelated prompt lands on a slot cleared while it
    held checkpoints; that slot's next checkpoint event must be the creation of its checkpoint 1
    (``cleared_checkpoints``); the last request loads A's entry back with its checkpoints."""
    cfg = ServerConfig("jamba", n_parallel=2, kv_unified=True, cache_ram_mib=8)
    a, b, c = (tuple(3 + (k * 31 + i * 7) % 250 for i in range(600)) for k in range(3))
    return cfg, [(a, 2), (b, 2), (c, 2), (a[:500], 2)]


LIMIT_PROGRAMS: dict[str, Callable[[], tuple[ServerConfig, Program]]] = {
    "eviction": eviction_program,
    "full-context": full_context_program,
    "checkpoint-cap": checkpoint_cap_program,
    "token-limit": token_limit_program,
    "load-threshold": load_threshold_program,
    "prefix-entry": prefix_entry_program,
    "cleared-slot": cleared_slot_program,
}
"""The fixed programs the gate runs besides the machines, each at one of the cache's limits (by name)."""


def run_program(cfg: ServerConfig, program: Program, binary: Path, semantics: str, log_dir: str | None) -> list[Row]:
    """``program`` through a :class:`Differential`; the model must predict every slot, ``cache_n`` and eviction."""
    with Differential(cfg, binary, semantics, log_dir) as d:
        for toks, n in program:
            d.check(d.request(toks, n))
        return d.rows


def full_context(binary: Path, semantics: str, log_dir: str | None) -> list[Row]:
    """:func:`full_context_program` on ``binary`` against the model."""
    return run_program(*full_context_program(), binary, semantics, log_dir)


def eviction(binary: Path, semantics: str, log_dir: str | None) -> list[Row]:
    """:func:`eviction_program` on ``binary`` against the model."""
    return run_program(*eviction_program(), binary, semantics, log_dir)
