"""prompt-cache-harness: a reference model of llama-server's prompt cache, real targets, properties,
fault injectors and the gate that runs them on every backend.

The house, from the ground floor up: :data:`FLOORS` below is the one table of its floors (the
architecture test ``tests/test_architecture.py`` reads it, and checks that ``docs/map.md`` draws the
same floors in the same order). A module may import only from its own floor or below; the test reads
every import and fails on an upward import, an import of the project hidden inside a function, or a
loop. Two rules of a floor's own:

- a target never imports another target (:data:`APART`: the modules of ``harness.targets`` import
  nothing of one another);
- the trees (``harness.trees``: llama.cpp checkouts and their builds) import only the ground floor,
  the model's value types and other trees: the targets run what the trees build, never the reverse.

This module holds the table and nothing else; nothing of the project imports it.
"""

from __future__ import annotations

__all__ = ["APART", "FLOORS", "Floor"]

#: one floor: its name, the packages and modules on it (a dotted prefix each), what they are
Floor = tuple[str, tuple[str, ...], str]

#: the floors, bottom first; floor n of ``docs/map.md`` is ``FLOORS[n - 1]``
FLOORS: tuple[Floor, ...] = (
    (
        "ground",
        ("harness.errors", "harness.findings", "harness.interrupt", "harness.child", "harness.memlimit", "fixtures"),
        "the error root and exit codes, the registry of known findings, Ctrl-C, the one child-process helper, "
        "a child's memory limit, the generated inputs (gguf files)",
    ),
    ("model", ("harness.model",), "the reference model of llama-server's prompt cache, slots and checkpoints"),
    ("trees", ("harness.trees",), "llama.cpp trees and their builds: a checkout to a llama-server binary"),
    ("targets", ("harness.targets",), "one adapter per target: synthetic, libllama, lcp_cache, llama_server"),
    ("properties", ("properties",), "the properties, policy checks and Hypothesis state machines"),
    ("faults", ("faults",), "fault kinds, the one Outcome vocabulary, the injectors"),
    ("trace", ("harness.trace",), "the libllama call tracer: the interposer, its replay and shrink"),
    ("backends", ("harness.backends",), "one gate runner per backend, in harness.backends.BACKENDS"),
    ("experiments", ("harness.experiments",), "the server experiments beside the gate: slot files, reuse"),
    (
        "work",
        ("harness.campaign", "harness.load", "harness.report", "harness.bench", "harness.coverage", "harness.history"),
        "work built on the backends: fuzz campaigns, load, the memory report, the bench, coverage, history",
    ),
    ("commands", ("harness.commands",), "one module per python -m harness subcommand"),
    ("entry", ("harness.cli", "harness.__main__", "harness"), "the entry point; this table"),
    ("plugin", ("harness.pytest_plugin", "ci"), "the pytest plugin and CI's helpers: on top, nothing imports them"),
)

#: packages whose modules never import one another
APART: tuple[str, ...] = ("harness.targets",)
