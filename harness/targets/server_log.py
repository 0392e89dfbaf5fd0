"""The prompt cache's properties read off a real ``llama-server``'s own ``-lv 4`` log, not off the model fed with
its answers.

:class:`CacheLog` reads the log as it grows (:meth:`CacheLog.feed`, whole lines only) and checks, on what the
server itself printed, the properties of :data:`properties.invariants.INVARIANTS` the log can show; each check
is counted under the property's name, so the gate's table says how often the server was held to it:

``limit``
    every ``cache state`` line that ``server_prompt_cache::update`` prints (tools/server/server-task.cpp:1894 at
    0c1e570) is within the byte limit (``--cache-ram``, when set) and the token limit it computed (``est``,
    when ``limit_tokens > 0``), and no entry it lists is alone above the byte limit;
``accounting``
    the state's size is the sum of the listed entries' sizes (within the log's rounding to 0.001 MiB) and its
    prompt count is the number of entries listed;
``checkpoint_lists``
    ``created context checkpoint K of N`` (server-context.cpp:2349) has ``1 <= K <= N`` and ``N`` the server's
    ``--ctx-checkpoints``; no listed entry holds more checkpoints than that;
``load_choice``
    ``server_prompt_cache::load`` (server-task.cpp:1795) moves exactly the entry upstream's front-to-back scan
    picks from the candidates it printed (skip ``f_keep < 0.25``; take one that beats the best so far on both
    ``f_keep`` and ``f_sim``; the best starts at the slot's own), or nothing: recomputed here from the printed
    figures, independently of the server's choice;
``alloc_eviction``
    ``alloc`` makes room before it saves (server-task.cpp:1750), so ``update`` never finds the cache above its
    byte limit (``cache size limit reached``) unless an allocation failure lowered the limit first; and the
    cache's order, replayed from the log between two states (a save removes the entries its prompt contains, then
    the oldest while the cache and the new entry exceed the limit, then appends the new entry; a load takes the
    entry its scan picks; update removes the oldest while over a limit), is the order the next state lists: the
    oldest go first, each make-room eviction was needed (the cache and the new entry, as the state then lists it,
    did not fit) and each token eviction too. A cycle the log cannot replay exactly (an allocation failure, two
    entries of the length an obsolete removal names) is not checked;
``update_eviction``
    in a cycle where ``update`` itself evicted (``cache size limit reached`` or ``cache token limit (N, est: E)
    reached, removing oldest entry``, server-task.cpp:1875-1893), the replay of ``alloc_eviction`` holds it: the
    oldest went first, and a token eviction only while the cache held more than ``est`` tokens;
``load_transfer``
    between two states the entries that left are the logged removals (an obsolete prefix, server-task.cpp:1742;
    the entry a load moved into the slot, :1864; an eviction) and each logged removal took one, and no entry
    appears without a save that added it. Entries are told apart by the address the state lists; a freed
    address a save reuses can hide one removal per save, so the count allows exactly that;
``no_prefix_entries``
    no entry is a prefix of another, nor two entries one prompt (``alloc`` refuses a prompt the cache holds
    already and removes the entries the new one contains, server-task.cpp:1713 and :1740): read off ``load``'s
    scan, which prints each entry's length and its common prefix with the request (:1808): an entry matched to
    its end and another matched at least as far hold the same first tokens.
``cleared_checkpoints``
    a slot the server cleared (``server_slot::prompt_clear``, server-context.cpp:293, logged ``clearing prompt
    with N tokens``: an erase, a failed load or restore, a purge or an idle slot cleared under a unified KV, a
    child slot released, a failed decode) holds no checkpoint until it creates one or a cache load gives it an
    entry's: no checkpoint of that slot is restored, invalidated or erased in between (server-context.cpp:2301,
    2316, 3357, 3374), and its next ``created context checkpoint K`` has ``K`` 1. Each clear counts once, when
    the slot's next checkpoint event settles it. A load's lines name no slot: the load belongs to the slot the
    next ``launch_slot_`` line names (get_available_slot returns it to launch_slot_with_task).

Deviations: sizes are compared as the log prints them (MiB to three decimals), so a difference below 0.0005 MiB
per entry is not seen; the log's wording is 0c1e570's (unchanged on the PR's branch); a tree that words it
otherwise shows fewer checks, never a false failure.

* ``restore_failure``: a load that found its entry and failed to restore it ("failed to restore state with size")
  leaves the entry in the next cache state's listing and its slot cleared ("clearing prompt with").
* ``busy_slot_untouched`` (:func:`busy_slot_touches`, over a whole log): the idle-slot pass saves no slot between
  its launch and its release.

Size: one reader, :class:`CacheLog`, keeps one log's state line by line for the ten properties it checks, each a
short method over that shared state; splitting it would pass that state between modules.
"""

