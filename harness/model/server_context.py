"""The slot side of llama-server: slots, slot selection, prompt processing, checkpoints, drafts.

Upstream: tools/server/server-context.cpp, llama.cpp commit 0c1e570 (vendored by
llama-cpp-python 0.3.36). Each method names the upstream lines it mirrors.

What is modelled: ``server_slot::prompt_save/prompt_load/prompt_clear/copy_state_to``;
``get_available_slot`` (by id, by similarity, by LRU, then save/load/update of the cache);
``process_single_task`` for completion tasks (deferral, child tasks, idle-slot caching with and
without ``kv_unified``); embedding and rerank tasks (``handle_stateless``: no cache save at selection,
no prefix reuse, no checkpoints, released once the prompt is evaluated; the idle-slot save that still
caches what they leave, see below); the start of prompt processing (restore point from a checkpoint and
invalidation of later checkpoints); prompt batches with the checkpoint gate and
``create_checkpoint`` (min-step thinning when full, count cap, superseding); generation with and
without a draft model (``spec_ckpt`` update/restore on partial acceptance); ``decode`` failure
handling (``try_clear_idle_slots``, halving, errors); ``abort_all_slots``.

Deviations (deliberate, to keep the model small):

* Text-only prompts; no chat message spans, so ``is_user_start`` is never true and checkpoints
  come from the near-end rule (the last ``4 + n_ubatch`` and ``4`` tokens) and from prompt ends.
* One slot's prompt batch per ``update_slots`` iteration (upstream packs several slots into one
  batch); generation of all generating slots happens in the same iteration.
* Sampling is a hash of the token history (greedy decoding on a fixed "model"); the draft model
  proposes the target's token except where a hash says otherwise, so partial acceptance happens.
* A rejected draft on checkpoint-type memory is replayed within the same iteration.
* Embedding and rerank tasks (``TASK_EMBEDDING``, ``TASK_RERANK``) carry token ids, not query/document
  pairs; no pooling and no output are modelled, only what they do to the slot and the cache. The model
  records every cache save of a slot whose last task (``task_prev``, :223, :350) was one of them in
  ``ServerContext.stateless_saves`` (harness-only, for the finding ``idle-stateless-slot-cached``). Not
  modelled: the refusal of an embedding longer than one ubatch under non-causal pooling (``n_batch`` =
  ``n_ubatch`` with embeddings on, tools/server/server.cpp:150-154), multi-prompt requests (one task each here;
  upstream posts them together, which the sequential calls of ``handle_stateless`` match when each one is
  launched or deferred in order).

Size: it mirrors upstream's tools/server/server-context.cpp method by method (that file is about 4,000 lines);
splitting it would break the line-for-line correspondence the docstrings cite.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections import Counter
from dataclasses import dataclass, field, replace

from harness.errors import GgmlAbort
from harness.model.cache import ServerPrompt, ServerPromptCache, Tokens, f32, get_common_prefix
from harness.model.checkpoint import CommonPromptCheckpoint
from harness.model.memory import Host
from harness.model.provider import STATE_SEQ_FLAGS_NONE, STATE_SEQ_FLAGS_PARTIAL_ONLY, SeqRmType, StateProvider
from harness.model.reuse import Chunk, can_shift, context_shift_bounds, reuse_chunks, shifted_tokens
from harness.model.semantics import Semantics

__all__ = [
    "STATELESS_TASKS",
    "TASK_COMPLETION",
    "TASK_EMBEDDING",
    "TASK_RERANK",
    "ServerContext",
    "ServerParams",
    "ServerSlot",
    "SlotState",
    "StatelessSave",
    "Task",
]

VOCAB = 24

# server_task_type (server-task.h): the types that reach a slot (server-context.cpp:2363-2366), infill as completion
TASK_COMPLETION = "completion"
TASK_EMBEDDING = "embedding"
TASK_RERANK = "rerank"
# is_stateless_task (server-context.cpp:3196): a prompt of these is never reused
STATELESS_TASKS = frozenset({TASK_EMBEDDING, TASK_RERANK})


class SlotState(enum.Enum):
    """``slot_state`` (server-context.cpp)."""

    IDLE = "idle"
    WAIT_OTHER = "wait_other"
    STARTED = "started"
    PROCESSING_PROMPT = "processing_prompt"
    DONE_PROMPT = "done_prompt"
    GENERATING = "generating"


@dataclass
class ServerParams:
    """The ``common_params`` fields that matter here, with upstream defaults unless noted.

    ``cache_ram`` is ``--cache-ram`` (-1 no limit, 0 cache disabled) in units of ``cache_ram_unit``
    bytes (1 MiB upstream; the synthetic backend uses small units). ``n_batch``/``n_ubatch`` and
    ``checkpoint_min_step`` default to small values suited to prompts of tens of tokens.
    """

    n_slots: int = 2
    cache_ram: int = 8192
    cache_ram_unit: int = 1024 * 1024
    n_ctx_checkpoints: int = 32
    checkpoint_min_step: int = 8
    cache_idle_slots: bool = True
    kv_unified: bool = False
    slot_prompt_similarity: float = 0.1
    n_batch: int = 16
    n_ubatch: int = 8
    n_draft_max: int = 0  # >0 and a draft context: speculative decoding
    # the draft-KV recovery proposed in PR #27451's discussion (neither upstream nor the PR):
    # purge idle slots and retry the draft batch once, else clear the out-of-sync slot
    draft_recovery: bool = False
    # in-slot reuse (harness.model.reuse): --cache-reuse N, --context-shift, --keep, the vocab's add_bos;
    # ctx_limit models the slot's n_ctx in generation (the :1867 stop, the :2889 shift); off, the
    # machines' programs from before it run as they did (their generations stay far below n_ctx)
    n_cache_reuse: int = 0
    ctx_shift: bool = False
    ctx_limit: bool = False
    n_keep: int = 0
    add_bos: bool = True
    # upstream after the pin (harness.trees.switches, read from the tree): #26004's slot-file checkpoints, and its
    # checkpoint loads that return bool (one restored from a slot file that does not load: reprocess, no abort)
    slot_file_checkpoints: bool = False
    checkpoint_load_bool: bool = False
    # upstream before the pin (b9093, server-context.cpp:1010-1013): the idle-slot pass only with --kv-unified
    idle_pass_needs_unified: bool = False
    # upstream before about b10280 (b9780's server-context.cpp:3546): the spacing rule holds the prompt's end
    # checkpoint too (no near_prompt_end in it)
    end_checkpoint_spaced: bool = False
    # upstream before about b10001 (b9780's server-task.cpp:1623): alloc makes no room, update() evicts after it
    alloc_without_room: bool = False


@dataclass
class Task:
    """The parts of ``server_task`` a completion needs."""

    id: int
    tokens: Tokens
    id_slot: int = -1
    n_predict: int = 4
    cache_prompt: bool = True
    id_parent: int = -1
    n_children: int = 0
    # the tokens the real target generated, when the model replays a real server's requests
    # (differential testing); empty: the model's own hash choice
    forced: Tokens = ()
    type: str = TASK_COMPLETION  # server_task::type
    # task_params (server-task.h:59-65): n_cache_reuse and n_keep default to the server's (server-schema.cpp:529-531)
    n_cache_reuse: int = 0
    n_keep: int = 0
    n_discard: int = 0

    def is_parent(self) -> bool:
        return self.n_children > 0

    def is_child(self) -> bool:
        return self.id_parent != -1


@dataclass(frozen=True)
class StatelessSave:
    """A cache entry saved from a slot whose last task was stateless (harness-only record).

    ``where``: ``"idle"`` (the idle-slot loop, server-context.cpp:2419-2432) or ``"select"`` (a completion's
    selection saving the slot it takes, :1616-1628); ``nbytes``: the entry's size (state and checkpoints)."""

    slot: int
    task_type: str
    n_tokens: int
    nbytes: int
    where: str
    by: str = TASK_COMPLETION  # the type of the task whose launch made the save


