"""``python -m harness gate``: the stateful properties as a CI gate.

A run prints every parameter it derived from its seed first (variant, backend, profile, seed,
commit, machines and their budgets), then one line per machine, then one line per property, then
the known findings, and ends with ``PASS``/``FAIL``. A failure prints the property, the shrunk
program (faults included as steps) ready to paste into ``python``, and one line that replays it.

The ``ci`` profile is deterministic for a seed (Hypothesis' seed is forced, the example database
is off). The ``fuzz`` profile runs more machines and many more examples, and keeps Hypothesis'
example database in ``.hypothesis/gate`` (or ``--db``) so a failure found once is replayed first.

Exit codes: 0 all properties pass, 1 a property failed, 2 usage or environment error, 3 the
target crashed (an exception escaped the modelled server).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import hypothesis.core
from hypothesis import HealthCheck, Phase, settings
from hypothesis.database import DirectoryBasedExampleDatabase
from hypothesis.stateful import run_state_machine_as_test

from harness.cli import EXIT_CRASH, EXIT_FAILED, EXIT_OK, EXIT_USAGE, UsageError

from .invariants import INVARIANTS, Violation
from .machine import MachineConfig, TargetCrash, machine_class

__all__ = ["KNOWN_FINDINGS", "GateReport", "add_arguments", "machines_for", "run", "run_gate"]

BACKENDS = ["synthetic", "llama", "llama-cpp-python-cache", "server"]

PROFILES: dict[str, dict[str, int]] = {
    "ci": {"max_examples": 300, "steps": 30},
    "fuzz": {"max_examples": 1500, "steps": 60},
}


def machines_for(variant: str, profile: str) -> list[MachineConfig]:
    """The machine configurations one gate run covers."""
    base = [
        MachineConfig(variant, "hybrid"),
        MachineConfig(variant, "hybrid", draft=True),
        MachineConfig(variant, "recurrent", kv_unified=True),
        MachineConfig(variant, "iswa"),
        MachineConfig(variant, "transformer", draft=True, kv_unified=True),
        # policy reachability: no byte limit (the token limit n_ctx = 44 evicts) and little KV room
        # (cache loads fail for lack of cells)
        MachineConfig(variant, "transformer", kv_unified=True, cache_ram=-1, n_ctx=44),
        MachineConfig(variant, "hybrid", kv_unified=True, n_slots=3, cache_ram=-1, n_ctx=44),
    ]
    if profile == "fuzz":
        base += [
            MachineConfig(variant, kind, draft=d, kv_unified=k, n_slots=n)
            for kind in ("transformer", "recurrent", "hybrid", "iswa")
            for d in (False, True)
            for k in (False, True)
            for n in (2, 3)
            if MachineConfig(variant, kind, draft=d, kv_unified=k, n_slots=n) not in base
        ]
    return base


@dataclass(frozen=True)
class KnownFinding:
    """A suspected upstream bug, modelled as upstream has it and run apart from the gate."""

    id: str
    title: str
    config: Callable[[str], MachineConfig]
    expects: frozenset[str]


KNOWN_FINDINGS: list[KnownFinding] = [
    KnownFinding(
        "busy-slot-by-id",
        "get_available_slot saves/loads the cache into a slot that is processing when the request names "
        "that slot by id (server-context.cpp:1532-1633, with slot_prompt_similarity != 0)",
        lambda v: MachineConfig(v, "hybrid", known=frozenset({"busy-slot-by-id"})),
        frozenset({"busy_slot_untouched"}),
    ),
    KnownFinding(
        "draft-kv-exhaustion",
        "a draft context with less KV room than the target: a cache load whose draft restore fails after the "
        "target restore succeeded leaves the entry without its main state (server-task.cpp:1842-1856), and a "
        "draft decode failure aborts every slot without clearing it, leaving target and draft out of step "
        "(server-context.cpp:3731, 2735)",
        lambda v: MachineConfig(v, "hybrid", draft=True, known=frozenset({"small-draft-ctx"})),
        frozenset({"load_transfer", "draft_in_step"}),
    ),
    KnownFinding(
        "swa-checkpoint-order",
        "after an SWA checkpoint restore the slot resumes at pos_max = n_tokens - 1 but the restored checkpoint "
        "is kept (invalidation erases only pos_max > pos_next), so the next checkpoint is created below it and "
        "the list is no longer ascending in n_tokens (server-context.cpp:3338-3380, 2290-2345)",
        lambda v: MachineConfig(v, "iswa", known=frozenset({"strict-swa-order"})),
        frozenset({"checkpoint_lists"}),
    ),
    KnownFinding(
        "stale-first-token-checkpoint",
        "a prompt that differs at its first token resumes at pos_next = 0, the invalidation erases only "
        "pos_max > 0, so a checkpoint of the old first token (pos_min = pos_max = 0) survives and a later "
        "prompt restores it (pos_min == 0 qualifies) onto other tokens (server-context.cpp:3331-3364)",
        lambda v: MachineConfig(v, "hybrid", known=frozenset({"no-bos"})),
        frozenset({"restore_bytes", "draft_in_step"}),
    ),
]


@dataclass
class Failure:
    property: str
    kind: str  # "violation" | "crash" | "error"
    message: str
    program: str
    replay: str
    machine: str
    steps: int


@dataclass
class MachineResult:
    config: MachineConfig
    seconds: float
    failure: Failure | None
    checked: Counter[str]
    check_seconds: Counter[str]
    peaks: list[tuple[int, int, int]]


@dataclass
class GateReport:
    variant: str
    backend: str
    profile: str
    seed: int
    commit: str
    machines: list[MachineResult] = field(default_factory=list)
    known: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)  # per-backend sections: "llama", "server", ...

    @property
    def failures(self) -> list[Failure]:
        return [m.failure for m in self.machines if m.failure is not None]

    @property
    def passed(self) -> bool:
        return not self.failures

    def properties(self) -> list[dict[str, Any]]:
        out = []
        failed = {f.property for f in self.failures}
        for name in INVARIANTS:
            examples = sum(m.checked[name] for m in self.machines)
            seconds = sum(m.check_seconds[name] for m in self.machines)
            status = "failed" if name in failed else ("passed" if examples else "not-checked")
            out.append({"name": name, "status": status, "examples": examples, "seconds": round(seconds, 3)})
        return out

    def to_json(self) -> dict[str, Any]:
        peaks = [p for m in self.machines for p in m.peaks]
        worst = max(peaks, key=lambda p: p[0] - p[1], default=None)
        return {
            "passed": self.passed,
            "variant": self.variant,
            "backend": self.backend,
            "profile": self.profile,
            "seed": self.seed,
            "commit": self.commit,
            "properties": self.properties(),
            "failures": [
                {
                    "property": f.property,
                    "kind": f.kind,
                    "message": f.message,
                    "machine": f.machine,
                    "program": f.program,
                    "replay": f.replay,
                }
                for f in self.failures
            ],
            "known_findings": self.known,
            "transient_peak": {
                "saves": len(peaks),
                "worst_excess_over_bound": 0 if worst is None else max(0, worst[0] - worst[1]),
            },
            **self.extra,
        }


def _commit() -> str:
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    try:
        out = subprocess.run(
            ["git", "-C", here, "rev-parse", "--short=12", "HEAD"], capture_output=True, text=True, timeout=10
        )
        dirty = subprocess.run(
            ["git", "-C", here, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    sha = out.stdout.strip() or "unknown"
    return sha + ("+dirty" if dirty.stdout.strip() else "")


def _program(cfg: MachineConfig, notes: Iterable[str]) -> tuple[str, int]:
    lines = [n for n in notes if n.startswith("state")]
    head = ["from properties.machine import MachineConfig, machine_class"]
    config = repr(cfg)  # resolve is not part of the repr
    if cfg.resolve is not None:
        head.insert(0, "import properties.mutants")
        config = config[:-1] + ", resolve=properties.mutants.resolve)"
    head.append(f"{cfg.class_name} = machine_class({config})")
    steps = sum(1 for n in lines if n.startswith("state.") and not n.startswith(("state.teardown", "state.state_inv")))
    return "\n".join(head + lines), steps


def run_machine(cfg: MachineConfig, cfg_settings: settings, seed: int, replay: str) -> MachineResult:
    cls = machine_class(cfg)
    cls.stats_checked.clear()
    cls.stats_seconds.clear()
    cls.peaks.clear()
    cls.llama_stats.clear()
    cls.layout_example.clear()
    t0 = time.perf_counter()
    failure: Failure | None = None
    hypothesis.core.global_force_seed = seed  # type: ignore[attr-defined]
    try:
        run_state_machine_as_test(cls, settings=cfg_settings)
    except (Violation, TargetCrash) as e:
        program, steps = _program(cfg, getattr(e, "__notes__", []))
        failure = Failure(
            e.name,
            "crash" if isinstance(e, TargetCrash) else "violation",
            e.message,
            program,
            replay,
            cfg.class_name,
            steps,
        )
    except Exception as e:  # a bug of the harness or the model itself: still a reproducible failure
        program, steps = _program(cfg, getattr(e, "__notes__", []))
        failure = Failure("crash", "error", f"{type(e).__name__}: {e}", program, replay, cfg.class_name, steps)
    finally:
        hypothesis.core.global_force_seed = None  # type: ignore[attr-defined]
    return MachineResult(
        cfg, time.perf_counter() - t0, failure, Counter(cls.stats_checked), Counter(cls.stats_seconds), list(cls.peaks)
    )


def make_settings(profile: str, db: str | None, max_examples: int | None = None) -> settings:
    p = PROFILES[profile]
    database = None
    if profile == "fuzz":
        path = db or os.path.join(".hypothesis", "gate")
        try:
            os.makedirs(path, exist_ok=True)
            probe = os.path.join(path, ".probe")
            with open(probe, "w") as f:
                f.write("")
            os.unlink(probe)
        except OSError as e:
            raise UsageError(f"example database {path!r} is not usable: {e.strerror or e}") from None
        database = DirectoryBasedExampleDatabase(path)
    return settings(
        max_examples=max_examples or p["max_examples"],
        stateful_step_count=p["steps"],
        deadline=None,
        database=database,
        report_multiple_bugs=False,
        derandomize=False,  # Hypothesis' own "ci" profile (CI=true) derandomizes; the seed must rule
        suppress_health_check=list(HealthCheck),
        phases=[Phase.explicit, Phase.reuse, Phase.generate, Phase.shrink]
        if database
        else [Phase.explicit, Phase.generate, Phase.shrink],
        print_blob=False,
    )


def run_gate(
    variant: str,
    *,
    profile: str = "ci",
    seed: int = 0,
    db: str | None = None,
    machines: list[MachineConfig] | None = None,
    max_examples: int | None = None,
    known: bool = True,
    backends: Sequence[str] = ("synthetic",),
    archs: Sequence[str] | None = None,
    cache: str = "ram",
    flavour: str = "pr",
    out: Callable[[str], None] = print,
) -> GateReport:
    """Run the gate on ``backends`` and return its report; ``out`` receives the human-readable lines."""
    cfg_settings = make_settings(profile, db, max_examples)
    report = GateReport(variant, "+".join(backends), profile, seed, _commit())
    replay = f"python -m harness gate --variant {variant} --profile {profile} --seed {seed}"
    if "synthetic" in backends:
        configs = machines if machines is not None else machines_for(variant, profile)
        out(
            f"gate: variant={variant} backend=synthetic profile={profile} seed={seed} commit={report.commit} "
            f"machines={len(configs)} max_examples={cfg_settings.max_examples} "
            f"steps={cfg_settings.stateful_step_count}"
        )
        for cfg in configs:
            r = run_machine(cfg, cfg_settings, seed, replay + " --backend synthetic")
            report.machines.append(r)
            status = "ok  " if r.failure is None else "FAIL"
            out(f"  [{status}] {cfg.class_name:<32} {sum(r.checked.values()):>7} checks {r.seconds:6.1f}s")
        if known:
            _run_known(report, variant, cfg_settings, seed, replay + " --backend synthetic")
    if "llama" in backends:
        _run_llama(report, variant, profile, seed, db, max_examples, archs, replay, out)
    if "llama-cpp-python-cache" in backends:
        _run_lcp(report, variant, cache, seed, max_examples, out)
    if "server" in backends:
        from .server_gate import run_server_backend

        run_server_backend(report, flavour, profile, seed, max_examples, out)
    _print_report(report, out)
    return report


def _run_known(report: GateReport, variant: str, cfg_settings: settings, seed: int, replay: str) -> None:
    for k in KNOWN_FINDINGS:
        kcfg = k.config(variant)
        r = run_machine(kcfg, cfg_settings, seed, replay)
        entry: dict[str, Any] = {"id": k.id, "title": k.title, "machine": kcfg.class_name}
        if r.failure is None:
            entry.update(status="not-reproduced")
        elif r.failure.property in k.expects:
            entry.update(
                status="reproduced",
                property=r.failure.property,
                message=r.failure.message,
                program=r.failure.program,
                steps=r.failure.steps,
            )
        else:
            # a failure the known-finding run did not expect is a new failure of the gate
            report.machines.append(r)
            entry.update(status="unexpected", property=r.failure.property, message=r.failure.message)
        report.known.append(entry)


def _run_llama(
    report: GateReport,
    variant: str,
    profile: str,
    seed: int,
    db: str | None,
    max_examples: int | None,
    archs: Sequence[str] | None,
    replay: str,
    out: Callable[[str], None],
) -> None:
    from fixtures.models import ARCHS

    from .llama_gate import (
        LAYOUT_FINDING,
        LLAMA_PROFILES,
        full_context_run,
        llama_machines,
        memray_figures,
        model_rows,
    )

    archs = list(archs or ARCHS)
    lp = LLAMA_PROFILES[profile]
    cfg_settings = make_settings(profile, db, max_examples or lp["max_examples"])
    cfg_settings = settings(cfg_settings, stateful_step_count=lp["steps"])
    replay = replay + " --backend llama --arch " + " ".join(archs)
    out(
        f"gate: variant={variant} backend=llama archs={','.join(archs)} profile={profile} seed={seed} "
        f"commit={report.commit} max_examples={cfg_settings.max_examples} steps={cfg_settings.stateful_step_count}"
    )
    stats: dict[str, dict[str, int]] = {}
    full: dict[str, Any] = {}
    layout_examples: list[str] = []
    for cfg in llama_machines(variant, archs):
        r = run_machine(cfg, cfg_settings, seed, replay)
        report.machines.append(r)
        mcls = machine_class(cfg)
        st = dict(mcls.llama_stats)
        layout_examples.extend(f"{cfg.class_name}: {x}" for x in mcls.layout_example)
        st["mismatches"] = int(r.failure is not None and r.failure.property == "restore_equivalence")
        stats[cfg.arch] = st
        status = "ok  " if r.failure is None else "FAIL"
        out(
            f"  [{status}] {cfg.class_name:<32} {sum(r.checked.values()):>7} checks "
            f"{st.get('restore_checks', 0):>5} restores {r.seconds:6.1f}s"
        )
    for arch in archs:
        try:
            fc = full_context_run(arch)
        except RuntimeError as e:
            f = Failure(
                "restore_equivalence",
                "error",
                str(e),
                "",
                f"python -m harness gate --backend llama --arch {arch}",
                f"full-context-{arch}",
                0,
            )
            report.machines.append(MachineResult(MachineConfig(variant, arch=arch), 0.0, f, Counter(), Counter(), []))
            continue
        full[arch] = fc
        status = "ok  " if not fc.mismatches else "FAIL"
        out(
            f"  [{status}] full context {arch:<8} n_ctx={fc.n_ctx} state={fc.state_bytes} B "
            f"partial={fc.partial_bytes} B restores={fc.restore_checks} {fc.seconds:5.1f}s"
        )
        if fc.mismatches:
            f = Failure(
                "restore_equivalence",
                "violation",
                fc.mismatches[0],
                "",
                f"python -m harness gate --backend llama --arch {arch}",
                f"full-context-{arch}",
                0,
            )
            report.machines.append(
                MachineResult(MachineConfig(variant, arch=arch), fc.seconds, f, Counter(), Counter(), [])
            )
    report.extra["llama"] = rows = model_rows(archs, stats, full)
    for arch, row in zip(archs, rows, strict=True):
        mem = memray_figures(arch)
        row["memory"] = mem.to_json()
        sp = mem.save_peak_bytes
        out(
            f"  [ok  ] memray {arch:<8} save peak master {sp['master']} B, shared {sp['shared']} B "
            f"(difference {sp['master'] - sp['shared']} B; checkpoints C = {mem.checkpoint_bytes} B), "
            f"load peak {mem.load_peak_bytes['shared']} B"
        )
    _run_draft_recovery(report, variant, archs, rows, out)
    _run_llama_native(report, variant, archs, rows, out)
    n_layout = sum(r["layout_diffs"] for r in rows)
    entry: dict[str, Any] = {
        "id": LAYOUT_FINDING.id,
        "title": LAYOUT_FINDING.title,
        "machine": "llama backend",
        "reproducer": LAYOUT_FINDING.reproducer,
        "status": "reproduced" if n_layout else "not-reproduced",
        "count": n_layout,
    }
    if layout_examples:
        entry.update(property="restore_equivalence", message=layout_examples[0])
    report.known.append(entry)


def _run_lcp(
    report: GateReport, variant: str, cache: str, seed: int, max_examples: int | None, out: Callable[[str], None]
) -> None:
    """llama-cpp-python's own prompt caches (LlamaRAMCache / LlamaDiskCache) under the generic properties."""
    from .lcp_cache import run_lcp_gate

    out(f"gate: backend=llama-cpp-python-cache cache={cache} seed={seed} commit={report.commit}")
    res = run_lcp_gate(cache, seed=seed, max_examples=max_examples, out=lambda line: out("  " + line))
    report.extra["llama_cpp_cache"] = {
        "cache": res["cache"],
        "checks": res["checks"],
        "properties": res["properties"],
        "findings": [
            {k: f[k] for k in ("name", "property", "reproducer", "title", "evidence")} for f in res["findings"]
        ],
        "out_of_scope": res["out_of_scope"],
        "seconds": res["seconds"],
    }
    for f in res["findings"]:
        report.known.append(
            {
                "id": f["name"],
                "title": f["title"],
                "machine": f"llama-cpp-python {cache} cache",
                "reproducer": f["reproducer"],
                "status": "reproduced",
                "property": f["property"],
                "message": f["evidence"],
            }
        )
    for f in res["failures"]:
        failure = Failure(
            f["property"], "violation", f["message"], f.get("program", ""), f["replay"], f.get("machine", "lcp"), 0
        )
        report.machines.append(MachineResult(MachineConfig(variant), res["seconds"], failure, Counter(), Counter(), []))


