"""In-slot reuse on a real llama-server: ``--cache-reuse`` and context shift against the model (issue #39).

:func:`reuse_pair` sends a prompt, then the same conversation with a piece of its middle deleted (the old
prompt and the tokens generated for it, minus ``[cut, cut + n_cut)``, plus new tokens) to one slot of a
server started with ``--cache-reuse N``; the model replays both requests with the server's generated
tokens and predicts ``timings.cache_n`` of the second (the common prefix plus every chunk of at least N
tokens moved into place, server-context.cpp:3219-3262 at 0c1e570). The second answer is then compared
with a fresh server's for the same prompt (greedy, ``cache_prompt`` off).

:func:`shift_run` sends a prompt whose generation runs past the slot's n_ctx to a server with
``--context-shift``; the model replays it and predicts each shift's ``n_keep``/``n_discard`` (the server's
log line "slot context shift, n_keep = .., n_left = .., n_discard = ..", :2928) and the tokens the slot
holds at the end ("stop processing: n_tokens = ..", :518). The tokens generated right after the first
shift are compared with a fresh server's continuation of exactly the kept tokens.

What an output comparison can show: a KV cell moved by ``seq_add`` keeps what it attended to before (the
deleted or discarded tokens), so on a model with attention layers the answer after a reuse or a shift may
differ from a fresh evaluation by design (:attr:`ReuseResult.matches_fresh` is a figure there, not a
verdict). On a model without attention (mamba) nothing excuses a difference: the recurrent state cannot
lose the deleted tokens, and upstream reuses it anyway (the finding ``cache-reuse-recurrent-stale``).
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from harness.model.cache import get_common_prefix
from harness.model.reuse import Chunk, reuse_chunks
from harness.model.server_context import ServerParams
from harness.targets.llama_server import Launch, ServerProcess
from harness.targets.synthetic import make_server

__all__ = ["ReuseResult", "ShiftResult", "reuse_pair", "shift_run"]

N_CTX = 256  # llama-server's smallest slot context: a generation of ~240 tokens reaches it
_SHIFT = re.compile(r"slot context shift, n_keep = (\d+), n_left = (\d+), n_discard = (\d+)")
_STOP = re.compile(r"stop processing: n_tokens = (\d+), truncated = (\d)")


def _tokens(r: Any) -> tuple[int, ...]:
    return tuple(int(t) for t in r.get("tokens") or ())


def _server(binary: str | os.PathLike[str], model: str | os.PathLike[str], args: list[str], log: Path | None
            ) -> ServerProcess:  # fmt: skip
    """One slot of N_CTX tokens, no RAM cache (the slot's own memory is what is reused), one thread."""
    return ServerProcess(
        binary,
        Launch(model=model, n_parallel=1, ctx_size=N_CTX, cache_ram=0, threads=1, args=args),
        log_path=log,
    )


@dataclass
class ReuseResult:
    """The second request of :func:`reuse_pair`: what the server did, what the model predicts."""

    arch: str
    first: tuple[int, ...]
    second: tuple[int, ...]
    cache_n: int  # the server's timings.cache_n
    chunks: list[Chunk]  # the model's chunks, from the common prefix
    model_cache_n: int  # the model's prediction (its full replay on transformer memory, else the chunk loop)
    generated: tuple[int, ...]
    fresh: tuple[int, ...]  # a fresh server's answer to ``second``
    undeleted: tuple[int, ...] = ()  # the server's answer when nothing was deleted (the stale-state witness)
    refused: bool = False  # the server turned --cache-reuse off at start-up (:1172-1175): chunks and prediction empty
    n_prefix: int = 0  # the common prefix of the slot's tokens and the second prompt

    @property
    def matches_fresh(self) -> bool:
        return self.generated == self.fresh

    def line(self) -> str:
        return (f"{self.arch}: cache_n {self.cache_n} (model {self.model_cache_n}, chunks "
                f"{[(c.head_c, c.head_p, c.n_match) for c in self.chunks]}), answer {list(self.generated)}, "
                f"fresh {list(self.fresh)}")  # fmt: skip


def reuse_pair(
    binary: str | os.PathLike[str],
    model: str | os.PathLike[str],
    arch: str,
    *,
    n_cache_reuse: int = 4,
    cut: int = 10,
    n_cut: int = 10,
    n_predict: int = 4,
    extra: tuple[int, ...] = (5, 6, 7),
    args: tuple[str, ...] = (),
    log_dir: Path | None = None,
) -> ReuseResult:
    """Two requests on one slot of a ``--cache-reuse n_cache_reuse`` server, the second a trimmed
    conversation; the model's prediction and a fresh server's answer (see the module's docstring)."""
    first = (1, *(3 + (i * 7) % 40 for i in range(40)))
    log = (log_dir or Path(tempfile.mkdtemp(prefix="reuse-"))) / f"reuse-{arch}.log"
    with _server(binary, model, ["--cache-reuse", str(n_cache_reuse), *args], log) as srv:
        ra = srv.completion(first, n_predict, id_slot=0, ignore_eos=True, return_tokens=True)
        gen_a = _tokens(ra)
        history = (*first, *gen_a[:-1])  # the last token is sampled, never decoded
        second = (*history[:cut], *history[cut + n_cut :], *extra)
        rb = srv.completion(second, n_predict, id_slot=0, ignore_eos=True, return_tokens=True)
        rc = srv.completion((*history, *extra), n_predict, id_slot=0, ignore_eos=True, return_tokens=True,
                            cache_prompt=False)  # fmt: skip
        refused = "cache_reuse is not supported" in srv.log_through(3)
    with _server(binary, model, list(args), None) as fresh:
        rf = fresh.completion(second, n_predict, ignore_eos=True, return_tokens=True, cache_prompt=False)
    kept = history
    n_prefix = get_common_prefix(kept, second)
    chunks = [] if refused else reuse_chunks(kept, second, n_prefix, n_cache_reuse)
    predicted = min(n_prefix + sum(c.n_match for c in chunks), len(second) - 1)
    if arch == "llama":  # transformer memory: the full model, replayed with the server's tokens
        params = ServerParams(n_slots=1, cache_ram=0, cache_ram_unit=1024, n_cache_reuse=n_cache_reuse)
        m = make_server("shared", "transformer", params=params, n_ctx=N_CTX)
        m.handle_completion(first, id_slot=0, n_predict=n_predict, forced=gen_a)
        m.run_until_idle()
        m.handle_completion(second, id_slot=0, n_predict=n_predict, forced=_tokens(rb))
        m.update_slots()
        predicted = m.slots[0].n_prompt_cached
    return ReuseResult(arch, first, second, int(rb["timings"]["cache_n"]), chunks, -1 if refused else predicted,
                       _tokens(rb), _tokens(rf), _tokens(rc), refused, n_prefix)  # fmt: skip


@dataclass
class ShiftResult:
    """:func:`shift_run`: the server's shifts and final tokens against the model's."""

    arch: str
    shifts: list[tuple[int, int]]  # the server's (n_keep, n_discard), from its log
    model_shifts: list[tuple[int, int]]
    n_tokens: int  # the server's tokens at the end (its log)
    model_n_tokens: int
    truncated: bool
    generated: tuple[int, ...]
    kept: tuple[int, ...] = ()  # the model's kept tokens at the first shift
    after: tuple[int, ...] = ()  # the server's tokens generated after the first shift
    fresh_after: tuple[int, ...] = ()  # a fresh server's continuation of ``kept``
    notes: list[str] = field(default_factory=list)

    def line(self) -> str:
        return (f"{self.arch}: shifts {self.shifts} (model {self.model_shifts}), n_tokens {self.n_tokens} (model "
                f"{self.model_n_tokens}), truncated {self.truncated}; after the first shift {list(self.after)}, "
                f"fresh on the kept tokens {list(self.fresh_after)}")  # fmt: skip


def shift_run(
    binary: str | os.PathLike[str],
    model: str | os.PathLike[str],
    arch: str,
    *,
    n_prompt: int = 20,
    n_predict: int = 260,
    n_keep: int = 0,
    n_discard: int = 0,
    n_after: int = 4,
    log_dir: Path | None = None,
) -> ShiftResult:
    """A generation past the slot's n_ctx (256) with ``--context-shift``, against the model."""
    prompt = (1, *(3 + (i * 7) % 40 for i in range(n_prompt - 1)))
    log = (log_dir or Path(tempfile.mkdtemp(prefix="shift-"))) / f"shift-{arch}.log"
    with _server(binary, model, ["--context-shift"], log) as srv:
        r = srv.completion(prompt, n_predict, ignore_eos=True, return_tokens=True, n_keep=n_keep, n_discard=n_discard)
        text = srv.log_through(1)
    gen = _tokens(r)
    params = ServerParams(n_slots=1, cache_ram=0, cache_ram_unit=1024, ctx_shift=True, ctx_limit=True)
    m = make_server("shared", "transformer", params=params, n_ctx=N_CTX)
    m.handle_completion(prompt, n_predict=n_predict, forced=gen, n_keep=n_keep, n_discard=n_discard)
    m.run_until_idle()
    stops = _STOP.findall(text)
    res = ShiftResult(
        arch,
        [(int(k), int(d)) for k, _, d in _SHIFT.findall(text)],
        [(k, d) for _, _, k, d in m.ctx_shifts],
        int(stops[-1][0]) if stops else -1,
        m.slots[0].prompt.n_tokens(),
        bool(r.get("truncated")),
        gen,
    )
    if m.ctx_shifts:
        _, before, k, d = m.ctx_shifts[0]
        i = len(before) - len(prompt)  # generated tokens decoded before the shift: gen[i] is decoded next
        res.kept = (*before[:k], *before[k + d :], gen[i])
        res.after = gen[i + 1 : i + 1 + n_after]
        with _server(binary, model, [], None) as fresh:
            rf = fresh.completion(res.kept, len(res.after), ignore_eos=True, return_tokens=True, cache_prompt=False)
        res.fresh_after = _tokens(rf)
    return res
