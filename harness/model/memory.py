"""Host memory as the model sees it: one allocation seam, payloads with identity, and a ledger.

What this module promises:

* **One seam.** Every allocation that the C++ makes on the prompt-cache paths (state buffers,
  checkpoint payload copies, token clones, list nodes) is a call to :meth:`Host.allocate`. When
  the seam is armed (:meth:`AllocationSeam.arm`) the Nth call raises :class:`BadAlloc`, our
  ``std::bad_alloc``; in persistent mode every call from the Nth on fails. A zero-byte request
  never reaches the seam, as ``std::vector::resize(0)`` never calls ``operator new``.
* **Payloads observed exactly.** A :class:`Payload` is one heap buffer: an identity, its bytes,
  a digest of those bytes (made when asked), and a holder count. ``acquire``/``release``
  mirror a ``shared_ptr`` (PR semantics) or the single owner of a ``std::vector`` (master). The
  payload is freed when the last holder releases it, and the :class:`Ledger` shows it at once.
* **A ledger of bytes.** Physical live bytes are the bytes of payloads alive now. The ledger keeps
  the all-time peak, and :meth:`Host.operation` measures the peak and the metadata allocated
  within one operation (a save, a load), which is what the transient-peak property reads.

Metadata (token arrays, list nodes, checkpoint headers) goes through the seam so it can fail, and
is counted per operation in ``meta_bytes``; it is not part of the physical live bytes.
"""

from __future__ import annotations

import hashlib
import itertools
from dataclasses import dataclass, field

from harness.errors import BadAlloc

__all__ = [
    "AllocationSeam",
    "BadAlloc",
    "Host",
    "Ledger",
    "OperationStats",
    "Payload",
]

# bytes charged for metadata allocations (sizes of the C++ objects on x86-64 libstdc++)
TOKEN_BYTES = 4  # llama_token
LIST_NODE_BYTES = 16  # std::list node links
CHECKPOINT_HEADER_BYTES = 112  # common_prompt_checkpoint without its buffers' contents
ENTRY_HEADER_BYTES = 144  # server_prompt_cache_state without its buffers' contents


class AllocationSeam:
    """The one hook every modelled allocation passes through.

    ``arm(nth, persistent=False)`` makes the ``nth`` allocation from now fail (and, if persistent,
    every one after it); ``disarm()`` returns the number of faults that fired. ``sites`` records the
    sites seen since the last ``arm``/``reset_trace`` so a sweep can name each allocation point.

    ``scope``: when set, only allocations made inside a :meth:`Host.operation` of that name are
    counted and can fail (``"save"`` arms a fault for the next prompt save only), and the seam
    disarms itself when an operation of that name ends after a fault fired.

    ``min_size``: only allocations of at least that many bytes are counted (and can fail), as the
    native shim's ``FAULTSHIM_MIN_SIZE`` does in a real server; 0 counts every allocation.
    """

    def __init__(self) -> None:
        self._nth: int | None = None
        self._persistent = False
        self.scope: str | None = None
        self.count = 0
        self.fired = 0
        self.total_fired = 0  # faults fired since the seam was made, over every arming (statistics; not upstream)
        self.sites: list[str] = []
        self.fired_sites: list[str] = []
        self.min_size = 0

    @property
    def armed(self) -> bool:
        return self._nth is not None

    def arm(self, nth: int, *, persistent: bool = False, scope: str | None = None, min_size: int = 0) -> None:
        if nth < 1:
            raise ValueError(f"nth must be >= 1, got {nth}")
        self.min_size = min_size
        self._nth = nth
        self._persistent = persistent
        self.scope = scope
        self.count = 0
        self.fired = 0
        self.sites = []
        self.fired_sites = []

    def disarm(self) -> int:
        fired = self.fired
        self._nth = None
        self._persistent = False
        self.scope = None
        self.min_size = 0
        return fired

    def reset_trace(self) -> None:
        self.count = 0
        self.sites = []

    def check(self, site: str, nbytes: int) -> None:
        """Called once per allocation; raises :class:`BadAlloc` when this one is armed to fail."""
        if nbytes < self.min_size:
            return
        self.count += 1
        self.sites.append(site)
        if self._nth is None:
            return
        if self.count == self._nth or (self._persistent and self.count > self._nth):
            self.fired += 1
            self.total_fired += 1
            self.fired_sites.append(site)
            raise BadAlloc(site, self.count, nbytes)


