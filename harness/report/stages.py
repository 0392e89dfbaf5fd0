"""``python -m harness report``'s work: the stages that measure, in order, and the files they leave.

:func:`build_report` runs each stage (a progress line when it starts and when it ends; a stage that
would start after the time budget is spent is skipped and says so), collects every figure into one
dict (``report.json``) and writes the page (:mod:`harness.report.page`), the memray captures (``.bin``)
and their flame graphs next to it. A stage that fails with a :class:`~harness.errors.HarnessError`
(a server that will not start, a model that will not load) is recorded as failed with its one line;
the other stages still run, and the page says which stage failed.

The stages: ``builds`` (both pinned llama-servers, or the user's tree for its own semantics);
``breakdown`` first, the figures the issue asks to explain: the server's peak on the gate's own
configuration with a diverging prompt that creates no checkpoint and one that creates two, beside the
gate's :func:`save_peak`; ``saves-count`` and ``saves-size`` (:func:`harness.report.saves.save_curve`
on every layer, both semantics); ``charge``; ``limit`` (both servers save big checkpoints under
``baseline + S + C/2`` in a memory cgroup and under RLIMIT_AS,
:func:`harness.backends.llama_server.oom.run_oom`: 4 x 64 MiB in ``--quick``, up to 4 x 256 MiB in the full
report); ``update-cost``, ``flames``, ``sweep``, ``mutants`` and ``findings``. The cheap ones (seconds, no
server) run even when the budget is spent.

Size: ``build_report`` is the list of stages; each stage is a small closure over the options, so the
list reads top to bottom as the page does.
"""

from __future__ import annotations

import json
import platform
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

from faults.sweep import run_sweep
from harness.backends.llama_server.memory import save_peak
from harness.backends.llama_server.oom import OomSettings, expected, run_oom
from harness.errors import HarnessError, UsageError
from harness.findings import FINDINGS, history_of
from harness.memlimit import cgroup_support
from harness.model.semantics import get_semantics
from harness.report.flame import flame_svg
from harness.report.page import render
from harness.report.saves import (
    allocator_control,
    charge_run,
    checkpoint_size,
    save_curve,
    server_point,
    server_update_cost,
    update_cost,
)
from harness.trees.build import PINNED_COMMIT
from harness.trees.choose import ServerChoice
from properties.mutants import MUTANTS
from properties.run import commit

__all__ = ["SEMS", "Options", "build_report"]

SEMS = ("master", "shared")


@dataclass(frozen=True)
class Plan:
    """The points each stage measures."""

    counts: tuple[int, ...]
    sizes: tuple[int, ...]
    server_counts: tuple[int, ...]
    server_sizes: tuple[int, ...]
    diverging: tuple[int, ...]
    mutants: tuple[str, ...]
    limits: tuple[tuple[int, int], ...] = ((64, 4),)  # (one checkpoint's MiB, checkpoints) saved under a limit


QUICK = Plan(
    counts=(1, 4, 16),
    sizes=(checkpoint_size(8), checkpoint_size(128), checkpoint_size(512)),
    server_counts=(1, 8),
    server_sizes=(checkpoint_size(8), checkpoint_size(512)),
    diverging=(3, 300),
    mutants=("deep-copy-on-insert",),
    limits=((64, 4),),
)
FULL = Plan(
    counts=(1, 2, 4, 8, 12, 16),
    sizes=tuple(checkpoint_size(d) for d in (8, 32, 128, 512, 2048, 8192)),
    server_counts=(1, 2, 4, 8, 12, 16),
    # the 64 MiB model decodes at ~1 token/s on a loaded 2-core host, in the server and the model both
    server_sizes=tuple(checkpoint_size(d) for d in (8, 32, 128, 512, 2048)),
    diverging=(3, 60, 300),
    mutants=tuple(MUTANTS),
    limits=((64, 4), (256, 4)),
)


