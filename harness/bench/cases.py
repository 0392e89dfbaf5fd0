"""The bench's cases, one function each, registered in :data:`harness.bench.framework.CASES` (issue 17).

1. ``exploration``: examples/s of each gate machine against Hypothesis alone on the same programs
   (:mod:`harness.bench.baselines`: the machine's rules with empty bodies, its preconditions' answers
   replayed, so the same choices are drawn) under the same settings (the ``ci`` profile, same seed), in
   CPU seconds (``time.process_time``). Each arm of a repetition runs in a warmed child of its own, and
   the arms take turns of 50 ms on one CPU (:mod:`harness.bench.arms`), so that they see the same
   host. The machine is timed as the gate runs it. Beside it, the same machine with its checks off
   (``checks_on``): what a check costing nothing would give; and the machine against
   :data:`~harness.bench.baselines.TrivialMachine`, whose programs (every rule always valid) are not
   the machine's. Then one repetition at each of the next :data:`OTHER_SEEDS` seeds, where every seed
   must meet the goal: the verdict must not hang on one seed's programs.
2. ``mutants``: seconds to kill each mutant and the steps of its shrunk program (:func:`properties.mutants.kill`),
   one repetition per seed (``--seed``, ``--seed`` + 1, ...).
3. ``sweep``: the fault sweep's trials/s and its wall time, both semantics, both modes.
4. ``saves``: save time and transient peak against the checkpoint payload size, master against shared.
   Three layers (:func:`save_layers`): the model's ledger (:func:`model_save_point`), libllama in this
   process and a real llama-server, both through :func:`harness.report.saves.save_curve`. Time is that
   of warm saves (:func:`harness.report.saves.warm_saves`: the same prompt saved again after a restore,
   every size in the same heap state); the first save's, which depends on whether its pages are fresh,
   is beside it. The goal is on the libllama and server layers (:data:`SAVE_GOAL_LAYERS`).
5. ``server``: a real llama-server differential (:class:`harness.backends.llama_server.Differential`):
   requests/s with the model's prediction on, and the model's share of the time.
6. ``state-io``: libllama state get/set bytes/s against ``ctypes.memmove`` of the same bytes.
7. ``gate``: the default gate's wall time (``python -m harness gate``, builds cached); full bench only.
   ``ci``: ``.ci/run``'s wall time on a clean clone of HEAD with this host's caches warm; only when
   named (``--only ci``: half an hour).

``targeting`` (beside 3): a campaign's reach with ``hypothesis.target`` against without, same examples.

Size: eight cases, each one function with its own setup and figures and nothing shared but the
registry; a module per case would spread one table over eight files.
"""

from __future__ import annotations

import ctypes
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from hypothesis.database import InMemoryExampleDatabase

from faults.scenarios import SCENARIOS
from faults.sweep import run_sweep
from fixtures.gguf import model_path
from harness.backends.llama_server.differential import Differential
from harness.bench.arms import SLICE, run_arms
from harness.bench.framework import Budget, Figure, figure, register
from harness.campaign.machines import Plan
from harness.campaign.machines import machines as campaign_machines
from harness.campaign.runner import run_batch
from harness.child import run_child
from harness.errors import UsageError
from harness.report.saves import LAYERS, save_curve
from harness.targets.libllama import LlamaProvider, load_model
from harness.targets.llama_server import ServerConfig
from harness.trees.build import cached_binary
from properties.machine import REACH, MachineConfig, PromptCacheMachine
from properties.mutants import MUTANTS, kill
from properties.run import PROFILES, machines_for

__all__ = ["save_layers"]

MIB = 1 << 20
OTHER_SEEDS = 2  # exploration: the seeds after --seed, one repetition each, that must meet the goal too


