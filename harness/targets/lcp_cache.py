"""Target adapter: llama-cpp-python's own prompt caches, ``LlamaRAMCache`` and ``LlamaDiskCache``.

llama-cpp-python 0.3.36 caches whole ``LlamaState`` objects (``Llama.save_state()``: the libllama state
bytes plus the ``scores`` and ``input_ids`` arrays) keyed by token tuples. ``Llama.create_completion``
looks a prompt up with ``cache[prompt_tokens]`` (the stored key with the longest common prefix),
loads the state when it covers more of the prompt than the context already does, and stores
``cache[prompt + completion] = save_state()`` afterwards.

This module holds what the properties (:mod:`properties.lcp_machine`), the fault layers
(:mod:`faults.lcp_cache`) and the gate runner (:mod:`harness.backends.lcp_cache`) share about the target:
real states of the tiny fixtures models (:class:`ModelEnv`), both caches behind one observing
interface (:class:`CacheAdapter`), and the in-process seam that raises ``MemoryError`` at the Nth
size computation or pickling inside ``cache[key] = state`` (:func:`seam_armed`).
"""

from __future__ import annotations

import contextlib
import importlib
import os
import pickle
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

import numpy as np

from fixtures.gguf import model_path

__all__ = [
    "ALPHABET",
    "BOS",
    "CACHES",
    "NEXT_TOKEN",
    "N_CTX",
    "TMP",
    "CacheAdapter",
    "Key",
    "ModelEnv",
    "Seam",
    "held_bytes",
    "lcp",
    "llama_cpp",
    "seam_armed",
    "state_key",
]

CACHES = ("ram", "disk")
N_CTX = 128
BOS = 1
ALPHABET = (3 + ord("a"), 3 + ord("b"), 3 + ord("c"))  # byte tokens: few letters, so prefixes meet often
NEXT_TOKEN = 3 + ord("z")  # what every restore check decodes after the reused prefix and the rest of q
# disk caches go to a RAM-backed tmpfs when there is one: SQLite's fsyncs on a shared disk dominate otherwise
TMP = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


def llama_cpp() -> ModuleType:
    """llama-cpp-python, imported on first use (the other backends run without it)."""
    return importlib.import_module("llama_cpp")


Key = tuple[int, ...]


