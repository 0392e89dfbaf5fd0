"""The server gate's drawn configurations: Hypothesis draws the server's flags as well as its requests, so every
limit of the prompt cache binds somewhere, and the server's own log is held to its properties at each step.

:func:`limits_machine` draws one :class:`~harness.targets.llama_server.ServerConfig` per example (any of the five
fixture models; 1 to 4 slots; unified KV or not; a draft model on the two that have one; ``--cache-ram`` -1 (the
token limit binds), 1, 2, 4 or 8 MiB; ``--ctx-checkpoints`` 1 to 32; ``-cms`` 0 to 256; ``-c`` 512 or 1024),
starts that server at ``-lv 4`` and sends prompts that share, extend and diverge from earlier ones, and erases
slots (``POST /slots/N?action=erase``, a slot cleared while it may hold checkpoints), and once an example sends the
context's boundary (:meth:`LimitRun.boundary`: a prompt of the slot's ``n_ctx`` tokens, which the server refuses, and
one of ``n_ctx - 1``, which it answers: ``slot_within_ctx``; under a unified KV that prompt fills the cells other
slots hold). After every step the log's
new lines are checked (:class:`~harness.targets.server_log.CacheLog`: ``limit``, ``accounting``,
``checkpoint_lists``, ``load_choice``, ``alloc_eviction``); no model is asked, so a configuration the reference
model does not cover is still held to what the server itself shows. With ``fresh`` (as the gate runs it) every
answer served partly from the cache is also held to a fresh server's
(``restore_equivalence``, :func:`~harness.backends.llama_server.differential.compare_with_reference`).
A failure prints the configuration and the
steps as a program (:meth:`LimitRun.program`) that replays them on a fresh server; the gate first shrinks them
(:func:`shrink_steps`: delta debugging over the steps on fresh servers, then ``n_predict`` cut to 1).

Deviations: a server is started per example, never reused across examples even where the configuration is the
same: no request empties a server's prompt cache (``/slots?action=erase`` clears a slot, not the cache), so a reused
server would carry one example's entries into the next, and an example would no longer replay alone (a start costs
about 0.2 s on the fixture models: the drawn configurations take seconds). Requests are sent one at a time; a
drawn ``--cache-ram`` is at least 1 MiB, the granularity of the flag, so an entry alone above the limit
needs a state above 1 MiB (the fixture models' are a few hundred KiB: that case is in the memory checks instead).
"""

from __future__ import annotations

import tempfile
import time
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from fixtures.gguf import ARCHS
from harness.backends.llama_server.differential import (
    ServerMismatch,
    compare_with_reference,
    fresh_launch,
    launch_of,
    prompt_from,
    request_rule,
)
from harness.backends.llama_server.probe import ensure_form
from harness.errors import ServerStartError
from harness.targets.llama_server import RequestFailed, ServerConfig, ServerProcess, unique_log
from harness.targets.server_log import CacheLog

__all__ = [
    "Action",
    "LimitRun",
    "LimitStats",
    "configs",
    "failed_load_program",
    "limits_machine",
    "run_limit_program",
    "shrink_steps",
]

Action = tuple[str, tuple[Any, ...]]
"""One step of a :class:`LimitRun` as a call: ``("request", (tokens, n_predict))``, ``("erase", (slot,))`` or
``("boundary", (tokens,))``."""

_DRAFTABLE = ("llama", "jamba")  # the fixture models the draft model can serve (the differential's)


@st.composite
def configs(draw: st.DrawFn) -> ServerConfig:
    """A server configuration at some limit of the cache: small caches and contexts, few or many checkpoints."""
    arch = draw(st.sampled_from(ARCHS))
    return ServerConfig(
        arch,
        n_parallel=draw(st.integers(1, 4)),
        kv_unified=draw(st.booleans()),
        cache_ram_mib=draw(st.sampled_from([-1, -1, 1, 2, 8])),  # -1 twice: the token limit binds only there
        ctx_checkpoints=draw(st.one_of(st.integers(1, 3), st.integers(4, 32))),  # a full list half the time
        checkpoint_min_step=draw(st.sampled_from([0, 16, 64, 256])),
        n_ctx=draw(st.sampled_from([512, 1024])),  # within every fixture model's trained context (jamba: 1024)
        draft=arch in _DRAFTABLE and draw(st.booleans()),
        log_verbosity=4,
    )