@dataclass
class Options:
    out: Path
    quick: bool = False
    backends: tuple[str, ...] = ("llama", "server")
    # each semantics' llama-server, in SEMS's order: the pinned builds unless --source/--server-bin stands for one
    servers: tuple[ServerChoice, ...] = tuple(ServerChoice(sem) for sem in SEMS)
    budget: float = 3600.0
    reps: int = 1
    mutants_json: Path | None = None
    command: str = ""
    binaries: dict[str, Path] = field(default_factory=dict)
    # harness.commands.mutants.kill (a command's helper: passed in, the commands are a floor above)
    kill: Callable[..., dict[str, Any]] | None = None
    plan: Plan | None = None  # the points to measure; None: QUICK or FULL


def _builds(opts: Options, log: Callable[[str], None]) -> dict[str, Any]:
    """Each semantics' llama-server built (or reused) as chosen, into ``opts.binaries``; what the page says of it.
    A ``--server-bin`` runs as it was given (its path as typed, not checked here: a binary that will not run fails
    the stages that run it, as the report always did)."""
    out: dict[str, Any] = {}
    for choice in opts.servers:
        if choice.binary is not None:
            binary, said = choice.binary, "--server-bin"
        else:
            binary = choice.build(log).binary
            said = f"--source {choice.source}" if choice.source is not None else f"pinned {PINNED_COMMIT}" + (
                " + PR #27451" if choice.semantics == "shared" else "")  # fmt: skip
        opts.binaries[choice.semantics] = binary
        out[choice.semantics] = {"binary": str(binary), "from": said}
    return out


def _environment(opts: Options) -> dict[str, Any]:
    def ver(name: str) -> str:
        try:
            return metadata.version(name)
        except metadata.PackageNotFoundError:
            return "not installed"

    return {
        "harness commit": commit(),
        "llama.cpp (pinned)": f"{PINNED_COMMIT} as vendored by llama-cpp-python {ver('llama-cpp-python')}",
        "PR": "llama.cpp #27451 (fixtures/pr-27451.patch)",
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "memray": ver("memray"),
        "matplotlib": ver("matplotlib"),
        "hypothesis": ver("hypothesis"),
        "numpy": ver("numpy"),
        "seed": "0 (sweep, mutants); models fixtures seed 0",
        "mode": "quick" if opts.quick else "full",
        "rerun": opts.command,
        "machine": "measured on a shared, loaded machine unless said otherwise: times are indicative, peaks are not",
    }


def _mutants(opts: Options, names: tuple[str, ...], progress: Callable[[str], None]) -> dict[str, Any]:
    """The mutation matrix: from ``--mutants-json`` (``python -m harness mutants --json``) or run here."""
    if opts.mutants_json is not None:
        try:
            rows = json.loads(opts.mutants_json.read_text())["mutants"]
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UsageError(f"--mutants-json {opts.mutants_json}: not a mutants JSON ({e})") from None
        return {"source": f"from {opts.mutants_json} (python -m harness mutants --json)", "rows": rows}
    if opts.kill is None:
        return {"source": "not run", "rows": []}
    rows = []
    for name in names:
        progress(f"mutants: {name}")
        rows.append(opts.kill(name, seed=0, max_examples=50 if opts.quick else 300))
    left = len(MUTANTS) - len(names)
    return {
        "source": f"ran {len(names)} of {len(MUTANTS)} mutants here (seed 0"
        + (", 50 examples: --quick runs only the mutant of the PR's memory claim; the full matrix is "
           "python -m harness mutants --json PATH, shown with --mutants-json PATH)" if left else ")"),
        "rows": rows,
    }  # fmt: skip


