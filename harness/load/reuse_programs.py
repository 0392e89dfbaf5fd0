"""Generated ``--cache-reuse`` and context-shift programs on a real ``llama-server`` against the model (issue #39,
point 3): ``python -m harness reuse --examples N --seed S``.

An example is a server with one slot of :data:`~harness.experiments.reuse.N_CTX` tokens, ``--cache-reuse
N`` (N drawn: 1-16) and ``--context-shift``, and the model (:func:`harness.targets.synthetic.make_server` on
transformer memory: the libllama provider cannot shift) with the same flags, fed the server's generated tokens.
On llama only: the synthetic provider cannot move a recurrent state's position (mamba, jamba, lfm2: the fixed
:func:`~harness.experiments.reuse.reuse_pair` on mamba shows ``cache-reuse-recurrent-stale``), and gemma2's
server refuses ``--cache-reuse`` only at sizes where its two caches differ, which the iSWA model does not follow.

A program: a first prompt, then up to :data:`MAX_FOLLOW` follow-ups, each the conversation the slot holds (its
prompt and the tokens generated) with a piece of its middle deleted and new tokens after, or (a ``long`` step)
a generation that runs past ``n_ctx`` so that the context shifts. Checked at each request,
failing on any difference no registered finding explains by its exact condition:

* ``timings.cache_n`` is the model's (the common prefix plus every chunk of at least N tokens moved into place,
  server-context.cpp:3219-3262; after a context shift, what the shifted slot holds): ``reuse_chunks``;
* every context shift in the server's log came when the model's did (``n_left``: ``shift_timing``) and kept and
  discarded what the model's did (``n_keep``, ``n_discard``: ``context_shift``) (:2927);
* the answer is a fresh cache-less server's when no reused cell was moved (no chunk since the slot was last
  rebuilt from position 0, no context shift): a greedy flip within the model's batch-shape bound is
  ``greedy-flip-on-cache-path``;
  once cells were moved, an answer unlike a fresh one is by design on a model with attention (a moved KV cell
  keeps what it attended to; counted as ``moved_differs``, not a verdict).

Found by it on seed 0 (llama, N 1, the first token deleted: a chunk moved to position 0): the model aborted
(``pos_min == -1, but n_past > 0``) where the server answered ``cache_n`` 13: the synthetic memory's ``seq_rm(seq,
0, p1)`` cleared the whole sequence instead of [0, p1) (fixed in :meth:`harness.model.provider.SyntheticProvider.
memory_seq_rm`; ``test_a_chunk_moved_to_position_0``).

A failure is shrunk and printed as a pasteable program, with the seed and the command line
(:func:`harness.load.generated.run_generated`). :data:`MUTANTS` plants a bug for the tests:
``reuse-off-by-one`` (the model's chunk loop asks for runs of N + 1 tokens).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hypothesis import strategies as st

from fixtures.gguf import model_path
from harness.errors import GgmlAbort
from harness.experiments.reuse import N_CTX
from harness.interrupt import check
from harness.load.generated import GeneratedFailure, GeneratedFigures, failed_request, output_verdict, run_generated
from harness.model.server_context import ServerContext, ServerParams
from harness.targets.llama_server import Launch, RequestFailed, ServerProcess
from harness.targets.synthetic import make_server

__all__ = ["ARCHS", "MUTANTS", "ReuseFigures", "command_line", "program_strategy", "replay", "run_model"]

ARCHS = ("llama",)
KIND = {"llama": "transformer"}
MAX_FOLLOW = 4
MUTANTS = ("reuse-off-by-one",)
_SHIFT = re.compile(r"slot context shift, n_keep = (\d+), n_left = (\d+), n_discard = (\d+)")

# (n_cache_reuse, first prompt's length, seed, [follow-up: (long, cut 0-23, n_cut 0-23, n_new, n_predict, n_keep,
# n_discard)]); a long step's request names its own n_keep (-1: the whole prompt) and n_discard (0: half the rest)
_FOLLOW = st.tuples(st.integers(0, 9), st.integers(0, 23), st.integers(0, 23), st.sampled_from([0, 1, 3, 8]),
                    st.integers(1, 4), st.sampled_from([0, -1, 4]), st.sampled_from([0, 8, 40]))  # fmt: skip
_PROGRAM = st.tuples(st.sampled_from([1, 2, 4, 8, 16]), st.sampled_from([12, 40, 90]), st.integers(0, 255),
                     st.lists(_FOLLOW, min_size=1, max_size=MAX_FOLLOW))  # fmt: skip


def program_strategy() -> st.SearchStrategy[tuple[Any, ...]]:
    return _PROGRAM


@dataclass
class ReuseFigures(GeneratedFigures):
    arch: str
    examples: int = 0
    requests: int = 0
    chunks_moved: int = 0
    tokens_reused_by_chunks: int = 0
    shifts: int = 0
    shift_checks: int = 0  # requests whose context shifts (none, or when and how many) were held to the model's
    compared: int = 0
    outputs_equal: int = 0
    moved_differs: int = 0  # by design: a moved KV cell keeps what it attended to (attention models only)
    findings: Counter[str] = field(default_factory=Counter)
    failure: GeneratedFailure | None = None
    seed: int = 0


def _tokens(r: Any) -> tuple[int, ...]:
    return tuple(int(t) for t in r.get("tokens") or ())


def _model(arch: str, n_cache_reuse: int, mutant: str | None) -> ServerContext:
    params = ServerParams(n_slots=1, cache_ram=0, cache_ram_unit=1024, n_cache_reuse=n_cache_reuse, ctx_shift=True,
                          ctx_limit=True)  # fmt: skip
    m = make_server("shared", KIND[arch], params=params, n_ctx=N_CTX)
    if mutant == "reuse-off-by-one":
        m.params.n_cache_reuse = n_cache_reuse + 1
    return m


class _Run:
    """One program: the server, the model, the fresh server; each request checked and written as a replay line."""

    def __init__(self, arch: str, srv: ServerProcess, fresh: ServerProcess, fig: ReuseFigures, n_cache_reuse: int,
                 mutant: str | None, binary_expr: str = "build_server('shared')") -> None:  # fmt: skip
        self.arch, self.srv, self.fresh, self.fig, self.mutant = arch, srv, fresh, fig, mutant
        self.binary_expr = binary_expr  # the replay program's expression for the server's binary
        self.n_cache_reuse = n_cache_reuse
        self.m = _model(arch, n_cache_reuse, mutant)
        self.lines: list[str] = []
        self.history: tuple[int, ...] = ()  # what the slot holds: the last prompt and its generated tokens
        self.moved = False  # cells were moved since the slot was last rebuilt from position 0
        self.sent = 0
        self.log_shifts = 0

    def fail(self, name: str, message: str) -> None:
        raise GeneratedFailure(name, message, replay_text(self.arch, self.n_cache_reuse, self.lines, self.mutant,
                                                          self.binary_expr))  # fmt: skip

    def request(self, prompt: tuple[int, ...], n_predict: int, n_keep: int = 0, n_discard: int = 0) -> None:
        """One request, checked (:meth:`_request`); a request that got no usable answer, from the server or the
        fresh one, is a failure with the program so far, as any other. ``n_keep``, ``n_discard``: the request's own
        (a context shift keeps ``n_keep`` tokens, -1 the whole prompt, and discards ``n_discard``, 0 half the rest:
        server-context.cpp:2914-2923 at 0c1e570)."""
        try:
            self._request(prompt, n_predict, n_keep, n_discard)
        except RequestFailed as e:
            self.fail(failed_request(e), f"a prompt of {len(prompt)} tokens: {e.describe()}")

    def _request(self, prompt: tuple[int, ...], n_predict: int, n_keep: int, n_discard: int) -> None:
        check()
        own = {k: v for k, v in (("n_keep", n_keep), ("n_discard", n_discard)) if v}  # upstream's defaults are 0
        named = "".join(f", {k}={v}" for k, v in own.items())
        self.lines.append(f"    r.request({list(prompt)!r}, {n_predict}{named})")
        r = self.srv.completion(list(prompt), n_predict, id_slot=0, ignore_eos=True, return_tokens=True, n_probs=0,
                                **own)  # fmt: skip
        self.sent += 1
        gen, cache_n = _tokens(r), int(r["timings"]["cache_n"])
        self.fig.requests += 1
        n_reuses, n_shifts = len(self.m.reuses), len(self.m.ctx_shifts)
        try:
            self.m.handle_completion(prompt, id_slot=0, n_predict=n_predict, forced=gen, n_keep=n_keep,
                                     n_discard=n_discard)  # fmt: skip
            self.m.run_until_idle()
        except GgmlAbort as e:  # the server answered: the model's abort is a difference too
            self.fail("model_abort", f"a prompt of {len(prompt)} tokens: the server answered, the model aborted: {e}")
        chunks = [c for _, _, cs in self.m.reuses[n_reuses:] for c in cs]
        want = self.m.slots[0].n_prompt_cached
        if cache_n != want:
            self.fail("reuse_chunks", f"a prompt of {len(prompt)} tokens: server cache_n {cache_n}, model {want} "
                      f"(chunks {[(c.head_c, c.head_p, c.n_match) for c in chunks]})")  # fmt: skip
        shifts = [(int(k), int(n), int(d)) for k, n, d in _SHIFT.findall(self.srv.log_through(self.sent))]
        model_shifts = [(k, len(tokens) - k, d) for _, tokens, k, d in self.m.ctx_shifts]
        self.shifts_agree(shifts, model_shifts)
        self.fig.shifts += len(model_shifts) - n_shifts
        self.fig.chunks_moved += len(chunks)
        self.fig.tokens_reused_by_chunks += sum(c.n_match for c in chunks)
        if cache_n == 0:
            self.moved = False
        self.moved = self.moved or bool(chunks) or len(model_shifts) > n_shifts
        self.history = (*prompt, *gen[:-1])
        self.judge(prompt, gen, cache_n)

    def shifts_agree(self, shifts: list[tuple[int, int, int]], model: list[tuple[int, int, int]]) -> None:
        """Every context shift so far, (n_keep, n_left, n_discard) as the server logged it (server-context.cpp:2927
        at 0c1e570) against the model's: ``shift_timing`` when one came at another length (``n_left``, the slot's
        tokens past ``n_keep``: it shifts exactly when ``n_tokens + 1 >= n_ctx``, :2892) or the counts differ,
        ``context_shift`` when one kept or discarded another number of tokens."""
        for i, (got, want) in enumerate(zip(shifts, model, strict=False)):
            if got[1] != want[1]:
                self.fail("shift_timing", f"context shift {i}: the server shifted with n_left {got[1]} past n_keep "
                          f"{got[0]}, the model with n_left {want[1]} (every shift (n_keep, n_left, n_discard): "
                          f"server {shifts}, model {model})")  # fmt: skip
            if got != want:
                self.fail("context_shift", f"context shift {i}: server (n_keep, n_left, n_discard) {got}, model "
                          f"{want} (every shift: server {shifts}, model {model})")  # fmt: skip
        if len(shifts) != len(model):
            self.fail("shift_timing", f"the server shifted its context {len(shifts)} times, the model {len(model)} "
                      f"((n_keep, n_left, n_discard): server {shifts}, model {model})")  # fmt: skip
        self.fig.shift_checks += 1

    def judge(self, prompt: tuple[int, ...], gen: tuple[int, ...], cache_n: int) -> None:
        if len(prompt) + len(gen) >= N_CTX:  # a shifted generation: the fresh server cannot hold the conversation
            return
        found, problem = output_verdict(self.fresh, prompt, gen, cache_n, self.arch)
        self.fig.compared += 1
        if found == "":
            self.fig.outputs_equal += 1
        elif self.moved:
            self.fig.moved_differs += 1
        elif found is not None:
            self.fig.findings[found] += 1
        else:
            self.fail("output", str(problem))

    def follow(self, step: tuple[int, int, int, int, int, int, int], seed: int) -> None:
        long, cut, n_cut, n_new, n_predict, n_keep, n_discard = step
        h = self.history
        new = tuple(3 + (seed * 13 + len(h) * 7 + i * 11) % 250 for i in range(n_new))
        a = len(h) * cut // 24
        b = min(len(h), a + max(1, len(h) * n_cut // 24))
        prompt = (*h[:a], *h[b:], *new)[-(N_CTX - 20) :] or (1,)
        if long != 0:
            self.request(prompt, n_predict)
            return
        # a generation past n_ctx: the context shifts, keeping and discarding what this request says
        self.request(prompt, N_CTX + 8 - len(prompt), n_keep, n_discard)


def replay_text(arch: str, n_cache_reuse: int, lines: Sequence[str], mutant: str | None = None,
                binary_expr: str = "build_server('shared')") -> str:  # fmt: skip
    m = "" if mutant is None else f", mutant={mutant!r}"
    head = ["from pathlib import Path",
            "from harness.trees.build import build_server",
            "from harness.load.reuse_programs import replay",
            f"with replay({arch!r}, {binary_expr}, {n_cache_reuse}{m}) as r:"]  # fmt: skip
    return "\n".join([*head, *lines])


def _server(binary: Path, arch: str, n_cache_reuse: int | None) -> ServerProcess:
    args = [] if n_cache_reuse is None else ["--cache-reuse", str(n_cache_reuse), "--context-shift"]
    return ServerProcess(
        binary,
        Launch(
            model=model_path(arch),
            n_parallel=1,
            ctx_size=N_CTX,
            cache_ram=0,
            threads=1,
            args=[*args, "--no-warmup"],
        ),
    )  # fmt: skip


class replay:
    """A replay program's runner: the server, the model and a fresh server; ``request`` checks as the run did."""

    def __init__(self, arch: str, binary: Path, n_cache_reuse: int, mutant: str | None = None) -> None:
        self.arch, self.binary, self.n, self.mutant = arch, binary, n_cache_reuse, mutant
        self.fig = ReuseFigures(arch)

    def __enter__(self) -> replay:
        self.fresh = _server(self.binary, self.arch, None)
        self.srv = _server(self.binary, self.arch, self.n)
        self.fresh.start()
        try:
            self.srv.start()
        except BaseException:
            self.fresh.stop()
            raise
        self.run = _Run(self.arch, self.srv, self.fresh, self.fig, self.n, self.mutant, f"Path({str(self.binary)!r})")
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.srv.stop()
        finally:
            self.fresh.stop()

    def request(self, tokens: Sequence[int], n_predict: int, n_keep: int = 0, n_discard: int = 0) -> None:
        self.run.request(tuple(tokens), n_predict, n_keep, n_discard)


