"""The gate's ``llama`` backend: the same state machines on real libllama state, one model per arch.

For each tiny fixtures model (``llama``, ``mamba``, ``jamba``, ``lfm2``, ``gemma2``) this runs

* the stateful machine of :mod:`properties.machine` on :class:`~harness.targets.libllama.LlamaProvider`
  contexts (fewer examples than the synthetic backend; a draft model on the transformer and one
  hybrid), with ``restore_equivalence`` checked at the first decode after every restore, and
* the scenarios of :mod:`properties.libllama_scenarios`: one save/restore at the model's full
  context, memray figures of a save and a load per semantics, the draft-KV exhaustion recovery, and
* native allocation failures swept through libllama's state calls and ``llama_decode``
  (:mod:`faults.llama_native`), each outcome classified against the registered findings.

Every mismatch fails the gate. A difference that disappears when the very same state is decoded
from a contiguous cell layout is not a mismatch but the known finding ``kv-layout-dependent-logits``
(counted per model as ``layout_diffs``, reproducer in ``fixtures/findings/``). A difference in a
sequence whose restored K/V a deferred cross-stream ``seq_cp`` overwrote is the known finding
``cache-load-into-pending-child-copy``, and one of a token whose window the restored SWA cells no longer
cover is ``swa-restore-window-short`` (``finding_diffs``; the provider tracks both states).

The target is :mod:`harness.targets.libllama`. Campaign machines: one per fixtures model (:func:`llama_machines`),
40 steps, batch 5.

Size: ``_run_llama`` is the one place that orders the llama backend's phases (machines per model, full
context, memray, native faults, draft recovery) and their report rows.
"""

from __future__ import annotations

import shlex
import time
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from hypothesis import settings

from faults.kinds import Outcome
from faults.llama_native import OPS, sweep_llama_native
from fixtures.gguf import ARCHS, draft_path, model_path
from harness.backends.base import (
    SOURCE,
    Backend,
    Failure,
    GateOptions,
    GateReport,
    MachineResult,
    MachineSpec,
    Option,
    Out,
    Plan,
    model_spec,
)
from harness.errors import PropertyFailure, UsageError
from harness.findings import (
    DECODE_BAD_ALLOC_TERMINATES,
    DRAFT_KV_EXHAUSTION_REAL_STATE,
    FINDINGS,
    GRAPH_COMPUTE_SEGV,
    KV_LAYOUT_DEPENDENT_LOGITS,
    STATE_IO_ALLOC_OUTSIDE_TRY,
    KnownRow,
    finding,
)
from harness.targets.libllama import PENDING_CP_FINDING, SWA_WINDOW_FINDING, load_model
from harness.trees.api import loaded_libllama
from harness.trees.driver import libllama_of
from properties.libllama_scenarios import FullContextResult, draft_recovery_run, full_context_run, memray_figures
from properties.machine import MachineConfig, machine_class
from properties.run import make_settings, run_machine

__all__ = [
    "LLAMA_PROFILES",
    "LlamaBackend",
    "LlamaLib",
    "LlamaOptions",
    "LlamaSection",
    "classify_native",
    "llama_machines",
]

NATIVE_FINDINGS = [f for f in FINDINGS.values() if f.backend == "llama" and f.property == "native_fault"]


def classify_native(op: str, group: dict[str, Any]) -> str | None:
    """The known finding a native-fault group belongs to, or None (an unexpected outcome: a gate failure).

    ``site`` is where the crash's own stack first enters libllama/ggml; ``alloc_sites``, where each failed
    allocation of the group was observed to be made (:mod:`faults.sites`). ``state-io-alloc-outside-try`` is
    the io object allocated in ``llama_context::state_seq_{get,set}_data`` before its try: an abort whose
    failed allocation was made anywhere else is not that finding, whatever the abort's stack shows."""
    outcome, site = group["outcome"], group["site"]
    allocs = [a for a in group.get("alloc_sites", []) if a]
    in_io = all(a.split(":", 1)[-1].startswith("llama_context::state_seq_") for a in allocs)
    if op != "decode" and outcome == Outcome.ABORTED and "state_seq_" in site and in_io:
        return STATE_IO_ALLOC_OUTSIDE_TRY.id
    if op == "decode" and outcome == Outcome.ABORTED:
        return DECODE_BAD_ALLOC_TERMINATES.id
    if op == "decode" and outcome == Outcome.KILLED and site.startswith("ggml_graph_compute"):
        return GRAPH_COMPUTE_SEGV.id
    return None