@dataclass
class Event:
    """One cache-side operation on a slot, for the property that no processing slot is touched."""

    op: str
    slot: int
    slot_processing: bool


def sample(hist: Tokens) -> int:
    """The target model's greedy choice after ``hist`` (a hash: deterministic, history-dependent)."""
    h = hashlib.blake2b(struct.pack(f"<{len(hist)}i", *hist), digest_size=2).digest()
    return 1 + h[0] % VOCAB


def draft_sample(hist: Tokens) -> int:
    """The draft model's choice: the target's, except on roughly one history in three."""
    h = hashlib.blake2b(b"draft" + struct.pack(f"<{len(hist)}i", *hist), digest_size=2).digest()
    t = sample(hist)
    return t if h[1] % 3 else 1 + (t + h[0]) % VOCAB


class ServerSlot:
    """``server_slot`` (server-context.cpp:198): the fields and methods the cache paths use."""

    def __init__(self, server: ServerContext, id: int) -> None:
        self.server = server
        self.id = id
        self.ctx_tgt = server.ctx_tgt
        self.ctx_dft = server.ctx_dft
        self.prompt = ServerPrompt.empty(server.host)
        self.spec_ckpt: CommonPromptCheckpoint = server.checkpoint_cls(server.host, server.sem)
        self.state = SlotState.IDLE
        self.task: Task | None = None
        self.task_prev: Task | None = None  # :223 the last task, moved there by reset() (:350)
        self.t_last_used = -1
        self.sampled: int | None = None
        self.n_decoded = 0
        self.n_prompt_cached = 0
        self.pos_next = 0  # where the last prompt processing resumed (after checkpoint invalidation)
        self.result: list[int] = []
        self.error: str | None = None
        self.resuming = False  # re-processing its tokens after a draft-KV recovery cleared it
        self.resyncs = 0  # draft-KV recoveries that cleared this slot during its current task
        self.truncated = False  # the generation reached n_ctx: stopped, or went on after a context shift

    def __repr__(self) -> str:
        return f"slot{self.id}({self.state.value}, {self.prompt.n_tokens()} tok, {len(self.prompt.checkpoints)} ckpt)"

    def is_processing(self) -> bool:
        return self.state is not SlotState.IDLE

    # common_memory::seq_rm (common.cpp:1558): aborts on failure
    def mem_seq_rm(self, p0: int, p1: int) -> None:
        for ctx in (self.ctx_tgt, self.ctx_dft):
            if ctx is not None and not ctx.memory_seq_rm(self.id, p0, p1):
                raise GgmlAbort(f"{ctx.name}: failed to remove sequence {self.id} [{p0}, {p1})")

    # common_memory::seq_add (common.cpp:1572)
    def mem_seq_add(self, p0: int, p1: int, delta: int) -> None:
        for ctx in (self.ctx_tgt, self.ctx_dft):
            if ctx is not None:
                ctx.memory_seq_add(self.id, p0, p1, delta)  # type: ignore[attr-defined]

    # server-context.cpp:258
    def prompt_save(self, prompt_cache: ServerPromptCache) -> bool:
        self.server.events.append(Event("save", self.id, self.is_processing()))
        if not self.prompt.tokens:
            return False
        cur_size_tgt = self.ctx_tgt.state_seq_get_size_ext(self.id, STATE_SEQ_FLAGS_NONE)
        cur_size_dft = self.ctx_dft.state_seq_get_size_ext(self.id, STATE_SEQ_FLAGS_NONE) if self.ctx_dft else 0
        with self.server.host.operation("save") as op:
            op.state_bytes = cur_size_tgt + cur_size_dft
            op.spec_bytes = sum(c.data_spec.nbytes for c in self.prompt.checkpoints if c.data_spec is not None)
            op.n_tokens = self.prompt.n_tokens()
            op.n_checkpoints = len(self.prompt.checkpoints)
            cur = prompt_cache.alloc(self.prompt, cur_size_tgt, cur_size_dft)
            if cur is not None:
                # the return value of get_data_ext is not checked upstream (:273)
                if cur.data.main is not None:
                    cur.data.main.fill(self.ctx_tgt.state_seq_get_data_ext(self.id, STATE_SEQ_FLAGS_NONE))
                if self.ctx_dft is not None and cur.data.drft is not None:
                    cur.data.drft.fill(self.ctx_dft.state_seq_get_data_ext(self.id, STATE_SEQ_FLAGS_NONE))
        return cur is not None

    # server-context.cpp:284
    def prompt_load(self, prompt_cache: ServerPromptCache, tokens: Tokens) -> bool:
        self.server.events.append(Event("load", self.id, self.is_processing()))
        with self.server.host.operation("load"):
            res = prompt_cache.load(self.prompt, tokens, self.ctx_tgt, self.ctx_dft, self.id)
        return res

    # server-context.cpp:293
    def prompt_clear(self) -> None:
        self.server.events.append(Event("clear", self.id, self.is_processing()))
        self.mem_seq_rm(-1, -1)
        self.prompt.clear()

    # server-context.cpp:692
    def copy_state_to(self, other: ServerSlot) -> None:
        assert self.state is SlotState.DONE_PROMPT, "GGML_ASSERT(state == SLOT_STATE_DONE_PROMPT)"
        other.mem_seq_rm(-1, -1)
        for ctx in (self.ctx_tgt, self.ctx_dft):
            if ctx is not None:
                ctx.memory_seq_cp(self.id, other.id, -1, -1)
        other.prompt.assign(self.prompt.clone())
        other.sampled = self.sampled
        other.n_decoded = self.n_decoded
        other.result = list(self.result)

    def reset(self) -> None:
        """``server_slot::reset`` (:313): clears the speculative checkpoint among per-task state."""
        if self.ctx_dft is not None:
            self.spec_ckpt.clear()
        self.task_prev = self.task
        self.task = None
        self.n_decoded = 0
        self.sampled = None
        self.resyncs = 0
        self.resuming = False
        self.truncated = False

    # server-context.cpp:515
    def release(self) -> None:
        if not self.is_processing():
            return
        assert self.task is not None
        self.server.clock += 1
        self.t_last_used = self.server.clock
        self.state = SlotState.IDLE
        # do not keep context of the child slots - the parent's context is enough
        if self.task.is_child():
            self.prompt_clear()
        self.reset()


