"""Outputs under load against a fresh cache-less server, and the known findings that explain a difference.

:func:`compare_output` compares a response's tokens with a fresh single-slot server's (greedy, no
cache) and says where they first differ and by what logprob gap (:class:`OutputDiff`);
:class:`Divergences` decides which differences a known finding explains and which are mismatches.
Used by the concurrent differential and the soak.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fixtures.gguf import BYTE_TOKEN_OFFSET, SPECS
from harness.findings import BATCH_SHAPE_FLIP_GAP, CONCURRENT_OUTPUT_DIVERGENCE, GREEDY_FLIP_ON_CACHE_PATH
from harness.targets.llama_server import ServerProcess, sampleable, withheld_tokens
from harness.trace.calls import read_trace
from harness.trace.lineage import DECODE_THREW, SHORT_WINDOW, Explainer

__all__ = ["BATCH_SHAPE_FLIP_GAP", "DECODE_THREW", "SHORT_WINDOW", "Divergences", "OutputDiff", "compare_output"]


@dataclass(frozen=True)
class OutputDiff:
    """Where a response first differs from the fresh server's greedy answer (on model ``arch``)."""

    arch: str
    prompt: tuple[int, ...]
    generated: tuple[int, ...]
    want: tuple[int, ...]  # the fresh server's tokens
    index: int  # the first differing token
    gap: float | None  # the fresh server's best logprob minus the served token's (None: not in its top 10)

    @property
    def bound(self) -> float:
        """The model's batch-shape bound (:data:`BATCH_SHAPE_FLIP_GAP`; 0: none, no attention layer)."""
        return BATCH_SHAPE_FLIP_GAP.get(self.arch, 0.0)

    @property
    def batch_shape_flip(self) -> bool:
        """The condition of the batch-shape findings: a greedy flip within the model's bound."""
        return self.gap is not None and self.gap < self.bound

    def describe(self) -> str:
        how = f"logprob gap {self.gap:.4f}" if self.gap is not None else "not in the fresh server's top 10"
        return (f"{len(self.prompt)}-token prompt (…{list(self.prompt[-3:])}): token {self.index} differs ({how}, "
                f"{self.arch}'s bound {self.bound}): generated {list(self.generated)}, a fresh server generates "
                f"{list(self.want)}")  # fmt: skip