def _run_draft_recovery(
    report: GateReport, variant: str, archs: Sequence[str], rows: list[dict[str, Any]], out: Callable[[str], None]
) -> None:
    """Draft context out of KV room mid-prompt on real state: upstream fails requests, the proposal must not."""
    from .llama_gate import draft_recovery_run

    failed_upstream = 0
    for arch, row in zip(archs, rows, strict=True):
        t0 = time.perf_counter()
        upstream = draft_recovery_run(arch, recovery=False)
        failed_upstream += len(upstream["errors"])
        try:
            rec = draft_recovery_run(arch)
        except (RuntimeError, Violation) as e:
            f = Failure(
                "draft_recovery",
                "violation",
                f"{arch}: {e}",
                "",
                "python -c 'from properties.llama_gate import draft_recovery_run as r; "
                f"print(r({arch!r}))'",
                f"draft-recovery-{arch}",
                0,
            )
            report.machines.append(MachineResult(MachineConfig(variant, arch=arch), 0.0, f, Counter(), Counter(), []))
            out(f"  [FAIL] draft recovery {arch:<8} {e}")
            continue
        secs = time.perf_counter() - t0
        row["draft_recovery"] = {
            "upstream_failed_requests": len(upstream["errors"]),
            "recoveries": rec["recoveries"],
            "verified": rec["verified"],
        }
        report.machines.append(
            MachineResult(
                MachineConfig(variant, arch=arch),
                secs,
                None,
                Counter({"draft_recovery": 1, "restore_equivalence": rec["verified"]}),
                Counter({"draft_recovery": secs}),
                [],
            )
        )
        out(
            f"  [ok  ] draft recovery {arch:<8} upstream failed {len(upstream['errors'])} request(s); with the "
            f"recovery: {dict(rec['recoveries'])}, no failed request, {rec['verified']} fresh-evaluation checks "
            f"{secs:4.1f}s"
        )
    report.known.append(
        {
            "id": "draft-kv-exhaustion (real state)",
            "title": "a draft context without room for a batch the target took fails every processing request "
            "(abort_all_slots, server-context.cpp:3731); the purge/retry/resync recovery proposed in the PR's "
            "discussion serves them instead",
            "machine": "llama backend, draft of 256 cells shared by two slots",
            "status": "reproduced" if failed_upstream else "not-reproduced",
            "count": failed_upstream,
        }
    )


