"""In-slot reuse: ``--cache-reuse`` chunks and context shift, on a slot's tokens and its memory.

Upstream: tools/server/server-context.cpp at 0c1e570.

``--cache-reuse N`` (common/arg.cpp:3582-3589, ``params.n_cache_reuse``, default 0 = off; a request's
``n_cache_reuse`` overrides it, server-schema.cpp:67-69, 531). When the slot's old prompt and the new one
differ after their common prefix, the loop at :3219-3262 walks both: at the new prompt's head ``head_p``
it looks for a run of equal tokens starting at the old prompt's head ``head_c``; a run of at least N
tokens is moved into place (``seq_rm(head_p, head_c)`` then ``seq_add(head_c, head_c + n_match,
head_p - head_c)``, :3249-3250), its tokens written at ``head_p`` and ``n_past`` grows by the run; a
shorter run advances ``head_c`` only. So the new prompt may be the old one with pieces deleted (a chat
whose middle was trimmed). It is refused where ``llama_memory_can_shift`` is false or the prompt has
multimodal chunks (:3210-3216, and at start-up :1160-1175 zeroes the flag); recurrent memories answer
true (src/llama-memory-recurrent.cpp:716-719, hybrid :133-136 of llama-memory-hybrid.cpp): their state
cannot lose the deleted tokens (the known finding ``cache-reuse-recurrent-stale``).

Context shift (``--context-shift``, default off: common.h:573; disabled where memory cannot shift,
:1166-1170, and with multimodal, :1155-1158). With it off, a generation stops when ``n_tokens + 1 >=
n_ctx`` (``truncated``, :1866-1874). With it on, before the next decode (:2889-2950) ``n_keep`` tokens
(the request's ``n_keep``, -1 = the whole prompt, plus one with a BOS token, at most ``n_ctx - 4``) stay
and ``n_discard`` after them (the request's, else half of the rest, clamped to ``n_left - 1``) are removed,
the tail moved back by ``n_discard``; the slot's checkpoints go with ``prompt.clear()`` (:2945). Parent and
child tasks (``n_cmpl``) get an error instead (:2907-2911).

Deviations: the synthetic memory applies each ``seq_rm``/``seq_add`` pair exactly
(:mod:`harness.model.shift`), so a reused chunk's state is that of a fresh evaluation of the new prompt's
prefix; a real KV cell keeps what it attended to before the shift (the outputs differ from a fresh
server's: the server tests show by how much). A recurrent state's position cannot move in the synthetic
provider, so the reuse machines run transformer and iSWA memories. The libllama provider does not answer
``can_shift``: reuse and context shift stay off on the libllama backend. ``ServerParams.ctx_limit`` (off by
default) turns on the n_ctx limit of a generation at all; the machines from before it never reach n_ctx.
"""

from __future__ import annotations

from dataclasses import dataclass

from harness.model.cache import Tokens

__all__ = ["Chunk", "can_shift", "context_shift_bounds", "reuse_chunks", "shifted_tokens"]


@dataclass(frozen=True)
class Chunk:
    """One reused run: the old prompt's ``[head_c, head_c + n_match)`` moved to ``head_p`` (:3242-3258)."""

    head_c: int
    head_p: int
    n_match: int

    @property
    def kv_shift(self) -> int:
        """:3248 ``kv_shift = head_p - head_c`` (negative: chunks only move back)."""
        return self.head_p - self.head_c


def can_shift(ctx: object) -> bool:
    """``llama_memory_can_shift`` (src/llama-context.cpp:4250-4257): a provider without the answer cannot."""
    fn = getattr(ctx, "can_shift", None)
    return bool(fn()) if callable(fn) else False


def reuse_chunks(cached: Tokens, prompt: Tokens, n_past: int, n_cache_reuse: int) -> list[Chunk]:
    """The chunk matching loop (:3219-3262) from the common prefix ``n_past``; it writes no token.

    Upstream writes each chunk's tokens at ``head_p`` as it goes (:3252-3255); those positions are
    below every later ``head_c``, so the reads of later iterations see the old prompt as here."""
    chunks: list[Chunk] = []
    head_c = head_p = n_past
    while head_c < len(cached) and head_p < len(prompt):
        n_match = 0
        while (
            head_c + n_match < len(cached)
            and head_p + n_match < len(prompt)
            and cached[head_c + n_match] == prompt[head_p + n_match]
        ):
            n_match += 1
        if n_match >= n_cache_reuse:
            chunks.append(Chunk(head_c, head_p, n_match))
            head_c += n_match
            head_p += n_match
        else:
            head_c += 1
    return chunks


def shifted_tokens(cached: Tokens, chunks: list[Chunk]) -> Tokens:
    """The slot's tokens after the loop: each chunk's tokens written at its ``head_p`` (:3252-3255)."""
    out = list(cached)
    for ch in chunks:
        out[ch.head_p : ch.head_p + ch.n_match] = cached[ch.head_c : ch.head_c + ch.n_match]
    return tuple(out)


def context_shift_bounds(
    n_tokens: int, n_task: int, n_keep: int, n_discard: int, *, add_bos: bool, n_ctx: int
) -> tuple[int, int]:
    """(n_keep, n_discard) of a context shift (:2914-2926) of a slot holding ``n_tokens`` tokens."""
    keep = n_task if n_keep < 0 else n_keep
    if add_bos:
        keep += 1
    keep = min(n_ctx - 4, keep)
    n_left = n_tokens - keep
    discard = n_discard if n_discard else n_left // 2
    discard = min(max(discard, 0), max(0, n_left - 1))  # std::clamp(n_discard, 0, max(0, n_left - 1))
    return keep, discard
