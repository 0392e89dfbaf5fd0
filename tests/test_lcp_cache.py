"""The llama-cpp-python cache gate: its result's shape, mutants killed by each property, the reproducers."""

from __future__ import annotations

import subprocess
import sys
from collections import OrderedDict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("llama_cpp")


import properties.lcp_machine as lcp
from harness.backends.lcp_cache import run_lcp_gate
from harness.targets.lcp_cache import NEXT_TOKEN, CacheAdapter, ModelEnv
from properties.lcp_machine import KNOWN_LCP_FINDINGS, LcpViolation, Stats, machine_class
from properties.run import run_seeded

ROOT = Path(__file__).resolve().parent.parent
ALL_KNOWN = frozenset(f.id for f in KNOWN_LCP_FINDINGS)


@pytest.fixture(scope="module")
def env() -> Iterator[ModelEnv]:
    e = ModelEnv("llama")
    yield e
    e.close()


class MutantAdapter(CacheAdapter):
    def __init__(self, factory: Any) -> None:
        super().__init__("ram")
        self.factory = factory

    def make(self, capacity: int) -> Any:
        return self.factory(capacity)


def run_mutant(
    env: ModelEnv, factory: Any, tolerate: frozenset[str] = ALL_KNOWN, n: int = 60, *, faults: bool = True
) -> LcpViolation | None:
    cls = machine_class(env, MutantAdapter(factory), tolerate, Stats())
    if not faults:  # a plain method in a subclass takes the rule out of the machine
        cls = type(cls.__name__, (cls,), {"insert_with_fault": lambda self: None})
    try:
        run_seeded(cls, lcp.machine_settings(n), 0)
    except LcpViolation as v:
        return v
    return None


def ram(capacity: int) -> Any:
    import llama_cpp

    return llama_cpp.LlamaRAMCache(capacity_bytes=capacity)


def test_gate_returns_the_documented_structure() -> None:
    lines: list[str] = []
    res = run_lcp_gate("ram", seed=1, max_examples=5, out=lines.append)
    assert res["cache"] == "ram" and isinstance(res["checks"], int) and res["checks"] > 0
    assert set(res["properties"]) == set(lcp.PROPERTIES)
    assert res["failures"] == []
    names = {f["name"] for f in res["findings"]}
    assert names <= ALL_KNOWN and names
    for f in res["findings"]:
        assert {"name", "property", "reproducer"} <= set(f) and (ROOT / f["reproducer"]).is_file()
    assert lines[-1].startswith("PASS")


def test_upstream_ram_cache_passes_when_its_findings_are_tolerated(env: ModelEnv) -> None:
    assert run_mutant(env, ram, n=30) is None


def test_a_cache_that_never_evicts_breaks_capacity(env: ModelEnv) -> None:
    import llama_cpp

    class NeverEvicts(llama_cpp.LlamaRAMCache):
        def __setitem__(self, key: Any, value: Any) -> None:
            if value.llama_state_size <= self.capacity_bytes:  # refuses oversize entries, as it should
                self.cache_state.pop(tuple(key), None)
                self.cache_state[tuple(key)] = value

    v = run_mutant(env, lambda c: NeverEvicts(capacity_bytes=c))
    assert v is not None and v.name == "capacity" and v.finding is None


def test_a_cache_that_undercounts_breaks_accounting(env: ModelEnv) -> None:
    import llama_cpp

    class HalfSize(llama_cpp.LlamaRAMCache):
        @property
        def cache_size(self) -> int:
            return sum(s.llama_state_size for s in self.cache_state.values()) // 2

    v = run_mutant(env, lambda c: HalfSize(capacity_bytes=c))
    assert v is not None and v.name == "accounting"


def test_upstream_accounting_is_the_known_finding(env: ModelEnv) -> None:
    v = run_mutant(env, ram, tolerate=ALL_KNOWN - {"ram_size_ignores_scores"}, n=10)
    assert v is not None and v.name == "accounting" and v.finding == "ram_size_ignores_scores"


def test_a_cache_that_evicts_the_most_recent_breaks_eviction(env: ModelEnv) -> None:
    import llama_cpp

    class EvictsMRU(llama_cpp.LlamaRAMCache):
        def __setitem__(self, key: Any, value: Any) -> None:
            key = tuple(key)
            self.cache_state.pop(key, None)
            while self.cache_state and self.cache_size + value.llama_state_size > self.capacity_bytes:
                self.cache_state.popitem(last=True)
            self.cache_state[key] = value

    v = run_mutant(env, lambda c: EvictsMRU(capacity_bytes=c))
    assert v is not None and v.name == "eviction"


def test_a_cache_without_lru_on_lookup_breaks_eviction(env: ModelEnv) -> None:
    import llama_cpp

    class Fifo(llama_cpp.LlamaRAMCache):
        def __getitem__(self, key: Any) -> Any:
            k = self._find_longest_prefix_key(tuple(key))
            if k is None:
                raise KeyError(key)
            return self.cache_state[k]

    v = run_mutant(env, lambda c: Fifo(capacity_bytes=c))
    assert v is not None and v.name == "eviction"