def _run_llama_native(
    report: GateReport, variant: str, archs: Sequence[str], rows: list[dict[str, Any]], out: Callable[[str], None]
) -> None:
    """Sweep native allocation failures through libllama's state calls and decode, per model."""
    from faults.llama_native import OPS, sweep_llama_native

    from .llama_gate import NATIVE_FINDINGS, classify_native

    seen: dict[str, list[str]] = {f.id: [] for f in NATIVE_FINDINGS}
    for arch, row in zip(archs, rows, strict=True):
        row["native_faults"] = []
        t0 = time.perf_counter()
        for op in OPS:
            rep = sweep_llama_native(arch, op)
            j = rep.to_json()
            row["native_faults"].append(j)
            for g in j["findings"]:
                known = classify_native(op, g)
                g["known_finding"] = known
                if known is not None:
                    seen[known].append(g["first_case"])
                    continue
                msg = f"{g['outcome']} at {g['site']} ({g['count']} allocations, first {g['first_case']})"
                f = Failure(
                    "native_fault",
                    "crash" if g["outcome"] in ("aborted", "crashed") else "violation",
                    msg + "\n" + g.get("stack", ""),
                    "",
                    f"python -m faults.llama_native --case {g['first_case']}",
                    f"native-{arch}-{op}",
                    0,
                )
                report.machines.append(
                    MachineResult(MachineConfig(variant, arch=arch), 0.0, f, Counter(), Counter(), [])
                )
            if rep.capped:
                out(f"  [warn] native {arch}.{op}: sweep capped at {j['allocations_swept']} allocations")
        outcomes = Counter[str]()
        for j in row["native_faults"]:
            outcomes.update(j["outcomes"])
        secs = time.perf_counter() - t0
        report.machines.append(
            MachineResult(
                MachineConfig(variant, arch=arch),
                secs,
                None,
                Counter({"native_fault": sum(outcomes.values())}),
                Counter({"native_fault": secs}),
                [],
            )
        )
        out(
            f"  [ok  ] native faults {arch:<8} "
            + " ".join(f"{k}={v}" for k, v in sorted(outcomes.items()))
            + f" {time.perf_counter() - t0:5.1f}s"
        )
    for fnd in NATIVE_FINDINGS:
        cases = seen[fnd.id]
        entry: dict[str, Any] = {
            "id": fnd.id,
            "title": fnd.title,
            "machine": "llama backend, native faults",
            "reproducer": fnd.reproducer,
            "status": "reproduced" if cases else "not-reproduced",
            "count": len(cases),
        }
        if cases:
            entry.update(
                property="native_fault",
                message="first case " + cases[0] + f" (replay: python -m faults.llama_native --case {cases[0]})",
            )
        report.known.append(entry)