@register("exploration", "examples/s of each gate machine against Hypothesis alone on the same programs (ci profile)")
def exploration(b: Budget) -> list[Figure]:
    profile = PROFILES["ci"]
    n = 5 if b.quick else profile["max_examples"]
    # in turns one repetition's ratio moves by ~+-0.01 on a steady host (np3: 0.762-0.785 over six); one after
    # the other in the bench's process it moved by +-0.15 (the same work took 2.9-5.1 s); harness.bench.arms
    reps = b.reps(5)
    configs = machines_for("shared", "ci")[: 1 if b.quick else None]
    runs: dict[str, list[dict[str, Any]]] = {c.class_name: [] for c in configs}
    for rep in range(reps):
        for cfg in configs:
            r = _explore(cfg, n, b.seed)
            runs[cfg.class_name].append(r)
            b.out(
                f"  rep {rep} {cfg.class_name:<34} same programs {r['replay'] / r['machine']:.2f}"
                f" ({n / r['machine']:.1f} examples/s CPU), checks off {r['replay'] / r['off']:.2f},"
                f" trivial {r['trivial'] / r['machine']:.2f}"
            )
    # the verdict must not depend on the seed: one repetition more at each of the next seeds, whose goal
    # every seed must meet (in turns, one repetition is within ~0.01-0.02 of a median of five)
    seeds = [b.seed + i for i in range(1, 2 if b.quick else OTHER_SEEDS + 1)]
    other: dict[str, list[dict[str, Any]]] = {c.class_name: [] for c in configs}
    for s in seeds:
        for cfg in configs:
            r = _explore(cfg, n, s)
            other[cfg.class_name].append(r)
            b.out(f"  seed {s} {cfg.class_name:<33} same programs {r['replay'] / r['machine']:.2f}")
    inputs: dict[str, Any] = {"profile": "ci", "examples": n, "steps": profile["steps"], "seed": b.seed}
    inputs["clock"] = "process_time"
    inputs["arms"] = f"a warmed child each, timed in turns of {SLICE * 1000:.0f} ms on one CPU (harness.bench.arms)"
    out: list[Figure] = []
    for name, rs in runs.items():
        split = {k: round(statistics.median(r["split"][k] for r in rs), 3) for k in rs[0]["split"]}
        out.append(figure(
            f"{name} / same programs", "ratio", [r["replay"] / r["machine"] for r in rs], goal=(">=", 0.80),
            **inputs, machine_examples_per_s=round(statistics.median(n / r["machine"] for r in rs), 2),
            precondition_calls=rs[0]["calls"], split=split,
            how="Hypothesis alone on the machine's own programs (harness.bench.baselines: its preconditions' "
            "answers replayed, empty bodies, the same choices) / the machine: 1 - this is the harness' share",
        ))  # fmt: skip
        out.append(figure(
            f"{name} / same programs, other seeds", "ratio", [r["replay"] / r["machine"] for r in other[name]],
            goal=(">=", 0.80, True), **{**inputs, "seed": None, "seeds": seeds, "repetitions_per_seed": 1},
            how="the figure above at each of the next seeds, one repetition each; every seed must meet the goal",
        ))  # fmt: skip
        fastest = min(r["replay"] for r in rs) / min(r["machine"] for r in rs)
        out.append(figure(
            f"{name} / same programs, fastest runs", "ratio", [fastest], noise=_jackknife_spread(rs), **inputs,
            machine_cpu=[round(r["machine"], 6) for r in rs], replay_cpu=[round(r["replay"], 6) for r in rs],
            how="the fastest replay / the fastest machine run over the repetitions (as timeit reports a "
            "minimum): interference on a shared machine only slows a run down, so the fastest of each is the "
            "least disturbed; beside the goal's median of per-repetition ratios, not in its place",
        ))  # fmt: skip
        out.append(figure(
            f"{name} / same programs, checks off", "ratio", [r["replay"] / r["off"] for r in rs], **inputs,
            how="the same with PromptCacheMachine.checks_on False: no state invariant, no post-condition "
            "(inv.Tracer, PolicyTracer) and no crash judged; what checks costing nothing would give",
        ))  # fmt: skip
        out.append(figure(
            f"{name} / trivial", "ratio", [r["trivial"] / r["machine"] for r in rs], **inputs,
            how="TrivialMachine (every rule always valid: not this machine's programs) / the machine; the rule "
            "mix a configuration's preconditions leave sets Hypothesis' own share, which no body can remove",
        ))  # fmt: skip
    for cfg in configs:
        m_calls, r_calls = _calls(cfg, n, b.seed)
        b.out(f"  calls {cfg.class_name:<34} same programs {r_calls / m_calls:.3f} ({r_calls} / {m_calls})")
        out.append(figure(
            f"{cfg.class_name} / same programs, calls", "ratio", [r_calls / m_calls], **{**inputs, "clock": "calls"},
            machine_calls=m_calls, replay_calls=r_calls,
            how="Python function calls (cProfile) of Hypothesis alone on the machine's own programs / of the "
            "machine, one run in a fresh interpreter (harness.bench.calls): the same on every run for a seed to "
            "within a few calls (and for any PYTHONHASHSEED), so two commits compare "
            "without this machine's clock noise; a proxy for the goal above, not the goal (calls differ in cost)",
        ))  # fmt: skip
    trivial = [n / r["trivial"] for rs in runs.values() for r in rs]
    out.append(figure("trivial machine", "examples/s", trivial, **inputs))
    return out