from __future__ import annotations

import re
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from harness.trees.switches import switches_of_binary

__all__ = ["LOG_PROPERTIES", "CacheLog", "LogProblem", "busy_slot_touches"]

LOG_PROPERTIES = ("limit", "accounting", "checkpoint_lists", "load_choice", "alloc_eviction", "load_transfer",
                  "no_prefix_entries", "cleared_checkpoints", "update_eviction", "restore_failure")
"""The properties :class:`CacheLog` checks, by their names in ``properties.invariants.INVARIANTS``."""

_STATE = re.compile(
    r"cache state: (\d+) prompts, ([\d.]+) MiB \(limits: ([\d.]+) MiB, (\d+) tokens, (\d+) est\)"
)
_ENTRY = re.compile(r"- prompt (0x[0-9a-f]+|\(nil\)|[0-9a-fx]+):\s+(\d+) tokens, checkpoints:\s+(\d+),\s+([\d.]+) MiB")
_CREATED = re.compile(
    r"created context checkpoint (\d+) of (\d+)(?: \(pos_min = (-?\d+), pos_max = (-?\d+), n_tokens = (\d+))?"
)
# "sim" before upstream named it "f_sim" (server-task.cpp's load at b9093: "found better prompt with f_keep = %.3f,
# sim = %.3f"); b9093 prints no candidate lines, so its load_choice cannot be read
_LOOKING = re.compile(r"looking for better prompt, base f_keep = (-?[\d.]+), (?:f_)?sim = ([\d.]+)")
_CANDIDATE = re.compile(r"- prompt with length\s+(\d+), lcp =\s+(\d+), f_keep = ([\d.]+), (?:f_)?sim = ([\d.]+)")
_FOUND = re.compile(r"found better prompt with f_keep = ([\d.]+), (?:f_)?sim = ([\d.]+)")
_SLOT_LINE = re.compile(r"\bslot\s+(\S+): id\s+(\d+) \|")
_CKPT_EVENTS = ("restored context checkpoint", "erased invalidated context checkpoint",
                "erasing old context checkpoint", "erasing context checkpoint too close")  # fmt: skip
_ROUND = 0.0005  # the log prints MiB to three decimals
_OTHER_THREADS = ("server_strea", "log_server_r")  # the HTTP threads log (server-stream.cpp:599, server-http.cpp:53)


@dataclass
class _FailedLoad:
    """A load that found its entry and failed to restore it ("failed to restore state with size",
    server-task.cpp:1834 at 0c1e570), until the cache state that follows it: the entry's address (from the last
    state's listing, by its place among the scan's candidates), the slot ("failed to load prompt from cache",
    server-context.cpp:287) and whether that slot was cleared since (:1631)."""

    line: int
    entry: str | None
    slot: int | None = None
    cleared: bool = False


@dataclass(frozen=True)
class LogProblem:
    """A property the server's log shows broken: its name and what the lines say."""

    property: str
    message: str