@dataclass
class OperationStats:
    """What one operation did to host memory (filled in when the ``with`` block ends)."""

    name: str
    live_before: int
    peak: int = 0
    live_after: int = 0
    meta_bytes: int = 0
    allocations: int = 0
    # set by the operation's owner: prompt_save records the new state bytes (S) and the
    # value-owned checkpoint bytes it copies in both semantics (data_spec)
    state_bytes: int = 0
    spec_bytes: int = 0
    n_tokens: int = 0
    n_checkpoints: int = 0

    @property
    def peak_excess(self) -> int:
        """Physical bytes above the live bytes at the start of the operation, at its peak."""
        return self.peak - self.live_before


@dataclass
class Ledger:
    """Physical bytes of payloads that are alive, their all-time peak, and released payloads."""

    live_bytes: int = 0
    peak_bytes: int = 0
    live: dict[int, Payload] = field(default_factory=dict)
    released: int = 0
    released_bytes: int = 0

    def on_alloc(self, p: Payload) -> None:
        self.live[p.ident] = p
        self.live_bytes += p.nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def on_resize(self, p: Payload, old: int) -> None:
        self.live_bytes += p.nbytes - old
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def on_free(self, p: Payload) -> None:
        del self.live[p.ident]
        self.live_bytes -= p.nbytes
        self.released += 1
        self.released_bytes += p.nbytes


class Payload:
    """One heap buffer: ``std::vector<uint8_t>`` (master) or its shared immutable storage (PR).

    A payload is created with zero-filled bytes by :meth:`Host.alloc_payload`; the producer writes
    it once with :meth:`fill`. After that the bytes may change only through :meth:`rewrite`, which
    models master's in-place ``resize`` + ``get_data`` into a vector that has a single owner. Whoever
    rewrites a payload that others hold breaks snapshot immutability: the immutability property
    catches that by comparing the bytes each holder saw last with the bytes now.
    """

    __slots__ = ("_data", "_host", "holders", "ident", "kind", "nbytes", "released")

    def __init__(self, host: Host, ident: int, nbytes: int, kind: str) -> None:
        self._host = host
        self.ident = ident
        self.kind = kind
        self._set(bytes(nbytes))
        self.holders = 1
        self.released = False

    def __repr__(self) -> str:
        return f"Payload(#{self.ident} {self.kind} {self.nbytes}B holders={self.holders})"

    def _set(self, data: bytes) -> None:
        """The one writer of the bytes; ``nbytes`` (a plain attribute: the checks read it ~30 times a
        step) follows them."""
        self._data = data
        self.nbytes = len(data)

    @property
    def digest(self) -> str:
        """A short digest of the bytes now (for people and tests: no check reads it per step)."""
        return _digest(self._data)

    @property
    def data(self) -> bytes:
        if self.released:
            raise RuntimeError(f"use after free of payload #{self.ident}")
        return self._data

    def fill(self, data: bytes, *, copy: bool = False) -> int:
        """Write the buffer (``llama_state_seq_get_data_ext`` into it); returns bytes written.

        ``copy`` makes the bytes a physically distinct object (a deep copy really copies, so a
        process-level profiler such as memray sees it); otherwise freshly produced bytes are
        adopted as they are.
        """
        n = min(len(data), self.nbytes)
        head = bytes(memoryview(data)[:n]) if copy else data[:n]
        self._set(head + self._data[n:] if n < self.nbytes else head)
        return n

    def rewrite(self, data: bytes, site: str) -> None:
        """Resize in place and write (master's ``update_tgt``). Growth goes through the seam."""
        old = self.nbytes
        if len(data) > old:
            self._host._check(site, len(data))
        self._set(bytes(data))
        self._host.ledger.on_resize(self, old)
        self._host.note_peak()

    def acquire(self) -> Payload:
        if self.released:
            raise RuntimeError(f"acquire after free of payload #{self.ident}")
        self.holders += 1
        return self

    def release(self) -> None:
        if self.released or self.holders <= 0:
            raise RuntimeError(f"double release of payload #{self.ident}")
        self.holders -= 1
        if self.holders == 0:
            self.released = True
            self._host.ledger.on_free(self)


