"""The reference model of llama-server's prompt cache, slots and context checkpoints.

The model mirrors llama.cpp at commit 0c1e570 (vendored by llama-cpp-python 0.3.36) in two
semantics: ``master`` (checkpoint payloads deep-copied, ``bad_alloc`` caught only around the state
resize) and ``shared`` (PR #27451: immutable shared payloads, copy-on-write update, the whole
entry construction inside the handler). Memory is observed exactly through
:class:`~harness.model.memory.Host`: every allocation passes one seam that can fail, and a ledger
counts logical and physical bytes.

- ``cache.py``: ``server_prompt``, ``server_prompt_cache`` (alloc, load, update, limits)
- ``checkpoint.py``: ``common_prompt_checkpoint`` and its list
- ``server_context.py``: slots, slot selection, checkpoint creation and restore, speculative rounds
  (upstream ``tools/server/server-context.cpp``)
- ``memory.py``: the allocation seam and the byte ledger
- ``provider.py``: the ``StateProvider`` protocol and the synthetic provider of four memory kinds
- ``semantics.py``: ``master`` / ``shared``

May import: ``harness.errors`` and the standard library. Nothing above it.
"""

from harness.errors import BadAlloc, GgmlAbort
from harness.model.cache import ServerPrompt, ServerPromptCache, ServerPromptCacheState, ServerPromptData
from harness.model.checkpoint import CheckpointList, CommonPromptCheckpoint
from harness.model.memory import AllocationSeam, Host, Ledger, OperationStats, Payload
from harness.model.provider import (
    STATE_SEQ_FLAGS_NONE,
    STATE_SEQ_FLAGS_PARTIAL_ONLY,
    MemoryKind,
    SeqRmType,
    StateProvider,
    SyntheticProvider,
)
from harness.model.semantics import MASTER, SEMANTICS, SHARED, Semantics, get_semantics
from harness.model.server_context import ServerContext, ServerParams, ServerSlot, SlotState, Task

__all__ = [
    "MASTER",
    "SEMANTICS",
    "SHARED",
    "STATE_SEQ_FLAGS_NONE",
    "STATE_SEQ_FLAGS_PARTIAL_ONLY",
    "AllocationSeam",
    "BadAlloc",
    "CheckpointList",
    "CommonPromptCheckpoint",
    "GgmlAbort",
    "Host",
    "Ledger",
    "MemoryKind",
    "OperationStats",
    "Payload",
    "Semantics",
    "SeqRmType",
    "ServerContext",
    "ServerParams",
    "ServerPrompt",
    "ServerPromptCache",
    "ServerPromptCacheState",
    "ServerPromptData",
    "ServerSlot",
    "SlotState",
    "StateProvider",
    "SyntheticProvider",
    "Task",
    "get_semantics",
]