@dataclass
class _Scan:
    """One ``load``'s scan as printed: the slot's own f_keep/f_sim and the candidates, in order."""

    base: tuple[float, float]
    candidates: list[tuple[float, float]] = field(default_factory=list)
    spans: list[tuple[int, int]] = field(default_factory=list)  # each candidate's length and lcp with the request

    def prefix_pair(self) -> tuple[int, int] | None:
        """Two candidates of which one is a prefix of the other (or both one prompt), as their lengths: an entry
        whose lcp with the request is all of it (its tokens are the request's first ``n``) and another that
        matches the request at least that far holds those same ``n`` tokens first."""
        for i, (n, lcp) in enumerate(self.spans):
            if n > 0 and lcp == n:
                for j, (m, lcp_j) in enumerate(self.spans):
                    if j != i and m >= n and lcp_j >= n:
                        return n, m
        return None

    def upstream_pick(self) -> tuple[float, float] | None:
        """The f_keep/f_sim of the entry upstream's rule takes (server-task.cpp:1812-1822), or None."""
        i = self.pick_index()
        return None if i is None else self.candidates[i]

    def pick_index(self) -> int | None:
        """Which candidate (its place in the cache, oldest first) upstream's rule takes, or None."""
        keep, sim = self.base
        best = None
        for i, (k, s) in enumerate(self.candidates):
            if k < 0.25:
                continue
            if keep < k and sim < s:
                keep, sim, best = k, s, i
        return best


_SAVING = re.compile(r"saving prompt with length (\d+)")
_OBSOLETE = re.compile(r"removing obsolete cached prompt with length (\d+)")
_TOKEN_EVICT = re.compile(r"cache token limit \((\d+), est: (\d+)\) reached, removing oldest entry")
_NEW = ""  # the entry a save appends, before a state names its address


@dataclass
class _Order:
    """The cache's entries oldest first, replayed from the log between two states, to hold the next state to
    ``alloc_eviction``: a save removes the entries its prompt contains, then the oldest ones while the cache and
    the new entry exceed the limit, then appends the new entry (server-task.cpp:1738-1790); a load takes the entry
    its scan picks; update removes the oldest while over a limit (:1875-1893)."""

    entries: list[tuple[str, int, float]] = field(default_factory=list)  # address, tokens, MiB
    saving: bool = False  # a save began and was not refused: its entry is appended at the next event
    saving_tokens: int = 0  # its length, from the save's own line (its size is known only when a state lists it)
    unsure: str = ""  # why this cycle cannot be replayed (then it is not checked)
    room: list[float] = field(default_factory=list)  # the cache's MiB before each make-room eviction
    token_pops: list[tuple[int, int]] = field(default_factory=list)  # tokens held before a token eviction, est
    known: bool = False  # a state has been listed: the replay starts from the first one (as load_transfer)
    update_pops: int = 0  # update's own evictions (size, tokens) in this cycle: ``update_eviction`` is at stake
    taken: tuple[int, tuple[str, int, float]] | None = None  # the last load's entry and its place, until it restores

    def appended(self) -> None:
        if self.saving:
            self.entries.append((_NEW, self.saving_tokens, 0.0))
            self.saving = False

    def pop_oldest(self, why: str) -> None:
        if not self.entries:
            self.unsure = self.unsure or f"{why} from an empty cache"
        else:
            self.entries.pop(0)

    def event(self, line: str) -> None:
        """One line of the log between two states."""
        if (m := _SAVING.search(line)) is not None:
            self.saving, self.saving_tokens = True, int(m[1])
        elif "already in the cache, skipping" in line or "exceeds cache size limit" in line:
            self.saving = False
        elif "failed to allocate memory for prompt cache state" in line:
            self.saving, self.unsure = False, "an allocation failed"
        elif (m := _OBSOLETE.search(line)) is not None:
            same = [i for i, (_a, n, _m) in enumerate(self.entries) if n == int(m[1]) and _a != _NEW]
            if len(same) != 1:
                self.unsure = self.unsure or f"{len(same)} entries of {m[1]} tokens for one obsolete removal"
            else:
                self.entries.pop(same[0])
        elif "making room for prompt cache entry, removing oldest entry" in line:
            self.room.append(sum(m for _a, _n, m in self.entries))
            self.pop_oldest("make room")
        elif "cache size limit reached, removing oldest entry" in line:
            self.appended()
            self.update_pops += 1
            self.pop_oldest("update's size eviction")
        elif "failed to restore state with size" in line and self.taken is not None:
            self.entries.insert(*self.taken)  # the load returned before erasing it (server-task.cpp:1833)
            self.taken = None
        elif (m := _TOKEN_EVICT.search(line)) is not None:
            self.appended()
            held = sum(n for _a, n, _m in self.entries)  # the new entry's tokens are its save line's length
            self.token_pops.append((held, int(m[2])))
            self.update_pops += 1
            self.pop_oldest("update's token eviction")

    def loaded(self, scan: _Scan) -> None:
        """A load that took the entry its scan picks (the scan lists the cache oldest first)."""
        self.appended()
        i = scan.pick_index()
        if len(scan.spans) != len(self.entries):
            self.unsure = self.unsure or f"the scan lists {len(scan.spans)} entries where {len(self.entries)} remain"
        elif i is not None:
            self.taken = (i, self.entries.pop(i))

    def check(self, ids: list[str], entries: list[tuple[int, int, float]], limit_mib: float) -> str | None:
        """The state just listed against the replay: the same entries in the same order (the new one anywhere a
        save put it), each eviction needed; then the replay starts again from this state."""
        self.appended()
        want, unsure, room, token_pops = self.entries, self.unsure, self.room, self.token_pops
        self.entries = [(a, t, m) for a, (t, _c, m) in zip(ids, entries, strict=True)]
        self.unsure, self.room, self.token_pops = "", [], []
        if unsure or not self.known:
            self.known = True
            return None
        got = list(ids)
        if len(want) != len(got) or any(w != _NEW and w != g for (w, _t, _m), g in zip(want, got, strict=False)):
            old = [a if a != _NEW else "new" for a, _t, _m in want]
            return (f"the cache lists {got} where removing the oldest entries first (and the ones a save contains, "
                    f"the one a load takes) leaves {old}")  # fmt: skip
        new = [m for (w, _t, _m), (_tt, _c, m) in zip(want, entries, strict=True) if w == _NEW]
        for before in room:
            if new and limit_mib > 0 and before + new[0] <= limit_mib - _ROUND * (len(want) + 2):
                return (f"a save removed an entry to make room though the cache ({before:.3f} MiB) and the new entry "
                        f"({new[0]:.3f} MiB) fit the limit {limit_mib:.3f} MiB")  # fmt: skip
        for held, est in token_pops:
            if held <= est:
                return f"update removed an entry for the token limit though the cache held {held} <= {est} tokens"
        return None


