"""Prompt-cache properties on llama-cpp-python's own caches: ``LlamaRAMCache`` and ``LlamaDiskCache``.

llama-cpp-python 0.3.36 caches whole ``LlamaState`` objects (``Llama.save_state()``: the libllama state
bytes plus the ``scores`` and ``input_ids`` arrays) keyed by token tuples. ``Llama.create_completion``
looks a prompt up with ``cache[prompt_tokens]`` (the stored key with the longest common prefix),
loads the state when it covers more of the prompt than the context already does, and stores
``cache[prompt + completion] = save_state()`` afterwards. This module checks, on real states of the
tiny fixtures models (:mod:`fixtures.models`), the properties a user of such a cache relies on:

``capacity``      ``cache_size <= capacity_bytes`` after every insert.
``accounting``    ``cache_size`` covers the bytes the cache really holds: RAM, every stored state's
                  ``llama_state`` + ``scores`` + ``input_ids`` buffers; disk, every stored value's pickled size
                  (``cache_size`` is diskcache's ``volume()``, which adds the SQLite pages).
``lookup``        ``cache[q]`` returns the entry a user would load for ``q``: the stored key that lets the
                  most of ``q`` be reused (the longest common prefix when the model can truncate its memory,
                  the longest stored key that is a prefix of ``q`` when it cannot: recurrent and hybrid
                  models), a miss when nothing is reusable, and a lookup keeps the entry.
``restore``       a state from the cache, loaded into another ``Llama`` and continued with the rest of ``q``
                  (after truncating to the reused prefix), gives bit for bit the logits of the ``Llama`` that
                  saved it continued in the same batches.
``eviction``      the RAM cache evicts least recently used first (``__getitem__`` moves the hit to the end of
                  its ``OrderedDict``; ``__setitem__`` pops from the front); the disk cache evicts oldest first
                  and what it keeps is always the newest entries.
``oversize``      an entry larger than ``capacity_bytes`` is refused and costs nothing already cached.
``fault_atomic``  after a failure inside ``cache[key] = state`` (a ``MemoryError`` from the size
                  computation or the pickling at its Nth call, a CPython allocation failure, an address-space
                  limit), the cache holds either exactly what it held before, or that plus the new entry,
                  complete, with the capacity enforced.

How it runs (:func:`run_lcp_gate`): a Hypothesis ``RuleBasedStateMachine`` per model (``llama``: a KV
cache; ``mamba``: recurrent) inserts prompts' states, looks up prompts (stored keys, prefixes,
extensions, divergent ones), restores and continues, shrinks the capacity and injects size/pickle
faults, against a reference model (an ordered dict of keys and sizes). A failing property is
diagnosed: when it is one of :data:`KNOWN_LCP_FINDINGS`, it is reported, the reference model adopts
upstream's behaviour for it, and the machine runs again to check everything else; an undiagnosed
failure goes into ``"failures"`` with its shrunk program and a replay command. Then two child-process
layers: CPython allocation failures (``_testcapi.set_nomemory``) swept over ``cache[key] = state``, and
``RLIMIT_AS`` in a forked child around a re-insert. Every temporary directory is removed.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import importlib
import json
import os
import pickle
import resource
import shutil
import sys
import tempfile
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from faults.kinds import Outcome, died
from fixtures.models import model_path
from harness.backends.base import Backend, Failure, GateOptions, GateReport, MachineResult, Out
from harness.child import child_setup, run_child
from harness.errors import PropertyFailure
from harness.findings import finding
from properties.machine import MachineConfig
from properties.run import run_seeded

__all__ = [
    "CACHES",
    "KNOWN_LCP_FINDINGS",
    "PROPERTIES",
    "LcpFinding",
    "LcpViolation",
    "ModelEnv",
    "diagnose_fault",
    "machine_class",
    "run_lcp_gate",
]

ROOT = Path(__file__).resolve().parents[2]
CACHES = ("ram", "disk")
PROPERTIES = ("capacity", "accounting", "lookup", "restore", "eviction", "oversize", "fault_atomic")
N_CTX = 128
BOS = 1
ALPHABET = (3 + ord("a"), 3 + ord("b"), 3 + ord("c"))  # byte tokens: few letters, so prefixes meet often
NEXT_TOKEN = 3 + ord("z")  # what every restore check decodes after the reused prefix and the rest of q
MACHINE_ARCHS = ("llama", "mamba")
# disk caches go to a RAM-backed tmpfs when there is one: SQLite's fsyncs on a shared disk dominate otherwise
_TMP = "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None
DEFAULT_EXAMPLES = 40
STEPS = 20


@dataclass(frozen=True)
class LcpFinding:
    """A property llama-cpp-python 0.3.36's cache does not have, with its standalone reproducer."""

    name: str
    property: str
    title: str
    reproducer: str
    caches: tuple[str, ...]