def _summary(report: dict[str, Any]) -> list[str]:
    out: list[str] = []
    rows = report.get("breakdown", {}).get("rows", [])
    by = {(r["semantics"], r["n_diverging"]): r for r in rows}
    for sem in SEMS:
        full = max((n for s, n in by if s == sem), default=None)
        if full is None:
            continue
        r = by[(sem, full)]
        mb = {k: f"{r[k] / 1e6:.2f} MB" for k in ("checkpoint_bytes", "state_bytes", "peak_bytes", "predicted_bytes",
                                                    "predicted_request_bytes")}  # fmt: skip
        out.append(
            f"{sem}: one save of a slot with {r['n_checkpoints']} checkpoints (C = {mb['checkpoint_bytes']}, "
            f"S = {mb['state_bytes']}): llama-server VmHWM {mb['peak_bytes']}; the model predicts "
            f"{mb['predicted_bytes']} for the save and {mb['predicted_request_bytes']} for the whole request "
            f"({r['request_checkpoints']} checkpoints created after the save)"
        )
    limited = report.get("limit", {}).get("rows", [])
    if limited:
        big = max(limited, key=lambda r: r["c_bytes"])
        said = [
            f"{r['semantics']} {r['mode']} {r['outcome']}" + (", resumed from the cache" if r["resumed"] else "")
            for r in limited
            if r["model"] == big["model"]
        ]
        out.append(
            f"under a memory limit of baseline + S + C/2 ({big['n_checkpoints']} checkpoints of "
            f"{big['checkpoint_mib_log']:.0f} MiB): " + "; ".join(said)
        )
    for line in report.get("breakdown", {}).get("explanation", [])[:1]:
        out.append(line)
    llama = [r for r in report.get("saves", {}).get("counts", []) if r["layer"] == "llama"]
    if llama:
        n = max(r["n_checkpoints"] for r in llama)
        at = {r["semantics"]: r for r in llama if r["n_checkpoints"] == n}
        out.append(
            f"libllama under memray, one save with {n} checkpoints: "
            + ", ".join(
                f"{sem} {r['peak_bytes'] / 1e6:.2f} MB (model {r['predicted_bytes'] / 1e6:.2f} MB + the harness's "
                f"2 S = {(r['predicted_bytes'] + r['harness_copies']) / 1e6:.2f} MB)"
                for sem, r in sorted(at.items())
            )
        )
    return out


