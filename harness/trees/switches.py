"""Upstream behaviour changes the model follows, read from a tree's source the way its semantics are.

The model predicts 0c1e570 (the pinned tree) unless a tree says otherwise. Each :class:`Switch` is one upstream
change the model's checks can see, read from the tree's text with the file and line that decided it:

* ``slot_file_checkpoints`` -- upstream #26004 (merged 2026-10-08, about b11540): a slot save appends the slot's
  context checkpoints to the file after the llama state (an ``SCKP`` appendix, ``save_slot_checkpoints`` in
  tools/server/server-context.cpp), a restore reads them back (``load_slot_checkpoints``), and ``n_saved``'s
  ``n_written`` and ``n_restored``'s ``n_read`` count the appendix. Read: the appendix's magic
  ``SLOT_CKPT_MAGIC`` in tools/server/server-context.cpp.
* ``checkpoint_load_bool`` -- the same change: ``common_prompt_checkpoint::load_tgt``/``load_dft`` return whether
  the state loaded (common/common.h); a task's own checkpoint that fails aborts the server, one restored from a
  slot file falls back to reprocessing the prompt. Read: ``bool load_tgt(`` in common/common.h.
* ``idle_pass_needs_unified`` -- upstream before the pin (b9093, tools/server/server-context.cpp:1010-1013): the
  idle-slot pass runs only with ``--kv-unified`` (a per-slot KV turns it off at start, "--cache-idle-slots requires
  --kv-unified, disabling"); by 0c1e570 it also runs on a per-slot KV, saving without clearing. Read: the start's
  ``if (!params_base.kv_unified)`` right inside ``if (params_base.cache_idle_slots)``.
* ``end_checkpoint_spaced`` -- upstream before about b10280 (b9093 and b9780: tools/server/server-context.cpp's
  "no need to create checkpoints that are too close together"): the checkpoint a prompt's last batch makes (4 tokens
  before its end) is held to the spacing rule as every other is, so one within ``checkpoint_min_step`` of the last
  is not made; by b10280 (and at 0c1e570) ``near_prompt_end`` lets it through. Read: that statement without
  ``near_prompt_end``. (b9093's step is a fixed 64, not ``-cms``: the harness's configurations mostly use 64.)
* ``alloc_without_room`` -- upstream before about b10001 (b9093 and b9780: tools/server/server-task.cpp's
  ``server_prompt_cache::alloc``): a save neither skips an entry over the cache's limit nor makes room for it
  first; the entry goes in, and the ``update()`` after it evicts the oldest for size ("cache size limit reached"),
  always keeping one entry ("always keep at least one state, regardless of the limits"). By b10001 (and at
  0c1e570) alloc skips an over-limit entry and pops the oldest until the new one fits ("making room for prompt
  cache entry"), and update() may empty the cache. Read: that line in
  ``server_prompt_cache::alloc``. The log reader (:class:`harness.targets.server_log.CacheLog`) follows it too,
  from the binary its log's first line names.
* ``prompt_cache_replaced`` -- not an upstream change yet: upstream has said a block cache may replace
  ``server_prompt_cache``. On when the tree's tools/server/server-task.h declares no ``struct server_prompt_cache``:
  the model's policy (``alloc``, ``load``, ``update``) then describes nothing in the tree, and the server gate runs
  only its checks that need no model of the policy (:func:`harness.backends.llama_server.runner.run_server_backend`).

:func:`read_switches` never guesses: a file it cannot read leaves the pinned value, said in ``where``.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass
from pathlib import Path

from harness.trees.build import tree_of_build
from harness.trees.semantics import blank_comments

__all__ = ["PINNED", "SERVER_TASK_CPP", "SERVER_TASK_H", "Switch", "Switches", "read_switches", "switches_from_text",
           "switches_of_binary"]

SERVER_CONTEXT = "tools/server/server-context.cpp"
SERVER_TASK_H = "tools/server/server-task.h"
COMMON_H = "common/common.h"


@dataclass(frozen=True)
class Switch:
    """One upstream change: on or off in a tree, and the ``file:line`` (or the reason) that decided it."""

    name: str
    on: bool
    where: str
    change: str  # the upstream change, for a person

    def line(self) -> str:
        return f"{self.name}: {'on' if self.on else 'off'} ({self.change}; {self.where})"


@dataclass(frozen=True)
class Switches:
    """What the model follows for one tree (the pinned tree: every switch off)."""

    slot_file_checkpoints: Switch
    checkpoint_load_bool: Switch
    prompt_cache_replaced: Switch
    idle_pass_needs_unified: Switch
    end_checkpoint_spaced: Switch
    alloc_without_room: Switch

    def all(self) -> tuple[Switch, ...]:
        return (self.slot_file_checkpoints, self.checkpoint_load_bool, self.prompt_cache_replaced,
                self.idle_pass_needs_unified, self.end_checkpoint_spaced, self.alloc_without_room)

    def lines(self) -> list[str]:
        return [s.line() for s in self.all()]


_SLOT = "slot files carry the checkpoints, upstream #26004"
_LOAD = "checkpoint loads return bool, upstream #26004"
_CACHE = "server_prompt_cache replaced, as by a block cache: the model's cache policy describes nothing there"
_IDLE = "the idle-slot pass only with --kv-unified, upstream before 0c1e570"
_SPACED = "the prompt's end checkpoint held to the spacing rule, upstream before b10280"
_ROOM = "a save that neither skips an over-limit entry nor makes room first, upstream before b10001"
SERVER_TASK_CPP = "tools/server/server-task.cpp"
# the spacing statement: do_checkpoint = do_checkpoint && (slot.prompt.checkpoints.empty() || ...);
_SPACING = r"do_checkpoint\s*=\s*do_checkpoint\s*&&\s*\(\s*slot\.prompt\.checkpoints\.empty\(\)[^;]*;"
_IDLE_OFF_WITHOUT_UNIFIED = (r"if\s*\(\s*params_base\.cache_idle_slots\s*\)\s*\{\s*"
                             r"if\s*\(\s*!\s*params_base\.kv_unified\s*\)")

PINNED = Switches(
    Switch("slot_file_checkpoints", False, "the pinned tree, 0c1e570", _SLOT),
    Switch("checkpoint_load_bool", False, "the pinned tree, 0c1e570", _LOAD),
    Switch("prompt_cache_replaced", False, "the pinned tree, 0c1e570", _CACHE),
    Switch("idle_pass_needs_unified", False, "the pinned tree, 0c1e570", _IDLE),
    Switch("end_checkpoint_spaced", False, "the pinned tree, 0c1e570", _SPACED),
    Switch("alloc_without_room", False, "the pinned tree, 0c1e570", _ROOM),
)


def _line_of(text: str, pattern: str) -> int | None:
    m = re.search(pattern, blank_comments(text))
    return None if m is None else text.count("\n", 0, m.start()) + 1


def switches_from_text(files: dict[str, str | None]) -> Switches:
    """The switches of a tree whose files (path -> text; None: unreadable) are ``files``."""
    out = []
    for name, path, pattern, change, on_when_found in (
        ("slot_file_checkpoints", SERVER_CONTEXT, r"\bSLOT_CKPT_MAGIC\b", _SLOT, True),
        ("checkpoint_load_bool", COMMON_H, r"\bbool\s+load_tgt\s*\(", _LOAD, True),
        ("prompt_cache_replaced", SERVER_TASK_H, r"\bstruct\s+server_prompt_cache\s*\{", _CACHE, False),
        ("idle_pass_needs_unified", SERVER_CONTEXT, _IDLE_OFF_WITHOUT_UNIFIED, _IDLE, True),
    ):
        text = files.get(path)
        if text is None:
            out.append(Switch(name, False, f"{path} not readable: the pinned behaviour", change))
            continue
        at = _line_of(text, pattern)
        where = f"{path}:{at}" if at is not None else f"not in {path}"
        out.append(Switch(name, (at is not None) == on_when_found, where, change))
    out.append(_end_checkpoint_spaced(files.get(SERVER_CONTEXT)))
    out.append(_alloc_without_room(files.get(SERVER_TASK_CPP)))
    return Switches(*out)


def _alloc_without_room(text: str | None) -> Switch:
    """On where ``server_prompt_cache::alloc`` makes no room ("making room for prompt cache entry" absent from
    it); a tree without that function is left to the pinned behaviour, said in ``where``."""
    if text is None:
        return Switch("alloc_without_room", False, f"{SERVER_TASK_CPP} not readable: the pinned behaviour", _ROOM)
    code = blank_comments(text)
    start = re.search(r"\bserver_prompt_cache::alloc\s*\(", code)
    if start is None:
        return Switch("alloc_without_room", False, f"no server_prompt_cache::alloc in {SERVER_TASK_CPP}: the "
                      "pinned behaviour", _ROOM)  # fmt: skip
    nxt = re.search(r"\bserver_prompt_cache::\w+\s*\(", code[start.end():])
    body = text[start.start(): start.end() + (nxt.start() if nxt else len(code))]  # the log line: a string
    room = body.find("making room for prompt cache entry")
    at = start.start() if room < 0 else start.start() + room
    where = f"{SERVER_TASK_CPP}:{text.count(chr(10), 0, at) + 1}"
    return Switch("alloc_without_room", room < 0, where, _ROOM)


def _end_checkpoint_spaced(text: str | None) -> Switch:
    """On where the spacing statement lets no ``near_prompt_end`` through; a tree without the statement (another
    shape of the code) is left to the pinned behaviour, said in ``where``."""
    if text is None:
        return Switch("end_checkpoint_spaced", False, f"{SERVER_CONTEXT} not readable: the pinned behaviour", _SPACED)
    m = re.search(_SPACING, blank_comments(text))
    if m is None:
        return Switch("end_checkpoint_spaced", False, f"no spacing statement in {SERVER_CONTEXT}: the pinned "
                      "behaviour", _SPACED)  # fmt: skip
    at = f"{SERVER_CONTEXT}:{text.count(chr(10), 0, m.start()) + 1}"
    return Switch("end_checkpoint_spaced", "near_prompt_end" not in m.group(0), at, _SPACED)


def read_switches(tree: Path) -> Switches:
    """The switches of the llama.cpp tree at ``tree``."""
    files: dict[str, str | None] = {}
    for path in (SERVER_CONTEXT, COMMON_H, SERVER_TASK_H, SERVER_TASK_CPP):
        try:
            files[path] = (tree / path).read_text(errors="replace")
        except OSError:
            files[path] = None
    return switches_from_text(files)


@functools.lru_cache(maxsize=32)
def switches_of_binary(binary: Path) -> Switches:
    """The switches of the tree a harness build of ``binary`` was made from; the pinned ones for a binary the harness
    did not build (nothing says what it is: ``--source`` does)."""
    tree = tree_of_build(binary.resolve().parent)
    return PINNED if tree is None else read_switches(tree)