@dataclass
class LimitStats:
    examples: int = 0
    requests: int = 0
    erases: int = 0
    boundaries: int = 0  # examples that sent the context's edge (LimitRun.boundary)
    configs: list[str] = field(default_factory=list)
    checked: Counter[str] = field(default_factory=Counter)
    last: LimitRun | None = None  # the latest example's run: the failing one when the machine fails
    near_ties: int = 0  # cached answers a greedy tie flipped (the known finding greedy-flip-on-cache-path)


class LimitRun:
    """One server of a drawn configuration and its log's checks; every step is kept for the replay program."""

    def __init__(self, cfg: ServerConfig, binary: Path, log_dir: str | None = None,
                 binary_expr: str = "build_server('shared')", *, fresh: bool = False) -> None:  # fmt: skip
        self.cfg = replace(cfg, log_verbosity=4)
        self.binary, self.binary_expr = binary, binary_expr
        self.steps: list[str] = []
        self.actions: list[Action] = []  # the steps as calls, for :func:`shrink`
        self.log = CacheLog(self.cfg.ctx_checkpoints)
        self.checked: Counter[str] = Counter()  # slot_within_ctx; restore_equivalence, with ``fresh``
        self.slot_ctx = 0  # the slots' n_ctx as the server reports it (GET /slots), once started
        self.near_ties = 0
        self.released = 0
        self._slots = tempfile.TemporaryDirectory(prefix="harness-limits-slots-")
        self.server = ServerProcess(
            binary,
            launch_of(self.cfg, "--slot-save-path", self._slots.name),  # the slot actions need it
            log_path=None if log_dir is None else unique_log(log_dir, f"limits-{self.cfg.name}"),
        )
        self.fresh = None if not fresh else ServerProcess(
            binary, fresh_launch(self.cfg),
            log_path=None if log_dir is None else unique_log(log_dir, f"limits-{self.cfg.name}-fresh"),
        )  # fmt: skip

    def __enter__(self) -> LimitRun:
        try:
            ensure_form(self.binary)  # a replay program in a new process drives the version as its run did
            self.server.start()
            if self.fresh is not None:
                self.fresh.start()
            # 0 where the server does not say: slot_within_ctx is then not checked, and the context's edge not sent
            self.slot_ctx = self.server.slot_n_ctx()
        except BaseException:
            self.__exit__()  # a server that did not start leaves nothing behind either
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.server.stop()
            if self.fresh is not None:
                self.fresh.stop()
        finally:
            self._slots.cleanup()

    def request(self, tokens: tuple[int, ...], n_predict: int) -> Any:
        """One completion; then the log's new lines are checked (a problem raises :class:`ServerMismatch`)."""
        self.steps.append(f"r.request({list(tokens)!r}, {n_predict})")
        self.actions.append(("request", (tokens, n_predict)))
        return self._complete(tokens, n_predict)

    def _complete(self, tokens: tuple[int, ...], n_predict: int) -> Any:
        """One completion, the log's lines up to its release and, for an answer served partly from the cache, the
        fresh server's answer: the server I/O of a step, then its checks (the log, the context, the equivalence)."""
        try:
            answer = self.server.completion(list(tokens), n_predict, ignore_eos=True, return_tokens=True)
        except RequestFailed as e:
            self._failed(e)
        self.released += 1
        text = self.server.logged(self.released)
        reference = None
        if self.fresh is not None and int(answer["timings"]["cache_n"]) > 0:
            try:
                reference = self.fresh.fresh_completion(tokens, n_predict)
            except RequestFailed as e:
                self._fresh_failed(e, tokens, answer)
        self.check(text)
        self._within_ctx(tokens, answer)
        if reference is not None:
            self._equivalent(tokens, answer, reference)
        return answer

    def _within_ctx(self, tokens: tuple[int, ...], answer: Any) -> None:
        """``slot_within_ctx`` on an answer: its prompt and the tokens it generated fit the slot's ``n_ctx``."""
        if not self.slot_ctx:
            return
        held = len(tokens) + len(answer.get("tokens") or ())
        self.checked["slot_within_ctx"] += 1
        if len(tokens) >= self.slot_ctx or held > self.slot_ctx:
            raise ServerMismatch("slot_within_ctx", f"step {len(self.steps)}: a prompt of {len(tokens)} tokens was "
                                 f"answered with {held - len(tokens)} more on slot {answer['id_slot']}, whose n_ctx is "
                                 f"{self.slot_ctx}", self.program())  # fmt: skip

    def boundary(self, tokens: tuple[int, ...]) -> None:
        """``slot_within_ctx`` at the context's edge: ``tokens`` (at least ``n_ctx``) cut to the slot's ``n_ctx`` are
        refused (HTTP 400, "exceeds the available context size", server-context.cpp:3186 at 0c1e570: the slot is
        taken, and may have loaded from the cache, before it refuses), and the first ``n_ctx - 1`` are answered (one
        token: the slot then holds exactly ``n_ctx``); the log is checked after each."""
        over = tokens[: self.slot_ctx]
        self.steps.append(f"r.boundary({list(over)!r})")
        self.actions.append(("boundary", (over,)))
        try:
            answer = self.server.completion(list(over), 1, ignore_eos=True, return_tokens=True)
        except RequestFailed as e:
            if not (e.alive and e.status == 400 and "exceeds the available context size" in (e.message or "")):
                self._failed(e)
            self.released += 1  # the refusal releases the slot (server_slot::release logs it)
            text = self.server.logged(self.released)
        else:
            said = (f"step {len(self.steps)}: a prompt of {len(over)} tokens, the slot's n_ctx, was answered (slot "
                    f"{answer['id_slot']}, cache_n {answer['timings']['cache_n']}): the server refuses a prompt of "
                    "n_ctx tokens or more")  # fmt: skip
            raise ServerMismatch("slot_within_ctx", said, self.program())
        self.checked["slot_within_ctx"] += 1
        self.check(text)
        self._complete(over[:-1], 1)

    def _what(self, tokens: tuple[int, ...], answer: Any) -> str:
        return (f"step {len(self.steps)}: prompt of {len(tokens)} tokens (…{list(tokens[-4:])}) on slot "
                f"{answer['id_slot']}, cache_n {answer['timings']['cache_n']}")  # fmt: skip

    def _fresh_failed(self, e: RequestFailed, tokens: tuple[int, ...], answer: Any) -> NoReturn:
        said = f"the fresh reference server, asked {self._what(tokens, answer)}: {e.describe()}"
        raise ServerMismatch("http_error" if e.alive else "server_crash", said, self.program(),
                             "violation" if e.alive else "crash") from None  # fmt: skip

    def _equivalent(self, tokens: tuple[int, ...], answer: Any, reference: Any) -> None:
        """``restore_equivalence``: an answer served partly from the cache equals the fresh server's ``reference``
        (a greedy tie flipped is the known finding, counted)."""
        generated = tuple(int(t) for t in answer.get("tokens") or ())
        problem = compare_with_reference(reference, generated, self._what(tokens, answer))
        self.checked["restore_equivalence"] += 1
        if problem == "near-tie":
            self.near_ties += 1
        elif problem is not None:
            raise ServerMismatch("restore_equivalence", problem, self.program())

    def erase(self, slot: int) -> None:
        """Clear slot ``slot`` (``POST /slots/N?action=erase``), then check the log."""
        self.steps.append(f"r.erase({slot})")
        self.actions.append(("erase", (slot,)))
        try:
            self.server.request("POST", f"/slots/{slot}?action=erase", {})
            text = self.server.logged(self.released)
        except RequestFailed as e:
            self._failed(e)
        self.check(text)

    def check(self, text: str) -> None:
        """The log's new lines held to its properties: ``text`` is the log as read after the step."""
        problems = self.log.feed(text)
        if problems:
            raise ServerMismatch(problems[0].property, f"the server's log: {problems[0].message}", self.program())

    def _failed(self, e: RequestFailed) -> NoReturn:
        what = f"step {len(self.steps)} ({self.steps[-1][:60]}...): {e.describe()}"
        if not e.alive:  # what the log showed broken before the server died is the property that failed
            broken = self.log.feed(e.log)
            if broken:
                said = f"the server's log: {broken[0].message}; then the server died: {what}"
                raise ServerMismatch(broken[0].property, said, self.program(), kind="crash") from None
            raise ServerMismatch("server_crash", what, self.program(), kind="crash") from None
        raise ServerMismatch("hang" if e.kind == "timeout" else "http_error", what, self.program()) from None

    def program(self) -> str:
        """The configuration and the steps so far as a program to paste into ``python`` (repository root)."""
        return "\n".join([
            "from pathlib import Path",
            "from harness.trees.build import build_server, build_source",
            "from harness.backends.llama_server.limits import LimitRun",
            "from harness.targets.llama_server import ServerConfig",
            f"with LimitRun({self.cfg!r}, {self.binary_expr}{', fresh=True' if self.fresh else ''}) as r:",
            *(f"    {s}" for s in self.steps),
            "print('the log held every property')",
        ])  # fmt: skip