# examples per machine and steps per example on real state
LLAMA_PROFILES: dict[str, dict[str, int]] = {
    "ci": {"max_examples": 150, "steps": 25},
    "fuzz": {"max_examples": 300, "steps": 40},
}


def llama_machines(semantics: str, archs: Sequence[str] | None = None) -> list[MachineConfig]:
    """One machine per architecture; drafts on ``llama`` and ``jamba``, a unified KV on ``mamba``/``lfm2``.

    (A draft context cannot be made smaller than 256 cells per sequence in libllama, so the draft-KV
    exhaustion runs as its own scenario, :func:`draft_recovery_run`.)
    """
    out = []
    for arch in archs or ARCHS:
        out.append(
            MachineConfig(
                semantics,
                kind="",
                arch=arch,
                draft=arch in ("llama", "jamba"),
                kv_unified=arch in ("mamba", "lfm2"),
            )
        )
    return out


def model_rows(
    archs: Sequence[str], machine_stats: dict[str, Any], full: dict[str, FullContextResult]
) -> list[dict[str, Any]]:
    """The ``"llama"`` list of the gate's JSON: one object per model."""
    rows = []
    for arch in archs:
        st = machine_stats.get(arch, {})
        fc = full.get(arch)
        rows.append(
            {
                "arch": load_model(model_path(arch)).arch,
                "state_bytes": max(st.get("state_bytes", 0), fc.state_bytes if fc else 0),
                "partial_bytes": max(st.get("partial_bytes", 0), fc.partial_bytes if fc else 0),
                "restore_checks": st.get("restore_checks", 0) + (fc.restore_checks if fc else 0),
                "mismatches": st.get("mismatches", 0) + (len(fc.mismatches) if fc else 0),
                "layout_diffs": st.get("layout_diffs", 0),
                "finding_diffs": {k.split(":", 1)[1]: v for k, v in st.items() if k.startswith("finding:")},
                "restores_by": _merge(
                    {k.split(":", 1)[1]: v for k, v in st.items() if k.startswith("restores_by:")},
                    fc.restores_by if fc else {},
                ),
                "full_context": None
                if fc is None
                else {
                    "n_ctx": fc.n_ctx,
                    "state_bytes": fc.state_bytes,
                    "partial_bytes": fc.partial_bytes,
                    "seconds": round(fc.seconds, 3),
                },
            }
        )
    return rows


@dataclass(frozen=True)
class LlamaSection:
    """The llama backend's part of the gate's JSON (``llama``): one row per model (:func:`model_rows`), with
    its memray figures, draft recovery and native faults added as the run goes."""

    rows: list[dict[str, Any]]

    def to_json(self) -> dict[str, Any]:
        return {"llama": self.rows}


@dataclass(frozen=True)
class LlamaLib:
    """``llama_lib``: the libllama this run loaded (None: none was loaded)."""

    path: str | None

    def to_json(self) -> dict[str, Any]:
        return {"llama_lib": self.path}


def _merge(a: dict[str, int], b: dict[str, int]) -> dict[str, int]:
    return {k: a.get(k, 0) + b.get(k, 0) for k in sorted(set(a) | set(b))}


@dataclass(frozen=True)
class LlamaOptions:
    """The llama backend's own options (:attr:`LlamaBackend.options`); an arch that is no fixtures model is
    refused with one line."""

    archs: tuple[str, ...] | None = None  # the fixtures models to run (None: all)
    source: Path | None = None  # a llama.cpp tree whose own libllama runs

    def __post_init__(self) -> None:
        bad = [a for a in self.archs or () if a not in ARCHS]
        if bad:
            raise UsageError(f"unknown --arch {', '.join(bad)}; choose from {', '.join(ARCHS)}")


