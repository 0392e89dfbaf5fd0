"""The model's allocation sites and the upstream code each one mirrors: one table, at llama.cpp 0c1e570.

Every allocation the model makes, and the one write it can fail (``slot_file.write``, a slot file's ``fwrite``
on a full disk), is named by a site (``alloc.state_tgt``, ``ckpt_copy.tgt``, ...: the first
argument of :meth:`~harness.model.memory.Host.allocate` and its kin, in :mod:`harness.model.cache`,
:mod:`harness.model.checkpoint`, :mod:`harness.model.provider`). :data:`SITES` says, for each, the upstream
function whose allocation it mirrors, where that allocation is (file:line at 0c1e570, as vendored by
llama-cpp-python 0.3.36, or at the build ``since`` names for an allocation upstream added after the pin) and
which functions a native stack of that allocation may show as its first frame in llama.cpp code once allocator and
STL frames are skipped (``frames``, fnmatch patterns): a function the
compiler inlined shows up as its caller, so an implicit copy constructor (``common_prompt_checkpoint``'s) is
seen as the function that copies the list.

What reads it: a native fault trial on a real server (:mod:`harness.backends.llama_server.memory`) agrees
with the model only when the stack of the allocation that failed shows one of the predicted site's
``frames`` (:func:`faults.sites.site_agrees`). Under PR #27451 (``shared``) ``ckpt.update_tgt``'s buffer is
allocated in ``common_prompt_checkpoint_capture`` (the patch's helper, called by ``update_tgt``).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

__all__ = ["SITES", "UpstreamSite", "upstream"]


@dataclass(frozen=True)
class UpstreamSite:
    function: str  # the upstream function whose allocation the model's site mirrors
    where: str  # file:line of that allocation at 0c1e570
    what: str  # the allocation itself
    frames: tuple[str, ...]  # fnmatch patterns: a native stack's first llama.cpp frame for it
    since: str = ""  # an allocation of upstream after the pin (``where`` is at that build): the model's switch

    def shows(self, function: str) -> bool:
        """Whether a stack whose first llama.cpp frame is ``function`` (qualified, no parameters) is this site."""
        return any(fnmatch.fnmatchcase(function, p) for p in self.frames)


_CACHE_ALLOC = "server_prompt_cache::alloc"
# the checkpoint list copied by value: in the cache entry (server_prompt_cache::alloc) or a slot's prompt clone
_LIST_COPY = (
    _CACHE_ALLOC,
    "server_prompt::clone",
    "server_slot::copy_state_to",
    "common_prompt_checkpoint::common_prompt_checkpoint",  # the copy constructor, if not inlined
)
# reading a sequence's state back: the context's reader, the io object, every memory's state_read
_STATE_READ = (
    "llama_context::state_seq_set_data",
    "llama_context::state_seq_read_data",
    "llama_context::state_read_data",
    "llama_io_read_*",
    "llama_kv_cache*::state_read*",
    "llama_memory_*::state_read*",
)

SITES: dict[str, UpstreamSite] = {
    "alloc.state_tgt": UpstreamSite(
        _CACHE_ALLOC, "tools/server/server-task.cpp:1765", "state_data_tgt.resize(state_size_tgt), inside the try",
        (_CACHE_ALLOC,),
    ),
    "alloc.state_dft": UpstreamSite(
        _CACHE_ALLOC, "tools/server/server-task.cpp:1766", "state_data_dft.resize(state_size_dft), inside the try",
        (_CACHE_ALLOC,),
    ),
    "tokens.clone": UpstreamSite(
        "server_tokens::clone", "tools/server/server-common.cpp:791",
        "the token vector copied (from server-task.cpp:1781 in the cache entry, server-task.h:580 in a prompt clone)",
        ("server_tokens::clone",),
    ),
    "ckpt_copy.node": UpstreamSite(
        _CACHE_ALLOC, "tools/server/server-task.cpp:1782",
        "a list node of the checkpoint list copied by value (/*.checkpoints =*/ prompt.checkpoints)", _LIST_COPY,
    ),
    "ckpt_copy.tgt": UpstreamSite(
        _CACHE_ALLOC, "tools/server/server-task.cpp:1782",
        "data_tgt deep-copied by common_prompt_checkpoint's implicit copy constructor (common/common.h:1232)",
        _LIST_COPY,
    ),
    "ckpt_copy.dft": UpstreamSite(
        _CACHE_ALLOC, "tools/server/server-task.cpp:1782",
        "data_dft deep-copied by common_prompt_checkpoint's implicit copy constructor (common/common.h:1232)",
        _LIST_COPY,
    ),
    "ckpt_copy.spec": UpstreamSite(
        _CACHE_ALLOC, "tools/server/server-task.cpp:1782",
        "data_spec deep-copied by common_prompt_checkpoint's implicit copy constructor (common/common.h:1232)",
        _LIST_COPY,
    ),
    "alloc.states_push_back": UpstreamSite(
        _CACHE_ALLOC, "tools/server/server-task.cpp:1779", "the std::list node of states.push_back", (_CACHE_ALLOC,),
    ),
    "ckpt_list.node": UpstreamSite(
        "server_context_impl::create_checkpoint", "tools/server/server-context.cpp:2335",
        "slot.prompt.checkpoints.emplace_back()",
        ("server_context_impl::create_checkpoint", "server_context_impl::update_slots"),
    ),
    "ckpt.update_tgt": UpstreamSite(
        "common_prompt_checkpoint::update_tgt", "common/common.cpp:2298", "data_tgt.resize(ckpt_size)",
        ("common_prompt_checkpoint::update_tgt", "common_prompt_checkpoint_capture"),
    ),
    "ckpt.update_dft": UpstreamSite(
        "common_prompt_checkpoint::update_dft", "common/common.cpp:2316", "data_dft.resize(ckpt_size)",
        ("common_prompt_checkpoint::update_dft", "common_prompt_checkpoint_capture"),
    ),
    "ckpt.update_spec": UpstreamSite(
        "common_speculative_get_state", "common/speculative.cpp:896",
        "data.resize(...) in the eagle3 impl's get_state, called from common_speculative_get_state (:2909)",
        ("common_speculative_get_state", "common_speculative_impl_draft_eagle3::get_state"),
    ),
    "tgt.state_read": UpstreamSite(
        "llama_context::state_seq_set_data", "src/llama-context.cpp:3223",
        "an allocation while the target's sequence state is read back (llama_state_seq_set_data_ext)", _STATE_READ,
    ),
    "dft.state_read": UpstreamSite(
        "llama_context::state_seq_set_data", "src/llama-context.cpp:3223",
        "an allocation while the draft's sequence state is read back (llama_state_seq_set_data_ext)", _STATE_READ,
    ),
    "slot_file.write": UpstreamSite(
        "llama_file::impl::write_raw", "src/llama-mmap.cpp:363",
        "not an allocation: the fwrite of a slot file (POST /slots/{id}?action=save), which fails on a full disk "
        "(ENOSPC) or a write error (harness/model/slot_files.py)",
        ("llama_file::impl::write_raw", "llama_file::write_raw*", "llama_state_seq_save_file*"),
    ),
    "slot_file.read_ckpt": UpstreamSite(
        "server_context_impl::load_slot_checkpoints", "tools/server/server-context.cpp:2605",
        "a checkpoint's blob read back from a slot file's appendix (ckpt_read_buf: buf.resize(n)), only where the "
        "model follows #26004 (harness/trees/switches.py: slot_file_checkpoints)",
        ("*ckpt_read_buf*", "*load_slot_checkpoints*"), since="b11549",
    ),
}  # fmt: skip


def upstream(site: str) -> UpstreamSite | None:
    """The upstream allocation the model's ``site`` mirrors (None: not a site of the model's)."""
    return SITES.get(site)