def _print_report(report: GateReport, out: Callable[[str], None]) -> None:
    props = report.properties()
    if any(p["status"] != "not-checked" for p in props):
        out("properties:")
    for p in props if any(p["status"] != "not-checked" for p in props) else []:
        out(f"  {p['name']:<20} {p['status']:<12} {p['examples']:>8} checks {p['seconds']:8.3f}s")
    peaks = [p for m in report.machines for p in m.peaks]
    if peaks:
        worst = max(peaks, key=lambda p: p[0] - p[1])
        out(
            f"transient peak: {len(peaks)} saves; worst peak excess {worst[0]} B against bound {worst[1]} B "
            f"(S = {worst[2]} B)"
        )
    if report.known:
        out("known findings (reported, not failing the gate):")
        for k in report.known:
            out(f"  {k['id']}: {k['status']}" + (f" ({k['property']}: {k['message']})" if "property" in k else ""))
            if k.get("program"):
                out("    " + k["program"].replace("\n", "\n    "))
    for f in report.failures:
        out("")
        out(f"FAILED {f.property} ({f.kind}) in {f.machine}: {f.message}")
        if f.program:
            out("--- shrunk program (paste into python from the repository root) ---")
            out(f.program)
        out("--- replay ---")
        out(f"{f.replay}    # commit {report.commit}")
    out("PASS" if report.passed else "FAIL")


