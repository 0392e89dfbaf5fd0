"""Known findings of llama-cpp-python 0.3.36's own caches (``LlamaRAMCache``, ``LlamaDiskCache``)."""

from __future__ import annotations

from harness.findings.record import Finding

__all__ = [
    "DISK_LOOKUP_REMOVES_ENTRY",
    "FAULT_LEAVES_OVER_CAPACITY",
    "LCP_CACHES",
    "LOOKUP_UNUSABLE_FOR_RECURRENT",
    "OVERSIZE_FLUSHES_CACHE",
    "RAM_SIZE_IGNORES_SCORES",
    "REINSERT_FAULT_LOSES_ENTRY",
]

# ---- llama-cpp-python 0.3.36's own caches ----
RAM_SIZE_IGNORES_SCORES = Finding(
    "ram_size_ignores_scores",
    "llama-cpp-python-cache",
    "accounting",
    "LlamaRAMCache.cache_size ignores each entry's scores and input_ids",
    "fixtures/findings/lcp_ram_size_ignores_scores.py",
    ("ram",),
    detail=(
        "LlamaRAMCache.cache_size sums llama_state_size only; every entry also holds the state's scores "
        "(n_tokens x n_vocab float32) and input_ids (n_ctx int32), so capacity_bytes does not bound the memory"
    ),
)

OVERSIZE_FLUSHES_CACHE = Finding(
    "oversize_flushes_cache",
    "llama-cpp-python-cache",
    "oversize",
    "an entry larger than capacity_bytes empties the whole cache",
    "fixtures/findings/lcp_oversize_flushes_cache.py",
    ("ram", "disk"),
    detail=(
        "inserting an entry larger than capacity_bytes evicts every cached entry and then the new one: "
        "the cache ends empty"
    ),
)

DISK_LOOKUP_REMOVES_ENTRY = Finding(
    "disk_lookup_removes_entry",
    "llama-cpp-python-cache",
    "lookup",
    "LlamaDiskCache's lookup removes the entry it returns",
    "fixtures/findings/lcp_disk_lookup_removes_entry.py",
    ("disk",),
    detail=("LlamaDiskCache.__getitem__ pops the entry it returns: a second lookup of the same prompt misses"),
)

LOOKUP_UNUSABLE_FOR_RECURRENT = Finding(
    "lookup_unusable_for_recurrent",
    "llama-cpp-python-cache",
    "lookup",
    "the longest-prefix lookup returns a key a recurrent model cannot resume from",
    "fixtures/findings/lcp_lookup_unusable_for_recurrent.py",
    ("ram", "disk"),
    detail=(
        "_find_longest_prefix_key returns the key with the longest common prefix even when it diverges from "
        "the prompt; a recurrent model cannot truncate the loaded state, so Llama re-evaluates everything while "
        "a stored key that is a prefix of the prompt was usable"
    ),
)

FAULT_LEAVES_OVER_CAPACITY = Finding(
    "fault_leaves_over_capacity",
    "llama-cpp-python-cache",
    "fault_atomic",
    "a MemoryError in the eviction loop leaves the cache above capacity_bytes",
    "fixtures/findings/lcp_fault_leaves_over_capacity.py",
    ("ram", "disk"),
    detail=(
        "a MemoryError from the size computation in __setitem__'s eviction loop leaves the new entry in and the "
        "cache above capacity_bytes"
    ),
)

REINSERT_FAULT_LOSES_ENTRY = Finding(
    "reinsert_fault_loses_entry",
    "llama-cpp-python-cache",
    "fault_atomic",
    "a failure while re-inserting a key loses its cached entry",
    "fixtures/findings/lcp_reinsert_fault_loses_entry.py",
    ("ram", "disk"),
    detail=(
        "__setitem__ deletes an existing key before storing the new value; a failure in between (disk: "
        "pickling, e.g. under an address-space limit; RAM: the OrderedDict insertion) loses the cached entry"
    ),
)

LCP_CACHES = [
    RAM_SIZE_IGNORES_SCORES,
    OVERSIZE_FLUSHES_CACHE,
    DISK_LOOKUP_REMOVES_ENTRY,
    LOOKUP_UNUSABLE_FOR_RECURRENT,
    FAULT_LEAVES_OVER_CAPACITY,
    REINSERT_FAULT_LOSES_ENTRY,
]
