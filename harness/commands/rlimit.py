"""``python -m harness rlimit``: the seed's save under a real address-space limit, both semantics.

The runner is :mod:`faults.rlimit`: a budget is measured just above what ``shared`` needs, and the
same save runs in a child under ``RLIMIT_AS`` in both semantics: shared must complete, master must
fail in the checkpoint deep copy.
"""

from __future__ import annotations

import argparse
import json
import sys

from faults.kinds import Outcome
from faults.rlimit import run_seed
from harness.errors import EXIT_CRASH, EXIT_FAILED, EXIT_OK, EXIT_USAGE, UsageError

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--json", metavar="PATH", help="write the budget and both outcomes as JSON")
    parser.add_argument("--ckpt-mib", type=int, default=40, help="checkpoint (recurrent state) size in MiB (40)")


def run(args: argparse.Namespace) -> int:
    if args.ckpt_mib < 2:
        raise UsageError("--ckpt-mib must be at least 2")
    seed = run_seed(args.ckpt_mib)
    p = seed.probes[0]
    print(
        f"seed scenario: hybrid slot, 1 checkpoint of C = {p.checkpoint_bytes} bytes, new state S = {p.state_bytes} "
        f"bytes; entry S + C = {p.state_bytes + p.checkpoint_bytes} <= --cache-ram {p.cache_ram_bytes}"
    )
    print("unlimited probe (peak of the save above its baseline):")
    for r in seed.probes:
        print(f"  {r.semantics:<7} {r.outcome:<10} peak +{r.peak_excess:>11} bytes  {r.detail}")
    if not seed.budget_bytes:
        print(f"error: a probe did not complete: {seed.results[0].detail}", file=sys.stderr)
        return EXIT_CRASH if seed.results[0].outcome in (Outcome.ABORTED, Outcome.KILLED) else EXIT_USAGE
    print(f"budget: RLIMIT_AS = baseline + {seed.budget_bytes} bytes (shared's peak + a quarter of the gap)")
    for r in seed.results:
        print(
            f"  {r.semantics:<7} {r.outcome:<12} VmPeak {r.peak_bytes} (+{r.peak_excess}), limit {r.limit_bytes}: "
            f"{r.detail}"
        )
    code = seed.exit_code()
    verdict = {
        EXIT_OK: "shared completes and master fails under the same budget",
        EXIT_FAILED: "NOT shown: expected shared to complete and master to fail",
        EXIT_CRASH: "a child died unexpectedly",
    }[code]
    print(verdict)
    if args.json:
        try:
            with open(args.json, "w") as f:
                json.dump(seed.to_json(), f, indent=2)
                f.write("\n")
        except OSError as e:
            raise UsageError(f"cannot write {args.json}: {e.strerror}") from None
    return code