def _write_junit(report: GateReport, path: str) -> None:
    props = report.properties()
    suite = ET.Element(
        "testsuite",
        name=f"gate-{report.variant}",
        tests=str(len(props)),
        failures=str(sum(p["status"] == "failed" for p in props)),
    )
    for p in props:
        case = ET.SubElement(
            suite, "testcase", classname=f"gate.{report.variant}", name=p["name"], time=str(p["seconds"])
        )
        for f in report.failures:
            if f.property == p["name"]:
                el = ET.SubElement(case, "failure", message=f.message)
                el.text = f"{f.program}\n\n{f.replay}"
    ET.ElementTree(suite).write(path, encoding="unicode", xml_declaration=True)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--variant", default="shared", choices=["shared", "master"])
    parser.add_argument(
        "--backend",
        choices=BACKENDS,
        help="run one backend (default: synthetic and llama)",
    )
    parser.add_argument(
        "--arch", nargs="+", metavar="NAME", help="llama backend: the fixtures models to run (default: all five)"
    )
    parser.add_argument(
        "--cache", choices=["ram", "disk"], help="llama-cpp-python-cache backend: which cache (default: ram)"
    )
    parser.add_argument(
        "--flavour",
        choices=["master", "pr", "asan"],
        help="server backend: which llama-server build (default: pr; built and cached on first use)",
    )
    parser.add_argument("--profile", default="ci", choices=sorted(PROFILES))
    parser.add_argument("--seed", type=int, default=0, help="Hypothesis seed (default 0)")
    parser.add_argument("--db", metavar="DIR", help="example database directory (fuzz profile)")
    parser.add_argument("--max-examples", type=int, help="override the profile's examples per machine")
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON")
    parser.add_argument("--junit", metavar="PATH", help="write a JUnit XML report")


