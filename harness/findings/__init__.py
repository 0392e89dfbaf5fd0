"""The one registry of known findings: suspected upstream bugs the gate reports and does not fail on.

A :class:`Finding` names the property it violates, the backend that sees it, where upstream's code
is at fault (file:line at 0c1e570 unless said otherwise) and, where one exists, the standalone
reproducer under ``fixtures/findings/`` that exits 1 while the bug is present. Each backend decides
*whether* a run shows a finding (matched by the violated property and the state that makes it, never
by a broad tolerance); this table says *what* each one is, once. :class:`KnownRow` is a run's row of one
(``known_findings`` in the gate's JSON). The contract machine's findings also say where upstream is
at fault (``upstream``) and the state that shows them (:class:`ContractCondition`).

The rows live by backend in this package's modules (``synthetic``, ``libllama``, ``server``,
``lcp_cache``), each a module-level constant named after its id (``busy-slot-by-id`` is
:data:`BUSY_SLOT_BY_ID`), re-exported here: code refers to a finding by its constant, never by its id
string (``finding(id)`` is for ids read back from JSON or a database); the record types in ``record``.
Imports nothing of the project outside it: every floor may use it.
"""

from __future__ import annotations

import json
from pathlib import Path

from harness.findings.lcp_cache import (
    DISK_LOOKUP_REMOVES_ENTRY,
    FAULT_LEAVES_OVER_CAPACITY,
    LCP_CACHES,
    LOOKUP_UNUSABLE_FOR_RECURRENT,
    OVERSIZE_FLUSHES_CACHE,
    RAM_SIZE_IGNORES_SCORES,
    REINSERT_FAULT_LOSES_ENTRY,
)
from harness.findings.libllama import (
    CACHE_LOAD_INTO_PENDING_CHILD_COPY,
    DECODE_BAD_ALLOC_TERMINATES,
    DRAFT_KV_EXHAUSTION_REAL_STATE,
    GRAPH_COMPUTE_SEGV,
    KV_LAYOUT_DEPENDENT_LOGITS,
    LIBLLAMA,
    RECURRENT_SEQ_CP_IGNORES_RANGE,
    RECURRENT_SEQ_RM_ALL_ABORT,
    RECURRENT_SEQ_RM_ANY_SEQ_REFUSED,
    RECURRENT_SEQ_RM_RANGE_SILENT,
    SEQ_ADD_MOVES_SHARED_CELLS,
    SEQ_KEEP_IGNORES_OTHER_STREAMS,
    STATE_GET_MISSES_PENDING_SEQ_CP,
    STATE_GET_MISSES_PENDING_SHIFT,
    STATE_IO_ALLOC_OUTSIDE_TRY,
    STATE_SET_LEAKS_INTO_PENDING_SEQ_CP,
    SWA_PREPARE_PURGE_NOT_UNDONE,
    SWA_RESTORE_WINDOW_SHORT,
)
from harness.findings.record import ContractCondition, Finding, KnownRow
from harness.findings.server import (
    CACHE_REUSE_RECURRENT_STALE,
    CHECKPOINT_ALLOC_TERMINATES,
    CLEARED_SLOT_KEEPS_CHECKPOINTS,
    CONCURRENT_OUTPUT_DIVERGENCE,
    DECODE_EXCEPTION_KEEPS_SLOT_TOKENS,
    FAULT_BATCH_ASSERT,
    GREEDY_FLIP_ON_CACHE_PATH,
    IDLE_STATELESS_SLOT_CACHED,
    LFM2_POOLED_COMPLETION_SEGV,
    SERVER,
    SLOT_ACTION_BAD_BODY_500,
    SLOT_FILE_FOLLOWS_SYMLINK,
    SLOT_RESTORE_ACCEPTS_FOREIGN_TOKENS,
    SLOT_RESTORE_DROPS_CHECKPOINTS,
    SLOT_RESTORE_STALE_DRAFT,
    SLOT_RESTORE_TRUNCATED_FILE_ABORT,
    SLOT_SAVE_FAILURE_ANSWERED_200,
    SLOT_SAVE_PARTIAL_FILE,
    SLOT_SAVE_SILENT_TRUNCATION,
)
from harness.findings.synthetic import (
    BUSY_SLOT_BY_ID,
    BUSY_SLOT_BY_ID_LIVELOCK,
    DRAFT_KV_EXHAUSTION,
    ID_SLOT_EMPTY_SKIPS_CACHE,
    LOAD_PICKS_UNRESUMABLE_ENTRY,
    SAVE_EVICTS_BETTER_ENTRY,
    SIMILAR_SLOT_SKIPS_BETTER_ENTRY,
    STALE_CHECKPOINT_AFTER_MISS,
    SWA_CHECKPOINT_ORDER,
    SYNTHETIC,
)

