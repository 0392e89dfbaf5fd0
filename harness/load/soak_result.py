"""What a soak phase runs with (:class:`SoakSettings`) and what it reports (:class:`PhaseResult`, the
``--json`` record of :mod:`harness.load.soak`, one per model and phase)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from harness.load.stateless import StatelessCounts

__all__ = ["CACHE_RAM_MIB", "PhaseResult", "SoakSettings"]

CACHE_RAM_MIB = 4  # the soak's --cache-ram, small so the cache evicts under load


@dataclass(frozen=True)
class SoakSettings:
    seconds: float  # per phase
    cache_ram_mib: int = CACHE_RAM_MIB
    rss_bound_mib: float | None = None  # None: base + cache-ram + slack
    n_parallel: int = 2
    seed: int = 0
    memory_limit_mib: int | None = None  # the soaked server in a memory cgroup with this hard limit
    embedding_clients: int = 0  # embedding/rerank clients besides (harness.load.stateless; servers get --rerank)


@dataclass
class PhaseResult:
    arch: str
    faults: bool
    seconds: float = 0.0
    requests: int = 0
    errors: int = 0  # request errors (HTTP error bodies and broken connections)
    fault_errors: int = 0  # of those, while a fault was armed or by a server the fault killed
    latencies: list[float] = field(default_factory=list)
    rss_curve: list[tuple[float, int, float, int]] = field(default_factory=list)  # (t, RSS B, cache MiB, entries)
    rss_base: int = 0
    rss_bound: int = 0  # 0: not bounded (an ASan build without --rss-bound: its quarantine holds freed memory)
    asan: bool = False  # the binary links the AddressSanitizer runtime: its reports are checked instead
    sanitizer_reports: list[str] = field(default_factory=list)  # the first line of each, with its server's log
    cache_limit_mib: float = 0.0
    evictions: int = 0
    output_checks: int = 0
    near_tie_flips: int = 0  # greedy-flip-on-cache-path: a flip within BATCH_SHAPE_FLIP_GAP, cache_n > 0
    concurrent_divergences: int = 0  # concurrent-output-divergence: a flip within the bound, cache_n = 0
    decode_failure_divergences: int = 0  # explained by decode-exception-keeps-slot-tokens
    short_window_divergences: int = 0  # located in the trace: swa-restore-window-short
    # (sent at, prompt, generated, cache_n, slot, the server that answered: 1, 2, ... counting restarts)
    responses: list[tuple[float, tuple[int, ...], tuple[int, ...], int, int, int]] = field(default_factory=list)
    traces: list[str] = field(default_factory=list)  # kept libllama traces and the lines that replay and shrink them
    crashes: int = 0
    crash_details: list[str] = field(default_factory=list)
    fault_trials: int = 0  # arms that failed an allocation
    fault_times: list[float] = field(default_factory=list)  # seconds into the phase when each one fired
    fault_sites: list[str] = field(default_factory=list)  # where each one's allocation failed (faults.sites)
    decode_failed: list[tuple[int, ...]] = field(default_factory=list)  # prompts answered "decode() failed"
    fault_survived: int = 0
    memory_limit_bytes: int | None = None
    cgroup_peak_bytes: int | None = None
    oom_kills: int = 0  # the cgroup's oom_kill counter at the end of the phase (over every server of it)
    oom_programs: list[str] = field(default_factory=list)  # the request program of each OOM kill, a JSON file
    violations: list[str] = field(default_factory=list)
    stateless: StatelessCounts = field(default_factory=StatelessCounts)  # the embedding/rerank clients' requests

    def summary(self) -> dict[str, Any]:
        lat = sorted(self.latencies)

        def pct(p: float) -> float:
            return round(lat[min(len(lat) - 1, int(p * len(lat)))] * 1e3, 2) if lat else 0.0

        rss = [r for _, r, _, _ in self.rss_curve]
        cache = [c for _, _, c, _ in self.rss_curve]
        return {
            "arch": self.arch,
            "faults": self.faults,
            "seconds": round(self.seconds, 1),
            "requests": self.requests,
            "requests_per_s": round(self.requests / self.seconds, 2) if self.seconds else 0.0,
            "p50_ms": pct(0.50),
            "p99_ms": pct(0.99),
            "errors": self.errors,
            "fault_errors": self.fault_errors,
            "rss_base_bytes": self.rss_base,
            "rss_max_bytes": max(rss, default=0),
            "rss_bound_bytes": self.rss_bound,
            "asan": self.asan,
            "sanitizer_reports": self.sanitizer_reports,
            "cache_max_mib": max(cache, default=0.0),
            "cache_limit_mib": self.cache_limit_mib,
            "cache_max_entries": max((e for *_, e in self.rss_curve), default=0),
            "evictions": self.evictions,
            "output_checks": self.output_checks,
            "near_tie_flips": self.near_tie_flips,
            "concurrent_divergences": self.concurrent_divergences,
            "traces": self.traces,
            "decode_failure_divergences": self.decode_failure_divergences,
            "short_window_divergences": self.short_window_divergences,
            "crashes": self.crashes,
            "crash_details": self.crash_details[:5],
            "fault_trials": self.fault_trials,
            "fault_times_s": [round(t, 1) for t in self.fault_times],
            "fault_sites": self.fault_sites,
            "fault_survived": self.fault_survived,
            "memory_limit_bytes": self.memory_limit_bytes,
            "cgroup_peak_bytes": self.cgroup_peak_bytes,
            "oom_kills": self.oom_kills,
            "oom_programs": self.oom_programs,
            "violations": self.violations[:20],
            "stateless": self.stateless.summary(),
            "rss_curve": [[round(t, 1), r, c, e] for t, r, c, e in self.rss_curve],
        }