def _calls(cfg: MachineConfig, examples: int, seed_value: int) -> tuple[int, int]:
    """Function calls of the machine of ``cfg`` and of Hypothesis alone on its programs, counted in a
    fresh interpreter (:mod:`harness.bench.calls`: what this process did before would change them)."""
    argv = [sys.executable, "-m", "harness.bench.calls", cfg.class_name, str(examples), str(seed_value)]
    r = run_child(argv, timeout=1800)
    words = r.stdout.split()
    if r.crashed or r.returncode != 0 or len(words) != 2:
        tail = (r.stdout + r.stderr).strip().splitlines()[-3:]
        raise UsageError(f"counting the calls of {cfg.class_name} failed ({r.describe()}): {' | '.join(tail)}")
    return int(words[0]), int(words[1])


def _jackknife_spread(rs: list[dict[str, Any]]) -> float:
    """The noise of the fastest-runs ratio: (max - min) / value over the ratio and its values with one
    repetition left out each (the jackknife). One fast outlier in either arm moves it as far as it moves
    the ratio; 0 for one repetition."""

    def ratio(keep: list[dict[str, Any]]) -> float:
        return float(min(r["replay"] for r in keep) / min(r["machine"] for r in keep))

    values = [ratio(rs)] + [ratio(rs[:i] + rs[i + 1 :]) for i in range(len(rs)) if len(rs) > 1]
    return (max(values) - min(values)) / values[0]


def _explore(cfg: MachineConfig, examples: int, seed_value: int) -> dict[str, Any]:
    """One repetition of ``cfg``: the trivial machine, the machine as the gate runs it, Hypothesis alone
    on the same programs and the machine with its checks off, each in a child of its own, timed in
    turns on one CPU (:func:`harness.bench.arms.run_arms`). CPU seconds of each, the tape's length
    and Hypothesis' statistics split of the first three."""
    arms = run_arms(cfg.class_name, examples, seed_value)
    split = {f"{who}_{k}": v for who in ("trivial", "machine", "replay") for k, v in arms[who]["split"].items()}
    cpu = {arm: float(r["cpu"]) for arm, r in arms.items()}
    return {**cpu, "calls": int(arms["replay"]["calls"]), "split": split}


@register("mutants", "seconds to kill each mutant and the steps of its shrunk program, one repetition per seed")
def mutants(b: Budget) -> list[Figure]:
    names = ["master"] if b.quick else list(MUTANTS)
    max_examples = 20 if b.quick else 300
    # a repetition is a seed (b.seed, b.seed + 1, ...): the kill's work is fixed by its seed, so the
    # spread that matters is the seeds', not the clock's; every figure is one sample per seed
    seeds = [b.seed + rep for rep in range(b.reps(3))]
    stats: dict[str, list[float]] = {}
    per: dict[int, dict[str, Any]] = {}
    survivors: dict[int, list[str]] = {}
    for seed in seeds:
        rows = []
        for name in names:
            c0 = time.process_time()
            row = kill(name, seed=seed, max_examples=max_examples)
            row["cpu_seconds"] = round(time.process_time() - c0, 2)
            b.out(
                f"  seed {seed} {name:<36} {'killed' if row['killed'] else 'SURVIVED'} {row['cpu_seconds']:6.1f}s CPU "
                f"{row['seconds']:6.1f}s wall (detect {row.get('detect_seconds', '-')}s, shrink "
                f"{row.get('shrink_seconds', '-')}s) {row['steps']} steps"
            )
            rows.append(row)
        survivors[seed] = [r["name"] for r in rows if not r["killed"]]
        cpu = [r["cpu_seconds"] for r in rows]
        killed = [r for r in rows if r["killed"]]
        detect = [r["detect_seconds"] for r in killed] or [0.0]
        steps = [r["steps"] for r in killed] or [0]
        for k, v in (
            ("median kill", statistics.median(cpu)),
            ("max kill", max(cpu)),
            ("median detect", statistics.median(detect)),
            ("max detect", max(detect)),
            ("median shrink", statistics.median([r["shrink_seconds"] for r in killed] or [0.0])),
            ("max steps", max(steps)),
            ("median steps", statistics.median(steps)),
            ("killed", len(killed)),
        ):
            stats.setdefault(k, []).append(v)
        per[seed] = {
            r["name"]: {
                "cpu_seconds": r["cpu_seconds"],
                "seconds": r["seconds"],
                "detect_seconds": r.get("detect_seconds"),
                "shrink_seconds": r.get("shrink_seconds"),
                "steps": r["steps"],
                "by": r["by"],
            }
            for r in rows
        }
    inputs: dict[str, Any] = {
        "mutants": len(names),
        "seeds": seeds,
        "max_examples": max_examples,
        "survivors": survivors,
        "clock": "process_time for the whole kill; wall (Hypothesis' phase statistics) for detect and shrink",
    }
    return [
        figure("median kill time", "s CPU", stats["median kill"], better="lower", goal=("<=", 2), **inputs),
        figure("max kill time", "s CPU", stats["max kill"], better="lower", goal=("<=", 20), **inputs, per_mutant=per),
        figure("median time to detect", "s", stats["median detect"], better="lower", goal=("<=", 2), **inputs),
        figure("max time to detect", "s", stats["max detect"], better="lower", goal=("<=", 20), **inputs),
        figure("median shrink time", "s", stats["median shrink"], better="lower", **inputs),
        figure("max shrunk steps", "steps", stats["max steps"], better="lower", goal=("<=", 6), **inputs),
        figure("median shrunk steps", "steps", stats["median steps"], better="lower", **inputs),
        # killed on every seed: the fewest of any seed
        figure("killed", "mutants", [min(stats["killed"])], goal=(">=", len(names)), **inputs),
    ]