class Divergences:
    """Outputs unlike a fresh server's that a known finding explains, by that finding's exact condition.

    * Located from the server's libllama trace, first (:meth:`located`, :class:`harness.trace.lineage.Explainer`):
      the reads that gave the first wrong token depend on a decode that threw
      (``decode-exception-keeps-slot-tokens``) or on a row decoded with its sliding window short of a
      cell (``swa-restore-window-short``, a checkpoint restore re-evaluating its ``pos_max``).
    * ``concurrent-output-divergence`` and ``greedy-flip-on-cache-path``, one mechanism (issue #41,
      docs/findings.md): libllama's logits move with how a sequence's tokens share batches (CPU flash
      attention's two kernels, the cells a cached prompt sits in), and a greedy choice flips where the
      fresh server's best token and the one served are within the model's :data:`BATCH_SHAPE_FLIP_GAP`
      (measured per model; none for mamba, which has no attention layer). :meth:`batch_shape` names
      which: ``greedy-flip-on-cache-path`` when the prompt was served partly from the slot or the cache
      (``cache_n`` > 0), else ``concurrent-output-divergence`` (only the other slots' batches changed its
      shape). On every model: a wider gap, or a served token outside the fresh top 10, is a mismatch.
    * ``busy-slot-by-id``: a response it changed (:meth:`add`) leaves wrong state in its slot and the
      cache entries saved from it; a later divergence that reused ``cache_n`` tokens starting like such
      a response is that finding's (:meth:`explains`).
    * ``decode-exception-keeps-slot-tokens``: a request that failed with "decode() failed"
      (:meth:`failed_decode`, the faults-on phases) leaves its slot claiming tokens its memory never got;
      a divergence whose prompt starts like such a request's (at least :data:`SHARED_HEAD` tokens)
      reused them (:meth:`after_failed_decode`).

    Anything else is a mismatch.
    """

    SHARED_HEAD = 4  # the soak's prompts are random token ids: 4 shared first tokens are no chance

    def __init__(self, arch: str) -> None:
        self.arch = arch
        self.seen: list[tuple[int, ...]] = []
        self.failed: list[tuple[int, ...]] = []
        spec = SPECS.get(arch)
        self.n_swa = (spec.n_swa or 0) if spec is not None else 0
        self._traces: dict[Path, Explainer] = {}

    def located(self, diff: OutputDiff, trace: Path | None) -> str | None:
        """The located finding the server's libllama trace ``trace`` shows behind ``diff``'s first wrong
        token (``DECODE_THREW`` or ``SHORT_WINDOW``), or None (no trace, or no such condition)."""
        if trace is None or not trace.is_file() or diff.index >= len(diff.generated):
            return None
        if trace not in self._traces:
            self._traces[trace] = Explainer(read_trace(trace).events, self.n_swa)
        return self._traces[trace].explain([*diff.prompt, *diff.generated[: diff.index]], diff.generated[diff.index])

    def add(self, tokens: Sequence[int], generated: Sequence[int]) -> None:
        """A response a known finding changed (its slot's state is wrong from then on)."""
        self.seen.append((*tokens, *generated))

    def failed_decode(self, tokens: Sequence[int]) -> None:
        """A request that ended in "decode() failed": its slot may keep its tokens unevaluated."""
        self.failed.append(tuple(tokens))

    @staticmethod
    def batch_shape(diff: OutputDiff, cache_n: int) -> str | None:
        """The batch-shape finding that explains ``diff`` (see above), or None when its gap is too wide."""
        if not diff.batch_shape_flip:
            return None
        return GREEDY_FLIP_ON_CACHE_PATH.id if cache_n > 0 else CONCURRENT_OUTPUT_DIVERGENCE.id

    def explains(self, tokens: Sequence[int], cache_n: int) -> bool:
        """The prompt reused ``cache_n`` tokens of a response a known finding changed, or of a failed decode."""
        head = tuple(tokens[:cache_n])
        if cache_n > 0 and any(s[:cache_n] == head for s in self.seen):
            return True
        return self.after_failed_decode(tokens, cache_n)

    def after_failed_decode(self, tokens: Sequence[int], cache_n: int) -> bool:
        """Whether the prompt reused a prefix of a request that failed in decode()."""
        k = self.SHARED_HEAD
        head = tuple(tokens[:k])
        return cache_n >= k and any(f[:k] == head for f in self.failed)


def _pieces_complete(tokens: Sequence[int]) -> list[bool]:
    """For each generated token of the fixtures' byte vocabulary, whether llama-server reports its
    probabilities: it withholds a token after which the text ends inside a UTF-8 sequence
    (``validate_utf8``, server-common.cpp:903-928; ``process_token``, server-context.cpp:1826-1829).
    The control tokens (unknown, BOS, EOS) are pieces of no text without ``--special``."""
    text = b""
    out = []
    for t in tokens:
        if BYTE_TOKEN_OFFSET <= t < BYTE_TOKEN_OFFSET + 256:
            text += bytes([t - BYTE_TOKEN_OFFSET])
        elif t >= BYTE_TOKEN_OFFSET + 256:
            text += b" "
        cut = False
        for k in range(1, min(4, len(text)) + 1):
            c = text[-k]
            need = 2 if c & 0xE0 == 0xC0 else 3 if c & 0xF0 == 0xE0 else 4 if c & 0xF8 == 0xF0 else 0
            if need and k < need:
                cut = True
                break
        out.append(not cut)
    return out


# the byte tokens llama-server withholds when a generation's text is that one byte (a UTF-8 lead byte)
_LEAD_BYTES = [BYTE_TOKEN_OFFSET + b for b in range(0xC0, 0xF8)]


def _gap(entry: dict[str, Any], served: int) -> float | None:
    """The served token's logprob below the best in ``entry`` (its probabilities among the tokens the server could
    sample: :func:`~harness.targets.llama_server.sampleable`)."""
    top = entry.get("top_logprobs") or []
    got = [float(t["logprob"]) for t in top if int(t["id"]) == served]
    return float(top[0]["logprob"]) - got[0] if top and got else None


