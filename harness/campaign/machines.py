"""Every state machine a campaign runs, by name, and the check that its backends can run here.

A :class:`Plan` says what a campaign covers (backends, semantics, a mutant, archs, targeting);
:func:`machines` lists its :class:`MachineSpec` rows, the same list in the parent and in every worker
(each worker rebuilds it from the plan and runs the names it was given). A spec builds its
Hypothesis machine class lazily, in the process that runs it, once.

Which machines a backend has is the backend's own word: :meth:`~harness.backends.base.Backend.campaign_machines`
and :meth:`~harness.backends.base.Backend.campaign_models` of each backend in
:data:`harness.backends.BACKENDS` (its module's docstring says what they are: steps, batch). This module only
asks the selected backends, in the plan's order, and filters by ``--machine``. :class:`Plan` and
:class:`MachineSpec` live in :mod:`harness.backends.base`, beside the backends that make them.

``batch`` is the number of examples a worker asks of one run before it moves on to its next
machine (adapted to about :data:`RUN_SECONDS` per run). :func:`check_ready` refuses, with one line
and exit 2, a backend whose build or models are missing, before any work starts.
"""

from __future__ import annotations

import fnmatch

from fixtures.gguf import ARCHS, draft_path, model_path
from harness.backends import BACKENDS
from harness.backends.base import MachineSpec, Plan
from harness.errors import UsageError
from properties.families import all_mutants

__all__ = ["RUN_SECONDS", "MachineSpec", "Plan", "check_ready", "machines"]

RUN_SECONDS = 3.0  # a worker's runs aim at this length: the view and Ctrl-C stay responsive


def _backend(name: str) -> str:
    if name not in BACKENDS:
        raise UsageError(f"unknown backend {name!r}; choose from {', '.join(BACKENDS)}")
    return name


def machines(plan: Plan) -> list[MachineSpec]:
    """Every machine of ``plan``, in a stable order."""
    out: list[MachineSpec] = []
    for b in plan.backends:
        specs = BACKENDS[_backend(b)].campaign_machines(plan)
        if not specs:
            raise UsageError(f"the {b} backend has no campaign machines")
        out += specs
    if plan.only is not None:
        out = [s for s in out if any(fnmatch.fnmatchcase(s.name, p) for p in plan.only)]
        if not out:
            raise UsageError(f"no machine matches --machine {' '.join(plan.only)}")
    return out


def check_ready(plan: Plan) -> None:
    """Refuse (one line, exit 2) what cannot run here: a build or a model missing, a bad mutant or arch."""
    if plan.mutant is not None:
        if plan.mutant not in all_mutants():
            raise UsageError(f"unknown mutant {plan.mutant!r}; see python -m harness mutants --list")
        if "synthetic" not in plan.backends:
            raise UsageError("--mutant runs the synthetic machines; add --backend synthetic")
    bad = [a for a in plan.archs or () if a not in ARCHS]
    if bad:
        raise UsageError(f"unknown --arch {', '.join(bad)}; choose from {', '.join(ARCHS)}")
    if plan.archs is not None and "llama" not in plan.backends:
        raise UsageError("--arch applies to the llama backend; add --backend llama")
    # the machines first: an unknown backend, a build that is not cached, a --machine that matches
    # nothing are refused before any model is made
    machines(plan)
    models: set[str] = set()
    draft = False
    for b in plan.backends:
        archs, needs_draft = BACKENDS[b].campaign_models(plan)
        models |= archs
        draft = draft or needs_draft
    for arch in sorted(models):
        model_path(arch)  # generated when missing; a cache that cannot be written is ModelLoadError (exit 2)
    if draft:
        draft_path()
