"""The soak's current server (:class:`LiveServer`: replaced after a crash, its log read as it grows, the
requests sent to it) and, under ``--memory-limit``, its memory cgroup and the OOM kills it saw
(:func:`oom_killed`: a kill counted from the group's ``oom_kill`` counter and the server's SIGKILL, its request
program written beside its log)."""

from __future__ import annotations

import collections
import json
import signal
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Protocol

from harness.memlimit import MemoryCgroup
from harness.targets.llama_server import ServerProcess, proc_status

__all__ = ["PROGRAM_KEEP", "LiveServer", "OomRecord", "oom_killed", "rss_bytes"]

PROGRAM_KEEP = 256  # the requests kept per server for an OOM kill's request program



def rss_bytes(pid: int) -> int:
    """``VmRSS`` of ``pid`` in bytes (0 when the process is gone)."""
    try:
        return proc_status(pid)["VmRSS"]
    except (OSError, KeyError):  # gone, or a zombie without VmRSS
        return 0

class OomRecord(Protocol):
    """What :func:`oom_killed` records into (a soak phase's result)."""

    arch: str
    faults: bool
    oom_programs: list[str]
    violations: list[str]


class LiveServer:
    """The phase's current server (replaced after a crash) and its log reader."""

    def __init__(self, make: Callable[[], ServerProcess], cgroup: MemoryCgroup | None = None) -> None:
        self.make = make
        self.cgroup = cgroup  # the server's memory cgroup (--memory-limit), else None
        self.lock = threading.Lock()
        self.server = make()
        self.offset = 0
        self.generation = 0
        self.restarting = threading.Event()
        self.oom_seen = 0  # the cgroup's oom_kill counter when the last kill was counted
        # the requests sent to this server, in order: (seconds into the phase, client, prompt, n_predict)
        self.program: collections.deque[tuple[float, int, tuple[int, ...], int]] = collections.deque(
            maxlen=PROGRAM_KEEP
        )

    def restart(self) -> None:
        """Replace a crashed server. While this runs, the clients may reach the new server before
        its model is loaded (HTTP 503 "Loading model"): ``restarting`` and ``generation`` let them
        count that as part of the crash, not as an error with faults off."""
        self.restarting.set()
        try:
            with self.lock:
                self.server.stop()
                self.server = self.make()
                self.server.start()
                self.offset = 0
                self.generation += 1
                self.program.clear()
        finally:
            self.restarting.clear()

    def in_crash(self, gen: int) -> bool:
        """Whether a request sent at generation ``gen`` overlapped a restart."""
        return self.restarting.is_set() or self.generation != gen

    def new_log(self) -> str:
        path = self.server.log_path
        if path is None:
            return ""
        with path.open("rb") as f:
            f.seek(self.offset)
            data = f.read()
        cut = data.rfind(b"\n") + 1
        self.offset += cut
        return data[:cut].decode(errors="replace")


def oom_killed(live: LiveServer, rc: int | None, res: OomRecord) -> str | None:
    """When the server's memory cgroup counted a new OOM kill and it died of SIGKILL: what it was, and its request
    program written beside its log (a violation in either phase); else None."""
    cg = live.cgroup
    if cg is None:
        return None
    kills = cg.oom_kills()
    new, live.oom_seen = kills - live.oom_seen, kills
    if not new or rc != -signal.SIGKILL:
        return None
    log = live.server.log_path or Path(tempfile.gettempdir()) / "soak.log"
    program = log.with_name(f"{log.stem}-oom-{len(res.oom_programs) + 1}.json")
    sent = [{"at_s": at, "client": k, "prompt": list(toks), "n_predict": n} for at, k, toks, n in live.program]
    limit, peak = cg.limit(), cg.peak()
    doc = {"arch": res.arch, "faults": res.faults, "memory_limit_bytes": limit, "cgroup_peak_bytes": peak,
           "oom_kill": kills, "requests": sent}  # fmt: skip
    program.write_text(json.dumps(doc) + "\n")
    res.oom_programs.append(str(program))
    what = (f"OOM-killed under --memory-limit {(limit or 0) >> 20} MiB (SIGKILL, the cgroup's oom_kill {kills}, "
            f"peak {peak >> 20} MiB); the last {len(sent)} requests sent to this server: {program}")  # fmt: skip
    res.violations.append(f"{what} (log {live.server.log_path})")
    return what
