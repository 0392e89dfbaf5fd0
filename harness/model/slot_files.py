"""Slot files: ``POST /slots/{id}?action=save|restore|erase`` with ``--slot-save-path`` (issue #39, point 1).

Upstream at 0c1e570 (tools/server/server-context.cpp; src/llama-context.cpp; src/llama-mmap.cpp):

* **save** (task ``SERVER_TASK_TYPE_SLOT_SAVE``, server-context.cpp:2526-2575; route ``handle_slots_save``
  :5271-5305): a processing slot defers the task (:2534-2539); the slot's tokens are serialized (:2546-2552) and
  ``llama_state_seq_save_file(ctx_tgt, path, id, tokens)`` (:2555) writes, through ``llama_file(path, "wb")``
  (llama-context.cpp:3377-3395): magic, version, the token count, the tokens, then the target's
  ``state_seq_write_data(seq, flags 0)``. **Only the target context**: no draft state (``ctx_dft`` is never
  written) and **no checkpoint** (``slot.prompt.checkpoints`` is not in the file). A write error throws
  (llama-mmap.cpp:363-366), ``llama_state_seq_save_file`` returns 0 (llama-context.cpp:4354-4363) and the route
  answers 500 "Unable to save slot" (:2558-2561); the bytes already written stay on disk (nothing removes the
  file). ``fwrite`` is buffered and the ``FILE`` is closed by ``~impl`` (llama-mmap.cpp:377-383) without checking
  ``fclose``: when the bytes that do not fit are the last ones still in stdio's buffer, no write fails, the save
  answers 200 with ``n_written`` the full size, and the file is short (registered finding
  ``slot-save-enospc-silent-truncation``).
* **restore** (:2576-2640): ``llama_state_seq_load_file`` twice (token count, then tokens and state:
  llama-context.cpp:3323-3375). A file too short for its header or tokens: 0, the slot is cleared
  (``prompt_clear``, :2621-2624) and the route answers 400. A file cut inside the state: ``read_raw_unsafe``
  clamps each read at the end of file without failing (llama-mmap.cpp:270-280), the reader counts the bytes it
  asked for and ``GGML_ASSERT(nread <= state_size)`` (llama-context.cpp:3370) aborts the server (registered
  finding ``slot-restore-truncated-file-abort``). On success ``slot->prompt.clear()`` then the restored tokens
  (:2618-2619): **the slot's checkpoints are dropped** (``server_prompt::clear``, server-task.h:571-574) and none
  come back from the file; the draft context is left as it was (registered finding
  ``slot-restore-drops-checkpoints``: a hybrid or recurrent slot then reprocesses the whole prompt on the next
  request that diverges before its end). The RAM prompt cache is not touched.
* **erase** (:2641-2664): ``slot->prompt_clear()`` (``seq_rm`` on both contexts, tokens and checkpoints gone).

Upstream #26004 (merged 2026-10-08; b11549's server-context.cpp:2586-2713, 2926-2930, 2997) appends the slot's
checkpoints to the file and reads them back: with ``SlotFileStore.checkpoints`` (the switch
``slot_file_checkpoints``, read from the tree by :mod:`harness.trees.switches`) a save writes, after the state, the
appendix ``"SCKP"``, version 1, the count, then per checkpoint ``n_tokens`` (i64), ``pos_min``, ``pos_max`` (i32)
and three u64-length blobs ``data_tgt``, ``data_dft``, ``data_spec`` (nothing at all when the slot has none), and
``n_saved``'s bytes count it; a restore brings them back as checkpoints of no task (``id_task`` -1), the newest
``--ctx-checkpoints`` of them, and ``n_restored``'s bytes count what it read. Deviation: the model does not
test-load the draft's data (upstream drops it when it does not fit the draft context: the model's always fits)
and does not fault the appendix's write.

The model's file is a record (tokens, the target's state bytes, the checkpoints, how many bytes of the full file
reached the disk), not bytes; its size is upstream's: 12 + 4 * n_tokens + the state. Writes go through the host's fault
seam: each ``write_raw`` is a :meth:`~harness.model.memory.Host.scoped_check` at site ``slot_file.write``
visible to a seam armed with scope ``"slot_save"`` (an injected write error), and the store's ``capacity``
(bytes free on the file system, ``None`` unlimited) cuts a write with ENOSPC. Deviation: the model writes the
state as one ``write_raw`` (upstream streams it per layer and tensor) and has no stdio buffer: whether a
short write is silent is the store's ``silent_tail`` (bytes that may be lost at ``fclose`` unseen: upstream's
``BUFSIZ``), applied only to ENOSPC.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from harness.errors import BadAlloc, GgmlAbort
from harness.model.cache import Tokens
from harness.model.checkpoint import CommonPromptCheckpoint
from harness.model.provider import STATE_SEQ_FLAGS_NONE
from harness.model.server_context import ServerContext, ServerSlot

__all__ = ["SavedCheckpoint", "SlotFile", "SlotFileResult", "SlotFileStore", "slot_erase", "slot_restore", "slot_save"]

HEADER = 12  # magic, version, token count: three u32 (llama-context.cpp:3380-3384)
APPENDIX_HEADER = 12  # "SCKP", version, count: three u32 (server-context.cpp:2633-2638 at b11549)
CHECKPOINT_RECORD = 8 + 4 + 4 + 3 * 8  # n_tokens, pos_min, pos_max, three blob lengths (:2639-2646)
STDIO_BUFSIZ = 4096  # glibc's stdio buffer for a regular file on a 4 KiB-block file system


@dataclass(frozen=True)
class SavedCheckpoint:
    """One checkpoint of the appendix, as bytes on disk: its positions and its three blobs (None: empty)."""

    n_tokens: int
    pos_min: int
    pos_max: int
    made_for: Tokens
    tgt: bytes | None
    dft: bytes | None
    spec: bytes | None

    @staticmethod
    def of(c: CommonPromptCheckpoint) -> SavedCheckpoint:
        blobs = (None if p is None else p.data for p in (c.data_tgt, c.data_dft, c.data_spec))
        return SavedCheckpoint(c.n_tokens, c.pos_min, c.pos_max, c.made_for, *blobs)

    def size(self) -> int:
        return sum(len(b or b"") for b in (self.tgt, self.dft, self.spec))

    def load(self, c: CommonPromptCheckpoint) -> None:
        """Fill a new checkpoint from the file (``ckpt_read_buf`` into its vectors)."""
        c.n_tokens, c.pos_min, c.pos_max, c.made_for = self.n_tokens, self.pos_min, self.pos_max, self.made_for
        for blob, attr, kind in ((self.tgt, "data_tgt", "ckpt_tgt"), (self.dft, "data_dft", "ckpt_dft"),
                                 (self.spec, "data_spec", "ckpt_spec")):  # fmt: skip
            if blob:
                payload = c.host.alloc_payload("slot_file.read_ckpt", len(blob), kind)
                if payload is not None:
                    payload.fill(blob)
                setattr(c, attr, payload)


@dataclass(frozen=True)
class SlotFile:
    """One file under ``--slot-save-path``: what the save meant to write and how much of it is on disk."""

    tokens: Tokens
    state: bytes  # the target's state_seq_get_data(seq, flags 0)
    written: int  # bytes on disk
    id_slot: int = -1  # harness-only: the slot that wrote it (a state names its sequence)
    checkpoints: tuple[SavedCheckpoint, ...] = ()  # the appendix (upstream #26004)

    @property
    def appendix(self) -> int:
        """The checkpoint appendix's bytes (0: none, as upstream writes nothing for a slot without checkpoints)."""
        if not self.checkpoints:
            return 0
        return APPENDIX_HEADER + sum(CHECKPOINT_RECORD + c.size() for c in self.checkpoints)

    @property
    def size(self) -> int:
        """The full file's size, as upstream's save computes it (llama-context.cpp:3391-3392), with the appendix."""
        return HEADER + 4 * len(self.tokens) + len(self.state) + self.appendix

    @property
    def complete(self) -> bool:
        return self.written == self.size


