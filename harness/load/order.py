"""The order a real ``llama-server`` took, read from its log at ``-lv 4``.

Mirrors the log lines of llama.cpp 0c1e570's tools/server (``SLT_*``/``SRV_*`` macros,
server-common.h:27-34): ``get_available_slot`` ("selected slot by id|LCP similarity|LRU",
server-context.cpp:1537, 1582, 1609), ``launch_slot_with_task`` ("processing task"),
the prompt start ("new prompt, ... task.n_tokens = N"), ``server_slot::prompt_save`` ("saving
prompt with length N", :268), ``server_prompt_cache::load`` looking at each entry ("looking for
better prompt", "prompt with length N, lcp = L", server-task.cpp:1799, 1810) and taking one ("found better
prompt", :1826), the timing print ("eval time = ... / D tokens"),
``server_slot::release`` ("stop processing: n_tokens = M"), and the cache's
``server_prompt_cache::update`` ("cache state: N prompts, X MiB (limits: L MiB", server-task.cpp:1894)
and evictions ("removing oldest entry", :1753, 1873, 1887).

:func:`parse_log` turns the log into :class:`Event` rows in log order (the main loop writes them
from one thread, so log order is the order the server took); :func:`tasks` sums up each task
(slot, prompt length, tokens decoded) so a response can be matched to its task.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = ["LOG_PREFIX", "STATE_LINE", "CacheState", "Event", "TaskInfo", "cache_states", "parse_log", "tasks"]

LOG_PREFIX = re.compile(r"^(\d+)\.(\d+)\.(\d+)\.(\d+) [A-Z] (slot|srv) +(\S+): (?:id +(\d+) \| task (-?\d+) \| )?(.*)$")
_SELECT = re.compile(r"selected slot by (id|LCP similarity|LRU)")
_PROMPT = re.compile(r"new prompt, .*task\.n_tokens = (\d+)")
_SAVE = re.compile(r"saving prompt with length (\d+)")
_EVAL = re.compile(r"^\s+eval time = .*/\s*(\d+) tokens")
_RELEASE = re.compile(r"stop processing: n_tokens = (\d+)")
_LOOKUP = re.compile(r"looking for better prompt, base (f_keep = -?[\d.]+, f_sim = [\d.]+)")
_ENTRY = re.compile(r"^\s*- prompt with length\s+(\d+), lcp =\s+(\d+),")
_LOAD = re.compile(r"found better prompt with (f_keep = [\d.]+, f_sim = [\d.]+)")
STATE_LINE = re.compile(r"cache state: (\d+) prompts, ([\d.]+) MiB \(limits: ([\d.]+) MiB")


@dataclass(frozen=True)
class Event:
    """``kind``: select (``how`` id/LCP/LRU), launch, prompt (``n``), save (``n``), lookup (``how``: the
    slot's own f_keep and f_sim for the new prompt), entry (a cached prompt looked at: ``n`` tokens,
    ``lcp`` shared with the new prompt), load (``how``: the f_keep and f_sim of the entry taken),
    eval (``n``), release (``n``), idle-save, evict, state; ``t`` seconds since the server started."""

    kind: str
    t: float
    slot: int = -1
    task: int = -1
    n: int = 0
    how: str = ""
    lcp: int = -1


def _time(m: re.Match[str]) -> float:
    return int(m.group(1)) * 60 + int(m.group(2)) + int(m.group(3)) / 1e3 + int(m.group(4)) / 1e6


def parse_log(text: str) -> list[Event]:
    out: list[Event] = []
    for line in text.splitlines():
        m = LOG_PREFIX.match(line)
        if m is None:
            continue
        t = _time(m)
        slot = int(m.group(7)) if m.group(7) is not None else -1
        task = int(m.group(8)) if m.group(8) is not None else -1
        msg = m.group(9)
        if sel := _SELECT.search(msg):
            out.append(Event("select", t, slot, task, how=sel.group(1).split()[0]))
        elif "processing task" in msg:
            out.append(Event("launch", t, slot, task))
        elif p := _PROMPT.search(msg):
            out.append(Event("prompt", t, slot, task, int(p.group(1))))
        elif s := _SAVE.search(msg):
            out.append(Event("save", t, n=int(s.group(1))))
        elif lk := _LOOKUP.search(msg):
            out.append(Event("lookup", t, how=lk.group(1)))
        elif en := _ENTRY.search(msg):
            out.append(Event("entry", t, n=int(en.group(1)), lcp=int(en.group(2))))
        elif ld := _LOAD.search(msg):
            out.append(Event("load", t, how=ld.group(1)))
        elif e := _EVAL.search(msg):
            out.append(Event("eval", t, slot, task, int(e.group(1))))
        elif r := _RELEASE.search(msg):
            out.append(Event("release", t, slot, task, int(r.group(1))))
        elif "saving idle slot" in msg:
            out.append(Event("idle-save", t, slot, task))
        elif "removing oldest entry" in msg:
            out.append(Event("evict", t))
    return out


@dataclass
class TaskInfo:
    task: int
    slot: int
    n_prompt: int = -1
    n_decoded: int = -1


def tasks(events: list[Event]) -> dict[int, TaskInfo]:
    """Every launched task: its slot, prompt length and the tokens it decoded."""
    out: dict[int, TaskInfo] = {}
    for e in events:
        if e.kind == "launch":
            out[e.task] = TaskInfo(e.task, e.slot)
        elif e.kind == "prompt" and e.task in out:
            out[e.task].n_prompt = e.n
        elif e.kind == "eval" and e.task in out:
            out[e.task].n_decoded = e.n
    return out


@dataclass(frozen=True)
class CacheState:
    """One ``cache state`` line: entries, size and limit in MiB, seconds since the server started."""

    t: float
    entries: int
    mib: float
    limit_mib: float


def cache_states(text: str) -> list[CacheState]:
    out = []
    for line in text.splitlines():
        m = LOG_PREFIX.match(line)
        if m is None:
            continue
        s = STATE_LINE.search(m.group(9))
        if s:
            out.append(CacheState(_time(m), int(s.group(1)), float(s.group(2)), float(s.group(3))))
    return out