class LlamaBackend(Backend):
    name = "llama"
    options_type = LlamaOptions
    options = (
        Option("archs", "--arch", {"nargs": "+", "metavar": "NAME",
                                   "help": "the fixtures models to run (default: all five)"}),
        SOURCE,
    )

    def run(self, report: GateReport, opts: GateOptions, out: Out) -> None:
        own = opts.of(LlamaOptions)
        replay = f"python -m harness gate --semantics {opts.semantics} --profile {opts.profile} --seed {opts.seed}"
        if own.source is not None:  # the tree's own libllama, built and checked against the bindings
            out("  " + libllama_of(own.source, log=lambda m: out("  build: " + m)))
            replay += f" --source {shlex.quote(str(own.source))}"
        _run_llama(report, opts.semantics, opts.profile, opts.seed, opts.db, opts.max_examples, own.archs, replay, out)
        loaded = loaded_libllama()
        report.sections.setdefault("llama_lib", LlamaLib(str(loaded) if loaded else None))
        if loaded is not None:
            out(f"  libllama this run loaded: {loaded}")

    def campaign_machines(self, plan: Plan) -> list[MachineSpec]:
        return [model_spec(c, self.name, 40, 5) for c in llama_machines(plan.semantics, plan.archs)]

    def campaign_models(self, plan: Plan) -> tuple[frozenset[str], bool]:
        return frozenset(plan.archs or ARCHS), True


def _run_llama(
    report: GateReport,
    semantics: str,
    profile: str,
    seed: int,
    db: str | None,
    max_examples: int | None,
    archs: Sequence[str] | None,
    replay: str,
    out: Out,
) -> None:
    """Machines per model, full context, memray, draft recovery, native faults; then the layout finding."""
    archs = list(archs or ARCHS)
    # every model first: a corrupt cached one is regenerated (one line) or ends the run with one line
    # (ModelLoadError, exit 2) before any machine starts
    for arch in archs:
        model_path(arch)
    draft_path()
    lp = LLAMA_PROFILES[profile]
    cfg_settings = make_settings(profile, db, max_examples or lp["max_examples"])
    cfg_settings = settings(cfg_settings, stateful_step_count=lp["steps"])
    replay = replay + " --backend llama --arch " + " ".join(archs)
    out(
        f"gate: semantics={semantics} backend=llama archs={','.join(archs)} profile={profile} seed={seed} "
        f"commit={report.commit} max_examples={cfg_settings.max_examples} steps={cfg_settings.stateful_step_count}"
    )
    stats: dict[str, dict[str, int]] = {}
    full: dict[str, Any] = {}
    layout_examples: list[str] = []
    finding_examples: dict[str, str] = {}
    for cfg in llama_machines(semantics, archs):
        r = run_machine(cfg, cfg_settings, seed, replay)
        report.machines.append(r)
        mcls = machine_class(cfg)
        st = dict(mcls.llama_stats)
        layout_examples.extend(f"{cfg.class_name}: {x}" for x in mcls.layout_example)
        for fid, line in mcls.finding_examples.items():
            finding_examples.setdefault(fid, f"{cfg.class_name}: {line}")
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
            report.machines.append(MachineResult(MachineConfig(semantics, arch=arch), 0.0, f, Counter(), Counter(), []))
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
                MachineResult(MachineConfig(semantics, arch=arch), fc.seconds, f, Counter(), Counter(), [])
            )
    rows = model_rows(archs, stats, full)
    report.sections["llama"] = LlamaSection(rows)
    for arch, row in zip(archs, rows, strict=True):
        mem = memray_figures(arch)
        row["memory"] = mem.to_json()
        sp = mem.save_peak_bytes
        out(
            f"  [ok  ] memray {arch:<8} save peak master {sp['master']} B, shared {sp['shared']} B "
            f"(difference {sp['master'] - sp['shared']} B; checkpoints C = {mem.checkpoint_bytes} B), "
            f"load peak {mem.load_peak_bytes['shared']} B"
        )
    _run_draft_recovery(report, semantics, archs, rows, out)
    _run_llama_native(report, semantics, archs, rows, out)
    n_layout = sum(r["layout_diffs"] for r in rows)
    known = KnownRow(KV_LAYOUT_DEPENDENT_LOGITS, "llama backend",
                     "reproduced" if n_layout else "not-reproduced", count=n_layout)  # fmt: skip
    if layout_examples:
        known.property, known.message = "restore_equivalence", layout_examples[0]
    report.known.append(known)
    # restore differences the provider attributes to a known finding by the state that makes it
    for fid in (PENDING_CP_FINDING, SWA_WINDOW_FINDING):
        n = sum(r["finding_diffs"].get(fid, 0) for r in rows)
        known = KnownRow(finding(fid), "llama backend", "reproduced" if n else "not-reproduced", count=n)
        if fid in finding_examples:
            known.property, known.message = "restore_equivalence", finding_examples[fid]
        report.known.append(known)