@dataclass
class SlotFileStore:
    """The directory ``--slot-save-path``: file name -> :class:`SlotFile`.

    ``capacity``: bytes the file system can still take (``None``: no limit); ``silent_tail``: how many of the
    last bytes of a save may fail to reach the disk without any write failing (stdio buffering, the unchecked
    ``fclose``); 0 makes every ENOSPC a failed write.
    """

    files: dict[str, SlotFile] = field(default_factory=dict)
    capacity: int | None = None
    silent_tail: int = STDIO_BUFSIZ
    checkpoints: bool = False  # upstream #26004: files carry the slot's checkpoints (the pinned tree: no)

    def used(self) -> int:
        return sum(f.written for f in self.files.values())

    def write_failed(self, size: int, room: int | None) -> bool:
        """Whether the save of a ``size``-byte file sees a failed write: always for an injected write error
        (``room`` None); after ENOSPC at ``room`` bytes only when bytes beyond stdio's buffered tail fail an
        ``fwrite`` (llama-mmap.cpp:363-366); the tail is lost at the unchecked ``fclose`` (llama-mmap.cpp:380-381)."""
        return room is None or size - room > self.silent_tail

    def after_write_error(self, name: str, f: SlotFile) -> None:
        """What a failed save leaves: upstream keeps the bytes written (nothing unlinks ``name``)."""
        self.files[name] = f

    def restore_prompt(self, slot: ServerSlot, tokens: Tokens) -> None:
        """``slot->prompt.clear(); slot->prompt.tokens = restored`` (server-context.cpp:2618-2619): the
        checkpoints go."""
        slot.prompt.clear()
        slot.prompt.tokens = tokens

    def restore_checkpoints(self, slot: ServerSlot, f: SlotFile, n_max: int) -> int:
        """``load_slot_checkpoints`` (server-context.cpp:2658-2713 at b11549): the file's checkpoints become the
        slot's, as checkpoints of no task, the newest ``n_max`` of them; the appendix's bytes read."""
        if not self.checkpoints or not f.checkpoints:
            return 0
        for saved in f.checkpoints:
            cur = slot.prompt.checkpoints.emplace_back(slot.server.checkpoint_cls(slot.server.host, slot.server.sem))
            saved.load(cur)  # id_task -1: a checkpoint restored from a slot file
            if len(slot.prompt.checkpoints) > n_max:
                slot.prompt.checkpoints.pop_front()
        return f.appendix