def _gap_resumed(fresh: ServerProcess, tokens: Sequence[int], want: Sequence[int], i: int, served: int) -> float | None:
    """The fresh generation's gap at token ``i`` when it reported no probabilities for it.

    Token ``i``'s logits are recomputed in the batch shape of the fresh generation itself: the
    generation is run again to ``i`` tokens with the prompt kept in the slot, then the prompt plus
    those tokens is sent with ``n_predict`` 1, so only the last one is evaluated (one row on the same
    memory, ``cache_n`` = its length - 1); the lone UTF-8 lead bytes are banned from the sample so the
    one token is reported, and the raw distribution (pre-sampling, biases not applied) is read."""
    withheld = withheld_tokens(fresh.binary)
    ban = [[t, False] for t in sorted(withheld.union(_LEAD_BYTES))]
    n_probs = 10 + len(withheld)  # ten the server could sample, besides the ones it never does
    if i == 0:  # the prompt's own last row, as in the fresh generation
        r = fresh.completion(list(tokens), 1, ignore_eos=True, return_tokens=True, cache_prompt=False, n_probs=n_probs,
                             logit_bias=ban)  # fmt: skip
        r = sampleable(r, withheld)
    else:
        head = fresh.completion(list(tokens), i, ignore_eos=True, return_tokens=True, cache_prompt=False)
        if [int(t) for t in head.get("tokens") or ()] != list(want[:i]):
            return None
        prompt = [*tokens, *want[:i]]
        r = sampleable(fresh.completion(prompt, 1, ignore_eos=True, return_tokens=True, cache_prompt=True,
                                        n_probs=n_probs, logit_bias=ban), withheld)  # fmt: skip
        if int(r["timings"]["cache_n"]) != len(prompt) - 1:
            return None  # evaluated in another shape (a recurrent slot that could not keep it): no exact gap
    probs = r.get("completion_probabilities") or []
    if not probs or not (probs[0].get("top_logprobs") or []) or int(probs[0]["top_logprobs"][0]["id"]) != want[i]:
        return None
    return _gap(probs[0], served)


def compare_output(
    fresh: ServerProcess, tokens: Sequence[int], generated: Sequence[int], arch: str
) -> OutputDiff | None:
    """``generated`` against a fresh cache-less server: None if equal, else where and by what gap it differs.

    The gap is the served token's logprob below the fresh server's best at the first difference (not
    only the second best: the tiny models' logits are flat enough for three-way ties; a token every completion
    of the run bans is not a best, :func:`~harness.targets.llama_server.withheld_tokens`), read from the
    fresh generation's own reported probabilities, or, where the server withheld them (a token that
    leaves the text inside a UTF-8 sequence), recomputed in the same batch shape
    (:func:`_gap_resumed`); whether it is within the batch-shape findings' bound is
    :attr:`OutputDiff.batch_shape_flip`.
    """
    withheld = withheld_tokens(fresh.binary)
    r = sampleable(fresh.completion(list(tokens), len(generated), ignore_eos=True, return_tokens=True,
                                    cache_prompt=False, n_probs=10 + len(withheld)), withheld)  # fmt: skip
    want = [int(t) for t in r.get("tokens") or ()]
    if want == list(generated):
        return None
    n = min(len(want), len(generated))
    i = next((k for k, (a, b) in enumerate(zip(want, generated, strict=False)) if a != b), n)
    probs = r.get("completion_probabilities") or []
    reported = [k for k, ok in enumerate(_pieces_complete(want)) if ok]
    gap: float | None = None
    if i < n and [want[k] for k in reported] == [int(p["id"]) for p in probs]:
        if i in reported:
            gap = _gap(probs[reported.index(i)], int(generated[i]))
        else:
            gap = _gap_resumed(fresh, tokens, want, i, int(generated[i]))
    return OutputDiff(arch, tuple(int(t) for t in tokens), tuple(int(t) for t in generated), tuple(want), i, gap)