class CacheLog:
    """The server-side properties of one ``llama-server`` (``-lv 4``), checked line by line as its log grows."""

    def __init__(self, ctx_checkpoints: int, *, alloc_makes_room: bool | None = None) -> None:
        self.ctx_checkpoints = ctx_checkpoints
        # False: a version whose alloc makes no room (harness.trees.switches: alloc_without_room), where update()
        # evicting for size after a save is the design, not alloc_eviction broken. None: as the log's first line
        # says, the command line ServerProcess writes there ("$ BINARY ..."): that binary's tree's switch
        self.alloc_makes_room = alloc_makes_room
        self.checked: Counter[str] = Counter()
        self._offset = 0
        self._state: tuple[int, float, float, int, int, int] | None = None  # the state line being listed, its line
        self._entries: list[tuple[int, int, float]] = []
        self._ids: list[str] = []  # the addresses the state being read lists
        self._prev_ids: list[str] | None = None  # the last state's
        self._cycle: Counter[str] = Counter()  # since the last state: saves, skipped saves, logged removals
        self._scan: _Scan | None = None
        self._limit_lowered = False
        self._line = 0
        self._order = _Order()  # the cache starts empty
        self._cleared: dict[int, int] = {}  # slot -> the log line that cleared it, until a checkpoint event settles it
        self._load_pending = False  # a load moved an entry: into the slot the next launch_slot_ line names
        #: every checkpoint created, in order: (slot, n_tokens) as its line says (server-context.cpp:2349 at 0c1e570)
        self.created: list[tuple[int, int]] = []
        #: every slot the idle-slot pass took, in order: (slot, cleared), from its "saving idle slot to prompt cache"
        #: line (server-context.cpp:2421 at 0c1e570) and the "clearing prompt" line of that slot right after it (:2429)
        self.idle: list[tuple[int, bool]] = []
        self._idle_open = False  # the last idle-pass line was a slot's "saving idle slot": its clear may follow
        self._loading: str | None = None  # the address of the entry the last load's scan took, if known
        self._failed: _FailedLoad | None = None  # a failed load, until the cache state after it (restore_failure)

    def feed(self, text: str) -> list[LogProblem]:
        """Check the whole lines of ``text`` (the log so far) not seen before; the problems found, in order. A
        block still open at the end (a state whose entries may go on, a scan without its end) waits for the
        next call or :meth:`finish`."""
        end = text.rfind("\n") + 1
        problems: list[LogProblem] = []
        for line in text[self._offset : end].splitlines():
            self._line += 1
            problems += self._read(line)
        self._offset = max(self._offset, end)
        return problems

    def finish(self) -> list[LogProblem]:
        """Check what is still open (the log has ended)."""
        return self._close_state() + self._close_scan(None)

    def _read(self, line: str) -> list[LogProblem]:
        out: list[LogProblem] = []
        if self.alloc_makes_room is None:  # the first line: the command line, if ServerProcess wrote the log
            binary = Path(line[2:].split(" ", 1)[0]) if line.startswith("$ ") else None
            self.alloc_makes_room = binary is None or not switches_of_binary(binary).alloc_without_room.on
        if any(other in line for other in _OTHER_THREADS):
            return out  # the HTTP threads' lines carry nothing checked here and may land inside a state's list
        entry = _ENTRY.search(line)
        if entry is not None and self._state is not None:
            self._entries.append((int(entry[2]), int(entry[3]), float(entry[4])))
            self._ids.append(entry[1])
            return out
        out += self._close_state()
        out += self._cleared_slots(line)
        self._idle_pass(line)
        self._failed_load(line)
        if (m := _STATE.search(line)) is not None:
            out += self._close_scan(None)  # update follows load: the scan found nothing
            self._state = (int(m[1]), float(m[2]), float(m[3]), int(m[4]), int(m[5]), self._line)
        elif (m := _CREATED.search(line)) is not None:
            out += self._created(int(m[1]), int(m[2]))
            if m[5] is not None and (slot := _SLOT_LINE.search(line)) is not None:
                self.created.append((int(slot[2]), int(m[5])))
        elif (m := _LOOKING.search(line)) is not None:
            out += self._close_scan(None)
            self._order.appended()
            self._scan = _Scan((float(m[1]), float(m[2])))
        elif (m := _CANDIDATE.search(line)) is not None and self._scan is not None:
            self._scan.candidates.append((float(m[3]), float(m[4])))
            self._scan.spans.append((int(m[1]), int(m[2])))
        elif (m := _FOUND.search(line)) is not None:
            out += self._close_scan((float(m[1]), float(m[2])))
        elif "cache size limit reduced" in line:
            self._limit_lowered = True
        elif "cache size limit reached, removing oldest entry" in line:
            if not self._limit_lowered and self.alloc_makes_room is not False:
                out.append(LogProblem("alloc_eviction", f"log line {self._line}: update evicted for size "
                                      f"({line.split('srv', 1)[-1].strip()}) though no allocation failure lowered "
                                      "the limit: alloc saved without making room first"))  # fmt: skip
        elif "prompt cache update took" in line:
            out += self._close_scan(None)
        self._count_cycle(line)
        self._order.event(line)
        return out

    def _idle_pass(self, line: str) -> None:
        """Keep :attr:`idle`: the pass logs an idle slot, saves it, and under a unified KV clears it before the next."""
        if "saving idle slot to prompt cache" not in line and "clearing prompt with" not in line:
            return
        if (m := _SLOT_LINE.search(line)) is None:
            return
        slot = int(m[2])
        if "saving idle slot" in line:
            self.idle.append((slot, False))
        elif self.idle and self.idle[-1] == (slot, False) and self._idle_open:
            self.idle[-1] = (slot, True)
        self._idle_open = "saving idle slot" in line

    def _failed_load(self, line: str) -> None:
        """Follow a failed load (:class:`_FailedLoad`) to the cache state after it, where :meth:`_restore_failure`
        judges it."""
        if "failed to restore state with size" in line:
            if self._failed is None:  # the draft's restore failing after the target's is the same load
                self._failed = _FailedLoad(self._line, self._loading)
            return
        if self._failed is None or (slot := _SLOT_LINE.search(line)) is None:
            return
        s = int(slot[2])
        if "failed to load prompt from cache" in line:
            self._failed.slot = s
        elif "clearing prompt with" in line and s == self._failed.slot:
            self._failed.cleared = True

    def _restore_failure(self, ids: list[str], line: int) -> list[LogProblem]:
        """``restore_failure`` at the cache state after a failed load: the slot it was for was cleared
        (get_available_slot, server-context.cpp:1630-1632 at 0c1e570) and the entry is still listed (load returns
        before ``states.erase``, server-task.cpp:1833-1836)."""
        failed, self._failed = self._failed, None
        if failed is None:
            return []
        self.checked["restore_failure"] += 1
        out = []
        if failed.slot is not None and not failed.cleared:  # a log that names no slot for it says nothing here
            out.append(LogProblem("restore_failure", f"log line {line}: the load that failed at log line "
                                  f"{failed.line} left slot {failed.slot} as it was: a failed load clears the "
                                  "slot"))  # fmt: skip
        if failed.entry is not None and failed.entry not in ids:
            out.append(LogProblem("restore_failure", f"log line {line}: the entry {failed.entry} that a load failed "
                                  f"to restore at log line {failed.line} left the cache: a failed load keeps "
                                  "it"))  # fmt: skip
        return out

    def _cleared_slots(self, line: str) -> list[LogProblem]:
        """``cleared_checkpoints``: a cleared slot's next checkpoint event is a creation of checkpoint 1."""
        if _FOUND.search(line):
            self._load_pending = True
        slot = _SLOT_LINE.search(line)
        if slot is None:
            return []
        s = int(slot[2])
        if self._load_pending and slot[1].startswith("launch_slot"):
            self._load_pending = False
            self._cleared.pop(s, None)  # the entry it loaded brought its own checkpoints
        if "clearing prompt with" in line:
            self._cleared[s] = self._line
            return []
        if "context checkpoint(s) from" in line:  # a slot file's checkpoints (upstream #26004)
            self._cleared.pop(s, None)
            return []
        at = self._cleared.get(s)
        if at is None:
            return []
        event = next((e for e in _CKPT_EVENTS if e in line), None)
        created = _CREATED.search(line)
        if event is None and created is None:
            return []
        del self._cleared[s]
        self.checked["cleared_checkpoints"] += 1
        if created is not None and int(created[1]) == 1:
            return []
        what = f"created context checkpoint {created[1]}" if created is not None else event
        return [LogProblem("cleared_checkpoints", f"log line {self._line}: slot {s} was cleared at log line {at}, "
                           f"yet its next checkpoint event is \"{what}\": the clear left its checkpoints")]  # fmt: skip

    def _count_cycle(self, line: str) -> None:
        """The saves and the logged removals between two states (:data:`LOG_PROPERTIES`' ``load_transfer``)."""
        if "saving prompt with length" in line:
            self._cycle["saves"] += 1
        elif "already in the cache, skipping" in line or "exceeds cache size limit" in line or (
            "failed to allocate memory for prompt cache state" in line
        ):
            self._cycle["unsaved"] += 1
        elif "removing obsolete cached prompt" in line or "removing oldest entry" in line or _FOUND.search(line):
            self._cycle["removals"] += 1
        elif "failed to restore state with size" in line:  # the load found its entry, then kept it (:1833)
            self._cycle["removals"] -= 1

    def _transfers(self, ids: list[str], line: int) -> list[LogProblem]:
        prev, self._prev_ids = self._prev_ids, ids
        cycle, self._cycle = self._cycle, Counter()
        if prev is None:
            return []
        self.checked["load_transfer"] += 1
        problem = _transfers_problem(prev, ids, cycle)
        return [] if problem is None else [LogProblem("load_transfer", f"log line {line}: {problem}")]

    def _created(self, k: int, n: int) -> list[LogProblem]:
        self.checked["checkpoint_lists"] += 1
        if n != self.ctx_checkpoints or not 1 <= k <= n:
            return [LogProblem("checkpoint_lists", f"log line {self._line}: created context checkpoint {k} of {n} "
                               f"with --ctx-checkpoints {self.ctx_checkpoints}")]  # fmt: skip
        return []

    def _close_scan(self, found: tuple[float, float] | None) -> list[LogProblem]:
        scan, self._scan = self._scan, None
        if scan is None:
            if found is not None:  # a load whose scan was not listed: which entry it took is unknown
                self._order.unsure = self._order.unsure or "a load without its scan"
            return []
        if found is not None and not scan.candidates:  # took an entry it never listed: a version that prints no
            self._order.unsure = self._order.unsure or "a load without its candidates"  # candidates (b9093)
            return []
        if found is not None:
            self._order.loaded(scan)
            at = next((i for i, c in enumerate(scan.candidates) if _close(c, found)), None)
            # the scan walks the entries in the order the last state listed them, then this cycle's save (appended,
            # server-task.cpp:1804): known while nothing left the cache since that state
            listed = (self._prev_ids or []) if not self._cycle["removals"] else []
            self._loading = listed[at] if at is not None and at < len(listed) else None
        out = []
        if len(scan.spans) > 1:
            self.checked["no_prefix_entries"] += 1
            if (pair := scan.prefix_pair()) is not None:
                out.append(LogProblem("no_prefix_entries", f"by log line {self._line}: the cache holds an entry of "
                                      f"{pair[0]} tokens that is a prefix of another of {pair[1]} (load's scan: both "
                                      f"match the request's first {pair[0]} tokens)"))  # fmt: skip
        self.checked["load_choice"] += 1
        want = scan.upstream_pick()
        if want == found or (want is not None and found is not None and _close(want, found)):
            return out
        said = "nothing" if found is None else f"the entry with f_keep {found[0]:.3f}, f_sim {found[1]:.3f}"
        should = "nothing" if want is None else f"the entry with f_keep {want[0]:.3f}, f_sim {want[1]:.3f}"
        cands = ", ".join(f"({k:.3f}, {s:.3f})" for k, s in scan.candidates)
        return [*out, LogProblem("load_choice", f"by log line {self._line}: load took {said} where upstream's scan "
                                 f"takes {should} (slot f_keep {scan.base[0]:.3f}, f_sim {scan.base[1]:.3f}; "
                                 f"candidates (f_keep, f_sim) in order: {cands or 'none'})")]  # fmt: skip

    def _close_state(self) -> list[LogProblem]:
        state, self._state = self._state, None
        entries, self._entries = self._entries, []
        ids, self._ids = self._ids, []
        if state is None:
            return []
        n, mib, limit_mib, limit_tokens, est, line = state
        out: list[LogProblem] = self._transfers(ids, line)
        out += self._restore_failure(ids, line)
        updated = self._order.update_pops > 0 and not self._order.unsure and self._order.known
        self._order.update_pops = 0
        if len(ids) == len(entries) and self._order.known:
            self.checked["alloc_eviction"] += 1
            self.checked["update_eviction"] += updated  # a cycle in which update itself evicted
        if len(ids) == len(entries) and (order := self._order.check(ids, entries, limit_mib)) is not None:
            prop = "update_eviction" if updated and order.startswith("update removed") else "alloc_eviction"
            out.append(LogProblem(prop, f"log line {line}: {order}"))
        self.checked["limit"] += 1
        self.checked["alloc_eviction"] += 1  # an update: it evicted for size only after a lowered limit
        tokens = sum(t for t, _c, _m in entries)
        if limit_mib > 0 and mib > limit_mib + _ROUND:
            out.append(LogProblem("limit", f"log line {line}: the cache holds {mib:.3f} MiB over its limit "
                                  f"{limit_mib:.3f} MiB"))  # fmt: skip
        elif limit_tokens > 0 and tokens > est:
            out.append(LogProblem("limit", f"log line {line}: the cache's entries hold {tokens} tokens over its "
                                  f"token limit {est} (limit_tokens {limit_tokens})"))  # fmt: skip
        elif limit_mib > 0 and any(m > limit_mib + _ROUND for _t, _c, m in entries):
            big = max(m for _t, _c, m in entries)
            out.append(LogProblem("limit", f"log line {line}: an entry of {big:.3f} MiB alone exceeds the limit "
                                  f"{limit_mib:.3f} MiB"))  # fmt: skip
        self.checked["accounting"] += 1
        total = sum(m for _t, _c, m in entries)
        if n != len(entries) or abs(total - mib) > _ROUND * (len(entries) + 1):
            out.append(LogProblem("accounting", f"log line {line}: the cache state says {n} prompts, {mib:.3f} MiB; "
                                  f"it lists {len(entries)} entries of {total:.3f} MiB"))  # fmt: skip
        self.checked["checkpoint_lists"] += len(entries)
        over = [c for _t, c, _m in entries if c > self.ctx_checkpoints]
        if over:
            out.append(LogProblem("checkpoint_lists", f"log line {line}: an entry holds {max(over)} checkpoints, "
                                  f"over --ctx-checkpoints {self.ctx_checkpoints}"))  # fmt: skip
        return out


