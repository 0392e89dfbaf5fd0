"""The properties of llama-cpp-python's prompt caches, as a Hypothesis state machine.

On real states of the tiny fixtures models (:mod:`harness.targets.lcp_cache`), the properties a
user of ``LlamaRAMCache`` / ``LlamaDiskCache`` relies on:

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

:func:`machine_class` builds a ``RuleBasedStateMachine`` on one cache and one model that inserts
prompts' states, looks up prompts (stored keys, prefixes, extensions, divergent ones), restores and
continues, shrinks the capacity and injects size/pickle faults, against a reference model (an
ordered dict of keys and sizes). A failing property raises :class:`LcpViolation`, naming the known
finding it shows when it is one of :data:`KNOWN_LCP_FINDINGS`; the findings passed as ``tolerate``
are modelled as upstream behaves, so that the machine can check everything else.
:func:`diagnose_fault` is the judgement of ``fault_atomic`` the fault layers share (:mod:`faults.lcp_cache`).
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
from hypothesis import HealthCheck, Phase, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from harness.errors import PropertyFailure
from harness.findings import (
    DISK_LOOKUP_REMOVES_ENTRY,
    FAULT_LEAVES_OVER_CAPACITY,
    FINDINGS,
    LOOKUP_UNUSABLE_FOR_RECURRENT,
    OVERSIZE_FLUSHES_CACHE,
    RAM_SIZE_IGNORES_SCORES,
    REINSERT_FAULT_LOSES_ENTRY,
    Finding,
)
from harness.targets.lcp_cache import (
    ALPHABET,
    BOS,
    NEXT_TOKEN,
    CacheAdapter,
    Key,
    ModelEnv,
    lcp,
    seam_armed,
    state_key,
)
from properties.teardown import noted, settle, stages

__all__ = [
    "ALLOWED_STATES",
    "KNOWN_BY_NAME",
    "KNOWN_LCP_FINDINGS",
    "PROPERTIES",
    "STEPS",
    "LcpCacheMachine",
    "LcpViolation",
    "Stats",
    "diagnose_fault",
    "machine_class",
    "machine_settings",
]

PROPERTIES = ("capacity", "accounting", "lookup", "restore", "eviction", "oversize", "fault_atomic")
STEPS = 20
ALLOWED_STATES = ("unchanged", "inserted")  # what diagnose_fault may find after a fault without a finding


# llama-cpp-python's findings, from the one registry (harness/findings/); ``scope`` holds the caches
KNOWN_LCP_FINDINGS: list[Finding] = [f for f in FINDINGS.values() if f.backend == "llama-cpp-python-cache"]
KNOWN_BY_NAME = {f.id: f for f in KNOWN_LCP_FINDINGS}


class LcpViolation(PropertyFailure):
    """A property of llama-cpp-python's cache failed: ``name`` is the property, ``finding`` the known finding it
    shows (the backend counts it and runs again without it), or ``None`` when undiagnosed: a failure, whose
    shrunk program replays it against the cache; fix the cache (or register the finding it shows)."""

    def __init__(self, name: str, message: str, finding: str | None = None) -> None:
        super().__init__(name, message, f"{name}: {message}" + (f" [{finding}]" if finding else ""))
        self.finding = finding


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
        return "lost", REINSERT_FAULT_LOSES_ENTRY.id
    full = [k for k in before if k != key] + [key]
    if after and after[-1] == key and after == full[len(full) - len(after) :] and over_capacity:
        return "over-capacity", FAULT_LEAVES_OVER_CAPACITY.id
    return "inconsistent", None


# ---- the state machine --------------------------------------------------------------------------


@dataclass
class Stats:
    checked: Counter[str] = field(default_factory=Counter)
    notes: list[str] = field(default_factory=list)


prompts = st.lists(st.sampled_from(ALPHABET), min_size=0, max_size=7).map(lambda t: (BOS, *t))


class LcpCacheMachine(RuleBasedStateMachine):
    """The machine on one cache and one model; :func:`machine_class` binds them (class attributes)."""

    adapter: ClassVar[CacheAdapter]
    env: ClassVar[ModelEnv]
    tolerate: ClassVar[frozenset[str]]
    stats: ClassVar[Stats]
    kind: ClassVar[str]
    unit: ClassVar[int]  # what one entry of the longest prompt counts for
    base: ClassVar[int]  # what an empty cache already counts (disk: the SQLite pages)

    def __init__(self) -> None:
        super().__init__()
        self.capacity = self.base + 3 * self.unit
        self.cache = self.adapter.make(self.capacity)
        self.ref: OrderedDict[Key, int] = OrderedDict()  # key -> entry size, oldest first
        self.step_failure: BaseException | None = None  # what escaped a rule (noted)

    def teardown(self) -> None:
        """Close the cache and clean up; after a failed rule their errors are kept beside its failure, not
        instead of it (:mod:`properties.teardown`); both run even when the first fails."""
        settle(self.step_failure, stages(lambda: self.adapter.close(self.cache), self.adapter.cleanup))

    # -- helpers
    def check(self, prop: str) -> None:
        self.stats.checked[prop] += 1

    def sync(self) -> None:
        self.ref = OrderedDict((k, self.ref.get(k) or self.adapter.entry_size(self.env.state(k))) for k in self.keys())

    def keys(self) -> list[Key]:
        return self.adapter.keys(self.cache)

    def expected_after_insert(self, key: Key, size: int) -> list[Key] | None:
        """Keys (oldest first) after a successful insert per the reference; None: undecidable (disk)."""
        ref = OrderedDict(self.ref)
        if self.base + size > self.capacity:
            if OVERSIZE_FLUSHES_CACHE.id in self.tolerate:
                return []
            if self.kind == "disk":
                return list(ref)  # refused, nothing lost
            # refused; only what a shrunk capacity_bytes no longer allows goes
            while sum(ref.values()) > self.capacity and ref:
                ref.popitem(last=False)
            return list(ref)
        ref.pop(key, None)
        ref[key] = size
        if self.kind == "disk":
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
        held = self.adapter.held(self.cache)
        if self.kind == "ram":
            own = sum(int(s.llama_state_size) for s in self.cache.cache_state.values())
            if own != size or any(len(s.llama_state) != s.llama_state_size for s in self.cache.cache_state.values()):
                raise LcpViolation("accounting", f"cache_size {size} != sum of llama_state_size {own}")
            if held > size and RAM_SIZE_IGNORES_SCORES.id not in self.tolerate:
                raise LcpViolation(
                    "accounting",
                    f"{len(self.ref)} entries hold {held} bytes (llama_state {own} + scores and input_ids "
                    f"{held - own}) but cache_size is {size}",
                    RAM_SIZE_IGNORES_SCORES.id,
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
    @noted
    def insert(self, key: Key) -> None:
        state = self.env.state(key)
        size = self.adapter.entry_size(state)
        before = self.keys()
        oversize = self.base + size > self.capacity
        expected = self.expected_after_insert(key, size)
        with self.adapter.quiet():
            self.cache[key] = state
        if oversize:
            self.check("oversize")
            got = self.keys()
            if got != expected:
                finding = OVERSIZE_FLUSHES_CACHE.id if not got and before else None
                raise LcpViolation(
                    "oversize",
                    f"an entry of {size} bytes > capacity {self.capacity - self.base}: {len(before)} cached entries "
                    f"became {len(got)}",
                    finding,
                )
        else:
            self.ref.pop(key, None)
            self.ref[key] = size
        self.check_capacity_and_accounting()
        self.check_order(f"insert {key}", expected)
        if not oversize and key not in self.keys():
            raise LcpViolation("eviction", f"the entry just inserted ({size} bytes, capacity {self.capacity}) is gone")

    @rule(query=prompts)
    @noted
    def lookup(self, query: Key) -> None:
        self.lookup_and_continue(query)

    @precondition(lambda self: len(self.ref) > 0)
    @rule(i=st.integers(0, 7), cut=st.integers(0, 3), ext=st.lists(st.sampled_from(ALPHABET), max_size=3))
    @noted
    def lookup_related(self, i: int, cut: int, ext: list[int]) -> None:
        """Look up a stored key, a prefix of it, an extension of it, or a divergent sibling."""
        keys = list(self.ref)
        k = keys[i % len(keys)]
        q = k[: max(1, len(k) - cut)] + tuple(ext)
        self.lookup_and_continue(q)

    def lookup_and_continue(self, query: Key) -> None:
        keys = list(self.ref)
        usable = {k: self.env.usable(k, query) for k in keys}
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
        strict = LOOKUP_UNUSABLE_FOR_RECURRENT.id not in self.tolerate
        if strict:
            ok = (got is None and best == 0) or (got is not None and best > 0 and usable[got] == best)
        else:  # upstream's rule: the longest common prefix, a miss only when nothing shares a token
            ok = (got is None and longest == 0) or (got is not None and longest > 0 and lcp(got, query) == longest)
        if not ok:
            finding = None
            if (
                not self.env.truncatable
                and (got is None) == (longest == 0)
                and (got is None or lcp(got, query) == longest)
            ):
                finding = LOOKUP_UNUSABLE_FOR_RECURRENT.id
            raise LcpViolation(
                "lookup",
                f"lookup {query} among {keys} returned {got} (reusable {usable.get(got, 0) if got else 0}); "
                f"the best reusable prefix is {best} tokens",
                finding,
            )
        if got is not None:
            st_ = self.adapter.peek(self.cache, got) if self.kind == "ram" else None
            if st_ is not None and st_ is not state:
                raise LcpViolation("lookup", f"lookup returned a state that is not the one stored under {got}")
            # the entry stays cached, and (RAM) becomes the most recently used
            after = self.keys()
            self.check("lookup")
            if got not in after:
                if DISK_LOOKUP_REMOVES_ENTRY.id not in self.tolerate:
                    raise LcpViolation(
                        "lookup",
                        f"lookup {query} returned {got} and the entry is no longer cached ({len(after)} left)",
                        DISK_LOOKUP_REMOVES_ENTRY.id if self.kind == "disk" else None,
                    )
                self.ref.pop(got)
            elif self.kind == "ram":
                self.ref.move_to_end(got)
            self.check_order(f"lookup {query}", list(self.ref))
            keep = usable[got]
            if keep > 0:
                self.restore_check(state, got, query, keep)

    def restore_check(self, state: Any, key: Key, query: Key, keep: int) -> None:
        rest = (*query[keep:], NEXT_TOKEN)
        want = self.env.fresh_logits(key, keep, rest)
        try:
            got = self.env.restored_logits(state, keep, rest)
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
    @noted
    def set_capacity(self, n: int) -> None:
        """Change capacity_bytes (a third of the largest entry to four of them); enforced at the next insert."""
        self.capacity = self.base + max(self.unit // 3, n * self.unit // 2)
        self.cache.capacity_bytes = self.capacity

    @rule(key=prompts, nth=st.integers(1, 4), where=st.sampled_from(["size", "pickle"]))
    @noted
    def insert_with_fault(self, key: Key, nth: int, where: str) -> None:
        if where == "pickle" and self.kind == "ram":
            where = "size"
        state = self.env.state(key)
        size = self.adapter.entry_size(state)
        if self.base + size > self.capacity:
            return  # oversize admission is its own property
        before = self.keys()
        expected = self.expected_after_insert(key, size)
        fired = False
        with self.adapter.quiet(), seam_armed(self.cache, where, nth) as seam:
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
            snap = {k: self.adapter.peek(self.cache, k) for k in after}
            if key in after and snap[key].llama_state != state.llama_state:
                raise LcpViolation("fault_atomic", f"after a {where} fault the entry {key} is not the new state")
            self.ref = OrderedDict((k, self.ref.get(k, size)) for k in after)
            return
        if finding is None or finding in self.tolerate:
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


def machine_class(
    env: ModelEnv, adapter: CacheAdapter, tolerate: frozenset[str], stats: Stats
) -> type[LcpCacheMachine]:
    """A machine on ``adapter``'s cache with ``env``'s states; findings in ``tolerate`` are modelled as upstream."""
    attrs: dict[str, Any] = {
        "adapter": adapter,
        "env": env,
        "tolerate": tolerate,
        "stats": stats,
        "kind": adapter.kind,
        "unit": adapter.entry_size(env.state((BOS, *ALPHABET[:1] * 7))),
        "base": adapter.base(),
    }
    return type(f"LcpCache_{adapter.kind}_{env.arch}", (LcpCacheMachine,), attrs)


def machine_settings(max_examples: int) -> settings:
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