def _writable(path: str | None) -> None:
    if path is None:
        return
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d) or not os.access(d, os.W_OK):
        raise UsageError(f"cannot write {path!r}: directory {d!r} does not exist or is not writable")


def run(args: argparse.Namespace) -> int:
    _writable(args.json)
    _writable(args.junit)
    if args.max_examples is not None and args.max_examples < 1:
        raise UsageError("--max-examples must be >= 1")
    backends = [args.backend] if args.backend else ["synthetic", "llama"]
    if args.arch:
        from fixtures.models import ARCHS

        bad = [a for a in args.arch if a not in ARCHS]
        if bad:
            raise UsageError(f"unknown --arch {', '.join(bad)}; choose from {', '.join(ARCHS)}")
        if "llama" not in backends:
            raise UsageError("--arch applies to the llama backend; add --backend llama")
    if args.flavour and "server" not in backends:
        raise UsageError("--flavour applies to the server backend; add --backend server")
    if args.cache and "llama-cpp-python-cache" not in backends:
        raise UsageError("--cache applies to the llama-cpp-python-cache backend; add --backend llama-cpp-python-cache")
    report = run_gate(
        args.variant,
        profile=args.profile,
        seed=args.seed,
        db=args.db,
        max_examples=args.max_examples,
        backends=backends,
        archs=args.arch,
        cache=args.cache or "ram",
        flavour=args.flavour or "pr",
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report.to_json(), f, indent=2)
    if args.junit:
        _write_junit(report, args.junit)
    sys.stdout.flush()
    if report.passed:
        return EXIT_OK
    if any(f.kind == "crash" for f in report.failures):
        return EXIT_CRASH
    return EXIT_FAILED if report.failures else EXIT_USAGE
