"""``server_prompt``, ``server_prompt_cache_state`` and ``server_prompt_cache``.

Upstream: tools/server/server-task.h:566-640 and tools/server/server-task.cpp:1691-1905, llama.cpp
commit 0c1e570 (vendored by llama-cpp-python 0.3.36). Method bodies follow the C++ line by line;
comments give the upstream line of each step. Float arithmetic that upstream does in ``float`` is
done in binary32 here (:func:`f32`) so that ratios and limits round as they do in C++.

Deviations, each deliberate:

* Tokens are text-only (``tuple[int, ...]``); media chunks of ``server_tokens`` are not modelled, so
  ``get_common_prefix`` is a plain longest common prefix and ``pos_next(n) == n``.
* ``limit_size`` is in bytes as upstream, but the constructor takes the ``--cache-ram`` value and
  a unit (1 MiB upstream) so that synthetic states of a few KiB can exercise the limits.
* Under ``shared`` semantics (PR #27451) the whole entry construction in :meth:`alloc` runs inside
  the ``bad_alloc`` handler; under ``master`` only the two state-buffer allocations do, and a
  ``BadAlloc`` from the token clone, the checkpoint copy or the list append escapes (a crash).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass, field

from harness.errors import BadAlloc
from harness.model.checkpoint import CheckpointList
from harness.model.memory import ENTRY_HEADER_BYTES, LIST_NODE_BYTES, TOKEN_BYTES, Host, Payload
from harness.model.provider import STATE_SEQ_FLAGS_NONE, StateProvider
from harness.model.semantics import Semantics

__all__ = [
    "ServerPrompt",
    "ServerPromptCache",
    "ServerPromptCacheState",
    "ServerPromptData",
    "f32",
    "get_common_prefix",
]

Tokens = tuple[int, ...]


def f32(x: float) -> float:
    """Round to IEEE binary32, as a C++ ``float`` holds it."""
    return _F32.unpack(_F32.pack(x))[0]  # type: ignore[no-any-return]


_F32 = struct.Struct("<f")
_F32_EXACT = 1 << 24  # every integer below it is exact in binary32 (a 24-bit significand)


def get_common_prefix(a: Tokens, b: Tokens) -> int:
    """``server_tokens::get_common_prefix`` (server-common.cpp:697) for text-only tokens."""
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def clone_tokens(host: Host, tokens: Tokens) -> Tokens:
    """``server_tokens::clone()``: a new token array (an allocation that may fail)."""
    host.allocate("tokens.clone", TOKEN_BYTES * len(tokens))
    return tuple(tokens)


@dataclass
class ServerPrompt:
    """``server_prompt`` (server-task.h:566): the slot's tokens and its context checkpoints."""

    tokens: Tokens
    checkpoints: CheckpointList

    @classmethod
    def empty(cls, host: Host) -> ServerPrompt:
        return cls((), CheckpointList(host))

    # server-task.h:571
    def clear(self) -> None:
        self.tokens = ()
        self.checkpoints.clear()

    # server-task.h:576
    def n_tokens(self) -> int:
        return len(self.tokens)

    # server-task.h:580
    def clone(self) -> ServerPrompt:
        """Token clone, then the checkpoint list copied by value (deep in master, shared in PR)."""
        host = self.checkpoints.host
        tokens = clone_tokens(host, self.tokens)
        return ServerPrompt(tokens, self.checkpoints.copy())

    def take(self) -> ServerPrompt:
        """``std::move(prompt)``: the result owns tokens and checkpoints, this one is left empty."""
        out = ServerPrompt(self.tokens, self.checkpoints.take())
        self.tokens = ()
        return out

    def assign(self, other: ServerPrompt) -> None:
        """Move-assignment: the old checkpoints are destroyed, ``other``'s are adopted."""
        old = self.checkpoints
        self.tokens, self.checkpoints = other.tokens, other.checkpoints
        old.clear()


