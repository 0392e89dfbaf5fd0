"""The record of a known finding (:class:`Finding`) and the state in which the contract machine shows one
(:class:`ContractCondition`). Imports nothing of the project."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["ContractCondition", "Finding"]


@dataclass(frozen=True)
class ContractCondition:
    """The state in which the contract machine (``properties/libllama_contract.py``) shows a finding.

    The machine tags each call with the conditions that hold (``seq_rm_range`` of a recurrent
    memory's range short of the tail is ``seq_rm_range:recurrent_not_tail``); a violation is this
    finding when a call since the last check carries ``op:tag``, on one of ``archs``, with the KV mode
    ``kv_unified`` (None: either).
    """

    op: str
    tag: str
    archs: frozenset[str]
    kv_unified: bool | None = None

    def matches(self, arch: str, kv_unified: bool, tags: Iterable[str]) -> bool:
        if arch not in self.archs:
            return False
        if self.kv_unified is not None and kv_unified != self.kv_unified:
            return False
        return f"{self.op}:{self.tag}" in set(tags)


@dataclass(frozen=True)
class Finding:
    """A suspected upstream bug: ``id`` is its name everywhere (JSON, reproducer, replay lines)."""

    id: str
    backend: str  # "synthetic" | "llama" | "server" | "llama-cpp-python-cache" | "contract" (harness contract)
    property: str  # the property it violates
    title: str
    reproducer: str | None = None  # path of the standalone reproducer, relative to the repository
    scope: tuple[str, ...] = ()  # where it applies, when narrower than the backend (e.g. the cache kind)
    upstream: str | None = None  # where upstream's code is at fault, file:line at 0c1e570, when not in the title
    condition: ContractCondition | None = None  # the contract machine's: the state that shows it

    def entry(self, machine: str, status: str, **extra: Any) -> dict[str, Any]:
        """The ``known_findings`` row: id, title, machine, reproducer (if any), status, then ``extra``."""
        row: dict[str, Any] = {"id": self.id, "title": self.title, "machine": machine}
        if self.reproducer is not None:
            row["reproducer"] = self.reproducer
        row["status"] = status
        row.update(extra)
        return row