def _transfers_problem(prev: list[str], ids: list[str], cycle: Counter[str]) -> str | None:
    """What the entries that left or appeared between two states say against the logged removals and saves."""
    removed = len(set(prev) - set(ids))
    added = len(set(ids) - set(prev))
    adds = max(0, cycle["saves"] - cycle["unsaved"])
    logged = cycle["removals"]
    if added > adds:
        return f"{added} entries appeared where {adds} saves added any"
    if removed > logged:
        return f"{removed} entries left the cache where the log shows {logged} removals (obsolete, load, eviction)"
    if removed + (adds - added) < logged:  # a save reusing a freed address hides at most one removal
        return f"the log shows {logged} removals (obsolete, load, eviction) but {removed} entries left the cache"
    return None


def _close(a: tuple[float, float], b: tuple[float, float]) -> bool:
    return abs(a[0] - b[0]) < 0.001 and abs(a[1] - b[1]) < 0.001


_LAUNCH = re.compile(r"\bslot\s+\S+: id\s+(\d+) \| task \d+ \| processing task")
_RELEASE = re.compile(r"\bslot\s+\S+: id\s+(\d+) \| task -?\d+ \| stop processing: n_tokens")
_IDLE_SAVE = re.compile(r"\bslot\s+\S+: id\s+(\d+) \| task -?\d+ \| saving idle slot to prompt cache")
_BY_ID = re.compile(r"\bslot\s+\S+: id\s+(\d+) \| task -?\d+ \| selected slot by id")