def limits_machine(binary: Path, stats: LimitStats, log_dir: str | None,
                   binary_expr: str = "build_server('shared')", *, fresh: bool = False) -> type:  # fmt: skip
    """A Hypothesis state machine class: a drawn configuration (:func:`configs`), then requests and erases (with
    ``fresh``, each cached answer against a fresh server's too)."""

    class LimitsMachine(RuleBasedStateMachine):
        run: LimitRun | None = None

        @initialize(cfg=configs())
        def start(self, cfg: ServerConfig) -> None:
            self.cfg = cfg
            self.sent: list[tuple[int, ...]] = []
            self.since_erase = 0
            self.edged = False
            self.run = LimitRun(cfg, binary, log_dir, binary_expr, fresh=fresh)
            stats.last = self.run
            self.run.__enter__()
            stats.examples += 1
            stats.configs.append(cfg.name + f"-cr{cfg.cache_ram_mib}-cp{cfg.ctx_checkpoints}-c{cfg.n_ctx}")

        def teardown(self) -> None:
            if self.run is not None:
                stats.checked.update(self.run.log.checked)
                stats.checked.update(self.run.checked)
                stats.near_ties += self.run.near_ties
                self.run.__exit__()

        @request_rule
        def request(self, source: int, keep: int, n_new: int, seed: int, n_predict: int) -> None:
            assert self.run is not None
            tokens = prompt_from(self.sent, self.cfg, source, keep, n_new, seed)
            self.run.request(tokens, n_predict)
            self.sent.append(tokens)
            self.since_erase += 1
            stats.requests += 1

        @precondition(lambda self: self.run is not None and self.since_erase >= 2)  # mostly requests
        @rule(slot=st.integers(0, 3))
        def erase(self, slot: int) -> None:
            assert self.run is not None
            self.run.erase(slot % self.cfg.n_parallel)
            self.since_erase = 0
            stats.erases += 1

        @precondition(lambda self: self.run is not None and self.run.slot_ctx > 0 and len(self.sent) >= 2
                      and not self.edged)  # fmt: skip
        @rule(source=st.integers(0, 7), seed=st.integers(0, 255))
        def boundary(self, source: int, seed: int) -> None:
            """The context's edge, once an example: an earlier prompt extended to the slot's ``n_ctx`` tokens."""
            assert self.run is not None
            n = self.run.slot_ctx
            tokens = (self.sent[source % len(self.sent)] + tuple(3 + (seed * 31 + i * 17) % 256 for i in range(n)))[:n]
            self.run.boundary(tokens)
            self.sent.append(tokens[:-1])
            self.edged = True
            stats.boundaries += 1

    return LimitsMachine