@register("sweep", "the fault sweep: trials/s and wall time, both semantics, both modes")
def sweep(b: Budget) -> list[Figure]:
    scenarios = list(SCENARIOS.values())[:1] if b.quick else None
    reps = b.reps(2)
    out: list[Figure] = []
    totals: list[float] = []
    per: dict[tuple[str, str], list[float]] = {}
    trials: dict[tuple[str, str], int] = {}
    for _ in range(reps):
        total = 0.0
        for sem in ("shared", "master"):
            for mode in ("transient", "persistent"):
                t0 = time.perf_counter()
                report = run_sweep(sem, [mode], scenarios)
                dt = time.perf_counter() - t0
                total += dt
                per.setdefault((sem, mode), []).append(len(report.cases) / dt)
                trials[(sem, mode)] = len(report.cases)
        totals.append(total)
        b.out(f"  full sweep (both semantics, both modes) {total:.1f}s")
    n_sc = len(scenarios) if scenarios else len(SCENARIOS)
    for (sem, mode), v in per.items():
        out.append(figure(f"{sem} {mode}", "trials/s", v, semantics=sem, mode=mode, trials=trials[(sem, mode)]))
    out.append(figure("wall, both semantics and modes", "s", totals, better="lower", goal=("<=", 60), scenarios=n_sc))
    return out


# ---- 3b. what hypothesis.target changes in a campaign -------------------------------------------------------


# (machine, label): one hypothesis.target label at a time, where the machine has room to climb it;
# label None: all of REACH at once, as a campaign targets them
TARGET_PAIRS: tuple[tuple[str, str | None], ...] = (
    ("Shared_hybrid", None),
    ("Shared_hybrid", "evictions"),
    ("Shared_hybrid", "transient_peak"),
    ("Shared_hybrid_kvu_np3_nobytes_ctx44", "shared_holders"),
    ("Shared_iswa", "checkpoints"),
)


@register("targeting", "a fuzz campaign's reach with hypothesis.target guidance against without, same examples")
def targeting(b: Budget) -> list[Figure]:
    """Campaign runs (:func:`harness.campaign.runner.run_batch`) of a few synthetic machines, the target
    phase on and off, interleaved, the same examples per run; each arm keeps its own in-memory database
    across its runs, as a campaign worker does (so the reuse phase carries the Pareto front forward).

    Per (machine, label) of :data:`TARGET_PAIRS`: the maximum of the label each run reached, on
    against off, with only that label targeted (``PromptCacheMachine.target_labels``), or all of
    :data:`properties.machine.REACH` at once (label None: the campaign's setting)."""
    rounds = 2 if b.quick else b.reps(8)
    n = 10 if b.quick else 300
    specs = {s.name: s for s in campaign_machines(Plan(("synthetic",)))}
    pairs = [(m, k) for m, k in TARGET_PAIRS if m in specs][: 1 if b.quick else None]
    out: list[Figure] = []
    for name, only in pairs:
        spec = specs[name]
        labels = REACH if only is None else (only,)
        mems = {arm: InMemoryExampleDatabase() for arm in (True, False)}
        maxima: dict[bool, dict[str, list[float]]] = {arm: {k: [] for k in labels} for arm in (True, False)}
        seconds: dict[bool, float] = {True: 0.0, False: 0.0}
        PromptCacheMachine.target_labels = labels  # read by every machine class (a class attribute)
        try:
            for rnd in range(rounds):
                for arm in (True, False) if rnd % 2 == 0 else (False, True):
                    r = run_batch(spec, Plan(("synthetic",), target=arm), n, InMemoryExampleDatabase(), mems[arm])
                    if r.record is not None or r.duplicate is not None:
                        raise UsageError(f"{name} failed during the targeting bench: {r.record or r.duplicate}")
                    seconds[arm] += r.seconds
                    for k in labels:
                        maxima[arm][k].append(float(r.reach.get(k, 0)))
                b.out(f"  {name} [{only or 'all labels'}] round {rnd}: " + " ".join(
                    f"{k} {maxima[True][k][-1]:g}/{maxima[False][k][-1]:g}" for k in labels
                ) + " (on/off)")  # fmt: skip
        finally:
            PromptCacheMachine.target_labels = REACH
        for k in labels:
            on, off = maxima[True][k], maxima[False][k]
            out.append(
                figure(
                    f"{name} {k} max, target on / off ({'all labels' if only is None else 'this label only'})",
                    "ratio",
                    [(statistics.mean(on) + 1) / (statistics.mean(off) + 1)],
                    note="(mean max on + 1) / (mean max off + 1); > 1: targeting reaches further",
                    machine=name,
                    label=k,
                    targeted=list(labels),
                    examples_per_run=n,
                    runs=rounds,
                    on=on,
                    off=off,
                    wins_on=sum(a > c for a, c in zip(on, off, strict=True)),
                    wins_off=sum(a < c for a, c in zip(on, off, strict=True)),
                    seconds_on=round(seconds[True], 2),
                    seconds_off=round(seconds[False], 2),
                )
            )
    return out


