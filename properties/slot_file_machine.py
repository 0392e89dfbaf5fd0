"""The prompt-cache machine with slot files: save, restore and erase between requests (issue #39, point 1).

:class:`SlotFileMachine` is :class:`properties.machine.PromptCacheMachine` (every rule, fault and state invariant
of the gate's machines) plus the three slot actions of :mod:`harness.model.slot_files` on a
:class:`~harness.model.slot_files.SlotFileStore`, a disk that fills up (``fill_disk``: ENOSPC mid-write) and an
injected write error (``arm_write_fault``: the host's fault seam, scope ``"slot_save"``). Two properties beside
the gate's (which keep running after every step, so immutability and refcounts hold across a save to file and
back, and, on a libllama machine, restore equivalence compares the first decode after a file restore with a
fresh evaluation):

* ``slot_file_restore`` (checked in the restore step): after a restore that answered 200 the slot's tokens are
  the file's, its target state is the file's bytes (``state_seq_get_data`` equals what was saved, when the file
  came from the same slot: a real state names its sequence), and every
  checkpoint it holds was made for a prefix of those tokens (upstream holds none: ``prompt.clear()``);
* ``no_partial_file`` (after every step): every file in the store is complete, except the two registered
  upstream findings (``slot-save-partial-file``: a save that answered 500 leaves the bytes it wrote;
  ``slot-save-silent-truncation``: a save that met ENOSPC only in its last ``BUFSIZ`` bytes answers 200), each
  excused only in exactly that shape unless the config's ``known`` has ``strict-slot-files``.

* ``draft_in_step`` (the gate's) excuses, on a draft machine, the draft of a slot restored from a file until it is
  back in step (registered finding ``slot-restore-stale-draft``: the file has no draft state), unless ``strict``.

A restore of a partial file aborts upstream (``slot-restore-truncated-file-abort``); the machine does not send
it (it counts the restores it skipped, ``partial_restores_skipped``), the model's tests do.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import replace
from types import SimpleNamespace
from typing import Any, ClassVar

from hypothesis import strategies as st
from hypothesis.stateful import precondition, rule

from harness.findings import SLOT_RESTORE_STALE_DRAFT, SLOT_SAVE_PARTIAL_FILE, SLOT_SAVE_SILENT_TRUNCATION
from harness.model.slot_files import SlotFileStore, slot_erase, slot_restore, slot_save
from properties import invariants as inv
from properties.machine import FAMILIES, MachineConfig, PromptCacheMachine
from properties.mutants import SLOT_FILE_MUTANTS
from properties.teardown import noted

__all__ = ["NAMES", "SlotFileMachine", "partial_shape", "slot_file_machine"]

NAMES = ("a.bin", "b.bin")
PARTIAL_500 = SLOT_SAVE_PARTIAL_FILE.id
SILENT = SLOT_SAVE_SILENT_TRUNCATION.id
STALE_DRAFT = SLOT_RESTORE_STALE_DRAFT.id


def check_slot_restore(server: Any, id_slot: int, tokens: tuple[int, ...], state: bytes | None) -> None:
    """``slot_file_restore``: the slot holds the file's tokens and state, and no checkpoint of another prompt.

    ``state``: the saved bytes when the file was written from this slot (a real state names its sequence, so
    another slot's differs in that field: there libllama's restore-equivalence check compares logits instead)."""
    s = server.slots[id_slot]
    if s.prompt.tokens != tokens:
        inv._fail("slot_file_restore", f"slot{id_slot}: {len(s.prompt.tokens)} tokens, file {len(tokens)}")
    # an empty file is skipped: libllama's KV cache reads a zero-cell stream without clearing the destination
    # (src/llama-kv-cache.cpp:2179-2185: ``continue`` before state_read_meta's seq_rm), so the old cells stay;
    # harmless on the server (the next request finds n_past 0 and removes them), an observation, not a finding
    if state is not None and tokens and server.ctx_tgt.state_seq_get_data_ext(id_slot, 0) != state:
        inv._fail("slot_file_restore", f"slot{id_slot}: the target state after restore is not the file's")
    for c in s.prompt.checkpoints.items:
        if c.made_for != tokens[: c.n_tokens]:
            inv._fail("slot_file_restore", f"slot{id_slot}: checkpoint at {c.n_tokens} made for another prompt")


def partial_shape(size: int, written: int, status: int | None, full_disk: bool, silent_tail: int) -> str | None:
    """The registered finding whose exact shape a partial file (``written`` of ``size`` bytes on disk) has, or None
    when none explains it: ``slot-save-partial-file`` (the save answered 500), ``slot-save-silent-truncation`` (it
    answered 200 on a full disk and lost at most the buffered tail, ``silent_tail`` bytes)."""
    if status == 500:
        return PARTIAL_500
    if status == 200 and full_disk and size - written <= silent_tail:
        return SILENT
    return None


def check_no_partial_file(store: SlotFileStore, statuses: dict[str, int], strict: bool, seen: Counter[str]) -> None:
    """``no_partial_file``, with the two registered findings excused in their exact shape unless ``strict``."""
    for name, f in store.files.items():
        if f.complete:
            continue
        status = statuses.get(name)
        shape = partial_shape(f.size, f.written, status, store.capacity is not None, store.silent_tail)
        if shape is not None and not strict:
            seen[shape] += 1
        else:
            inv._fail("no_partial_file", f"{name}: {f.written} of {f.size} bytes on disk, save answered {status}")


class SlotFileMachine(PromptCacheMachine):
    """The gate's machine plus slot save/restore/erase, a filling disk and a write fault."""

    found: ClassVar[Counter[str]]  # registered findings seen (excused), over the class's examples
    actions: ClassVar[Counter[str]]  # slot actions sent and their status
    store_cls: ClassVar[type[SlotFileStore]] = SlotFileStore

    def __init__(self) -> None:
        super().__init__()
        self.store = self.store_cls()
        self.statuses: dict[str, int] = {}  # file name -> the status of the save that wrote it
        self.stale_draft: set[int] = set()  # slots restored on a draft machine whose draft is not yet back in step
        self.checks = (*self.checks, ("no_partial_file", self._check_files))

    def _check_files(self, server: Any) -> None:
        strict = "strict-slot-files" in self.config.known
        check_no_partial_file(self.store, self.statuses, strict, type(self).found)

    def _check_in_step(self, server: Any) -> None:
        """``draft_in_step``, with the draft of a slot restored from a file excused (``slot-restore-stale-draft``:
        upstream restores the target only) until it is back in step (an erase, a request from n_past 0)."""
        if "strict-slot-files" in self.config.known or server.ctx_dft is None or not self.stale_draft:
            super()._check_in_step(server)
            return
        for s in list(self.stale_draft):
            if server.ctx_dft.seq_tokens(s) == server.slots[s].prompt.tokens:
                self.stale_draft.discard(s)
            else:
                type(self).found[STALE_DRAFT] += 1
        rest = [s for s in server.slots if s.id not in self.stale_draft]
        stale = [s for s in server.slots if s.id in self.stale_draft]
        common = {"ctx_tgt": server.ctx_tgt, "stale_restores": server.stale_restores}
        super()._check_in_step(SimpleNamespace(slots=rest, ctx_dft=server.ctx_dft, **common))
        super()._check_in_step(SimpleNamespace(slots=stale, ctx_dft=None, **common))  # their target, still

    def _idle(self) -> bool:
        return not self.crashed and not self._busy()

    @precondition(_idle)
    @rule(id_slot=st.integers(0, 1), name=st.sampled_from(NAMES))
    @noted
    def save_slot(self, id_slot: int, name: str) -> None:
        """``POST /slots/{id}?action=save``."""
        r = self._guard("slot_save", slot_save, self.server, id_slot % self.params.n_slots, name, self.store)
        if r is not None:
            self.statuses[name] = r.status
            type(self).actions[f"save {r.status}"] += 1
        if self.server.host.seam.scope == "slot_save":
            self.server.host.seam.disarm()

    @precondition(_idle)
    @rule(id_slot=st.integers(0, 1), name=st.sampled_from(NAMES))
    @noted
    def restore_slot(self, id_slot: int, name: str) -> None:
        """``POST /slots/{id}?action=restore``; a partial file (upstream aborts) is not sent."""
        id_slot %= self.params.n_slots
        f = self.store.files.get(name)
        if f is not None and not f.complete:
            type(self).actions["partial_restores_skipped"] += 1
            return
        r = self._guard("slot_restore", slot_restore, self.server, id_slot, name, self.store)
        if r is None:
            return
        type(self).actions[f"restore {r.status}"] += 1
        if r.ok and self.server.ctx_dft is not None:
            self.stale_draft.add(id_slot)
        if r.ok and f is not None and self.checks_on:
            check_slot_restore(self.server, id_slot, f.tokens, f.state if f.id_slot == id_slot else None)
            type(self).stats_checked["slot_file_restore"] += 1

    @precondition(_idle)
    @rule(id_slot=st.integers(0, 1))
    @noted
    def erase_slot(self, id_slot: int) -> None:
        """``POST /slots/{id}?action=erase``."""
        r = self._guard("slot_erase", slot_erase, self.server, id_slot % self.params.n_slots)
        if r is not None:
            type(self).actions[f"erase {r.status}"] += 1

    @rule(free=st.integers(0, 4096))
    @noted
    def fill_disk(self, free: int) -> None:
        """The file system keeps ``free`` bytes beyond what the store holds now (ENOSPC past them)."""
        self.store.capacity = self.store.used() + free

    @rule(nth=st.integers(1, 5))
    @noted
    def arm_write_fault(self, nth: int) -> None:
        """The ``nth`` write of the next save fails (``write error``)."""
        self.server.host.seam.arm(nth, scope="slot_save")
        self.unchanged = True


