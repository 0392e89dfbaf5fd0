"""The server gate's drawn configurations: Hypothesis draws the server's flags as well as its requests, so every
limit of the prompt cache binds somewhere, and the server's own log is held to its properties at each step.

:func:`limits_machine` draws one :class:`~harness.targets.llama_server.ServerConfig` per example (any of the five
fixture models; 1 to 4 slots; unified KV or not; a draft model on the two that have one; ``--cache-ram`` -1 (the
token limit binds), 1, 2, 4 or 8 MiB; ``--ctx-checkpoints`` 1 to 32; ``-cms`` 0 to 256; ``-c`` 512 or 1024),
starts that server at ``-lv 4`` and sends prompts that share, extend and diverge from earlier ones, and erases
slots (``POST /slots/N?action=erase``, a slot cleared while it may hold checkpoints). After every step the log's
new lines are checked (:class:`~harness.targets.server_log.CacheLog`: ``limit``, ``accounting``,
``checkpoint_lists``, ``load_choice``, ``alloc_eviction``); no model is asked, so a configuration the reference
model does not cover is still held to what the server itself shows. With ``fresh`` (the gate on a tree whose
prompt cache the model cannot read) every answer served partly from the cache is also held to a fresh server's
(``restore_equivalence``, :func:`~harness.backends.llama_server.differential.compare_with_fresh`).
A failure prints the configuration and the
steps as a program (:meth:`LimitRun.program`) that replays them on a fresh server.

Deviations: a server is started per example (the configuration changes with each); requests are sent one at a
time; a drawn ``--cache-ram`` is at least 1 MiB, the granularity of the flag, so an entry alone above the limit
needs a state above 1 MiB (the fixture models' are a few hundred KiB: that case is in the memory checks instead).
"""

from __future__ import annotations

import tempfile
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, NoReturn

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, precondition, rule

from fixtures.gguf import ARCHS
from harness.backends.llama_server.differential import (
    ServerMismatch,
    compare_with_fresh,
    fresh_launch,
    launch_of,
    prompt_from,
    request_rule,
)
from harness.targets.llama_server import RequestFailed, ServerConfig, ServerProcess, unique_log
from harness.targets.server_log import CacheLog

__all__ = ["LimitRun", "LimitStats", "configs", "limits_machine"]

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
    configs: list[str] = field(default_factory=list)
    checked: Counter[str] = field(default_factory=Counter)
    near_ties: int = 0  # cached answers a greedy tie flipped (the known finding greedy-flip-on-cache-path)


class LimitRun:
    """One server of a drawn configuration and its log's checks; every step is kept for the replay program."""

    def __init__(self, cfg: ServerConfig, binary: Path, log_dir: str | None = None,
                 binary_expr: str = "build_server('shared')", *, fresh: bool = False) -> None:  # fmt: skip
        self.cfg = replace(cfg, log_verbosity=4)
        self.binary_expr = binary_expr
        self.steps: list[str] = []
        self.log = CacheLog(self.cfg.ctx_checkpoints)
        self.checked: Counter[str] = Counter()  # restore_equivalence, with ``fresh``
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
            self.server.start()
            if self.fresh is not None:
                self.fresh.start()
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
        try:
            answer = self.server.completion(list(tokens), n_predict, ignore_eos=True, return_tokens=True)
        except RequestFailed as e:
            self._failed(e)
        self.released += 1
        self.check()
        if self.fresh is not None and int(answer["timings"]["cache_n"]) > 0:
            self._equivalent(tokens, n_predict, tuple(int(t) for t in answer.get("tokens") or ()), answer)
        return answer

    def _equivalent(self, tokens: tuple[int, ...], n_predict: int, generated: tuple[int, ...], answer: Any) -> None:
        """``restore_equivalence``: an answer served partly from the cache equals a fresh server's (a greedy tie
        flipped is the known finding, counted)."""
        assert self.fresh is not None
        what = (f"step {len(self.steps)}: prompt of {len(tokens)} tokens (…{list(tokens[-4:])}) on slot "
                f"{answer['id_slot']}, cache_n {answer['timings']['cache_n']}")  # fmt: skip
        try:
            problem = compare_with_fresh(self.fresh, tokens, n_predict, generated, what)
        except RequestFailed as e:
            said = f"the fresh reference server, asked {what}: {e.describe()}"
            raise ServerMismatch("http_error" if e.alive else "server_crash", said, self.program(),
                                 "violation" if e.alive else "crash") from None  # fmt: skip
        self.checked["restore_equivalence"] += 1
        if problem == "near-tie":
            self.near_ties += 1
        elif problem is not None:
            raise ServerMismatch("restore_equivalence", problem, self.program())

    def erase(self, slot: int) -> None:
        """Clear slot ``slot`` (``POST /slots/N?action=erase``), then check the log."""
        self.steps.append(f"r.erase({slot})")
        try:
            self.server.request("POST", f"/slots/{slot}?action=erase", {})
        except RequestFailed as e:
            self._failed(e)
        self.check()

    def check(self) -> None:
        text = self.server.log_through(self.released) if self.server.log_path else ""
        problems = self.log.feed(text)
        if problems:
            raise ServerMismatch(problems[0].property, f"the server's log: {problems[0].message}", self.program())

    def _failed(self, e: RequestFailed) -> NoReturn:
        what = f"step {len(self.steps)} ({self.steps[-1][:60]}...): {e.describe()}"
        if not e.alive:
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
            self.run = LimitRun(cfg, binary, log_dir, binary_expr, fresh=fresh).__enter__()
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

    return LimitsMachine
