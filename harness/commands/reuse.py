"""``python -m harness reuse``: generated ``--cache-reuse`` and context-shift programs on a real llama-server.

``--examples`` Hypothesis-generated programs per model (seeded by ``--seed``;
:mod:`harness.load.reuse_programs`): each a server with ``--cache-reuse N`` and
``--context-shift`` sent a first prompt, then the conversation it holds with a piece of its middle deleted,
or a generation past ``n_ctx``; every ``timings.cache_n`` and context shift against the model, the answers
against a fresh server where no cell was moved (a greedy flip within the model's batch-shape bound is the
registered ``greedy-flip-on-cache-path``). One line of figures per model; a failure prints the shrunk program
(pasteable Python), the seed and the command line that replays it. ``--json PATH`` writes the figures.

Exit 0 when nothing mismatched, 1 on a mismatch, 2 on a usage error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from harness.commands.common import add_archs, add_server_options, archs_of, resolve_server
from harness.errors import EXIT_FAILED, EXIT_OK, UsageError
from harness.load.reuse_programs import ARCHS, command_line, run_model

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--examples", type=int, default=50, metavar="N", help="generated programs per model (50)")
    parser.add_argument("--seed", type=int, default=0, help="the programs' seed (0)")
    add_archs(parser, ARCHS, "the fixture models (the model can move transformer cells only)")
    add_server_options(parser, asan=False)
    parser.add_argument("--json", metavar="PATH", help="write the figures as JSON")


def run(args: argparse.Namespace) -> int:
    if not 1 <= args.examples <= 100_000:
        raise UsageError(f"--examples must be between 1 and 100000, got {args.examples}")
    archs = archs_of(args, ARCHS)
    binary = resolve_server(args).binary
    rows, failed = [], False
    for arch in archs:
        f = run_model(arch, binary, examples=args.examples, seed=args.seed)
        rows.append(f.to_json())
        found = ", ".join(f"{k} {v}" for k, v in sorted(f.findings.items())) or "none"
        print(f"  [{'FAIL' if f.failure else 'ok  '}] {arch:<7} {f.examples} programs, {f.requests} requests, "
              f"{f.chunks_moved} chunks moved ({f.tokens_reused_by_chunks} tokens), {f.shifts} context shifts; "
              f"{f.compared} outputs compared ({f.outputs_equal} equal, {f.moved_differs} differ after moved cells: "
              f"by design); findings: {found}")  # fmt: skip
        if f.failure is not None:
            failed = True
            print(f"FAIL {arch} seed {args.seed}: {f.failure.name}: {f.failure.message}\n"
                  f"  the shrunk program (paste into python from the repository root):\n{f.failure.program}\n"
                  f"  replay the run: {command_line((arch,), args.examples, args.seed)}", file=sys.stderr)  # fmt: skip
    if args.json:
        doc = {"command": "reuse", "examples": args.examples, "seed": args.seed, "models": rows}
        Path(args.json).write_text(json.dumps(doc, indent=1) + "\n")
    return EXIT_FAILED if failed else EXIT_OK