KNOWN_LCP_FINDINGS: list[LcpFinding] = [
    LcpFinding(
        "ram_size_ignores_scores",
        "accounting",
        "LlamaRAMCache.cache_size sums llama_state_size only; every entry also holds the state's scores "
        "(n_tokens x n_vocab float32) and input_ids (n_ctx int32), so capacity_bytes does not bound the memory",
        "fixtures/findings/lcp_ram_size_ignores_scores.py",
        ("ram",),
    ),
    LcpFinding(
        "oversize_flushes_cache",
        "oversize",
        "inserting an entry larger than capacity_bytes evicts every cached entry and then the new one: "
        "the cache ends empty",
        "fixtures/findings/lcp_oversize_flushes_cache.py",
        ("ram", "disk"),
    ),
    LcpFinding(
        "disk_lookup_removes_entry",
        "lookup",
        "LlamaDiskCache.__getitem__ pops the entry it returns: a second lookup of the same prompt misses",
        "fixtures/findings/lcp_disk_lookup_removes_entry.py",
        ("disk",),
    ),
    LcpFinding(
        "lookup_unusable_for_recurrent",
        "lookup",
        "_find_longest_prefix_key returns the key with the longest common prefix even when it diverges from "
        "the prompt; a recurrent model cannot truncate the loaded state, so Llama re-evaluates everything while "
        "a stored key that is a prefix of the prompt was usable",
        "fixtures/findings/lcp_lookup_unusable_for_recurrent.py",
        ("ram", "disk"),
    ),
    LcpFinding(
        "fault_leaves_over_capacity",
        "fault_atomic",
        "a MemoryError from the size computation in __setitem__'s eviction loop leaves the new entry in and the "
        "cache above capacity_bytes",
        "fixtures/findings/lcp_fault_leaves_over_capacity.py",
        ("ram", "disk"),
    ),
    LcpFinding(
        "reinsert_fault_loses_entry",
        "fault_atomic",
        "__setitem__ deletes an existing key before storing the new value; a failure in between (disk: "
        "pickling, e.g. under an address-space limit; RAM: the OrderedDict insertion) loses the cached entry",
        "fixtures/findings/lcp_reinsert_fault_loses_entry.py",
        ("ram", "disk"),
    ),
]
KNOWN_BY_NAME = {f.name: f for f in KNOWN_LCP_FINDINGS}


class LcpViolation(PropertyFailure):
    """A property failed; ``finding`` names the known finding it shows, or ``None`` when undiagnosed."""

    def __init__(self, prop: str, message: str, finding: str | None = None) -> None:
        super().__init__(prop, message, f"{prop}: {message}" + (f" [{finding}]" if finding else ""))
        self.prop = prop
        self.finding = finding


def _llama_cpp() -> ModuleType:
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

        lc = _llama_cpp()
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

    def __init__(self, kind: str) -> None:
        if kind not in CACHES:
            raise ValueError(f"unknown cache kind {kind!r}")
        self.kind = kind
        self._dirs: list[str] = []
        self._sizes: dict[tuple[Key, int], int] = {}

    def make(self, capacity: int) -> Any:
        lc = _llama_cpp()
        if self.kind == "ram":
            return lc.LlamaRAMCache(capacity_bytes=capacity)
        d = tempfile.mkdtemp(prefix="lcp-disk-", dir=_TMP)
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
        state_cls = _llama_cpp().llama.LlamaState

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


ALLOWED_STATES = ("unchanged", "inserted")


def diagnose_fault(
    before: Sequence[Key], after: Sequence[Key], key: Key, expected: Sequence[Key], over_capacity: bool
) -> tuple[str, str | None]:
    """Classify the cache's keys after a failed insert: ``(state, finding)``; ``finding`` None when allowed.

    Allowed: ``unchanged`` (``after == before``) and ``inserted`` (``after == expected``, the keys a
    successful insert leaves, with the capacity enforced).
    Findings: ``lost`` (a re-inserted key's old entry gone, the new one not stored) and ``over-capacity``
    (the new entry in, the eviction cut short above capacity_bytes).
    """
    before, after, expected = list(before), list(after), list(expected)
    if after == before:  # as before, even when a shrunk capacity_bytes was not enforced yet
        return "unchanged", None
    if after == expected and not over_capacity:
        return "inserted", None
    if key in before and after == [k for k in before if k != key]:
        return "lost", "reinsert_fault_loses_entry"
    full = [k for k in before if k != key] + [key]
    if after and after[-1] == key and after == full[len(full) - len(after) :] and over_capacity:
        return "over-capacity", "fault_leaves_over_capacity"
    return "inconsistent", None


# ---- the state machine --------------------------------------------------------------------------


@dataclass
class Stats:
    checked: Counter[str] = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)


prompts = st.lists(st.sampled_from(ALPHABET), min_size=0, max_size=7).map(lambda t: (BOS, *t))


