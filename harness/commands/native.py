"""``python -m harness native``: native malloc failures inside libllama, one forked child per allocation.

The runner is :mod:`faults.llama_native`: allocation 1, 2, ... inside one ``get``/``get-part``/
``set``/``decode`` call of a tiny model fails until the call completes; ``--case ARCH.OP.NTH``
replays one trial. Exit 1 when an outcome is a finding (an abort, a crash or a silent wrong
result), 0 when every allocation failure was handled.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from faults.llama_native import OPS, _first_frames, sweep_llama_native
from fixtures.gguf import ARCHS
from harness.errors import UsageError
from harness.trees.driver import libllama_of

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--case", help="replay one trial: ARCH.OP.NTH (e.g. lfm2.set.7)")
    parser.add_argument("--arch", default="llama", choices=ARCHS)
    parser.add_argument("--op", default="set", choices=OPS)
    parser.add_argument("--max-nth", type=int, default=3000)
    parser.add_argument("--source", metavar="DIR", type=Path,
                        help="run on this llama.cpp tree's own libllama (built, cached, bound from its llama.h)")


def run(args: argparse.Namespace) -> int:
    if args.source is not None:
        print(libllama_of(args.source, log=lambda m: print(m, file=sys.stderr)))
    if args.case:
        try:
            arch, op, n = args.case.rsplit(".", 2)
            nth = int(n)
        except ValueError:
            raise UsageError(f"--case must look like ARCH.OP.NTH, got {args.case!r}") from None
        if arch not in ARCHS or op not in OPS:
            raise UsageError(f"--case {args.case!r}: ARCH is one of {', '.join(ARCHS)}, OP one of {', '.join(OPS)}")
        rep = sweep_llama_native(arch, op, first=nth, max_nth=nth)
    else:
        rep = sweep_llama_native(args.arch, args.op, max_nth=args.max_nth)
    for t in rep.trials:
        where = f"  (allocation failed at {t.alloc_site})" if t.alloc_site not in ("", "-") else ""
        print(f"{t.case:<24} {t.outcome:<12} {t.detail}{where}")
        if t.stacks:
            print("    " + _first_frames(t.stacks, 20).replace("\n", "\n    "))
    print(json.dumps(rep.to_json()))
    return 1 if rep.findings else 0
