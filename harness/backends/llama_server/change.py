"""The change differential (``gate --backend server --source TREE --base BASE``): what a change does to the cache.

A contributor's tree is rarely the commit the reference model mirrors, so "the server disagrees with the
model" cannot tell their change from upstream moving on. With a base, the same request programs go to two
real servers, one built from ``TREE`` and one from ``BASE``, and to the model (fed what ``BASE`` answered):

* a difference between ``TREE`` and ``BASE`` (an answer's slot, ``cache_n`` or generated tokens; an HTTP
  error, a dropped connection or a dead server on one side only; or the prompt-cache events their logs show
  for that request, :data:`EVENTS`: how many of each, and each one's numbers, :data:`FIELDS`, so a checkpoint
  created at other positions or an entry saved with another length differs even when the counts agree; or a
  server-side property, :mod:`harness.targets.server_log`, that ``TREE``'s own log breaks and ``BASE``'s holds) is
  **the change's**: a gate failure (property ``change``; exit 3 when ``TREE`` died), reported with the
  shortest request program that still shows it (:func:`shrink`, replayed on fresh server pairs) and a script
  that replays it on both;
* a difference between ``BASE`` and the model is **upstream drift** when ``BASE`` is not the pinned tree:
  reported once per configuration and never failing the gate by itself (on the pinned tree it is a
  mismatch of the model, as without ``--base``).

Both servers run with ``-lv 4``, so their logs show every save, cache load, eviction and checkpoint.
"""

from __future__ import annotations

import dataclasses
import re
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from harness.backends.llama_server.differential import (
    Differential,
    Program,
    ServerMismatch,
    launch_of,
    prompt_from,
    request_rule,
)
from harness.backends.llama_server.probe import ensure_form
from harness.targets.llama_server import RequestFailed, ServerConfig, ServerProcess, unique_log
from harness.targets.server_log import CacheLog, LogProblem

__all__ = [
    "EVENTS",
    "FIELDS",
    "Answer",
    "ChangeFound",
    "ChangePair",
    "ChangeStats",
    "Event",
    "Step",
    "change_machine",
    "difference",
    "parse_events",
    "shrink",
]

EVENTS: dict[str, str] = {
    "evictions": "removing oldest entry",
    "saves": "saving prompt with length",
    "cache_loads": "found better prompt",
    "checkpoints_created": "created context checkpoint",
    "checkpoints_restored": "restored context checkpoint",
    "checkpoints_invalidated": "erased invalidated context checkpoint",
    "checkpoints_erased": "erasing old context checkpoint",
}
"""The prompt-cache events a server's ``-lv 4`` log shows (name -> the line's words in
tools/server/server-context.cpp and server-task.cpp at 0c1e570, unchanged on the PR's branch of 2026-08-20).
The eviction's words end all three of its lines (making room for an entry, the size limit, the token limit);
"erasing context checkpoint too close to an earlier one" is none of them."""

FIELDS: dict[str, tuple[str, ...]] = {
    "evictions": ("size",),  # "removing oldest entry (size = %.3f MiB)"
    "saves": ("length", "size", "draft"),  # "saving prompt with length %d, total state size = %.3f MiB (draft: ...)"
    "cache_loads": ("f_keep", "f_sim"),  # "found better prompt with f_keep = %.3f, f_sim = %.3f"
    "checkpoints_created": ("number", "of", "pos_min", "pos_max", "n_tokens", "size"),  # "%d of %d (pos_min = ..."
    "checkpoints_restored": ("pos_min", "pos_max", "n_tokens", "n_past", "size"),
    "checkpoints_invalidated": ("pos_min", "pos_max", "n_tokens", "n_swa", "pos_next", "size"),
    "checkpoints_erased": ("pos_min", "pos_max", "n_tokens", "size"),
}
"""The numbers each :data:`EVENTS` line carries after its words, in order (the lines' formats at 0c1e570; sizes
in MiB). A line of another tree with fewer numbers gives fewer fields; one with more, the named ones."""

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@dataclass(frozen=True)
class Event:
    """One :data:`EVENTS` line: its name and its numbers (:data:`FIELDS` name -> the number as logged: sizes and
    fractions are compared as printed, ``%.3f``, both builds printing the same state the same way)."""

    name: str
    values: tuple[tuple[str, str], ...] = ()

    def against(self, other: Event) -> tuple[str, str] | None:
        """The fields both lines carry that differ, as ``(this side's, other side's)`` text; None: none does."""
        theirs = dict(other.values)
        diff = [(k, v, theirs[k]) for k, v in self.values if k in theirs and theirs[k] != v]
        if not diff:
            return None
        return " ".join(f"{k} {a}" for k, a, _ in diff), " ".join(f"{k} {b}" for k, _, b in diff)


