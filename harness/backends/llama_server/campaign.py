"""The server backend's fuzz-campaign machines: the differential's configurations on the cached pinned build.

One machine per :func:`~harness.backends.llama_server.differential.server_configs` row, on the cached build of
the plan's semantics (``master``, or ``pr`` for ``shared``), 25 steps, batch 2. A campaign never builds:
without the build it refuses with one line (exit 2) before any work starts. ``PROMPT_CACHE_SERVER_BIN`` in the
environment names another binary of the same semantics instead (``python -m harness coverage --run fuzz`` runs
the coverage build so).
"""

from __future__ import annotations

import os
from pathlib import Path

from hypothesis.stateful import RuleBasedStateMachine

from harness.backends.base import MachineSpec, Plan
from harness.backends.llama_server.differential import MachineStats, server_configs, server_machine
from harness.errors import UsageError
from harness.targets.llama_server import ServerConfig
from harness.trees.build import cached_binary

__all__ = ["SERVER_BIN_ENV", "campaign_machines", "campaign_models"]

SERVER_BIN_ENV = "PROMPT_CACHE_SERVER_BIN"


def campaign_machines(plan: Plan, backend: str) -> list[MachineSpec]:
    named = os.environ.get(SERVER_BIN_ENV)
    binary = Path(named) if named else cached_binary(plan.semantics)
    expr = f"Path({named!r})" if named else f"build_server({plan.semantics!r})"
    if binary is None or not binary.is_file():
        raise UsageError(
            f"no llama-server build for --semantics {plan.semantics}: "
            f"run python -m harness build-server --semantics {plan.semantics} first"
        )
    out = []
    for cfg in server_configs():

        def make(cfg: ServerConfig = cfg) -> type[RuleBasedStateMachine]:
            cls: type[RuleBasedStateMachine] = server_machine(
                cfg, binary, plan.semantics, MachineStats(), None, expr
            )
            return cls

        name = f"Server_{cfg.name.replace('-', '_')}"
        out.append(MachineSpec(name, backend, 25, 2, make, lambda: []))
    return out


def campaign_models() -> frozenset[str]:
    """The fixtures models the machines load (and every one may run a draft)."""
    return frozenset(c.arch for c in server_configs())
