"""The one table of fault kinds, and the outcome classes every layer reports in.

Each :class:`FaultKind` says how the fault is armed and disarmed, which errors count as accepted,
what the fault can reach and what it cannot, and which entry point runs it. The module docstring of
:mod:`faults` renders the same table for readers; :data:`FAULT_KINDS` is what code and tests use.

Outcomes (:data:`OUTCOMES`) are the same words in every report and JSON file:

``ok``                  no fault fired; the scenario gave the right result; every invariant holds.
``accepted-error``      a fault fired and the code under test absorbed it as upstream promises
                        (``alloc`` caught ``bad_alloc`` and recovered); the result is one of the
                        documented degraded results; every invariant holds.
``violation``           a wrong result, or an invariant broke (including ``no_partial_entries``).
``crash``               an error escaped the target on a path the PR's handler is meant to cover
                        (or any non-allocation error escaped): upstream would terminate.
``crash-out-of-scope``  a ``bad_alloc`` escaped on a path that neither upstream nor PR #27451
                        protects (checkpoint creation, slot clone, speculative checkpoint update).
                        Upstream terminates there in both semantics; it is reported and counted on
                        its own, never folded into ``ok`` and never counted as a failure of the PR.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final, Literal

__all__ = [
    "ACCEPTED",
    "CRASH",
    "CRASH_OUT_OF_SCOPE",
    "FAULT_KINDS",
    "OK",
    "OUTCOMES",
    "VIOLATION",
    "FaultKind",
    "Outcome",
]

Outcome = Literal["ok", "accepted-error", "violation", "crash", "crash-out-of-scope"]

OK: Final = "ok"
ACCEPTED: Final = "accepted-error"
VIOLATION: Final = "violation"
CRASH: Final = "crash"
CRASH_OUT_OF_SCOPE: Final = "crash-out-of-scope"
OUTCOMES: tuple[Outcome, ...] = (OK, ACCEPTED, VIOLATION, CRASH, CRASH_OUT_OF_SCOPE)


@dataclass(frozen=True)
class FaultKind:
    """One row of the contract table."""

    name: str
    layer: str
    arm: str
    disarm: str
    accepted: str
    reaches: str
    cannot_reach: str
    runner: str


FAULT_KINDS: dict[str, FaultKind] = {
    k.name: k
    for k in (
        FaultKind(
            name="oom-transient",
            layer="model seam",
            arm="host.seam.arm(nth, persistent=False, scope=...): allocation #nth (counted inside the scope) fails",
            disarm="host.seam.disarm(); a scoped seam also disarms itself when a failed operation of that scope ends",
            accepted="save returns False after alloc's bad_alloc recovery (limit_size = max(1, 0.4*size()), update())",
            reaches="every allocation the C++ makes on the cache paths: state buffers, token clone, checkpoint copies, "
            "list nodes, states.push_back, checkpoint payloads",
            cannot_reach="allocations the model does not name (Python's own, libllama's, the OS's)",
            runner="python -m harness sweep --mode transient",
        ),
        FaultKind(
            name="oom-persistent",
            layer="model seam",
            arm="host.seam.arm(nth, persistent=True, scope=...): allocation #nth and every later one fail",
            disarm="as oom-transient",
            accepted="as oom-transient; the recovery path itself must not need to allocate",
            reaches="as oom-transient, plus every allocation after the first failure (recovery under pressure)",
            cannot_reach="as oom-transient",
            runner="python -m harness sweep --mode persistent",
        ),
        FaultKind(
            name="pymem",
            layer="CPython allocator",
            arm="_testcapi.set_nomemory(start, stop) in a child process, right before the act",
            disarm="_testcapi.remove_mem_hooks() in a finally; a watchdog kills a child whose hook hangs it",
            accepted="MemoryError out of the act with every invariant holding afterwards",
            reaches="any Python allocation (model bookkeeping, dicts, tuples, digests): exception safety of the model",
            cannot_reach="C++ behaviour: a Python MemoryError has no upstream counterpart at most of those points; "
            "unavailable when the interpreter lacks _testcapi",
            runner="faults.pymem.sweep_pymem(scenario, variant, ...)",
        ),
        FaultKind(
            name="rlimit",
            layer="operating system",
            arm="resource.setrlimit(RLIMIT_AS or RLIMIT_DATA) in a forked child, just above what shared needs",
            disarm="the child exits; the limit never touches the runner",
            accepted="shared: the save completes; master: the checkpoint deep copy does not fit (its bad_alloc "
            "escapes, as upstream would terminate)",
            reaches="real address-space exhaustion by the payload buffers: the seed's transient deep copy",
            cannot_reach="which allocation fails is decided by size, not by number; no sweep",
            runner="python -m harness rlimit",
        ),
        FaultKind(
            name="native",
            layer="C allocator (LD_PRELOAD shim)",
            arm="faultshim_arm(nth, persistent) through ctypes/dlsym, or FAULTSHIM_NTH at load: malloc, calloc, "
            "realloc, posix_memalign, aligned_alloc, memalign #nth fail, so operator new throws std::bad_alloc",
            disarm="faultshim_disarm() (returns the number fired); the shim disarms itself on a fatal signal",
            accepted="the program catches std::bad_alloc; a SIGABRT/SIGSEGV is a finding with its stacks",
            reaches="native code in the child: libstdc++ operator new, libllama/ggml buffers, C extensions, "
            "the interpreter",
            cannot_reach="mmap-only allocators, statically linked allocators",
            runner="faults.native.run_native(argv, nth=...), run_new_demo(nth, catch=...), "
            "faults.llama_native.sweep_llama_native(arch, op)",
        ),
    )
}
