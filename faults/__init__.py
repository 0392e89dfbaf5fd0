"""Fault injection: allocation failures where the C++ would see ``std::bad_alloc``, and proof that
nothing is lost.

Four layers behind one table of fault kinds (:data:`FAULT_KINDS` in :mod:`faults.kinds` holds the
same rows for code): how each is armed and disarmed, which errors count as accepted, what it can
and cannot reach.

``oom-transient`` -- the model's allocation seam
    *arm/disarm*: ``host.seam.arm(nth, persistent=False, scope=...)`` / ``host.seam.disarm()``;
    only allocation ``nth`` (counted inside ``scope``) fails. *Accepted*: the save returns False
    after ``alloc``'s recovery (``limit_size = max(1, 0.4*size())``, ``update()``). *Reaches*: every
    allocation the C++ makes on the cache paths: state buffers, token clone, checkpoint copies,
    list nodes, ``states.push_back``, checkpoint payloads. *Cannot reach*: allocations the model
    does not name (Python's own, libllama's, the OS's).
``oom-persistent`` -- the model's allocation seam
    As above with ``persistent=True``: ``nth`` and every later allocation fail, so the recovery
    path runs under continued pressure and must not need memory itself.
``pymem`` -- CPython's allocator (:mod:`faults.pymem`)
    *arm/disarm*: ``_testcapi.set_nomemory(start, stop)`` in a child right before the act,
    ``_testcapi.remove_mem_hooks()`` in ``finally``, a watchdog per trial. *Accepted*: a
    ``MemoryError`` out of the act with every invariant holding afterwards. *Reaches*: any Python
    allocation, i.e. the model's own exception safety. *Cannot reach*: C++ behaviour (a Python
    ``MemoryError`` has no upstream counterpart at most points); unavailable without ``_testcapi``.
``rlimit`` -- the operating system (:mod:`faults.rlimit`)
    *arm/disarm*: ``setrlimit(RLIMIT_AS)`` in a forked child, just above what ``shared`` needs; the
    child exits. *Accepted*: ``shared`` completes the save; ``master``'s checkpoint deep copy does
    not fit. *Reaches*: real address-space exhaustion by payload buffers, the seed's transient
    copy. *Cannot reach*: a chosen allocation (size decides which fails); no sweep.
``native`` -- the C allocator (:mod:`faults.native`, ``shim.c``, ``new_demo.cpp``)
    *arm/disarm*: an LD_PRELOAD shim; ``faultshim_arm(nth, persistent)`` through ctypes or dlsym
    (or ``FAULTSHIM_NTH`` at load) / ``faultshim_disarm()``; malloc/calloc/realloc and the
    aligned allocators' ``nth`` call returns NULL and ``operator new`` throws ``std::bad_alloc``.
    *Accepted*: the program catches it; a SIGABRT or SIGSEGV is a finding reported with its
    stacks. *Observed*: the shim writes the failed allocation's call stack when it fails it, and
    :mod:`faults.sites` names its site (the first llama.cpp frame past the allocator). *Reaches*:
    native code (libstdc++, libllama and ggml's buffers, C extensions, the interpreter);
    :mod:`faults.llama_native` sweeps libllama's state calls and decode with it.
    *Cannot reach*: mmap-only or statically linked allocators.

Outcomes are one :class:`faults.kinds.Outcome` everywhere: ``ok``, ``accepted-error``, ``violation``,
``crash`` and ``crash-out-of-scope`` from every layer, ``aborted`` and ``killed`` from the layers that
run a child process (see :mod:`faults.kinds`).

**What counts as a crash, and why ``crash-out-of-scope`` exists.** Upstream catches ``bad_alloc``
only inside ``server_prompt_cache::alloc``: around the two state resizes on master, around the
whole entry construction (token clone, checkpoint copies, ``states.push_back``) with PR #27451.
That is the PR's contract, and the sweep arms the seam *scoped to the operation under test*
(``scope="save"`` counts only allocations inside ``prompt_save``) to test exactly it: there, a
``bad_alloc`` that escapes is a ``crash`` (exit 3), which is what master does on its checkpoint
copy and list append. Other paths allocate too, and neither semantics protects them:
``create_checkpoint`` (list node, ``update_tgt``/``update_dft``), ``copy_state_to`` (the child
task's prompt clone) and the speculative checkpoint update. A ``bad_alloc`` there terminates
upstream in both semantics. Those scenarios are swept with the seam scoped to the whole act and
their escapes are reported as ``crash-out-of-scope``, listed and counted on their own: neither
hidden as ``ok`` nor charged to the PR. The pass criterion of ``sweep`` is no ``violation`` and no
``crash``.

Entry points: ``python -m harness sweep`` (:mod:`faults.sweep`), ``python -m harness rlimit``
(:mod:`faults.rlimit`), ``python -m harness native`` (:mod:`faults.llama_native`),
:func:`faults.pymem.sweep_pymem`, :func:`faults.native.run_native`, :func:`faults.native.run_new_demo`,
and the ``pymem``/``rlimit`` layers on llama-cpp-python's caches (:mod:`faults.lcp_cache`, run by the
``llama-cpp-python-cache`` gate). Every child, a command or a forked function, runs through
:func:`harness.child.run_child`, which never lets a child's death or hang become the runner's.
"""

from faults.kinds import FAULT_KINDS, OUTCOMES, FaultKind, Outcome
from faults.scenarios import SCENARIOS, Scenario
from faults.sweep import SweepReport, TrialResult, parse_case_id, run_sweep, run_trial
from harness.child import ChildResult, run_child

__all__ = [
    "FAULT_KINDS",
    "OUTCOMES",
    "SCENARIOS",
    "ChildResult",
    "FaultKind",
    "Outcome",
    "Scenario",
    "SweepReport",
    "TrialResult",
    "parse_case_id",
    "run_child",
    "run_sweep",
    "run_trial",
]
