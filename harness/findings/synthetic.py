"""Known findings of the model's machines (synthetic backend): upstream's logic, modelled; and the reuse
property's (``properties/reuse.py``), counted with the tokens each request recomputed."""

from __future__ import annotations

from harness.findings.record import Finding

__all__ = [
    "BUSY_SLOT_BY_ID",
    "BUSY_SLOT_BY_ID_LIVELOCK",
    "DRAFT_KV_EXHAUSTION",
    "ID_SLOT_EMPTY_SKIPS_CACHE",
    "LOAD_PICKS_UNRESUMABLE_ENTRY",
    "SAVE_EVICTS_BETTER_ENTRY",
    "SIMILAR_SLOT_SKIPS_BETTER_ENTRY",
    "STALE_CHECKPOINT_AFTER_MISS",
    "SWA_CHECKPOINT_ORDER",
    "SYNTHETIC",
]

# ---- the model's machines (synthetic backend): upstream's logic, modelled ----
BUSY_SLOT_BY_ID = Finding(
    "busy-slot-by-id",
    "synthetic",
    "busy_slot_untouched",
    "a request naming a busy slot by id loads another prompt into it mid-generation",
    "fixtures/findings/busy_slot_by_id_server.py",
    detail=(
        "(report: fixtures/findings/busy_slot_by_id.md) "
        "get_available_slot saves/loads the cache into a slot that is processing when the request names "
        "that slot by id (server-context.cpp:1532-1633, with slot_prompt_similarity != 0); on the real server "
        "the request being generated in that slot goes on from the loaded prompt: a wrong answer, no error"
    ),
    takes_binary=True,
)

BUSY_SLOT_BY_ID_LIVELOCK = Finding(
    "busy-slot-by-id-livelock",
    "server",
    "request_error",
    "a request naming a slot still busy with its prompt spins the server and never answers",
    "fixtures/findings/busy_slot_by_id_livelock.py",
    detail=(
        "as busy-slot-by-id, but the named slot is still processing its prompt and the prompt loaded into it is at "
        "least as long: the prompt loop has nothing to add and re-creates ('supersedes') the same checkpoint every "
        "iteration; the server spins, the request never answers and the request naming the slot stays deferred until "
        "a client gives up (server-context.cpp:1534-1628, 3441-3530)"
    ),
)

DRAFT_KV_EXHAUSTION = Finding(
    "draft-kv-exhaustion",
    "synthetic",
    "draft_in_step",
    "a draft context with less KV room than the target leaves target and draft out of step",
    detail=(
        "a draft context with less KV room than the target: a cache load whose draft restore fails after the "
        "target restore succeeded leaves the entry without its main state (server-task.cpp:1842-1856), and a "
        "draft decode failure aborts every slot without clearing it, leaving target and draft out of step "
        "(server-context.cpp:3731, 2735)"
    ),
)

SWA_CHECKPOINT_ORDER = Finding(
    "swa-checkpoint-order",
    "synthetic",
    "checkpoint_lists",
    "a checkpoint at pos_max == pos_next survives invalidation: the list is no longer ascending",
    "fixtures/findings/swa_checkpoint_order.py",
    detail=(
        "a checkpoint with pos_max == pos_next survives invalidation (it erases only pos_max > pos_next), so "
        "after an SWA checkpoint restore (the slot resumes at pos_max) or after [TAG_PROMPT_LOGITS] decrements "
        "n_past of a request that is exactly pos_next tokens long, the next checkpoint is created below it and "
        "the list is no longer ascending in n_tokens (server-context.cpp:3339-3377, 3383-3388, 2290-2345)"
    ),
)