def _run_draft_recovery(
    report: GateReport, semantics: str, archs: Sequence[str], rows: list[dict[str, Any]], out: Out
) -> None:
    """Draft context out of KV room mid-prompt on real state: upstream fails requests, the proposal must not."""
    failed_upstream = 0
    for arch, row in zip(archs, rows, strict=True):
        t0 = time.perf_counter()
        upstream = draft_recovery_run(arch, recovery=False)
        failed_upstream += len(upstream["errors"])
        try:
            rec = draft_recovery_run(arch)
        except (RuntimeError, PropertyFailure) as e:
            f = Failure(
                "draft_recovery",
                "violation",
                f"{arch}: {e}",
                "",
                f"python -c 'from properties.libllama_scenarios import draft_recovery_run as r; print(r({arch!r}))'",
                f"draft-recovery-{arch}",
                0,
            )
            report.machines.append(MachineResult(MachineConfig(semantics, arch=arch), 0.0, f, Counter(), Counter(), []))
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
                MachineConfig(semantics, arch=arch),
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
        KnownRow(
            DRAFT_KV_EXHAUSTION_REAL_STATE,
            "llama backend, draft of 256 cells shared by two slots",
            "reproduced" if failed_upstream else "not-reproduced",
            count=failed_upstream,
        )
    )


def _run_llama_native(
    report: GateReport, semantics: str, archs: Sequence[str], rows: list[dict[str, Any]], out: Out
) -> None:
    """Sweep native allocation failures through libllama's state calls and decode, per model."""
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
                msg = (
                    f"{g['outcome']} ({g['detail']}) at {g['site']} ({g['count']} allocations, first {g['first_case']}"
                    f"; failed allocation made at {', '.join(g.get('alloc_sites') or ['?'])})"
                )
                f = Failure(
                    "native_fault",
                    "violation" if g["outcome"] == Outcome.VIOLATION else "crash",
                    msg + "\n" + g.get("stack", ""),
                    "",
                    f"python -m harness native --case {g['first_case']}",
                    f"native-{arch}-{op}",
                    0,
                )
                report.machines.append(
                    MachineResult(MachineConfig(semantics, arch=arch), 0.0, f, Counter(), Counter(), [])
                )
            if rep.capped:
                out(f"  [warn] native {arch}.{op}: sweep capped at {j['allocations_swept']} allocations")
        outcomes = Counter[str]()
        for j in row["native_faults"]:
            outcomes.update(j["outcomes"])
        secs = time.perf_counter() - t0
        report.machines.append(
            MachineResult(
                MachineConfig(semantics, arch=arch),
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
        native_row = KnownRow(fnd, "llama backend, native faults", "reproduced" if cases else "not-reproduced",
                              count=len(cases))  # fmt: skip
        if cases:
            native_row.property = "native_fault"
            native_row.message = "first case " + cases[0] + f" (replay: python -m harness native --case {cases[0]})"
        report.known.append(native_row)