def run_model(arch: str, binary: Path, *, examples: int, seed: int, mutant: str | None = None,
              shrinks: int | None = 15, binary_expr: str = "build_server('shared')") -> ReuseFigures:  # fmt: skip
    """``examples`` generated programs on ``arch``; the figures and the shrunk failure, if any (its program names
    the server's binary as ``binary_expr``)."""
    if mutant is not None and mutant not in MUTANTS:
        raise ValueError(f"unknown reuse-program mutant {mutant!r}")
    fig = ReuseFigures(arch, seed=seed)
    with _server(binary, arch, None) as fresh:

        def run_one(program: tuple[Any, ...]) -> None:
            n, n_first, pseed, follows = program
            with _server(binary, arch, n) as srv:
                run = _Run(arch, srv, fresh, fig, n, mutant, binary_expr)
                run.request((1, *(3 + (pseed * 31 + i * 7) % 40 for i in range(n_first - 1))), 4)
                for k, step in enumerate(follows):
                    run.follow(step, pseed + k)

        out = run_generated(program_strategy(), run_one, examples=examples, seed_value=seed, shrinks=shrinks)
    fig.examples, fig.failure = out.examples, out.failure
    return fig


def command_line(archs: Sequence[str], examples: int, seed: int) -> str:
    return f"python -m harness reuse --models {','.join(archs)} --examples {examples} --seed {seed}"