def build_report(opts: Options, progress: Callable[[str], None] = print) -> dict[str, Any]:
    """Run every stage within ``opts.budget`` seconds, write the page and ``report.json``; return the dict."""
    t_start = time.monotonic()
    plan = opts.plan or (QUICK if opts.quick else FULL)
    out = opts.out
    caps = out / "captures"
    caps.mkdir(parents=True, exist_ok=True)
    logs = str(out / "logs")
    Path(logs).mkdir(exist_ok=True)
    report: dict[str, Any] = {"version": 1, "quick": opts.quick, "stages": [], "command": opts.command}
    report["environment"] = _environment(opts)
    server = "server" in opts.backends
    llama = "llama" in opts.backends

    def saves(kind: str) -> None:
        rows: list[dict[str, Any]] = []
        counts, sizes = (plan.counts, ()) if kind == "counts" else ((), plan.sizes)
        s_counts, s_sizes = (plan.server_counts, ()) if kind == "counts" else ((), plan.server_sizes)
        for sem in SEMS:
            if llama:
                got = save_curve("llama", sem, counts=counts, sizes=sizes, reps=opts.reps, capture_dir=caps,
                                 progress=progress)  # fmt: skip
                rows += got
                rows += [{**r, "layer": "model", "peak_bytes": r["predicted_bytes"],
                          "theory_bytes": r["theory_bytes"] - r["harness_copies"], "save_seconds": None}
                         for r in got]  # fmt: skip
            else:
                rows += save_curve("model", sem, counts=counts, sizes=sizes, reps=opts.reps, progress=progress)
            if server:
                rows += save_curve("server", sem, counts=s_counts, sizes=s_sizes, reps=opts.reps,
                                   binary=opts.binaries[sem], log_dir=logs, progress=progress)  # fmt: skip
        report.setdefault("saves", {})[kind] = rows

    def breakdown() -> None:
        rows = []
        for sem in SEMS:
            for n in plan.diverging:
                progress(f"breakdown {sem}: gate configuration, {n}-token prompt after the save")
                rows.append(server_point(opts.binaries[sem], sem, n_diverging=n, log_dir=logs))
        gate = {sem: save_peak(opts.binaries[sem], sem, log_dir=logs) for sem in SEMS}
        alloc = {}
        for sem in SEMS:
            progress(f"breakdown {sem}: one-checkpoint save, glibc's malloc default and with a fixed mmap threshold")
            alloc[sem] = allocator_control(opts.binaries[sem], sem, log_dir=logs)
        explanation = _explain(rows, gate, alloc)
        report["breakdown"] = {"rows": rows, "gate": gate, "allocator": alloc, "explanation": explanation}

    def limit() -> None:
        modes = ("cgroup", "rlimit") if cgroup_support() is not None else ("rlimit",)
        rows = []
        for size, k in plan.limits:
            for sem in SEMS:
                for mode in modes:
                    progress(f"limit {sem} {mode}: {k} checkpoints of {size} MiB under baseline + S + C/2")
                    r = run_oom(opts.binaries[sem], sem, sem, OomSettings(checkpoints=k, size_mib=size, mode=mode),
                                Path(logs))  # fmt: skip
                    rows.append({**r.to_json(), "expected": expected(sem, mode)})
        report["limit"] = {"rows": rows, "modes": list(modes), "cgroup": cgroup_support() is not None}

    def charge() -> None:
        report["charge"] = {
            sem: charge_run(sem, binary=opts.binaries.get(sem) if server else None, log_dir=logs, progress=progress)
            for sem in SEMS
        }

    def updates() -> None:
        report["update_cost"] = {sem: update_cost(sem, capture=caps / f"update-{sem}.bin") for sem in SEMS}
        if server:
            for sem in SEMS:
                progress(f"update-cost {sem}: llama-server, speculative decoding on mamba-big")
                report["update_cost"][sem].update(server_update_cost(opts.binaries[sem], sem, log_dir=logs))
        report["update_note"] = UPDATE_NOTE

    def sweep() -> None:
        res = {}
        for sem in SEMS:
            rep = run_sweep(get_semantics(sem), ("transient", "persistent"))
            scen: dict[str, Any] = {}
            for c in rep.cases:
                row = c.row()
                s = scen.setdefault(str(row["scenario"]), {"points": 0, "trials": 0, "outcomes": {}})
                s["trials"] += 1
                s["points"] += bool(row["fired"])
                s["outcomes"][str(row["outcome"])] = s["outcomes"].get(str(row["outcome"]), 0) + 1
            sm = rep.summary()
            res[sem] = {"summary": sm, "scenarios": scen, "line": (
                f"swept {sm['points']} allocation points in {sm['trials']} trials: {sm['violations']} violations, "
                f"{sm['crashes']} crashes, {sm['crashes_out_of_scope']} crashes outside the PR's scope; replay one "
                f"with python -m harness sweep --semantics {sem} --case ID")}  # fmt: skip
        report["sweep"] = res

    def mutants() -> None:
        report["mutants"] = _mutants(opts, plan.mutants, progress)

    def findings() -> None:
        report["findings"] = [
            {"id": f.id, "backend": f.backend, "property": f.property, "title": f.title, "detail": f.detail,
             "reproducer": f.reproducer, "history": history_of(f.id)}
            for f in FINDINGS.values()
        ]

    def flames() -> None:
        report["flames"] = [
            {"title": f"{sem} save ({c.stem})", "capture": f"captures/{c.name}", "svg": flame_svg(c, title=c.stem)}
            for sem in SEMS
            for c in sorted(caps.glob(f"save-{sem}-mamba-big-n*-r0.bin"))[-1:]
        ] + [
            {"title": f"{sem}: {c.stem}", "capture": f"captures/{c.name}", "svg": flame_svg(c, title=c.stem)}
            for sem in SEMS
            for c in [caps / f"update-{sem}.bin"]
            if c.is_file()
        ]

    # (name, wanted, cheap, run): a cheap stage (seconds, no server) runs even when the budget is spent
    stages: list[tuple[str, bool, bool, Callable[[], None]]] = [
        ("builds", server, True, lambda: report.__setitem__("builds", _builds(opts, progress))),
        ("breakdown", server, False, breakdown),
        ("saves-count", True, False, lambda: saves("counts")),
        ("saves-size", True, False, lambda: saves("sizes")),
        ("charge", True, False, charge),
        ("limit", server, False, limit),
        ("update-cost", True, True, updates),
        ("flames", llama, True, flames),
        ("sweep", True, True, sweep),
        ("mutants", True, False, mutants),
        ("findings", True, True, findings),
    ]
    for i, (name, wanted, cheap, fn) in enumerate(stages, 1):
        elapsed = time.monotonic() - t_start
        if not wanted:
            report["stages"].append({"name": name, "status": "skipped", "seconds": 0.0, "note": "backend not selected"})
            continue
        if elapsed > opts.budget and not cheap:
            report["stages"].append({"name": name, "status": "skipped", "seconds": 0.0,
                                     "note": f"time budget of {opts.budget:.0f} s spent"})  # fmt: skip
            progress(f"[report {i}/{len(stages)}] {name}: skipped (budget of {opts.budget:.0f} s spent)")
            continue
        progress(f"[report {i}/{len(stages)}] {name} ({elapsed:.0f} s so far)")
        t0 = time.monotonic()
        try:
            fn()
            status, note = "ok", ""
        except HarnessError as e:
            if name == "builds":
                raise
            status, note = "failed", str(e)
        except KeyboardInterrupt:
            # what the stages before measured is kept: the page and report.json are written, then Ctrl-C goes on
            report["stages"].append({"name": name, "status": "interrupted", "seconds": 0.0, "note": "Ctrl-C"})
            _write(report, out, t_start)
            raise
        except Exception as e:  # a measurement that broke: one line on the page, the other stages still run
            status, note = "failed", f"{type(e).__name__}: {e}".splitlines()[0]
        if status == "failed":
            progress(f"[report {i}/{len(stages)}] {name} failed: {note}")
        dt = time.monotonic() - t0
        report["stages"].append({"name": name, "status": status, "seconds": round(dt, 1), "note": note})
        progress(f"[report {i}/{len(stages)}] {name} {status} in {dt:.1f} s")
    _write(report, out, t_start)
    return report