def test_a_cache_that_returns_the_shortest_prefix_breaks_lookup(env: ModelEnv) -> None:
    import llama_cpp

    class Shortest(llama_cpp.LlamaRAMCache):
        def _find_longest_prefix_key(self, key: Any) -> Any:
            best = None
            for k in self.cache_state:
                n = llama_cpp.Llama.longest_token_prefix(k, key)
                if n > 0 and (best is None or n < best[0]):
                    best = (n, k)
            return None if best is None else best[1]

    v = run_mutant(env, lambda c: Shortest(capacity_bytes=c))
    assert v is not None and v.name == "lookup" and v.finding is None


def test_a_cache_that_stores_another_prompts_kv_breaks_restore(env: ModelEnv) -> None:
    import llama_cpp

    class Stale(llama_cpp.LlamaRAMCache):
        def __setitem__(self, key: Any, value: Any) -> None:
            key = tuple(key)
            other = env.state((*key[:-1], NEXT_TOKEN)) if len(key) > 1 else value
            bad = llama_cpp.LlamaState(
                value.input_ids, value.scores, value.n_tokens, other.llama_state, other.llama_state_size, value.seed
            )
            super().__setitem__(key, bad)

    v = run_mutant(env, lambda c: Stale(capacity_bytes=c), faults=False)
    assert v is not None and v.name == "restore"


def test_refusing_an_oversize_entry_is_accepted_and_evicting_for_it_is_not(env: ModelEnv) -> None:
    import llama_cpp

    class Refuses(llama_cpp.LlamaRAMCache):
        def __setitem__(self, key: Any, value: Any) -> None:
            if value.llama_state_size > self.capacity_bytes:
                while self.cache_size > self.capacity_bytes:
                    self.cache_state.popitem(last=False)
                return
            super().__setitem__(key, value)

    class RefusesLate(llama_cpp.LlamaRAMCache):
        def __setitem__(self, key: Any, value: Any) -> None:
            if value.llama_state_size > self.capacity_bytes:
                if self.cache_state:
                    self.cache_state.popitem(last=False)
                while self.cache_size > self.capacity_bytes:
                    self.cache_state.popitem(last=False)
                return
            super().__setitem__(key, value)

    strict = ALL_KNOWN - {"oversize_flushes_cache"}
    assert run_mutant(env, lambda c: Refuses(capacity_bytes=c), tolerate=strict) is None
    v = run_mutant(env, lambda c: RefusesLate(capacity_bytes=c), tolerate=strict, n=300)
    assert v is not None and v.name == "oversize"  # with one entry cached it looks like upstream's flush
    v = run_mutant(env, ram, tolerate=strict)
    assert v is not None and v.finding == "oversize_flushes_cache"


def test_a_half_insert_on_failure_breaks_fault_atomicity(env: ModelEnv) -> None:
    import llama_cpp

    class HalfInsert(llama_cpp.LlamaRAMCache):
        def __setitem__(self, key: Any, value: Any) -> None:
            key = tuple(key)
            placeholder = llama_cpp.LlamaState(value.input_ids, value.scores, value.n_tokens, b"", 0, value.seed)
            self.cache_state.pop(key, None)
            self.cache_state[key] = placeholder
            _ = self.cache_size  # may fail: the placeholder stays
            self.cache_state[key] = value
            while self.cache_size > self.capacity_bytes and self.cache_state:
                self.cache_state.popitem(last=False)

    v = run_mutant(env, lambda c: HalfInsert(capacity_bytes=c))
    assert v is not None and v.name == "fault_atomic" and v.finding is None


def test_an_atomic_insert_passes_fault_atomicity_strictly(env: ModelEnv) -> None:
    import llama_cpp

    class Atomic(llama_cpp.LlamaRAMCache):
        def __setitem__(self, key: Any, value: Any) -> None:
            key = tuple(key)
            new: OrderedDict[Any, Any] = OrderedDict(self.cache_state)
            new.pop(key, None)
            new[key] = value
            if value.llama_state_size > self.capacity_bytes:
                new.pop(key)
            while sum(s.llama_state_size for s in new.values()) > self.capacity_bytes:
                new.popitem(last=False)
            _ = self.cache_size  # a failure here leaves the old contents
            self.cache_state = new

    strict = ALL_KNOWN - {"fault_leaves_over_capacity", "reinsert_fault_loses_entry", "oversize_flushes_cache"}
    assert run_mutant(env, lambda c: Atomic(capacity_bytes=c), tolerate=strict) is None


def test_diagnose_fault_classifies() -> None:
    a, b, c = (1,), (1, 2), (1, 3)
    assert lcp.diagnose_fault([a, b], [a, b], c, [b, c], False) == ("unchanged", None)
    assert lcp.diagnose_fault([a, b], [b, c], c, [b, c], False) == ("inserted", None)
    assert lcp.diagnose_fault([a, b], [a], b, [a, b], False) == ("lost", "reinsert_fault_loses_entry")
    assert lcp.diagnose_fault([a, b], [a, b, c], c, [b, c], True) == ("over-capacity", "fault_leaves_over_capacity")
    assert lcp.diagnose_fault([a, b], [c], c, [b, c], False)[1] is None


@pytest.mark.parametrize("finding", KNOWN_LCP_FINDINGS, ids=lambda f: f.id)
def test_reproducer_exits_1_while_the_bug_is_present(finding: lcp.LcpFinding) -> None:
    p = subprocess.run([sys.executable, finding.reproducer], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert p.returncode == 1, p.stdout + p.stderr
    assert "BUG:" in p.stdout
