"""The server backend's fuzz-campaign machines: the differential's configurations on the cached pinned build.

One machine per :func:`~harness.backends.llama_server.differential.server_configs` row, on the cached build of
the plan's semantics (``master``, or ``pr`` for ``shared``), 25 steps, batch 2. A campaign never builds:
without the build it refuses with one line (exit 2) before any work starts.
"""

from __future__ import annotations

from hypothesis.stateful import RuleBasedStateMachine

from harness.backends.base import MachineSpec, Plan
from harness.backends.llama_server.differential import MachineStats, ServerConfig, server_configs, server_machine
from harness.errors import UsageError
from harness.targets.llama_build import cached_binary

__all__ = ["campaign_machines", "campaign_models"]


def campaign_machines(plan: Plan, backend: str) -> list[MachineSpec]:
    flavour = "master" if plan.semantics == "master" else "pr"
    binary = cached_binary(flavour)
    if binary is None:
        raise UsageError(
            f"no llama-server build for --semantics {plan.semantics}: "
            f"run python -m harness build-server --semantics {plan.semantics} first"
        )
    out = []
    for cfg in server_configs():

        def make(cfg: ServerConfig = cfg) -> type[RuleBasedStateMachine]:
            cls: type[RuleBasedStateMachine] = server_machine(
                cfg, binary, plan.semantics, MachineStats(), None, f"build_server({flavour!r})"
            )
            return cls

        name = f"Server_{cfg.name.replace('-', '_')}"
        out.append(MachineSpec(name, backend, 25, 2, make, lambda: []))
    return out


def campaign_models() -> frozenset[str]:
    """The fixtures models the machines load (and every one may run a draft)."""
    return frozenset(c.arch for c in server_configs())