def _write(report: dict[str, Any], out: Path, t_start: float) -> None:
    report["seconds"] = round(time.monotonic() - t_start, 1)
    report["summary"] = _summary(report)
    (out / "report.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    (out / "report.html").write_text(render(report))


UPDATE_NOTE = (
    "common_prompt_checkpoint::update_tgt (common/common.cpp:2288 @ 0c1e570) on real libllama state, repeated on "
    "one checkpoint of mamba-big (as the speculative checkpoint spec_ckpt is updated every draft round): master "
    "resizes its vector to the same size and reads the state into it, the PR allocates a fresh shared buffer each "
    "time and frees the old one. 'model' counts the payload allocations on the ledger; memray counts every "
    "allocation in this process (both sides also pay the harness's ctypes buffer and Python bytes of the state "
    "read, about 2 allocations of the checkpoint size per update); minor faults from getrusage; time per update "
    "includes the harness's digest of the state. 'server_' figures: a real llama-server generating with the draft "
    "model on mamba-big, where every draft round updates the slot's speculative checkpoint of the target "
    "(spec_ckpt.update_tgt): minor page faults and time per generated token, VmHWM growth over the request. "
    "glibc's dynamic mmap threshold lets the PR's fresh 1 MiB buffer reuse the one it just freed, so its faults "
    "stay a few per round. Measured on a loaded 2-core machine."
)


def _explain(
    rows: list[dict[str, Any]], gate: dict[str, dict[str, int]], alloc: dict[str, dict[str, Any]] | None = None
) -> list[str]:
    by = {(r["semantics"], r["n_diverging"]): r for r in rows}
    lines = [
        "The gate's figure (save_peak) is VmHWM minus VmRSS around the request whose slot selection makes the save. "
        "That request goes on to process its own prompt after the save (server-context.cpp:1617-1637, then "
        "update_slots), and a 300-token prompt leaves two context checkpoints on the way, at n - 68 and n - 4 "
        "(server-context.cpp:3540-3615 @ 0c1e570), each the size of mamba-big's recurrent state (1.07 MB). "
        "Under the PR the slot's old checkpoints are not freed when the slot moves on (the new cache entry holds "
        "them), so the two new buffers add to the peak: S + 2 c. Under master the slot's own copies are freed "
        "first, so the same two buffers fit in memory the save's copy already counted: the peak stays S + C.",
    ]
    for sem in SEMS:
        g = gate.get(sem)
        big = by.get((sem, 300))
        small = by.get((sem, 3))
        if g and big:
            lines.append(
                f"{sem}: the gate's save_peak measured {g['rss_peak_bytes'] / 1e6:.2f} MB against the save's "
                f"prediction {g['model_peak_bytes'] / 1e6:.2f} MB; the model of the whole request predicts "
                f"{big['predicted_request_bytes'] / 1e6:.2f} MB (save {big['predicted_bytes'] / 1e6:.2f} MB + "
                f"{big['request_checkpoints']} new checkpoints {big['request_checkpoint_bytes'] / 1e6:.2f} MB), "
                f"measured here {big['peak_bytes'] / 1e6:.2f} MB"
                + (
                    f"; with a 3-token prompt, which creates no checkpoint, the same save measures "
                    f"{small['peak_bytes'] / 1e6:.2f} MB against the save's {small['predicted_bytes'] / 1e6:.2f} MB "
                    f"({'S + C' if sem == 'master' else 'S'})"
                    if small
                    else ""
                )
                + ". What remains unmodelled (allocator rounding to pages, the HTTP response, the batch) is "
                f"{(big['peak_bytes'] - big['predicted_request_bytes']) / 1e6:.3f} MB."
            )
    if all(k in by for k in (("master", 3), ("shared", 3))):
        m, p = by[("master", 3)], by[("shared", 3)]
        if m["save_seconds"] is not None and p["save_seconds"] is not None:
            lines.append(
                f"The save itself (the server's log, slot selection to the cache lookup after the save): master "
                f"{m['save_seconds'] * 1e3:.1f} ms and {m['minflt']} minor page faults in the request, the PR "
                f"{p['save_seconds'] * 1e3:.1f} ms and {p['minflt']} (master touches every page of its copy of C)."
            )
    if alloc:
        parts = [
            f"{sem} {a['default_residual_checkpoints']:+.2f} c with glibc's default malloc, "
            f"{a['fixed_mmap_threshold_residual_checkpoints']:+.2f} c with MALLOC_MMAP_THRESHOLD_=65536"
            for sem, a in alloc.items()
        ]
        lines.append(
            "The allocator, a named line: with one checkpoint per slot the measured request peak exceeds the "
            "model's by " + "; ".join(parts) + " (c = one checkpoint). glibc raises its mmap threshold to the size "
            "of the last freed mapped chunk, so once the slot's old checkpoint is freed, later checkpoint-sized "
            "buffers come from the heap, where a freed chunk stays resident; the model frees it at once. With a "
            "fixed threshold every such buffer is its own mapping, returned when freed, and the residual is gone: "
            "it is the allocator's, not a copy the model misses."
        )
    return lines


def command_line(argv: list[str]) -> str:
    return "python -m harness report " + " ".join(shlex.quote(a) for a in argv)