@dataclass
class ServerPromptData:
    """``server_prompt_data`` (server-task.h:588): full target and draft state of a cache entry."""

    main: Payload | None = None
    drft: Payload | None = None

    # server-task.h:592
    def size(self) -> int:
        return (self.main.nbytes if self.main else 0) + (self.drft.nbytes if self.drft else 0)

    def clear_main(self) -> None:
        """``data.main.clear(); data.main.shrink_to_fit()``."""
        if self.main is not None:
            self.main.release()
            self.main = None

    def clear_drft(self) -> None:
        if self.drft is not None:
            self.drft.release()
            self.drft = None


@dataclass(eq=False)
class ServerPromptCacheState:
    """``server_prompt_cache_state`` (server-task.h:597): one cache entry."""

    prompt: ServerPrompt
    data: ServerPromptData = field(default_factory=ServerPromptData)

    # server-task.h:601
    def size(self) -> int:
        # data.size() and each ckpt.size() (common.cpp:2260), inline: the cache's size() asks every
        # entry, ~33k times a gate run on np3
        d = self.data
        res = (d.main.nbytes if d.main is not None else 0) + (d.drft.nbytes if d.drft is not None else 0)
        for ckpt in self.prompt.checkpoints.items:
            for p in (ckpt.data_tgt, ckpt.data_dft, ckpt.data_spec):
                if p is not None:
                    res += p.nbytes
        return res

    def payloads(self) -> list[Payload]:
        out = [p for p in (self.data.main, self.data.drft) if p is not None]
        for c in self.prompt.checkpoints.items:
            out.extend(c.payloads())
        return out

    def destroy(self) -> None:
        self.data.clear_main()
        self.data.clear_drft()
        self.prompt.checkpoints.clear()