def failed_load_program() -> tuple[ServerConfig, list[tuple[int, ...]]]:
    """A cache load that fails on the pinned tree, reached by requests alone (``restore_failure``): a unified KV of
    1024 cells with the idle-slot pass off, so an idle slot keeps its cells. E (500 tokens) lands on slot 1, F (400)
    on slot 0, G (600) takes slot 1 by LRU (E is saved: an entry of 501 tokens); H, E and 50 more, takes slot 0 by
    LRU, saves F and finds E, whose 501 cells do not fit beside G's 601: ``llama_state_seq_set_data`` fails
    ("failed to find 501 available cells in kv cache"), ``load`` returns false before it erases the entry
    (server-task.cpp:1833-1836 at 0c1e570) and the slot is cleared (server-context.cpp:1630-1632); H is then
    answered from scratch once the server purged slot 1 for room. Each prompt with ``n_predict`` 2."""
    cfg = ServerConfig("llama", n_parallel=2, kv_unified=True, cache_ram_mib=8, n_ctx=1024, cache_idle_slots=False)

    def tokens(seed: int, n: int) -> tuple[int, ...]:
        return (1, *(3 + (seed * 37 + i * 11) % 250 for i in range(n - 1)))

    e = tokens(1, 500)
    return cfg, [e, tokens(2, 400), tokens(3, 600), (*e, *tokens(4, 51)[1:])]