def _digest(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=12).hexdigest()


class Host:
    """The process heap of the modelled server: the seam, the ledger and operation scopes."""

    def __init__(self) -> None:
        self.seam = AllocationSeam()
        self.ledger = Ledger()
        self._ids = itertools.count(1)
        self._ops: list[OperationStats] = []
        self.last_op: OperationStats | None = None

    def _check(self, site: str, nbytes: int) -> None:
        scope = self.seam.scope
        if scope is not None:  # a scoped arm counts only allocations inside an operation of that name
            for op in self._ops:
                if op.name == scope:
                    break
            else:
                return
        self.seam.check(site, nbytes)

    def scoped_check(self, site: str, nbytes: int, scopes: tuple[str, ...]) -> None:
        """An allocation inside libllama (a state read), visible only to a seam armed for one of ``scopes``.

        Unscoped arms and arms scoped to other operations do not count it, so the numbering of the
        model's own allocation points (what the sweeps and the server differential arm by) does not
        change. Raises :class:`BadAlloc` when this allocation is the armed one.
        """
        if nbytes > 0 and self.seam.scope is not None and self.seam.scope in scopes:
            self._check(site, nbytes)

    def allocate(self, site: str, nbytes: int) -> None:
        """A metadata allocation (token array, list node, header): may fail, is counted per op."""
        if nbytes <= 0:
            return
        self._check(site, nbytes)
        for op in self._ops:
            op.meta_bytes += nbytes
            op.allocations += 1

    def alloc_payload(self, site: str, nbytes: int, kind: str) -> Payload | None:
        """``std::vector<uint8_t>(nbytes)``: a zero-filled buffer, or ``None`` for zero bytes."""
        if nbytes <= 0:
            return None
        self._check(site, nbytes)
        p = Payload(self, next(self._ids), nbytes, kind)
        self.ledger.on_alloc(p)
        for op in self._ops:
            op.allocations += 1
            op.peak = max(op.peak, self.ledger.live_bytes)
        return p

    def copy_payload(self, site: str, src: Payload | None) -> Payload | None:
        """A deep copy of ``src`` (copy-constructing a ``std::vector``)."""
        if src is None:
            return None
        p = self.alloc_payload(site, src.nbytes, src.kind)
        assert p is not None
        p.fill(src.data, copy=True)
        return p

    def note_peak(self) -> None:
        for op in self._ops:
            op.peak = max(op.peak, self.ledger.live_bytes)

    def operation(self, name: str) -> _Operation:
        """Measure one operation (``with host.operation("save") as op``): live bytes before and after,
        peak and metadata in between."""
        return _Operation(self, name)

    def _end(self, op: OperationStats) -> None:
        self._ops.remove(op)
        op.live_after = self.ledger.live_bytes
        op.peak = max(op.peak, op.live_after)
        self.last_op = op
        if self.seam.scope == op.name and self.seam.fired:
            self.seam.disarm()


class _Operation:
    """The ``with`` block of :meth:`Host.operation` (a class, not a generator: ~7k a gate example set)."""

    __slots__ = ("host", "name", "op")

    def __init__(self, host: Host, name: str) -> None:
        self.host = host
        self.name = name

    def __enter__(self) -> OperationStats:
        live = self.host.ledger.live_bytes
        self.op = OperationStats(name=self.name, live_before=live, peak=live)
        self.host._ops.append(self.op)
        return self.op

    def __exit__(self, *exc: object) -> None:
        self.host._end(self.op)