def parse_events(text: str) -> list[Event]:
    """The :data:`EVENTS` lines of a log text, in order."""
    found = []
    for line in text.splitlines():
        for name, words in EVENTS.items():
            at = line.find(words)
            if at >= 0:
                numbers = _NUMBER.findall(line, at + len(words))
                found.append(Event(name, tuple(zip(FIELDS[name], numbers, strict=False))))
                break
    return found


@dataclass(frozen=True)
class Answer:
    """What one server made of one request: its answer (slot, ``cache_n``, generated tokens) or what went
    wrong (``error``), and the :data:`EVENTS` its log showed for it (``records``, in the log's order;
    ``events``: how many of each)."""

    slot: int | None
    cache_n: int | None
    generated: tuple[int, ...] | None
    error: str | None
    records: tuple[Event, ...] = ()
    raw: Any = field(default=None, compare=False, repr=False)
    log_problems: tuple[LogProblem, ...] = field(default=(), compare=False)  # the server-side properties it broke

    @property
    def events(self) -> tuple[tuple[str, int], ...]:
        """How many of each :data:`EVENTS` (name, count), in :data:`EVENTS`' order."""
        n = Counter(e.name for e in self.records)
        return tuple((name, n[name]) for name in EVENTS)

    def describe(self) -> str:
        if self.error is not None:
            return self.error
        ev = ", ".join(f"{k} {v}" for k, v in self.events if v)
        return f"slot {self.slot} cache_n {self.cache_n} generated {list(self.generated or ())}" + (
            f" ({ev})" if ev else ""
        )


def difference(tree: Answer, base: Answer) -> str | None:
    """What ``tree`` answered differently from ``base`` (None: the same), in one line."""
    if (tree.error is None) != (base.error is None) or (tree.error and tree.error != base.error):
        return f"TREE {tree.error or 'answered'} where BASE {base.error or 'answered'}"
    if tree.error is not None:
        return None  # the same failure on both sides: not the change's
    held = {p.property for p in base.log_problems}
    broken = [p for p in tree.log_problems if p.property not in held]
    if broken:
        return f"TREE's log breaks {broken[0].property} where BASE's holds it: {broken[0].message}"
    for name in ("slot", "cache_n", "generated"):
        a, b = getattr(tree, name), getattr(base, name)
        if a != b:
            return f"{name}: TREE {_shown(a)} where BASE {_shown(b)}"
    te, be = dict(tree.events), dict(base.events)
    for name in EVENTS:
        if te[name] != be[name]:
            return f"the logs show {name}: TREE {te[name]} where BASE {be[name]}"
    # as many of each: the k-th event of a kind against BASE's k-th of that kind, the first in TREE's log order
    theirs = {name: [e for e in base.records if e.name == name] for name in EVENTS}
    k: Counter[str] = Counter()
    for ev in tree.records:
        other = theirs[ev.name][k[ev.name]]
        k[ev.name] += 1
        diff = ev.against(other)
        if diff is not None:
            return f"the logs show {ev.name} ({k[ev.name]} of {te[ev.name]}): TREE {diff[0]} where BASE {diff[1]}"
    return None