class ServerPromptCache:
    """``server_prompt_cache`` (server-task.h:612, server-task.cpp:1691-1905 @ 0c1e570).

    ``states`` is the ``std::list``: front = oldest. ``limit_size`` in bytes (0 = no limit),
    ``limit_tokens`` in tokens (0 = no limit; the server passes ``n_ctx``).
    """

    def __init__(
        self,
        host: Host,
        sem: Semantics,
        limit_size_mib: int,
        limit_tokens: int,
        *,
        unit: int = 1024 * 1024,
        makes_room: bool = True,
    ) -> None:
        self.host = host
        self.sem = sem
        # upstream before about b10001 (b9780's server-task.cpp:1623): alloc neither skips an over-limit entry nor
        # makes room; the update() after the save evicts for size (harness.trees.switches: alloc_without_room)
        self.makes_room = makes_room
        self.evictions = 0  # entries popped by update() (statistics; not upstream)
        self.loads = 0  # entries moved into a slot by load() (statistics; not upstream)
        # server-task.h:613
        self.limit_size = unit * (0 if limit_size_mib < 0 else limit_size_mib)
        self.limit_tokens = limit_tokens
        self.states: list[ServerPromptCacheState] = []
        self.log: list[str] = []

    def __iter__(self) -> Iterator[ServerPromptCacheState]:
        return iter(list(self.states))

    def __len__(self) -> int:
        return len(self.states)

    # ---- std::list operations: every removal destroys the entry --------------------------

    def _erase(self, entry: ServerPromptCacheState) -> None:
        self.states.remove(entry)
        entry.destroy()

    def _pop_front(self) -> None:
        self.evictions += 1
        self._erase(self.states[0])

    # server-task.cpp:1691
    def size(self) -> int:
        res = 0
        for state in self.states:
            res += state.size()
        return res

    # server-task.cpp:1701
    def n_tokens(self) -> int:
        res = 0
        for state in self.states:
            res += len(state.prompt.tokens)  # prompt.n_tokens(), inline: ~30k calls a gate run on np3
        return res

    # server-task.cpp:1711
    def alloc(self, prompt: ServerPrompt, state_size_tgt: int, state_size_dft: int) -> ServerPromptCacheState | None:
        """Make room for ``prompt`` and append an entry with zeroed state buffers, or return None.

        Order (server-task.cpp:1711-1791): contained check; logical size incl. checkpoints;
        over-limit skip; removal of entries that are prefixes of the new prompt; evict oldest until
        it fits; allocate (inside ``try``: recovery ``limit_size = max(1, 0.4*size())``, ``update()``,
        return None); append the entry.
        """
        # :1713 first check if the current state is contained fully in the cache
        for state in self.states:
            if get_common_prefix(state.prompt.tokens, prompt.tokens) == len(prompt.tokens):
                self.log.append("prompt is already in the cache, skipping")
                return None

        # :1722 checkpoints size
        checkpoints_size = 0
        for ckpt in prompt.checkpoints.items:
            checkpoints_size += ckpt.size()
        state_size_new = state_size_tgt + state_size_dft + checkpoints_size

        # :1730 skip over-limit entries to avoid disturbing the cache
        if self.makes_room and self.limit_size > 0 and state_size_new > self.limit_size:
            self.log.append(f"prompt state size {state_size_new} exceeds cache size limit {self.limit_size}")
            return None

        self._remove_obsolete(prompt)
        if self.makes_room:
            self._make_room(state_size_new)

        # :1762 allocate the new state buffers inside the try (both semantics)
        tgt: Payload | None = None
        dft: Payload | None = None
        try:
            tgt = self.host.alloc_payload("alloc.state_tgt", state_size_tgt, "state_main")
            dft = self.host.alloc_payload("alloc.state_dft", state_size_dft, "state_drft")
        except BadAlloc as e:
            if tgt is not None:
                tgt.release()
            self._recover(e)
            return None

        if not self.sem.wide_try:
            # :1779 master: outside the try, a BadAlloc propagates out of the cache (the process terminates)
            return self._push_back(prompt, tgt, dft)

        # PR #27451: the whole construction, states.push_back included, inside the try
        try:
            return self._push_back(prompt, tgt, dft)
        except BadAlloc as e:
            self._recover(e)
            return None

    def _remove_obsolete(self, prompt: ServerPrompt) -> None:
        """:1737 remove any cached prompts that are fully contained in the current prompt."""
        for state in list(self.states):
            n = get_common_prefix(state.prompt.tokens, prompt.tokens)
            if n == len(state.prompt.tokens):
                self.log.append(f"removing obsolete cached prompt with length {n}")
                self._erase(state)

    def _make_room(self, state_size_new: int) -> None:
        """:1750 make room before allocating the new vectors to avoid breaching the limit."""
        if self.limit_size > 0:
            while self.states and self.size() + state_size_new > self.limit_size:
                self.log.append(f"making room, removing oldest entry (size = {self.states[0].size()})")
                self._pop_front()

    def _push_back(self, prompt: ServerPrompt, tgt: Payload | None, dft: Payload | None) -> ServerPromptCacheState:
        """``states.push_back({{prompt.tokens.clone(), prompt.checkpoints}, {move(tgt), move(dft)}})``.

        Takes ownership of ``tgt``/``dft``: if an allocation fails, the temporaries (the buffers, the
        token clone, the checkpoint copies) are released before ``BadAlloc`` propagates, as stack
        unwinding would.
        """
        checkpoints: CheckpointList | None = None
        try:
            tokens = clone_tokens(self.host, prompt.tokens)
            checkpoints = prompt.checkpoints.copy()
            self.host.allocate("alloc.states_push_back", LIST_NODE_BYTES + ENTRY_HEADER_BYTES)
        except BaseException:  # stack unwinding frees the temporaries, whatever is thrown
            if checkpoints is not None:
                checkpoints.clear()
            for p in (tgt, dft):
                if p is not None:
                    p.release()
            raise
        entry = ServerPromptCacheState(ServerPrompt(tokens, checkpoints), ServerPromptData(tgt, dft))
        self.states.append(entry)
        return entry

    def _recover(self, e: BadAlloc) -> None:
        """The ``catch (const std::bad_alloc &)`` body (server-task.cpp:1767-1776)."""
        self.log.append(f"failed to allocate memory for prompt cache state: {e}")
        self.limit_size = max(1, int(0.4 * self.size()))
        self.log.append(f"cache size limit reduced to {self.limit_size}")
        self.update()

    # server-task.cpp:1793
    def load(
        self,
        prompt: ServerPrompt,
        tokens_new: Tokens,
        ctx_tgt: StateProvider,
        ctx_dft: StateProvider | None,
        id_slot: int,
    ) -> bool:
        """Move the best entry into ``prompt`` and restore its state; False if a restore fails."""
        lcp_best = get_common_prefix(prompt.tokens, tokens_new)
        f_keep_best = f32(lcp_best / len(prompt.tokens)) if prompt.tokens else -1.0
        f_sim_best = f32(lcp_best / len(tokens_new))

        best: ServerPromptCacheState | None = None
        # :1803 find the most similar cached prompt, that would also preserve the most context
        for state in self.states:
            lcp_cur = get_common_prefix(state.prompt.tokens, tokens_new)
            f_keep_cur = f32(lcp_cur / len(state.prompt.tokens)) if state.prompt.tokens else float("nan")
            f_sim_cur = f32(lcp_cur / len(tokens_new))
            # don't trash large prompts
            if f_keep_cur < 0.25:
                continue
            if f_keep_best < f_keep_cur and f_sim_best < f_sim_cur:
                f_keep_best = f_keep_cur
                f_sim_best = f_sim_cur
                best = state

        if best is None:
            return True

        # :1828 restore the target state, then free it
        data = best.data.main
        size = data.nbytes if data is not None else 0
        n = ctx_tgt.state_seq_set_data_ext(id_slot, data.data if data is not None else b"", STATE_SEQ_FLAGS_NONE)
        if n != size:
            self.log.append(f"failed to restore state with size {size}")
            return False
        best.data.clear_main()

        # :1842 the draft state, if any
        if best.data.drft is not None:
            assert ctx_dft is not None, "GGML_ASSERT(ctx_dft)"
            size = best.data.drft.nbytes
            n = ctx_dft.state_seq_set_data_ext(id_slot, best.data.drft.data, STATE_SEQ_FLAGS_NONE)
            if n != size:
                self.log.append(f"failed to restore draft state with size {size}")
                return False
            best.data.clear_drft()

        # :1860 prompt = std::move(it_best->prompt); states.erase(it_best);
        prompt.assign(best.prompt.take())
        self._erase(best)
        self.loads += 1
        return True

    # server-task.cpp:1870
    def update(self) -> int:
        """Evict oldest entries over the byte limit, then over the token limit; returns the latter. (Before about
        b10001, with an alloc that makes no room, update() always kept one entry: b9780's server-task.cpp:1755.)"""
        keep = 0 if self.makes_room else 1
        if self.limit_size > 0:
            while len(self.states) > keep and self.size() > self.limit_size:
                self.log.append(f"cache size limit reached, removing oldest entry (size = {self.states[0].size()})")
                self._pop_front()

        # average size per token (float arithmetic, as upstream)
        # (an integer below 2**24 is exact in binary32: f32 of its float is the float itself, not rounded)
        size, n_tok, limit = self.size(), max(1, self.n_tokens()), self.limit_size
        f_size = float(size) if size < _F32_EXACT else f32(float(size))
        f_n = float(n_tok) if n_tok < _F32_EXACT else f32(float(n_tok))
        size_per_token = max(1.0, f32(f_size / f_n))
        # dynamically increase the token limit if it can fit in the memory limit
        if limit > 0:
            f_limit = float(limit) if limit < _F32_EXACT else f32(float(limit))
            limit_tokens_cur = max(self.limit_tokens, int(f32(f_limit / size_per_token)))
        else:
            limit_tokens_cur = self.limit_tokens

        if self.limit_tokens > 0:
            while len(self.states) > keep and self.n_tokens() > limit_tokens_cur:
                self.log.append(f"cache token limit ({self.limit_tokens}, est: {limit_tokens_cur}) reached")
                self._pop_front()
        return limit_tokens_cur
