"""``gate --backend synthetic``: the reference model's state machines on synthetic state.

The target is :mod:`harness.targets.synthetic` (the model on deterministic synthetic state of four
memory kinds). The backend runs the machines of :func:`properties.run.machines_for`, then one
machine per known finding of this backend, each with the pattern that reaches the suspected
upstream bug switched on (``MachineConfig.known``): a finding is ``reproduced`` when that machine
fails on exactly the property the finding names, and a failure on any other property is a new
failure of the gate. The reuse property's findings (``properties/reuse.py``) are counted in the main
machines (``counted``: requests and tokens recomputed), never failed.

The gate's and the campaign's machines are :func:`properties.run.machines_for`'s, then the families' of
:func:`properties.families.family_configs` (slot files, ``--cache-reuse`` and context shift, embedding and rerank
requests: issue #39); a family's excused registered findings (``found``: a partial slot file, a stale draft after
a restore, an embedding's idle slot cached) are ``counted`` rows too.

Campaign machines: the gate's ``fuzz`` profile and the families', 60 steps, batch 30; with a mutant, that
mutant's own machine first, then the others on its semantics (a family's mutant: its family's machines), so that
a campaign can be seen to find a planted bug.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from dataclasses import replace
from typing import cast

from hypothesis import settings

from harness.backends.base import Backend, GateOptions, GateReport, MachineSpec, Out, Plan, model_spec
from harness.findings import (
    BUSY_SLOT_BY_ID,
    DRAFT_KV_EXHAUSTION,
    FINDINGS,
    STALE_CHECKPOINT_AFTER_MISS,
    SWA_CHECKPOINT_ORDER,
    KnownRow,
    finding,
)
from properties.families import FAMILY_MUTANTS, family_configs, mutant_configs
from properties.families import resolve as resolve_any
from properties.machine import MachineConfig, machine_class
from properties.mutants import config as mutant_config
from properties.mutants import resolve
from properties.reuse import finding_counts
from properties.run import SHRINKS, machines_for, make_settings, run_machine

__all__ = ["KNOWN_MACHINES", "SyntheticBackend"]

# finding id -> (the machine that reaches it, the properties it is allowed to fail)
KNOWN_MACHINES: dict[str, tuple[Callable[[str], MachineConfig], frozenset[str]]] = {
    BUSY_SLOT_BY_ID.id: (
        lambda v: MachineConfig(v, "hybrid", known=frozenset({BUSY_SLOT_BY_ID.id})),
        frozenset({"busy_slot_untouched"}),
    ),
    DRAFT_KV_EXHAUSTION.id: (
        lambda v: MachineConfig(v, "hybrid", draft=True, known=frozenset({"small-draft-ctx"})),
        frozenset({"load_transfer", "draft_in_step"}),
    ),
    SWA_CHECKPOINT_ORDER.id: (
        lambda v: MachineConfig(v, "iswa", known=frozenset({"strict-swa-order"})),
        frozenset({"checkpoint_lists"}),
    ),
    STALE_CHECKPOINT_AFTER_MISS.id: (
        lambda v: MachineConfig(v, "hybrid", known=frozenset({"strict-stale-checkpoint", "no-bos"})),
        frozenset({"restore_bytes", "draft_in_step"}),
    ),
}


def replay_line(opts: GateOptions) -> str:
    return f"python -m harness gate --semantics {opts.semantics} --profile {opts.profile} --seed {opts.seed}"


class SyntheticBackend(Backend):
    """``machines`` replaces the gate's list (tests run a few); ``known=False`` skips the finding runs."""

    name = "synthetic"

    def __init__(self, machines: list[MachineConfig] | None = None, *, known: bool = True) -> None:
        self.machines = machines
        self.known = known

    def configs(self, semantics: str, profile: str) -> list[MachineConfig]:
        """The machines a gate run covers: the given ones, else the gate's own and the families'."""
        if self.machines is not None:
            return self.machines
        return machines_for(semantics, profile) + family_configs(semantics, profile)

    def run(self, report: GateReport, opts: GateOptions, out: Out) -> None:
        cfg_settings = make_settings(opts.profile, opts.db, opts.max_examples)
        replay = replay_line(opts) + " --backend synthetic"
        configs = self.configs(opts.semantics, opts.profile)
        out(
            f"gate: semantics={opts.semantics} backend=synthetic profile={opts.profile} seed={opts.seed} "
            f"commit={report.commit} machines={len(configs)} max_examples={cfg_settings.max_examples} "
            f"steps={cfg_settings.stateful_step_count}"
        )
        counted: dict[str, Counter[str]] = {}  # reuse finding -> machine -> requests; "" -> tokens recomputed
        excused: dict[str, Counter[str]] = {}  # a family's excused finding -> machine -> examples or checks
        for cfg in configs:
            # a family's findings seen (slot files, stateless), kept over the class's examples: this run's only
            found = cast("Counter[str]", getattr(machine_class(cfg), "found", Counter()))
            found.clear()
            r = run_machine(cfg, cfg_settings, opts.seed, replay, shrinks=SHRINKS[opts.profile])
            report.machines.append(r)
            status = "ok  " if r.failure is None else "FAIL"
            out(f"  [{status}] {cfg.class_name:<32} {sum(r.checked.values()):>7} checks {r.seconds:6.1f}s")
            for fid, n in finding_counts(machine_class(cfg).reuse_counts).items():
                c = counted.setdefault(fid, Counter())
                c[cfg.class_name] += n["requests"]
                c[""] += n["tokens_recomputed"]
            for fid, k in found.items():
                if fid in FINDINGS and k:
                    excused.setdefault(fid, Counter())[cfg.class_name] += k
        for fid, c in counted.items():  # counted, never failed: properties/reuse.py matched their exact condition
            tokens = c.pop("")
            n_req, first = sum(c.values()), next(iter(c))
            report.known.append(
                KnownRow(finding(fid), first, "counted", requests=n_req, tokens_recomputed=tokens, machines=len(c))
            )
        for fid, c in excused.items():  # the slot-file and stateless machines' registered findings, excused
            report.known.append(
                KnownRow(finding(fid), next(iter(c)), "counted", times=sum(c.values()), machines=len(c))
            )
        if self.known:
            run_known(report, opts.semantics, cfg_settings, opts.seed, replay, SHRINKS[opts.profile])

    def campaign_machines(self, plan: Plan) -> list[MachineSpec]:
        if plan.mutant is None:
            configs = machines_for(plan.semantics, "fuzz") + family_configs(plan.semantics, "fuzz")
        elif plan.mutant in FAMILY_MUTANTS:  # its own machine first, then its family's others
            configs = mutant_configs(plan.mutant)
        else:
            configs = [mutant_config(plan.mutant)] + [
                replace(c, semantics=plan.mutant, resolve=resolve) for c in machines_for("shared", "fuzz")
            ] + [replace(c, semantics=plan.mutant, resolve=resolve_any) for c in family_configs("shared", "fuzz")]
        out: list[MachineSpec] = []
        for c in configs:
            if c.class_name not in {s.name for s in out}:
                out.append(model_spec(c, self.name, 60, 30))
        return out


def run_known(
    report: GateReport,
    semantics: str,
    cfg_settings: settings,
    seed: int,
    replay: str,
    shrinks: int | None = SHRINKS["ci"],
) -> None:
    """One machine per known finding of the model; each must fail only where its finding says."""
    for fid, (config, expects) in KNOWN_MACHINES.items():
        kcfg = config(semantics)
        r = run_machine(kcfg, cfg_settings, seed, replay, shrinks=shrinks)
        f = finding(fid)
        if r.failure is None:
            report.known.append(KnownRow(f, kcfg.class_name, "not-reproduced"))
        elif r.failure.property in expects:
            report.known.append(
                KnownRow(
                    f,
                    kcfg.class_name,
                    "reproduced",
                    property=r.failure.property,
                    message=r.failure.message,
                    program=r.failure.program,
                    steps=r.failure.steps,
                )
            )
        else:
            # a failure the known-finding run did not expect is a new failure of the gate
            report.machines.append(r)
            report.known.append(
                KnownRow(f, kcfg.class_name, "unexpected", property=r.failure.property, message=r.failure.message)
            )
