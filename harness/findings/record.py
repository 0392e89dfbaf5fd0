"""The record of a known finding (:class:`Finding`), the state in which the contract machine shows one
(:class:`ContractCondition`) and a run's row of one (:class:`KnownRow`). Imports nothing of the project."""

from __future__ import annotations

import builtins
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

__all__ = ["ContractCondition", "Finding", "KnownRow"]


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
    """A suspected upstream bug: ``id`` is its name everywhere (JSON, reproducer, replay lines).

    ``title`` is one line a person reads at a glance (tables, the gate's JSON); ``detail`` is the long
    explanation: the mechanism, where upstream is at fault, what was measured."""

    id: str
    backend: str  # "synthetic" | "llama" | "server" | "llama-cpp-python-cache" | "contract" (harness contract)
    property: str  # the property it violates
    title: str
    reproducer: str | None = None  # path of the standalone reproducer, relative to the repository
    scope: tuple[str, ...] = ()  # where it applies, when narrower than the backend (e.g. the cache kind)
    upstream: str | None = None  # where upstream's code is at fault, file:line at 0c1e570, when not in the title
    condition: ContractCondition | None = None  # the contract machine's: the state that shows it
    detail: str = ""  # the long explanation (the title is one line)
    takes_binary: bool = False  # its reproducer takes a llama-server binary as its first argument (``history``)


@dataclass
class KnownRow:
    """One row of a run's known findings (the gate's ``known_findings``): which finding, where it was looked for
    (``machine``), what came of it (``status``: ``reproduced``, ``not-reproduced``, ``counted`` or
    ``unexpected``) and the figures of that run; a figure left None is not in the JSON."""

    finding: Finding
    machine: str
    status: str
    count: int | None = None  # how many times it showed
    requests: int | None = None  # counted (the reuse property's): requests that fell short
    tokens_recomputed: int | None = None  # ... and the tokens they recomputed
    times: int | None = None  # a machine family's excused finding: how often
    machines: int | None = None  # ... on how many machines
    property: str | None = None  # the property it violated, with ``message`` what was seen
    message: str | None = None
    program: str | None = None  # the program that shows it
    steps: int | None = None  # ... its number of steps

    @builtins.property  # the field ``property`` shadows the builtin in this class's body
    def id(self) -> str:
        return self.finding.id

    def to_json(self) -> dict[str, Any]:
        """id, title, detail, machine, reproducer (if any), status, then each figure that is set, in the order above."""
        f = self.finding
        row: dict[str, Any] = {"id": f.id, "title": f.title, "detail": f.detail, "machine": self.machine}
        if self.finding.reproducer is not None:
            row["reproducer"] = self.finding.reproducer
        row["status"] = self.status
        for k in _FIGURES:
            v = getattr(self, k)
            if v is not None:
                row[k] = v
        return row


_FIGURES = ("count", "requests", "tokens_recomputed", "times", "machines", "property", "message", "program", "steps")