STALE_CHECKPOINT_AFTER_MISS = Finding(
    "stale-checkpoint-after-miss",
    "synthetic",
    "restore_bytes",
    "after a request sharing no token, the old prompt's first checkpoint is restored",
    "fixtures/findings/stale_checkpoint_after_miss.py",
    detail=(
        "a request sharing no token with the slot (n_past = 0) skips the checkpoint search and invalidation "
        "keeps pos_max <= 0, so the old prompt's checkpoint at n_tokens = 1 survives; a later request sharing "
        "a token restores it via `cur.pos_min == 0` and the recurrent/SWA state holds the old first token: "
        "wrong output, no error (server-context.cpp:3280, 3339-3342, 3355-3356, 3370-3377)"
    ),
)

# ---- the reuse property (properties/reuse.py): counted, with the tokens each request recomputed ----
ID_SLOT_EMPTY_SKIPS_CACHE = Finding(
    "id-slot-empty-skips-cache",
    "synthetic",
    "reuse",
    "a request naming an empty slot never asks the prompt cache (f_keep is NaN)",
    "fixtures/findings/id_slot_empty_skips_cache.py",
    detail=(
        "a request that names an empty slot with id_slot never asks the RAM prompt cache: the similarity scan "
        "skips an empty slot, so ret is the named slot with f_sim_best = 0 and f_keep = (0 * n) / 0 = NaN, and "
        "`NaN < 0.5f` is false: no prompt_save/prompt_load, the whole prompt is recomputed although the cache "
        "holds a prefix of it (server-context.cpp:1533-1538, 1557-1560, 1578-1590, 1617-1633)"
    ),
)

SIMILAR_SLOT_SKIPS_BETTER_ENTRY = Finding(
    "similar-slot-skips-better-entry",
    "synthetic",
    "reuse",
    "a similar slot is used as it is although the cache holds a longer prefix",
    "fixtures/findings/similar_slot_skips_better_entry.py",
    detail=(
        "a slot chosen by LCP similarity whose own prompt would keep f_keep >= 0.5 is used as it is: the cache "
        "is not asked, although server_prompt_cache::load would pick an entry that shares a longer prefix with "
        "the prompt; the tokens between the slot's prefix and the entry's are recomputed "
        "(server-context.cpp:1578-1590, 1617-1633; server-task.cpp:1793-1823)"
    ),
)

SAVE_EVICTS_BETTER_ENTRY = Finding(
    "save-evicts-better-entry",
    "synthetic",
    "reuse",
    "the slot's save evicts the cache entry the load would have picked",
    "fixtures/findings/save_evicts_better_entry.py",
    detail=(
        "get_available_slot saves the selected slot's prompt before it loads (server-context.cpp:1628-1630): "
        "the save makes room by evicting the oldest entries (server-task.cpp:1750-1758), which can be the entry "
        "load would have picked; load then finds nothing better and the request recomputes what that entry held"
    ),
)

LOAD_PICKS_UNRESUMABLE_ENTRY = Finding(
    "load-picks-unresumable-entry",
    "synthetic",
    "reuse",
    "the cache load picks the longest prefix, not the one the memory can resume",
    "fixtures/findings/load_picks_unresumable_entry.py",
    detail=(
        "server_prompt_cache::load ranks entries by raw common prefix (server-task.cpp:1810-1823), not by what "
        "the memory can resume: on recurrent/hybrid/SWA memory an entry without a checkpoint at the divergence "
        "(or one equal to the prompt, [TAG_PROMPT_LOGITS]) resumes at 0 (server-context.cpp:3330-3366), so "
        "moving it into the slot loses the slot's own usable prefix: with the cache a request can recompute more "
        "than with none"
    ),
)

SYNTHETIC = [
    BUSY_SLOT_BY_ID,
    BUSY_SLOT_BY_ID_LIVELOCK,
    DRAFT_KV_EXHAUSTION,
    SWA_CHECKPOINT_ORDER,
    STALE_CHECKPOINT_AFTER_MISS,
    ID_SLOT_EMPTY_SKIPS_CACHE,
    SIMILAR_SLOT_SKIPS_BETTER_ENTRY,
    SAVE_EVICTS_BETTER_ENTRY,
    LOAD_PICKS_UNRESUMABLE_ENTRY,
]
