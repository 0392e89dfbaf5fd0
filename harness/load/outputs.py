"""Outputs under load against a fresh cache-less server, and the known findings that explain a difference.

:func:`compare_output` compares a response's tokens with a fresh single-slot server's (greedy, no
cache) and tells a rounding tie from a real divergence; :class:`Divergences` decides which
differences a known finding explains (``concurrent-output-divergence``, ``busy-slot-by-id``,
``decode-exception-keeps-slot-tokens``) and which are mismatches. Used by the concurrent differential and the soak.
"""

from __future__ import annotations

from collections.abc import Sequence

from harness.backends.llama_server.differential import NEAR_TIE_LOGPROB
from harness.targets.llama_server import ServerProcess

__all__ = ["ATTENTION_ARCHS", "Divergences", "compare_output"]

# models with attention layers: their outputs under concurrent requests show concurrent-output-divergence
ATTENTION_ARCHS = frozenset({"llama", "gemma2", "jamba", "lfm2"})


class Divergences:
    """Outputs unlike a fresh server's that a known finding explains.

    ``concurrent-output-divergence``: on a model with attention layers (:data:`ATTENTION_ARCHS`),
    requests evaluated while other slots are evaluated too can come out unlike a sequential
    evaluation, with or without the prompt cache (``--cache-ram 0`` shows it as well), and the wrong
    state stays in the slot and in cache entries saved from it: on those models a divergence is
    counted as that finding, and the cache's own correctness under load is checked on ``mamba``
    (pure recurrent), where it never showed. ``busy-slot-by-id``: a response changed by it leaves
    wrong state the same way; a later divergence that reused ``cache_n`` tokens starting like such a
    response is explained by it. ``decode-exception-keeps-slot-tokens``: a request that failed with
    "decode() failed" (:meth:`failed_decode`, the faults-on phases) leaves its slot claiming tokens
    its memory never got; a divergence whose prompt starts like such a request's (at least
    :data:`SHARED_HEAD` tokens) reused them. Anything else is a mismatch.
    """

    SHARED_HEAD = 4  # the soak's prompts are random token ids: 4 shared first tokens are no chance

    def __init__(self, arch: str) -> None:
        self.arch = arch
        self.seen: list[tuple[int, ...]] = []
        self.failed: list[tuple[int, ...]] = []

    def add(self, tokens: Sequence[int], generated: Sequence[int]) -> None:
        self.seen.append((*tokens, *generated))

    def failed_decode(self, tokens: Sequence[int]) -> None:
        """A request that ended in "decode() failed": its slot may keep its tokens unevaluated."""
        self.failed.append(tuple(tokens))

    def explains(self, tokens: Sequence[int], cache_n: int) -> bool:
        if self.arch in ATTENTION_ARCHS:
            return True
        head = tuple(tokens[:cache_n])
        if cache_n > 0 and any(s[:cache_n] == head for s in self.seen):
            return True
        return self.after_failed_decode(tokens, cache_n)

    def after_failed_decode(self, tokens: Sequence[int], cache_n: int) -> bool:
        """Whether the prompt reused a prefix of a request that failed in decode()."""
        k = self.SHARED_HEAD
        head = tuple(tokens[:k])
        return cache_n >= k and any(f[:k] == head for f in self.failed)


def compare_output(fresh: ServerProcess, tokens: Sequence[int], generated: Sequence[int]) -> str | None:
    """``generated`` against a fresh cache-less server: None if equal, "near-tie", or what differs.

    As :func:`harness.backends.llama_server.check_output`, but a flip counts as a near-tie whenever the
    token served is within :data:`NEAR_TIE_LOGPROB` of the fresh server's best at the first difference
    (not only when it is the second best): the tiny models' logits are flat enough for three-way ties,
    and batches of several slots move them as a cache path does (``greedy-flip-on-cache-path``).
    The difference names the served token's logprob gap, so a real divergence is told from a tie.
    """
    r = fresh.completion(list(tokens), len(generated), ignore_eos=True, return_tokens=True, cache_prompt=False,
                         n_probs=10)  # fmt: skip
    want = [int(t) for t in r.get("tokens") or ()]
    if want == list(generated):
        return None
    n = min(len(want), len(generated))
    i = next((k for k, (a, b) in enumerate(zip(want, generated, strict=False)) if a != b), n)
    probs = r.get("completion_probabilities") or []
    ids = [int(p["id"]) for p in probs]
    off = next((o for o in range(len(want) - len(ids) + 1) if want[o : o + len(ids)] == ids), None)
    gap: float | None = None
    if off is not None and 0 <= i - off < len(probs) and i < len(generated):
        top = probs[i - off].get("top_logprobs") or []
        got = [float(t["logprob"]) for t in top if int(t["id"]) == int(generated[i])]
        if top and got:
            gap = float(top[0]["logprob"]) - got[0]
    if gap is not None and gap < NEAR_TIE_LOGPROB:
        return "near-tie"
    how = f"logprob gap {gap:.3f}" if gap is not None else "not in the fresh server's top 10"
    return (f"{len(tokens)}-token prompt (…{list(tokens[-3:])}): token {i} differs ({how}): generated "
            f"{list(generated)}, a fresh server generates {want}")  # fmt: skip