def _shown(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


class _Side:
    """One server of a pair, and the events its log has shown so far."""

    def __init__(self, name: str, server: ServerProcess, ctx_checkpoints: int) -> None:
        self.name = name
        self.server = server
        self.released = 0
        self.read = 0  # the log's characters parsed so far (whole lines)
        self.log = CacheLog(ctx_checkpoints)  # the server-side properties on its own log
        self.problems: tuple[LogProblem, ...] = ()  # what the last read of the log showed broken

    def ask(self, toks: tuple[int, ...], n_predict: int) -> Answer:
        try:
            r = self.server.completion(list(toks), n_predict, ignore_eos=True, return_tokens=True)
        except RequestFailed as e:
            what = ("died" if not e.alive else e.kind + (f" {e.status}" if e.status else ""))
            return Answer(None, None, None, f"{what} ({e.describe()})", self._events(0.5), None, self.problems)
        self.released += 1
        events = self._events(10.0)
        return Answer(int(r["id_slot"]), int(r["timings"]["cache_n"]), tuple(int(t) for t in r.get("tokens") or ()),
                      None, events, r, self.problems)  # fmt: skip

    def _events(self, timeout: float) -> tuple[Event, ...]:
        """The events logged since the last call: whole lines only (a line still being written, which only a
        timeout can leave, is waited for briefly, else left to the next call)."""
        if not self.server.log_path:
            return ()
        text = self.server.log_through(self.released, timeout)
        for _ in range(25):
            tail = text[text.rfind("\n") + 1 :]
            if not any(words in tail for words in EVENTS.values()):
                break
            time.sleep(0.02)
            text = self.server.log_path.read_text(errors="replace")
        end = text.rfind("\n") + 1
        self.problems = tuple(self.log.feed(text[:end]))
        new = parse_events(text[self.read : end]) if end > self.read else []
        self.read = max(self.read, end)
        return tuple(new)


@dataclass(frozen=True)
class Step:
    """One request sent to both servers: their answers, the difference (None: none), and the drift of the
    model from ``BASE`` this request showed (None: none, or the model was not asked)."""

    index: int
    tokens: tuple[int, ...]
    n_predict: int
    tree: Answer
    base: Answer
    difference: str | None
    drift: str | None = None

    def describe(self) -> str:
        head = f"#{self.index} {len(self.tokens)} tokens (…{list(self.tokens[-4:])}), n_predict {self.n_predict}"
        if self.difference is None:
            return f"{head}: both {self.base.describe()}"
        return f"{head}: TREE {self.tree.describe()} | BASE {self.base.describe()} -> {self.difference}"


class ChangePair:
    """``TREE`` and ``BASE`` servers of one configuration (``-lv 4``), and the model fed ``BASE``'s answers
    in ``base_semantics`` (None: no model, as when shrinking)."""

    def __init__(
        self,
        cfg: ServerConfig,
        tree: Path,
        base: Path,
        base_semantics: str | None = None,
        log_dir: str | None = None,
        *,
        tree_expr: str = "TREE",
        base_expr: str = "BASE",
    ) -> None:
        self.cfg = dataclasses.replace(cfg, log_verbosity=4)
        self.exprs = (tree_expr, base_expr)
        self.sent: Program = []
        self.drift: str | None = None
        self.steps: list[Step] = []
        self.base_model = (
            Differential(self.cfg, base, base_semantics, log_dir, binary_expr=base_expr)
            if base_semantics is not None
            else None
        )
        base_server = self.base_model.server if self.base_model is not None else self._server(base, log_dir, "base")
        self.base = _Side("BASE", base_server, self.cfg.ctx_checkpoints)
        self.tree = _Side("TREE", self._server(tree, log_dir, "tree"), self.cfg.ctx_checkpoints)

    def _server(self, binary: Path, log_dir: str | None, side: str) -> ServerProcess:
        log_path = None if log_dir is None else unique_log(log_dir, f"{self.cfg.name}-{side}")
        return ServerProcess(binary, launch_of(self.cfg), log_path=log_path)

    def __enter__(self) -> ChangePair:
        try:
            ensure_form(self.tree.server.binary, self.base.server.binary)  # one form, also in a pasted replay
            self.base.server.start()
            self.tree.server.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        try:
            self.tree.server.stop()
        finally:
            if self.base_model is not None:
                self.base_model.close()
            else:
                self.base.server.stop()

    def request(self, tokens: Sequence[int], n_predict: int) -> Step:
        toks = tuple(int(t) for t in tokens)
        base = self.base.ask(toks, n_predict)
        tree = self.tree.ask(toks, n_predict)
        self.sent.append((toks, n_predict))
        drift = None
        if self.base_model is not None and self.drift is None:
            if base.error is not None:
                drift = f"request #{len(self.sent)}: BASE {base.error}, where the model predicts an answer"
            else:
                row = self.base_model.record(toks, n_predict, base.raw)
                if not row.ok:
                    drift = f"request #{len(self.sent)}: BASE {row.describe()}"
                elif row.checkpoints != row.predicted_checkpoints:
                    drift = (f"request #{len(self.sent)}: BASE created checkpoints (slot, n_tokens) "
                             f"{list(row.checkpoints)}, the model {list(row.predicted_checkpoints)}")  # fmt: skip
            self.drift = drift
        step = Step(len(self.sent), toks, n_predict, tree, base, difference(tree, base), drift)
        self.steps.append(step)
        return step

    def program(self, sent: Program | None = None) -> str:
        """``sent`` (default: every request so far) as a script that replays it on both servers."""
        lines = [
            "from pathlib import Path",
            "from harness.trees.build import build_server, build_source",
            "from harness.backends.llama_server.change import ChangePair",
            "from harness.targets.llama_server import ServerConfig",
            f"with ChangePair({self.cfg!r}, {self.exprs[0]}, {self.exprs[1]}) as p:",
        ]
        for toks, n in self.sent if sent is None else sent:
            lines.append(f"    print(p.request({list(toks)!r}, {n}).describe())")
        return "\n".join(lines)


class ChangeFound(ServerMismatch):
    """``TREE`` answered a request unlike ``BASE``: ``step`` is the request that shows it, ``sent`` the request
    program up to it, ``name`` the property ``change``.

    The change under test is the cause: ``program`` replays the pair on fresh servers of both builds; fix the
    tree, or, when the difference is intended, say so in the change's description."""

    def __init__(self, step: Step, sent: Program, program: str) -> None:
        died = step.tree.error is not None and step.tree.error.startswith("died")
        super().__init__("change", step.describe(), program, kind="crash" if died else "violation")
        self.step = step
        self.sent = list(sent)


def shrink(
    cfg: ServerConfig,
    tree: Path,
    base: Path,
    sent: Program,
    *,
    log_dir: str | None = None,
    budget_s: float = 240.0,
    out: Callable[[str], None] = lambda _m: None,
) -> tuple[Program, Step | None, str]:
    """The shortest sub-program of ``sent`` (delta debugging over its requests, then each request's
    ``n_predict`` cut to 1) that still shows a difference between ``TREE`` and ``BASE`` on fresh servers,
    the step that shows it, and one line on how the shrink went (replays, seconds, budget)."""
    t0 = time.monotonic()
    replays = 0

    def shows(prog: Program) -> Step | None:
        nonlocal replays
        replays += 1
        with ChangePair(cfg, tree, base, None, log_dir) as p:
            for toks, n in prog:
                step = p.request(toks, n)
                if step.difference is not None:
                    return step
        return None

    def over() -> bool:
        return time.monotonic() - t0 > budget_s

    found = shows(sent)
    if found is None:
        return sent, None, "the difference did not show again on fresh servers (1 replay): not shrunk"
    best, step = list(sent[: found.index]), found
    n = 2
    while len(best) >= 2 and not over():
        chunk = max(1, len(best) // n)
        smaller = False
        for start in range(0, len(best), chunk):
            cand = best[:start] + best[start + chunk :]
            if not cand or over():
                continue
            got = shows(cand)
            if got is not None:
                best, step = cand[: got.index], got
                n = max(n - 1, 2)
                smaller = True
                break
        if not smaller:
            if chunk == 1:
                break
            n = min(n * 2, len(best))
        out(f"    shrinking: {len(best)} requests after {replays} replays, {time.monotonic() - t0:.0f}s")
    for i, (toks, n_predict) in enumerate(best):
        if n_predict > 1 and not over():
            cand = [*best[:i], (toks, 1), *best[i + 1 :]]
            got = shows(cand)
            if got is not None and got.index == len(cand):
                best, step = cand, got
    how = f"{replays} replays on fresh servers, {time.monotonic() - t0:.0f}s" + (
        f" (stopped at the {budget_s:.0f}s budget)" if over() else ""
    )
    return best, step, how


@dataclass
class ChangeStats:
    requests: int = 0
    same: int = 0
    drift: list[str] = field(default_factory=list)  # the first drift of the model from BASE, per machine


def change_machine(
    cfg: ServerConfig,
    tree: Path,
    base: Path,
    base_semantics: str,
    stats: ChangeStats,
    log_dir: str | None,
    exprs: tuple[str, str],
) -> type:
    """A Hypothesis machine driving ``cfg`` on the ``TREE``/``BASE`` pair; a difference raises :class:`ChangeFound`."""

    class ChangeMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.p = ChangePair(cfg, tree, base, base_semantics, log_dir, tree_expr=exprs[0], base_expr=exprs[1])
            self.p.__enter__()
            self.held: list[tuple[int, ...]] = []

        def teardown(self) -> None:
            if self.p.drift is not None:
                stats.drift.append(f"{cfg.name}: {self.p.drift}")
            self.p.close()

        def _send(self, tokens: tuple[int, ...], n_predict: int) -> None:
            step = self.p.request(tokens, n_predict)
            stats.requests += 1
            if step.difference is not None:
                raise ChangeFound(step, self.p.sent, self.p.program())
            stats.same += 1
            self.held.append(tokens)
            if step.base.generated:
                self.held.append(tokens + step.base.generated)  # what the slot now holds

        @request_rule
        def request(self, source: int, keep: int, n_new: int, seed: int, n_predict: int) -> None:
            """A prompt: 0-100 % (in 24ths) of one sent or held earlier (latest first), then new tokens."""
            self._send(prompt_from(self.held[::-1], cfg, source, keep, n_new, seed), n_predict)

        @precondition(lambda self: len(self.p.sent) > 0)
        @rule(i=st.integers(0, 50))
        def repeat(self, i: int) -> None:
            """Send an earlier prompt again (a cache hit or a slot hit)."""
            self._send(self.p.sent[i % len(self.p.sent)][0], 2)

    ChangeMachine.__name__ = f"Change_{cfg.name.replace('-', '_')}"
    return ChangeMachine
