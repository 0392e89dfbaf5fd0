"""``python -m harness contract``: libllama's memory API against its own contract, on the five models.

A state machine (:mod:`properties.libllama_contract`) calls decode, ``llama_memory_seq_rm`` /
``seq_cp`` / ``seq_keep`` / ``seq_add`` and state get/set (full and partial) on several sequences,
unified and per-slot KV, ``swa_full`` off and on; whenever a call reports success, the next
decode's logits must equal a fresh evaluation of the history the call claims to leave. Violations
that are registered upstream findings are reported (each with a reproducer under
``fixtures/findings/``) and do not fail the run.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from fixtures.gguf import ARCHS
from harness.errors import EXIT_FAILED, EXIT_OK, UsageError
from harness.trees.api import loaded_libllama
from harness.trees.driver import libllama, libllama_of
from properties.contract_child import run_config_isolated
from properties.libllama_contract import run_contract, table

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--arch", nargs="+", metavar="NAME", help="models to run (default: all five)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--max-examples", type=int, default=150, help="examples per configuration (150)")
    parser.add_argument("--steps", type=int, default=50, help="steps per example (50)")
    parser.add_argument("--json", metavar="PATH", help="write the report as JSON")
    parser.add_argument("--source", metavar="DIR", type=Path,
                        help="run on this llama.cpp tree's own libllama (built, cached, bound from its llama.h)")


def run(args: argparse.Namespace) -> int:
    archs = list(args.arch or ARCHS)
    bad = [a for a in archs if a not in ARCHS]
    if bad:
        raise UsageError(f"unknown --arch {', '.join(bad)}; choose from {', '.join(ARCHS)}")
    if args.max_examples < 1 or args.steps < 1:
        raise UsageError("--max-examples and --steps must be >= 1")
    lib = libllama_of(args.source, log=lambda m: print(m, file=sys.stderr)) if args.source else None
    if lib is not None:
        print(lib)
    print(f"driving {libllama().name}; each configuration in a child process (an abort is its failure)")
    rep = run_contract(archs, seed=args.seed, max_examples=args.max_examples, steps=args.steps,
                       runner=run_config_isolated)  # fmt: skip
    print(table(rep))
    for f in rep["findings"]:
        print(f"finding {f['name']}: {f['reproducer']} ({f['upstream']})")
    rep["libllama"] = str(loaded_libllama() or "")
    print(f"{'PASS' if rep['ok'] else 'FAIL'} in {rep['seconds']}s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(rep, fh, indent=1)
    return EXIT_OK if rep["ok"] else EXIT_FAILED