@dataclass
class LaunchResult:
    status: str  # "launched" | "deferred"
    slot: int = -1
    task: int = -1


@dataclass
class ServerContext:
    """``server_context_impl`` reduced to the prompt-cache paths (server-context.cpp)."""

    params: ServerParams
    host: Host
    sem: Semantics
    ctx_tgt: StateProvider
    ctx_dft: StateProvider | None = None
    slots: list[ServerSlot] = field(default_factory=list)
    prompt_cache: ServerPromptCache | None = None
    events: list[Event] = field(default_factory=list)
    errors: list[tuple[int, str]] = field(default_factory=list)
    cancels: list[int] = field(default_factory=list)  # task ids of the queued SERVER_TASK_TYPE_CANCEL tasks
    #: every checkpoint :meth:`create_checkpoint` made, in order: (slot, n_tokens), what upstream logs of it (:2349)
    created: list[tuple[int, int]] = field(default_factory=list)
    #: every slot the idle-slot pass took, in order: (slot, cleared), what upstream logs of it (:2421, :2429)
    idle_passed: list[tuple[int, bool]] = field(default_factory=list)
    clock: int = 0
    next_task_id: int = 0
    # cache entries saved from a slot whose last task was stateless (the finding idle-stateless-slot-cached)
    stateless_saves: list[StatelessSave] = field(default_factory=list)
    _launched: str = TASK_COMPLETION  # the type of the task launched last (for StatelessSave.by)
    # ServerParams.draft_recovery outcomes: "retried" (after purging idle slots), "resynced"
    draft_recoveries: Counter[str] = field(default_factory=Counter)
    # harness-only records of two upstream quirks (known findings, see _start_prompt):
    # token prefixes a restored checkpoint put into memory in place of the slot's own tokens
    stale_restores: list[tuple[int, ...]] = field(default_factory=list)
    # id_task -> pos_next of tasks whose n_past [TAG_PROMPT_LOGITS] decremented below pos_next
    prompt_logits_resumes: dict[int, int] = field(default_factory=dict)
    # harness-only records of in-slot reuse: (slot, n_past of the common prefix, chunks) per cache reuse,
    # (slot, tokens before, n_keep, n_discard) per context shift
    reuses: list[tuple[int, int, list[Chunk]]] = field(default_factory=list)
    ctx_shifts: list[tuple[int, Tokens, int, int]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.checkpoint_cls: type[CommonPromptCheckpoint] = self.sem.checkpoint_cls or CommonPromptCheckpoint
        cache_cls: type[ServerPromptCache] = self.sem.cache_cls or ServerPromptCache
        slot_cls: type[ServerSlot] = self.sem.slot_cls or ServerSlot
        p = self.params
        n_ctx = getattr(self.ctx_tgt, "n_ctx", 0)
        # server-context.cpp:1333: --cache-ram 0 disables the cache
        if p.cache_ram != 0:
            self.prompt_cache = cache_cls(self.host, self.sem, p.cache_ram, n_ctx, unit=p.cache_ram_unit,
                                          makes_room=not p.alloc_without_room)  # fmt: skip
        # :1401 idle-slot caching needs the cache
        if p.cache_idle_slots and p.cache_ram == 0:
            p.cache_idle_slots = False
        # before the pin (b9093's :1010-1013, harness.trees.switches): a per-slot KV turns the pass off at start
        if p.cache_idle_slots and p.idle_pass_needs_unified and not p.kv_unified:
            p.cache_idle_slots = False
        self.n_swa = self.ctx_tgt.n_swa
        # :1166-1175 a memory that cannot shift turns both off
        if not can_shift(self.ctx_tgt):
            p.ctx_shift = False
            p.n_cache_reuse = 0
        self.slots = [slot_cls(self, i) for i in range(p.n_slots)]
        self.slot_n_ctx = n_ctx if p.kv_unified else n_ctx // max(1, p.n_slots)

    # ---- slot selection --------------------------------------------------------------------

    # server-context.cpp:1528
    def get_available_slot(self, task: Task) -> ServerSlot | None:
        ret: ServerSlot | None = None
        update_cache = False

        if task.id_slot != -1:
            ret = self.slots[task.id_slot] if 0 <= task.id_slot < len(self.slots) else None

        if self.params.slot_prompt_similarity != 0.0:
            f_sim_best = 0.0
            for slot in self.slots:
                if task.id_slot != -1 and slot.id != task.id_slot:
                    continue
                if slot.is_processing():
                    continue
                if not slot.prompt.tokens:
                    continue
                lcp_len = get_common_prefix(slot.prompt.tokens, task.tokens)
                f_sim_cur = f32(lcp_len / len(task.tokens))
                if f_sim_cur > f_sim_best and f_sim_cur > f32(self.params.slot_prompt_similarity):
                    f_sim_best = f_sim_cur
                    ret = slot
            if ret is not None:
                n_ret = ret.prompt.n_tokens()
                # float arithmetic as upstream: (f_sim_best * n_task) / n_ret, each step in binary32
                f_keep = f32(f32(f_sim_best * len(task.tokens)) / n_ret) if n_ret else float("nan")
                # if we are about to lose a large portion of the existing context - save it
                if f_keep < 0.5:
                    update_cache = True

        if ret is None:
            t_last = -1
            for slot in self.slots:
                if slot.is_processing():
                    continue
                if ret is None or slot.t_last_used <= t_last:
                    t_last = slot.t_last_used
                    ret = slot
            if ret is not None:
                update_cache = True

        if ret is not None:
            update_cache = update_cache and self.prompt_cache is not None
            # :1620 cache prompts only for completion tasks
            update_cache = update_cache and task.type == TASK_COMPLETION
            if update_cache and self.prompt_cache is not None:
                if ret.prompt_save(self.prompt_cache):
                    self._note_stateless(ret, "select", task.type)
                if not ret.prompt_load(self.prompt_cache, task.tokens):
                    ret.prompt_clear()
                self.prompt_cache.update()
        return ret

    # server-context.cpp:1648
    def try_clear_idle_slots(self) -> bool:
        if not self.params.kv_unified:
            return False
        for slot in self.slots:
            if slot.is_processing():
                continue
            if slot.prompt.n_tokens() > 0:
                slot.prompt_clear()
                return True
        return False

    # server-context.cpp:2231
    def get_free_slots(self, n_needed: int, exclude: int) -> list[ServerSlot]:
        out: list[ServerSlot] = []
        for slot in self.slots:
            if not slot.is_processing() and slot.id != exclude:
                out.append(slot)
            if len(out) >= n_needed:
                break
        return out

    # ---- tasks -----------------------------------------------------------------------------

    def handle_completion(
        self,
        tokens: Tokens,
        *,
        id_slot: int = -1,
        n_cmpl: int = 1,
        n_predict: int = 4,
        cache_prompt: bool = True,
        forced: Tokens = (),
        n_cache_reuse: int | None = None,
        n_keep: int | None = None,
        n_discard: int = 0,
    ) -> LaunchResult:
        """``process_single_task`` for a completion (server-context.cpp:2370-2432).

        ``forced``: the tokens a real server generated for this request; the model then generates
        exactly those instead of its own hash choices (differential testing against llama-server).
        """
        if not tokens:
            raise ValueError("empty prompt")
        self._take_cancels()  # queued at the front: taken before this task
        self.next_task_id += 1
        reuse = self.params.n_cache_reuse if n_cache_reuse is None else n_cache_reuse
        keep = self.params.n_keep if n_keep is None else n_keep
        task = Task(self.next_task_id, tuple(tokens), id_slot, n_predict, cache_prompt, -1, n_cmpl - 1, tuple(forced),
                    n_cache_reuse=reuse, n_keep=keep, n_discard=n_discard)  # fmt: skip
        self.events.clear()
        slot = self.get_available_slot(task)
        if slot is None or slot.is_processing():
            return LaunchResult("deferred", -1 if slot is None else slot.id, task.id)
        if task.is_parent():
            children = self.get_free_slots(task.n_children, slot.id)
            if len(children) < task.n_children:
                return LaunchResult("deferred", slot.id, task.id)
            for child in children:
                self.next_task_id += 1
                child.task = replace(task, id=self.next_task_id, id_slot=-1, id_parent=task.id, n_children=0)
                child.state = SlotState.WAIT_OTHER
        self.launch_slot_with_task(slot, task)

        if self.params.cache_idle_slots:
            self._cache_idle_slots()
        return LaunchResult("launched", slot.id, task.id)

    def handle_stateless(self, tokens: Tokens, task_type: str = TASK_EMBEDDING, *, id_slot: int = -1) -> LaunchResult:
        """``process_single_task`` for an embedding or rerank task (server-context.cpp:2363-2432).

        Selection as a completion's, but nothing is saved or loaded there (:1620); the idle-slot loop
        after the launch (:2419) saves every idle slot whatever its last task was. The prompt is
        evaluated from position 0 (``is_stateless_task``, :3196-3198, :3269), with no checkpoint (:3444),
        and the slot is released once it is (:3800-3812), keeping the tokens and their memory.
        """
        if task_type not in STATELESS_TASKS:
            raise ValueError(f"not a stateless task type: {task_type!r}")
        if not tokens:
            raise ValueError("empty prompt")
        self._take_cancels()
        self.next_task_id += 1
        task = Task(self.next_task_id, tuple(tokens), id_slot, n_predict=0, type=task_type)
        self.events.clear()
        slot = self.get_available_slot(task)
        if slot is None or slot.is_processing():
            return LaunchResult("deferred", -1 if slot is None else slot.id, task.id)
        self.launch_slot_with_task(slot, task)
        if self.params.cache_idle_slots:
            self._cache_idle_slots()
        return LaunchResult("launched", slot.id, task.id)

    def _cache_idle_slots(self) -> None:
        """:2417 save every idle slot to the cache; with kv_unified also clear it (even if not saved)."""
        if self.prompt_cache is None:
            return
        for s in self.slots:
            if self.params.idle_pass_needs_unified and s.prompt.n_tokens() == 0:
                continue  # before the pin (b9093's slot_save_and_clear, :726-728): an empty slot is skipped, unlogged
            if not s.is_processing():
                # whatever task the slot last ran: an embedding's or a rerank's state is saved too
                if s.prompt_save(self.prompt_cache):
                    self._note_stateless(s, "idle", self._launched)
                    self.prompt_cache.update()
                if self.params.kv_unified:
                    s.prompt_clear()
                self.idle_passed.append((s.id, self.params.kv_unified))

    def _note_stateless(self, slot: ServerSlot, where: str, by: str) -> None:
        """Record a save that just appended ``slot``'s prompt, when its last task was stateless."""
        prev = slot.task_prev
        if prev is None or prev.type not in STATELESS_TASKS or self.prompt_cache is None:
            return
        entry = self.prompt_cache.states[-1]  # alloc appended it; update() (evicting the oldest) has not run
        save = StatelessSave(slot.id, prev.type, entry.prompt.n_tokens(), entry.size(), where, by)
        self.stateless_saves.append(save)

    def launch_slot_with_task(self, slot: ServerSlot, task: Task) -> None:
        self._launched = task.type
        slot.task = task
        slot.state = SlotState.STARTED
        slot.n_decoded = 0
        slot.result = []
        slot.error = None

    def send_error(self, slot: ServerSlot, msg: str) -> None:
        """The error result of ``slot``'s task; the request's other tasks are cancelled.

        The HTTP handler's reader stops at the first error result and cancels the request's remaining
        tasks (server-queue.cpp:559-561 ``next`` calls ``stop``, :602-617 posts a
        ``SERVER_TASK_TYPE_CANCEL`` per task at the front of the queue); the loop takes them before its
        next ``update_slots``, and a cancel releases the slot running that task (server-context.cpp:
        2435-2444; here :meth:`_take_cancels`). Without it, the children of an ``n_cmpl > 1`` parent
        that failed would wait for it (``SLOT_STATE_WAIT_OTHER``) for ever.
        """
        slot.error = msg
        self.errors.append((slot.id, msg))
        task = slot.task
        if task is None or not (task.is_parent() or task.is_child()):
            return
        root = task.id_parent if task.is_child() else task.id
        for other in self.slots:
            t = other.task
            if other is not slot and t is not None and root in (t.id, t.id_parent):
                self.cancels.append(t.id)

    def _take_cancels(self) -> None:
        """The queued cancels (server-context.cpp:2435-2444): release the slot still running each task."""
        cancels, self.cancels = self.cancels, []
        for id_task in cancels:
            for other in self.slots:
                if other.task is not None and other.task.id == id_task and other.is_processing():
                    other.release()
                    break

    # ---- update_slots ----------------------------------------------------------------------

    def update_slots(self) -> None:
        """One iteration of the server loop: prompt batches, child activation, generation."""
        self._take_cancels()  # the queue's front: cancels posted since the last iteration
        for slot in self.slots:
            if slot.state is SlotState.STARTED:
                self._start_prompt(slot)
            if slot.state is SlotState.PROCESSING_PROMPT:
                self._prompt_batch(slot)
        # :3740 activate child tasks once the parent's prompt is processed
        for slot in self.slots:
            if slot.state is SlotState.DONE_PROMPT and slot.task is not None and slot.task.is_parent():
                for other in self.slots:
                    if (
                        other.state is SlotState.WAIT_OTHER
                        and other.task is not None
                        and other.task.id_parent == slot.task.id
                    ):
                        slot.copy_state_to(other)
                        other.state = SlotState.DONE_PROMPT
        for slot in self.slots:
            if slot.state is SlotState.DONE_PROMPT:
                slot.state = SlotState.GENERATING
                self._finish_token(slot)
            elif slot.state is SlotState.GENERATING:
                self._generate(slot)

    def run_until_idle(self, max_iters: int = 10_000) -> None:
        idle = SlotState.IDLE
        for _ in range(max_iters):
            for s in self.slots:  # any slot processing (is_processing(), inline: not a generator per iteration)
                if s.state is not idle:
                    break
            else:
                return
            self.update_slots()
        raise RuntimeError("server did not become idle")

    # server-context.cpp:3140-3400
    def _start_prompt(self, slot: ServerSlot) -> None:
        assert slot.task is not None
        input_tokens = slot.task.tokens
        if len(input_tokens) >= self.slot_n_ctx:
            self.send_error(slot, "request exceeds the available context size")
            slot.release()
            return
        # :3196-3198 is_stateless_task: an embedding or rerank prompt is evaluated from scratch (:3269); the
        # chunk reuse (:3208-3265) is inside the same branch
        reuse = slot.task.cache_prompt and slot.task.type not in STATELESS_TASKS
        n_past = get_common_prefix(slot.prompt.tokens, input_tokens) if reuse else 0
        if reuse:
            n_past = self.cache_reuse(slot, input_tokens, n_past)
        pos_next = n_past
        has_new_tokens = n_past < len(input_tokens)
        pos_min_thold = max(0, pos_next - self.n_swa - (0 if has_new_tokens else 1))

        if 0 < n_past <= slot.prompt.n_tokens():
            pos_min = self.ctx_tgt.memory_seq_pos_min(slot.id)
            if pos_min == -1:
                raise GgmlAbort("pos_min == -1, but n_past > 0 - should not happen")
            if pos_min >= pos_min_thold:
                found: CommonPromptCheckpoint | None = None
                for cur in reversed(slot.prompt.checkpoints):
                    if cur.pos_max > pos_next:
                        continue
                    if cur.pos_min < pos_min_thold or cur.pos_min == 0:
                        found = cur
                        break
                if found is not None:
                    pos_next = min(pos_next, max(found.pos_min + 1, found.pos_max))
                    n_past = min(pos_next, found.n_tokens)
                    if found.made_for[:n_past] != slot.prompt.tokens[:n_past]:
                        # known finding stale-checkpoint-after-miss: the checkpoint was taken for a
                        # prompt that shares fewer than n_past tokens with this one (it survived a
                        # request with n_past = 0, see the docstring); upstream restores it anyway.
                        # Recorded before the restore, so the checks around the restore can see it.
                        self.stale_restores.append(found.made_for[:n_past])
                    # a failed read aborts (common.cpp:2337, 2355); "restore" scopes faults to it
                    with self.host.operation("restore"):
                        if not self._load_checkpoint(slot, found):
                            pos_next = 0  # b11549 (server-context.cpp:3746-3753): reprocess the whole prompt
                            n_past = 0
                else:
                    pos_next = 0
                    n_past = 0

        self._invalidate_checkpoints(slot, pos_next)
        slot.pos_next = pos_next

        # :3385 [TAG_PROMPT_LOGITS]
        if n_past == len(input_tokens) and n_past > 0:
            n_past -= 1
            if n_past < pos_next:
                # known finding swa-checkpoint-order: a checkpoint with pos_max == pos_next survived
                # the invalidation above and this task's checkpoint may land at pos_next - 1
                self.prompt_logits_resumes[slot.task.id] = pos_next

        slot.n_prompt_cached = n_past
        slot.prompt.tokens = slot.prompt.tokens[:n_past]
        # :3424 truncate any tokens that are beyond n_past for this slot
        slot.mem_seq_rm(n_past, -1)
        slot.state = SlotState.PROCESSING_PROMPT

    # server-context.cpp:3208-3265
    def cache_reuse(self, slot: ServerSlot, input_tokens: Tokens, n_past: int) -> int:
        """Reuse chunks of the slot's old prompt by shifting them into place; the new ``n_past``."""
        assert slot.task is not None
        n_cache_reuse = slot.task.n_cache_reuse
        if n_cache_reuse <= 0 or not can_shift(self.ctx_tgt):  # :3210-3216 (text only: never has_mtmd)
            return n_past
        chunks = reuse_chunks(slot.prompt.tokens, input_tokens, n_past, n_cache_reuse)
        for ch in chunks:
            self.shift_chunk(slot, ch)
        slot.prompt.tokens = shifted_tokens(slot.prompt.tokens, chunks)
        self.reuses.append((slot.id, n_past, chunks))
        return n_past + sum(ch.n_match for ch in chunks)

    def shift_chunk(self, slot: ServerSlot, ch: Chunk) -> None:
        """:3249-3250 ``seq_rm(head_p, head_c)`` then ``seq_add(head_c, head_c + n_match, kv_shift)``."""
        slot.mem_seq_rm(ch.head_p, ch.head_c)
        slot.mem_seq_add(ch.head_c, ch.head_c + ch.n_match, ch.kv_shift)

    # server-context.cpp:2889-2950 (pre_decode)
    def context_shift(self, slot: ServerSlot) -> bool:
        """A generating slot at ``n_tokens + 1 >= n_ctx``: shift (True), or fail the task (False)."""
        task = slot.task
        assert task is not None
        if not self.params.ctx_shift:
            self.send_error(slot, "context shift is disabled")
            slot.release()
            return False
        if task.is_parent() or task.is_child():
            self.send_error(slot, "context shift cannot be used for shared prompt")
            slot.release()
            return False
        n_keep, n_discard = self.shift_bounds(slot)
        self.discard(slot, n_keep, n_discard)
        tokens = slot.prompt.tokens
        slot.prompt.clear()  # :2945 the checkpoints go too
        slot.prompt.tokens = tokens[:n_keep] + tokens[n_keep + n_discard :]
        slot.truncated = True
        self.ctx_shifts.append((slot.id, tokens, n_keep, n_discard))
        return True

    def shift_bounds(self, slot: ServerSlot) -> tuple[int, int]:
        """:2914-2926 (n_keep, n_discard) of ``slot``'s context shift."""
        task = slot.task
        assert task is not None
        return context_shift_bounds(slot.prompt.n_tokens(), len(task.tokens), task.n_keep, task.n_discard,
                                    add_bos=self.params.add_bos, n_ctx=self.slot_n_ctx)  # fmt: skip

    def discard(self, slot: ServerSlot, n_keep: int, n_discard: int) -> None:
        """:2930-2931 ``seq_rm(n_keep, n_keep + n_discard)``, ``seq_add(n_keep + n_discard, pos_next, -n_discard)``."""
        slot.mem_seq_rm(n_keep, n_keep + n_discard)
        slot.mem_seq_add(n_keep + n_discard, slot.prompt.n_tokens(), -n_discard)

    def _load_checkpoint(self, slot: ServerSlot, ckpt: CommonPromptCheckpoint) -> bool:
        """Load a checkpoint into both contexts. A failed load aborts (common.cpp:2337, 2355 at 0c1e570); under
        ``checkpoint_load_bool`` (upstream #26004, server-context.cpp:3745-3754 at b11549) only a task's own
        checkpoint aborts, and one restored from a slot file (``id_task`` -1) returns False."""
        try:
            ckpt.load_tgt(self.ctx_tgt, slot.id, STATE_SEQ_FLAGS_PARTIAL_ONLY)
            ckpt.load_dft(self.ctx_dft, slot.id, STATE_SEQ_FLAGS_PARTIAL_ONLY)
        except GgmlAbort:
            if self.params.checkpoint_load_bool and ckpt.id_task == -1:
                return False
            raise
        return True

    def _invalidate_checkpoints(self, slot: ServerSlot, pos_next: int) -> None:
        """:3369 erase any checkpoints with pos_max > pos_next."""
        for cur in list(slot.prompt.checkpoints.items):  # a copy: erase() changes the list
            if cur.pos_max > pos_next:
                slot.prompt.checkpoints.erase(cur)

    def _do_checkpoint_base(self) -> bool:
        """:3441 checkpoints only where memory cannot be rolled back (FULL, RS) or with SWA."""
        t = self.ctx_tgt.seq_rm_type()
        return self.params.n_ctx_checkpoints > 0 and (t is SeqRmType.FULL or t is SeqRmType.RS or self.n_swa > 0)

    # server-context.cpp:3441-3620
    def _prompt_batch(self, slot: ServerSlot) -> None:
        assert slot.task is not None
        p = self.params
        input_tokens = slot.task.tokens
        n_task = len(input_tokens)
        # :3444 make checkpoints only for completion tasks
        do_checkpoint = self._do_checkpoint_base() and slot.task.type == TASK_COMPLETION
        n_start = slot.prompt.n_tokens()
        # the batch: up to n_batch tokens, ending early at the first checkpoint stop it reaches, where
        # n_task == n_now + min(n_batch, off) for off in (4 + n_ubatch, 4) (the prompt is not touched here)
        end = min(n_task, n_start + p.n_batch)
        if do_checkpoint:
            for stop in sorted((n_task - min(p.n_batch, 4 + p.n_ubatch), n_task - min(p.n_batch, 4))):
                if n_start < stop <= end:
                    end = stop
                    break
        batch = list(input_tokens[n_start:end])
        n_tokens_cur = len(batch)
        n_after = n_start + n_tokens_cur
        near_prompt_end = n_task < n_after + p.n_ubatch
        if n_after != n_task and not near_prompt_end:
            do_checkpoint = False
        pos_min = self.ctx_tgt.memory_seq_pos_min(slot.id)
        pos_max = self.ctx_tgt.memory_seq_pos_max(slot.id)
        if do_checkpoint and pos_min < 0:
            do_checkpoint = False
        cps = slot.prompt.checkpoints
        do_checkpoint = do_checkpoint and (
            cps.empty()
            or (near_prompt_end and not p.end_checkpoint_spaced)
            or n_start > cps.back().n_tokens + p.checkpoint_min_step
        )
        # the tokens are in the slot's prompt before the checkpoint is taken (:3526)
        slot.prompt.tokens = slot.prompt.tokens + tuple(batch)
        if do_checkpoint:
            self.create_checkpoint(slot, n_tokens_cur, pos_min, pos_max)
        if not self._decode(slot, batch, n_start):
            return
        if slot.prompt.n_tokens() == n_task and slot.task.type in STATELESS_TASKS:
            # :3800-3812 send_embedding / send_rerank, then release: the tokens and memory stay in the slot
            slot.release()
            return
        if slot.prompt.n_tokens() == n_task:
            slot.state = SlotState.DONE_PROMPT
            # the first generated token: counted now, decoded only with the next batch (:475-511)
            slot.sampled = self._choose(slot, slot.prompt.tokens)
            if slot.resuming:  # back in step after a draft-KV recovery: generation goes on
                slot.resuming = False
                slot.result.append(slot.sampled)
                slot.n_decoded += 1
            else:
                slot.result = [slot.sampled]
                slot.n_decoded = 1

    # server-context.cpp:2290
    def create_checkpoint(self, slot: ServerSlot, n_tokens_cur: int, pos_min: int, pos_max: int) -> None:
        assert slot.task is not None
        p = self.params
        id_task = slot.task.id
        cps = slot.prompt.checkpoints
        # evict checkpoints within min-step of a previous one, unless created by the current task;
        # only when the list is full
        last = -1
        if len(cps) + 1 >= p.n_ctx_checkpoints:
            for it in list(cps.items):
                if len(cps) + 1 < p.n_ctx_checkpoints:
                    break
                if it.id_task != id_task and last >= 0 and it.n_tokens <= last + p.checkpoint_min_step:
                    cps.erase(it)
                    continue
                last = it.n_tokens
        while len(cps) >= p.n_ctx_checkpoints:
            cps.pop_front()
        # replace an existing checkpoint at the same n_tokens instead of appending a duplicate
        n_tokens_new = slot.prompt.n_tokens() - n_tokens_cur
        for it in list(cps.items):
            if it.n_tokens == n_tokens_new:
                cps.erase(it)
        cur = cps.emplace_back(self.checkpoint_cls(self.host, self.sem, id_task=id_task))
        cur.update_pos(n_tokens_new, pos_min, pos_max)
        self.created.append((slot.id, n_tokens_new))
        cur.made_for = slot.prompt.tokens[:n_tokens_new]
        cur.update_tgt(self.ctx_tgt, slot.id, STATE_SEQ_FLAGS_PARTIAL_ONLY)
        cur.update_dft(self.ctx_dft, slot.id, STATE_SEQ_FLAGS_PARTIAL_ONLY)
        if self.ctx_dft is not None:
            cur.update_spec(_spec_state(slot.prompt.tokens[:n_tokens_new]))

    def _decode(self, slot: ServerSlot, batch: list[int], pos0: int) -> bool:
        """``llama_decode`` of one slot's batch on target then draft (:3660-3737).

        Returns False when the batch could not be processed; the slot is then released (and, for
        a target failure, cleared) as upstream does.
        """
        while True:
            ret = self.ctx_tgt.decode(slot.id, batch, pos0)
            if ret == 0:
                break
            if ret == 1 and self.try_clear_idle_slots():
                continue
            # upstream halves n_batch and retries; a one-token batch that still fails is an error
            err = "Context size has been exceeded." if ret == 1 else "Invalid input batch."
            for s in self.slots:
                if s.is_processing():
                    self.send_error(s, err)
                    s.release()
                    s.prompt_clear()
            return False
        if self.ctx_dft is not None:
            ret = self.ctx_dft.decode(slot.id, batch, pos0)
            if ret != 0 and self.params.draft_recovery:
                return self._recover_draft(slot, batch, pos0)
            if ret != 0:
                # :3731 "failed to process speculative batch" -> abort_all_slots: released, not cleared
                self.abort_all_slots("failed to process speculative batch")
                return False
        return True

    def _recover_draft(self, slot: ServerSlot, batch: list[int], pos0: int) -> bool:
        """The proposed recovery when the draft context has no room for a batch the target took.

        Not upstream and not in PR #27451 (a reviewer's account of what fixed it for them, see
        ``../shared/spec``): clear every idle slot (freeing their draft cells) and retry the draft
        batch once; if it still fails, clear the out-of-sync slot in both contexts and let it
        re-process its tokens (the prompt, or the tokens it had decoded up to ``pos0``) instead of
        failing the request. Returns True when the retry succeeded (the batch is in both contexts).
        """
        assert self.ctx_dft is not None and slot.task is not None
        purged = False
        for s in self.slots:
            if s is not slot and not s.is_processing() and s.prompt.n_tokens() > 0:
                s.prompt_clear()
                purged = True
        if purged and self.ctx_dft.decode(slot.id, batch, pos0) == 0:
            self.draft_recoveries["retried"] += 1
            return True
        if slot.resyncs >= 2:  # bounded: a slot that keeps losing the draft race fails as upstream does
            self.abort_all_slots("failed to process speculative batch")
            return False
        slot.resyncs += 1
        generating = slot.state is not SlotState.PROCESSING_PROMPT
        resume = slot.prompt.tokens[: pos0 + 1]
        slot.mem_seq_rm(-1, -1)
        slot.prompt.clear()
        if generating:
            # the target decoded up to pos0 (unverified drafts after it are dropped): re-process those
            slot.task = replace(slot.task, tokens=resume)
            slot.resuming = True
        slot.state = SlotState.PROCESSING_PROMPT
        self.draft_recoveries["resynced"] += 1
        return False

    def _choose(self, slot: ServerSlot, hist: Tokens) -> int:
        """The target's next token: the real server's when replaying one (``Task.forced``), else ``sample``."""
        forced = slot.task.forced if slot.task is not None else ()
        i = slot.n_decoded if slot.resuming or slot.state is SlotState.GENERATING else 0
        return forced[i] if i < len(forced) else sample(hist)

    def _choose_after(self, slot: ServerSlot, hist: Tokens) -> int:
        """The target's greedy choice after ``hist`` inside a speculative round (forced tokens by position)."""
        forced = slot.task.forced if slot.task is not None else ()
        i = len(hist) - len(slot.task.tokens) if slot.task is not None and not slot.resuming else -1
        return forced[i] if 0 <= i < len(forced) else sample(hist)

    # server-context.cpp:2735
    def abort_all_slots(self, reason: str) -> None:
        for s in self.slots:
            if s.is_processing():
                self.send_error(s, reason)
                s.release()

    def _finish_token(self, slot: ServerSlot) -> None:
        assert slot.task is not None
        p = self.params
        if p.ctx_limit and not p.ctx_shift and slot.prompt.n_tokens() + 1 >= self.slot_n_ctx:
            slot.truncated = True  # :1866-1874 out of context: the generation stops
            slot.release()
        elif slot.n_decoded >= slot.task.n_predict:
            slot.release()

    def _generate(self, slot: ServerSlot) -> None:
        assert slot.sampled is not None
        if self.params.ctx_limit and slot.prompt.n_tokens() + 1 >= self.slot_n_ctx and not self.context_shift(slot):
            return
        if self.ctx_dft is not None and self.params.n_draft_max > 0:
            self._speculative_round(slot)
            return
        n = slot.prompt.n_tokens()
        tok = slot.sampled
        slot.prompt.tokens = (*slot.prompt.tokens, tok)
        if not self._decode(slot, [tok], n):
            return
        slot.sampled = self._choose(slot, slot.prompt.tokens)
        slot.result.append(slot.sampled)
        slot.n_decoded += 1
        self._finish_token(slot)

    def _restore_draft(self, slot: ServerSlot, use_ckpt_dft: bool) -> None:
        """:3040 restore the draft context to the state before drafting (spec_ckpt, then seq_rm)."""
        assert self.ctx_dft is not None
        ckpt = slot.spec_ckpt
        if use_ckpt_dft:
            ckpt.load_dft(self.ctx_dft, slot.id, STATE_SEQ_FLAGS_PARTIAL_ONLY)
        if not self.ctx_dft.memory_seq_rm(slot.id, ckpt.pos_max + 1, -1):
            raise GgmlAbort(f"failed to remove sequence {slot.id}")

    # server-context.cpp:2980-3060 (draft, spec_ckpt) and :3890-3960 (acceptance)
    def _speculative_round(self, slot: ServerSlot) -> None:
        assert slot.sampled is not None and self.ctx_dft is not None and slot.task is not None
        tgt, dft = self.ctx_tgt, self.ctx_dft
        n = slot.prompt.n_tokens()
        use_ckpt_tgt = tgt.seq_rm_type() is SeqRmType.FULL
        use_ckpt_dft = dft.seq_rm_type() is SeqRmType.FULL
        ckpt = slot.spec_ckpt
        ckpt.update_pos(n, tgt.memory_seq_pos_min(slot.id), tgt.memory_seq_pos_max(slot.id))
        if use_ckpt_dft:
            ckpt.update_dft(dft, slot.id, STATE_SEQ_FLAGS_PARTIAL_ONLY)

        # common_speculative_draft: the draft model runs ahead in its own context
        k = min(self.params.n_draft_max, slot.task.n_predict - slot.n_decoded)
        hist = (*slot.prompt.tokens, slot.sampled)
        draft: list[int] = []
        if dft.decode(slot.id, [slot.sampled], n) == 0:
            for i in range(k):
                d = draft_sample(hist)
                draft.append(d)
                hist = (*hist, d)
                if i + 1 < k and dft.decode(slot.id, [d], n + 1 + i) != 0:
                    break

        self._restore_draft(slot, use_ckpt_dft)
        if draft and use_ckpt_tgt:
            ckpt.update_tgt(tgt, slot.id, STATE_SEQ_FLAGS_PARTIAL_ONLY)

        batch = [slot.sampled, *draft]
        slot.prompt.tokens = slot.prompt.tokens + tuple(batch)
        if not self._decode(slot, batch, n):
            return

        # accept: the target's greedy choices along the draft
        accepted: list[int] = []
        h = slot.prompt.tokens[: n + 1]
        for d in draft:
            a = self._choose_after(slot, h)
            accepted.append(a)
            if a != d:
                break
            h = (*h, d)
        else:
            accepted.append(self._choose_after(slot, h))
        n_rollback = len(draft) + 1 - len(accepted)
        confirmed = [slot.sampled, *accepted[:-1]]
        if n_rollback > 0:
            if use_ckpt_tgt:
                ckpt.load_tgt(tgt, slot.id, STATE_SEQ_FLAGS_PARTIAL_ONLY)
                ckpt.load_dft(dft, slot.id, STATE_SEQ_FLAGS_PARTIAL_ONLY)
                slot.mem_seq_rm(ckpt.pos_max + 1, -1)
                slot.prompt.tokens = slot.prompt.tokens[: ckpt.n_tokens]
                # replay the confirmed tokens (upstream: next iteration, spec_is_replay)
                slot.prompt.tokens = slot.prompt.tokens + tuple(confirmed)
                if not self._decode(slot, confirmed, ckpt.n_tokens):
                    return
            else:
                keep = n + len(confirmed)
                slot.mem_seq_rm(keep, -1)
                slot.prompt.tokens = slot.prompt.tokens[:keep]
        # every accepted token is generated; the last one is sampled but not yet decoded
        slot.result.extend(accepted)
        slot.n_decoded += len(accepted)
        slot.sampled = accepted[-1]
        self._finish_token(slot)


def _spec_state(hist: Tokens) -> bytes:
    """``common_speculative_get_state``: a small per-position blob (e.g. EAGLE3's g_embd row)."""
    return hashlib.blake2b(struct.pack(f"<{len(hist)}i", *hist), digest_size=32).digest()
