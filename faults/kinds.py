"""The one table of fault kinds, and the outcome classes every layer reports in.

Each :class:`FaultKind` says how the fault is armed and disarmed, which errors count as accepted,
what the fault can reach and what it cannot, and which entry point runs it. The module docstring of
:mod:`faults` renders the same table for readers; :data:`FAULT_KINDS` is what code and tests use.

Outcomes (:class:`Outcome`) are the same words in every fault layer, report and JSON file. The
model seam's sweep (:mod:`faults.sweep`) runs in process and reports the first five; the child
layers (``pymem``, ``rlimit``, ``native``, :mod:`faults.llama_native`, :mod:`faults.lcp_cache`) add the
two deaths a real process can die. Each layer's finer word (``MemoryError`` escaped or absorbed, the
call reported or absorbed the failure, the cache unchanged or inserted) is in the trial's detail.

``ok``                  no fault fired (or none was reached); the act gave the right result and every
                        invariant holds. The trial that ends a sweep is ``ok``.
``accepted-error``      a fault fired and the code under test absorbed or reported it as its contract
                        promises (``alloc`` caught ``bad_alloc`` and recovered; a ``MemoryError`` left
                        the state consistent; libllama returned its failure value; the cache holds what
                        it held before or that plus the new entry); every invariant holds.
``violation``           a wrong result, or an invariant broke (including ``no_partial_entries``, an
                        inconsistent state after a ``MemoryError``, a lost cache entry).
``crash``               an error escaped the target on a path the contract under test covers (or any
                        non-allocation error escaped): upstream would terminate.
``crash-out-of-scope``  an allocation failure escaped where nothing under test promises to handle it:
                        a ``bad_alloc`` on a path that neither upstream nor PR #27451 protects
                        (checkpoint creation, slot clone, speculative checkpoint update), or a failure
                        of the harness's own Python allocations. Reported and counted on its own,
                        never folded into ``ok`` and never counted as a failure of the target.
``aborted``             a child process died of SIGABRT: a ``bad_alloc`` or ``GGML_ABORT`` nobody
                        caught, the native form of ``crash``; reported with its stacks.
``killed``              a child process died of another signal (SIGSEGV ...), hung past its
                        watchdog and was killed, or ended without reporting its trial; reported with
                        its stacks.

:attr:`Outcome.failed` is the same in every layer: ``violation``, ``crash``, ``aborted`` and
``killed`` are findings; ``ok``, ``accepted-error`` and ``crash-out-of-scope`` are not.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from harness.child import ChildResult

__all__ = ["FAULT_KINDS", "OUTCOMES", "FaultKind", "Outcome", "died"]


class Outcome(StrEnum):
    """How one fault trial ended (see the module docstring); serialises as its value."""

    OK = "ok"
    ACCEPTED = "accepted-error"
    VIOLATION = "violation"
    CRASH = "crash"
    CRASH_OUT_OF_SCOPE = "crash-out-of-scope"
    ABORTED = "aborted"
    KILLED = "killed"

    @property
    def failed(self) -> bool:
        """A finding in every layer: a wrong result, a broken invariant, an escape or a dead process."""
        return self in _FAILED


_FAILED = frozenset({Outcome.VIOLATION, Outcome.CRASH, Outcome.ABORTED, Outcome.KILLED})
OUTCOMES: tuple[Outcome, ...] = tuple(Outcome)


def died(child: ChildResult) -> Outcome:
    """The outcome of a trial whose child process ended without reporting it."""
    return Outcome.ABORTED if child.signal == "SIGABRT" else Outcome.KILLED


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
            runner="faults.pymem.sweep_pymem(scenario, semantics, ...)",
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