def busy_slot_touches(text: str) -> tuple[int, int, list[str]]:
    """``busy_slot_untouched`` read from a ``-lv 4`` log: a slot is processing from its launch ("processing task",
    server-context.cpp:1810 at 0c1e570) to its release ("stop processing", :518), and the idle-slot pass may save
    only a slot that is not (:2417-2418, "saving idle slot to prompt cache"). A request that selects a processing slot
    by id ("selected slot by id", :1537) goes through the cache update too (:1617-1630): the registered finding
    ``busy-slot-by-id``'s exact shape, counted, not a problem. The lines are the server's main loop's, in order (the
    HTTP threads' lines are skipped). Returns the idle-pass saves checked, the finding's selections and the problems."""
    busy: set[int] = set()
    checked, finding, problems = 0, 0, []
    for line in text.splitlines():
        if any(other in line for other in _OTHER_THREADS):
            continue
        if (m := _LAUNCH.search(line)) is not None:
            busy.add(int(m.group(1)))
        elif (m := _RELEASE.search(line)) is not None:
            busy.discard(int(m.group(1)))
        elif (m := _IDLE_SAVE.search(line)) is not None:
            checked += 1
            if int(m.group(1)) in busy:
                problems.append(f"the idle-slot pass saved slot {m.group(1)} while it was processing: {line.strip()}")
        elif (m := _BY_ID.search(line)) is not None and int(m.group(1)) in busy:
            finding += 1
    return checked, finding, problems