@dataclass(frozen=True)
class SlotFileResult:
    """The route's answer: HTTP status and the JSON fields the harness reads (or the error message)."""

    status: int
    n_tokens: int = 0
    n_bytes: int = 0
    message: str = ""

    @property
    def ok(self) -> bool:
        return self.status == 200


def slot_save(server: ServerContext, id_slot: int, filename: str, store: SlotFileStore) -> SlotFileResult | None:
    """``SERVER_TASK_TYPE_SLOT_SAVE`` (server-context.cpp:2526-2575). ``None``: deferred (the slot is busy)."""
    if not 0 <= id_slot < len(server.slots):
        return SlotFileResult(400, message="Invalid slot ID")
    slot = server.slots[id_slot]
    if slot.is_processing():
        return None
    tokens = slot.prompt.tokens
    state = server.ctx_tgt.state_seq_get_data_ext(slot.id, STATE_SEQ_FLAGS_NONE)
    held = tuple(SavedCheckpoint.of(c) for c in slot.prompt.checkpoints) if store.checkpoints else ()
    f = SlotFile(tokens, state, 0, id_slot, held)
    store.files.pop(filename, None)  # fopen "wb" truncates
    room = None if store.capacity is None else store.capacity - store.used()
    written = 0
    failed = False
    with server.host.operation("slot_save"):
        # llama-context.cpp:3380-3389: write_u32 x 3, write_raw(tokens), the state stream
        for n in (4, 4, 4, 4 * len(tokens), len(state)):
            try:
                server.host.scoped_check("slot_file.write", n, ("slot_save",))
            except BadAlloc:  # "write error" thrown by llama_file::write_raw (llama-mmap.cpp:363-366)
                failed = store.write_failed(f.size, None)
                break
            if room is not None and written + n > room:
                written = room
                failed = store.write_failed(f.size, room)
                break
            written += n
    if failed:
        store.after_write_error(filename, SlotFile(tokens, state, written, id_slot))
        return SlotFileResult(500, message="Unable to save slot")
    store.files[filename] = SlotFile(tokens, state, written + f.appendix, id_slot, held)
    return SlotFileResult(200, n_tokens=len(tokens), n_bytes=f.size)


def slot_restore(server: ServerContext, id_slot: int, filename: str, store: SlotFileStore) -> SlotFileResult | None:
    """``SERVER_TASK_TYPE_SLOT_RESTORE`` (server-context.cpp:2576-2640). ``None``: deferred.

    Raises :class:`GgmlAbort` for a file cut inside its state (llama-context.cpp:3370), as the server aborts.
    """
    if not 0 <= id_slot < len(server.slots):
        return SlotFileResult(400, message="Invalid slot ID")
    slot = server.slots[id_slot]
    if slot.is_processing():
        return None
    f = store.files.get(filename)
    err = ""
    if f is None or f.written < HEADER + 4 * len(f.tokens):
        err = "No available space in KV cache or invalid slot save file"  # :2606
    elif not f.complete:
        raise GgmlAbort("llama-context.cpp:3370: GGML_ASSERT(nread <= state_size) failed")
    elif len(f.tokens) > server.slot_n_ctx:
        err = "Restored prompt does not fit in the slot context"  # :2612
    elif server.ctx_tgt.state_seq_set_data_ext(slot.id, f.state, STATE_SEQ_FLAGS_NONE) == 0:
        err = "No available space in KV cache or invalid slot save file"
    if err or f is None:
        slot.prompt_clear()  # :2621-2624
        return SlotFileResult(400, message=f"Unable to restore slot: {err}")
    store.restore_prompt(slot, f.tokens)  # the checkpoints go, and a file of the pinned tree brings none back
    read = store.restore_checkpoints(slot, f, server.params.n_ctx_checkpoints)
    return SlotFileResult(200, n_tokens=len(f.tokens), n_bytes=f.size - f.appendix + read)


def slot_erase(server: ServerContext, id_slot: int) -> SlotFileResult | None:
    """``SERVER_TASK_TYPE_SLOT_ERASE`` (server-context.cpp:2641-2664): ``prompt_clear``. ``None``: deferred."""
    if not 0 <= id_slot < len(server.slots):
        return SlotFileResult(400, message="Invalid slot ID")
    slot = server.slots[id_slot]
    if slot.is_processing():
        return None
    n = slot.prompt.n_tokens()
    slot.prompt_clear()
    return SlotFileResult(200, n_tokens=n)
