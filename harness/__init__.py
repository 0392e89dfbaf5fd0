"""A reference model of llama-server's prompt cache, slots and context checkpoints.

The model mirrors llama.cpp at commit 0c1e570 (vendored by llama-cpp-python 0.3.36) in two
semantics: ``master`` (checkpoint payloads deep-copied, ``bad_alloc`` caught only around the state
resize) and ``shared`` (PR #27451: immutable shared payloads, copy-on-write update, the whole
entry construction inside the handler). Memory is observed exactly through :class:`Host`: every
allocation passes one seam that can fail, and a ledger counts logical and physical bytes.

Public surface: the model classes, :func:`make_server`, the semantics, the providers and the two
exceptions. Everything else is private to the package.
"""

from .build import make_server
from .cache import ServerPrompt, ServerPromptCache, ServerPromptCacheState, ServerPromptData
from .checkpoint import CheckpointList, CommonPromptCheckpoint
from .errors import BadAlloc, GgmlAbort
from .memory import AllocationSeam, Host, Ledger, OperationStats, Payload
from .provider import (
    STATE_SEQ_FLAGS_NONE,
    STATE_SEQ_FLAGS_PARTIAL_ONLY,
    MemoryKind,
    SeqRmType,
    StateProvider,
    SyntheticProvider,
)
from .semantics import MASTER, SEMANTICS, SHARED, Semantics, get_semantics
from .server import ServerContext, ServerParams, ServerSlot, SlotState, Task

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
    "make_server",
]