def run_limit_program(cfg: ServerConfig, prompts: list[tuple[int, ...]], binary: Path, log_dir: str | None,
                      binary_expr: str = "build_server('shared')") -> LimitRun:  # fmt: skip
    """``prompts`` (``n_predict`` 2 each) on a server of ``cfg``, the log checked after each as the drawn
    configurations check it (a problem raises :class:`ServerMismatch` with the program); the run, for its counts."""
    with LimitRun(cfg, binary, log_dir, binary_expr) as run:
        for p in prompts:
            run.request(p, 2)
    return run


def _replay(run: LimitRun, actions: list[Action]) -> tuple[ServerMismatch | None, int]:
    """``actions`` on a fresh :class:`LimitRun` of ``run``'s configuration: the mismatch they end in (None: none) and
    how many of them it took."""
    again = LimitRun(run.cfg, run.binary, None, run.binary_expr, fresh=run.fresh is not None)
    try:
        with again:
            for name, args in actions:
                getattr(again, name)(*args)
    except ServerMismatch as e:
        return e, len(again.actions)
    except ServerStartError:
        return None, 0
    return None, len(actions)


def shrink_steps(run: LimitRun, prop: str, *, budget_s: float = 180.0) -> tuple[ServerMismatch | None, str]:
    """The shortest sub-sequence of ``run``'s steps (delta debugging, then each request's ``n_predict`` cut to 1)
    that still fails ``prop`` on a fresh server: its mismatch, whose program replays just those steps (None: it did
    not fail again), and one line on how the shrink went."""
    t0 = time.monotonic()
    replays = 0

    def fails(actions: list[Action]) -> tuple[ServerMismatch | None, int]:
        nonlocal replays
        replays += 1
        e, n = _replay(run, actions)
        return (e, n) if e is not None and e.name == prop else (None, n)

    def over() -> bool:
        return time.monotonic() - t0 > budget_s

    found, n_used = fails(list(run.actions))
    if found is None:
        return None, f"{prop} did not fail again on a fresh server (1 replay): not shrunk"
    best = list(run.actions[:n_used])
    chunks = 2
    while len(best) >= 2 and not over():
        size = max(1, len(best) // chunks)
        smaller = False
        for start in range(0, len(best), size):
            cand = best[:start] + best[start + size :]
            if not cand or over():
                continue
            e, n = fails(cand)
            if e is not None:
                best, found, chunks, smaller = cand[:n], e, max(chunks - 1, 2), True
                break
        if not smaller:
            if size == 1:
                break
            chunks = min(chunks * 2, len(best))
    for i, (name, args) in enumerate(best):
        if name == "request" and args[1] > 1 and not over():
            cand = [*best[:i], (name, (args[0], 1)), *best[i + 1 :]]
            e, n = fails(cand)
            if e is not None and n == len(cand):
                best, found = cand, e
    late = f" (stopped at the {budget_s:.0f}s budget)" if over() else ""
    return found, (f"shrunk from {len(run.actions)} to {len(best)} steps, {replays} replays on fresh servers, "
                   f"{time.monotonic() - t0:.0f}s{late}")  # fmt: skip