# ---- 4. save cost against the checkpoint payload size -----------------------------------------------------


def save_layers(
    semantics: str, sizes: list[int], reps: int, layers: tuple[str, ...] = LAYERS, warm: int = 0
) -> dict[str, list[dict[str, Any]]]:
    """Rows per layer for the ``saves`` case, one per (total payload size, repetition), in that order.

    Every layer holds the slot's state S fixed and grows the number of its checkpoints: n = total / 1 MiB
    checkpoints of about 1 MiB. That is the PR's claim: a save's cost must not grow with the bytes of
    the checkpoints it shares. (Growing each checkpoint instead needs a bigger recurrent state, and S
    is copied in both semantics: a run at commit 0ec4099 with four checkpoints of total / 4 bytes on
    the sized ``mamba-d*`` models measured 223x from 1 to 256 MiB on the PR's libllama, all of it S.)
    Each row is the first save after the build-up and ``warm`` more saves of the same prompt
    (:func:`harness.report.saves.warm_saves`). Every point runs in a fresh process: the ``model`` and
    ``llama`` points in an interpreter of their own (:func:`_save_point`), the ``server`` points in a
    llama-server of their own, so no size is timed on the heap another size left behind.

    ``model``: the model's ledger (:func:`harness.report.saves.model_save_point`, a synthetic recurrent
    context).
    ``llama`` and ``server``: :func:`harness.report.saves.save_curve` on ``mamba-big`` (1.02 MiB
    checkpoints), its ``counts`` axis; each row says the bytes it got. ``server`` is left out when no
    llama-server of ``semantics`` is built (``python -m harness build-server --semantics SEMANTICS``).
    """
    rows: dict[str, list[dict[str, Any]]] = {}
    counts = [max(1, s // MIB) for s in sizes]
    for layer in ("model", "llama"):
        if layer in layers:
            rows[layer] = [_save_point(layer, semantics, n, rep, warm) for n in counts for rep in range(reps)]
    binary = cached_binary(semantics)
    if "server" in layers and binary is not None:
        rows["server"] = save_curve("server", semantics, counts=counts, reps=reps, size=MIB, binary=binary, warm=warm)
    return rows


def _save_point(layer: str, semantics: str, n: int, rep: int, warm: int) -> dict[str, Any]:
    """One ``model`` or ``llama`` point in a fresh interpreter (``python -m harness.report.saves``)."""
    argv = [sys.executable, "-m", "harness.report.saves", layer, semantics, str(n), str(rep), str(warm)]
    r = run_child(argv, timeout=900)
    lines = r.stdout.strip().splitlines()
    if r.crashed or r.returncode != 0 or not lines:
        tail = (r.stdout + r.stderr).strip().splitlines()[-3:]
        raise UsageError(f"the {layer} {semantics} save of {n} checkpoints failed ({r.describe()}): {' | '.join(tail)}")
    rows = json.loads(lines[-1])
    assert isinstance(rows, list) and rows
    return cast(dict[str, Any], rows[-1])


#: Layers the issue's save-time goal is on ("on libllama and on the real server"). The ``model`` layer's
#: time is the reference model's own Python: one list node per shared checkpoint, each a fault-injection
#: point (``CheckpointList.copy``), about a microsecond per checkpoint; it grows with the number of
#: checkpoints, not their bytes, and a C++ server pays tens of nanoseconds for the same list copy.
SAVE_GOAL_LAYERS = ("llama", "server")
# what a save's transient peak is on each layer (harness.report.saves)
PEAK_HOW = {
    "model": "the physical bytes the save adds above the live bytes at its peak, on the model's ledger (exact)",
    "llama": "the heap's high-water mark during the save under memray (native), libllama's allocations and the "
    "harness' two copies of S included",
    "server": "VmHWM - VmRSS of a real llama-server around the request that makes the save (that request's own "
    "new checkpoints included)",
}


@register("saves", "save time and transient peak against checkpoint payload size, master against shared")
def saves(b: Budget) -> list[Figure]:
    """Per layer, semantics and size: the warm saves' seconds (the goal's figure: the save's own cost,
    every size timed in the same heap state) with the first saves' seconds and the minor page faults of
    both as inputs; then the 256/1 MiB ratios of the warm saves' medians and of the first saves', and
    what one checkpoint more costs a warm save."""
    # quick: two sizes and no server (the test's budget); full: the 1 .. 256 MiB on all three layers
    sizes = [1 * MIB, 4 * MIB] if b.quick else [1 * MIB, 4 * MIB, 16 * MIB, 64 * MIB, 256 * MIB]
    layers = ("model", "llama") if b.quick else LAYERS
    reps = b.reps(3)
    warm = 2 if b.quick else 8  # 24 warm saves a size: a server's save of a 1 MiB state is ~0.15 ms
    out: list[Figure] = []
    for sem in ("shared", "master"):
        for layer, rows in save_layers(sem, sizes, reps, layers, warm).items():
            by_size: dict[int, list[dict[str, Any]]] = {}
            for r, s in zip(rows, [s for s in sizes for _ in range(reps)], strict=True):
                by_size.setdefault(s, []).append(r)
            out += _save_size_figures(layer, sem, by_size, reps, warm)
            out += _save_curve_figures(layer, sem, by_size, reps, warm)
    return out


def _warm_times(rs: list[dict[str, Any]]) -> list[float]:
    # the server's save time is read from its log; a save whose log lacks it has none
    return [float(t) for r in rs for t in r.get("warm_save_seconds", [])]


def _first_times(rs: list[dict[str, Any]]) -> list[float]:
    return [float(r["save_seconds"]) for r in rs if r.get("save_seconds") is not None]


def _save_size_figures(
    layer: str, sem: str, by_size: dict[int, list[dict[str, Any]]], reps: int, warm: int
) -> list[Figure]:
    """One figure per size: its warm saves, the first saves and every minor fault count as inputs."""
    out = []
    for s, rs in by_size.items():
        out.append(
            figure(
                f"{layer} {sem} save peak {s // MIB} MiB",
                "MiB",
                [r["peak_bytes"] / MIB for r in rs],
                better="lower",
                layer=layer,
                semantics=sem,
                n_checkpoints=rs[0]["n_checkpoints"],
                checkpoint_bytes=rs[0]["checkpoint_bytes"],
                state_bytes=rs[0]["state_bytes"],
                how=PEAK_HOW[layer],
                repetitions=reps,
            )
        )
        if not _warm_times(rs):
            continue
        out.append(
            figure(
                f"{layer} {sem} warm save {s // MIB} MiB",
                "s",
                _warm_times(rs),
                better="lower",
                layer=layer,
                semantics=sem,
                model=rs[0].get("model", "synthetic"),
                n_checkpoints=rs[0]["n_checkpoints"],
                checkpoint_bytes=rs[0]["checkpoint_bytes"],
                warm_checkpoint_bytes=[c for r in rs for c in r.get("warm_checkpoint_bytes", [])],
                peak_bytes=[r["peak_bytes"] for r in rs],
                state_bytes=rs[0]["state_bytes"],
                warm_minflt=[f for r in rs for f in r.get("warm_minflt", [])],
                first_save_seconds=_first_times(rs),
                first_minflt=[r.get("minflt") for r in rs],
                repetitions=reps,
                warm=warm,
            )
        )
    return out


def _save_curve_figures(
    layer: str, sem: str, by_size: dict[int, list[dict[str, Any]]], reps: int, warm: int
) -> list[Figure]:
    """The curve's figures: largest over smallest size for warm and first saves (the goal on the warm
    ratio, :data:`SAVE_GOAL_LAYERS`, shared only), and the least-squares slope of the warm medians over
    the checkpoints held (what one checkpoint more costs a save)."""
    sizes = sorted(s for s, rs in by_size.items() if _warm_times(rs))
    if len({by_size[s][0]["n_checkpoints"] for s in sizes}) < 2:  # no curve (and no slope) to draw
        return []
    lo, hi = sizes[0], sizes[-1]
    warm_med = {s: statistics.median(_warm_times(by_size[s])) for s in sizes}
    peak_ratio = statistics.median(r["peak_bytes"] for r in by_size[hi]) / max(
        1, statistics.median(r["peak_bytes"] for r in by_size[lo])
    )
    inputs: dict[str, Any] = {
        "layer": layer,
        "semantics": sem,
        "checkpoint_bytes": [by_size[lo][0]["checkpoint_bytes"], by_size[hi][0]["checkpoint_bytes"]],
        "peak_ratio": round(peak_ratio, 3),
        "repetitions": reps,
    }
    goal = ("<=", 1.5) if sem == "shared" and layer in SAVE_GOAL_LAYERS else None
    if sem == "master":
        note = "master: about linear expected"
    elif goal is None:
        note = "the model's own Python bookkeeping, per checkpoint (SAVE_GOAL_LAYERS); no goal"
    else:
        note = "PR: must not grow with checkpoint bytes (warm saves: the same heap state at every size)"
    name = f"{layer} {sem}"
    ratio = f"{hi // MIB}/{lo // MIB} MiB"
    ns = [float(by_size[s][0]["n_checkpoints"]) for s in sizes]
    mib = by_size[hi][0]["checkpoint_bytes"] / by_size[hi][0]["n_checkpoints"] / MIB
    out = [
        figure(f"{name} warm save time {ratio}", "ratio", [warm_med[hi] / warm_med[lo]], better="lower",
               goal=goal, note=note, warm=warm, **inputs),
        figure(f"{name} save peak {ratio}", "ratio", [peak_ratio], better="lower",
               note="master copies the checkpoints (S + C: about linear); the PR shares them (S: flat)",
               **{k: v for k, v in inputs.items() if k != "peak_ratio"}),
        figure(f"{name} warm save cost per checkpoint", "us",
               [statistics.linear_regression(ns, [warm_med[s] for s in sizes]).slope * 1e6], better="lower",
               note=f"slope of the warm medians over the checkpoints held ({mib:.2f} MiB each)",
               n_checkpoints=ns, medians=[warm_med[s] for s in sizes], **inputs),
    ]  # fmt: skip
    firsts = {s: _first_times(by_size[s]) for s in (lo, hi)}
    if firsts[lo] and firsts[hi]:
        out.append(
            figure(
                f"{name} first save time {ratio}",
                "ratio",
                [statistics.median(firsts[hi]) / statistics.median(firsts[lo])],
                better="lower",
                note="the first save after the build-up: its buffers' fresh pages fault or not (no goal)"
                + ("; timed under memray's native tracing" if layer == "llama" else ""),
                **inputs,
            )
        )
    return out


# ---- 5. the real server differential ---------------------------------------------------------------------


def _prompts(n: int) -> list[list[int]]:
    """Requests that share, extend and diverge: three families, each request extending the last."""
    out = []
    for i in range(n):
        fam = i % 3
        out.append([1] + [3 + (j * (fam + 2)) % 200 for j in range(16 + 8 * (i // 3) % 96)])
    return out


def _time_model(d: Differential) -> list[float]:
    """Charge the model's part of each request (``handle_completion`` + ``run_until_idle``) to a counter."""
    secs = [0.0]

    def timed(fn: Callable[..., Any]) -> Callable[..., Any]:
        def inner(*a: Any, **kw: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                secs[0] += time.perf_counter() - t0

        return inner

    d.model.handle_completion = timed(d.model.handle_completion)  # type: ignore[method-assign]
    d.model.run_until_idle = timed(d.model.run_until_idle)  # type: ignore[method-assign]
    return secs


@register("server", "real llama-server differential: requests/s with the model's prediction on")
def server(b: Budget) -> list[Figure]:
    binary = cached_binary("shared")
    if binary is None:
        raise UsageError("no cached llama-server (pr): run python -m harness build-server --semantics shared")
    n = 6 if b.quick else 60
    reps = b.reps(3)
    rates: list[float] = []
    shares: list[float] = []
    mismatches = 0
    cfg = ServerConfig("llama")
    for _ in range(reps):
        with Differential(cfg, binary, "shared") as d:
            model_secs = _time_model(d)
            t0 = time.perf_counter()
            for p in _prompts(n):
                mismatches += not d.request(p, 4).ok
            dt = time.perf_counter() - t0
        rates.append(n / dt)
        shares.append(model_secs[0] / dt)
        b.out(f"  {n / dt:.1f} requests/s, model {model_secs[0] / dt:.0%} of the time")
    inputs: dict[str, Any] = {"model": cfg.arch, "requests": n, "n_predict": 4, "mismatches": mismatches}
    return [
        figure("requests/s (model on)", "req/s", rates, goal=(">=", 20), **inputs),
        figure("model's share of the time", "fraction", shares, better="lower", **inputs),
    ]


# ---- 6. state I/O against memcpy -------------------------------------------------------------------------


@register("state-io", "libllama state get/set bytes/s against a memcpy of the same size")
def state_io(b: Budget) -> list[Figure]:
    """Per repetition, ``calls`` rounds of get, set and memcpy in turn; each rate is taken from its
    fastest call (the physical limit; a loaded machine only adds to a call's time), so get and set are
    compared with a memcpy measured within the same milliseconds."""
    arch = "mamba" if b.quick else "mamba-big"
    reps = b.reps(5)
    calls = 3 if b.quick else 30
    get_r, set_r, cpy_r = [], [], []
    with LlamaProvider(load_model(model_path(arch)), n_seq=1, n_ctx=256, check_restores=False) as p:
        p.decode(0, [1 + i % 24 for i in range(64)], 0)
        ll, ctx = p._ll, p.ctx
        size = int(ll.llama_state_seq_get_size_ext(ctx, 0, 0))
        buf = (ctypes.c_uint8 * size)()
        dst = (ctypes.c_uint8 * size)()
        clock = time.perf_counter
        for _ in range(reps):
            best = [float("inf")] * 3
            for _ in range(calls):
                t0 = clock()
                ll.llama_state_seq_get_data_ext(ctx, buf, size, 0, 0)
                t1 = clock()
                ll.llama_state_seq_set_data_ext(ctx, buf, size, 0, 0)
                t2 = clock()
                ctypes.memmove(dst, buf, size)
                t3 = clock()
                best = [min(best[0], t1 - t0), min(best[1], t2 - t1), min(best[2], t3 - t2)]
            get_r.append(size / best[0])
            set_r.append(size / best[1])
            cpy_r.append(size / best[2])
    inputs: dict[str, Any] = {"model": arch, "state_bytes": size, "calls_per_rep": calls, "statistic": "fastest call"}
    mib = float(MIB)
    return [
        figure("state get", "MiB/s", [x / mib for x in get_r], **inputs),
        figure("state set", "MiB/s", [x / mib for x in set_r], **inputs),
        figure("memcpy", "MiB/s", [x / mib for x in cpy_r], **inputs),
        figure("state get / memcpy", "ratio", [g / c for g, c in zip(get_r, cpy_r, strict=True)], **inputs),
        figure("state set / memcpy", "ratio", [s / c for s, c in zip(set_r, cpy_r, strict=True)], **inputs),
    ]


# ---- 7. the whole gate ----------------------------------------------------------------------------------


@register("gate", "the default gate's wall time after builds (python -m harness gate)", full_only=True)
def gate(b: Budget) -> list[Figure]:
    argv = [sys.executable, "-m", "harness", "gate", "--seed", str(b.seed)]
    r = run_child(argv, timeout=1800)
    if r.crashed or r.returncode != 0:
        tail = (r.stdout + r.stderr).strip().splitlines()[-3:]
        raise UsageError(f"the gate did not pass ({r.describe()}): {' | '.join(tail)}")
    b.out(f"  gate {r.elapsed:.1f}s")
    return [figure("default gate wall", "s", [r.elapsed], better="lower", goal=("<=", 180), seed=b.seed)]


@register(
    "ci",
    "the wall time of .ci/run on a clean clone of HEAD, this machine's caches warm (about 30 minutes)",
    full_only=True,
    named_only=True,
)
def ci(b: Budget) -> list[Figure]:
    root = Path(__file__).resolve().parents[2]
    with tempfile.TemporaryDirectory(prefix="bench-ci-") as tmp:
        clone = Path(tmp) / "clone"
        got = subprocess.run(["git", "clone", "-q", str(root), str(clone)], capture_output=True, text=True)
        if got.returncode != 0:
            raise UsageError(f"cannot clone {root}: {got.stderr.strip()}")
        rev = ["git", "-C", str(clone), "rev-parse", "--short=12", "HEAD"]
        head = subprocess.run(rev, capture_output=True, text=True)
        env = {**os.environ, "CI": "true"}
        r = run_child(["bash", str(clone / ".ci" / "run")], env=env, timeout=90 * 60)
        tail = (r.stdout + r.stderr).strip().splitlines()[-3:]
        if r.crashed or r.returncode != 0:
            raise UsageError(f".ci/run did not pass ({r.describe()}): {' | '.join(tail)}")
        sections = [line[3:] for line in r.stdout.splitlines() if line.startswith("== ")]
        pytest_seconds = None
        for name in ("pytest.xml", "pytest-builds.xml"):  # both tiers of tests (tests/README.md)
            xml = clone / "artifacts" / name
            if xml.exists():
                top = ET.parse(xml).getroot()
                suite = top if top.tag == "testsuite" else top.find("testsuite")
                if suite is not None:
                    pytest_seconds = (pytest_seconds or 0.0) + float(suite.get("time", "nan"))
    b.out(f"  .ci/run {r.elapsed:.0f}s (pytest {pytest_seconds}s)")
    return [
        figure(
            ".ci/run wall, warm", "s", [r.elapsed], better="lower", goal=("<=", 90 * 60),
            commit=head.stdout.strip(), sections=len(sections), pytest_seconds=pytest_seconds,
            caches="warm: this machine's pip cache, llama-server builds and generated models",
        )
    ]  # fmt: skip