def lcp(a: Sequence[int], b: Sequence[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


# ---- real states ------------------------------------------------------------------------------


class ModelEnv:
    """Two ``Llama`` contexts of one tiny model: ``src`` saves states and evaluates fresh, ``dst`` restores."""

    def __init__(self, arch: str, n_ctx: int = N_CTX) -> None:

        lc = llama_cpp()
        kw: dict[str, Any] = {
            "model_path": str(model_path(arch)),
            "n_ctx": n_ctx,
            "n_batch": n_ctx,
            "n_threads": 1,
            "n_threads_batch": 1,
            "verbose": False,
            "logits_all": True,
        }
        self.arch = arch
        self.src = lc.Llama(**kw)
        self.dst = lc.Llama(**kw)
        self.truncatable = not (self.src._is_recurrent or self.src._is_hybrid)
        self._states: dict[Key, Any] = {}
        self._fresh: dict[tuple[Key, int, Key], np.ndarray] = {}

    def state(self, key: Key) -> Any:
        """A new ``LlamaState`` object for ``key`` (buffers shared between calls; they are never written)."""
        s = self._states.get(key)
        if s is None:
            self.src.reset()
            self.src.eval(list(key))
            s = self._states[key] = self.src.save_state()
        return type(s)(s.input_ids, s.scores, s.n_tokens, s.llama_state, s.llama_state_size, s.seed)

    def usable(self, key: Sequence[int], query: Sequence[int]) -> int:
        """How many tokens of ``query`` a ``Llama`` can reuse after loading ``key``'s state."""
        n = lcp(key, query)
        if self.truncatable:
            return n
        return len(key) if n == len(key) else 0

    def fresh_logits(self, key: Key, keep: int, rest: Key) -> np.ndarray:
        """Logits after ``eval(key)``, truncation to ``keep`` tokens and ``eval(rest)`` on the saving context."""
        k = (key, keep, rest)
        if k not in self._fresh:
            self.src.reset()
            self.src.eval(list(key))
            self._truncate(self.src, keep)
            self.src.eval(list(rest))
            self._fresh[k] = self.src.scores[self.src.n_tokens - 1].copy()
        return self._fresh[k]

    def restored_logits(self, state: Any, keep: int, rest: Key) -> np.ndarray:
        self.dst.load_state(state)
        self._truncate(self.dst, keep)
        self.dst.eval(list(rest))
        return np.asarray(self.dst.scores[self.dst.n_tokens - 1].copy())

    @staticmethod
    def _truncate(llm: Any, keep: int) -> None:
        if keep < llm.n_tokens:
            if not llm._ctx.kv_cache_seq_rm(-1, keep, -1):
                raise RuntimeError(f"cannot truncate the memory to {keep} tokens")
            llm.n_tokens = keep

    def close(self) -> None:
        for llm in (self.src, self.dst):
            with contextlib.suppress(Exception):
                llm.close()


def state_key(state: Any) -> Key:
    return tuple(int(t) for t in state.input_ids[: state.n_tokens])


def held_bytes(state: Any) -> int:
    """The bytes of payload a cached ``LlamaState`` keeps alive."""
    return len(state.llama_state) + int(state.scores.nbytes) + int(state.input_ids.nbytes)


# ---- the two caches behind one interface --------------------------------------------------------


class CacheAdapter:
    """Makes a cache of one kind and observes it without changing it."""

    def __init__(self, kind: str, tmp: str | None = TMP) -> None:
        if kind not in CACHES:
            raise ValueError(f"unknown cache kind {kind!r}")
        self.kind = kind
        self.tmp = tmp  # where disk caches go (a child gets a directory its parent removes)
        self._dirs: list[str] = []
        self._sizes: dict[tuple[Key, int], int] = {}

    def make(self, capacity: int) -> Any:
        lc = llama_cpp()
        if self.kind == "ram":
            return lc.LlamaRAMCache(capacity_bytes=capacity)
        d = tempfile.mkdtemp(prefix="lcp-disk-", dir=self.tmp)
        self._dirs.append(d)
        return lc.LlamaDiskCache(cache_dir=d, capacity_bytes=capacity)

    def keys(self, cache: Any) -> list[Key]:
        """Stored keys, oldest (first to be evicted) first."""
        if self.kind == "ram":
            return list(cache.cache_state.keys())
        return [tuple(k) for k in iter(cache.cache)]

    def peek(self, cache: Any, key: Key) -> Any:
        return cache.cache_state[key] if self.kind == "ram" else cache.cache.get(key)

    def entry_size(self, state: Any) -> int:
        """What one entry adds to ``cache_size``: RAM, ``llama_state_size``; disk, the growth of ``volume()``
        when it is stored alone (its pickle and the SQLite pages that hold it), measured once per key."""
        if self.kind == "ram":
            return int(state.llama_state_size)
        key = (state_key(state), len(state.llama_state))
        if key not in self._sizes:
            probe = self.make(1 << 40)
            try:
                empty = int(probe.cache_size)
                with self.quiet():
                    probe[key[0]] = state
                self._sizes[key] = int(probe.cache_size) - empty
            finally:
                self.close(probe)
                shutil.rmtree(self._dirs.pop(), ignore_errors=True)
        return self._sizes[key]

    def base(self) -> int:
        """``cache_size`` of an empty cache (disk: the SQLite database's pages)."""
        if self.kind == "ram":
            return 0
        probe = self.make(1 << 40)
        try:
            return int(probe.cache_size)
        finally:
            self.close(probe)
            shutil.rmtree(self._dirs.pop(), ignore_errors=True)

    def held(self, cache: Any) -> int:
        """RAM: the payload buffers the stored states keep alive; disk: the stored values' pickled sizes."""
        if self.kind == "ram":
            return sum(held_bytes(s) for s in cache.cache_state.values())
        return sum(len(pickle.dumps(cache.cache.get(k), protocol=pickle.HIGHEST_PROTOCOL)) for k in self.keys(cache))

    def snapshot(self, cache: Any) -> list[tuple[Key, bytes]]:
        return [(k, self.peek(cache, k).llama_state) for k in self.keys(cache)]

    @contextlib.contextmanager
    def quiet(self) -> Iterator[None]:
        """LlamaDiskCache.__setitem__ prints four lines to stderr on every insert."""
        if self.kind == "ram":
            yield
            return
        with open(os.devnull, "w") as devnull, contextlib.redirect_stderr(devnull):
            yield

    def close(self, cache: Any) -> None:
        if self.kind == "disk" and cache is not None:
            with contextlib.suppress(Exception):
                cache.cache.close()

    def cleanup(self) -> None:
        for d in self._dirs:
            shutil.rmtree(d, ignore_errors=True)
        self._dirs.clear()


# ---- the model seam: a MemoryError at the Nth size computation or pickling ----------------------


class Seam:
    def __init__(self, nth: int) -> None:
        self.nth = nth
        self.count = 0
        self.fired = False

    def tick(self) -> None:
        self.count += 1
        if self.count == self.nth:
            self.fired = True
            raise MemoryError(f"injected at call #{self.nth}")


@contextlib.contextmanager
def seam_armed(cache: Any, where: str, nth: int) -> Iterator[Seam]:
    """Raise ``MemoryError`` at the ``nth`` ``cache_size`` read (``size``) or ``LlamaState`` pickling (``pickle``)."""
    seam = Seam(nth)
    cls = type(cache)
    if where == "size":
        owner = next(c for c in cls.__mro__ if "cache_size" in c.__dict__)
        orig = owner.__dict__["cache_size"]

        def fget(self: Any) -> int:
            seam.tick()
            return int(orig.fget(self))

        setattr(cls, "cache_size", property(fget))  # noqa: B010
        try:
            yield seam
        finally:
            if owner is cls:
                setattr(cls, "cache_size", orig)  # noqa: B010
            else:
                delattr(cls, "cache_size")
    elif where == "pickle":
        state_cls = llama_cpp().llama.LlamaState

        def reduce_ex(self: Any, proto: Any) -> Any:
            seam.tick()
            return object.__reduce_ex__(self, proto)

        state_cls.__reduce_ex__ = reduce_ex
        try:
            yield seam
        finally:
            del state_cls.__reduce_ex__
    else:
        raise ValueError(where)