_CLASSES: dict[tuple[MachineConfig, type[SlotFileStore]], type[SlotFileMachine]] = {}


def slot_file_machine(config: MachineConfig, store_cls: type[SlotFileStore] = SlotFileStore) -> type[SlotFileMachine]:
    """The slot-file machine for ``config`` (its base's rules and checks), with ``store_cls`` (mutants); the
    family ``slot_files`` of :func:`properties.machine.machine_class`, where a config whose semantics names a
    slot-file mutant (:data:`properties.mutants.SLOT_FILE_MUTANTS`) gets that mutant's store."""
    config = replace(config, family="slot_files")
    key = (replace(config, resolve=None), store_cls)
    cls = _CLASSES.get(key)
    if cls is None:
        own = store_cls is SlotFileStore or SLOT_FILE_MUTANTS.get(config.semantics, (None,))[0] is store_cls
        name = config.class_name + ("" if own else "_" + store_cls.__name__)
        attrs = {
            "config": config, "stats_checked": Counter(), "stats_seconds": Counter(), "stats_branches": Counter(),
            "peaks": [], "llama_stats": Counter(), "layout_example": [], "finding_examples": {}, "reach": Counter(),
            "reuse_counts": Counter(),
            "found": Counter(), "actions": Counter(), "store_cls": store_cls, "__module__": __name__,
        }  # fmt: skip
        cls = type(name, (SlotFileMachine,), attrs)
        _CLASSES[key] = cls
        globals()[name] = cls
    return cls


def _family(config: MachineConfig) -> type[SlotFileMachine]:
    return slot_file_machine(config, SLOT_FILE_MUTANTS.get(config.semantics, (SlotFileStore, ""))[0])


FAMILIES["slot_files"] = _family
