"""The bench's big-save case (``--only big-saves``): the save of 256 MiB to 4 GiB of checkpoints, PR against master.

The ``saves`` case measures the save's cost per checkpoint byte on small payloads (1-256 MiB in all). This
one measures it where users meet it: one slot of a ``mamba2-cN`` model holds 4 checkpoints of N = 64 ... 1024
MiB (256 MiB to 4 GiB in all, sizes from the server's own log), and a prompt sharing nothing forces the save
into the RAM cache. It is the ``oom`` scenario's ``--mode none`` (:func:`harness.backends.llama_server.oom.run_oom`):
the server in a memory cgroup whose only limit is a ceiling protecting the shared machine, so the group's peak
is the save's whole transient cost above the baseline measured right before it, and the save's time is the
request's wall time (the server's own ``prompt cache update took`` is beside it). PR #27451 says the PR's save
needs S (one state) and master's S + C: the figure with a goal is the PR's peak over S at the largest size.

Master runs as far as its estimated peak stays under :data:`MASTER_BUDGET_GIB` (the baseline, about K + 2
states, plus S + C); the sizes it skips are said in the output and in the figures' inputs. ``--quick`` runs
the smallest point (4 x 64 MiB) on both builds, about 10 s. Only when named: a full run holds up to 6.5 GiB
and takes minutes on two cores (one thread decodes 1-2 tokens/s of a 1 GiB state).
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from fixtures.gguf import CHECKPOINT_MIBS
from harness.backends.llama_server.oom import OomRun, OomSettings, run_oom
from harness.bench.framework import Budget, Figure, figure, register
from harness.errors import UsageError
from harness.memlimit import cgroup_support
from harness.trees.build import build_name, cached_binary

__all__ = ["CHECKPOINTS", "MASTER_BUDGET_GIB", "big_saves", "master_estimate_gib"]

MIB = 1 << 20
CHECKPOINTS = 4
MASTER_BUDGET_GIB = 9.0  # the machine is shared: master's S + C above its baseline stops the curve here
CEILING_GIB = 9.0  # the cgroup's only limit: the PR at 4 x 1 GiB peaks near 6.5 GiB
PEAK_GOAL = 1.10  # the PR's save peak over S at the largest size: S, with 10% for the allocator and the log


def master_estimate_gib(size_mib: int, k: int = CHECKPOINTS) -> float:
    """Master's peak at ``k`` checkpoints of ``size_mib``: a baseline of about k + 2 states (measured: 5.3 at
    4 x 1 GiB), then S + C."""
    return ((k + 2) + 1 + k) * size_mib / 1024


def _mib(n: int | None) -> float | None:
    return None if n is None else round(n / MIB, 1)


def _inputs(r: OomRun) -> dict[str, Any]:
    return {
        "model": r.model,
        "checkpoints": r.n_checkpoints,
        "checkpoint_mib": r.checkpoint_mib_log,
        "c_mib": _mib(r.c_bytes),
        "s_mib": _mib(r.s_log_bytes or r.s_bytes),
        "baseline_mib": _mib(r.baseline_bytes),
        "peak_mib": _mib(r.peak_bytes),
        "vmhwm_above_rss_mib": _mib(r.vmhwm_above_rss),
        "update_ms": r.save_update_ms,
        "outcome": r.outcome,
        "resumed": r.resumed,
        "cache_n": r.cache_n,
        "limit": f"a memory cgroup with a {CEILING_GIB:g} GiB ceiling only (oom --mode none)",
    }


@register("big-saves", "the save of 256 MiB to 4 GiB of checkpoints into the RAM cache: peak and time, PR and master",
          named_only=True)  # fmt: skip
def big_saves(b: Budget) -> list[Figure]:
    if cgroup_support() is None:
        raise UsageError("no writable memory cgroup here (v1 memory or v2 memory.max): the peak is the group's")
    binaries = {sem: cached_binary(sem) for sem in ("shared", "master")}
    missing = [sem for sem, path in binaries.items() if path is None]
    if missing:
        raise UsageError(f"no cached llama-server ({', '.join(missing)}): python -m harness build-server --semantics "
                         + missing[0])  # fmt: skip
    sizes = CHECKPOINT_MIBS[:1] if b.quick else CHECKPOINT_MIBS
    skipped = [s for s in sizes if master_estimate_gib(s) > MASTER_BUDGET_GIB]
    if skipped:
        which = ", ".join(f"{CHECKPOINTS} x {s} MiB" for s in skipped)
        b.out(f"  big-saves: master skips {which} (its save's estimated peak, "
              f"{master_estimate_gib(skipped[0]):.1f} GiB, is over {MASTER_BUDGET_GIB:g} GiB)")  # fmt: skip
    reps = b.reps(1)
    runs: dict[tuple[str, int], list[OomRun]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-big-saves-") as tmp:
        for size in sizes:
            for sem in ("shared", "master"):
                if sem == "master" and size in skipped:
                    continue
                st = OomSettings(checkpoints=CHECKPOINTS, size_mib=size, mode="none", ceiling_gib=CEILING_GIB)
                binary = binaries[sem]
                assert binary is not None
                for _ in range(reps):
                    r = run_oom(binary, build_name(sem), sem, st, Path(tmp))
                    if r.outcome != "survived" or r.peak_above_baseline is None or r.save_wall_s is None:
                        raise UsageError(f"big-saves: {sem} at {CHECKPOINTS} x {size} MiB: {r.outcome} "
                                         f"({'; '.join(r.notes)})")  # fmt: skip
                    runs.setdefault((sem, size), []).append(r)
                    b.out(f"  big-saves: {sem:<6} C {r.c_bytes / MIB:6.0f} MiB, S {r.s_bytes / MIB:5.0f} MiB: peak+ "
                          f"{r.peak_above_baseline / MIB:6.0f} MiB above {r.baseline_bytes / MIB:.0f}, save "
                          f"{r.save_wall_s:.1f} s (update {r.save_update_ms} ms), resumed {r.resumed}")  # fmt: skip
    return _figures(runs, skipped)


def _figures(runs: dict[tuple[str, int], list[OomRun]], skipped: list[int]) -> list[Figure]:
    out: list[Figure] = []
    for (sem, _), rs in runs.items():
        c = round(rs[0].c_bytes / MIB)
        inputs = _inputs(rs[0])
        out.append(figure(f"{sem} save peak, C {c} MiB", "MiB", [(r.peak_above_baseline or 0) / MIB for r in rs],
                          better="lower", **inputs,
                          how="the cgroup's peak during the save above its usage before it"))  # fmt: skip
        out.append(figure(f"{sem} save time, C {c} MiB", "s", [r.save_wall_s or 0.0 for r in rs], better="lower",
                          **inputs, how="the request that forces the save, its wall time"))  # fmt: skip
    largest = max(size for sem, size in runs if sem == "shared")
    pr = runs[("shared", largest)]
    out.append(figure(
        f"shared save peak / S, C {round(pr[0].c_bytes / MIB)} MiB", "ratio",
        [(r.peak_above_baseline or 0) / (r.s_log_bytes or r.s_bytes) for r in pr], better="lower",
        goal=("<=", PEAK_GOAL), s_mib=_mib(pr[0].s_log_bytes or pr[0].s_bytes),
        how="PR #27451: a save into the RAM cache needs S bytes transiently (master's S + C)",
    ))  # fmt: skip
    masters = [size for sem, size in runs if sem == "master"]
    if masters:
        m = runs[("master", max(masters))]
        sc = (m[0].s_log_bytes or m[0].s_bytes) + m[0].c_bytes
        out.append(figure(
            f"master save peak / (S + C), C {round(m[0].c_bytes / MIB)} MiB", "ratio",
            [(r.peak_above_baseline or 0) / sc for r in m], better="lower", s_plus_c_mib=_mib(sc),
            master_skipped_mib=[CHECKPOINTS * s for s in skipped],
            how="master deep-copies the checkpoints into the entry: S + C",
        ))  # fmt: skip
        shared = runs.get(("shared", max(masters)))
        if shared:
            out.append(figure(
                f"master / shared save peak, C {round(m[0].c_bytes / MIB)} MiB", "ratio",
                [(x.peak_above_baseline or 0) / (y.peak_above_baseline or 1) for x, y in zip(m, shared, strict=False)],
                better="lower", how="the same save's peak on both builds",
            ))  # fmt: skip
    return out
