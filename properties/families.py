"""The machine families beside the gate's own machine, and every mutant a gate or a campaign can plant.

Importing this module loads the families of :data:`properties.machine.FAMILIES` (issue #39): ``slot_files``
(:mod:`properties.slot_file_machine`: save/restore/erase, a filling disk, a write fault), ``reuse``
(:mod:`properties.reuse_machine`: ``--cache-reuse`` and context shift) and ``stateless``
(:mod:`properties.stateless_machine`: embedding and rerank requests, idle slots). :func:`family_configs` is what
the synthetic gate and campaign run of them after :func:`properties.run.machines_for`'s machines (the gate's
ci profile: five machines, about 45 s together on the shared 2-core machine at 300 examples each).

Mutants: :data:`properties.mutants.MUTANTS` (the gate's), and the families' own, kept out of that table because
the gate's matrix (``python -m harness mutants``, the report) runs the gate's machines, which have no rule for
them: the slot-file mutants (:data:`~properties.mutants.SLOT_FILE_MUTANTS`, a broken store), the reuse mutants
(:data:`~properties.reuse_mutants.REUSE_MUTANTS`) and the stateless ones
(:data:`~properties.stateless.STATELESS_MUTANTS`). :func:`mutant_configs` gives the machines that plant one (its
own first), :func:`resolve` the semantics of any of them. ``idle-skips-stateless`` is the reverse mutant (the
idle loop skips stateless slots, as a fix would): it makes the cache smaller; ``idle_pass``, which pins upstream's
loop (every idle slot saved, :2419-2432), kills it on the model, and the model's prediction against a real server
does too (tests/test_idle_slots.py). Importing this module also registers the families with
:data:`properties.mutants.FAMILY_HOOKS`, so :func:`properties.mutants.kill` tries the gate's whole list.
"""

from __future__ import annotations

from dataclasses import replace

from harness.model.semantics import SHARED, Semantics
from properties.machine import MachineConfig
from properties.mutants import FAMILY_HOOKS, MUTANTS, SLOT_FILE_MUTANTS, STATELESS_MUTANTS
from properties.mutants import resolve as resolve_gate
from properties.reuse_machine import N_CTX, REUSE_KINDS
from properties.reuse_mutants import REUSE_MUTANTS
from properties.slot_file_machine import slot_file_machine
from properties.stateless import PROPERTY as STATELESS_PROPERTY
from properties.stateless_machine import stateless_machine

# the two machine makers re-exported: importing them registers their families
__all__ = ["FAMILY_MUTANTS", "all_mutants", "family_configs", "mutant_configs", "resolve", "slot_file_machine",
           "stateless_machine"]  # fmt: skip

#: a family's mutant -> (its family, the property expected to kill it, its machine's kind, draft)
FAMILY_MUTANTS: dict[str, tuple[str, str, str, bool]] = {
    **{n: ("slot_files", prop, "hybrid", False) for n, (_, prop) in SLOT_FILE_MUTANTS.items()},
    **{n: ("reuse", m.kills, m.kind, m.draft) for n, m in REUSE_MUTANTS.items()},
    "stateless-select-saves": ("stateless", STATELESS_PROPERTY, "transformer", False),
    # the idle loop skipping stateless slots (what a fix would do): idle_pass pins upstream's loop, which saves
    # every idle slot (issue #50); before it, only the model's prediction against a real server killed it
    "idle-skips-stateless": ("stateless", "idle_pass", "transformer", False),
    "stateless-resumes-prefix": ("stateless", "stateless_fresh", "transformer", False),
}
assert set(FAMILY_MUTANTS) >= set(STATELESS_MUTANTS) and not set(FAMILY_MUTANTS) & set(MUTANTS)


def resolve(name: str) -> Semantics:
    """The semantics of any mutant (a slot-file mutant breaks the store: its semantics is ``shared``), or of
    ``shared``/``master``."""
    if name in SLOT_FILE_MUTANTS:
        return SHARED
    if name in STATELESS_MUTANTS:
        return STATELESS_MUTANTS[name]
    if name in REUSE_MUTANTS:
        return REUSE_MUTANTS[name].semantics
    return resolve_gate(name)


def all_mutants() -> dict[str, str]:
    """Every mutant a campaign can plant: name -> the property expected to kill it."""
    return {**{n: m.kills for n, m in MUTANTS.items()}, **{n: f[1] for n, f in FAMILY_MUTANTS.items()}}


def family_configs(semantics: str, profile: str) -> list[MachineConfig]:
    """The families' machines a gate run (``profile`` ci or fuzz) covers after the gate's own."""
    configs = [
        MachineConfig(semantics, "hybrid", family="slot_files"),
        MachineConfig(semantics, "transformer", draft=True, kv_unified=True, family="slot_files"),
        *(MachineConfig(semantics, kind, n_ctx=N_CTX, family="reuse") for kind in REUSE_KINDS),
        MachineConfig(semantics, "transformer", family="stateless"),
    ]
    if profile == "fuzz":
        configs += [
            MachineConfig(semantics, "recurrent", kv_unified=True, family="slot_files"),
            MachineConfig(semantics, "iswa", draft=True, family="slot_files"),
            # transformer only: on hybrid and iSWA memory the policy tracer's restore_bytes fails an embedding
            # that follows a completion on its slot (a restore it sees resume from ()), which is not yet told
            # apart from a real fault (a gap, said in the report of #39)
            MachineConfig(semantics, "transformer", n_slots=3, family="stateless"),
            MachineConfig(semantics, "transformer", kv_unified=True, family="stateless"),
        ]
    return configs


def mutant_configs(name: str) -> list[MachineConfig]:
    """The machines that plant a family's mutant ``name``: its own first, then its family's others (fuzz
    profile) on its semantics."""
    family, _, kind, draft = FAMILY_MUTANTS[name]
    n_ctx = N_CTX if family == "reuse" else 256
    own = MachineConfig(name, kind, draft=draft, n_ctx=n_ctx, family=family, resolve=resolve)
    rest = [replace(c, semantics=name, resolve=resolve) for c in family_configs("shared", "fuzz")]
    return [own, *(c for c in rest if c.family == family and c != own)]


# properties.mutants.kill tries the gate's whole list of machines, these families' included, on any mutant
FAMILY_HOOKS.configs, FAMILY_HOOKS.own, FAMILY_HOOKS.resolve = family_configs, mutant_configs, resolve
FAMILY_HOOKS.kills.update(
    {n: (f[1], REUSE_MUTANTS[n].also if n in REUSE_MUTANTS else frozenset()) for n, f in FAMILY_MUTANTS.items()}
)
