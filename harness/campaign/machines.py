"""Every state machine a campaign runs, by name, and the check that its backends can run here.

A :class:`Plan` says what a campaign covers (backends, semantics, a mutant, archs, targeting);
:func:`machines` lists its :class:`MachineSpec` rows, the same list in the parent and in every worker
(each worker rebuilds it from the plan and runs the names it was given). A spec builds its
Hypothesis machine class lazily, in the process that runs it, once.

* ``synthetic``: the gate's ``fuzz`` profile (:func:`properties.run.machines_for`), 60 steps, batch 30;
* ``llama``: one per fixtures model (:func:`~harness.backends.libllama.llama_machines`), 40 steps, batch 5;
* ``llama-cpp-python-cache``: RAM and disk cache on each of its models, known findings modelled as
  upstream behaves (as the gate does once it has seen them), 20 steps, batch 5;
* ``server``: the differential's configurations on the cached build (never built here), 25 steps, batch 2.

``batch`` is the number of examples a worker asks of one run before it moves on to its next
machine (adapted to about :data:`RUN_SECONDS` per run). With ``mutant``, the synthetic machines run
on that mutant's semantics (its own machine first), so that a campaign can be seen to find a
planted bug. :func:`check_ready` refuses, with one line and exit 2, a backend whose build or
models are missing, before any work starts.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from hypothesis.stateful import RuleBasedStateMachine

from fixtures.models import ARCHS, draft_path, model_path
from harness.backends import BACKENDS
from harness.backends.lcp_cache import MACHINE_ARCHS
from harness.backends.libllama import llama_machines
from harness.backends.llama_server.differential import MachineStats, server_configs, server_machine
from harness.errors import UsageError
from harness.targets.lcp_cache import CACHES, CacheAdapter, ModelEnv
from harness.targets.llama_build import cached_binary
from properties import lcp_machine
from properties.machine import MachineConfig, machine_class
from properties.mutants import MUTANTS, config, resolve
from properties.run import machines_for, program_of

__all__ = ["RUN_SECONDS", "MachineSpec", "Plan", "check_ready", "machines"]

RUN_SECONDS = 3.0  # a worker's runs aim at this length: the view and Ctrl-C stay responsive


@dataclass(frozen=True)
class Plan:
    backends: tuple[str, ...] = ("synthetic",)
    semantics: str = "shared"
    mutant: str | None = None
    archs: tuple[str, ...] | None = None
    target: bool = True  # Hypothesis' target phase on (hypothesis.target() guidance)
    only: tuple[str, ...] | None = None  # fnmatch patterns of machine names

    def to_json(self) -> dict[str, Any]:
        return {
            "backends": list(self.backends),
            "semantics": self.semantics,
            "mutant": self.mutant,
            "archs": None if self.archs is None else list(self.archs),
            "target": self.target,
            "only": None if self.only is None else list(self.only),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> Plan:
        return cls(
            tuple(d["backends"]), d["semantics"], d["mutant"], None if d["archs"] is None else tuple(d["archs"]),
            d["target"], None if d.get("only") is None else tuple(d["only"]),
        )  # fmt: skip


@dataclass
class MachineSpec:
    """One machine of a campaign: ``name`` is its class name (the example database keys on it)."""

    name: str
    backend: str
    steps: int
    batch: int
    make: Callable[[], type[RuleBasedStateMachine]]
    header: Callable[[], list[str]]  # the lines that make the class, above a printed program
    _cls: type[RuleBasedStateMachine] | None = field(default=None, repr=False)

    def cls(self) -> type[RuleBasedStateMachine]:
        if self._cls is None:
            self._cls = self.make()
        return self._cls

    def program(self, notes: list[str]) -> str:
        lines = [n for n in notes if n.startswith("state")]
        return "\n".join(self.header() + lines)


def _model_spec(cfg: MachineConfig, backend: str, steps: int, batch: int) -> MachineSpec:
    return MachineSpec(
        cfg.class_name,
        backend,
        steps,
        batch,
        lambda: machine_class(cfg),
        lambda: program_of(cfg, [])[0].splitlines(),
    )


def _synthetic(plan: Plan) -> list[MachineSpec]:
    if plan.mutant is None:
        configs = machines_for(plan.semantics, "fuzz")
    else:
        configs = [config(plan.mutant)] + [
            replace(c, semantics=plan.mutant, resolve=resolve) for c in machines_for("shared", "fuzz")
        ]
    out: list[MachineSpec] = []
    for c in configs:
        if c.class_name not in {s.name for s in out}:
            out.append(_model_spec(c, "synthetic", 60, 30))
    return out


def _llama(plan: Plan) -> list[MachineSpec]:
    return [_model_spec(c, "llama", 40, 5) for c in llama_machines(plan.semantics, plan.archs)]


def _lcp_spec(cache: str, arch: str) -> MachineSpec:
    tolerate = frozenset(f.id for f in lcp_machine.KNOWN_LCP_FINDINGS if cache in f.scope)
    name = f"LcpCache_{cache}_{arch}"

    def make() -> type[RuleBasedStateMachine]:
        cls = lcp_machine.machine_class(ModelEnv(arch), CacheAdapter(cache), tolerate, lcp_machine.Stats())
        cls.__name__ = cls.__qualname__ = name  # the database key is made from it
        return cls

    def header() -> list[str]:
        return [
            "from harness.targets.lcp_cache import CacheAdapter, ModelEnv",
            "from properties import lcp_machine",
            f"{name} = lcp_machine.machine_class(ModelEnv({arch!r}), CacheAdapter({cache!r}), "
            f"frozenset({sorted(tolerate)!r}), lcp_machine.Stats())",
        ]

    return MachineSpec(name, "llama-cpp-python-cache", lcp_machine.STEPS, 5, make, header)


def _server(plan: Plan) -> list[MachineSpec]:
    flavour = "master" if plan.semantics == "master" else "pr"
    binary = cached_binary(flavour)
    if binary is None:
        raise UsageError(
            f"no llama-server build for --semantics {plan.semantics}: "
            f"run python -m harness build-server --semantics {plan.semantics} first"
        )
    out = []
    for cfg in server_configs():

        def make(cfg: Any = cfg) -> type[RuleBasedStateMachine]:
            cls: type[RuleBasedStateMachine] = server_machine(
                cfg, binary, plan.semantics, MachineStats(), None, f"build_server({flavour!r})"
            )
            return cls

        name = f"Server_{cfg.name.replace('-', '_')}"
        out.append(MachineSpec(name, "server", 25, 2, make, lambda: []))
    return out


def machines(plan: Plan) -> list[MachineSpec]:
    """Every machine of ``plan``, in a stable order."""
    out: list[MachineSpec] = []
    for b in plan.backends:
        if b == "synthetic":
            out += _synthetic(plan)
        elif b == "llama":
            out += _llama(plan)
        elif b == "llama-cpp-python-cache":
            out += [_lcp_spec(cache, arch) for cache in CACHES for arch in MACHINE_ARCHS]
        elif b == "server":
            out += _server(plan)
        else:
            raise UsageError(f"unknown backend {b!r}; choose from {', '.join(BACKENDS)}")
    if plan.only is not None:
        out = [s for s in out if any(fnmatch.fnmatchcase(s.name, p) for p in plan.only)]
        if not out:
            raise UsageError(f"no machine matches --machine {' '.join(plan.only)}")
    return out


def check_ready(plan: Plan) -> None:
    """Refuse (one line, exit 2) what cannot run here: a build or a model missing, a bad mutant or arch."""
    if plan.mutant is not None:
        if plan.mutant not in MUTANTS:
            raise UsageError(f"unknown mutant {plan.mutant!r}; see python -m harness mutants --list")
        if "synthetic" not in plan.backends:
            raise UsageError("--mutant runs the synthetic machines; add --backend synthetic")
    bad = [a for a in plan.archs or () if a not in ARCHS]
    if bad:
        raise UsageError(f"unknown --arch {', '.join(bad)}; choose from {', '.join(ARCHS)}")
    if plan.archs is not None and "llama" not in plan.backends:
        raise UsageError("--arch applies to the llama backend; add --backend llama")
    if "server" in plan.backends:
        _server(plan)  # its build must be cached: checked before models are made
    models = set()
    if "llama" in plan.backends:
        models |= set(plan.archs or ARCHS)
    if "llama-cpp-python-cache" in plan.backends:
        models |= set(MACHINE_ARCHS)
    if "server" in plan.backends:
        models |= {c.arch for c in server_configs()}
    for arch in sorted(models):
        model_path(arch)  # generated when missing; a cache that cannot be written is ModelLoadError (exit 2)
    if "llama" in plan.backends or "server" in plan.backends:
        draft_path()
    machines(plan)  # an unknown backend, a --machine that matches nothing