def machine_class(
    env: ModelEnv, adapter: CacheAdapter, tolerate: frozenset[str], stats: Stats
) -> type[RuleBasedStateMachine]:
    """A machine on ``adapter``'s cache with ``env``'s states; findings in ``tolerate`` are modelled as upstream."""
    kind = adapter.kind
    # what one entry of the longest prompt counts for, and what an empty disk cache already counts
    unit = adapter.entry_size(env.state((BOS, *ALPHABET[:1] * 7)))
    base = adapter.base()

    class LcpCacheMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.capacity = base + 3 * unit
            self.cache = adapter.make(self.capacity)
            self.ref: OrderedDict[Key, int] = OrderedDict()  # key -> entry size, oldest first

        def teardown(self) -> None:
            adapter.close(self.cache)
            adapter.cleanup()

        # -- helpers
        def check(self, prop: str) -> None:
            stats.checked[prop] += 1

        def sync(self) -> None:
            self.ref = OrderedDict((k, self.ref.get(k) or adapter.entry_size(env.state(k))) for k in self.keys())

        def keys(self) -> list[Key]:
            return adapter.keys(self.cache)

        def expected_after_insert(self, key: Key, size: int) -> list[Key] | None:
            """Keys (oldest first) after a successful insert per the reference; None: undecidable (disk)."""
            ref = OrderedDict(self.ref)
            if base + size > self.capacity:
                if "oversize_flushes_cache" in tolerate:
                    return []
                if kind == "disk":
                    return list(ref)  # refused, nothing lost
                # refused; only what a shrunk capacity_bytes no longer allows goes
                while sum(ref.values()) > self.capacity and ref:
                    ref.popitem(last=False)
                return list(ref)
            ref.pop(key, None)
            ref[key] = size
            if kind == "disk":
                return None
            while sum(ref.values()) > self.capacity and ref:
                ref.popitem(last=False)
            return list(ref)

        def check_capacity_and_accounting(self) -> None:
            size = int(self.cache.cache_size)
            self.check("capacity")
            if size > self.capacity:
                raise LcpViolation("capacity", f"cache_size {size} > capacity_bytes {self.capacity}")
            self.check("accounting")
            held = adapter.held(self.cache)
            if kind == "ram":
                own = sum(int(s.llama_state_size) for s in self.cache.cache_state.values())
                if own != size or any(
                    len(s.llama_state) != s.llama_state_size for s in self.cache.cache_state.values()
                ):
                    raise LcpViolation("accounting", f"cache_size {size} != sum of llama_state_size {own}")
                if held > size and "ram_size_ignores_scores" not in tolerate:
                    raise LcpViolation(
                        "accounting",
                        f"{len(self.ref)} entries hold {held} bytes (llama_state {own} + scores and input_ids "
                        f"{held - own}) but cache_size is {size}",
                        "ram_size_ignores_scores",
                    )
            elif held > size:
                raise LcpViolation("accounting", f"stored values pickle to {held} bytes but cache_size is {size}")

        def check_order(self, what: str, expected: list[Key] | None) -> None:
            got = self.keys()
            self.check("eviction")
            if expected is None:  # disk: what is kept must be the newest entries, the new one included
                full = list(self.ref)
                if got != full[len(full) - len(got) :]:
                    raise LcpViolation("eviction", f"after {what}: kept {got}, not the newest of {full}")
                self.sync()
                return
            if got != expected:
                raise LcpViolation("eviction", f"after {what}: keys {got}, expected {expected} (oldest first)")
            self.sync()

        # -- rules
        @rule(key=prompts)
        def insert(self, key: Key) -> None:
            state = env.state(key)
            size = adapter.entry_size(state)
            before = self.keys()
            oversize = base + size > self.capacity
            expected = self.expected_after_insert(key, size)
            with adapter.quiet():
                self.cache[key] = state
            if oversize:
                self.check("oversize")
                got = self.keys()
                if got != expected:
                    finding = "oversize_flushes_cache" if not got and before else None
                    raise LcpViolation(
                        "oversize",
                        f"an entry of {size} bytes > capacity {self.capacity - base}: {len(before)} cached entries "
                        f"became {len(got)}",
                        finding,
                    )
            else:
                self.ref.pop(key, None)
                self.ref[key] = size
            self.check_capacity_and_accounting()
            self.check_order(f"insert {key}", expected)
            if not oversize and key not in self.keys():
                raise LcpViolation(
                    "eviction", f"the entry just inserted ({size} bytes, capacity {self.capacity}) is gone"
                )

        @rule(query=prompts)
        def lookup(self, query: Key) -> None:
            self.lookup_and_continue(query)

        @precondition(lambda self: len(self.ref) > 0)
        @rule(i=st.integers(0, 7), cut=st.integers(0, 3), ext=st.lists(st.sampled_from(ALPHABET), max_size=3))
        def lookup_related(self, i: int, cut: int, ext: list[int]) -> None:
            """Look up a stored key, a prefix of it, an extension of it, or a divergent sibling."""
            keys = list(self.ref)
            k = keys[i % len(keys)]
            q = k[: max(1, len(k) - cut)] + tuple(ext)
            self.lookup_and_continue(q)

        def lookup_and_continue(self, query: Key) -> None:
            keys = list(self.ref)
            usable = {k: env.usable(k, query) for k in keys}
            best = max(usable.values(), default=0)
            longest = max((lcp(k, query) for k in keys), default=0)
            try:
                state = self.cache[query]
            except KeyError:
                state = None
            self.check("lookup")
            got = None if state is None else state_key(state)
            if got is not None and got not in usable:
                raise LcpViolation("lookup", f"lookup {query} returned {got}, which is not a stored key")
            strict = "lookup_unusable_for_recurrent" not in tolerate
            if strict:
                ok = (got is None and best == 0) or (got is not None and best > 0 and usable[got] == best)
            else:  # upstream's rule: the longest common prefix, a miss only when nothing shares a token
                ok = (got is None and longest == 0) or (got is not None and longest > 0 and lcp(got, query) == longest)
            if not ok:
                finding = None
                if (
                    not env.truncatable
                    and (got is None) == (longest == 0)
                    and (got is None or lcp(got, query) == longest)
                ):
                    finding = "lookup_unusable_for_recurrent"
                raise LcpViolation(
                    "lookup",
                    f"lookup {query} among {keys} returned {got} (reusable {usable.get(got, 0) if got else 0}); "
                    f"the best reusable prefix is {best} tokens",
                    finding,
                )
            if got is not None:
                st_ = adapter.peek(self.cache, got) if kind == "ram" else None
                if st_ is not None and st_ is not state:
                    raise LcpViolation("lookup", f"lookup returned a state that is not the one stored under {got}")
                # the entry stays cached, and (RAM) becomes the most recently used
                after = self.keys()
                self.check("lookup")
                if got not in after:
                    if "disk_lookup_removes_entry" not in tolerate:
                        raise LcpViolation(
                            "lookup",
                            f"lookup {query} returned {got} and the entry is no longer cached ({len(after)} left)",
                            "disk_lookup_removes_entry" if kind == "disk" else None,
                        )
                    self.ref.pop(got)
                elif kind == "ram":
                    self.ref.move_to_end(got)
                self.check_order(f"lookup {query}", list(self.ref))
                keep = usable[got]
                if keep > 0:
                    self.restore_check(state, got, query, keep)

        def restore_check(self, state: Any, key: Key, query: Key, keep: int) -> None:
            rest = (*query[keep:], NEXT_TOKEN)
            want = env.fresh_logits(key, keep, rest)
            try:
                got = env.restored_logits(state, keep, rest)
            except RuntimeError as e:
                raise LcpViolation("restore", f"state of {key} could not be restored and continued: {e}") from e
            self.check("restore")
            if not np.array_equal(want.view(np.uint32), got.view(np.uint32)):
                diff = int(np.count_nonzero(want.view(np.uint32) != got.view(np.uint32)))
                raise LcpViolation(
                    "restore",
                    f"state of {key} restored, kept {keep} tokens, continued with {rest}: {diff} of {want.size} "
                    f"logits differ from the saving context's (max |d| {float(np.max(np.abs(want - got)))})",
                )

        @rule(n=st.integers(0, 8))
        def set_capacity(self, n: int) -> None:
            """Change capacity_bytes (a third of the largest entry to four of them); enforced at the next insert."""
            self.capacity = base + max(unit // 3, n * unit // 2)
            self.cache.capacity_bytes = self.capacity

        @rule(key=prompts, nth=st.integers(1, 4), where=st.sampled_from(["size", "pickle"]))
        def insert_with_fault(self, key: Key, nth: int, where: str) -> None:
            if where == "pickle" and kind == "ram":
                where = "size"
            state = env.state(key)
            size = adapter.entry_size(state)
            if base + size > self.capacity:
                return  # oversize admission is its own property
            before = self.keys()
            expected = self.expected_after_insert(key, size)
            fired = False
            with adapter.quiet(), seam_armed(self.cache, where, nth) as seam:
                try:
                    self.cache[key] = state
                except MemoryError:
                    if not seam.fired:
                        raise
                fired = seam.fired
            if not fired:
                self.ref.pop(key, None)
                self.ref[key] = size
                self.check_capacity_and_accounting()
                self.check_order(f"insert {key}", expected)
                return
            after = self.keys()
            size_now = int(self.cache.cache_size)
            over = size_now > self.capacity
            if expected is None:  # disk: a successful insert keeps the newest entries, the new one included
                full = [k for k in before if k != key] + [key]
                expected = after if (after and after == full[len(full) - len(after) :] and not over) else full
            cache_state, finding = diagnose_fault(before, after, key, expected, over)
            self.check("fault_atomic")
            if cache_state in ALLOWED_STATES:
                snap = {k: adapter.peek(self.cache, k) for k in after}
                if key in after and snap[key].llama_state != state.llama_state:
                    raise LcpViolation("fault_atomic", f"after a {where} fault the entry {key} is not the new state")
                self.ref = OrderedDict((k, self.ref.get(k, size)) for k in after)
                return
            if finding is None or finding in tolerate:
                if finding is None:
                    raise LcpViolation(
                        "fault_atomic",
                        f"MemoryError at {where} call #{nth} of cache[{key}] = state: keys {before} became {after} "
                        f"(cache_size {size_now}, capacity {self.capacity})",
                    )
                self.sync()
                return
            raise LcpViolation(
                "fault_atomic",
                f"MemoryError at {where} call #{nth} of cache[{key}] = state: keys {before} became {after} "
                f"(cache_size {size_now}, capacity {self.capacity}): {cache_state}",
                finding,
            )

    LcpCacheMachine.__name__ = f"LcpCache_{kind}_{env.arch}"
    return LcpCacheMachine


# ---- the child-process layers: CPython allocator and RLIMIT_AS ---------------------------------


def _scenario(adapter: CacheAdapter, env: ModelEnv, act: str) -> tuple[Any, Key, Any, int]:
    """A cache holding three entries; ``act`` re-inserts the middle one (``reinsert``) or adds one that evicts."""
    keys: list[Key] = [(BOS, ALPHABET[0]), (BOS, ALPHABET[1], ALPHABET[1]), (BOS, ALPHABET[2], ALPHABET[0])]
    new: Key = keys[1] if act == "reinsert" else (BOS, ALPHABET[2], ALPHABET[2], ALPHABET[2])
    sizes = [adapter.entry_size(env.state(k)) for k in keys]
    base = adapter.base()
    cap = base + sum(sizes) + (adapter.entry_size(env.state(new)) // 2 if act == "evict" else 4096 * 4)
    cache = adapter.make(cap)
    with adapter.quiet():
        for k in keys:
            cache[k] = env.state(k)
    return cache, new, env.state(new), cap


def fault_outcome(cache_state: str, *, fired: bool) -> Outcome:
    """A fault trial's :class:`Outcome` from what the cache holds after it (see :func:`diagnose_fault`)."""
    if cache_state not in ALLOWED_STATES:
        return Outcome.VIOLATION
    return Outcome.ACCEPTED if fired else Outcome.OK


def _testcapi() -> ModuleType | None:
    try:
        mod = importlib.import_module("_testcapi")
    except ImportError:
        return None
    return mod if hasattr(mod, "set_nomemory") else None


def _pymem_child(spec: dict[str, Any]) -> int:

    global _TMP
    _TMP = spec["tmp"]  # the parent removes it, even when this child dies

    child_setup(watchdog=True)
    capi = _testcapi()
    if capi is None:
        print(json.dumps({"unavailable": "no _testcapi.set_nomemory"}), flush=True)
        return 0
    env = ModelEnv("llama")
    adapter = CacheAdapter(spec["cache"])
    try:
        # what a successful insert leaves: the same act once without a fault
        cache, key, state, cap = _scenario(adapter, env, spec["act"])
        with adapter.quiet():
            cache[key] = state
        expected = adapter.keys(cache)
        adapter.close(cache)
        for nth in spec["points"]:
            cache, key, state, cap = _scenario(adapter, env, spec["act"])
            before = adapter.keys(cache)
            escaped: BaseException | None = None
            reached = True
            gc.collect()
            gc.disable()
            with adapter.quiet():
                capi.set_nomemory(nth - 1, nth)
                try:
                    try:
                        cache[key] = state
                    except BaseException as e:
                        escaped = e
                    if escaped is None:
                        try:
                            bytearray(64)
                        except MemoryError:
                            reached = False
                finally:
                    capi.remove_mem_hooks()
                    gc.enable()
            after = adapter.keys(cache)
            over = int(cache.cache_size) > cap
            cache_state, finding = diagnose_fault(before, after, key, expected, over)
            row = {
                "nth": nth,
                "reached": reached,
                "escaped": None if escaped is None else f"{type(escaped).__name__}: {escaped}"[:160],
                "outcome": fault_outcome(cache_state, fired=reached),
                "state": cache_state,
                "finding": finding,
                "before": [len(k) for k in before],
                "after": [len(k) for k in after],
            }
            adapter.close(cache)
            adapter.cleanup()
            print(json.dumps(row), flush=True)
            if not reached:
                break
    finally:
        adapter.cleanup()
    return 0


def sweep_pymem(
    cache: str, act: str, *, max_points: int, stride: int = 1, timeout: float = 60.0
) -> list[dict[str, Any]]:
    """Fail CPython allocation ``1, 1+stride, ...`` of ``cache[key] = state`` (transient), in a child."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    rows: list[dict[str, Any]] = []
    points = list(range(1, 1 + max_points * stride, stride))
    tmp = tempfile.mkdtemp(prefix="lcp-pymem-", dir=_TMP)
    try:
        _sweep_points(cache, act, points, tmp, env, rows, timeout)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return rows


def _sweep_points(
    cache: str, act: str, points: list[int], tmp: str, env: dict[str, str], rows: list[dict[str, Any]], timeout: float
) -> None:

    while points:
        spec = {"cache": cache, "act": act, "points": points, "tmp": tmp}
        child = run_child(
            [sys.executable, "-m", "harness.backends.lcp_cache", "--pymem-child", json.dumps(spec)],
            env=env,
            timeout=timeout,
        )
        got = [json.loads(ln) for ln in child.stdout.splitlines() if ln.startswith("{")]
        if got and "unavailable" in got[0]:
            return
        rows.extend({**r, "outcome": Outcome(r["outcome"])} for r in got)
        if (got and not got[-1]["reached"]) or len(got) >= len(points):
            break
        dead = points[len(got)]
        rows.append(
            {
                "nth": dead,
                "reached": True,
                "escaped": f"child {child.describe()}",
                "outcome": died(child),
                "state": None,
                "finding": None,
                "before": [],
                "after": [],
            }
        )
        points = points[len(got) + 1 :]


def _vm_size() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _reinsert_under_limit(
    adapter: CacheAdapter, cache: Any, key: Key, new: Any, before: list[Key], expected: list[Key], headroom: int | None
) -> None:
    """In a forked process (its VmSize is its parent's): limit, re-insert ``key``, report one JSON row."""
    res: dict[str, Any] = {"headroom": headroom}
    if headroom is not None:
        _, hard = resource.getrlimit(resource.RLIMIT_AS)
        resource.setrlimit(resource.RLIMIT_AS, (_vm_size() + headroom, hard))
    try:
        with adapter.quiet():
            cache[key] = new
        res["escaped"] = None
    except MemoryError as e:
        res["escaped"] = f"MemoryError: {e}"[:160]
    resource.setrlimit(resource.RLIMIT_AS, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    after = adapter.keys(cache)
    res["state"], res["finding"] = diagnose_fault(before, after, key, expected, False)
    res["outcome"] = fault_outcome(res["state"], fired=res["escaped"] is not None)
    res["state_bytes"] = held_bytes(new)
    print(json.dumps(res))


def _rlimit_child(spec: dict[str, Any]) -> int:
    """Build a big re-insert scenario, then fork once per headroom: limit, re-insert, report."""

    global _TMP
    _TMP = spec["tmp"]

    child_setup(watchdog=False)
    lc = _llama_cpp()

    n_ctx = 1024
    llm = lc.Llama(
        model_path=str(model_path("llama")),
        n_ctx=n_ctx,
        n_batch=256,
        n_threads=1,
        n_threads_batch=1,
        verbose=False,
        logits_all=True,
    )
    adapter = CacheAdapter(spec["cache"])
    keys = [(BOS, *[ALPHABET[i % 3] for i in range(j, j + 900)]) for j in range(3)]
    states = {}
    for k in keys:
        llm.reset()
        llm.eval(list(k))
        states[k] = llm.save_state()
    try:
        for headroom in spec["headrooms"]:
            cache = adapter.make(1 << 40)
            with adapter.quiet():
                for k in keys:
                    cache[k] = states[k]
            key = keys[1]
            new = type(states[key])(
                **{
                    f: getattr(states[key], f)
                    for f in ("input_ids", "scores", "n_tokens", "llama_state", "llama_state_size", "seed")
                }
            )
            before = adapter.keys(cache)
            gc.collect()

            expected = [keys[0], keys[2], key]
            reinsert = functools.partial(_reinsert_under_limit, adapter, cache, key, new, before, expected, headroom)
            done = run_child(reinsert, timeout=spec["timeout"])
            text = done.stdout.strip()
            dead = {"headroom": headroom, "outcome": died(done), "state": None, "finding": None}
            print(text if text else json.dumps(dead), flush=True)
            adapter.close(cache)
            adapter.cleanup()
    finally:
        adapter.cleanup()
        llm.close()
    return 0


def run_rlimit(cache: str, headrooms: Sequence[int | None], timeout: float = 90.0) -> list[dict[str, Any]]:

    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    env["MALLOC_ARENA_MAX"] = "1"
    tmp = tempfile.mkdtemp(prefix="lcp-rlimit-", dir=_TMP)
    spec = {"cache": cache, "headrooms": list(headrooms), "tmp": tmp, "timeout": timeout / (len(headrooms) + 1)}
    with contextlib.ExitStack() as stack:
        stack.callback(shutil.rmtree, tmp, True)
        child = run_child(
            [sys.executable, "-m", "harness.backends.lcp_cache", "--rlimit-child", json.dumps(spec)],
            env=env,
            timeout=timeout,
        )
    rows = [json.loads(ln) for ln in child.stdout.splitlines() if ln.startswith("{")]
    rows = [{**r, "outcome": Outcome(r["outcome"])} for r in rows]
    if child.crashed or len(rows) < len(headrooms):
        rows.append(
            {
                "headroom": None,
                "outcome": died(child),
                "state": None,
                "finding": None,
                "escaped": f"child {child.describe()}: {child.stderr.strip()[-300:]}",
            }
        )
    return rows


# ---- the gate -----------------------------------------------------------------------------------


def _settings(max_examples: int) -> settings:
    return settings(
        max_examples=max_examples,
        stateful_step_count=STEPS,
        deadline=None,
        database=None,
        report_multiple_bugs=False,
        derandomize=False,
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.generate, Phase.shrink],
        print_blob=False,
    )


def _known(name: str, cache: str) -> bool:
    f = KNOWN_BY_NAME.get(name)
    return f is not None and cache in f.caches


def run_lcp_gate(
    cache: str = "ram", *, seed: int = 0, max_examples: int | None = None, out: Callable[[str], None] = print
) -> dict[str, Any]:
    """Run every property on ``cache`` (``"ram"`` or ``"disk"``); known findings are reported, not failed.

    Returns ``{"cache", "checks", "properties", "findings", "failures", "out_of_scope", "seconds"}``:
    ``checks`` counts the property checks made (``properties`` per property), ``findings`` the known
    findings shown (name, property, reproducer, title, evidence), ``failures`` every failure that is not a
    known finding (property, message, shrunk program, replay command), ``out_of_scope`` pymem trials whose
    child died inside the interpreter or sqlite3 (not attributable to the cache; reported, never failed).
    """
    if cache not in CACHES:
        raise ValueError(f"cache must be one of {CACHES}, not {cache!r}")
    t0 = time.perf_counter()
    replay = f"python -m harness gate --backend llama-cpp-python-cache --cache {cache} --seed {seed}"
    n = max_examples or DEFAULT_EXAMPLES
    stats = Stats()
    findings: dict[str, dict[str, Any]] = {}
    failures: list[dict[str, Any]] = []
    out_of_scope: list[dict[str, Any]] = []
    tolerate: set[str] = set()

    def found(name: str, evidence: str, where: str) -> None:
        f = KNOWN_BY_NAME[name]
        if name not in findings:
            findings[name] = {
                "name": name,
                "property": f.property,
                "reproducer": f.reproducer,
                "title": f.title,
                "evidence": evidence,
                "where": where,
                "also": [],
            }
            out(f"  known finding {name} ({f.property}): {evidence}")
        elif where not in findings[name]["where"] and all(where not in a for a in findings[name]["also"]):
            findings[name]["also"].append(f"{where}: {evidence}")  # the first sighting per further layer
            out(f"  known finding {name} also shown by {where}: {evidence}")

    out(
        f"llama-cpp-python cache gate: cache={cache} seed={seed} max_examples={n} steps={STEPS} "
        f"archs={' '.join(MACHINE_ARCHS)}"
    )
    for arch in MACHINE_ARCHS:
        env = ModelEnv(arch)
        adapter = CacheAdapter(cache)
        try:
            for _ in range(len(KNOWN_LCP_FINDINGS) + 1):
                cls = machine_class(env, adapter, frozenset(tolerate), stats)
                t1 = time.perf_counter()
                try:
                    run_seeded(cls, _settings(n), seed)
                    out(
                        f"  machine {cls.__name__}: passed in {time.perf_counter() - t1:.1f}s "
                        f"(tolerating {sorted(tolerate) or 'nothing'})"
                    )
                    break
                except LcpViolation as v:
                    program = "\n".join(getattr(v, "__notes__", []))
                    if v.finding is not None and _known(v.finding, cache) and v.finding not in tolerate:
                        found(v.finding, v.message, f"machine {cls.__name__}")
                        tolerate.add(v.finding)
                        continue
                    failures.append(
                        {
                            "property": v.prop,
                            "message": v.message,
                            "machine": cls.__name__,
                            "program": program,
                            "replay": replay,
                        }
                    )
                    out(f"  FAIL {v.prop}: {v.message}\n{program}\n  replay: {replay}")
                    break
                except Exception as e:
                    program = "\n".join(getattr(e, "__notes__", []))
                    failures.append(
                        {
                            "property": "crash",
                            "message": f"{type(e).__name__}: {e}",
                            "machine": cls.__name__,
                            "program": program,
                            "replay": replay,
                        }
                    )
                    out(f"  FAIL crash: {type(e).__name__}: {e}\n{program}\n  replay: {replay}")
                    break
        finally:
            adapter.cleanup()
            env.close()

    # CPython allocator failures inside cache[key] = state (children)
    t1 = time.perf_counter()
    if _testcapi() is None:
        out("  pymem: skipped (no _testcapi.set_nomemory)")
    else:
        for act in ("reinsert", "evict"):
            stride = 1 if cache == "ram" else 7
            rows = sweep_pymem(cache, act, max_points=120 if cache == "ram" else 60, stride=stride)
            reached = [r for r in rows if r["reached"]]
            tally = Counter(r["outcome"] for r in reached)
            states = Counter(r["state"] for r in reached if r["state"])
            stats.checked["fault_atomic"] += len(reached)
            out(
                f"  pymem {act}: {len(reached)} points (stride {stride}): "
                + ", ".join(f"{o} {k}" for o, k in tally.items())
                + " (cache " + ", ".join(f"{s} {k}" for s, k in states.items()) + ")"
            )
            for r in reached:
                if r["finding"] and _known(r["finding"], cache):
                    found(
                        r["finding"],
                        f"CPython allocation #{r['nth']} failing in cache[key] = state ({act}): "
                        f"{r['escaped']}; entries {r['before']} -> {r['after']} (key lengths)",
                        f"pymem {act}",
                    )
                elif r["outcome"] in (Outcome.ABORTED, Outcome.KILLED):  # the interpreter died (e.g. in sqlite3)
                    out_of_scope.append({"layer": "pymem", "act": act, **r})
                elif r["outcome"] not in (Outcome.OK, Outcome.ACCEPTED):
                    failures.append(
                        {
                            "property": "fault_atomic",
                            "message": f"pymem {act} #{r['nth']}: {r}",
                            "machine": "pymem",
                            "program": "",
                            "replay": replay,
                        }
                    )
    out(f"  pymem layer: {time.perf_counter() - t1:.1f}s")

    # a real address-space limit around a re-insert of a ~1.2 MB state (forked children)
    t1 = time.perf_counter()
    if hasattr(os, "fork") and os.path.exists("/proc/self/status"):
        rows = run_rlimit(cache, [None, 256 * 1024])
        stats.checked["fault_atomic"] += len(rows)
        for r in rows:
            out(f"  rlimit headroom {r.get('headroom')}: {r['outcome']} ({r.get('state')}, {r.get('escaped')})")
            if r.get("finding") and _known(r["finding"], cache):
                found(
                    r["finding"],
                    f"RLIMIT_AS at +{r['headroom']} bytes around re-inserting a {r['state_bytes']}-byte "
                    f"state: {r['escaped']}; the cached entry is gone",
                    "rlimit",
                )
            elif r["outcome"] not in (Outcome.OK, Outcome.ACCEPTED):
                failures.append(
                    {
                        "property": "fault_atomic",
                        "message": f"rlimit: {r}",
                        "machine": "rlimit",
                        "program": "",
                        "replay": replay,
                    }
                )
    out(f"  rlimit layer: {time.perf_counter() - t1:.1f}s")

    for p in PROPERTIES:
        shown = [f["name"] for f in findings.values() if f["property"] == p]
        failed = any(f["property"] == p for f in failures)
        verdict = "FAILED" if failed else ("finding " + ", ".join(shown) if shown else "holds")
        out(f"  {p:<13} {stats.checked[p]:>6} checks  {verdict}")
    res = {
        "cache": cache,
        "checks": sum(stats.checked.values()),
        "properties": {p: stats.checked[p] for p in PROPERTIES},
        "findings": list(findings.values()),
        "failures": failures,
        "out_of_scope": out_of_scope,
        "seconds": round(time.perf_counter() - t0, 2),
    }
    out(
        f"{'PASS' if not failures else 'FAIL'} ({len(findings)} known findings, {len(failures)} failures, "
        f"{res['seconds']}s)"
    )
    return res


def _main(argv: list[str]) -> int:
    if len(argv) == 2 and argv[0] == "--pymem-child":
        return _pymem_child(json.loads(argv[1]))
    if len(argv) == 2 and argv[0] == "--rlimit-child":
        return _rlimit_child(json.loads(argv[1]))
    cache = argv[0] if argv else "ram"
    res = run_lcp_gate(cache)
    return 1 if res["failures"] else 0




def _run_lcp(
    report: GateReport, variant: str, cache: str, seed: int, max_examples: int | None, out: Out
) -> None:
    """llama-cpp-python's own prompt caches (LlamaRAMCache / LlamaDiskCache) under the generic properties."""
    out(f"gate: backend=llama-cpp-python-cache cache={cache} seed={seed} commit={report.commit}")
    res = run_lcp_gate(cache, seed=seed, max_examples=max_examples, out=lambda line: out("  " + line))
    report.extra["llama_cpp_cache"] = {
        "cache": res["cache"],
        "checks": res["checks"],
        "properties": res["properties"],
        "findings": [
            {k: f[k] for k in ("name", "property", "reproducer", "title", "evidence")} for f in res["findings"]
        ],
        "out_of_scope": res["out_of_scope"],
        "seconds": res["seconds"],
    }
    for f in res["findings"]:
        report.known.append(
            finding(f["name"]).entry(
                f"llama-cpp-python {cache} cache", "reproduced", property=f["property"], message=f["evidence"]
            )
        )
    for f in res["failures"]:
        failure = Failure(
            f["property"], "violation", f["message"], f.get("program", ""), f["replay"], f.get("machine", "lcp"), 0
        )
        report.machines.append(MachineResult(MachineConfig(variant), res["seconds"], failure, Counter(), Counter(), []))


class LcpCacheBackend(Backend):
    name = "llama-cpp-python-cache"
    flags = frozenset({"cache"})
    semantics_axis = False

    def run(self, report: GateReport, opts: GateOptions, out: Out) -> None:
        _run_lcp(report, opts.semantics, opts.cache, opts.seed, opts.max_examples, out)


if __name__ == "__main__":
    raise SystemExit(_main(sys.argv[1:]))