__all__ = [
    "BATCH_SHAPE_FLIP_GAP",
    "BUSY_SLOT_BY_ID",
    "BUSY_SLOT_BY_ID_LIVELOCK",
    "CACHE_LOAD_INTO_PENDING_CHILD_COPY",
    "CACHE_REUSE_RECURRENT_STALE",
    "CHECKPOINT_ALLOC_TERMINATES",
    "CLEARED_SLOT_KEEPS_CHECKPOINTS",
    "CONCURRENT_OUTPUT_DIVERGENCE",
    "DECODE_BAD_ALLOC_TERMINATES",
    "DECODE_EXCEPTION_KEEPS_SLOT_TOKENS",
    "DISK_LOOKUP_REMOVES_ENTRY",
    "DRAFT_KV_EXHAUSTION",
    "DRAFT_KV_EXHAUSTION_REAL_STATE",
    "FAULT_BATCH_ASSERT",
    "FAULT_LEAVES_OVER_CAPACITY",
    "FINDINGS",
    "GRAPH_COMPUTE_SEGV",
    "GREEDY_FLIP_ON_CACHE_PATH",
    "HISTORY_PATH",
    "IDLE_STATELESS_SLOT_CACHED",
    "ID_SLOT_EMPTY_SKIPS_CACHE",
    "KV_LAYOUT_DEPENDENT_LOGITS",
    "LFM2_POOLED_COMPLETION_SEGV",
    "LOAD_PICKS_UNRESUMABLE_ENTRY",
    "LOOKUP_UNUSABLE_FOR_RECURRENT",
    "OVERSIZE_FLUSHES_CACHE",
    "RAM_SIZE_IGNORES_SCORES",
    "RECURRENT_SEQ_CP_IGNORES_RANGE",
    "RECURRENT_SEQ_RM_ALL_ABORT",
    "RECURRENT_SEQ_RM_ANY_SEQ_REFUSED",
    "RECURRENT_SEQ_RM_RANGE_SILENT",
    "REINSERT_FAULT_LOSES_ENTRY",
    "SAVE_EVICTS_BETTER_ENTRY",
    "SEQ_ADD_MOVES_SHARED_CELLS",
    "SEQ_KEEP_IGNORES_OTHER_STREAMS",
    "SIMILAR_SLOT_SKIPS_BETTER_ENTRY",
    "SLOT_ACTION_BAD_BODY_500",
    "SLOT_FILE_FOLLOWS_SYMLINK",
    "SLOT_RESTORE_ACCEPTS_FOREIGN_TOKENS",
    "SLOT_RESTORE_DROPS_CHECKPOINTS",
    "SLOT_RESTORE_STALE_DRAFT",
    "SLOT_RESTORE_TRUNCATED_FILE_ABORT",
    "SLOT_SAVE_FAILURE_ANSWERED_200",
    "SLOT_SAVE_PARTIAL_FILE",
    "SLOT_SAVE_SILENT_TRUNCATION",
    "STALE_CHECKPOINT_AFTER_MISS",
    "STATE_GET_MISSES_PENDING_SEQ_CP",
    "STATE_GET_MISSES_PENDING_SHIFT",
    "STATE_IO_ALLOC_OUTSIDE_TRY",
    "STATE_SET_LEAKS_INTO_PENDING_SEQ_CP",
    "SWA_CHECKPOINT_ORDER",
    "SWA_PREPARE_PURGE_NOT_UNDONE",
    "SWA_RESTORE_WINDOW_SHORT",
    "ContractCondition",
    "Finding",
    "KnownRow",
    "finding",
    "history_of",
]

#: Per model, the widest gap a greedy choice can flip across by batch shape alone (issue #41): at the first
#: token a server's answer differs from a fresh single-slot server's, the fresh server's logprob of its best
#: token minus that of the token served. Measured with ``python -m harness trace`` on 51 traced runs of
#: ``python -m harness concurrent`` (seeds 1 and 2, every configuration, ~36,000 logits reads): every
#: replay gave the server's logits bit for bit and no call was inconsistent, and the widest shift of the
#: margin between a fresh evaluation's best token and any of its top 10 was llama 0.179, gemma2 0.077,
#: jamba 0.063, lfm2 0.022 (flash attention's two kernels, ggml-cpu/ops.cpp:9547-9569), mamba 2e-5; the
#: bound is that, rounded up. The flips seen were narrower (0.003-0.039; 0.0142 at most on 2-16 token
#: answers). No entry (mamba: no attention layer): no flip is excused. The one condition under which an
#: output divergence is excused as ``concurrent-output-divergence`` or ``greedy-flip-on-cache-path``.
BATCH_SHAPE_FLIP_GAP: dict[str, float] = {"llama": 0.18, "gemma2": 0.08, "jamba": 0.07, "lfm2": 0.03}

_ALL = [*SYNTHETIC, *LIBLLAMA, *SERVER, *LCP_CACHES]

FINDINGS: dict[str, Finding] = {f.id: f for f in _ALL}
if len(FINDINGS) != len(_ALL):  # one id, one finding: a second row under an id would silently win
    raise RuntimeError(f"duplicate finding ids: {sorted(i for i in FINDINGS if sum(f.id == i for f in _ALL) > 1)}")


def finding(id: str) -> Finding:
    """The registered finding ``id`` (a KeyError names a finding nobody registered: a harness bug)."""
    return FINDINGS[id]


HISTORY_PATH = Path(__file__).with_name("history.json")
"""What ``python -m harness history --table --record`` measured last: each finding on upstream's builds (the builds
tested, each one's state, the line a report prints, the date and the harness commit). Data, not code: the
command rewrites it; a finding it does not list was not measured."""


def history_of(id: str) -> str | None:
    """The line the reports print of finding ``id`` on upstream's history (None: not measured, or no record)."""
    try:
        data = json.loads(HISTORY_PATH.read_text())
    except (OSError, ValueError):
        return None
    row = data.get("findings", {}).get(id) if isinstance(data, dict) else None
    return str(row["line"]) if isinstance(row, dict) and "line" in row else None
